// Python <-> C++ conversions shared by every binding file.
#include <string>

#include "common.hpp"
#include "strideweave/errors.hpp"

namespace swpy {

namespace {

std::string py_type_name(nb::handle h) { return nb::type_name(h.type()).c_str(); }

bool is_text(nb::handle h) { return PyUnicode_Check(h.ptr()) || PyBytes_Check(h.ptr()) || PyByteArray_Check(h.ptr()); }

bool is_iterable(nb::handle h) {
  if (is_text(h)) return false;
  PyObject* it = PyObject_GetIter(h.ptr());
  if (!it) {
    PyErr_Clear();
    return false;
  }
  Py_DECREF(it);
  return true;
}

sw::IntTuple parse_tree(nb::handle h, const char* kind, int depth) {
  if (depth > 64) sw::raise<sw::ValueError>(kind, " nesting is deeper than 64 levels");
  if (nb::isinstance<sw::Shape>(h)) return nb::cast<const sw::Shape&>(h).tree();
  if (nb::isinstance<sw::Stride>(h)) return nb::cast<const sw::Stride&>(h).tree();
  if (PyBool_Check(h.ptr()))
    sw::raise<sw::TypeError>(kind, " entries must be ints or nested iterables of ints, got bool");
  if (is_index(h)) {
    int overflow = 0;
    nb::object v = nb::steal(PyNumber_Index(h.ptr()));
    if (!v.is_valid()) throw nb::python_error();
    long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
    if (overflow > 0) sw::raise<sw::ValueError>(kind, " entry exceeds 2**62");
    if (overflow < 0) sw::raise<sw::ValueError>(kind, " entries must be non-negative");
    return sw::IntTuple(static_cast<int64_t>(x));
  }
  if (!is_iterable(h))
    sw::raise<sw::TypeError>(kind, " entries must be ints or nested iterables of ints, got ", py_type_name(h));
  std::vector<sw::IntTuple> children;
  for (nb::handle item : nb::iter(h)) children.push_back(parse_tree(item, kind, depth + 1));
  return sw::IntTuple::tuple(std::move(children));
}

}  // namespace

bool is_index(nb::handle h) {
  if (PyBool_Check(h.ptr())) return false;
  if (PyLong_Check(h.ptr())) return true;
  // NumPy arrays define __index__ (only 0-d integer arrays convert); an iterable
  // one is a mode list or a coordinate, not an int.
  return PyIndex_Check(h.ptr()) && !is_iterable(h);
}

int64_t index_value(nb::handle h, const char* what) {
  if (!is_index(h)) sw::raise<sw::TypeError>(what, " must be an int, got ", py_type_name(h));
  nb::object v = nb::steal(PyNumber_Index(h.ptr()));
  if (!v.is_valid()) throw nb::python_error();
  int overflow = 0;
  long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow) {
    // An int too long to print (CPython refuses str() past 4300 digits) is named by its size.
    const size_t bits = _PyLong_NumBits(v.ptr());
    const std::string shown = bits <= 256 ? std::string(nb::str(v).c_str())
                                          : (overflow < 0 ? "(a negative int of " : "(an int of ") +
                                                std::to_string(bits) + " bits)";
    sw::raise<sw::ValueError>(what, " ", shown, " is out of range (an int64: from -9223372036854775808 to "
                              "9223372036854775807)");
  }
  return x;
}

sw::IntTuple parse_modes(nb::handle modes, const char* kind) {
  sw::IntTuple t = parse_tree(modes, kind, 0);
  if (t.is_leaf()) sw::raise<sw::TypeError>(kind, " modes must be an iterable");
  return t;
}

namespace {
// Recursion is bounded like parse_tree's: a hostile, deeply nested key must not exhaust the C++ stack.
sw::Coord parse_coord_at(nb::handle key, int depth) {
  if (depth > 64) sw::raise<sw::ValueError>("coordinate nesting is deeper than 64 levels");
  if (PyBool_Check(key.ptr())) sw::raise<sw::TypeError>("coordinates must be ints or tuples of them, got bool");
  if (is_index(key)) return sw::IntTuple(index_value(key, "coordinate"));
  if (!is_iterable(key))
    sw::raise<sw::TypeError>("coordinates must be ints or tuples of them, got ", py_type_name(key));
  std::vector<sw::IntTuple> children;
  for (nb::handle item : nb::iter(key)) children.push_back(parse_coord_at(item, depth + 1));
  return sw::IntTuple::tuple(std::move(children));
}
}  // namespace

sw::Coord parse_coord(nb::handle key) { return parse_coord_at(key, 0); }

nb::object coord_to_python(const sw::IntTuple& c) {
  if (c.is_leaf()) return nb::int_(c.value());
  nb::list out;
  for (const auto& child : c.children()) out.append(coord_to_python(child));
  return nb::tuple(out);
}

sw::Shape to_shape(nb::handle h) {
  if (nb::isinstance<sw::Shape>(h)) return nb::cast<sw::Shape>(h);
  if (is_index(h) || PyBool_Check(h.ptr()) || !is_iterable(h))
    sw::raise<sw::TypeError>("expected a Shape or an iterable of modes, got ", py_type_name(h));
  return sw::Shape(parse_modes(h, "Shape"));
}

sw::Stride to_stride(nb::handle h) {
  if (nb::isinstance<sw::Stride>(h)) return nb::cast<sw::Stride>(h);
  if (is_index(h) || PyBool_Check(h.ptr()) || !is_iterable(h))
    sw::raise<sw::TypeError>("expected a Stride or an iterable of modes, got ", py_type_name(h));
  return sw::Stride(parse_modes(h, "Stride"));
}

sw::Value to_value(nb::handle h) {
  if (PyBool_Check(h.ptr())) return sw::Value::from_bool(h.ptr() == Py_True);
  if (PyFloat_Check(h.ptr())) return sw::Value::from_float(PyFloat_AS_DOUBLE(h.ptr()));
  if (PyLong_Check(h.ptr())) {
    int overflow = 0;
    long long x = PyLong_AsLongLongAndOverflow(h.ptr(), &overflow);
    if (!overflow) return sw::Value::from_int(x);
    double d = PyLong_AsDouble(h.ptr());
    if (d == -1.0 && PyErr_Occurred()) {
      PyErr_Clear();
      d = overflow > 0 ? HUGE_VAL : -HUGE_VAL;
    }
    return sw::Value::from_big_int(d);
  }
  if (is_index(h)) return sw::Value::from_int(index_value(h, "element value"));  // NumPy integers
  if (nb::hasattr(h, "dtype") && nb::hasattr(h, "item") && PyNumber_Check(h.ptr()))  // NumPy scalars
    return to_value(h.attr("item")());
  sw::raise<sw::TypeError>("element values must be float, int or bool, got ", py_type_name(h));
}

nb::object from_value(const sw::Value& v) {
  switch (v.kind) {
    case sw::Value::Kind::Float:
    case sw::Value::Kind::BigInt: return nb::float_(v.f);
    case sw::Value::Kind::Int: return nb::int_(v.i);
    case sw::Value::Kind::Bool: return nb::bool_(v.b);
  }
  return nb::none();
}

nb::object numpy_half_dtype(const sw::DType& d) {
  nb::object numpy = nb::module_::import_("numpy");
  if (d.id() == sw::DTypeId::BFloat16) return numpy.attr("dtype")(nb::module_::import_("ml_dtypes").attr("bfloat16"));
  return numpy.attr("dtype")(numpy.attr("float16"));
}

}  // namespace swpy
