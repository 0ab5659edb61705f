// strideweave/grad_mode.hpp — the per-thread autograd switch (default on).
#pragma once

namespace sw {

bool is_grad_enabled() noexcept;
void set_grad_enabled(bool enabled) noexcept;

// RAII: sets grad mode for a scope and restores the previous value.
class GradModeGuard {
 public:
  explicit GradModeGuard(bool enabled) : previous_(is_grad_enabled()) { set_grad_enabled(enabled); }
  ~GradModeGuard() { set_grad_enabled(previous_); }
  GradModeGuard(const GradModeGuard&) = delete;
  GradModeGuard& operator=(const GradModeGuard&) = delete;

 private:
  bool previous_;
};

}  // namespace sw
