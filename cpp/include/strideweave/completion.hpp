// strideweave/completion.hpp — one-shot completions and bounded executors.
//
// Completion<T> is a shared, one-shot result: it is set exactly once, to a
// value or to an error (setting it again is refused with InternalError).
// Waiters block until it is terminal (the first may first run work the
// completion depends on, Note [Waiters help]); callbacks registered with `then` run
// once it is, on the thread that completes it (or immediately if already
// terminal), with no internal lock held; they must not block.
//
// Executor is a bounded, named thread pool, started lazily on first submit.
// Three process-wide pools exist: `io()` (residency transfers, I/O bound),
// `select()` (gather/scatter, compute bound) and `moves()`. However many
// requests are pending, the thread count stays bounded. Work holds its own
// state: a dropped handle neither blocks nor cancels it. The pools are never
// destroyed (their threads outlive static destruction safely).
//
// After fork(), a child starts every pool afresh, and a completion created
// before fork() that was not yet set fails there with RuntimeError "created
// before fork" (Note [Fork safety] in fork.hpp).
//
// Note [Drain at exit]: work captures shared_ptrs to objects that the Python
// face owns; dropping the last one takes the GIL. A pool thread that does so
// while the interpreter finalizes is killed inside a noexcept destructor
// (std::terminate). The bindings therefore wait_idle() at interpreter exit
// (atexit), with the GIL released, so captures are dropped before finalization.
//
// Example:
//   auto c = std::make_shared<Completion<int>>();
//   Executor::moves().submit([c] { c->set_value(42); });
//   c->wait(); c->value();  // 42
#pragma once

#include <chrono>
#include <condition_variable>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "strideweave/errors.hpp"
#include "strideweave/fork.hpp"

namespace sw {

class CompletionBase {
 public:
  virtual ~CompletionBase() {
    if (inherited()) {  // its condition variable and continuations are the parent's (Note [Fork safety])
      std::lock_guard lock(mutex_);
      adopt();
    }
  }
  bool done() const {
    std::lock_guard lock(mutex_);
    if (inherited()) adopt();
    return done_;
  }
  // Blocks until terminal. The first waiter that finds help (see set_help) runs it first.
  void wait() const {
    help();
    std::unique_lock lock(mutex_);
    if (inherited()) adopt();
    cv_.wait(lock, [&] { return done_; });
  }
  // Runs the help (see set_help) if no other waiter took it and the completion is not terminal; returns at once
  // otherwise. For a waiter that then blocks in its own way (wait_for in a loop, to stay interruptible).
  void help() const {
    std::function<void()> work;
    {
      std::lock_guard lock(mutex_);
      if (inherited()) adopt();
      if (done_) return;
      work.swap(help_);
    }
    if (work) {
      work();
      work = nullptr;  // its captures go before this thread blocks
    }
  }
  // Note [Waiters help]: work that a waiter may run itself before it blocks,
  // because the completion depends on it and it is safe on any thread (it takes
  // parts of queued work that no pool thread has taken yet). A caller that waits
  // at once then starts on the work without the hand-off to a sleeping pool
  // thread, and often finishes it and completes the handle itself, without the
  // wake-up back. At most one waiter runs it; wait_for never does (it would not
  // be bounded by the timeout). Dropped, unrun, when the completion is set.
  void set_help(std::function<void()> help) {
    {
      std::lock_guard lock(mutex_);
      if (inherited()) adopt();
      if (!done_) help_.swap(help);
    }
    // The help replaced (or refused) is destroyed here, without the lock: its captures may hold anything.
  }
  // True when terminal within `timeout`.
  bool wait_for(std::chrono::milliseconds timeout) const {
    std::unique_lock lock(mutex_);
    if (inherited()) adopt();
    return cv_.wait_for(lock, timeout, [&] { return done_; });
  }
  std::exception_ptr error() const {
    std::lock_guard lock(mutex_);
    if (inherited()) adopt();
    return error_;
  }
  void set_error(std::exception_ptr e) { finish(std::move(e)); }
  // Runs `cb` once terminal (now, if already terminal).
  void then(std::function<void()> cb) {
    {
      std::lock_guard lock(mutex_);
      if (inherited()) adopt();
      if (!done_) {
        callbacks_.push_back(std::move(cb));
        return;
      }
    }
    cb();
  }

