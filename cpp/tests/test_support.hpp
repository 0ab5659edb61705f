// Shared helpers for the carrier, completion, move and io GoogleTest suites.
//
//  * EXPECT_SW_THROW(Type, "fragment", expr): the expression throws exactly
//    `Type` (or a subclass) and its message contains `fragment`.
//  * test_seed(): the process-wide random seed, printed once; set
//    SW_TEST_SEED=<n> to replay a run.
//  * TempPath / make_device_file(): temporary files removed on destruction.
//  * TestCarrier: a user-defined carrier kind (sw::Carrier + a
//    StorageProvider), with counters that prove release runs once.
//  * TestRoute: a TransferRoute whose transfers stay pending until the
//    test completes or fails each one (TensorStore's mock_kvstore idea), so
//    pending states and failures are tested without sleeps.
//  * run_in_forked_child(): runs a check in a child of fork(), bounded by a timeout.
//  * dense_tensor() / values_of() / draw_eighths(): dense CPU or Generic
//    tensors from doubles and back, and exact Float32 test data (ops, autograd).
// Header-only; not a *_test.cpp, so CMake builds no executable from it.
#pragma once

#include <fcntl.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <sys/wait.h>

#include <atomic>
#include <bit>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <iostream>
#include <memory>
#include <mutex>
#include <random>
#include <string>
#include <string_view>
#include <vector>

#include "strideweave/carrier.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/completion.hpp"
#include "strideweave/dtype.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/layout.hpp"
#include "strideweave/move.hpp"
#include "strideweave/tensor.hpp"

namespace sw {

inline void PrintTo(const Value& v, std::ostream* os) {
  switch (v.kind) {
    case Value::Kind::Float: *os << "Float(" << v.f << ")"; break;
    case Value::Kind::Int: *os << "Int(" << v.i << ")"; break;
    case Value::Kind::BigInt: *os << "BigInt(" << v.f << ")"; break;
    case Value::Kind::Bool: *os << "Bool(" << (v.b ? "true" : "false") << ")"; break;
  }
}

namespace testing_support {

// ---------------------------------------------------------------- errors

// EXPECT_THROW plus a message-fragment check; the expression is evaluated once.
#define EXPECT_SW_THROW(Type, fragment, ...)                                                           \
  do {                                                                                                 \
    std::string sw_thrown_message_;                                                                    \
    bool sw_thrown_ = false;                                                                           \
    EXPECT_THROW(                                                                                      \
        {                                                                                              \
          try {                                                                                        \
            (void)(__VA_ARGS__);                                                                       \
          } catch (const Type& sw_e_) {                                                                \
            sw_thrown_ = true;                                                                         \
            sw_thrown_message_ = sw_e_.what();                                                         \
            throw;                                                                                     \
          }                                                                                            \
        },                                                                                             \
        Type)                                                                                          \
        << "for: " #__VA_ARGS__;                                                                       \
    if (sw_thrown_)                                                                                    \
      EXPECT_NE(sw_thrown_message_.find(fragment), std::string::npos)                                  \
          << "message \"" << sw_thrown_message_ << "\" lacks \"" << (fragment) << "\" for: " #__VA_ARGS__; \
  } while (0)

// The message of the exception held by `e` ("" when null or not a std::exception).
inline std::string message_of(const std::exception_ptr& e) {
  if (!e) return {};
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return {};
}

// ---------------------------------------------------------------- seeds

// A Float32's bit pattern, and the Float32 of a bit pattern (the half-precision and quantized-format tests).
inline uint32_t bits(float f) { return std::bit_cast<uint32_t>(f); }
inline float from_bits(uint32_t u) { return std::bit_cast<float>(u); }

inline uint64_t test_seed() {
  static const uint64_t seed = [] {
    const char* env = std::getenv("SW_TEST_SEED");
    uint64_t s;
    if (env && *env) {
      s = std::strtoull(env, nullptr, 0);
    } else {
      s = static_cast<uint64_t>(std::chrono::system_clock::now().time_since_epoch().count()) % 1000000007ULL;
    }
    std::cout << "[ SEED     ] SW_TEST_SEED=" << s
              << (env && *env ? " (from environment)" : " (time-based; set SW_TEST_SEED to replay)") << std::endl;
    return s;
  }();
  return seed;
}

struct Rng {
  std::mt19937_64 g;
  explicit Rng(uint64_t seed) : g(seed) {}
  int64_t uniform(int64_t lo, int64_t hi) { return std::uniform_int_distribution<int64_t>(lo, hi)(g); }
  bool chance(double p) { return std::bernoulli_distribution(p)(g); }
};

// ---------------------------------------------------------------- files

inline std::string temp_dir() {
  const char* t = std::getenv("TMPDIR");
  return (t && *t) ? t : "/tmp";
}

// A unique path in the temp directory; the file (if any) is removed on destruction.
class TempPath {
 public:
  explicit TempPath(const std::string& stem = "sw-test") {
    std::string pattern = temp_dir() + "/" + stem + "-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    int fd = ::mkstemp(buf.data());
    if (fd < 0) throw std::runtime_error("mkstemp failed: " + std::string(std::strerror(errno)));
    ::close(fd);
    path_ = buf.data();
  }
  ~TempPath() { ::unlink(path_.c_str()); }
  TempPath(const TempPath&) = delete;
  TempPath& operator=(const TempPath&) = delete;
  const std::string& path() const { return path_; }

