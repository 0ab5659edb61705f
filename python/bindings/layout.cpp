// Shape, Stride, Layout and the dense-layout helpers.
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"
#include "typing.hpp"
#include "strideweave/errors.hpp"

namespace swpy {

namespace {

size_t mode_index(nb::handle key, size_t rank, const char* kind) {
  if (PyBool_Check(key.ptr()) || !is_index(key))
    sw::raise<sw::TypeError>(kind, " indices must be ints");
  nb::object v = nb::steal(PyNumber_Index(key.ptr()));
  if (!v.is_valid()) throw nb::python_error();
  int overflow = 0;
  long long k = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow) sw::raise<sw::IndexError>(kind, " mode index out of range for rank ", rank);
  if (k < 0) k += static_cast<int64_t>(rank);
  if (k < 0 || k >= static_cast<int64_t>(rank))
    sw::raise<sw::IndexError>(kind, " mode index out of range for rank ", rank);
  return static_cast<size_t>(k);
}

// Shape(*modes): a single iterable argument is the mode list.
sw::IntTuple modes_from_args(const nb::args& args, const char* kind) {
  if (args.size() == 1) {
    nb::handle only = args[0];
    if (!is_index(only) && !PyBool_Check(only.ptr()) && !PyUnicode_Check(only.ptr())) {
      PyObject* it = PyObject_GetIter(only.ptr());
      if (it) {
        Py_DECREF(it);
        return parse_modes(only, kind);
      }
      PyErr_Clear();
    }
  }
  return parse_modes(args, kind);
}

template <class T>
nb::tuple sub_list(const T& value) {
  nb::list out;
  for (size_t k = 0; k < value.rank(); ++k) out.append(nb::cast(value.mode(k)));
  return nb::tuple(out);
}

}  // namespace