 protected:
  void finish(std::exception_ptr e) {
    finish(std::move(e), [] {});
  }
  // Under the lock: refuses a second set before `store` records anything, so
  // a refused set never disturbs the published value (or a reader of it).
  template <class Store>
  void finish(std::exception_ptr e, Store&& store) {
    std::vector<std::function<void()>> cbs;
    std::function<void()> help;  // destroyed after the lock, with no waiter left to run it
    {
      std::lock_guard lock(mutex_);
      if (inherited()) adopt();
      if (failed_by_fork_) return;  // its work, inherited from the parent, is not this process's (Note [Fork safety])
      SW_ASSERT(!done_, "a completion was set twice");
      store();
      error_ = std::move(e);
      done_ = true;
      cbs.swap(callbacks_);
      help.swap(help_);
    }
    cv_.notify_all();
    for (auto& cb : cbs) cb();
  }
  // A striped lock, held across fork() (Note [Fork safety]); critical sections under it take no other lock.
  std::mutex& mutex_ = detail::completion_lock(this);

 private:
  // Under the lock: whether this completion was created before the fork() that made this process.
  bool inherited() const noexcept { return generation_ != fork_generation(); }
  // Under the lock, in a child of fork(): see Note [Fork safety].
  void adopt() const;

  mutable std::condition_variable cv_;
  mutable uint64_t generation_ = fork_generation();  // under the lock
  mutable bool done_ = false;
  mutable bool failed_by_fork_ = false;
  mutable std::exception_ptr error_;
  mutable std::vector<std::function<void()>> callbacks_;
  mutable std::function<void()> help_;  // Note [Waiters help]
};

template <class T>
class Completion final : public CompletionBase {
 public:
  void set_value(T v) {
    finish(nullptr, [&] { value_ = std::move(v); });
  }
  // The value after successful completion (rethrows the error otherwise).
  const T& value() const {
    wait();
    if (auto e = error()) std::rethrow_exception(e);
    return *value_;
  }

 private:
  std::optional<T> value_;
};

template <class T>
using CompletionPtr = std::shared_ptr<Completion<T>>;

// A pool of lazily started worker threads. `nice` is the scheduling niceness
// its threads take when they start (0: the process's own); see Note
// [Background I/O threads].
class Executor {
 public:
  Executor(std::string name, size_t threads, int nice = 0);
  ~Executor();
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  void submit(std::function<void()> work);
  const std::string& name() const noexcept { return name_; }
  size_t max_threads() const noexcept { return max_threads_; }
  int nice() const noexcept { return nice_; }
  size_t started_threads() const;
  // Blocks until no work is queued or running (a finished work item's captures
  // are destroyed before it counts as done), or until `timeout` passes; returns
  // whether the pool went idle. Called at interpreter exit, see Note [Drain at exit].
  bool wait_idle(std::chrono::milliseconds timeout);

  static Executor& io();
  // Reads that wait on a device (cold reads that bypass the page cache): at the process's priority, since such a
  // thread only issues a system call and sleeps in it (Note [Background I/O threads]).
  static Executor& device_reads();
  static Executor& select();
  static Executor& moves();

 private:
  void run();
  // Note [Fork safety]: the process pools' queues are locked across fork(); the child's pool starts afresh.
  static Executor* process_pool(std::string name, size_t threads, int nice = 0);
  static void lock_process_pools();
  static void unlock_process_pools();
  static void restart_process_pools_in_child();
  void restart_in_child();
  std::string name_;
  size_t max_threads_;
  int nice_;
  mutable std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  size_t busy_ = 0;  // work items taken and not yet destroyed
  std::condition_variable idle_cv_;
  bool stopping_ = false;
};

}  // namespace sw
