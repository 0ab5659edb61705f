// The optimizers (strideweave/optim.hpp, Note [Optimizers on tiled parameters]): validation, the state carriers,
// and a step tile by tile: each tile's weight, gradient and state made resident and held, one update pass, commit.
#include "strideweave/optim.hpp"

#include <cmath>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "../tiled/internal.hpp"
#include "optim_internal.hpp"
#include "quantized_state.hpp"

namespace sw::optim {

const char* algorithm_name(Algorithm a) {
  switch (a) {
    case Algorithm::SGD: return "SGD";
    case Algorithm::Adam: return "Adam";
    case Algorithm::AdamW: return "AdamW";
  }
  return "?";
}

const char* state_dtype_name(StateDType d) {
  switch (d) {
    case StateDType::Float32: return "Float32";
    case StateDType::BFloat16: return "BFloat16";
    case StateDType::Int8Blockwise: return "Int8Blockwise";
  }
  return "?";
}

namespace {

// Whether `t`'s layout reaches as many slots as it has elements, each once (a compact view).
bool compact(const TensorImpl& t) { return t.layout.size() == t.layout.cosize() && t.layout.is_injective(); }

}  // namespace

void validate(Algorithm algorithm, const Hyperparameters& h) {
  const char* name = algorithm_name(algorithm);
  auto bad = [&](const char* what, double v, const char* rule) {
    raise<ValueError>(name, ": invalid ", what, " ", v, " (", rule, ")");
  };
  if (!(h.lr >= 0)) bad("learning rate lr", h.lr, "must be >= 0");
  if (!(h.weight_decay >= 0)) bad("weight_decay", h.weight_decay, "must be >= 0");
  if (algorithm == Algorithm::SGD) {
    if (!(h.momentum >= 0)) bad("momentum", h.momentum, "must be >= 0");
    if (!std::isfinite(h.dampening)) bad("dampening", h.dampening, "must be finite");
    if (h.nesterov && (h.momentum <= 0 || h.dampening != 0))
      raise<ValueError>(name, ": nesterov momentum requires momentum > 0 and dampening 0, got momentum ", h.momentum,
                        " and dampening ", h.dampening);
  } else {
    if (!(h.eps >= 0)) bad("eps", h.eps, "must be >= 0");
    if (!(h.beta1 >= 0 && h.beta1 < 1)) bad("beta at index 0:", h.beta1, "must be in [0, 1)");
    if (!(h.beta2 >= 0 && h.beta2 < 1)) bad("beta at index 1:", h.beta2, "must be in [0, 1)");
  }
}

Optimizer::Optimizer(Algorithm algorithm, std::vector<TensorPtr> params, Hyperparameters h, StateDType state_dtype,
                     bool step_in_backward)
    : algorithm_(algorithm), state_dtype_(state_dtype), h_(h) {
  const char* name = algorithm_name(algorithm);
  validate(algorithm, h);
  if (params.empty()) raise<ValueError>(name, ": got an empty parameter list");
  // Every parameter is checked before any state is allocated.
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorPtr& p = params[i];
    if (!p) raise<TypeError>(name, ": parameter ", i, " is None, not a Tensor");
    if (!detail::float_dtype(p->dtype()))
      raise<TypeError>(name, ": parameter ", i, " has dtype ", p->dtype().name(),
                       "; an optimizer steps Float32, BFloat16 or Float16 parameters");
    for (size_t j = 0; j < i; ++j) {
      if (params[j] == p) raise<ValueError>(name, ": parameter ", i, " is listed twice (also parameter ", j, ")");
      if (params[j]->carrier == p->carrier)
        raise<ValueError>(name, ": parameters ", j, " and ", i, " view one carrier; give each carrier once");
    }
    {
      std::lock_guard lock(p->mutex);
      if (p->node)
        raise<ValueError>(name, ": parameter ", i, " is not a leaf (autograd computes it), so it cannot be optimized");
    }
    if (!p->is_mutable()) raise<ValueError>(name, ": parameter ", i, " is read-only (its carrier is not mutable)");
    if (auto t = std::dynamic_pointer_cast<TiledEvictable>(p->carrier)) {
      if (t->is_released()) raise<ValueError>(name, ": parameter ", i, "'s TiledEvictable is released");
      if (p->offset != 0 || p->size() != t->size() || !compact(*p))
        raise<ValueError>(name, ": parameter ", i, " of shape ", p->layout.shape().str(),
                          " must view the whole extent of its TiledEvictable (", t->size(),
                          " slots, each once, from offset 0), got ", p->size(), " elements from offset ", p->offset);
      t->check_footprints(*p);  // ValueError ("tile footprints")
    } else {
      if (&p->carrier->kind() != &cpu_kind() || !p->carrier->native_data())
        raise<ValueError>(name, ": parameter ", i, " is over a ", p->carrier->kind().name,
                          " carrier; a parameter is a TiledEvictable or a dense CPU tensor");
      if (!compact(*p))
        raise<ValueError>(name, ": parameter ", i, " of shape ", p->layout.shape().str(),
                          " is not compact (its layout reaches ", p->layout.cosize(), " slots for ", p->size(),
                          " elements, or one slot twice)");
    }
  }
  const bool has_state = algorithm != Algorithm::SGD || h.momentum != 0;
  for (size_t i = 0; i < params.size(); ++i) {
    auto s = std::make_unique<Slot>();
    s->param = params[i];
    s->tiled = std::dynamic_pointer_cast<TiledEvictable>(params[i]->carrier);
    if (has_state) s->state1 = make_state(*s);
    if (algorithm != Algorithm::SGD) s->state2 = make_state(*s);
    s->steps.assign(static_cast<size_t>(s->tiled ? s->tiled->tile_count() : 1), 0);
    s->stateful.assign(s->steps.size(), 0);
    slots_.push_back(std::move(s));
  }
  if (step_in_backward) install_hooks();  // ValueError (another optimizer's hook), nothing installed
  params_ = std::move(params);
}

