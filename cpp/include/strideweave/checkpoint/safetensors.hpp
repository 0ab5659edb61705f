// strideweave/checkpoint/safetensors.hpp — the safetensors file format: what a
// file holds (its header), validated in full before any tensor byte is read,
// and the writing of a header.
//
// A safetensors file is: an 8-byte little-endian header length N, N bytes of
// JSON (an object: "__metadata__" -> {str: str}, and per tensor
// {"dtype": "BF16", "shape": [..], "data_offsets": [begin, end]}, offsets
// relative to the data area that starts at 8 + N), then the data area.
// Tensors are C-contiguous (row-major) in little-endian element order.
//
// Note [A header is checked before any read]: opening a checkpoint reads the
// 8-byte length and the header, and nothing else, until every rule below
// holds; a broken rule raises ValueError naming the file (and the tensor) and
// leaves nothing mapped or open:
//  * the file holds at least 8 bytes, and 8 + N <= file size (N <= 100 MiB,
//    the bound the reference implementation uses);
//  * the header is well-formed JSON (parsed by nlohmann::json), an object,
//    nesting at most 128 levels, with no key twice in one object (Note [A
//    header is parsed in linear time and bounded depth] in safetensors.cpp);
//  * "__metadata__", when present, maps strings to strings;
//  * every tensor entry is an object with exactly a known "dtype", a "shape"
//    of non-negative integers and "data_offsets" [begin, end], begin <= end;
//  * product(shape) * itemsize == end - begin, computed without overflow;
//  * end <= the data area's size, and no two tensors' ranges overlap.
//
// Thread-safety: every function here is a pure function of its arguments (and
// of the file's bytes); they may be called from any thread.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "strideweave/carriers/checkpoint.hpp"
#include "strideweave/dtype.hpp"
#include "strideweave/tensor.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace sw::safetensors {

// The element type names of the format, with their sizes in bytes. Float8
// types are parsed (a file may hold them) and have no StrideWeave dtype: F8_E4M3
// with its scales is a quantized tensor (Note [Quantized tensors of a checkpoint]),
// F8_E8M0 a scale.
struct ElementType {
  std::string_view name;  // as the header spells it: "BF16", "F32", ...
  int64_t itemsize;
};
// The element type named `name`, or nullptr when the format has no such type.
const ElementType* element_type(std::string_view name);

struct TensorInfo {
  std::string name;
  std::string dtype;            // the header's spelling ("BF16")
  int64_t itemsize = 0;
  std::vector<int64_t> shape;   // row-major: the last axis varies fastest
  uint64_t begin = 0;           // absolute byte offsets in the file
  uint64_t end = 0;
  int64_t elements() const;
};

struct Header {
  std::string path;
  uint64_t file_size = 0;
  uint64_t data_start = 0;  // 8 + N
  std::map<std::string, std::string> metadata;
  std::vector<TensorInfo> tensors;  // sorted by name
  // The tensor named `name` (ValueError naming the file when absent).
  const TensorInfo& tensor(const std::string& name) const;
  const TensorInfo* find(const std::string& name) const;
};

// Largest header the parser accepts, as the reference implementation (100 MiB).
inline constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;

// Reads and validates the header of the file at `path` (Note [A header is
// checked before any read]). ValueError for a malformed file, RuntimeError
// when the file cannot be opened or read.
Header read_header(const std::string& path);
// The same rules over bytes already read: `prefix` holds at least the first
// min(file_size, 8 + N) bytes of a file of `file_size` bytes named `path`.
Header parse_header(std::string_view prefix, uint64_t file_size, const std::string& path);

// A sharded checkpoint's index (model.safetensors.index.json): tensor name ->
// file name (relative to the index's folder). ValueError names the index.
std::map<std::string, std::string> read_index(const std::string& path);

