// The one place where C++ errors become Python exceptions.
#include <chrono>
#include <new>
#include <thread>

#include "common.hpp"
#include "strideweave/errors.hpp"

namespace swpy {

void set_python_error(std::exception_ptr p) {
  try {
    std::rethrow_exception(p);
  } catch (nb::python_error& e) {
    e.restore();  // a Python exception raised by user code keeps its identity
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
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
}

bool finalizing_elsewhere() noexcept {
#if PY_VERSION_HEX >= 0x030D0000
  const bool finalizing = Py_IsFinalizing();
#else
  const bool finalizing = _Py_IsFinalizing();
#endif
  return finalizing && !_PyOS_IsMainThread();
}

GilRelease::~GilRelease() {
  if (finalizing_elsewhere())  // Note [Threads at interpreter exit]
    for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
  PyEval_RestoreThread(state_);
}

GilAcquire::GilAcquire() {
  if (finalizing_elsewhere())
    sw::raise<sw::RuntimeError>("the Python interpreter is shutting down; a Python callback cannot run");
  state_ = PyGILState_Ensure();
}

GilObject::~GilObject() {
  if (!obj.is_valid()) return;
  if (!nb::is_alive() || finalizing_elsewhere()) {
    obj.release();  // the interpreter is gone or going: leak rather than touch it
    return;
  }
  GilAcquire gil;
  obj.reset();
}

void bind_errors(nb::module_& m) {
  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const sw::Error&) {
      set_python_error(p);
    }
  });
}

}  // namespace swpy
