// strideweave._core.Optimizer: the engine's SGD / Adam / AdamW (strideweave/optim.hpp) under the thin Python classes
// of strideweave.optim.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/optim.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace swpy {

namespace {

using sw::TensorImpl;
using sw::TensorPtr;
namespace optim = sw::optim;

optim::Algorithm algorithm_of(const std::string& name) {
  if (name == "SGD") return optim::Algorithm::SGD;
  if (name == "Adam") return optim::Algorithm::Adam;
  if (name == "AdamW") return optim::Algorithm::AdamW;
  sw::raise<sw::ValueError>("Optimizer: algorithm must be 'SGD', 'Adam' or 'AdamW', got '", name, "'");
}

std::vector<TensorPtr> params_of(nb::handle params, const char* name) {
  if (nb::isinstance<TensorImpl>(params) || !nb::hasattr(params, "__iter__"))
    sw::raise<sw::TypeError>(name, ": params must be an iterable of Tensors, got ", nb::type_name(params.type()).c_str());
  std::vector<TensorPtr> out;
  for (nb::handle p : nb::iter(params)) {
    if (!nb::isinstance<TensorImpl>(p))
      sw::raise<sw::TypeError>(name, ": parameter ", out.size(), " must be a Tensor, got ",
                               nb::type_name(p.type()).c_str());
    out.push_back(nb::cast<TensorPtr>(p));
  }
  return out;
}

// grad_norm's and scale_grads' params: a Tensor or an iterable of Tensors (TypeError naming params[i] otherwise).
std::vector<TensorPtr> tensors_of(nb::handle params, const char* name) {
  if (nb::isinstance<TensorImpl>(params)) return {nb::cast<TensorPtr>(params)};
  if (!nb::hasattr(params, "__iter__"))
    sw::raise<sw::TypeError>(name, ": params must be a Tensor or an iterable of Tensors, got ",
                             nb::type_name(params.type()).c_str());
  std::vector<TensorPtr> out;
  for (nb::handle p : nb::iter(params)) {
    if (!nb::isinstance<TensorImpl>(p))
      sw::raise<sw::TypeError>(name, ": params[", out.size(), "] must be a Tensor, got ",
                               nb::type_name(p.type()).c_str());
    out.push_back(nb::cast<TensorPtr>(p));
  }
  return out;
}

// state_dtype: sw.DType.Float32 or sw.DType.BFloat16, or the string "8bit" (strideweave.optim.STATE_8BIT: 8-bit
// block-wise state) (Note [Compact optimizer state]); ValueError for another DType, TypeError for anything else
// (another string included: the accepted values are DTypes and the one literal "8bit").
optim::StateDType state_dtype_of(nb::handle v, const char* name) {
  if (v.is_none()) return optim::StateDType::Float32;
  if (nb::isinstance<nb::str>(v) && nb::cast<std::string>(v) == "8bit") return optim::StateDType::Int8Blockwise;
  if (!nb::isinstance<sw::DType>(v)) {
    const std::string what = nb::isinstance<nb::str>(v) ? "the str '" + nb::cast<std::string>(v) + "'"
                                                        : std::string(nb::type_name(v.type()).c_str());
    sw::raise<sw::TypeError>(name, ": state_dtype must be a DType (DType.Float32 or DType.BFloat16) or \"8bit\", got ",
                             what);
  }
  const sw::DType& d = nb::cast<const sw::DType&>(v);
  if (d.id() == sw::DTypeId::Float32) return optim::StateDType::Float32;
  if (d.id() == sw::DTypeId::BFloat16) return optim::StateDType::BFloat16;
  sw::raise<sw::ValueError>(name, ": state_dtype must be DType.Float32 or DType.BFloat16 (or \"8bit\"), got ",
                            d.name());
}

double number_of(nb::handle v, const char* name, const char* what) {
  if (PyBool_Check(v.ptr()) || !(PyFloat_Check(v.ptr()) || PyLong_Check(v.ptr())))
    sw::raise<sw::TypeError>(name, ": ", what, " must be a float, got ", nb::type_name(v.type()).c_str());
  return PyFloat_AsDouble(v.ptr());
}

// The hyperparameters as a dict of Python values (betas as beta1 and beta2).
nb::dict hyper_dict(const optim::Hyperparameters& h) {
  nb::dict d;
  d["lr"] = h.lr;
  d["momentum"] = h.momentum;
  d["dampening"] = h.dampening;
  d["nesterov"] = h.nesterov;
  d["beta1"] = h.beta1;
  d["beta2"] = h.beta2;
  d["eps"] = h.eps;
  d["weight_decay"] = h.weight_decay;
  return d;
}

nb::dict traffic(const optim::TierTraffic& t) {
  nb::dict d;
  d["promotions"] = t.promotions;
  d["evictions"] = t.evictions;
  d["bytes_promoted"] = t.bytes_promoted;
  d["bytes_evicted"] = t.bytes_evicted;
  return d;
}

}  // namespace

