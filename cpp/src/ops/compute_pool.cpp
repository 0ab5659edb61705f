// The compute pool. See Note [Compute pool] in compute_pool.hpp.
#include "compute_pool.hpp"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <thread>
#include <vector>

namespace sw::detail {

namespace {

thread_local bool in_region = false;  // this thread runs a part of a region right now
std::atomic<bool> forked{false};

class ComputePool {
 public:
  ComputePool() : threads_(std::max(1u, std::thread::hardware_concurrency())) {
    for (int64_t t = 1; t < threads_; ++t) std::thread([this] { work(); }).detach();
  }

  int64_t threads() const { return threads_; }

  // False when the pool cannot take the region (busy, nested, or after fork): the caller runs it inline.
  bool run(int64_t parts, void (*part)(void*, int64_t), void* ctx) {
    if (in_region || forked.load(std::memory_order_relaxed) || threads_ < 2) return false;
    std::unique_lock region(region_, std::try_to_lock);
    if (!region.owns_lock()) return false;
    {
      std::lock_guard lock(m_);
      part_ = part;
      ctx_ = ctx;
      parts_ = parts;
      next_ = 1;
      unfinished_ = parts - 1;
      ++generation_;
    }
    cv_.notify_all();
    in_region = true;
    part(ctx, 0);
    // The caller helps with the parts no worker has taken yet.
    for (;;) {
      int64_t i;
      {
        std::lock_guard lock(m_);
        if (next_ >= parts_) break;
        i = next_++;
      }
      part(ctx, i);
      finish_one();
    }
    in_region = false;
    std::unique_lock lock(m_);
    done_.wait(lock, [this] { return unfinished_ == 0; });
    part_ = nullptr;
    return true;
  }

 private:
  void finish_one() {
    std::lock_guard lock(m_);
    if (--unfinished_ == 0) done_.notify_all();
  }

  void work() {
    in_region = true;  // a worker's own kernels never re-enter the pool
    uint64_t seen = 0;
    for (;;) {
      int64_t i;
      void (*part)(void*, int64_t);
      void* ctx;
      {
        std::unique_lock lock(m_);
        cv_.wait(lock, [&] { return generation_ != seen && next_ < parts_; });
        i = next_++;
        if (next_ >= parts_) seen = generation_;  // nothing left of this region for anyone
        part = part_;
        ctx = ctx_;
      }
      part(ctx, i);
      finish_one();
    }
  }

  const int64_t threads_;
  std::mutex region_;  // one region at a time
  std::mutex m_;
  std::condition_variable cv_, done_;
  void (*part_)(void*, int64_t) = nullptr;
  void* ctx_ = nullptr;
  int64_t parts_ = 0, next_ = 0, unfinished_ = 0;
  uint64_t generation_ = 0;
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

}  // namespace sw::detail
