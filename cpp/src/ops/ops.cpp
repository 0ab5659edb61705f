// Dispatch: call_op validates operands, runs the dispatching kind's backend
// and records the autograd node whose backward runs the row's VJP (Note [The
// operation table]); operation_capabilities lists what a carrier executes.
#include "strideweave/ops.hpp"

#include <vector>

#include "op_table.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"

namespace sw {

namespace {

// The row of `id` (the table is in this translation unit's view: no call on the hot path).
const OpDef& row(OpId id) { return detail::kOps[static_cast<size_t>(id)]; }

// ---------------------------------------------------------------- autograd nodes

struct OpNode final : Node {
  const OpDef* def = nullptr;
  std::vector<Operand> operands;  // tensors (as inputs) and weak scalars, in call order
  OpOptions options;
  TensorPtr second;  // row operations: a second result the VJP reads (topk's indices), saved

  std::vector<TensorPtr> apply(const TensorPtr& g) override {
    OpBackend* backend = backend_for(*dispatch_kind);
    if (!backend || !backend->materializes()) return vjp(inputs, g, offered_sinks());
    std::vector<TensorPtr> dense;
    for (const auto& in : inputs) dense.push_back(backend->materialize_for_backward(in));
    std::vector<TensorPtr> grads = vjp(dense, g);
    for (size_t i = 0; i < grads.size(); ++i)
      if (grads[i]) grads[i] = backend->gradient_from_dense(inputs[i], grads[i]);
    return grads;
  }