// The bytes of a header (length prefix, JSON, padding with spaces to a
// multiple of 8 bytes, as the reference implementation writes) for tensors
// laid out in the order given, each starting where the previous one ends.
// Returns the header bytes; `offsets` receives each tensor's [begin, end)
// relative to the data area. ValueError for an unknown dtype or a duplicate
// or reserved name.
struct TensorSpec {
  std::string name;
  std::string dtype;
  std::vector<int64_t> shape;
};
std::string encode_header(const std::vector<TensorSpec>& tensors, const std::map<std::string, std::string>& metadata,
                          std::vector<std::pair<uint64_t, uint64_t>>& offsets);

}  // namespace sw::safetensors

// ---------------------------------------------------------------- checkpoints

namespace sw::safetensors {

// The StrideWeave dtype of a safetensors element type, or nullptr when there is none.
const DType* dtype_of(std::string_view element_type);

// Note [Quantized tensors of a checkpoint]: how a checkpoint's quantized tensors are recognised (their elements'
// formats: Note [Quantized element formats] in strideweave/checkpoint/quantized.hpp).
//  * FP8 block-scaled: a tensor of element type F8_E4M3, rank >= 2, (..., R, C), whose scale tensor is, unless
//    named explicitly, "<prefix>.weight_scale_inv" (then "<prefix>.weight_scale") for a name "<prefix>.weight",
//    else name + "_scale_inv" (then name + "_scale"): DeepSeek-V3's, Qwen3's and transformers' names. The scale
//    is F32, BF16 or F8_E8M0, of shape (..., ceil(R / br), ceil(C / bc)) for the block (br, bc): (128, 128) unless
//    given, or, where the scale's shape is not that but divides R and C exactly, (R / sr, C / sc) (transformers'
//    rule, which covers one scale per tensor, shape (1, 1)).
//  * MXFP4 (GPT-OSS): "X_blocks" (U8, shape (..., G, 16): 32 e2m1 values in 16 bytes per group) and "X_scales"
//    (U8 or F8_E8M0, shape (..., G)), named "X_blocks" or "X" (the parameter's name, which no tensor has); the
//    values are (..., 32 G).
// A file's metadata may record a block the shape rule would not find: "fp8_block_size:<scale name>" -> "[br, bc]"
// (save(quantize=) writes it for such blocks); a block given to tiled() wins over both, and a checkpoint's block
// (Checkpoint::set_fp8_block, from a model's quantization_config) comes after the metadata, for scales it fits.
// Every rule is checked from the headers (no byte read): a scale missing, of the wrong shape or element type,
// or blocks whose count does not match their scales raise ValueError naming the tensor and its file. A tier over
// quantized tensors also reads every scale it will use once, when it is made, and refuses NaN (and infinite)
// scales and the e8m0 NaN code 255 the same way: nothing is made then.
inline constexpr std::string_view kFp8BlockKey = "fp8_block_size:";
// The block the shape rule infers for an FP8 matrix (R, C) with a scale grid (sr, sc): (128, 128) where the grid is
// (ceil(R / 128), ceil(C / 128)), else (R / sr, C / sc) where that divides exactly, else (0, 0) (none).
std::pair<int64_t, int64_t> fp8_block_by_shape(int64_t rows, int64_t cols, int64_t scale_rows, int64_t scale_cols);
struct Quantization {
  QuantizedRange::Format format = QuantizedRange::Format::FP8;
  std::string data;         // the quantized elements' tensor ("X.weight", "X_blocks")
  std::string scale;        // the scales' tensor
  std::string scale_dtype;  // its element type: "F32", "BF16", "F8_E8M0", "U8"
  int64_t block_rows = 1, block_cols = 32;
  std::vector<int64_t> shape;  // the dequantized values' shape
  bool operator==(const Quantization&) const = default;
};
// Options of a tier over a checkpoint's tensors: `dtype` the values' dtype (nullptr: the tensors' own; required,
// BFloat16 or Float32, for quantized tensors); `scales` explicit scale tensor names (empty: by naming), one per
// name; `block` FP8's block (br, bc) (0: inferred).
struct TierOptions {
  const DType* dtype = nullptr;
  std::vector<std::string> scales;
  int64_t block_rows = 0, block_cols = 0;
};

// Note [Opening a checkpoint]: a checkpoint is one safetensors file, several
// (listed), or a folder: the folder's model.safetensors.index.json names the
// file of every tensor (a sharded checkpoint), or, without an index, the
// folder's *.safetensors files are taken in name order. Every header is read
// and validated when the checkpoint is opened (Note [A header is checked before
// any read]); a name held by two files, or an index naming a tensor its file
// does not hold, is a ValueError. No tensor byte is read until a tile is
// promoted or a tensor is read. Files are opened read-only; a writable
// descriptor is opened only for a tier asked to write in place. A checkpoint
// is the files it parsed: tensor() and tiled() over a file that another save
// replaced, or that changed since, raise RuntimeError naming it (Note [A
// checkpoint is the file it parsed] in checkpoint.cpp).
class Checkpoint {
 public:
  // ValueError (naming the path) for a malformed file, index or folder; RuntimeError for a file that cannot be
  // opened or read.
  static std::shared_ptr<Checkpoint> open(const std::vector<std::string>& paths);
  // The FP8 block of this checkpoint's quantized tensors (a model's quantization_config weight_block_size): taken
  // for a tensor whose scales' shape fits it, before the shape rule (Note [Quantized tensors of a checkpoint]).
  // ValueError for a block below 1 x 1.
  void set_fp8_block(int64_t rows, int64_t cols);