Optimizer::~Optimizer() { remove_hooks(); }

int64_t Optimizer::state_bytes(int64_t n) const noexcept {
  switch (state_dtype_) {
    case StateDType::Float32: return 4 * n;
    case StateDType::BFloat16: return 2 * n;
    case StateDType::Int8Blockwise: return 4 * detail::quant_tile_slots(n);
  }
  return 4 * n;
}

TensorPtr Optimizer::make_state(const Slot& s) const {
  const TensorPtr& p = s.param;
  const DType& dtype = state_dtype_ == StateDType::BFloat16 ? DType::BFloat16() : DType::Float32();
  if (state_dtype_ == StateDType::Int8Blockwise) {
    // Packed tiles (quantized_state.hpp): per weight tile, quant_tile_slots(n) Float32 slots of raw bytes, in a
    // carrier of the weight's grid whose tiles run along the first axis, so tile t is the slots [t m, (t + 1) m);
    // the state tensor is those slots in order. A dense parameter: one zero-filled packed tile in CPU memory.
    const int64_t n = s.tiled ? s.tiled->tile_size() : p->layout.cosize();
    const int64_t m = detail::quant_tile_slots(n);
    if (!s.tiled) {
      CarrierPtr c = p->carrier->allocate_like(m, true, DType::Float32(), false);  // zeros: absmax 0
      return make_tensor(c, 0, Layout(Shape(IntTuple::tuple({IntTuple(m)})),
                                      Stride(IntTuple::tuple({IntTuple(1)}))));
    }
    std::vector<int64_t> tile(s.tiled->grid_shape().size(), 1);
    tile[0] = m;
    CarrierPtr primary = s.tiled->primary()->allocate_like(0, true, DType::Float32(), true);
    CarrierPtr scratch = std::make_shared<FileBackedCarrier>(std::string(), DType::Float32(), true);
    auto c = std::make_shared<TiledEvictable>(primary, scratch, s.tiled->grid_shape(), tile, nullptr, true);
    TiledInternals::make_implicit_zeros(*c);
    if (s.tiled->residency_budget()) c->set_residency_budget(s.tiled->residency_budget());
    const int64_t total = m * s.tiled->tile_count();
    return make_tensor(c, 0,
                       Layout(Shape(IntTuple::tuple({IntTuple(total)})), Stride(IntTuple::tuple({IntTuple(1)}))));
  }
  if (s.tiled) {
    // Tiles of the state dtype and the weight's geometry over the weight's primary kind and a scratch file of their own,
    // every tile an implicit zero, under the weight's budget; no residency policy.
    CarrierPtr primary = s.tiled->primary()->allocate_like(0, true, dtype, true);
    CarrierPtr scratch = std::make_shared<FileBackedCarrier>(std::string(), dtype, true);
    auto c = std::make_shared<TiledEvictable>(primary, scratch, s.tiled->grid_shape(), s.tiled->tile_shape(),
                                              nullptr, true);
    TiledInternals::make_implicit_zeros(*c);
    if (s.tiled->residency_budget()) c->set_residency_budget(s.tiled->residency_budget());
    return make_tensor(c, p->offset, p->layout);
  }
  CarrierPtr c = p->carrier->allocate_like(p->layout.cosize(), true, dtype, false);  // zeros
  return make_tensor(c, 0, p->layout);
}

