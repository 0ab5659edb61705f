// tiled/tile_copies.hpp — copying one tile between a tile buffer and its region of a dense tensor, shared by the
// data paths (projection.cpp, scatter.cpp, backend.cpp). Internal to cpp/src/tiled.
#pragma once

#include <cstddef>
#include <memory>
#include <optional>
#include <span>
#include <vector>

#include "strideweave/tensor.hpp"
#include "strideweave/tiled/data.hpp"
#include "internal.hpp"

namespace sw {

// Where the values of one source tile live for a given full tensor: for each logical within-tile ordinal, the
// within-tile ordinal of the carrier tile buffer holding it. Canonical tensors (offset 0, column-major) map identity.
//
// Note [Within-tile layouts]: a full tensor whose layout splits, mode by mode, into a within-tile part and a tile
// part (each mode's leaves, first fastest, reach the tile extent exactly, a leaf split where needed), and whose
// within-tile leaves each step along one digit of the carrier's slot space without carrying into the next (the
// digits are the slot axes, an axis that tiles span whole merged with the next: a tile's footprint is contiguous
// across them), maps every tile the same way: `within`, a layout over the tile's logical within-tile ordinal with buffer strides
// (uniform). A valid footprint (TileGeometry::check_footprints) starts every tile's logical region at the tile's
// first slot (strides are >= 0 and the region covers the footprint exactly), so no per-tile offset remains.
// PyTorch's row-major (out, in) tiles are such a tensor: within strides (in, 1). When every mode is at most one
// within-tile leaf and the buffer is dense in some order of the modes (`dense_permutation`, `mode_order` fastest
// first), a projection's compact tensor keeps that order (compact_strides): its tiles are then copied run by run
// (a row-major tile, one run per row; a one-tile projection, one run, or none when the tile is shared), a matmul
// reads it through BLAS's transposition flags, and a gradient in that layout goes back into tiles run by run. A
// tensor that is not uniform is read slot by slot (physical_within), as before.
//
// Note [Tile-major projections]: in column-major order a tile's values in the compact tensor are whole columns
// apart, so the expert-last projections of the guide ("Why expert last") gather each tile with one copy. In any
// other order the compact tensor, dense in that order over the whole selection, interleaves the tiles: two
// row-major (out, in) experts side by side, (out, 2 in), are 2 x out runs of `in` values, 1 KiB each for
// (512, 256) Float32 experts, against two runs of 512 KiB, and many small copies into an interleaved destination
// cost more than a few large ones (a copy loop alone: 1.4x the time on one thread, 1.8x on two, on the AMD EPYC
// of docs/performance.md). A projection asked to be tile-major (`tile_major`, compact_layout) keeps each selected
// tile's values together, in the tile's own order, tiles in column-major order of the selection: a mode that
// spans several tiles is the nested mode (tile extent, count) with strides (within-tile, between tiles), e.g.
// (out, (in, 2)) : (in, (1, out x in)) for the two experts, gathered with one copy per tile. Where that is
// already one dense mode (one tile on the axis, tiles stacked along the slowest within-tile mode, or column-major
// tiles) the layout is the dense one, so only the interleaved cases change. It combines with flat tensors of the
// same size (Note [Compatible shapes] in layout.hpp). It is not the default because a nested mode is no NumPy
// view (`np.asarray` copies it, `copy=False` refuses) and DLPack exports it only as a copy. A matmul runs over the
// nested mode block by block (Note [Products over nested modes] in cpp/src/ops/cpu_matmul.cpp), and gradients
// and scatters go back into the tiles run by run like any compact tensor (tile_region).
struct TileAccess {
  const TileGeometry& geometry;
  const TensorImpl& t;
  bool canonical;
  bool uniform = false;            // `within` holds for every tile
  FlatLayout within;               // leaves (modes in order, each mode's leaves first fastest) -> buffer ordinal
  std::vector<size_t> leaf_mode;   // the tile mode of each leaf of `within`
  std::vector<int64_t> leaf_scale; // the leaf's step in its mode's within-tile coordinate
  bool dense_permutation = false;  // the buffer is dense in `mode_order` (fastest first)
  std::vector<size_t> mode_order;

  TileAccess(const TiledEvictable& carrier, const TensorImpl& tensor);

  // Within-buffer ordinal of logical within-tile ordinal `w` of source tile `index`: the tensor's logical ordinal
  // of that value is its canonical slot.
  int64_t physical_within(int64_t index, int64_t w) const {
    if (uniform) return within.index(w);
    return geometry.locate(t.offset + t.layout.flat().index(geometry.slot(index, w))).second;
  }