 private:
  std::string path_;
};

inline bool file_exists(const std::string& path) { return ::access(path.c_str(), F_OK) == 0; }

// A preallocated file of `bytes` bytes for a BlockDevice arena.
inline std::unique_ptr<TempPath> make_device_file(int64_t bytes) {
  auto p = std::make_unique<TempPath>("sw-blockdev");
  int fd = ::open(p->path().c_str(), O_RDWR);
  if (fd < 0) throw std::runtime_error("open of device file failed");
  if (::posix_fallocate(fd, 0, bytes) != 0 && ::ftruncate(fd, bytes) != 0) {
    ::close(fd);
    throw std::runtime_error("cannot size device file");
  }
  ::close(fd);
  return p;
}

// ---------------------------------------------------------------- values

inline Value F(double v) { return Value::from_float(v); }
inline Value I(int64_t v) { return Value::from_int(v); }
inline Value B(bool v) { return Value::from_bool(v); }

// A value of `dtype` derived from an integer seed (exactly representable in Float32).
inline Value value_for(const DType& dtype, int64_t k) {
  switch (dtype.id()) {
    case DTypeId::Int32: return I(k * 7 - 3);
    case DTypeId::Bool: return B(k % 3 == 1);
    default: return F(static_cast<double>(k) * 0.5 - 3.25);
  }
}

inline Value zero_of(const DType& dtype) {
  switch (dtype.id()) {
    case DTypeId::Int32: return I(0);
    case DTypeId::Bool: return B(false);
    default: return F(0.0);
  }
}

// Every slot through the checked public API.
inline std::vector<Value> snapshot(const Carrier& c) {
  std::vector<Value> out;
  for (int64_t i = 0; i < c.size(); ++i) out.push_back(c.get(i));
  return out;
}

// Every slot through one bulk read (engine path).
inline std::vector<Value> bulk_snapshot(const Carrier& c) {
  const size_t w = slot_bytes(c.dtype());
  std::vector<std::byte> buf(static_cast<size_t>(c.size()) * w);
  c.read_slots(0, c.size(), buf.data());
  std::vector<Value> out;
  for (int64_t i = 0; i < c.size(); ++i) out.push_back(load_value(c.dtype(), buf.data() + i * w));
  return out;
}

// Fills every slot with value_for(dtype, i + salt) through write_slots (no version change).
inline void fill_slots(Carrier& c, int64_t salt = 0) {
  const size_t w = slot_bytes(c.dtype());
  std::vector<std::byte> buf(static_cast<size_t>(c.size()) * w);
  for (int64_t i = 0; i < c.size(); ++i) store_value(c.dtype(), buf.data() + i * w, value_for(c.dtype(), i + salt));
  c.write_slots(0, c.size(), buf.data());
}

// ---------------------------------------------------------------- a user-defined carrier kind

inline const CarrierKind& test_kind() {
  static const CarrierKind k{"TestCarrier", false, false, false};
  return k;
}

class TestStorage;

// Slots live in a vector on the carrier; the provider does the work. Counters
// prove that the provider's release runs exactly once per carrier.
class TestCarrier final : public Carrier {
 public:
  TestCarrier(std::shared_ptr<StorageProvider> provider, const DType& dtype, bool is_mutable)
      : Carrier(&test_kind(), std::move(provider), dtype, is_mutable) {}
  std::vector<Value> slots;
  std::atomic<int> release_calls{0};
  std::atomic<int> allocate_calls{0};
};

class TestStorage final : public StorageProvider, public std::enable_shared_from_this<TestStorage> {
 public:
  explicit TestStorage(bool fallback) { elementwise_fallback = fallback; }
  static TestCarrier& self(const Carrier& c) { return static_cast<TestCarrier&>(const_cast<Carrier&>(c)); }

