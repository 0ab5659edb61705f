// Shared helpers of the nanobind bindings: Python <-> C++ value conversion.
// Only errors.cpp translates C++ exceptions into Python ones; the helpers here
// throw the engine's own error types.
#pragma once

#include <nanobind/nanobind.h>

#include <exception>

#include "strideweave/dtype.hpp"
#include "strideweave/layout.hpp"

namespace nb = nanobind;

namespace swpy {

void bind_errors(nb::module_& m);
void bind_dtype(nb::module_& m);
void bind_layout(nb::module_& m);
void bind_carriers(nb::module_& m);
void bind_tensor(nb::module_& m);
void bind_completion(nb::module_& m);
void bind_extension(nb::module_& m);
void bind_ops(nb::module_& m);
void bind_tiled(nb::module_& m);
void bind_tensor_operators(nb::module_& m);

// Sets the Python error indicator for a C++ exception (the one translation point, errors.cpp).
void set_python_error(std::exception_ptr error);

// A Python object that may be dropped from any thread: the GIL is taken to release it.
struct GilObject {
  explicit GilObject(nb::object o) : obj(std::move(o)) {}
  ~GilObject();
  GilObject(const GilObject&) = delete;
  GilObject& operator=(const GilObject&) = delete;
  nb::object obj;
};

// The DType singleton object for a C++ dtype; a non-DType argument raises TypeError with `what`.
const sw::DType& to_dtype(nb::handle h, const char* what = "dtype must be a DType");

// An int that is not a bool (Python int or anything with __index__).
bool is_index(nb::handle h);
// Exact int64 value of an index object; values outside int64 raise `overflow` kind.
int64_t index_value(nb::handle h, const char* what);

// Shape/Stride mode lists from Python: ints, nested iterables, or Shape/Stride objects.
sw::IntTuple parse_modes(nb::handle modes, const char* kind);
// A coordinate: an int ordinal or a nested iterable of coordinates.
sw::Coord parse_coord(nb::handle key);
nb::object coord_to_python(const sw::IntTuple& c);

sw::Shape to_shape(nb::handle h);    // a Shape, or an iterable mode list
sw::Stride to_stride(nb::handle h);  // a Stride, or an iterable mode list

sw::Value to_value(nb::handle h);
nb::object from_value(const sw::Value& v);

}  // namespace swpy