  // The strides of a dense tensor of shape `cshape`: dense in the buffer's mode order when the buffer is a dense
  // permutation (column-major for a canonical tensor), column-major otherwise.
  std::vector<int64_t> compact_strides(std::span<const int64_t> cshape) const;

  // The layout of a projection's compact tensor of shape `cshape` over `counts` tiles per axis: compact_strides,
  // or tile-major (`tile_major` and tiles that are not column-major: Note [Tile-major projections]).
  Layout compact_layout(std::span<const int64_t> cshape, std::span<const int64_t> counts, bool tile_major) const;

  // Whether one tile's buffer holds a tensor of the tile's shape with `layout` at offset 0 in its own order: a
  // one-tile compact tensor in that layout is the buffer as is (shared by a projection, adopted by a gradient).
  bool buffer_order_is(const Layout& layout) const;

 private:
  bool derive_within();
};

// Per top-level mode, the stride of a layout whose every mode is one leaf (Layout::mode_as_leaf), or none.
std::optional<std::vector<int64_t>> mode_strides(const Layout& layout);

// Where compact tile `cc` lies in a tensor laid out by `layout` (relative to its offset): the offset of its first
// value and, per slot axis, the stride of its within-tile coordinate. Each mode is one leaf (a tile's region is
// `tile extent` consecutive coordinates) or the nested (tile extent, count) of a tile-major projection; none
// otherwise.
struct TileRegion {
  int64_t base = 0;
  std::vector<int64_t> strides;
};
std::optional<TileRegion> tile_region(const TileGeometry& g, const Layout& layout, const TileCoord& cc);

// The runs of one tile of a uniform access (Note [Within-tile layouts]) against a region with per-mode strides
// `rstride`: the leaves in buffer order, the leading ones contiguous on both sides merged into one run of `len`
// slots (a row-major tile in a row-major region: one run per row, or the whole tile); the other leaves (extent,
// buffer stride, region stride) are walked by an odometer. `total`: the tile's slots.
struct RunWalk {
  std::vector<int64_t> ext, bs, rs;
  int64_t len = 1, total = 0;
};
RunWalk run_walk(const TileAccess& access, std::span<const int64_t> rstride);

// Copies source tile `index` (`buffer`, or an implicit zero when null) into `region` (tile_region) of `dest`, a
// dense tensor at offset 0. With `pieces` > 1 (a uniform access only), piece `piece` of the tile's slots in run
// order: the pieces 0 .. pieces - 1 together copy the tile, and may run at once (Note [Gathering in the caller]).
// `walk`: run_walk(access, region.strides), when the caller derived it once for many pieces.
void gather_tile(const TiledEvictable& c, const TileAccess& access, int64_t index, const CarrierPtr& buffer,
                 Carrier& dest, const TileRegion& region, int64_t piece = 0, int64_t pieces = 1,
                 const RunWalk* walk = nullptr);

// The inverse: a fresh tile buffer for source tile `index` holding the region of `compact` at compact tile
// coordinate `cc`, plus `existing` values for "add" (null means zero).
CarrierPtr scatter_tile(const TiledEvictable& c, const TileAccess& access, int64_t index, const TensorImpl& compact,
                        const TileCoord& cc, const CarrierPtr& existing, bool add);

// Per axis, how many coordinates a selection names (the compact grid's extents).
std::vector<int64_t> counts_of(const TileSelection& sel);

// Whether a buffer's first `slots` slots are all (+0) zero bytes.
bool all_zero_bytes(const Carrier& buf, int64_t slots, std::vector<std::byte>& scratch);

// A fresh tiled gradient of `c`'s kind laid out like `primal` (a full tensor over `c`), holding `compact_grad`
// (the cotangent of a projection of `sel`) in the selected tiles and implicit zeros elsewhere
// (Note [Adopting a compact gradient]).
TensorPtr scatter_add_gradient(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& primal,
                               const TileSelection& sel, const TensorPtr& compact_grad);

// carrier.project with `purpose` told to the residency policy: "projection" for carrier.project, "operation" for a
// direct operation's operands, "backward" inside backward (projection.cpp).
// `tile_major`: Note [Tile-major projections].
CompletionPtr<TensorPtr> project_for(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& tensor,
                                     const TileSelection& sel, const CarrierPtr& destination, const char* purpose,
                                     bool tile_major = false);

}  // namespace sw
