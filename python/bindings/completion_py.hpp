// The Python face of a completion: caches the result / exception object.
#pragma once

#include <functional>
#include <memory>
#include <variant>

#include "common.hpp"
#include "strideweave/completion.hpp"

namespace swpy {

struct AwaitHandle {
  virtual ~AwaitHandle() = default;
  std::shared_ptr<sw::CompletionBase> state;
  std::function<nb::object()> result;  // called once, with the GIL, after success
  nb::object cached_result;
  nb::object cached_error;
  nb::object wait_py();
};

struct AwaitMove : AwaitHandle {};

// The garbage collector's slots of every handle class (AwaitResult and each subclass passes them).
extern PyType_Slot await_slots[];

// sparse MoE block: an AwaitResidency handle of a residency request (tiled.cpp).
nb::object residency_await(sw::CompletionPtr<std::monostate> c);

}  // namespace swpy
