// Internal: the vector-Jacobian products of the operations (vjps.cpp), named
// by the table's rows (Note [The operation table]).
#pragma once

#include <span>

#include "strideweave/autograd.hpp"
#include "strideweave/ops.hpp"

namespace sw {

// What a VJP reads. `inputs` are the tensor operands in call order, or dense copies of them when the
// dispatching kind computes on dense copies (OpBackend::materializes); `operands` also hold the weak scalars.
struct VjpArgs {
  std::span<const Operand> operands;
  const OpOptions& options;
  std::span<const TensorPtr> inputs;
  const TensorPtr& grad;                 // the output's gradient
  std::span<GradientSink* const> sinks;  // per input, Note [Gradient sinks]; empty when none is offered
  // row operations: the operation's second result (topk's indices), else null (Note [Row operations] in rows.cpp)
  TensorPtr second = nullptr;

  bool wants(size_t i) const { return inputs[i]->is_differentiable(); }
  const Shape& shape_of(size_t i) const { return inputs[i]->layout.shape(); }
};

namespace detail {
// VjpFn: each fills `grads` (one slot per tensor input) where a gradient flows; a gradient added into a
// sink is left null. `vjp_mul` serves elementwise_mul and mul; the binary VJPs take a weak scalar operand on
// either side (it gets no gradient; `grads` then has one slot, the tensor operand's).
void vjp_add(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_sub(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_mul(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_div(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_neg(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_exp(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_relu(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_reduce_sum(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_matmul(const VjpArgs& args, std::span<TensorPtr> grads);
// activations (activations.cpp)
void vjp_silu(const VjpArgs& args, std::span<TensorPtr> grads);
void vjp_sigmoid(const VjpArgs& args, std::span<TensorPtr> grads);
}  // namespace detail

}  // namespace sw
