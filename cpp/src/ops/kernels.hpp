// Internal: kernels of the CPU (fast) and Generic (reference) backends.
#pragma once

#include "strideweave/ops.hpp"

namespace sw::detail {

// An operand resolved for a kernel: a tensor, or a weak scalar already
// converted to the result dtype (a one-element buffer with stride 0).
struct KernelInput {
  const Carrier* carrier = nullptr;  // nullptr for a scalar
  const std::byte* data = nullptr;   // native memory (fast backend)
  DTypeId dtype = DTypeId::Float32;
  int64_t offset = 0;
  std::vector<int64_t> strides;      // flat strides broadcast to the result leaves
  Value scalar;                      // converted scalar when carrier == nullptr
  alignas(8) std::byte scalar_bytes[8]{};
};

// Element-wise ops (Add, ElementwiseMul, Mul, Sub, Div, Relu, Neg, Exp) into a
// dense `out` of `result_extents` leaves. Throws OverflowError for Int32.
void cpu_elementwise(OpId id, const std::vector<KernelInput>& in, const std::vector<int64_t>& result_extents,
                     Carrier& out);
void generic_elementwise(OpId id, const std::vector<KernelInput>& in, const std::vector<int64_t>& result_extents,
                         Carrier& out);

// reduce_sum of `in` (layout already permuted: kept leaves first); `kept` is the
// number of result elements.
void cpu_reduce_sum(const TensorImpl& in, const Layout& permuted, int64_t kept, bool f64, Carrier& out);
void generic_reduce_sum(const TensorImpl& in, const Layout& permuted, int64_t kept, bool f64, Carrier& out);

// matmul: lhs (m, k), rhs (n, k) -> out (m, n) dense column-major.
void cpu_matmul(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, bool f64,
                Carrier& out);
// out += lhs rhs^T into dense column-major Float32 memory (m x n), for Float32
// operands in host memory; false (out untouched) for anything else.
bool cpu_matmul_accumulate(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, float* out);
void generic_matmul(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, bool f64,
                    Carrier& out);

}  // namespace sw::detail