  bool supports_dtype(const Carrier&, const DType& d) override {
    return d.id() == DTypeId::Float32 || d.id() == DTypeId::Int32;
  }
  int64_t physical_size(const Carrier& c) override { return static_cast<int64_t>(self(c).slots.size()); }
  void allocate(Carrier& c, int64_t n) override {
    self(c).allocate_calls.fetch_add(1);
    self(c).slots.assign(static_cast<size_t>(n), zero_of(c.dtype()));
  }
  void release(Carrier& c) override {
    self(c).release_calls.fetch_add(1);
    self(c).slots.clear();
    releases.fetch_add(1);
  }
  Value read(const Carrier& c, int64_t slot) override { return self(c).slots.at(static_cast<size_t>(slot)); }
  void write(Carrier& c, int64_t slot, const Value& v) override { self(c).slots.at(static_cast<size_t>(slot)) = v; }
  CarrierPtr construct(int64_t n, const DType& d, bool is_mutable) override {
    auto c = std::make_shared<TestCarrier>(shared_from_this(), d, is_mutable);
    c->allocate_storage(n);
    constructions.fetch_add(1);
    return c;
  }
  std::atomic<int> releases{0};
  std::atomic<int> constructions{0};
};

// Providers without and with the element-by-element fallback (one per process).
inline const std::shared_ptr<TestStorage>& test_storage(bool fallback = false) {
  static const auto plain = std::make_shared<TestStorage>(false);
  static const auto with_fallback = std::make_shared<TestStorage>(true);
  return fallback ? with_fallback : plain;
}

inline std::shared_ptr<TestCarrier> make_test_carrier(int64_t n, const DType& dtype = DType::Float32(),
                                                      bool is_mutable = true, bool fallback = false) {
  return std::static_pointer_cast<TestCarrier>(test_storage(fallback)->construct(n, dtype, is_mutable));
}

// ---------------------------------------------------------------- a route the test drives

// Copies the request's runs from the source carrier to the destination (offset 0).
inline void copy_request(const TransferRequest& r) {
  const Carrier& src = *r.tensor->carrier;
  const size_t w = slot_bytes(*r.dtype);
  for (const Run& run : r.layout.runs()) {
    std::vector<std::byte> buf(static_cast<size_t>(run.length) * w);
    src.read_slots(r.tensor->offset + run.offset, run.length, buf.data());
    r.destination->write_slots(run.offset, run.length, buf.data());
  }
}

// One submitted transfer; it stays pending until the test completes or fails it.
struct PendingTransfer {
  explicit PendingTransfer(TransferRequest r) : request(std::move(r)) {}
  TransferRequest request;
  std::shared_ptr<Completion<bool>> gate = std::make_shared<Completion<bool>>();
  void complete() { gate->set_value(true); }
  void fail(std::exception_ptr e) { gate->set_error(std::move(e)); }
};

class TestRoute final : public TransferRoute {
 public:
  enum class Mode { Pending, Synchronous, Unsupported, SubmitThrows };

  Submit prepare(const TransferRequest& request, std::string& unsupported) override {
    prepares.fetch_add(1);
    if (on_prepare) on_prepare(request);
    Mode m = mode.load();
    if (m == Mode::Unsupported) {
      unsupported = "the test route refuses this request";
      return {};
    }
    return [this, request, m]() -> Waiter {
      submits.fetch_add(1);
      if (m == Mode::SubmitThrows) raise<RuntimeError>("test route: submit failed on purpose");
      if (m == Mode::Synchronous) {
        copy_request(request);
        return {};
      }
      auto p = std::make_shared<PendingTransfer>(request);
      {
        std::lock_guard lock(mutex_);
        queue_.push_back(p);
      }
      return [p]() {
        p->gate->value();  // blocks until the test decides; rethrows a failure
        copy_request(p->request);
      };
    };
  }

  // The oldest submitted transfer not yet taken (nullptr when none).
  std::shared_ptr<PendingTransfer> take() {
    std::lock_guard lock(mutex_);
    if (queue_.empty()) return nullptr;
    auto p = queue_.front();
    queue_.pop_front();
    return p;
  }
  size_t queued() const {
    std::lock_guard lock(mutex_);
    return queue_.size();
  }
  void reset(Mode m) {
    std::lock_guard lock(mutex_);
    queue_.clear();
    mode.store(m);
    on_prepare = nullptr;
  }

