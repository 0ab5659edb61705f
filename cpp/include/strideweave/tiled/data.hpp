// strideweave/tiled/data.hpp — the data paths of TiledEvictable: projection
// (an asynchronous, autograd-visible gather of selected tiles into a compact
// dense tensor), scatter (its asynchronous counterpart into a fresh full-shaped
// TiledEvictable) and direct operations on full tiled tensors.
//
// Every entry point validates before work, then runs as one *work request*
// (cpp/src/tiled/work.cpp): the required tiles are pinned, missing ones are
// promoted as part of the request, the policy is consulted with the request's
// purpose, and deferred evictions run when the request ends.
//
// Selections are bound to the grid as tile indices in selection.coordinates
// order (first axis fastest, each axis in the caller's order).
#pragma once

#include <memory>
#include <vector>

#include "strideweave/completion.hpp"
#include "strideweave/tensor.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace sw {

struct TileSelection {
  std::vector<std::vector<int64_t>> per_axis;
};

// Source tile indices in coordinates order (ValueError for rank or range).
std::vector<int64_t> bind_selection(const TiledEvictable& c, const TileSelection& sel);
// The compact logical shape of a selection: per axis, count * tile extent.
std::vector<int64_t> compact_shape(const TiledEvictable& c, const TileSelection& sel);

// carrier.project(tensor, selection, destination, tile_major); `destination` may be null.
// Validation raises before work; the completion carries the compact tensor: dense in the tiles' order, or with
// `tile_major`, each tile's values together (Note [Tile-major projections] in cpp/src/tiled/tile_copies.hpp).
// Blocks: calls the residency policy and takes the tile-table lock; the gathers run on the selection threads,
// or before it returns when every tile is readable and the copy is at most caller_gather_bytes() (Note [Gathering
// in the caller] in cpp/src/tiled/projection.cpp).
CompletionPtr<TensorPtr> project(const std::shared_ptr<TiledEvictable>& carrier, const TensorPtr& tensor,
                                 const TileSelection& selection, const CarrierPtr& destination,
                                 bool tile_major = false);

// The kernel that copies a tile's runs in gathers and scatters (Note [Copying runs] in
// cpp/src/tiled/tile_copies.cpp): "avx512f" (chosen at run time) or "portable". force_portable_run_copies makes
// every run a memcpy (tests check both paths; benchmarks compare them) and returns the previous setting.
const char* run_copy_path() noexcept;
bool force_portable_run_copies(bool portable) noexcept;

// The largest copy (bytes) a projection of readable tiles gathers before project returns (4 MiB); set_caller_gather
// changes it (0: every gather on the selection threads; tests of the asynchronous path) and returns the previous.
int64_t caller_gather_bytes() noexcept;
int64_t set_caller_gather_bytes(int64_t bytes) noexcept;

// carrier.scatter(compact, template, selection, reduction).
// Blocks: for "add", calls the residency policy and takes the tile-table lock; the copies run on the selection threads.
CompletionPtr<TensorPtr> scatter(const std::shared_ptr<TiledEvictable>& carrier, const TensorPtr& compact,
                                 const TensorPtr& templ, const TileSelection& selection, bool add);

// Note [Tiled gradient accumulation]
// A leaf backed by TiledEvictable (an expert weight in a file) receives one
// fresh tiled gradient per projection node: only the selected tiles hold
// values, the rest are implicit zeros. Summing such gradients densely would
// cost a full-extent pass (and full-size temporaries) per contribution, so:
//  * add_tiled_gradients sums two gradients tile by tile into a fresh carrier
//    (used when gradients meet inside one backward);
//  * autograd's leaf accumulation adds into the existing .grad in place
//    (accumulate_tiles, cpp/src/tiled/gradient_sums.cpp) when nothing but the leaf holds that
//    .grad tensor and its carrier, so nobody can observe the mutation; then
//    the cost is the tiles the new gradient touches. Otherwise it falls back to
//    a fresh sum, leaving any tensor the caller holds unchanged.
// Both hold the tiles they touch while they do (Note [Gradient sums hold their
// tiles]): a thread that takes a reference to the .grad after that check cannot
// move or release them under the sum.
// Neither consults the residency policy: they are part of the backward request
// that produced the gradient, and the policy (shared with the weight carrier
// through allocate_like) tracks the weight's tiles. Under a residency budget
// (Note [One residency budget]) both make room for the tiles they bring in.
// A 16-bit parameter's gradients are Float32 until they reach its .grad (Note
// [Tiled gradients of 16-bit parameters], cpp/src/tiled/gradient_dtypes.cpp).
//
// Tiled gradient sums (autograd): tile by tile, never through a dense full-size
// temporary. `a` and `b` are compatible when both are float tensors (Float32,
// BFloat16 or Float16; two 16-bit ones of one dtype) over distinct live
// TiledEvictables of one geometry, read with one offset and Layout that match
// the carriers' tile footprints.
// Blocks: takes each carrier's footprint cache lock briefly.
bool tiled_gradients_compatible(const TensorPtr& a, const TensorPtr& b);
// a + b as a fresh tiled gradient with a's carrier kind, geometry, offset and
// Layout (Float32 when either is, else their dtype: summed in Float32, rounded
// once); a tile implicit in both stays implicit. Reads evicted tiles from the
// secondary tier without changing the inputs' residency.
// Blocks: takes both carriers' tile-table locks and reads evicted tiles (I/O), in this thread.
TensorPtr add_tiled_gradients(const TensorPtr& a, const TensorPtr& b);

// Registers the operation backend of TiledEvictable (direct operations). Idempotent.
void install_tiled_backend();

}  // namespace sw
