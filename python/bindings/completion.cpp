// AwaitResult and its subclasses; move_async / move.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <chrono>

#include "common.hpp"
#include "completion_py.hpp"
#include "typing.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/move.hpp"

namespace swpy {

nb::object AwaitHandle::wait_py() {
  if (!cached_result.is_valid() && !cached_error.is_valid()) {
    {
      // Note [Waiters help]: queued work the handle depends on (bounded: copies of tiles already resident) runs
      // here first; the interruptible wait below then only covers what other threads still do.
      swpy::GilRelease nogil;
      state->help();
    }
    while (true) {
      bool finished;
      {
        swpy::GilRelease nogil;
        finished = state->wait_for(std::chrono::milliseconds(20));
      }
      if (finished) break;
      if (PyErr_CheckSignals() != 0) throw nb::python_error();  // Ctrl-C
    }
    // Caching happens with the GIL held, so concurrent waiters observe one object.
    if (!cached_result.is_valid() && !cached_error.is_valid()) {
      if (auto e = state->error()) {
        set_python_error(e);
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyErr_NormalizeException(&type, &value, &tb);
        if (tb) PyException_SetTraceback(value, tb);
        cached_error = nb::steal(value);
        Py_XDECREF(type);
        Py_XDECREF(tb);
      } else {
        cached_result = result();
      }
    }
  }
  if (cached_error.is_valid()) {
    PyErr_SetObject((PyObject*)Py_TYPE(cached_error.ptr()), cached_error.ptr());
    throw nb::python_error();
  }
  return cached_result;
}

namespace {

// Note [Handle reference cycles]. A handle caches the exception its wait() raises, and raising it
// again appends the waiting frames to the exception's traceback; a frame that holds the handle (a
// local `h = c.promote_async(...)`) closes the cycle handle -> exception -> traceback -> frame ->
// handle through the C++ member cached_error, which the garbage collector cannot see without these
// slots. The handle owns both cached objects outright (C++ code never holds an AwaitHandle; its
// completion holds C++ values only), so they are always visited. tp_clear only drops the caches (slot
// emptied first: dropping may run any code): a cleared handle that is waited on again recomputes its
// result or error from the completion. AwaitMove, AwaitResidency and AwaitProjection inherit the slots.
int await_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));  // instances of heap types own a reference to their type
  if (!nb::inst_ready(self)) return 0;
  // Every handle class derives from AwaitHandle alone, so the instance pointer is an AwaitHandle*.
  auto* h = nb::inst_ptr<AwaitHandle>(self);
  Py_VISIT(h->cached_result.ptr());
  Py_VISIT(h->cached_error.ptr());
  return 0;
}

int await_clear(PyObject* self) {
  if (!nb::inst_ready(self)) return 0;
  auto* h = nb::inst_ptr<AwaitHandle>(self);
  nb::object result = std::move(h->cached_result), error = std::move(h->cached_error);
  return 0;
}

}  // namespace

// Every handle class passes these slots itself: a subclass of a weak-referenceable nanobind class that names no
// traverse slot of its own gets nanobind's default pair instead of inheriting these.
PyType_Slot await_slots[] = {{Py_tp_traverse, (void*)await_traverse}, {Py_tp_clear, (void*)await_clear}, {0, nullptr}};

void bind_completion(nb::module_& m) {
  nb::class_<AwaitHandle>(m, "AwaitResult", nb::type_slots(await_slots), nb::is_weak_referenceable(),
                          "A one-shot completion created by the framework: `done` and `wait()`. wait() returns the "
                          "same object (or raises the same exception) every time; handles never cancel work. In a child "
                          "of fork(), a handle whose work was in flight at the fork is done and raises RuntimeError "
                          "('created before fork'): that work runs only in the parent.")
      .def("__init__", [](AwaitHandle*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("AwaitResult handles are created by the framework, not constructed directly");
      })
      .def_prop_ro("done", [](const AwaitHandle& h) { return h.state->done(); })
      .def("wait", &AwaitHandle::wait_py, "Blocks until terminal (interruptibly, without the GIL); returns the result "
                                          "or raises the failure.")
      .def("__repr__", [](nb::handle self) {
        const AwaitHandle& h = nb::cast<const AwaitHandle&>(self);
        return std::string(nb::type_name(self.type()).c_str()) + (h.state->done() ? "(done)" : "(pending)");
      });
  nb::class_<AwaitMove, AwaitHandle>(m, "AwaitMove", nb::type_slots(await_slots),
                                     "AwaitResult[Tensor] of move_async and scatter.")
      .def("__init__", [](AwaitMove*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("AwaitMove handles are created by the framework, not constructed directly");
      })
      // The same wait, declared again only so that its signature names the result (a Tensor).
      .def("wait", &AwaitHandle::wait_py, nb::sig("def wait(self) -> Tensor"),
           "Blocks until terminal (interruptibly, without the GIL); returns the moved Tensor or raises the failure.");

  m.def("move_async", [](nb::handle tensor, nb::handle destination) {
    if (!nb::isinstance<sw::TensorImpl>(tensor))
      sw::raise<sw::TypeError>("move_async: tensor must be a Tensor, got ", nb::type_name(tensor.type()).c_str());
    sw::TensorPtr t = nb::cast<sw::TensorPtr>(tensor);
    sw::CarrierPtr dest;
    if (nb::isinstance<sw::Carrier>(destination)) dest = nb::cast<sw::CarrierPtr>(destination);
    auto c = sw::move_async(t, dest);
    auto* h = new AwaitMove();
    h->state = c;
    h->result = [c]() { return nb::cast(c->value()); };
    return nb::cast(h, nb::rv_policy::take_ownership);
  }, nb::arg("tensor").none(), nb::arg("destination").none(),
     nb::sig("def move_async(tensor: Tensor, destination: Carrier) -> AwaitMove"),
     "Moves a tensor's values to `destination` asynchronously; returns an AwaitMove.");
}

}  // namespace swpy
