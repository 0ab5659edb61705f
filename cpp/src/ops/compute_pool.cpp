// The compute pool. See Note [Compute pool] in compute_pool.hpp.
#include "compute_pool.hpp"

#include <pthread.h>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

namespace sw::detail {

namespace {

thread_local bool in_region = false;  // this thread runs a part of a region right now
std::atomic<bool> forked{false};

std::atomic<int64_t> spin_us{200};  // Note [Compute pool]: how long an idle thread spins before it sleeps

inline void cpu_relax() {
#if defined(__x86_64__) || defined(__i386__)
  _mm_pause();
#elif defined(__aarch64__)
  asm volatile("yield");
#endif
}

// Spins (with pause) until ready() holds or about spin_us microseconds passed; returns ready().
template <class F>
bool spin_until(F&& ready) {
  if (ready()) return true;
  const int64_t us = spin_us.load(std::memory_order_relaxed);
  if (us <= 0) return false;
  const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(us);
  for (;;) {
    for (int i = 0; i < 32; ++i) {
      cpu_relax();
      if (ready()) return true;
    }
    if (std::chrono::steady_clock::now() >= until) return ready();
    // Between rounds, a thread that is ready to run on this core gets it (Note [Compute pool]); with none, the
    // call returns at once.
    std::this_thread::yield();
  }
}

// A region's claim state in one word: the region's number (bits 32-63), its number
// of parts (bits 16-31) and the next unclaimed part (bits 0-15). A thread claims
// part i of region g by moving the word from (g, n, i) to (g, n, i + 1) while
// i < n. A successful claim means the region is still running (part i has not
// finished, so the caller has not returned), so part_ and ctx_ are still the
// ones its caller published before storing (g, n, 1).
constexpr uint64_t kMaxParts = 0xFFFF;
constexpr uint64_t pack(uint64_t gen, uint64_t parts, uint64_t next) {
  return (gen << 32) | (parts << 16) | next;
}
constexpr uint32_t gen_of(uint64_t s) { return static_cast<uint32_t>(s >> 32); }

class ComputePool {
 public:
  ComputePool() : threads_(std::max(1u, std::thread::hardware_concurrency())) {
    for (int64_t t = 1; t < threads_; ++t) std::thread([this] { work(); }).detach();
  }

  int64_t threads() const { return threads_; }

  // False when the pool cannot take the region (busy, nested, or after fork): the caller runs it inline.
  bool run(int64_t parts, void (*part)(void*, int64_t), void* ctx) {
    if (in_region || forked.load(std::memory_order_relaxed) || threads_ < 2 || static_cast<uint64_t>(parts) > kMaxParts)
      return false;
    std::unique_lock region(region_, std::try_to_lock);
    if (!region.owns_lock()) return false;
    part_ = part;
    ctx_ = ctx;
    unfinished_.store(parts - 1, std::memory_order_relaxed);
    const uint32_t gen = ++generation_;
    state_.store(pack(gen, static_cast<uint64_t>(parts), 1), std::memory_order_seq_cst);  // publishes the fields above
    if (sleepers_.load(std::memory_order_seq_cst) > 0) {
      std::lock_guard lock(m_);
      cv_.notify_all();
    }
    in_region = true;
    part(ctx, 0);
    // The caller helps with the parts no worker has taken yet.
    for (int64_t i; (i = claim(gen)) >= 0;) {
      part(ctx, i);
      finish_one();
    }
    in_region = false;
    if (!spin_until([this] { return unfinished_.load(std::memory_order_acquire) == 0; })) {
      std::unique_lock lock(m_);
      done_.wait(lock, [this] { return unfinished_.load(std::memory_order_acquire) == 0; });
    }
    return true;
  }

 private:
  // Claims the next part of region `gen`, or returns -1 when none is left (or the region is another).
  int64_t claim(uint32_t gen) {
    uint64_t s = state_.load(std::memory_order_acquire);
    for (;;) {
      const uint64_t next = s & 0xFFFF, parts = (s >> 16) & 0xFFFF;
      if (gen_of(s) != gen || next >= parts) return -1;
      if (state_.compare_exchange_weak(s, s + 1, std::memory_order_acq_rel, std::memory_order_acquire))
        return static_cast<int64_t>(next);
    }
  }

  void finish_one() {
    if (unfinished_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard lock(m_);  // the caller checks under this lock before it sleeps: no lost wake-up
      done_.notify_all();
    }
  }

  void work() {
    in_region = true;  // a worker's own kernels never re-enter the pool
    uint32_t seen = 0;
    for (;;) {
      auto fresh = [&] { return gen_of(state_.load(std::memory_order_seq_cst)) != seen; };
      if (!spin_until(fresh)) {
        std::unique_lock lock(m_);
        sleepers_.fetch_add(1, std::memory_order_seq_cst);
        cv_.wait(lock, fresh);
        sleepers_.fetch_sub(1, std::memory_order_relaxed);
      }
      seen = gen_of(state_.load(std::memory_order_acquire));
      for (int64_t i; (i = claim(seen)) >= 0;) {
        // The claim succeeded, so the region is still running and part_, ctx_ are its own.
        part_.load(std::memory_order_relaxed)(ctx_.load(std::memory_order_relaxed), i);
        finish_one();
      }
    }
  }

  const int64_t threads_;
  std::mutex region_;  // one region at a time
  std::mutex m_;       // only for sleeping: workers on cv_, the caller on done_
  std::condition_variable cv_, done_;
  std::atomic<void (*)(void*, int64_t)> part_{nullptr};
  std::atomic<void*> ctx_{nullptr};
  std::atomic<int64_t> unfinished_{0};
  std::atomic<uint64_t> state_{0};
  std::atomic<int> sleepers_{0};
  uint32_t generation_ = 0;  // under region_ (wraps; only changes are compared)
};

ComputePool& pool() {
  // Never destroyed: detached workers may still be blocked in it while the process exits.
  static ComputePool* p = [] {
    pthread_atfork(nullptr, nullptr, [] { forked.store(true); });  // the child has no workers
    return new ComputePool;
  }();
  return *p;
}

}  // namespace

void run_parts(int64_t parts, void (*part)(void* ctx, int64_t i), void* ctx) {
  if (parts <= 0) return;
  if (parts == 1 || !pool().run(parts, part, ctx)) {
    for (int64_t i = 0; i < parts; ++i) part(ctx, i);
  }
}

int64_t compute_threads() { return pool().threads(); }

int64_t set_compute_spin_us(int64_t us) { return spin_us.exchange(std::max<int64_t>(us, 0)); }

}  // namespace sw::detail
