// strideweave/tiled/data.hpp — the data paths of TiledEvictable: projection
// (an asynchronous, autograd-visible gather of selected tiles into a compact
// dense tensor), scatter (its asynchronous counterpart into a fresh full-shaped
// TiledEvictable) and direct operations on full tiled tensors.
//
// Every entry point validates before work, then runs as one *work request*
// (TiledEvictable::begin_work): the required tiles are pinned, missing ones are
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

struct TileSelectionC {
  std::vector<std::vector<int64_t>> per_axis;
};

// Source tile indices in coordinates order (ValueError for rank or range).
std::vector<int64_t> bind_selection(const TiledEvictable& c, const TileSelectionC& sel);
// The compact logical shape of a selection: per axis, count * tile extent.
std::vector<int64_t> compact_shape(const TiledEvictable& c, const TileSelectionC& sel);

// carrier.project(tensor, selection, destination); `destination` may be null.
// Validation raises before work; the completion carries the compact tensor.
CompletionPtr<TensorPtr> project(const std::shared_ptr<TiledEvictable>& carrier, const TensorPtr& tensor,
                                 const TileSelectionC& selection, const CarrierPtr& destination);

// carrier.scatter(compact, template, selection, reduction).
CompletionPtr<TensorPtr> scatter(const std::shared_ptr<TiledEvictable>& carrier, const TensorPtr& compact,
                                 const TensorPtr& templ, const TileSelectionC& selection, bool add);

// Registers the operation backend of TiledEvictable (direct operations). Idempotent.
void install_tiled_backend();

}  // namespace sw
