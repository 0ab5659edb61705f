// strideweave/views.hpp — views with autograd: narrow, chunk, permute, reshape.
//
// A view is a tensor over the same carrier as its base, at another offset and
// layout: no slot is copied, and a write through either is seen by the other
// (they share the carrier, hence its version too). Only `reshape` may copy,
// and only when no layout over the base's slots has the requested shape in the
// base's ordinal order (Note [Reshape without a copy] in cpp/src/ops/views.cpp);
// `reshape_is_view` says beforehand which it will do.
//
// Modes are top-level modes; ordinals are first-mode-fastest (colex), so
// `reshape` keeps the colex order of the elements (NumPy's order="F").
//
// Autograd: with grad mode on and a differentiable base, each view records one
// node ("narrow", "chunk", "permute", "reshape") whose VJP maps the cotangent
// back: narrow and chunk place it in a zero gradient of the base's shape,
// permute applies the inverse order, reshape reshapes it back.
//
// Kinds whose operations take only whole tensors (a TiledEvictable: tile
// footprints must match) refuse every view other than the identity with
// TypeError naming the kind (project the tiles, then view the dense result).
//
// Errors (nothing is changed): a released carrier RuntimeError; a mode out of
// range, a start or end outside the mode IndexError; a length < 1, n < 1, an
// order that is not a permutation, a shape of another element count (or with
// more than one -1, an extent < -1 or 0, a -1 that does not divide) ValueError;
// a narrow of a nested mode whose range no layout expresses ValueError.
#pragma once

#include <cstdint>
#include <vector>

#include "strideweave/tensor.hpp"

namespace sw {

// Ordinals [start, start + length) of top-level mode `mode`.
TensorPtr narrow(const TensorPtr& t, int64_t mode, int64_t start, int64_t length);
// `mode` cut into pieces of ceil(extent / n) ordinals, the last possibly smaller; there are
// ceil(extent / ceil(extent / n)) of them, which is fewer than n when the pieces do not come out even
// (extent < n gives `extent` pieces of one ordinal), as torch.chunk.
std::vector<TensorPtr> chunk(const TensorPtr& t, int64_t n, int64_t mode);
// Top-level modes reordered: result mode i is input mode order[i] (nested modes travel whole).
TensorPtr permute(const TensorPtr& t, const std::vector<int64_t>& order);
// The elements in colex order under `shape` (nested shapes allowed): a view when the layout can express it,
// else a fresh dense (column-major) tensor of the same carrier kind and dtype.
TensorPtr reshape(const TensorPtr& t, const Shape& shape);
// Top-level extents, one of which may be -1 (inferred from the element count).
TensorPtr reshape(const TensorPtr& t, const std::vector<int64_t>& extents);
// Whether reshape(t, shape) is a view (the layout can express it); ValueError for another element count.
bool reshape_is_view(const TensorPtr& t, const Shape& shape);
// The extents with a -1 resolved against `size` (ValueError as reshape).
Shape infer_reshape_extents(const std::vector<int64_t>& extents, int64_t size);

}  // namespace sw