  // Gradients for `inputs` (the operands, or dense copies of them) given the output's gradient; a gradient
  // added into one of `sinks` (Note [Gradient sinks]) is returned as nullptr.
  std::vector<TensorPtr> vjp(const std::vector<TensorPtr>& in, const TensorPtr& g,
                             std::span<GradientSink* const> sinks = {}) {
    std::vector<TensorPtr> grads(in.size());
    def->vjp(VjpArgs{operands, options, in, g, sinks, second}, grads);
    return grads;
  }
};

// Shapes, before any allocation (ValueError when the operands do not fit the row's shape rule).
void check_shapes(const OpDef& def, std::span<const Operand> ops, const Operand& first, const OpOptions& options) {
  switch (def.shape) {
    case OpShape::Elementwise: {
      Shape s = first.tensor->layout.shape();
      for (const auto& o : ops)
        if (o.is_tensor() && !(o.tensor->layout.shape() == s)) s = broadcast_shapes(s, o.tensor->layout.shape(), def.name);
      return;
    }
    case OpShape::Reduction: parse_reduce_description(options.description, first.tensor->layout.rank()); return;
    case OpShape::Contraction: {
      const Layout& l = ops[0].tensor->layout;
      const Layout& r = ops[1].tensor->layout;
      if (l.rank() != 2 || r.rank() != 2)
        raise<ValueError>(def.name, " operands must have two top-level modes, got ", l.shape().str(), " and ",
                          r.shape().str());
      if (l.shape().extents()[1] != r.shape().extents()[1])
        raise<ValueError>(def.name, ": lhs ", l.shape().str(), " and rhs ", r.shape().str(),
                          " disagree on the contracted mode 1 (", l.shape().extents()[1], " vs ", r.shape().extents()[1],
                          ")");
      return;
    }
    // row operations (Note [Row operations] in rows.cpp)
    case OpShape::AlongMode:
    case OpShape::TopK:
    case OpShape::Gather:
    case OpShape::Scatter: detail::check_row_operands(def, ops, options); return;
  }
}

}  // namespace

// ---------------------------------------------------------------- call_op

TensorPtr call_op(OpId id, std::span<const Operand> ops, const OpOptions& options) {
  const OpDef& def = row(id);
  if (static_cast<int>(ops.size()) != def.arity)
    raise<TypeError>(def.name, " takes ", def.arity, " operand", def.arity == 1 ? "" : "s", ", got ", ops.size());
  const Operand* first = nullptr;
  for (const auto& o : ops) {
    if (o.is_tensor()) {
      if (!first) first = &o;
      continue;
    }
    if (!def.weak_scalars) raise<TypeError>(def.name, " operands must be Tensors");
    if (o.scalar.kind == Value::Kind::Bool) raise<TypeError>(def.name, ": a weak scalar must be an int or a float, not a bool");
  }
  if (!first) raise<TypeError>(def.name, " needs at least one Tensor operand");
  const Carrier& dispatch = *first->tensor->carrier;
  for (const auto& o : ops) {
    if (!o.is_tensor()) continue;
    if (&o.tensor->carrier->kind() != &dispatch.kind())
      raise<TypeError>(def.name, ": Tensor backing carriers must match (", dispatch.kind_name(), " and ",
                       o.tensor->carrier->kind_name(), "); move a tensor first");
  }
  for (const auto& o : ops)
    if (o.is_tensor()) o.tensor->carrier->check_live("compute with it");
  OpBackend* backend = backend_for(dispatch.kind());
  if (!backend || !backend->supports(id))
    raise<NotImplementedError>(dispatch.kind_name(), backend ? " does not execute " : " executes no operations (",
                               backend ? def.name : "it is storage only", backend ? "" : ")");
  check_shapes(def, ops, *first, options);
  if (options.accumulate_f64 && !def.takes_accumulator())
    raise<TypeError>(def.name, " takes no accumulator_dtype");
  // row operations: a row with two results needs the place of its second (sw::topk gives it)
  if ((def.results() == 2) != (options.second != nullptr))
    raise<TypeError>(def.name, def.results() == 2 ? " has two results: call it through its own function"
                                                  : " has one result");

  TensorPtr result = backend->forward(id, ops, options);

  // Nothing is recorded with grad mode off: skip gathering the inputs then.
  if (!def.differentiable() || !is_grad_enabled()) return result;
  std::vector<TensorPtr> inputs;
  for (const auto& o : ops)
    if (o.is_tensor()) inputs.push_back(o.tensor);
  if (should_record(inputs, result)) {
    auto node = std::make_shared<OpNode>();
    node->name = def.name;
    node->dispatch_kind = &dispatch.kind();
    node->def = &def;
    node->operands.assign(ops.begin(), ops.end());
    node->options = options;
    node->options.second = nullptr;  // row operations: the node keeps the second result itself
    node->inputs = inputs;
    if (def.saves == OpSaves::Inputs)
      for (const auto& t : inputs) node->save(t);
    if (options.second) node->save(node->second = *options.second);
    attach_node(node, result);
  }
  return result;
}

// ---------------------------------------------------------------- capabilities

std::vector<Capability> operation_capabilities(const Carrier& carrier, std::optional<OpId> only) {
  std::vector<Capability> out;
  OpBackend* backend = backend_for(carrier.kind());
  if (!backend) return out;
  std::vector<const DType*> dtypes;
  for (const DType* d : DType::registered())
    if (d->is_storage() && carrier.supports_storage_dtype(*d)) dtypes.push_back(d);
  for (const auto& def : detail::kOps) {
    if (only && *only != def.id) continue;
    if (!backend->executes(carrier, def.id)) continue;
    // row operations: not listed. An entry is an operand signature (tensors and weak scalars) that
    // sw.<name>(*operands) runs; a row operation also takes a mode (and k), which an entry cannot express.
    // dispatch_op(name) gives them (Note [Row operations] in rows.cpp).
    if (def.takes_mode()) continue;
    if (def.arity == 1) {
      for (const DType* a : dtypes) out.push_back({def.id, {{false, a}}});
      continue;
    }
    for (const DType* a : dtypes)
      for (const DType* b : dtypes) out.push_back({def.id, {{false, a}, {false, b}}});
    if (def.weak_scalars) {
      for (const DType* a : dtypes)
        for (const DType* s : {&DType::Int32(), &DType::Float32()}) {
          out.push_back({def.id, {{false, a}, {true, s}}});
          out.push_back({def.id, {{true, s}, {false, a}}});
        }
    }
  }
  return out;
}

}  // namespace sw