  // Runs inside prepare, on the thread that requested the move (set by one test, cleared by reset).
  std::function<void(const TransferRequest&)> on_prepare;

  std::atomic<Mode> mode{Mode::Pending};
  std::atomic<int> prepares{0};
  std::atomic<int> submits{0};

 private:
  mutable std::mutex mutex_;
  std::deque<std::shared_ptr<PendingTransfer>> queue_;
};

// The process-wide test route, registered once for TestCarrier -> CPU, CPU -> TestCarrier and
// TestCarrier -> FileBacked (one way only: FileBacked -> TestCarrier has no route unless the
// TestCarrier allows the element-wise fallback). TestCarrier <-> Generic has no registered route.
inline TestRoute& test_route() {
  static const std::shared_ptr<TestRoute> route = [] {
    auto r = std::make_shared<TestRoute>();
    register_route(&test_kind(), &cpu_kind(), r);
    register_route(&cpu_kind(), &test_kind(), r);
    register_route(&test_kind(), &file_backed_kind(), r);
    return r;
  }();
  return *route;
}

// ---------------------------------------------------------------- fork()

// Runs `child` in a child made by fork() (only the calling thread exists there) and returns its exit code:
// 0 when it returned 0, its non-zero return (which check failed), or 128 + the signal that ended it; a child
// that hangs is ended by SIGALRM after `timeout_s` (128 + 14). The child leaves with _exit: no destructor and
// no test framework code runs there.
inline int run_in_forked_child(const std::function<int()>& child, unsigned timeout_s = 60) {
  const pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    alarm(timeout_s);
    int code = 1;
    try {
      code = child();
    } catch (...) {
      code = 99;
    }
    _exit(code);
  }
  int status = 0;
  while (waitpid(pid, &status, 0) < 0 && errno == EINTR) {
  }
  if (WIFEXITED(status)) return WEXITSTATUS(status);
  return WIFSIGNALED(status) ? 128 + WTERMSIG(status) : -1;
}

// ---------------------------------------------------------------- dense tensors (ops, autograd)

// A dense column-major CPU (or Generic) tensor of `shape` holding `values` in ordinal order.
inline TensorPtr dense_tensor(bool cpu, const Shape& shape, const std::vector<double>& values,
                              const DType& dtype = DType::Float32()) {
  CarrierPtr c = cpu ? CarrierPtr(std::make_shared<CPUCarrier>(shape.size(), dtype, true, false))
                     : CarrierPtr(std::make_shared<GenericCarrier>(shape.size(), dtype, true));
  for (int64_t i = 0; i < shape.size(); ++i)
    c->write_value(i, dtype.id() == DTypeId::Int32 ? Value::from_int(static_cast<int64_t>(values[i]))
                                                   : Value::from_float(values[i]));
  return make_tensor(std::move(c), 0, column_major(shape));
}

// The values of `t` in ordinal order, as doubles.
inline std::vector<double> values_of(const TensorPtr& t) {
  std::vector<double> out;
  for (int64_t i = 0; i < t->size(); ++i) {
    Value v = t->carrier->read_value(t->offset + t->layout.index(i));
    out.push_back(v.kind == Value::Kind::Int ? double(v.i) : v.kind == Value::Kind::Bool ? double(v.b) : v.f);
  }
  return out;
}

// `n` multiples of 1/8 in [lo, hi] (exact in Float32); with `away_from_zero`, none within 1/4 of 0.
inline std::vector<double> draw_eighths(Rng& rng, int64_t n, double lo, double hi, bool away_from_zero = false) {
  std::vector<double> v;
  while (static_cast<int64_t>(v.size()) < n) {
    double x = static_cast<double>(rng.uniform(static_cast<int64_t>(lo * 8), static_cast<int64_t>(hi * 8))) / 8;
    if (!away_from_zero || std::abs(x) >= 0.25) v.push_back(x);
  }
  return v;
}

// The message of a RuntimeError raised by `f`, or "" (with a test failure) when it raised none.
template <class F>
std::string runtime_error_of(F&& f) {
  try {
    f();
  } catch (const RuntimeError& e) {
    return e.what();
  }
  ADD_FAILURE() << "no RuntimeError";
  return "";
}

// `n` as 8 little-endian bytes (a safetensors header's length prefix).
inline std::string le64(uint64_t n) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[static_cast<size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return out;
}

}  // namespace testing_support
}  // namespace sw
