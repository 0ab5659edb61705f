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
// types are parsed (a file may hold them) but have no StrideWeave dtype yet.
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

  const std::vector<std::string>& keys() const noexcept { return keys_; }  // sorted
  bool contains(const std::string& name) const { return where_.count(name) != 0; }
  // ValueError "... holds no tensor named '<name>'" for an unknown name.
  const TensorInfo& info(const std::string& name) const;
  const std::string& file_of(const std::string& name) const;
  // The tensor's StrideWeave dtype: TypeError naming the tensor and its element type when it has none.
  const DType& dtype(const std::string& name) const;
  const std::map<std::string, std::string>& metadata() const noexcept { return metadata_; }

  // The checkpoint tier over `names`, one range per name in the order given (slot order). The tensors must share
  // shape and dtype (ValueError naming the first that differs); `names` must be non-empty and distinct.
  std::shared_ptr<CheckpointCarrier> tier(const std::vector<std::string>& names, CheckpointCarrier::Writes writes);
  // The checkpoint tier over one tensor split along its first axis into `tiles` equal slabs (std::nullopt: shape[0]
  // slabs, one per index of that axis): range i covers rows [i R, (i + 1) R) of that axis (R = shape[0] / tiles),
  // contiguous in the file, in index order. ValueError for a tensor of rank 0 or with a first axis of extent 0, for
  // tiles < 1, and for a first extent `tiles` does not divide (naming the tensor, its first extent and tiles); no
  // file is opened then.
  std::shared_ptr<CheckpointCarrier> split_tier(const std::string& name, CheckpointCarrier::Writes writes,
                                                std::optional<int64_t> tiles = std::nullopt);
  // The shape of one slab of split_tier(name, writes, tiles), the tile shape of tiled_split: (R, *shape[1:]) for
  // slabs of R = shape[0] / tiles > 1 rows, shape[1:] for slabs of one row (one index of the first axis, the axis
  // dropped), so tiles == shape[0] is the default. The same errors as split_tier.
  std::vector<int64_t> split_shape(const std::string& name, std::optional<int64_t> tiles = std::nullopt) const;
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
                  CheckpointCarrier::Writes writes);
  // The same over split_tier(name, writes, tiles): shape (*split_shape(name, tiles), tiles), the same logical shape
  // as one tensor per slab: (*shape[1:], shape[0]) without `tiles`; (E I, H) with tiles = E gives (I, H, E), tile e
  // the rows [e I, (e + 1) I), as DBRX's fused experts are stored ((H, E) when I = 1).
  TensorPtr tiled_split(const std::string& name, CarrierPtr primary, std::shared_ptr<ResidencyPolicy> policy,
                        CheckpointCarrier::Writes writes, std::optional<int64_t> tiles = std::nullopt);

 private:
  Checkpoint() = default;
  void add_file(const std::string& path, const std::map<std::string, std::string>* expected);
  // The file of header `index`, opened once per mode; RuntimeError naming the file and `action` when it is no
  // longer the file whose header was read (Note [A checkpoint is the file it parsed] in checkpoint.cpp).
  std::shared_ptr<CheckpointFile> file(size_t index, bool writable, const char* action);

  std::vector<Header> headers_;
  std::vector<FileIdentity> identities_;  // per header: the file it was read from
  std::vector<std::shared_ptr<CheckpointFile>> readers_, writers_;  // per header; writers opened on demand
  std::map<std::string, size_t> where_;                             // name -> header
  std::vector<std::string> keys_;
  std::map<std::string, std::string> metadata_;
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
void save(const std::string& path, const std::vector<std::pair<std::string, TensorPtr>>& tensors,
          const std::map<std::string, std::string>& metadata);

// Moves the finished folder `temp` (beside `target`, same file system) to `target` atomically: a new target by a
// rename that refuses to replace, an existing target folder by exchanging the two and removing the old one
// (Note [Replacing a folder whole] in save.cpp). ValueError when `target` exists and is not a folder,
// RuntimeError for a failed rename (`target` left as it was).
void install_folder(const std::string& temp, const std::string& target);
// Removes the folders ".<name of target>.tmp-<pid>-<n>" beside `target` left by writers that are gone.
void remove_stale_folders(const std::string& target);

}  // namespace sw::safetensors