void bind_optim(nb::module_& m) {
  m.def("_optim_quantization_map", [](bool is_signed) {
    const float* v = optim::blockwise_quantization_map(is_signed);
    return std::vector<float>(v, v + 256);
  }, nb::arg("is_signed"), nb::sig("def _optim_quantization_map(is_signed: bool) -> list[float]"),
  "The 256 entries of the dynamic quantization map of 8-bit optimizer state (signed or unsigned), ascending.");
  // Note [Gradient reservations]: the torch bridge's per-expert arithmetic reserves its experts' tiles in forward
  // and finishes each as its backward delivers it (python/strideweave/torch/_experts.py).
  nb::class_<sw::GradientReservation>(m, "_GradientReservation")
      .def("finish", [](sw::GradientReservation& r, int64_t tile, bool delivered) {
        GilRelease nogil;
        r.finish(tile, delivered);
      }, nb::arg("tile"), nb::arg("delivered"))
      .def("finish_all", [](sw::GradientReservation& r, bool delivered) {
        GilRelease nogil;
        r.finish_all(delivered);
      }, nb::arg("delivered"));
  m.def("_reserve_gradients", [](const TensorPtr& t, std::vector<int64_t> tiles) {
    auto c = std::dynamic_pointer_cast<sw::TiledEvictable>(t->carrier);
    if (!c) sw::raise<sw::TypeError>("_reserve_gradients: the tensor is not over a TiledEvictable");
    for (int64_t i : tiles)
      if (i < 0 || i >= c->tile_count())
        sw::raise<sw::ValueError>("_reserve_gradients: tile ", i, " is outside the grid's ", c->tile_count(), " tiles");
    GilRelease nogil;
    return c->reserve_gradients(std::move(tiles));
  }, nb::arg("tensor"), nb::arg("tiles"));
  m.def("_steps_in_backward", [](const TensorPtr& t) {
    auto c = std::dynamic_pointer_cast<sw::TiledEvictable>(t->carrier);
    return c && c->gradient_hook() != nullptr;
  }, nb::arg("tensor"), "Whether an optimizer with step_in_backward steps this tiled tensor's tiles in backward.");
  m.def("_optim_grad_norm", [](nb::handle params, nb::handle norm_type) {
    const double p = number_of(norm_type, "grad_norm", "norm_type");
    std::vector<TensorPtr> ps = tensors_of(params, "grad_norm");
    GilRelease nogil;
    return optim::grad_norm(ps, p);
  }, nb::arg("params"), nb::arg("norm_type"),
  nb::sig("def _optim_grad_norm(params: typing.Any, norm_type: float) -> float"));
  m.def("_optim_scale_grads", [](nb::handle params, nb::handle factor) {
    const double f = number_of(factor, "scale_grads", "factor");
    std::vector<TensorPtr> ps = tensors_of(params, "scale_grads");
    GilRelease nogil;
    optim::scale_grads(ps, f);
  }, nb::arg("params"), nb::arg("factor"),
  nb::sig("def _optim_scale_grads(params: typing.Any, factor: float) -> None"));
  nb::class_<optim::Optimizer>(m, "Optimizer", nb::is_final(),
                               "The engine behind strideweave.optim.SGD, Adam and AdamW (use those).")
      .def("__init__",
           [](optim::Optimizer* self, const std::string& algorithm, nb::handle params, nb::handle lr,
              nb::handle momentum, nb::handle dampening, bool nesterov, nb::handle beta1, nb::handle beta2,
              nb::handle eps, nb::handle weight_decay, nb::handle state_dtype, bool step_in_backward) {
             const optim::Algorithm a = algorithm_of(algorithm);
             const char* name = optim::algorithm_name(a);
             optim::Hyperparameters h;
             h.lr = number_of(lr, name, "lr");
             h.momentum = number_of(momentum, name, "momentum");
             h.dampening = number_of(dampening, name, "dampening");
             h.nesterov = nesterov;
             h.beta1 = number_of(beta1, name, "betas[0]");
             h.beta2 = number_of(beta2, name, "betas[1]");
             h.eps = number_of(eps, name, "eps");
             h.weight_decay = number_of(weight_decay, name, "weight_decay");
             const optim::StateDType sd = state_dtype_of(state_dtype, name);
             std::vector<TensorPtr> ps = params_of(params, name);
             new (self) optim::Optimizer(a, std::move(ps), h, sd, step_in_backward);
           },
           nb::arg("algorithm"), nb::arg("params"), nb::arg("lr"), nb::arg("momentum"), nb::arg("dampening"),
           nb::arg("nesterov"), nb::arg("beta1"), nb::arg("beta2"), nb::arg("eps"), nb::arg("weight_decay"),
           nb::arg("state_dtype") = nb::none(), nb::arg("step_in_backward") = false,
           nb::sig("def __init__(self, algorithm: str, params: collections.abc.Iterable[Tensor], lr: float, "
                   "momentum: float, dampening: float, nesterov: bool, beta1: float, beta2: float, eps: float, "
                   "weight_decay: float, state_dtype: DType | str | None = None, step_in_backward: bool = False) -> None"))
      .def("hyperparameters", [](const optim::Optimizer& o) { return hyper_dict(o.hyperparameters()); },
           nb::sig("def hyperparameters(self) -> dict[str, typing.Any]"),
           "The current hyperparameters (lr, momentum, dampening, nesterov, beta1, beta2, eps, weight_decay).")
      .def("set_hyperparameters", [](optim::Optimizer& o, nb::dict changes) {
        // Every value converted and the whole set validated before anything changes.
        const char* name = optim::algorithm_name(o.algorithm());
        optim::Hyperparameters h = o.hyperparameters();
        for (auto [k, v] : changes) {
          const std::string key = nb::cast<std::string>(k);
          if (key == "lr") h.lr = number_of(v, name, "lr");
          else if (key == "momentum") h.momentum = number_of(v, name, "momentum");
          else if (key == "dampening") h.dampening = number_of(v, name, "dampening");
          else if (key == "beta1") h.beta1 = number_of(v, name, "betas[0]");
          else if (key == "beta2") h.beta2 = number_of(v, name, "betas[1]");
          else if (key == "eps") h.eps = number_of(v, name, "eps");
          else if (key == "weight_decay") h.weight_decay = number_of(v, name, "weight_decay");
          else if (key == "nesterov") {
            if (!PyBool_Check(v.ptr()))
              sw::raise<sw::TypeError>(name, ": nesterov must be a bool, got ", nb::type_name(v.type()).c_str());
            h.nesterov = v.ptr() == Py_True;
          } else {
            sw::raise<sw::ValueError>(name, ": no hyperparameter named '", key, "'");
          }
        }
        GilRelease nogil;
        o.set_hyperparameters(h);
      }, nb::arg("changes"), nb::sig("def set_hyperparameters(self, changes: dict[str, typing.Any]) -> None"),
      "Replaces the named hyperparameters, validated together as the constructor validates them (ValueError, "
      "nothing changed); the next step uses them.")
      .def("step", [](optim::Optimizer& o) {
        GilRelease nogil;
        o.step();
      }, "One step over every parameter with a gradient, tile by tile.")
      .def("save_state", [](const optim::Optimizer& o, const std::string& path) {
        GilRelease nogil;
        o.save_state(path);
      }, nb::arg("path"), "Writes the state, step counts and hyperparameters to a safetensors file (atomic).")
      .def("load_state", [](optim::Optimizer& o, const std::string& path) {
        GilRelease nogil;
        o.load_state(path);
      }, nb::arg("path"), "Restores a file of save_state, tile by tile under the budget.")
      .def("zero_grad", &optim::Optimizer::zero_grad, "Drops every parameter's gradient (.grad = None).")
      .def_prop_ro("step_in_backward", &optim::Optimizer::step_in_backward,
                   "Whether tiles are stepped in backward, the moment their gradient is final.")
      .def_prop_rw("accumulating", &optim::Optimizer::accumulating,
                   [](optim::Optimizer& o, bool on) {
                     GilRelease nogil;
                     o.set_accumulating(on);
                   },
                   "While True, backward only adds into .grad (step_in_backward: micro-batches before the last).")
      .def_prop_rw("prefetch", &optim::Optimizer::prefetch, &optim::Optimizer::set_prefetch,
                   "Whether a step promotes the next tile during the current tile's update (default False).")
      .def_prop_ro("params", [](const optim::Optimizer& o) { return o.params(); })
      .def_prop_ro("state_dtype", [](const optim::Optimizer& o) -> nb::object {
        switch (o.state_dtype()) {
          case optim::StateDType::Int8Blockwise: return nb::str("8bit");
          case optim::StateDType::BFloat16: return nb::cast(&sw::DType::BFloat16(), nb::rv_policy::reference);
          default: return nb::cast(&sw::DType::Float32(), nb::rv_policy::reference);
        }
      }, nb::for_getter(nb::sig("def state_dtype(self) -> DType | str")),
      "How the state is stored: DType.Float32, DType.BFloat16 or \"8bit\" (block-wise 8-bit).")
      .def_prop_ro("algorithm", [](const optim::Optimizer& o) { return std::string(optim::algorithm_name(o.algorithm())); })
      .def("state", [](const optim::Optimizer& o, const TensorPtr& param) {
        optim::ParameterState s = o.state(param);
        nb::dict d;
        d["step"] = nb::cast(s.steps);
        if (o.algorithm() == optim::Algorithm::SGD) {
          d["momentum_buffer"] = nb::cast(s.momentum_buffer);
        } else {
          d["exp_avg"] = nb::cast(s.exp_avg);
          d["exp_avg_sq"] = nb::cast(s.exp_avg_sq);
        }
        return d;
      }, nb::arg("param"), nb::sig("def state(self, param: Tensor) -> dict[str, typing.Any]"))
      .def("stats", [](const optim::Optimizer& o) {
        optim::OptimizerStats s = o.stats();
        nb::dict d;
        d["steps"] = s.steps;
        d["tiles_stepped"] = s.tiles_stepped;
        d["tiles_skipped"] = s.tiles_skipped;
        d["prefetches"] = s.prefetches;
        d["tiles_stepped_in_backward"] = s.tiles_stepped_in_backward;
        d["weights"] = traffic(s.weights);
        d["gradients"] = traffic(s.gradients);
        d["state"] = traffic(s.state);
        return d;
      }, nb::sig("def stats(self) -> dict[str, typing.Any]"));
}

}  // namespace swpy
