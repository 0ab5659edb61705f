// Slot access of a TiledEvictable (the Carrier interface): reads (Note [Reading a slot never moves a tile]),
// writes (a write promotes first), bulk forms and allocate_like.
#include <algorithm>
#include <cstring>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "internal.hpp"

namespace sw {

// ---------------------------------------------------------------- data access

const TiledEvictable::Tile& TiledEvictable::readable_tile(int64_t index, std::unique_lock<std::mutex>& lock) const {
  for (;;) {
    const_cast<TiledEvictable*>(this)->settle_write_behind(lock, {&index, 1});  // Note [Write-behind evictions]
    const Tile& t = tiles_[index];
    if (t.pending) pending_conflict(index, "accessing its values");
    if (t.loc == TileLocation::Invalid)
      raise<RuntimeError>("tile ", coord_str(tile_coord(index)), " of TiledEvictable is invalid: it has no value yet");
    if (t.loc != TileLocation::Secondary) return t;
    // A secondary tile is promoted first.
    lock.unlock();
    const_cast<TiledEvictable*>(this)->promote_tiles({index}, /*inline_=*/true)->value();
    lock.lock();
  }
}

// Note [Reading a slot never moves a tile]: reading a slot of a tile that
// lives in the secondary tier reads that slot through the secondary (which
// holds the full extent in slot order), and the tile stays where it is: a
// read is not a residency decision, and promoting a whole tile to read one
// slot would also evict others under a residency budget. Writes still
// promote first (the primary holds the only dirty copy). The read runs
// outside the tile-table lock, so a user storage kind's provider is never
// called under it, and counts as active work, so release() waits for it (or
// refuses) instead of freeing the secondary under it. A concurrent promotion
// only reads the secondary; an eviction can only write it after a promotion
// and a write, which the read does not overlap in any order that matters
// (it returns the value before that write, as if it had run first).
Value TiledEvictable::read_value(int64_t slot) const {
  const auto [index, within] = locate(slot);
  alignas(8) std::byte buf[8];
  read_tile_run(index, slot, within, 1, buf);
  return load_value(dtype(), buf);
}

void TiledEvictable::write_value(int64_t slot, const Value& value) {
  auto [index, within] = locate(slot);
  std::unique_lock lock(mutex_);
  for (;;) {
    const Tile& t = readable_tile(index, lock);
    if (t.loc == TileLocation::Primary) break;
    lock.unlock();  // implicit: materialise a zero buffer first
    promote_tiles({index}, /*inline_=*/true)->value();
    lock.lock();
  }
  Tile& t = tiles_[index];
  if (t.pins > 0)
    raise<RuntimeError>("tile ", coord_str(tile_coord(index)),
                        " of TiledEvictable is pinned by running tiled work (its values must stay as they were); "
                        "wait for that work before writing");
  t.buffer->write_value(within, value);
  t.dirty = true;
}

// In bulk: one read per footprint run of each tile the range covers (a resident tile's run is one copy from its
// buffer, a secondary tile's one read of its tier, an implicit tile's zeros), never slot by slot.
void TiledEvictable::read_slots(int64_t start, int64_t count, void* out) const {
  auto* bytes = static_cast<std::byte*>(out);
  const size_t w = slot_bytes(dtype());
  for (int64_t k = 0; k < count;) {
    const int64_t slot = start + k;
    const auto [index, within] = locate(slot);
    // The footprint run holding `slot`: runs are in slot order.
    const FootprintRuns runs = geometry_.footprint_runs(index);
    size_t lo = 0, hi = runs.size();
    while (hi - lo > 1) {
      const size_t mid = lo + (hi - lo) / 2;
      (runs[mid].offset <= slot ? lo : hi) = mid;
    }
    const Run r = runs[lo];
    const int64_t n = r.offset <= slot && slot < r.offset + r.length ? std::min(count - k, r.offset + r.length - slot) : 1;
    read_tile_run(index, slot, within, n, bytes + static_cast<size_t>(k) * w);
    k += n;
  }
}

void TiledEvictable::read_tile_run(int64_t index, int64_t slot, int64_t within, int64_t n, std::byte* out) const {
  std::unique_lock lock(mutex_);
  {
    const_cast<TiledEvictable*>(this)->settle_write_behind(lock, {&index, 1});  // Note [Write-behind evictions]
    const Tile& t = tiles_[index];
    if (t.pending) pending_conflict(index, "accessing its values");
    if (t.loc == TileLocation::Secondary) {  // read through the secondary; the tile stays where it is
      auto* self = const_cast<TiledEvictable*>(this);
      self->active_work_++;
      lock.unlock();
      struct EndRead {
        TiledEvictable* self;
        ~EndRead() {
          std::lock_guard l(self->mutex_);
          self->active_work_--;
          self->idle_cv_.notify_all();
        }
      } end{self};
      secondary_->read_slots(slot, n, out);
      return;
    }
  }
  const Tile& t = readable_tile(index, lock);
  if (t.loc == TileLocation::Implicit) {
    std::memset(out, 0, static_cast<size_t>(n) * slot_bytes(dtype()));  // zero bytes: 0, 0.0 or false
    return;
  }
  t.buffer->read_slots(within, n, out);
}

void TiledEvictable::write_slots(int64_t start, int64_t count, const void* in) {
  // A bulk write that covers the whole footprint of an invalid tile initialises it (new_like, gradients):
  // such a tile gets a fresh primary buffer first, and the writes below fill all of it.
  std::vector<int64_t> covered;
  {
    std::lock_guard lock(mutex_);
    for (int64_t t = 0; t < tile_count(); ++t) {
      if (tiles_[t].loc != TileLocation::Invalid || tiles_[t].pending) continue;
      const auto& runs = geometry_.footprint_runs(t);
      if (std::all_of(runs.begin(), runs.end(),
                      [&](const Run& r) { return r.offset >= start && r.offset + r.length <= start + count; }))
        covered.push_back(t);
    }
  }
  for (int64_t t : covered) {
    CarrierPtr buf = primary_->allocate_like(tile_size(), true, dtype(), true);  // outside the lock
    std::lock_guard lock(mutex_);
    Tile& tile = tiles_[t];
    if (tile.loc != TileLocation::Invalid || tile.pending) continue;
    tile.buffer = std::move(buf);
    tile.loc = TileLocation::Primary;
    tile.dirty = true;
    tile.secondary_valid = false;
    stats_.primary_tiles++;
    stats_.primary_bytes += tile_size() * static_cast<int64_t>(slot_bytes(dtype()));
    if (budget_) budget_->resident(*this, t, tile_bytes());
  }
  auto* bytes = static_cast<const std::byte*>(in);
  const size_t w = slot_bytes(dtype());
  for (int64_t k = 0; k < count; ++k) write_value(start + k, load_value(dtype(), bytes + k * w));
}

bool TiledEvictable::supports_storage_dtype(const DType& d) const {
  return primary_->supports_storage_dtype(d) && secondary_->supports_storage_dtype(d);
}

CarrierPtr TiledEvictable::allocate_like(int64_t slots, bool is_mutable, const DType& d, bool empty) const {
  if (slots != 0 && slots != geometry_.size())
    raise<ValueError>("TiledEvictable.allocate_like size must be 0 or the full extent ", geometry_.size(), ", got ", slots);
  CarrierPtr p = primary_->allocate_like(0, true, d, true);
  // Under a budget, a derived carrier (a gradient) evicts to a scratch file of its own when the secondary tier is
  // memory (CPU, Generic): evicting into memory would free nothing (Note [One residency budget]).
  const bool in_memory = &secondary_->kind() == &cpu_kind() || &secondary_->kind() == &generic_kind();
  CarrierPtr s = budget_ && in_memory ? std::make_shared<FileBackedCarrier>(std::string(), d, true)
                                      : secondary_->allocate_like(0, true, d, true);
  auto out = std::make_shared<TiledEvictable>(p, s, grid_shape(), tile_shape(), policy_, is_mutable);
  if (!empty) {
    std::lock_guard lock(out->mutex_);
    for (auto& t : out->tiles_) t.loc = TileLocation::Implicit;
  }
  if (budget_) out->set_residency_budget(budget_);  // gradients draw from their parameter's budget
  return out;
}

}  // namespace sw
