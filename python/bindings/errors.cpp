// The one place where C++ errors become Python exceptions.
#include <atomic>
#include <chrono>
#include <new>
#include <typeinfo>
#include <thread>

#include "common.hpp"
#include "strideweave/errors.hpp"

namespace swpy {

namespace {
// Note [No C++ type names]: a conversion that nanobind could not make (nb::cast of an argument: a value of another
// type, an int beyond the C++ integer's range, a str with lone surrogates that has no UTF-8 form) throws
// nb::cast_error, which is std::bad_cast, whose what() is the C++ type name "std::bad_cast". Every argument the
// bindings convert is meant to be checked first, with a message naming it; this is the backstop for one that was
// not: a TypeError that says what failed instead of a RuntimeError naming a C++ type.
void set_cast_error() {
  PyErr_SetString(PyExc_TypeError,
                  "an argument could not be converted to what this call expects (a value of another type, an int "
                  "out of range, or a str that has no UTF-8 form); see the function's signature");
}
}  // namespace

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
      case sw::ErrorKind::Memory: type = PyExc_MemoryError; break;
      case sw::ErrorKind::Internal: type = PyExc_SystemError; break;
    }
    PyErr_SetString(type, e.what());
  } catch (const std::bad_alloc&) {
    PyErr_NoMemory();
  } catch (const std::bad_cast&) {
    set_cast_error();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  } catch (...) {
    PyErr_SetString(PyExc_RuntimeError, "unknown C++ exception");
  }
}

namespace {
std::atomic<bool> g_exiting{false};
std::atomic<int> g_released{0};  // threads inside a GilRelease scope (until the GIL is back), not parked
std::atomic<unsigned long> g_main_thread{0};

[[noreturn]] void park() {
  for (;;) std::this_thread::sleep_for(std::chrono::hours(1));
}
}  // namespace

void remember_main_thread() noexcept {
  // The module is imported on the main thread in every ordinary program; threading knows for sure.
  unsigned long ident = PyThread_get_thread_ident();
  try {
    ident = nb::cast<unsigned long>(nb::module_::import_("threading").attr("main_thread")().attr("ident"));
  } catch (...) {
    PyErr_Clear();
  }
  g_main_thread.store(ident);
}

bool finalizing_elsewhere(bool or_exiting) noexcept {
  // Neither call needs the GIL: the thread ident is pthread_self, the flag an atomic of the runtime.
  if (PyThread_get_thread_ident() == g_main_thread.load()) return false;
  if (or_exiting && g_exiting.load()) return true;
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

void settle_threads_at_exit() noexcept {
  g_exiting.store(true);
  // The caller (the exit drain, on the main thread) is inside a GilRelease scope itself.
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(1);
  while (g_released.load() > 1 && std::chrono::steady_clock::now() < deadline)
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
}

GilRelease::GilRelease() noexcept : state_(PyEval_SaveThread()) { g_released.fetch_add(1); }

GilRelease::~GilRelease() {
  if (finalizing_elsewhere(/*or_exiting=*/true)) {  // Note [Threads at interpreter exit]
    g_released.fetch_sub(1);
    park();
  }
  // Counted until the GIL is back: settle_threads_at_exit() waits for threads blocked right here.
  PyEval_RestoreThread(state_);
  g_released.fetch_sub(1);
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
    } catch (const std::bad_cast&) {  // Note [No C++ type names]
      set_cast_error();
    }
  });
}

}  // namespace swpy