  const std::vector<std::string>& keys() const noexcept { return keys_; }  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // ValueError "... holds no tensor named '<name>'" for an unknown name.
  const TensorInfo& info(const std::string& name) const;
  const std::string& file_of(const std::string& name) const;
  // The tensor's StrideWeave dtype: TypeError naming the tensor and its element type when it has none (a quantized
  // tensor's says how to open it).
  const DType& dtype(const std::string& name) const;
  // How `name` is quantized (Note [Quantized tensors of a checkpoint]), or nullopt for a plain tensor. `scale`:
  // the scale tensor's name (empty: by naming); `block_rows`/`block_cols` FP8's block (0: inferred). ValueError
  // naming the tensor and its file for a scale missing, of the wrong shape or element type, or blocks whose count
  // does not match; ValueError "holds no tensor" for an unknown name.
  std::optional<Quantization> quantization(const std::string& name, const std::string& scale = {},
                                           int64_t block_rows = 0, int64_t block_cols = 0) const;
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }

  // The checkpoint tier over `names`, one range per name in the order given (slot order). The tensors must share
  // shape and dtype (ValueError naming the first that differs); `names` must be non-empty and distinct.
  // Quantized tensors (Note [Quantized tensors of a checkpoint]): `options.dtype` (BFloat16 or Float32) is required
  // (TypeError without it), every name must be quantized alike (format, shape), FP8 tensors listed by name must be
  // matrices, and writes must be Overlay (ValueError); their scales are read and checked (NaN: ValueError naming
  // the tensor and its file). Plain tensors: `options.dtype`, when given, must be theirs (TypeError).
  std::shared_ptr<CheckpointCarrier> tier(const std::vector<std::string>& names, CheckpointCarrier::Writes writes,
                                          const TierOptions& options = {});
  // The checkpoint tier over one tensor split along its first axis into `tiles` equal slabs (std::nullopt: shape[0]
  // slabs, one per index of that axis): range i covers rows [i R, (i + 1) R) of that axis (R = shape[0] / tiles),
  // contiguous in the file, in index order. ValueError for a tensor of rank 0 or with a first axis of extent 0, for
  // tiles < 1, and for a first extent `tiles` does not divide (naming the tensor, its first extent and tiles); no
  // file is opened then.
  // A quantized tensor is split into shape[0] slabs (tiles, when given, must be that): FP8 (E, R, C) into E
  // matrices, MXFP4 (E, ..., G, 16) into E slabs; the same options and errors as tier.
  std::shared_ptr<CheckpointCarrier> split_tier(const std::string& name, CheckpointCarrier::Writes writes,
                                                std::optional<int64_t> tiles = std::nullopt,
                                                const TierOptions& options = {});
  // The shape of one slab of split_tier(name, writes, tiles), the tile shape of tiled_split: (R, *shape[1:]) for
  // slabs of R = shape[0] / tiles > 1 rows, shape[1:] for slabs of one row (one index of the first axis, the axis
  // dropped), so tiles == shape[0] is the default. The same errors as split_tier.
  std::vector<int64_t> split_shape(const std::string& name, std::optional<int64_t> tiles = std::nullopt,
                                   const TierOptions& options = {}) const;
  // Bytes read from the checkpoint's files so far (all tiers over it).
  uint64_t bytes_read() const;

