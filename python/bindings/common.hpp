// Shared helpers of the nanobind bindings: Python <-> C++ value conversion.
// Only errors.cpp translates C++ exceptions into Python ones; the helpers here
// throw the engine's own error types.
#pragma once

#include <nanobind/nanobind.h>

#include <exception>
#include <type_traits>

#include "strideweave/dtype.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/layout.hpp"

namespace nb = nanobind;

namespace swpy {

void bind_errors(nb::module_& m);
void bind_dtype(nb::module_& m);
void bind_layout(nb::module_& m);
void bind_carriers(nb::module_& m);
void bind_tensor(nb::module_& m);
void bind_dlpack(nb::module_& m);  // after bind_tensor: it adds Tensor's DLPack methods
void bind_completion(nb::module_& m);
void bind_extension(nb::module_& m);
void bind_ops(nb::module_& m);
void bind_tiled(nb::module_& m);
void bind_tensor_operators(nb::module_& m);

// Sets the Python error indicator for a C++ exception (the one translation point, errors.cpp).
void set_python_error(std::exception_ptr error);

// Note [Threads at interpreter exit]. Once CPython finalizes, a thread other than the finalizing
// (main) one must not take the GIL back: CPython ends such a thread with pthread_exit, and the forced
// unwinding aborts the process ("terminate called without an active exception") as soon as it crosses
// a noexcept frame such as a GIL guard's destructor. A daemon thread blocked in AwaitResult.wait() and
// a library thread finishing work after the exit drain (module.cpp) gave up both meet it. Every GIL
// transition of the bindings therefore goes through GilRelease / GilAcquire below, and the exit drain
// calls settle_threads_at_exit(): from then on no other thread takes the GIL back through them.
// (CPython offers no way to take the GIL without that risk, so a thread already blocked on the GIL
// inside CPython itself when finalization starts is beyond reach; the drain makes that window small.)
// This is not the interpreter's main thread, and CPython finalizes (or, with `or_exiting`, the exit drain
// has run: GilRelease parks from then on; taking the GIL for a callback stays allowed until finalization,
// so that atexit handlers that run after the drain can still use user-defined carriers).
bool finalizing_elsewhere(bool or_exiting = false) noexcept;
void remember_main_thread() noexcept;  // at module init
// Marks the interpreter as exiting, then (GIL released, bounded) lets every thread inside a GilRelease
// scope reach its end, where it parks.
void settle_threads_at_exit() noexcept;

// Releases the GIL for its scope. A thread that would take it back while the interpreter finalizes
// parks until the process ends instead (it has nothing left to return to).
class GilRelease {
 public:
  GilRelease() noexcept;
  ~GilRelease();
  GilRelease(const GilRelease&) = delete;
  GilRelease& operator=(const GilRelease&) = delete;

 private:
  PyThreadState* state_;
};

// Takes the GIL (for library threads calling user callbacks); raises RuntimeError instead once the
// interpreter finalizes on another thread, so the request fails rather than the process.
class GilAcquire {
 public:
  GilAcquire();
  ~GilAcquire() { PyGILState_Release(state_); }
  GilAcquire(const GilAcquire&) = delete;
  GilAcquire& operator=(const GilAcquire&) = delete;

 private:
  PyGILState_STATE state_;
};

// Note [Calling into Python from engine threads]. The engine calls user code (a storage provider, a transfer
// provider, a residency policy) from whichever thread runs the work: an I/O pool thread, a thread waiting on a
// handle, the caller's own thread. Every such call goes through call_into_python: it takes the GIL (GilAcquire,
// so it fails with RuntimeError instead of the process once the interpreter finalizes) and runs the callback with
// grad mode off (a callback's tensor operations are the engine's internals, never recorded: docs/guide.md,
// "Adding a carrier kind"). `f` returns a C++ value: a Python object must not outlive the GIL held here.
template <class F>
decltype(auto) call_into_python(F&& f) {
  static_assert(!std::is_base_of_v<nb::handle, std::decay_t<std::invoke_result_t<F&>>>,
                "call_into_python returns C++ values; a Python object would be dropped without the GIL");
  GilAcquire gil;
  sw::GradModeGuard off(false);
  return f();
}

// A Python object that may be dropped from any thread: the GIL is taken to release it (during
// interpreter finalization a library thread leaks it instead: Note [Threads at interpreter exit]).
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

// The NumPy dtype of a 16-bit float dtype's elements: ml_dtypes.bfloat16 for BFloat16, numpy.float16 for Float16.
// Arrays of them are made as uint16 arrays of the same bits and viewed as this dtype (no copy).
nb::object numpy_half_dtype(const sw::DType& d);

}  // namespace swpy
