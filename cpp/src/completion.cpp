#include "strideweave/completion.hpp"

#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <new>

namespace sw {

// ---------------------------------------------------------------- fork (Note [Fork safety], fork.hpp)

void CompletionBase::adopt() const {
  // The parent's waiters may be listed in the condition variable, and no thread here will ever confirm their
  // wake-up: it is made afresh (the old state is dropped, never destroyed), before any waiter of this process
  // can use it (every one adopts first, under the lock).
  new (&cv_) std::condition_variable();
  generation_ = fork_generation();
  if (done_) return;  // set before fork(): the value is this process's too
  done_ = true;
  failed_by_fork_ = true;
  error_ = std::make_exception_ptr(RuntimeError(
      "this request was created before fork() in the parent process, and its work runs only there: it cannot "
      "complete in this child process (created before fork); make the request again in the child"));
  // Continuations and help belong to the parent's work: neither run nor destroyed here (destroying their
  // captures could run anything, on state that work left half-done).
  if (!callbacks_.empty()) (void)new std::vector<std::function<void()>>(std::move(callbacks_));
  if (help_) (void)new std::function<void()>(std::move(help_));
  callbacks_.clear();
  help_ = nullptr;
}

namespace {
constexpr size_t kProcessPools = 4;
std::array<std::atomic<Executor*>, kProcessPools> g_process_pools{};
// The pools whose queues the prepare step locked (a pool made meanwhile is not unlocked by mistake); only the
// forking thread uses it, one fork() at a time.
std::array<Executor*, kProcessPools> g_locked{};
}  // namespace

Executor* Executor::process_pool(std::string name, size_t threads, int nice) {
  auto* e = new Executor(std::move(name), threads, nice);
  static std::atomic<size_t> next{0};
  g_process_pools[next.fetch_add(1)].store(e, std::memory_order_release);
  static const bool registered =
      (on_fork(ForkLevel::Executors, lock_process_pools, unlock_process_pools, restart_process_pools_in_child), true);
  (void)registered;
  return e;
}

void Executor::lock_process_pools() {
  for (size_t i = 0; i < kProcessPools; ++i) {
    g_locked[i] = g_process_pools[i].load(std::memory_order_acquire);
    if (g_locked[i]) g_locked[i]->mutex_.lock();
  }
}

void Executor::unlock_process_pools() {
  for (size_t i = kProcessPools; i-- > 0;)
    if (Executor* e = g_locked[i]) e->mutex_.unlock();
}

void Executor::restart_process_pools_in_child() {
  for (size_t i = kProcessPools; i-- > 0;)
    if (Executor* e = g_locked[i]) {
      e->restart_in_child();
      e->mutex_.unlock();
    }
}

// Under mutex_, in the child: none of the parent's threads exists here. Their std::thread objects (joinable:
// destroying one would terminate the process) and the queued work (the parent's, which runs there) are dropped
// without being destroyed; the counts start from zero, and the next submit starts a thread.
void Executor::restart_in_child() {
  if (!threads_.empty()) (void)new std::vector<std::thread>(std::move(threads_));
  if (!queue_.empty()) (void)new std::deque<std::function<void()>>(std::move(queue_));
  threads_.clear();
  queue_.clear();
  idle_ = 0;
  busy_ = 0;
  new (&cv_) std::condition_variable();  // the parent's idle threads wait on them (see CompletionBase::adopt)
  new (&idle_cv_) std::condition_variable();
}

Executor::Executor(std::string name, size_t threads, int nice)
    : name_(std::move(name)), max_threads_(std::max<size_t>(1, threads)), nice_(nice) {}

Executor::~Executor() {
  {
    std::lock_guard lock(mutex_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (auto& t : threads_) t.join();
}

size_t Executor::started_threads() const {
  std::lock_guard lock(mutex_);
  return threads_.size();
}

void Executor::submit(std::function<void()> work) {
  {
    std::lock_guard lock(mutex_);
    queue_.push_back(std::move(work));
    // Start a thread lazily when the idle threads cannot take all queued work.
    // (A thread that was notified but has not yet dequeued still counts as
    // idle, so comparing idle_ with 0 left work queued behind blocked work.)
    if (queue_.size() > idle_ && threads_.size() < max_threads_) {
      threads_.emplace_back([this] { run(); });
      std::string short_name = name_.substr(0, 15);
      pthread_setname_np(threads_.back().native_handle(), short_name.c_str());
    }
  }
  cv_.notify_one();
}

void Executor::run() {
  if (nice_ > 0) {
    // Linux schedules threads individually: this sets the calling thread's niceness only. Raising it needs no
    // privilege; where it fails the thread keeps the process's priority, which is only slower.
    const int current = getpriority(PRIO_PROCESS, static_cast<id_t>(gettid()));
    (void)setpriority(PRIO_PROCESS, static_cast<id_t>(gettid()), std::min(19, std::max(current, nice_)));
  }
  std::unique_lock lock(mutex_);
  while (true) {
    ++idle_;
    cv_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
    --idle_;
    if (queue_.empty()) return;  // stopping
    auto work = std::move(queue_.front());
    queue_.pop_front();
    ++busy_;
    lock.unlock();
    try {
      work();  // work reports its own errors through its completion
    } catch (...) {
    }
    work = nullptr;  // its captures are destroyed here, before the item counts as done
    lock.lock();
    if (--busy_ == 0 && queue_.empty()) idle_cv_.notify_all();
  }
}

bool Executor::wait_idle(std::chrono::milliseconds timeout) {
  std::unique_lock lock(mutex_);
  return idle_cv_.wait_for(lock, timeout, [&] { return busy_ == 0 && queue_.empty(); });
}

namespace {
size_t hardware() { return std::max<unsigned>(1, std::thread::hardware_concurrency()); }
}  // namespace

// Note [Background I/O threads]: tier I/O (promotions, evictions, their
// reads and writes) and moves run ahead of the computation that needs them,
// so their latency matters less than that of the compute threads beside them.
// At equal priority the scheduler lets a woken I/O thread preempt a compute
// thread in the middle of a parallel region, and the region's caller then
// waits for the preempted part (on a 2-core machine, 4-5 s of I/O CPU time
// over a 10-12 s Mixture-of-Experts run). The I/O and move threads therefore
// run at niceness 19: they take whatever CPU time the computation leaves, and
// when a caller blocks on them its own core is free for them. Unlike
// SCHED_IDLE, niceness 19 still gives them a small share on a machine that
// other processes keep busy, so a wait on them always progresses. Measured on
// the MoE example (120 batches, 4 pairs against the same build with equal
// priorities): 4-5% less wall time, although the waits for gradient
// evictions grow from about 0.3 s to 0.5 s.
// A read that bypasses the page cache (Note [Cold reads bypass the page cache]
// in io.cpp) is the exception: its thread issues one system call and sleeps in
// it, and at niceness 19 every wake-up to issue the next one waited behind the
// compute threads, leaving the device idle (the overlap benchmark took as long
// as its reads and its compute one after the other). Such reads run on
// device_reads(), at the process's priority.
constexpr int kBackgroundNice = 19;

// Intentionally leaked: pools must outlive every static object that may submit work.
Executor& Executor::io() {
  static Executor* e = process_pool("sw-io", std::max<size_t>(4, hardware()), kBackgroundNice);
  return *e;
}
Executor& Executor::device_reads() {
  static Executor* e = process_pool("sw-read", std::max<size_t>(4, hardware()));
  return *e;
}
Executor& Executor::select() {
  static Executor* e = process_pool("sw-select", hardware());
  return *e;
}
Executor& Executor::moves() {
  static Executor* e = process_pool("sw-move", std::max<size_t>(4, hardware()), kBackgroundNice);
  return *e;
}

}  // namespace sw
