// Internal: kernels of the CPU (fast) and Generic (reference) backends, and
// the kernel entries the operation table names (Note [The operation table]).
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

// One element-wise operation over resolved operands into a dense `out` of
// `result_extents` leaves. Throws OverflowError for Int32.
struct ElementwiseCall {
  const std::vector<KernelInput>& in;
  const std::vector<int64_t>& result_extents;
  Carrier& out;
  const char* op;  // the operation's name, for messages
};
using ElementwiseKernel = void (*)(const ElementwiseCall& call);
// reduce_sum of `in` (layout already permuted: kept leaves first); `kept` is the
// number of result elements.
using ReduceKernel = void (*)(const TensorImpl& in, const Layout& permuted, int64_t kept, bool f64, Carrier& out);
// matmul: lhs (m, k), rhs (n, k) -> out (m, n) dense column-major.
using MatmulKernel = void (*)(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k,
                              bool f64, Carrier& out);

// The backend glue shared by both native backends (backends.cpp): result shape, dtype and dense result
// allocation, operands resolved for the kernel, then one kernel call.
TensorPtr run_elementwise(std::span<const Operand> ops, const OpOptions& options, const OpDef& def,
                          ElementwiseKernel kernel);
TensorPtr run_reduce_sum(std::span<const Operand> ops, const OpOptions& options, const OpDef& def,
                         ReduceKernel kernel);
TensorPtr run_matmul(std::span<const Operand> ops, const OpOptions& options, const OpDef& def, MatmulKernel kernel);

// Kernel entries (KernelFn) for the table's rows: the glue of the row's shape rule around one kernel.
template <ElementwiseKernel Kernel>
TensorPtr elementwise(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  return run_elementwise(ops, options, def, Kernel);
}
template <ReduceKernel Kernel>
TensorPtr reduction(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  return run_reduce_sum(ops, options, def, Kernel);
}
template <MatmulKernel Kernel>
TensorPtr contraction(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  return run_matmul(ops, options, def, Kernel);
}

// The element-wise kernels of each native backend; `mul` serves elementwise_mul and mul.
namespace cpu {  // cpu_kernels.cpp
void add(const ElementwiseCall&), sub(const ElementwiseCall&), mul(const ElementwiseCall&), div(const ElementwiseCall&),
    relu(const ElementwiseCall&), neg(const ElementwiseCall&), exp(const ElementwiseCall&);
// silu and sigmoid; their backward kernels take (g, x) and give g times the derivative at x (activations.hpp)
void silu(const ElementwiseCall&), sigmoid(const ElementwiseCall&), silu_backward(const ElementwiseCall&),
    sigmoid_backward(const ElementwiseCall&);
}
namespace generic {  // generic_kernels.cpp
void add(const ElementwiseCall&), sub(const ElementwiseCall&), mul(const ElementwiseCall&), div(const ElementwiseCall&),
    relu(const ElementwiseCall&), neg(const ElementwiseCall&), exp(const ElementwiseCall&);
// silu and sigmoid, and their backward kernels
void silu(const ElementwiseCall&), sigmoid(const ElementwiseCall&), silu_backward(const ElementwiseCall&),
    sigmoid_backward(const ElementwiseCall&);
}

// The raw kernels.
void cpu_reduce_sum(const TensorImpl& in, const Layout& permuted, int64_t kept, bool f64, Carrier& out);
void generic_reduce_sum(const TensorImpl& in, const Layout& permuted, int64_t kept, bool f64, Carrier& out);
void cpu_matmul(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, bool f64,
                Carrier& out);
// out += lhs rhs^T into dense column-major Float32 memory (m x n), for Float32
// operands in host memory; false (out untouched) for anything else.
bool cpu_matmul_accumulate(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, float* out);
void generic_matmul(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, bool f64,
                    Carrier& out);

}  // namespace sw::detail
