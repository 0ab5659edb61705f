// Note [Fork safety] (fork.hpp): the ordered pthread_atfork steps and the striped small locks.
#include "strideweave/fork.hpp"

#include "strideweave/errors.hpp"

#include <pthread.h>

#include <array>
#include <cstddef>
#include <initializer_list>
#include <mutex>

namespace sw {

namespace detail {
std::atomic<uint64_t> g_fork_generation{0};
}  // namespace detail

namespace {

struct Steps {
  void (*prepare)() = nullptr;
  void (*parent)() = nullptr;
  void (*child)() = nullptr;
};
struct Registered {
  std::atomic<void (*)()> prepare{nullptr}, parent{nullptr}, child{nullptr};
};
constexpr size_t kLevels = 5;

// Registration takes no lock (a thread may register while it holds a lock that a prepare step takes): the
// prepare handler snapshots the steps, and the parent and child handlers run that snapshot.
std::array<Registered, kLevels>& registered() {
  static auto* r = new std::array<Registered, kLevels>();  // never destroyed: fork() may run during static destruction
  return *r;
}
std::mutex& fork_mutex() {  // one fork() at a time runs the steps (and owns `taken`)
  static auto* m = new std::mutex();
  return *m;
}
std::array<Steps, kLevels> taken;  // under fork_mutex()

void prepare_all() {
  fork_mutex().lock();
  for (size_t i = 0; i < kLevels; ++i) {
    Registered& r = registered()[i];
    taken[i] = Steps{};
    // `prepare` is stored last: once it is seen, so are the other two.
    if (auto* prepare = r.prepare.load(std::memory_order_acquire))
      taken[i] = Steps{prepare, r.parent.load(std::memory_order_relaxed), r.child.load(std::memory_order_relaxed)};
  }
  for (const Steps& s : taken)
    if (s.prepare) s.prepare();
}
void parent_all() {
  for (size_t i = kLevels; i-- > 0;)
    if (taken[i].parent) taken[i].parent();
  fork_mutex().unlock();
}
void child_all() {
  detail::g_fork_generation.fetch_add(1, std::memory_order_relaxed);  // before anything else looks at it
  for (size_t i = kLevels; i-- > 0;)
    if (taken[i].child) taken[i].child();
  fork_mutex().unlock();
}

// The striped locks: enough stripes that unrelated objects seldom share one, each on its own cache line.
constexpr size_t kStripes = 64;
struct alignas(64) Stripe {
  std::mutex m;
};
using Table = std::array<Stripe, kStripes>;
Table& completion_table() {
  static auto* t = new Table();  // never destroyed: completions may be set during static destruction
  return *t;
}
Table& carrier_table() {
  static auto* t = new Table();
  return *t;
}
Table& budget_table() {
  static auto* t = new Table();
  return *t;
}
size_t stripe_of(const void* object) noexcept {
  const auto p = reinterpret_cast<uintptr_t>(object);
  return static_cast<size_t>((p >> 4) ^ (p >> 10)) % kStripes;  // objects are at least 16-byte aligned
}

void lock_tables() {
  for (Table* t : {&completion_table(), &carrier_table(), &budget_table()})
    for (Stripe& s : *t) s.m.lock();
}
void unlock_tables() {
  for (Table* t : {&budget_table(), &carrier_table(), &completion_table()})
    for (Stripe& s : *t) s.m.unlock();
}

// Registers the small locks' own step, the first time a stripe is asked for.
bool small_locks_registered() {
  static const bool once = (on_fork(ForkLevel::SmallLocks, lock_tables, unlock_tables, unlock_tables), true);
  return once;
}

}  // namespace

void on_fork(ForkLevel level, void (*prepare)(), void (*parent)(), void (*child)()) {
  static const bool installed = (pthread_atfork(prepare_all, parent_all, child_all), true);
  (void)installed;
  Registered& r = registered()[static_cast<size_t>(level)];
  r.parent.store(parent, std::memory_order_relaxed);
  r.child.store(child, std::memory_order_relaxed);
  r.prepare.store(prepare, std::memory_order_release);
}

// ---------------------------------------------------------------- CallMutex (Note [Locks held for a whole call])

void CallMutex::lock() {
  const uint32_t mine = 1 + static_cast<uint32_t>(fork_generation() & 0x7FFFFFFF);
  for (;;) {
    uint32_t seen = 0;
    if (state_.compare_exchange_weak(seen, mine, std::memory_order_acquire, std::memory_order_relaxed)) return;
    if (seen != 0 && seen != mine)
      raise<RuntimeError>(what_, ": a call of this ", what_, " was running on another thread when this process was "
                          "forked; that call runs only in the parent and left the ", what_, " half-way through it, "
                          "so it cannot be used in this child process (created before fork): make a new one in "
                          "the child");
    if (seen != 0) state_.wait(seen, std::memory_order_relaxed);  // futex wait until it changes
  }
}

void CallMutex::unlock() noexcept {
  state_.store(0, std::memory_order_release);
  state_.notify_all();
}

namespace detail {

std::mutex& completion_lock(const void* object) noexcept {
  static const bool registered = small_locks_registered();
  (void)registered;
  return completion_table()[stripe_of(object)].m;
}

std::mutex& carrier_state_lock(const void* object) noexcept {
  static const bool registered = small_locks_registered();
  (void)registered;
  return carrier_table()[stripe_of(object)].m;
}

std::mutex& budget_lock(const void* object) noexcept {
  static const bool registered = small_locks_registered();
  (void)registered;
  return budget_table()[stripe_of(object)].m;
}

}  // namespace detail

}  // namespace sw
