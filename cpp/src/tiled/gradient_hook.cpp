// Gradient reservations (Note [Gradient reservations], strideweave/tiled/gradient_hook.hpp): the carrier's hook, a
// reservation's bookkeeping, and a held gradient tile that becomes an implicit zero without being written.
#include "strideweave/tiled/gradient_hook.hpp"

#include <algorithm>

#include "strideweave/errors.hpp"
#include "internal.hpp"

namespace sw {

GradientReservation::GradientReservation(std::shared_ptr<TileGradientHook> hook, std::vector<int64_t> tiles)
    : hook_(std::move(hook)), tiles_(std::move(tiles)) {}

GradientReservation& GradientReservation::operator=(GradientReservation&& o) noexcept {
  if (this != &o) {
    finish_all(false);
    hook_ = std::move(o.hook_);
    tiles_ = std::move(o.tiles_);
  }
  return *this;
}

GradientReservation::~GradientReservation() { finish_all(false); }

void GradientReservation::finish(int64_t tile, bool delivered) {
  if (!hook_) return;
  auto it = std::find(tiles_.begin(), tiles_.end(), tile);
  if (it == tiles_.end()) return;
  tiles_.erase(it);
  hook_->finish(tile, delivered);
}

void GradientReservation::finish_all(bool delivered) {
  if (!hook_) return;
  // One at a time, each taken out first: an error from a delivered finish leaves the rest to the destructor.
  while (!tiles_.empty()) {
    const int64_t t = tiles_.back();
    tiles_.pop_back();
    hook_->finish(t, delivered);
  }
}

void TiledEvictable::set_gradient_hook(std::shared_ptr<TileGradientHook> hook) {
  std::lock_guard lock(hook_mutex_);
  if (hook && gradient_hook_ && gradient_hook_ != hook)
    raise<ValueError>("TiledEvictable of grid ", coord_str(grid_shape()),
                      ": another consumer already takes its gradients in backward (an optimizer with "
                      "step_in_backward); give each parameter to one such optimizer");
  gradient_hook_ = std::move(hook);
}

std::shared_ptr<TileGradientHook> TiledEvictable::gradient_hook() const {
  std::lock_guard lock(hook_mutex_);
  return gradient_hook_;
}

GradientReservation TiledEvictable::reserve_gradients(std::vector<int64_t> tiles) const {
  std::shared_ptr<TileGradientHook> hook = gradient_hook();
  if (!hook || tiles.empty()) return {};
  hook->reserve(tiles);
  return GradientReservation(std::move(hook), std::move(tiles));
}

void TiledEvictable::TileWrite::commit_zero() {
  SW_ASSERT(!ended_ && hold_, "TileWrite::commit_zero without a hold");
  CarrierPtr let_go;  // freed after the lock
  {
    std::lock_guard lock(owner_->mutex_);
    Tile& t = owner_->tiles_[index_];
    SW_ASSERT(t.buffer == buffer_ && t.loc == TileLocation::Primary, "a held tile changed under its writer");
    let_go = std::move(t.buffer);
    t.loc = TileLocation::Implicit;
    t.dirty = false;
    t.secondary_valid = false;
    const int64_t bytes = owner_->tile_bytes();
    owner_->stats_.primary_tiles--;
    owner_->stats_.primary_bytes -= bytes;
    if (owner_->budget_) owner_->budget_->evicted(*owner_, index_);
    owner_->bump_version();
    owner_->end_hold_locked({&index_, 1}, hold_);
    ended_ = true;
  }
  buffer_.reset();
  data_ = nullptr;
}

}  // namespace sw
