// strideweave/tiled/gradient_hook.hpp — who consumes a tile's gradient the moment it is final.
//
// Note [Gradient reservations]: an optimizer that steps in backward (Note [Stepping in backward] in
// strideweave/optim.hpp) must know when a tile's gradient is final: when no recorded computation that can still add
// into it remains. Each computation that records a use of tiles of a tiled parameter (a projection recorded for
// autograd, a SparseMoE call's routed experts, the torch bridge's per-expert arithmetic) takes a
// GradientReservation on those tiles from the carrier's hook, and finishes each tile once: `delivered` when its
// backward has added that tile's contribution into the parameter's .grad, or not (its graph freed without a
// backward reaching it; the reservation's destructor finishes what remains that way). The hook counts, per tile,
// the reservations outstanding; when a tile's count falls to zero on a delivered finish, its gradient is final for
// this backward and the hook may consume it. Carriers without a hook cost one null check per recorded use.
#pragma once

#include <cstdint>
#include <memory>
#include <span>
#include <vector>

namespace sw {

class TileGradientHook {
 public:
  virtual ~TileGradientHook() = default;
  // A recorded computation will add into the gradient of `tiles` (indices of the carrier's grid; repeats count
  // twice). Raises (and reserves nothing) when the hook refuses the use.
  virtual void reserve(std::span<const int64_t> tiles) = 0;
  // One reservation of `tile` ends; `delivered`: its contribution reached the parameter's .grad. Never raises
  // for a count: errors of what the hook then does (a step) propagate to the caller.
  virtual void finish(int64_t tile, bool delivered) = 0;
};

// A computation's reservations on one carrier's tiles, finished exactly once each (RAII, move-only).
class GradientReservation {
 public:
  GradientReservation() = default;
  GradientReservation(std::shared_ptr<TileGradientHook> hook, std::vector<int64_t> tiles);
  GradientReservation(GradientReservation&& o) noexcept = default;
  GradientReservation& operator=(GradientReservation&& o) noexcept;
  GradientReservation(const GradientReservation&) = delete;
  GradientReservation& operator=(const GradientReservation&) = delete;
  ~GradientReservation();  // finishes the tiles still reserved, not delivered
  explicit operator bool() const noexcept { return hook_ != nullptr; }
  // Finishes one reservation of `tile` (nothing when `tile` holds none here).
  void finish(int64_t tile, bool delivered);
  // Finishes every reservation still held.
  void finish_all(bool delivered);

 private:
  std::shared_ptr<TileGradientHook> hook_;
  std::vector<int64_t> tiles_;  // still reserved
};

}  // namespace sw