Hyperparameters Optimizer::hyperparameters() const {
  std::lock_guard lock(mutex_);
  return h_;
}

void Optimizer::set_hyperparameters(const Hyperparameters& h) {
  validate(algorithm_, h);
  std::lock_guard lock(mutex_);
  if (algorithm_ == Algorithm::SGD && h.momentum != 0) {
    // The buffers of every slot allocated first (an allocation error leaves the optimizer as it was).
    std::vector<TensorPtr> buffers(slots_.size());
    for (size_t k = 0; k < slots_.size(); ++k)
      if (!slots_[k]->state1) buffers[k] = make_state(*slots_[k]);
    for (size_t k = 0; k < slots_.size(); ++k)
      if (buffers[k]) slots_[k]->state1 = std::move(buffers[k]);
  }
  h_ = h;
}

void Optimizer::zero_grad() {
  for (const TensorPtr& p : params_) {
    std::lock_guard lock(p->mutex);
    p->grad = nullptr;
  }
}

ParameterState Optimizer::state(const TensorPtr& param) const {
  std::lock_guard lock(mutex_);
  for (const auto& s : slots_) {
    if (s->param != param) continue;
    ParameterState out;
    out.steps = s->steps;
    if (state_dtype_ == StateDType::Int8Blockwise) {
      // Decoded copies (ParameterState): the momentum buffer and exp_avg on the signed map, exp_avg_sq unsigned.
      const bool sgd = algorithm_ == Algorithm::SGD;
      TensorPtr a = s->state1 ? detail::decoded_state(s->param, s->tiled, s->state1, true) : nullptr;
      TensorPtr b = s->state2 ? detail::decoded_state(s->param, s->tiled, s->state2, false) : nullptr;
      if (sgd) out.momentum_buffer = a;
      else out.exp_avg = a, out.exp_avg_sq = b;
      return out;
    }
    if (algorithm_ == Algorithm::SGD) out.momentum_buffer = s->state1;
    else out.exp_avg = s->state1, out.exp_avg_sq = s->state2;
    return out;
  }
  raise<ValueError>(algorithm_name(algorithm_), ".state: the tensor is not one of this optimizer's parameters");
}

OptimizerStats Optimizer::stats() const {
  std::lock_guard lock(mutex_);
  OptimizerStats out = counts_;
  out.state = {};
  for (const auto& s : slots_)
    for (const TensorPtr& t : {s->state1, s->state2})
      if (auto c = t ? std::dynamic_pointer_cast<TiledEvictable>(t->carrier) : nullptr) detail::add_traffic(out.state, c->stats());
  return out;
}

}  // namespace sw::optim
