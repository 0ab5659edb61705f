// The one place where C++ errors become Python exceptions.
#include "common.hpp"
#include "strideweave/errors.hpp"

namespace swpy {

void bind_errors(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const sw::Error& e) {
      PyObject* type = PyExc_RuntimeError;
      switch (e.kind()) {
        case sw::ErrorKind::Type: type = PyExc_TypeError; break;
        case sw::ErrorKind::Value: type = PyExc_ValueError; break;
        case sw::ErrorKind::Runtime: type = PyExc_RuntimeError; break;
        case sw::ErrorKind::Index: type = PyExc_IndexError; break;
        case sw::ErrorKind::NotImplemented: type = PyExc_NotImplementedError; break;
        case sw::ErrorKind::Overflow: type = PyExc_OverflowError; break;
        case sw::ErrorKind::Internal: type = PyExc_SystemError; break;
      }
      PyErr_SetString(type, e.what());
    }
  });
}

}  // namespace swpy