  // Note [A checkpoint's tensors]: a tensor of the file is a Tensor of its own shape with row-major strides over a
  // CheckpointCarrier of one range (Writes::Overlay: writes never reach the file), no copy. ValueError for an
  // unknown name or a tensor with an extent 0 (a Shape has no empty modes); TypeError for an element type without
  // a dtype.
  TensorPtr tensor(const std::string& name);
  // The full tensor of shape (*shape, tiles.size()) over a TiledEvictable whose secondary tier is tier(names,
  // writes) (tiled_layout); `primary` an empty carrier (nullptr: an empty allocatable CPU carrier).
  TensorPtr tiled(const std::vector<std::string>& names, CarrierPtr primary, std::shared_ptr<ResidencyPolicy> policy,
                  CheckpointCarrier::Writes writes, const TierOptions& options = {});
  // The same over split_tier(name, writes, tiles): shape (*split_shape(name, tiles), tiles), the same logical shape
  // as one tensor per slab: (*shape[1:], shape[0]) without `tiles`; (E I, H) with tiles = E gives (I, H, E), tile e
  // the rows [e I, (e + 1) I), as DBRX's fused experts are stored ((H, E) when I = 1).
  TensorPtr tiled_split(const std::string& name, CarrierPtr primary, std::shared_ptr<ResidencyPolicy> policy,
                        CheckpointCarrier::Writes writes, std::optional<int64_t> tiles = std::nullopt,
                     const TierOptions& options = {});

 private:
  Checkpoint() = default;
  void add_file(const std::string& path, const std::map<std::string, std::string>* expected);
  // The file of header `index`, opened once per mode; RuntimeError naming the file and `action` when it is no
  // longer the file whose header was read (Note [A checkpoint is the file it parsed] in checkpoint.cpp).
  std::shared_ptr<CheckpointFile> file(size_t index, bool writable, const char* action);
  // The quantized range of `q` for the slab `index` of `slabs` (the whole tensor: 0 of 1), its scales read and
  // checked (Note [Quantized tensors of a checkpoint]).
  CheckpointCarrier::Range quantized_range(const Quantization& q, int64_t index, int64_t slabs);
  // The quantized tier's checks common to tier and split_tier; returns the values' dtype.
  const DType& quantized_dtype(const Quantization& q, CheckpointCarrier::Writes writes, const TierOptions& options) const;

  std::vector<Header> headers_;
  std::vector<FileIdentity> identities_;  // per header: the file it was read from
  std::vector<std::shared_ptr<CheckpointFile>> readers_, writers_;  // per header; writers opened on demand
  std::map<std::string, size_t> where_;                             // name -> header
  std::vector<std::string> keys_;
  std::map<std::string, std::string> metadata_;
  int64_t fp8_block_rows_ = 0, fp8_block_cols_ = 0;  // set_fp8_block (0: none)
  mutable std::mutex mutex_;  // guards readers_ and writers_
};

