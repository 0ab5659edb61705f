#include "strideweave/autograd.hpp"

#include <algorithm>
#include <unordered_map>
#include <unordered_set>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"

namespace sw {

void attach_node(const std::shared_ptr<Node>& node, const TensorPtr& result) {
  node->output = result;
  std::lock_guard lock(result->mutex);
  result->node = node;
}

bool should_record(std::span<const TensorPtr> inputs, const TensorPtr& result) {
  if (!is_grad_enabled() || !result || !result->is_differentiable()) return false;
  for (const auto& t : inputs)
    if (t && t->is_differentiable()) return true;
  return false;
}

namespace {

thread_local std::span<GradientSink* const> t_offered;  // Note [Gradient sinks]

// Publishes `sinks` to offered_sinks() for the duration of one apply() on this thread.
struct OfferedSinks {
  explicit OfferedSinks(std::span<GradientSink* const> sinks) : saved(t_offered) { t_offered = sinks; }
  ~OfferedSinks() { t_offered = saved; }
  std::span<GradientSink* const> saved;
};

}  // namespace

std::span<GradientSink* const> offered_sinks() { return t_offered; }

namespace {
thread_local bool t_grad_enabled = true;  // grad mode: per thread, on by default
}  // namespace

bool is_grad_enabled() noexcept { return t_grad_enabled; }
void set_grad_enabled(bool enabled) noexcept { t_grad_enabled = enabled; }

namespace {

// The backend of a kind that computes on dense copies (TiledEvictable), or null.
OpBackend* materializing_backend(const Carrier& c) {
  OpBackend* b = backend_for(c.kind());
  return b && b->materializes() ? b : nullptr;
}

// Note [Gradients of a kind]: how two gradients add, and whether a leaf's .grad
// can take a contribution in place, depend on the carrier kind (a tiled
// gradient adds tile by tile and keeps all-zero tiles implicit), as PyTorch's
// AccumulateGrad belongs to a node rather than to the engine. So the engine
// asks the backend of the gradient's kind (OpBackend::add_gradients and
// accumulate_in_place) and includes nothing of any kind; what it does itself is
// the generic rule: a kind that computes on dense copies reads both densely as
// backward work, adds them on the compute carrier and turns the sum back into a
// gradient of a's kind, geometry and layout; others add with the central add.
TensorPtr add_grads(const TensorPtr& a, const TensorPtr& b) {
  if (&b->carrier->kind() == &a->carrier->kind())
    if (OpBackend* backend = backend_for(a->carrier->kind()))
      if (TensorPtr sum = backend->add_gradients(a, b)) return sum;
  OpBackend* m = materializing_backend(*a->carrier);
  if (m && &b->carrier->kind() == &a->carrier->kind()) {
    std::vector<Operand> dense{Operand::of(m->materialize_for_backward(a)), Operand::of(m->materialize_for_backward(b))};
    return m->gradient_from_dense(a, call_op(OpId::Add, dense));
  }
  std::vector<Operand> ops{Operand::of(a), Operand::of(b)};
  return call_op(OpId::Add, ops);
}

// The gradient as the leaf's carrier kind holds it (new_like of the leaf). `g` is kept as is only when `owned`
// (freshly computed here, held by nobody else); otherwise (the caller's seed, or one gradient that add passes
// through to several operands) it is copied, so that no two .grad tensors, nor .grad and the seed, share storage.
TensorPtr on_leaf_kind(const TensorImpl& leaf, const TensorPtr& g, bool owned) {
  if (OpBackend* m = materializing_backend(*leaf.carrier)) {
    // A tiled leaf: its gradient is a fresh carrier of its kind with its geometry and layout (slot-wise
    // copies cannot fill the fresh carrier's invalid tiles).
    const bool same_kind = &g->carrier->kind() == &leaf.carrier->kind();
    // A tiled gradient in another dtype (Float32 for a 16-bit leaf) goes to the kind as it is, which converts
    // it tile by tile (Note [Tiled gradients of 16-bit parameters] in cpp/src/tiled/gradient_dtypes.cpp).
    const bool same_dtype = g->dtype() == leaf.dtype();
    if (owned && same_kind && same_dtype && g->offset == leaf.offset && g->layout == leaf.layout) return g;
    TensorPtr dense = same_kind && same_dtype ? m->materialize_for_backward(g) : g;
    return m->gradient_from_dense(make_tensor(leaf.carrier, leaf.offset, leaf.layout), dense);
  }
  const DType& dtype = leaf.dtype();
  if (owned && &g->carrier->kind() == &leaf.carrier->kind() && g->layout == column_major(leaf.layout.shape()) &&
      g->dtype() == dtype)
    return g;
  CarrierPtr c = leaf.carrier->allocate_like(g->size(), true, dtype, /*empty=*/true);
  TensorPtr dense = g;
  if (!g->layout.is_contiguous() || g->offset != 0) dense = expand_dense(g, g->layout.shape());
  if (dense->dtype() == dtype) {
    copy_slots(*dense->carrier, 0, *c, 0, dense->size());
  } else {
    // Note [Gradients of 16-bit parameters]: the VJPs compute in Float32; the leaf's gradient takes the
    // leaf's dtype here, rounded once (nearest even). An accumulation adds the new contribution to the held
    // gradient in Float32 first (add_grads: a 16-bit tensor with a Float32 one gives Float32), so each
    // accumulation rounds once: after contributions g_1..g_k the held BFloat16 gradient G_k satisfies
    // |G_k - sum g_j| <= sum_{j<=k} (2^-8 + 2^-24) |G_{j-1} + g_j| (2^-11 for Float16): one 16-bit rounding
    // (and one Float32 rounding) of each partial sum, never one per operation.
    const int64_t n = dense->size();
    std::vector<float> values(static_cast<size_t>(n));
    if (dense->dtype().id() == DTypeId::Float32) {
      dense->carrier->read_slots(dense->offset, n, values.data());
    } else {
      for (int64_t i = 0; i < n; ++i) values[static_cast<size_t>(i)] = static_cast<float>(dense->carrier->read_value(i).f);
    }
    std::vector<std::byte> bytes(static_cast<size_t>(n) * slot_bytes(dtype));
    for (int64_t i = 0; i < n; ++i)
      store_value(dtype, bytes.data() + i * static_cast<int64_t>(slot_bytes(dtype)), Value::from_float(values[static_cast<size_t>(i)]));
    c->write_slots(0, n, bytes.data());
  }
  return make_tensor(std::move(c), 0, column_major(leaf.layout.shape()));
}

// `owned`: `g` is a fresh tensor nobody else holds (not the caller's seed, not
// handed to another tensor), so it may become `.grad` without a copy.
void accumulate_into(TensorImpl& t, const TensorPtr& g, bool owned) {
  TensorPtr current;
  {
    std::lock_guard lock(t.mutex);
    current = t.grad;
  }
  // The kind may add `g` into a .grad that only this leaf holds in place (Note [Gradients of a kind]): `current`
  // is held here once, beside t.grad.
  if (current && &g->carrier->kind() == &current->carrier->kind())
    if (OpBackend* backend = backend_for(current->carrier->kind()))
      if (backend->accumulate_in_place(current, g, owned)) return;
  TensorPtr value = current ? on_leaf_kind(t, add_grads(current, g), /*owned=*/true) : on_leaf_kind(t, g, owned);
  std::lock_guard lock(t.mutex);
  t.grad = value;
}

// Note [A released gradient]: a .grad whose carrier was released (release(), or consumed by a move) cannot take
// another contribution. The sum used to fail deep inside, with the words of whatever first read the released
// carrier ("cannot project" for a tiled one) and after other leaves had already accumulated theirs. So backward
// checks every gradient it may add to before any work, and names it.
void check_gradient_live(const TensorImpl& t) {
  TensorPtr current;
  {
    std::lock_guard lock(t.mutex);
    current = t.grad;
  }
  if (current && current->carrier->is_released())
    raise<RuntimeError>("backward: the gradient of a ", t.carrier->kind_name(), " tensor of shape ",
                        t.layout.shape().str(), " was released (its .grad is backed by a released ",
                        current->carrier->kind_name(), " carrier); set .grad to None to start a new gradient");
}

void check_saved(const Node& node) {
  for (const auto& s : node.saved) {
    uint64_t now = s.tensor->version();
    if (now != s.version)
      raise<RuntimeError>("one of the tensors needed for gradient computation has been modified in-place: ", node.name,
                          " saved a tensor of shape ", s.tensor->layout.shape().str(), " at version ", s.version,
                          ", but it is now at version ", now,
                          ". Do not write to tensors (or their carriers) that a recorded operation still needs; "
                          "compute on a copy instead");
  }
}

// Note [A gradient on another carrier kind]: backward(gradient) takes a
// cotangent on any carrier kind of the output's shape and dtype (a NumPy-made
// CPU tensor for an output of a tiled computation, say). The VJPs run on the
// output's kind, so the cotangent's values are copied once into a dense
// tensor of that kind; the caller's tensor is read, never consumed (a move
// would release it) and never written.
TensorPtr seed_on_kind(const TensorImpl& seed, const Carrier& prototype) {
  const Shape& shape = seed.layout.shape();
  TensorPtr out = full_like_kind(prototype, shape, DType::Float32(), 0.0);
  const int64_t n = seed.size();
  std::vector<float> values(static_cast<size_t>(n));
  if (seed.layout.is_column_major() && seed.dtype().id() == DTypeId::Float32) {
    seed.carrier->read_slots(seed.offset, n, values.data());  // one bulk read
  } else {
    const FlatLayout& flat = seed.layout.flat();
    for (int64_t i = 0; i < n; ++i)
      values[static_cast<size_t>(i)] = static_cast<float>(seed.carrier->read_value(seed.offset + flat.index(i)).f);
  }
  out->carrier->write_slots(out->offset, n, values.data());
  return out;
}

}  // namespace

void backward(const TensorPtr& root, const TensorPtr& gradient, bool retain_graph) {
  if (!root->is_differentiable())
    raise<RuntimeError>("backward: a ", root->dtype().name(), " tensor is not differentiable");
  TensorPtr seed = gradient;
  if (!seed) {
    if (root->size() != 1)
      raise<ValueError>("backward: gradient can be omitted only for single-element outputs; this one has shape ",
                        root->layout.shape().str());
    seed = full_like_kind(*root->carrier, root->layout.shape(), DType::Float32(), 1.0);
  } else {
    // Note [Compatible shapes] (layout.hpp): a flat mode where the output has a nested one of the same size is
    // read through a refined view; a nested mode where the output has a flat one is copied in its order.
    enum class Fit { Same, Refine, Coarsen } fit = Fit::Same;
    const Shape& want = root->layout.shape();
    const Shape got = seed->layout.shape();
    if (!(got == want)) {
      if (std::optional<Shape> r = refine_shape(got, want); r && *r == want) fit = Fit::Refine;
      else if (std::optional<Shape> r2 = refine_shape(want, got); r2 && *r2 == got) fit = Fit::Coarsen;
      else raise<ValueError>("backward: gradient shape ", got.str(), " does not match the output's ", want.str());
    }
    // Checked here, before any work: a wrong seed would otherwise fail (or be misread) midway, after some
    // leaves had already accumulated.
    if (seed->dtype().id() != DTypeId::Float32 && seed->dtype() != root->dtype())
      raise<TypeError>("backward: gradient must be a Float32 tensor (or of the output's dtype ", root->dtype().name(),
                       "), got ", seed->dtype().name());
    seed->carrier->check_live("use it as a gradient");
    if (fit == Fit::Refine) {
      seed = make_tensor(seed->carrier, seed->offset, seed->layout.broadcast_to(want));
    } else if (fit == Fit::Coarsen) {  // a dense Float32 copy on the output's kind, in the seed's order
      TensorPtr dense = seed_on_kind(*seed, *root->carrier);
      seed = make_tensor(dense->carrier, dense->offset, column_major(want));
    }
    if (&seed->carrier->kind() != &root->carrier->kind() || seed->dtype().id() != DTypeId::Float32)
      seed = seed_on_kind(*seed, *root->carrier);  // a 16-bit seed widens (exactly) to Float32: VJPs run in Float32
  }
  GradModeGuard no_grad(false);
  std::shared_ptr<Node> root_node;
  {
    std::lock_guard lock(root->mutex);
    root_node = root->node;
  }
  if (!root_node) {  // a leaf
    check_gradient_live(*root);  // Note [A released gradient]
    accumulate_into(*root, seed, /*owned=*/false);
    return;
  }
  // Discover the graph and count dependencies.
  std::unordered_map<Node*, int> deps;
  std::vector<std::shared_ptr<Node>> stack{root_node}, order;
  std::unordered_set<Node*> seen{root_node.get()};
  while (!stack.empty()) {
    auto n = stack.back();
    stack.pop_back();
    if (n->freed)
      raise<RuntimeError>("backward: the graph of ", n->name,
                          " was already freed by an earlier backward; pass retain_graph=True to the first backward "
                          "to run backward through it again");
    order.push_back(n);
    for (const auto& in : n->inputs) {
      std::shared_ptr<Node> child;
      {
        std::lock_guard lock(in->mutex);
        child = in->node;
      }
      if (!child) continue;
      deps[child.get()]++;
      if (seen.insert(child.get()).second) stack.push_back(child);
    }
  }
  for (const auto& n : order) check_saved(*n);
  // Every gradient this backward may add to is checked before any is (Note [A released gradient]).
  for (const auto& n : order) {
    if (auto out = n->output.lock()) {
      bool keep;
      {
        std::lock_guard lock(out->mutex);
        keep = out->retains_grad;
      }
      if (keep) check_gradient_live(*out);
    }
    for (const auto& in : n->inputs) {
      bool leaf;
      {
        std::lock_guard lock(in->mutex);
        leaf = !in->node;
      }
      if (leaf && in->is_differentiable()) check_gradient_live(*in);
    }
  }
  // Kahn's algorithm from the root.
  std::unordered_map<Node*, TensorPtr> grads{{root_node.get(), seed}};
  // The carriers of gradients already given to a tensor: by carrier, not by tensor, since a view's VJP (permute,
  // reshape) returns another tensor over its cotangent's carrier, which must not become two leaves' .grad.
  std::unordered_set<const Carrier*> handed;
  std::vector<std::shared_ptr<Node>> ready{root_node};
  std::unordered_map<Node*, std::shared_ptr<Node>> by_ptr;
  for (const auto& n : order) by_ptr[n.get()] = n;
  while (!ready.empty()) {
    auto n = ready.back();
    ready.pop_back();
    TensorPtr g = grads[n.get()];
    grads.erase(n.get());
    if (auto out = n->output.lock()) {
      bool keep;
      {
        std::lock_guard lock(out->mutex);
        keep = out->retains_grad;
      }
      if (keep && g) accumulate_into(*out, g, /*owned=*/false);  // g also flows on
    }
    std::vector<TensorPtr> in_grads;
    // Sinks offered by the nodes of this node's inputs (Note [Gradient sinks]).
    std::vector<std::optional<GradientSink>> offered;
    if (g) {
      offered.resize(n->inputs.size());
      std::vector<GradientSink*> sinks(n->inputs.size(), nullptr);
      for (size_t i = 0; i < n->inputs.size(); ++i) {
        const TensorPtr& in = n->inputs[i];
        std::shared_ptr<Node> child;
        bool keep;
        {
          std::lock_guard lock(in->mutex);
          child = in->node;
          keep = in->retains_grad;
        }
        if (!child || keep || deps[child.get()] != 1 || grads.count(child.get())) continue;
        bool repeated = false;  // an input passed twice gets two contributions
        for (size_t j = 0; j < n->inputs.size(); ++j) repeated |= j != i && n->inputs[j] == in;
        if (repeated) continue;
        offered[i] = child->gradient_sink();
        if (offered[i]) sinks[i] = &*offered[i];
      }
      {
        OfferedSinks scope(sinks);
        try {
          in_grads = n->apply(g);  // a node whose output received no gradient does no work
        } catch (...) {
          // A sink already written holds a whole contribution: it is recorded (dirty, versioned) before its hold
          // ends, never left behind unrecorded (Note [Gradient sums hold their tiles]).
          for (auto& o : offered)
            if (o && o->used) o->commit();
          throw;
        }
      }
      for (size_t i = 0; i < offered.size(); ++i)
        if (offered[i] && offered[i]->used) {
          SW_ASSERT(i >= in_grads.size() || !in_grads[i], n->name, " both filled a gradient sink and returned a gradient");
          offered[i]->commit();
        }
    }
    for (size_t i = 0; i < n->inputs.size(); ++i) {
      const TensorPtr& in = n->inputs[i];
      TensorPtr gi = i < in_grads.size() ? in_grads[i] : nullptr;
      std::shared_ptr<Node> child;
      {
        std::lock_guard lock(in->mutex);
        child = in->node;
      }
      if (child) {
        if (gi) {
          auto& slot = grads[child.get()];
          slot = slot ? add_grads(slot, gi) : gi;
        }
        if (--deps[child.get()] == 0) ready.push_back(child);
      } else if (gi && in->is_differentiable()) {
        const bool owned = (!seed || gi->carrier != seed->carrier) && handed.insert(gi->carrier.get()).second;
        accumulate_into(*in, gi, owned);
      }
    }
  }
  if (!retain_graph)
    for (const auto& n : order) {
      n->freed = true;
      n->release_saved();
    }
}

}  // namespace sw

// ---------------------------------------------------------------- the move node

#include "strideweave/move.hpp"

namespace sw {

namespace {

struct MoveNode final : Node {
  CarrierPtr source_prototype;  // the (consumed) source carrier: its kind receives the gradient
  std::vector<TensorPtr> apply(const TensorPtr& g) override {
    // Move a private dense copy back along the reverse route (a move consumes its source).
    TensorPtr copy = expand_dense(g, g->layout.shape());
    CarrierPtr dest = source_prototype->allocate_like(0, true, DType::Float32(), true);
    return {move_to(copy, dest)};
  }
};

}  // namespace

void install_autograd_hooks() {
  static const bool installed = [] {
  set_move_node_hook([](const TensorPtr& source, const TensorPtr& result) {
    auto node = std::make_shared<MoveNode>();
    node->name = "move";
    node->dispatch_kind = &result->carrier->kind();
    node->inputs = {source};
    node->source_prototype = source->carrier;
    attach_node(node, result);
  });
  return true;
  }();
  (void)installed;
}

}  // namespace sw
