// tiled/tile_copies.hpp — copying one tile between a tile buffer and its region of a dense tensor, shared by the
// data paths (projection.cpp, scatter.cpp, backend.cpp). Internal to cpp/src/tiled.
#pragma once

#include <cstddef>
#include <memory>
#include <span>
#include <vector>

#include "strideweave/tensor.hpp"
#include "strideweave/tiled/data.hpp"
#include "internal.hpp"

namespace sw {

// Where the values of one source tile live for a given full tensor: for each logical within-tile ordinal, the
// within-tile ordinal of the carrier tile buffer holding it. Canonical tensors (offset 0, column-major) map identity.
struct TileAccess {
  const TileGeometry& geometry;
  const TensorImpl& t;
  bool canonical;

  TileAccess(const TiledEvictable& carrier, const TensorImpl& tensor)
      : geometry(carrier.geometry()), t(tensor), canonical(tensor.offset == 0 && tensor.layout.is_column_major()) {}

  // Within-buffer ordinal of logical within-tile ordinal `w` of source tile `index`: the tensor's logical ordinal
  // of that value is its canonical slot.
  int64_t physical_within(int64_t index, int64_t w) const {
    if (canonical) return w;
    return geometry.locate(t.offset + t.layout.flat().index(geometry.slot(index, w))).second;
  }
};

// Copies source tile `index` (`buffer`, or an implicit zero when null) into the region of `dest` that starts at
// `base`, a dense tensor with column-major `dstride`; `region` is TileGeometry::region_runs(dstride).
void gather_tile(const TiledEvictable& c, const TileAccess& access, int64_t index, const CarrierPtr& buffer,
                 Carrier& dest, int64_t base, std::span<const int64_t> dstride, std::span<const Run> region);

// The inverse: a fresh tile buffer for source tile `index` holding the region of `compact` (column-major strides
// `cstride`, runs `region`) that starts at `base`, plus `existing` values for "add" (null means zero).
CarrierPtr scatter_tile(const TiledEvictable& c, const TileAccess& access, int64_t index, const TensorImpl& compact,
                        int64_t base, std::span<const int64_t> cstride, std::span<const Run> region,
                        const CarrierPtr& existing, bool add);

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
CompletionPtr<TensorPtr> project_for(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& tensor,
                                     const TileSelection& sel, const CarrierPtr& destination, const char* purpose);

}  // namespace sw