void bind_layout(nb::module_& m) {
  using sw::Layout;
  using sw::Shape;
  using sw::Stride;

  nb::class_<Shape>(m, "Shape",
                    "Shape(*modes): a tree of extents >= 1. Ordering is first-mode-fastest at every level.")
      .def("__init__", [](Shape* self, nb::args args) { new (self) Shape(modes_from_args(args, "Shape")); },
           nb::sig("def __init__(self, *modes: " SW_PY_KEY ") -> None"))
      .def("__len__", &Shape::rank)
      .def("__getitem__", [](const Shape& s, nb::handle k) { return s.mode(mode_index(k, s.rank(), "Shape")); },
           nb::arg("k").none(), nb::sig("def __getitem__(self, k: " SW_PY_INDEX ") -> Shape"))
      .def("__iter__", [](const Shape& s) { return nb::iter(sub_list(s)); })
      .def_prop_ro("size", &Shape::size)
      .def_prop_ro("rank", &Shape::rank)
      .def_prop_ro("extents", [](const Shape& s) { return nb::tuple(nb::cast(s.extents())); })
      .def_prop_ro("depth", &Shape::depth)
      .def("decode", [](const Shape& s, nb::handle i) { return coord_to_python(s.decode(index_value(i, "ordinal"))); },
           nb::arg("ordinal").none(), nb::sig("def decode(self, ordinal: " SW_PY_INDEX ") -> int | tuple"),
           "The coordinate of a logical ordinal (first mode fastest).")
      .def("encode", [](const Shape& s, nb::handle c) { return s.encode(parse_coord(c)); }, nb::arg("coord").none(),
           nb::sig("def encode(self, coord: " SW_PY_KEY ") -> int"),
           "The ordinal of a coordinate; any subtree may be given as one integer ordinal.")
      .def("__eq__", [](const Shape& a, nb::handle b) {
        return nb::isinstance<Shape>(b) && a == nb::cast<const Shape&>(b);
      })
      .def("__ne__", [](const Shape& a, nb::handle b) {
        return !(nb::isinstance<Shape>(b) && a == nb::cast<const Shape&>(b));
      })
      .def("__hash__", [](const Shape& s) { return static_cast<Py_hash_t>(s.hash() >> 1); })
      .def("__repr__", [](const Shape& s) { return "Shape(" + s.str() + ")"; })
      .def("__reduce__", [](const Shape& s) {
        return nb::make_tuple(nb::type<Shape>(), nb::make_tuple(coord_to_python(s.tree())));
      });

  nb::class_<Stride>(m, "Stride", "Stride(*modes): a tree of strides >= 0 (0 broadcasts), congruent to a Shape.")
      .def("__init__", [](Stride* self, nb::args args) { new (self) Stride(modes_from_args(args, "Stride")); },
           nb::sig("def __init__(self, *modes: " SW_PY_KEY ") -> None"))
      .def("__len__", &Stride::rank)
      .def("__getitem__", [](const Stride& s, nb::handle k) { return s.mode(mode_index(k, s.rank(), "Stride")); },
           nb::arg("k").none(), nb::sig("def __getitem__(self, k: " SW_PY_INDEX ") -> Stride"))
      .def("__iter__", [](const Stride& s) { return nb::iter(sub_list(s)); })
      .def_prop_ro("rank", &Stride::rank)
      .def("__eq__", [](const Stride& a, nb::handle b) {
        return nb::isinstance<Stride>(b) && a == nb::cast<const Stride&>(b);
      })
      .def("__ne__", [](const Stride& a, nb::handle b) {
        return !(nb::isinstance<Stride>(b) && a == nb::cast<const Stride&>(b));
      })
      .def("__hash__", [](const Stride& s) { return static_cast<Py_hash_t>(s.hash() >> 1); })
      .def("__repr__", [](const Stride& s) { return "Stride(" + s.str() + ")"; })
      .def("__reduce__", [](const Stride& s) {
        return nb::make_tuple(nb::type<Stride>(), nb::make_tuple(coord_to_python(s.tree())));
      });

  nb::class_<Layout>(m, "Layout", "Layout(shape, stride): maps logical coordinates to physical slot offsets.")
      .def("__init__", [](Layout* self, nb::handle shape, nb::handle stride) {
        Shape sh = to_shape(shape);  // shape first: errors name the first bad argument
        new (self) Layout(std::move(sh), to_stride(stride));
      }, nb::arg("shape").none(), nb::arg("stride").none(),
         nb::sig("def __init__(self, shape: Shape | collections.abc.Iterable, stride: Stride | collections.abc.Iterable) -> None"))
      .def_prop_ro("shape", [](const Layout& l) { return l.shape(); })
      .def_prop_ro("stride", [](const Layout& l) { return l.stride(); })
      .def_prop_ro("size", &Layout::size)
      .def_prop_ro("rank", &Layout::rank)
      .def_prop_ro("cosize", &Layout::cosize)
      .def_prop_ro("is_injective", &Layout::is_injective)
      .def("__len__", &Layout::rank)
      .def("__getitem__", [](const Layout& l, nb::handle k) { return l.mode(mode_index(k, l.rank(), "Layout")); },
           nb::arg("k").none(), nb::sig("def __getitem__(self, k: " SW_PY_INDEX ") -> Layout"))
      .def("__iter__", [](const Layout& l) { return nb::iter(sub_list(l)); })
      .def("index", [](const Layout& l, nb::handle key) { return l.index(parse_coord(key)); }, nb::arg("key").none(),
           nb::sig("def index(self, key: " SW_PY_KEY ") -> int"),
           "Physical offset of a logical ordinal or coordinate.")
      .def("__call__", [](const Layout& l, nb::handle key) { return l.index(parse_coord(key)); }, nb::arg("key").none(),
           nb::sig("def __call__(self, key: " SW_PY_KEY ") -> int"))
      .def("broadcast_to", [](const Layout& l, nb::handle shape) { return l.broadcast_to(to_shape(shape)); },
           nb::arg("shape").none(), nb::sig("def broadcast_to(self, shape: Shape | collections.abc.Iterable) -> Layout"),
           "Extent-1 leaves take the target extent with stride 0; nothing else may change.")
      .def("__eq__", [](const Layout& a, nb::handle b) {
        return nb::isinstance<Layout>(b) && a == nb::cast<const Layout&>(b);
      })
      .def("__ne__", [](const Layout& a, nb::handle b) {
        return !(nb::isinstance<Layout>(b) && a == nb::cast<const Layout&>(b));
      })
      .def("__hash__", [](const Layout& l) { return static_cast<Py_hash_t>(l.hash() >> 1); })
      .def("__repr__", [](const Layout& l) { return "Layout(" + l.str() + ")"; })
      .def("__reduce__", [](const Layout& l) { return nb::make_tuple(nb::type<Layout>(), nb::make_tuple(l.shape(), l.stride())); });

  // *extents: ints and nested iterables of ints, or one iterable of modes (nb::args has no type of its own, so the
  // signature is spelled out, as for Shape(*modes) and Stride(*modes)).
  m.def("column_major", [](nb::args extents) { return sw::column_major(Shape(modes_from_args(extents, "Shape"))); },
        nb::sig("def column_major(*extents: " SW_PY_KEY ") -> Layout"),
        "The canonical dense layout: first mode fastest at every depth.");
  m.def("row_major", [](nb::args extents) { return sw::row_major(Shape(modes_from_args(extents, "Shape"))); },
        nb::sig("def row_major(*extents: " SW_PY_KEY ") -> Layout"),
        "Last mode fastest at every depth: row_major(2, 3, 4) has strides (12, 4, 1).");
}

}  // namespace swpy
