// Views with autograd (strideweave/views.hpp): sw.narrow, sw.chunk, sw.permute, sw.reshape, sw.reshape_is_view and
// the Tensor methods of the same names.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/views.hpp"

namespace swpy {

namespace {

using sw::TensorPtr;

TensorPtr tensor_arg(nb::handle h, const char* op) {
  if (!nb::isinstance<sw::TensorImpl>(h))
    sw::raise<sw::TypeError>(op, ": t must be a Tensor, got ", nb::type_name(h.type()).c_str());
  return nb::cast<TensorPtr>(h);
}

int64_t int_arg(nb::handle h, const char* op, const char* name) {
  const std::string what = std::string(op) + ": " + name;
  return index_value(h, what.c_str());
}

std::vector<int64_t> ints_arg(nb::handle h, const char* op, const char* name) {
  if (is_index(h) || PyBool_Check(h.ptr()) || PyUnicode_Check(h.ptr()) || !nb::hasattr(h, "__iter__"))
    sw::raise<sw::TypeError>(op, ": ", name, " must be a sequence of ints, got ", nb::type_name(h.type()).c_str());
  std::vector<int64_t> out;
  for (nb::handle x : nb::iter(h)) out.push_back(int_arg(x, op, name));
  return out;
}

// A Shape, a flat sequence of ints (one may be -1), or nested sequences of ints (a hierarchical shape).
bool flat_ints(nb::handle h) {
  if (nb::isinstance<sw::Shape>(h) || is_index(h) || PyBool_Check(h.ptr()) || PyUnicode_Check(h.ptr()) ||
      !nb::hasattr(h, "__iter__"))
    return false;
  for (nb::handle x : nb::iter(h))
    if (!is_index(x)) return false;
  return true;
}

void check_shape_arg(nb::handle shape, const char* op) {
  if (PyUnicode_Check(shape.ptr()) || PyBytes_Check(shape.ptr()))
    sw::raise<sw::TypeError>(op, ": shape must be a Shape or a sequence of ints, got ", nb::type_name(shape.type()).c_str());
}

TensorPtr reshape_of(nb::handle t, nb::handle shape) {
  TensorPtr x = tensor_arg(t, "reshape");
  check_shape_arg(shape, "reshape");
  if (flat_ints(shape)) return sw::reshape(x, ints_arg(shape, "reshape", "shape"));
  return sw::reshape(x, to_shape(shape));
}

bool reshape_is_view_of(nb::handle t, nb::handle shape) {
  TensorPtr x = tensor_arg(t, "reshape_is_view");
  check_shape_arg(shape, "reshape_is_view");
  if (flat_ints(shape))
    return sw::reshape_is_view(x, sw::infer_reshape_extents(ints_arg(shape, "reshape", "shape"), x->size()));
  return sw::reshape_is_view(x, to_shape(shape));
}

TensorPtr narrow_of(nb::handle t, nb::handle mode, nb::handle start, nb::handle length) {
  return sw::narrow(tensor_arg(t, "narrow"), int_arg(mode, "narrow", "mode"), int_arg(start, "narrow", "start"),
                    int_arg(length, "narrow", "length"));
}

std::vector<TensorPtr> chunk_of(nb::handle t, nb::handle n, nb::handle mode) {
  return sw::chunk(tensor_arg(t, "chunk"), int_arg(n, "chunk", "n"), int_arg(mode, "chunk", "mode"));
}

TensorPtr permute_of(nb::handle t, nb::handle order) {
  return sw::permute(tensor_arg(t, "permute"), ints_arg(order, "permute", "order"));
}

#define SW_T "strideweave._core.Tensor"
#define SW_SHAPE "strideweave._core.Shape | collections.abc.Sequence[typing.Any]"

}  // namespace

void bind_views(nb::module_& m) {
  m.def("narrow", &narrow_of, nb::arg("t").none(), nb::arg("mode").none(), nb::arg("start").none(),
        nb::arg("length").none(),
        nb::sig("def narrow(t: " SW_T ", mode: int, start: int, length: int) -> " SW_T),
        "Ordinals [start, start + length) of top-level mode `mode`: a view (no copy) with autograd.");
  m.def("chunk", &chunk_of, nb::arg("t").none(), nb::arg("n").none(), nb::arg("mode").none(),
        nb::sig("def chunk(t: " SW_T ", n: int, mode: int) -> list[" SW_T "]"),
        "Views of `mode` in pieces of ceil(extent / n) ordinals, the last possibly smaller (torch.chunk's rule).");
  m.def("permute", &permute_of, nb::arg("t").none(), nb::arg("order").none(),
        nb::sig("def permute(t: " SW_T ", order: collections.abc.Sequence[int]) -> " SW_T),
        "Top-level modes reordered (result mode i is mode order[i]): a view with autograd.");
  m.def("reshape", &reshape_of, nb::arg("t").none(), nb::arg("shape").none(),
        nb::sig("def reshape(t: " SW_T ", shape: " SW_SHAPE ") -> " SW_T),
        "The elements in colex (first-mode-fastest) order under `shape`: a view when the layout can express it "
        "(reshape_is_view), else a fresh dense tensor of the same carrier kind.");
  m.def("reshape_is_view", &reshape_is_view_of, nb::arg("t").none(), nb::arg("shape").none(),
        nb::sig("def reshape_is_view(t: " SW_T ", shape: " SW_SHAPE ") -> bool"),
        "Whether reshape(t, shape) is a view of t (True) or a copy (False).");

  nb::handle tensor = nb::type<sw::TensorImpl>();
  tensor.attr("narrow") = nb::cpp_function(&narrow_of, nb::is_method(), nb::arg("mode").none(), nb::arg("start").none(),
                                           nb::arg("length").none(),
                                           nb::sig("def narrow(self, mode: int, start: int, length: int) -> " SW_T));
  tensor.attr("chunk") = nb::cpp_function(&chunk_of, nb::is_method(), nb::arg("n").none(), nb::arg("mode").none(),
                                          nb::sig("def chunk(self, n: int, mode: int) -> list[" SW_T "]"));
  tensor.attr("permute") = nb::cpp_function(
      &permute_of, nb::is_method(), nb::arg("order").none(),
      nb::sig("def permute(self, order: collections.abc.Sequence[int]) -> " SW_T));
  tensor.attr("reshape") = nb::cpp_function(&reshape_of, nb::is_method(), nb::arg("shape").none(),
                                            nb::sig("def reshape(self, shape: " SW_SHAPE ") -> " SW_T));
}

}  // namespace swpy
