// The tile table of a TiledEvictable: construction (tiers, claims, seeding), fork safety, footprint checks,
// tile states and the references a gradient sum counts. Residency requests are in residency.cpp.
#include <algorithm>
#include <new>
#include <sstream>
#include <thread>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/tiled/data.hpp"
#include "internal.hpp"

namespace sw {

const char* location_name(TileLocation loc) {
  switch (loc) {
    case TileLocation::Primary: return "primary";
    case TileLocation::Secondary: return "secondary";
    case TileLocation::Implicit: return "implicit";
    case TileLocation::Invalid: return "invalid";
  }
  return "?";
}

const CarrierKind& tiled_evictable_kind() {
  static const CarrierKind k{"TiledEvictable", true, false, true};
  return k;
}

// ---------------------------------------------------------------- construction

TiledEvictable::TiledEvictable(CarrierPtr primary, CarrierPtr secondary, std::vector<int64_t> grid,
                               std::vector<int64_t> tile, std::shared_ptr<ResidencyPolicy> policy, bool is_mutable)
    : DependentCarrier(&tiled_evictable_kind(), primary ? primary->dtype() : DType::Float32(), is_mutable),
      policy_(std::move(policy)) {
  // Direct operations on whole tiled tensors work in any program that builds one (idempotent, one guard check).
  install_tiled_backend();
  if (!primary || !secondary) raise<TypeError>("TiledEvictable tiers must be Carrier instances");
  // Any storage kind may be a tier, a registered user kind included (its provider is called from the I/O
  // threads as from any other); only a dependent carrier, which composes tiers of its own, may not.
  for (const Carrier* c : {primary.get(), secondary.get()}) {
    if (c->kind().dependent)
      raise<TypeError>("TiledEvictable tiers must not be dependent carriers, got the dependent ", c->kind_name());
  }
  if (primary == secondary) raise<ValueError>("TiledEvictable primary and secondary must be distinct carriers");
  for (const Carrier* c : {primary.get(), secondary.get()}) {
    if (c->is_released()) raise<RuntimeError>("TiledEvictable tier ", c->kind_name(), " is released");
    if (c->is_owned()) raise<RuntimeError>("TiledEvictable tier ", c->kind_name(), " is owned by ", c->owner_description());
  }
  if (primary->dtype() != secondary->dtype())
    raise<TypeError>("TiledEvictable tiers must share one dtype, got ", primary->dtype().name(), " and ",
                     secondary->dtype().name());
  geometry_ = TileGeometry(std::move(grid), std::move(tile));  // ValueError, before anything is allocated
  const int64_t total = geometry_.size();
  const int64_t p = primary->size(), s = secondary->size();
  if (p != 0 && p != total) raise<ValueError>("TiledEvictable primary must have 0 or ", total, " slots, got ", p);
  if (s != 0 && s != total) raise<ValueError>("TiledEvictable secondary must have 0 or ", total, " slots, got ", s);
  if (s == 0 && !secondary->can_grow())
    raise<ValueError>("TiledEvictable secondary ", secondary->kind_name(), " is empty and cannot grow to hold evicted tiles");
  tiles_.resize(static_cast<size_t>(tile_count()));
  // Claims, rolled back if anything below fails.
  Claim pc = primary->claim("a TiledEvictable carrier");
  Claim sc = secondary->claim("a TiledEvictable carrier");
  if (p == total) {
    for (int64_t t = 0; t < tile_count(); ++t) {
      CarrierPtr buf = primary->allocate_like(tile_size(), true, dtype(), true);
      for (const Run& r : geometry_.footprint_runs(t)) copy_slots(*primary, r.offset, *buf, r.ordinal, r.length);
      tiles_[t].loc = TileLocation::Primary;
      tiles_[t].buffer = std::move(buf);
      tiles_[t].dirty = true;  // a full secondary holds unrelated values: the primary value must be preserved
      tiles_[t].secondary_valid = false;
      stats_.primary_tiles++;
      stats_.primary_bytes += tile_size() * static_cast<int64_t>(slot_bytes(dtype()));
    }
  } else if (s == total) {
    for (auto& t : tiles_) {
      t.loc = TileLocation::Secondary;
      t.secondary_valid = true;
    }
  }
  primary_ = std::move(primary);
  secondary_ = std::move(secondary);
  primary_claim_ = std::move(pc);
  secondary_claim_ = std::move(sc);
  if (const auto* file = dynamic_cast<const FileBackedCarrier*>(secondary_.get()); file && !file->is_anonymous()) {
    named_file_ = file->filename();
    auto& named = named_file_carriers();
    std::lock_guard lock(named.m);
    named.live.push_back(this);
  }
  register_for_fork();  // last: a constructor that throws has nothing to unregister
}

TiledEvictable::~TiledEvictable() {
  unregister_for_fork();
  if (budget_) budget_->leave(*this);  // noexcept
  if (named_file_.empty()) return;
  {
    auto& named = named_file_carriers();
    std::lock_guard lock(named.m);
    if (auto it = std::find(named.live.begin(), named.live.end(), this); it != named.live.end()) named.live.erase(it);
  }
  if (is_released() || exit_reported_.load()) return;
  try {
    int64_t tiles;
    {
      std::lock_guard lock(mutex_);
      tiles = unsaved_tiles_locked();
    }
    DiscardReporter report = discard_reporter();
    if (tiles > 0 && report) report(discard_warning(tiles, "as it is destroyed (collected)"));
  } catch (...) {  // a destructor reports what it can and never throws
  }
}

// ---------------------------------------------------------------- fork (Note [Fork safety], fork.hpp)

namespace {
// The live tile tables, in an intrusive list (TiledEvictable::fork_prev_/fork_next_) under this mutex, which
// the prepare step holds across fork(): no carrier is made or destroyed in between.
std::mutex& tile_tables_mutex() {
  static auto* m = new std::mutex();  // never destroyed: carriers may be destroyed during static destruction
  return *m;
}
TiledEvictable* g_tile_tables = nullptr;  // under tile_tables_mutex()
}  // namespace

void TiledEvictable::register_for_fork() {
  static const bool registered =
      (on_fork(ForkLevel::TileTables, lock_tile_tables, unlock_tile_tables, restart_tile_tables_in_child), true);
  (void)registered;
  std::lock_guard lock(tile_tables_mutex());
  fork_next_ = g_tile_tables;
  if (fork_next_) fork_next_->fork_prev_ = this;
  g_tile_tables = this;
}

void TiledEvictable::unregister_for_fork() noexcept {
  std::lock_guard lock(tile_tables_mutex());
  if (fork_prev_) fork_prev_->fork_next_ = fork_next_;
  else g_tile_tables = fork_next_;
  if (fork_next_) fork_next_->fork_prev_ = fork_prev_;
}

// No thread takes the registry's mutex while it holds a tile table's, and two tile tables are only ever
// taken together through std::scoped_lock (which never blocks while it holds one), so taking them one by
// one here cannot deadlock.
void TiledEvictable::lock_tile_tables() {
  tile_tables_mutex().lock();
  for (TiledEvictable* c = g_tile_tables; c; c = c->fork_next_) {
    c->mutex_.lock();
    c->footprint_cache_mutex_.lock();
  }
}

void TiledEvictable::unlock_tile_tables() {
  for (TiledEvictable* c = g_tile_tables; c; c = c->fork_next_) {
    c->footprint_cache_mutex_.unlock();
    c->mutex_.unlock();
  }
  tile_tables_mutex().unlock();
}

// In the child: the requests and work in flight at fork() run only in the parent, so their pending marks,
// pins and counts are forgotten (each tile keeps its state from before them, as after a failed request),
// and idle_cv_ is made afresh (a release() waiting on it in the parent is a phantom here).
void TiledEvictable::restart_tile_tables_in_child() {
  for (TiledEvictable* c = g_tile_tables; c; c = c->fork_next_) {
    for (Tile& t : c->tiles_) {
      t.pending = 0;
      t.pins = 0;
      t.behind = 0;  // the parent writes them (Note [Write-behind evictions])
    }
    c->behind_tiles_ = 0;
    c->behind_requests_ = 0;
    c->behind_jobs_ = 0;
    c->behind_queue_.clear();
    c->active_requests_ = 0;
    c->active_work_ = 0;
    c->turns_.clear();  // the threads waiting in turn are not in the child (Note [Taking turns])
    new (&c->idle_cv_) std::condition_variable();
  }
  unlock_tile_tables();
}

// ---------------------------------------------------------------- footprints

void TiledEvictable::check_footprints(const TensorImpl& t) const {
  if (t.carrier.get() != this) raise<TypeError>("the tensor is not backed by this TiledEvictable");
  {
    std::lock_guard lock(footprint_cache_mutex_);
    for (const auto& [l, off] : footprint_cache_)
      if (off == t.offset && l == t.layout) return;
  }
  geometry_.check_footprints(t.layout, t.offset);  // ValueError ("tile footprints")
  std::lock_guard lock(footprint_cache_mutex_);
  if (footprint_cache_.size() >= 8) footprint_cache_.erase(footprint_cache_.begin());
  footprint_cache_.emplace_back(t.layout, t.offset);
}

// ---------------------------------------------------------------- states

TileState TiledEvictable::tile_state(const TileCoord& t) const {
  int64_t i = tile_index(t);
  std::lock_guard lock(mutex_);
  const Tile& tile = tiles_[i];
  return {tile.loc, tile.loc != TileLocation::Invalid, tile.loc == TileLocation::Primary && tile.dirty};
}

std::vector<TileCoord> TiledEvictable::tiles_where(const std::function<bool(const TileState&)>& pred) const {
  std::vector<TileCoord> out;
  std::lock_guard lock(mutex_);
  for (int64_t i = 0; i < tile_count(); ++i) {
    const Tile& t = tiles_[i];
    TileState s{t.loc, t.loc != TileLocation::Invalid, t.loc == TileLocation::Primary && t.dirty};
    if (pred(s)) out.push_back(tile_coord(i));
  }
  return out;
}

TiledStats TiledEvictable::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

bool TiledEvictable::has_incomplete_work() const {
  std::lock_guard lock(mutex_);
  return active_requests_ > 0 || active_work_ > 0;
}

// Note [Requests' own references]: a queued residency request holds the carrier
// (Request::owner) until its transfers end, so that dropping every other
// reference cannot free the tiles under an I/O thread. A tiled gradient adds in
// place only when nothing else holds it (Note [Tiled gradient accumulation]);
// counting the requests' references as "something else" made every gradient sum
// that met an eviction of other tiles (or a read-back of them) build a new
// gradient, with every written-out tile read back into memory, so callers had
// to wait for all such transfers before each backward. The requests' references
// are therefore counted (request_refs_, shared with the requests so a request
// can uncount after dropping its reference, which may free the carrier), and
// only the rest must be the caller's one. Tiles under a request are still
// never added into: accumulate_tiles and hold_tile_for_update check each
// tile. A request takes its reference after counting it and uncounts it after
// dropping it, and the count is read before the use count, so a reading taken
// in between shows fewer references than the caller's own (never more than
// there are), which only a request in between can cause: it is read again.
bool TiledEvictable::only_reference_is(const CarrierPtr& self) const {
  SW_ASSERT(self.get() == this, "only_reference_is: not a reference to this carrier");
  for (;;) {
    const int64_t requests = request_refs_->load(std::memory_order_seq_cst);  // first: see the Note
    const int64_t others = static_cast<int64_t>(self.use_count()) - requests;
    if (others >= 1) return others == 1;
    std::this_thread::yield();  // a request between dropping its reference and uncounting it
  }
}

void TiledEvictable::pending_conflict(int64_t index, const char* what) const {
  if (tiles_[index].pending & kSumHold)
    raise<RuntimeError>("tile ", coord_str(tile_coord(index)), " of TiledEvictable is being added into by a gradient ",
                        "sum (backward); wait for it before ", what);
  raise<RuntimeError>("tile ", coord_str(tile_coord(index)), " of TiledEvictable has an incomplete residency request; ",
                      "wait for it before ", what);
}

}  // namespace sw
