// Internal: reading and writing tensors densely, in ordinal order (helpers.cpp), for the VJPs and helpers.
#pragma once

#include <vector>

#include "strideweave/ops.hpp"

namespace sw::detail {

// Values of `t` in ordinal order, as doubles.
std::vector<double> read_doubles(const TensorImpl& t);
// The Float32 values of `t` as one native array in ordinal order (a dense column-major tensor in host
// memory), or null.
const float* dense_floats(const TensorImpl& t);
// A dense Float32 tensor of `shape` on `prototype`'s kind holding `values`.
TensorPtr write_floats(const Carrier& prototype, const Shape& shape, const std::vector<double>& values);

}  // namespace sw::detail
