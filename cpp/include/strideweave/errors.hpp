// strideweave/errors.hpp — the one error model of the engine.
//
// Every public failure is a C++ exception of one of seven kinds, each mapped to
// the Python built-in of the same name by python/bindings/errors.cpp (the only
// translation point). MemoryError says what could not be allocated and how
// much ("allocating 4398046511104 bytes for a CPU carrier ... failed"). Messages carry context: they name the object and the
// rule that was broken, e.g.
//   "tile (1, 0) of TiledEvictable: pinned by a running projection; wait for it".
// Broken internal invariants throw InternalError through SW_ASSERT; those are
// bugs in strideweave, never user errors.
//
// Thread-safety: exception objects are immutable after construction.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <utility>

namespace sw {

enum class ErrorKind { Type, Value, Runtime, Index, NotImplemented, Overflow, Memory, Internal };

class Error : public std::runtime_error {
 public:
  Error(ErrorKind kind, std::string message) : std::runtime_error(std::move(message)), kind_(kind) {}
  ErrorKind kind() const noexcept { return kind_; }

 private:
  ErrorKind kind_;
};

#define SW_DEFINE_ERROR(Name, Kind)                                               \
  class Name : public Error {                                                     \
   public:                                                                        \
    explicit Name(std::string message) : Error(ErrorKind::Kind, std::move(message)) {} \
  };

SW_DEFINE_ERROR(TypeError, Type)
SW_DEFINE_ERROR(ValueError, Value)
SW_DEFINE_ERROR(RuntimeError, Runtime)
SW_DEFINE_ERROR(IndexError, Index)
SW_DEFINE_ERROR(NotImplementedError, NotImplemented)
SW_DEFINE_ERROR(OverflowError, Overflow)
SW_DEFINE_ERROR(MemoryError, Memory)
SW_DEFINE_ERROR(InternalError, Internal)
#undef SW_DEFINE_ERROR

namespace detail {
template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream out;
  (out << ... << std::forward<Parts>(parts));
  return out.str();
}
[[noreturn]] void internal_failure(const char* condition, const char* file, int line,
                                   const std::string& message);
}  // namespace detail

// Throw error type E with a message built from streamable parts.
template <class E, class... Parts>
[[noreturn]] void raise(Parts&&... parts) {
  throw E(detail::concat(std::forward<Parts>(parts)...));
}

}  // namespace sw

// Checks an internal invariant; a failure is a bug in strideweave.
#define SW_ASSERT(cond, ...)                                                        \
  do {                                                                              \
    if (!(cond)) [[unlikely]]                                                       \
      ::sw::detail::internal_failure(#cond, __FILE__, __LINE__,                     \
                                     ::sw::detail::concat("" __VA_OPT__(, ) __VA_ARGS__)); \
  } while (0)
