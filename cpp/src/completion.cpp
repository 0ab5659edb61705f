#include "strideweave/completion.hpp"

#include <pthread.h>

#include <algorithm>

namespace sw {

Executor::Executor(std::string name, size_t threads) : name_(std::move(name)), max_threads_(std::max<size_t>(1, threads)) {}

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

// Intentionally leaked: pools must outlive every static object that may submit work.
Executor& Executor::io() {
  static Executor* e = new Executor("sw-io", std::max<size_t>(4, hardware()));
  return *e;
}
Executor& Executor::select() {
  static Executor* e = new Executor("sw-select", hardware());
  return *e;
}
Executor& Executor::moves() {
  static Executor* e = new Executor("sw-move", std::max<size_t>(4, hardware()));
  return *e;
}

}  // namespace sw