// Note [A checkpoint's tiled tensor]: `tiles` tensors of one row-major shape s (rank r; PyTorch's (out, in)) as
// one full tensor of shape (*s, tiles), the last mode the tile index. The TiledEvictable's geometry is grid
// (1, .., 1, tiles) and tile (*s, 1): tile e covers slots [e T, (e + 1) T) (T = prod(s)), which the checkpoint tier
// maps to exactly the e-th tensor's bytes, so promoting a tile is one read of that range. The full tensor reads
// those slots row-major: strides (row-major strides of s, T). Its shape is the geometry's logical shape and each
// tile's coordinates reach only that tile's slots, so the footprint check (TileGeometry::check_footprints) takes
// it, and a TileSelection ((0,), .., (0,), (e1, e2, ..)) projects experts e1, e2, ...
struct TiledView {
  std::vector<int64_t> grid, tile;  // of the TiledEvictable
  Layout layout;                    // of the full tensor over it (offset 0)
};
// ValueError for tiles < 1 or an extent < 1.
TiledView tiled_view(const std::vector<int64_t>& shape, int64_t tiles);

// The safetensors element type of a StrideWeave dtype ("F32"); TypeError for one the format cannot hold.
std::string_view element_type_of(const DType& dtype);

// Note [Saving a checkpoint]: save writes `tensors` (name -> tensor, in the
// order given) to a safetensors file: each tensor as its top-level modes'
// extents, row-major over them (the last mode fastest; within a nested mode,
// the mode's own colex order), the format's order. Values are read through
// each tensor's layout in bounded chunks (a tiled tensor tile range by tile
// range; evicted tiles are read from their secondary tier without moving),
// never gathered whole. The file appears whole or not at all: it is written
// as an unnamed file in the same folder, synced, linked under a temporary name
// and renamed over `path` (and the folder synced); a save killed part-way
// leaves nothing (Note [A save leaves no temporary] in save.cpp). Each save has
// its own temporary file, so concurrent saves of one path each land whole.
// Every tensor's carrier is claimed while the save reads it: release() from
// another thread raises "wait". ValueError for an empty or repeated name, TypeError
// for a dtype the format cannot hold, RuntimeError for a released carrier or
// an I/O failure (the temporary file is removed; `path` is left as it was).
//
// Quantized saving: `quantize` maps names of `tensors` (BFloat16 or Float32) to a format; each such tensor is written
// quantized (Note [Quantized element formats] in strideweave/checkpoint/quantized.hpp, quantize_fp8 and
// quantize_mxfp4), one matrix (FP8) or chunk of groups (MXFP4) at a time as it is read, never gathered whole:
// FP8 (rank >= 2, (..., R, C)) as F8_E4M3 `name` and F32 scales (..., ceil(R / br), ceil(C / bc)) named by
// quantized_scale_name; MXFP4 (last extent a multiple of 32) as U8 "<name>_blocks" (..., C / 32, 16) and U8
// "<name>_scales" (..., C / 32). ValueError for a name not among `tensors`, a shape the format cannot hold, or a
// NaN value for MXFP4 (which has none; the file is not written); TypeError for another dtype.
struct SaveQuantization {
  QuantizedRange::Format format = QuantizedRange::Format::FP8;
  int64_t block_rows = 128, block_cols = 128;  // FP8
};
// The scale tensor a quantized save writes beside `name`: FP8 "<prefix>.weight_scale_inv" for "<prefix>.weight",
// else name + "_scale_inv"; MXFP4 name + "_scales" (its blocks: name + "_blocks").
std::string quantized_scale_name(const std::string& name, QuantizedRange::Format format);
void save(const std::string& path, const std::vector<std::pair<std::string, TensorPtr>>& tensors,
          const std::map<std::string, std::string>& metadata,
          const std::map<std::string, SaveQuantization>& quantize = {});

// Moves the finished folder `temp` (beside `target`, same file system) to `target` atomically: a new target by a
// rename that refuses to replace, an existing target folder by exchanging the two and removing the old one
// (Note [Replacing a folder whole] in save.cpp). ValueError when `target` exists and is not a folder,
// RuntimeError for a failed rename (`target` left as it was).
void install_folder(const std::string& temp, const std::string& target);
// Removes the folders ".<name of target>.tmp-<pid>-<n>" beside `target` left by writers that are gone.
void remove_stale_folders(const std::string& target);

}  // namespace sw::safetensors
