// fuzz/fuzz_input.hpp — shared by the libFuzzer targets (fuzz/*_fuzz.cpp, docs/reliability.md,
// "Coverage-guided fuzzing"): a reader that turns the fuzz input into small decisions, and the one rule for
// exceptions: an engine error of an allowed kind is an answer, anything else (another kind, a non-engine
// exception) is a finding and aborts, so libFuzzer saves the input.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <exception>
#include <initializer_list>
#include <string>

#include "strideweave/errors.hpp"

namespace sw::fuzz {

// Reads the input front to back; past its end every read yields 0, so any input decodes to some sequence of calls.
class Input {
 public:
  Input(const uint8_t* data, size_t size) : p_(data), end_(data + size) {}
  bool empty() const noexcept { return p_ == end_; }
  size_t left() const noexcept { return static_cast<size_t>(end_ - p_); }
  uint8_t byte() noexcept { return p_ < end_ ? *p_++ : 0; }
  bool flag() noexcept { return byte() & 1; }
  // In [0, n) (n >= 1).
  uint64_t below(uint64_t n) noexcept { return n <= 1 ? 0 : (n <= 256 ? byte() % n : u64() % n); }
  uint64_t u64() noexcept {
    uint64_t v = 0;
    for (int k = 0; k < 8; ++k) v |= uint64_t{byte()} << (8 * k);
    return v;
  }
  // An integer that is usually small (0..max_small) and sometimes an edge: negative, 2**31, 2**62, INT64_MAX...
  int64_t extent(int64_t max_small) noexcept {
    uint8_t b = byte();
    if (b < 240) return b % (max_small + 1);
    static constexpr int64_t edges[] = {-1, -2, int64_t{1} << 31, int64_t{1} << 32, int64_t{1} << 62,
                                        (int64_t{1} << 62) + 1, INT64_MAX, INT64_MIN, 1000003, 65536,
                                        int64_t{1} << 40, -(int64_t{1} << 40), 3, 7, 0, 1};
    return edges[b - 240];
  }
  std::string bytes(size_t n) {
    n = n < left() ? n : left();
    std::string s(reinterpret_cast<const char*>(p_), n);
    p_ += n;
    return s;
  }

 private:
  const uint8_t* p_;
  const uint8_t* end_;
};

[[noreturn]] inline void finding(const char* where, const std::string& what) {
  std::fprintf(stderr, "FUZZ FINDING in %s: %s\n", where, what.c_str());
  std::abort();
}

inline const char* kind_name(ErrorKind k) {
  switch (k) {
    case ErrorKind::Type: return "TypeError";
    case ErrorKind::Value: return "ValueError";
    case ErrorKind::Runtime: return "RuntimeError";
    case ErrorKind::Index: return "IndexError";
    case ErrorKind::NotImplemented: return "NotImplementedError";
    case ErrorKind::Overflow: return "OverflowError";
    case ErrorKind::Memory: return "MemoryError";
    case ErrorKind::Internal: return "InternalError";
  }
  return "?";
}

// Runs f(); an sw::Error of a kind in `allowed` returns false (the call was refused), success returns true, and
// any other exception is a finding.
template <class F>
bool attempt(const char* where, std::initializer_list<ErrorKind> allowed, F&& f) {
  try {
    f();
    return true;
  } catch (const Error& e) {
    for (ErrorKind k : allowed)
      if (e.kind() == k) return false;
    finding(where, std::string(kind_name(e.kind())) + " (not a documented error here): " + e.what());
  } catch (const std::exception& e) {
    finding(where, std::string("non-engine exception: ") + e.what());
  } catch (...) {
    finding(where, "non-standard exception");
  }
}

#define FUZZ_CHECK(cond, ...)                                                                      \
  do {                                                                                             \
    if (!(cond)) ::sw::fuzz::finding(__func__, ::sw::detail::concat("check failed: " #cond " ", __VA_ARGS__)); \
  } while (0)

}  // namespace sw::fuzz
