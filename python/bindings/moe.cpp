// strideweave.moe.SparseMoE (strideweave/moe.hpp): a sparse Mixture-of-Experts block over tiled expert weights.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>

#include "common.hpp"
#include "completion_py.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/moe.hpp"

namespace swpy {

namespace {

using sw::TensorPtr;

TensorPtr tensor_arg(nb::handle h, const char* what) {
  if (!nb::isinstance<sw::TensorImpl>(h))
    sw::raise<sw::TypeError>("SparseMoE: ", what, " must be a Tensor, got ", nb::type_name(h.type()).c_str());
  return nb::cast<TensorPtr>(h);
}

#define SW_T "strideweave._core.Tensor"

}  // namespace

void bind_moe(nb::module_& m) {
  nb::class_<sw::SparseMoE>(
      m, "SparseMoE", nb::is_final(),
      "SparseMoE(w1, w2, w3, top_k=2, *, normalize=True, routing_dtype=None, budget=None): a sparse "
      "Mixture-of-Experts block with SwiGLU experts whose weights are tiled, one tile per expert "
      "(docs/guide.md, \"SparseMoE\").")
      .def("__init__", [](sw::SparseMoE* self, nb::handle w1, nb::handle w2, nb::handle w3, nb::handle top_k,
                          nb::handle normalize, nb::handle routing_dtype, nb::handle budget) {
        TensorPtr a = tensor_arg(w1, "w1"), b = tensor_arg(w2, "w2"), c = tensor_arg(w3, "w3");
        if (!is_index(top_k)) sw::raise<sw::TypeError>("SparseMoE: top_k must be an int, got ", nb::type_name(top_k.type()).c_str());
        const int64_t k = index_value(top_k, "SparseMoE: top_k");
        if (!PyBool_Check(normalize.ptr()))
          sw::raise<sw::TypeError>("SparseMoE: normalize must be a bool, got ", nb::type_name(normalize.type()).c_str());
        const sw::DType* rd = routing_dtype.is_none() ? nullptr : &to_dtype(routing_dtype, "SparseMoE: routing_dtype must be a DType or None");
        std::shared_ptr<sw::ResidencyBudget> bud;
        if (!budget.is_none()) {
          if (!nb::isinstance<sw::ResidencyBudget>(budget))
            sw::raise<sw::TypeError>("SparseMoE: budget must be a ResidencyBudget or None, got ",
                                     nb::type_name(budget.type()).c_str());
          bud = nb::cast<std::shared_ptr<sw::ResidencyBudget>>(budget);
        }
        const bool norm = normalize.ptr() == Py_True;
        GilRelease nogil;  // joining a budget may evict (I/O)
        new (self) sw::SparseMoE(a, b, c, k, norm, rd, std::move(bud));
      }, nb::arg("w1").none(), nb::arg("w2").none(), nb::arg("w3").none(), nb::arg("top_k").none() = 2, nb::kw_only(),
         nb::arg("normalize").none() = true, nb::arg("routing_dtype").none() = nb::none(),
         nb::arg("budget").none() = nb::none(),
         nb::sig("def __init__(self, w1: " SW_T ", w2: " SW_T ", w3: " SW_T ", top_k: int = 2, *, normalize: bool = "
                 "True, routing_dtype: DType | None = None, budget: ResidencyBudget | None = None) -> None"))
      .def("forward", [](sw::SparseMoE& s, nb::handle x, nb::handle rw) {
        TensorPtr a = tensor_arg(x, "x"), b = tensor_arg(rw, "router_weight");
        GilRelease nogil;
        return s.forward(a, b);
      }, nb::arg("x").none(), nb::arg("router_weight").none(),
         nb::sig("def forward(self, x: " SW_T ", router_weight: " SW_T ") -> " SW_T),
         "The block's output (T, H) for x (T, H) and router_weight (E, H): route, then experts.")
      .def("__call__", [](sw::SparseMoE& s, nb::handle x, nb::handle rw) {
        TensorPtr a = tensor_arg(x, "x"), b = tensor_arg(rw, "router_weight");
        GilRelease nogil;
        return s.forward(a, b);
      }, nb::arg("x").none(), nb::arg("router_weight").none(),
         nb::sig("def __call__(self, x: " SW_T ", router_weight: " SW_T ") -> " SW_T))
      .def("route", [](sw::SparseMoE& s, nb::handle x, nb::handle rw) {
        TensorPtr a = tensor_arg(x, "x"), b = tensor_arg(rw, "router_weight");
        sw::SparseMoE::Routing r;
        {
          GilRelease nogil;
          r = s.route(a, b);
        }
        return std::make_tuple(r.logits, r.weights, r.indices);
      }, nb::arg("x").none(), nb::arg("router_weight").none(),
         nb::sig("def route(self, x: " SW_T ", router_weight: " SW_T ") -> tuple[" SW_T ", " SW_T ", " SW_T "]"),
         "(logits (T, E) in the block's dtype, weights (T, top_k) in the routing dtype, indices (T, top_k) Int32).")
      .def("experts", [](sw::SparseMoE& s, nb::handle x, nb::handle w, nb::handle idx) {
        TensorPtr a = tensor_arg(x, "x"), b = tensor_arg(w, "weights"), c = tensor_arg(idx, "indices");
        GilRelease nogil;
        return s.experts(a, b, c);
      }, nb::arg("x").none(), nb::arg("weights").none(), nb::arg("indices").none(),
         nb::sig("def experts(self, x: " SW_T ", weights: " SW_T ", indices: " SW_T ") -> " SW_T),
         "The expert part alone, given a routing.")
      .def("prefetch", [](sw::SparseMoE& s, nb::handle idx) {
        TensorPtr c = tensor_arg(idx, "indices");
        sw::CompletionPtr<std::monostate> done;
        {
          GilRelease nogil;
          done = s.prefetch(c);
        }
        return done ? residency_await(done) : nb::object(nb::none());
      }, nb::arg("indices").none(), nb::sig("def prefetch(self, indices: " SW_T ") -> AwaitResidency | None"),
         "Starts promoting the tiles of the experts `indices` names (as many as the budget holds beside one expert "
         "at work); returns at once: a handle, or None when nothing needed promoting.")
      .def("stats", [](const sw::SparseMoE& s) {
        sw::MoEStats st = s.stats();
        nb::dict d;
        d["calls"] = st.calls;
        d["expert_visits"] = st.expert_visits;
        d["hits"] = st.hits;
        d["tiles_promoted"] = st.tiles_promoted;
        d["bytes_promoted"] = st.bytes_promoted;
        d["wait_seconds"] = st.wait_seconds;
        return d;
      }, nb::sig("def stats(self) -> dict[str, int | float]"),
         "calls, expert_visits (forward and backward), hits (visits whose tiles were resident), tiles_promoted and "
         "bytes_promoted (the three carriers' promotions), wait_seconds (time spent waiting for tiles).")
      .def("reset_stats", &sw::SparseMoE::reset_stats, "Restarts every statistic from zero.")
      .def_prop_ro("w1", [](const sw::SparseMoE& s) { return s.w1(); }, nb::sig("def w1(self) -> " SW_T))
      .def_prop_ro("w2", [](const sw::SparseMoE& s) { return s.w2(); }, nb::sig("def w2(self) -> " SW_T))
      .def_prop_ro("w3", [](const sw::SparseMoE& s) { return s.w3(); }, nb::sig("def w3(self) -> " SW_T))
      .def_prop_ro("top_k", &sw::SparseMoE::top_k)
      .def_prop_ro("normalize", &sw::SparseMoE::normalize)
      .def_prop_ro("num_experts", &sw::SparseMoE::num_experts)
      .def_prop_ro("hidden_size", &sw::SparseMoE::hidden_size)
      .def_prop_ro("intermediate_size", &sw::SparseMoE::intermediate_size)
      .def_prop_ro("dtype", [](const sw::SparseMoE& s) -> const sw::DType& { return s.dtype(); },
                   nb::rv_policy::reference)
      .def_prop_ro("routing_dtype", [](const sw::SparseMoE& s) -> const sw::DType& { return s.routing_dtype(); },
                   nb::rv_policy::reference)
      .def_prop_ro("budget", [](const sw::SparseMoE& s) { return s.budget(); },
                   nb::sig("def budget(self) -> ResidencyBudget | None"))
      .def("prefetch_depth", &sw::SparseMoE::prefetch_depth, nb::arg("backward") = false,
           "Experts kept in flight beside the one computing: 1, or 0 under a budget too small for two experts' "
           "tiles (and, in backward, their Float32 gradient tiles).")
      .def("__repr__", [](const sw::SparseMoE& s) {
        return "SparseMoE(experts=" + std::to_string(s.num_experts()) + ", hidden=" + std::to_string(s.hidden_size()) +
               ", intermediate=" + std::to_string(s.intermediate_size()) + ", top_k=" + std::to_string(s.top_k()) +
               ", dtype=" + s.dtype().name() + ")";
      });
}

}  // namespace swpy
