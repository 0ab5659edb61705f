// ResidencyBudget (Note [One residency budget], residency_budget.hpp): the resident tiles of its members in
// recency order, admission (make_room) and the working-set check; and a TiledEvictable's side of it.
#include <algorithm>
#include <chrono>
#include <optional>
#include <set>

#include "strideweave/errors.hpp"
#include "strideweave/tiled/residency_budget.hpp"
#include "internal.hpp"

namespace sw {

ResidencyBudget::ResidencyBudget(int64_t max_bytes, int64_t write_behind_bytes) : max_bytes_(max_bytes) {
  if (max_bytes < 1) raise<ValueError>("ResidencyBudget: max_bytes must be >= 1, got ", max_bytes);
  write_behind_limit_ = write_behind_bytes < 0 ? max_bytes / 8 : std::min(write_behind_bytes, max_bytes);
}

int64_t ResidencyBudget::write_behind_bytes() const {
  std::lock_guard lock(m_);
  return write_behind_limit_;
}

void ResidencyBudget::set_write_behind_bytes(int64_t bytes) {
  if (bytes < 0) raise<ValueError>("ResidencyBudget: write_behind_bytes must be >= 0 (0 turns write-behind off), got ", bytes);
  std::lock_guard lock(m_);
  write_behind_limit_ = std::min(bytes, max_bytes_);
}

BudgetStats ResidencyBudget::stats() const {
  std::lock_guard lock(m_);
  BudgetStats s;
  s.max_bytes = max_bytes_;
  s.resident_tiles = static_cast<int64_t>(entries_.size());
  s.resident_bytes = resident_bytes_;
  s.peak_tiles = peak_tiles_;
  s.peak_bytes = peak_bytes_;
  s.evictions = evictions_;
  s.members = static_cast<int64_t>(members_.size());
  s.write_behind_limit = write_behind_limit_;
  s.write_behind_tiles = behind_tiles_;
  s.write_behind_bytes = behind_bytes_;
  s.write_behind_evictions = behind_evictions_;
  s.write_behind_cancelled = behind_cancelled_;
  s.write_behind_failures = behind_failures_;
  s.eviction_waits = eviction_waits_;
  s.eviction_wait_ns = eviction_wait_ns_;
  s.write_behind_waits = behind_waits_;
  s.write_behind_wait_ns = behind_wait_ns_;
  return s;
}

void ResidencyBudget::reset_peak() {
  std::lock_guard lock(m_);
  peak_bytes_ = resident_bytes_;
  peak_tiles_ = static_cast<int64_t>(entries_.size());
}

void ResidencyBudget::join(const TiledEvictable& c) {
  std::lock_guard lock(m_);
  members_.emplace(&c, 0);
}

void ResidencyBudget::remove_locked(Key k) noexcept {  // by value: k may be the list node erased below
  auto it = entries_.find(k);
  if (it == entries_.end()) return;
  resident_bytes_ -= it->second.bytes;
  restart_after_fork_locked();  // in a child nothing is behind any more (and no phantom waits on behind_cv_)
  if (it->second.behind) {  // its write-behind ended by evicting it (or the carrier left)
    behind_tiles_--;
    behind_bytes_ -= it->second.bytes;
    behind_cv_.notify_all();
  }
  lru_.erase(it->second.pos);
  entries_.erase(it);
  if (auto m = members_.find(k.carrier); m != members_.end()) m->second--;
}

void ResidencyBudget::leave(const TiledEvictable& c) noexcept {
  std::lock_guard lock(m_);
  for (auto it = lru_.begin(); it != lru_.end();) {
    auto next = std::next(it);
    if (it->carrier == &c) remove_locked(*it);
    it = next;
  }
  members_.erase(&c);
}

void ResidencyBudget::resident(const TiledEvictable& c, int64_t index, int64_t bytes) {
  std::lock_guard lock(m_);
  const Key k{&c, index};
  if (auto it = entries_.find(k); it != entries_.end()) {  // already counted (a replaced buffer): most recent
    lru_.splice(lru_.end(), lru_, it->second.pos);
    return;
  }
  lru_.push_back(k);
  entries_.emplace(k, Entry{bytes, std::prev(lru_.end())});
  resident_bytes_ += bytes;
  members_[&c]++;
  peak_bytes_ = std::max(peak_bytes_, resident_bytes_);
  peak_tiles_ = std::max(peak_tiles_, static_cast<int64_t>(entries_.size()));
}

void ResidencyBudget::evicted(const TiledEvictable& c, int64_t index) noexcept {
  std::lock_guard lock(m_);
  if (auto it = entries_.find({&c, index}); it != entries_.end() && it->second.behind) {
    behind_evictions_++;
    evictions_++;
  }
  remove_locked({&c, index});
}

bool ResidencyBudget::write_behind_admit(const TiledEvictable& c, int64_t index) {
  std::lock_guard lock(m_);
  restart_after_fork_locked();
  auto it = entries_.find({&c, index});
  if (it == entries_.end() || it->second.behind || behind_bytes_ + it->second.bytes > write_behind_limit_) return false;
  it->second.behind = true;
  behind_tiles_++;
  behind_bytes_ += it->second.bytes;
  return true;
}

void ResidencyBudget::write_behind_ended(const TiledEvictable& c, int64_t index, bool failed) noexcept {
  std::lock_guard lock(m_);
  if (failed) behind_failures_++;
  else behind_cancelled_++;
  restart_after_fork_locked();
  auto it = entries_.find({&c, index});
  if (it == entries_.end() || !it->second.behind) return;
  it->second.behind = false;
  behind_tiles_--;
  behind_bytes_ -= it->second.bytes;
  behind_cv_.notify_all();
}

void ResidencyBudget::count_eviction_wait(int64_t ns, int64_t queued_ns) noexcept {
  std::lock_guard lock(m_);
  eviction_waits_++;
  eviction_wait_ns_ += ns;
  if (queued_ns >= 0) {
    behind_waits_++;
    behind_wait_ns_ += queued_ns;
  }
}

void ResidencyBudget::restart_after_fork_locked() noexcept {
  if (generation_ == fork_generation()) return;
  generation_ = fork_generation();
  for (auto& [key, entry] : entries_) entry.behind = false;
  behind_tiles_ = behind_bytes_ = 0;
  new (&behind_cv_) std::condition_variable();  // a waiter in the parent is a phantom here
}

void ResidencyBudget::touch(const TiledEvictable& c, std::span<const int64_t> tiles) {
  std::lock_guard lock(m_);
  for (int64_t i : tiles)
    if (auto it = entries_.find({&c, i}); it != entries_.end()) lru_.splice(lru_.end(), lru_, it->second.pos);
}

void ResidencyBudget::check_working_set(const TiledEvictable& c, int64_t tiles, int64_t bytes,
                                        const char* purpose) const {
  if (bytes <= max_bytes_) return;
  raise<ValueError>("residency budget: this ", purpose, " needs ", tiles, tiles == 1 ? " tile" : " tiles", " (",
                    bytes, " bytes) of a TiledEvictable with grid ", coord_str(c.grid_shape()),
                    " resident at once, more than the budget's ", max_bytes_,
                    " bytes; select fewer tiles per request or give the budget more bytes (nothing was changed)");
}

namespace {
struct Victim {
  TiledEvictable* carrier;
  std::shared_ptr<TiledEvictable> hold;  // null for the requester, which its caller keeps alive
  std::vector<int64_t> tiles;
};
}  // namespace

void ResidencyBudget::make_room(const TiledEvictable& requester, std::span<const int64_t> keep, int64_t bytes,
                                const char* purpose, const TiledEvictable* spare) {
  std::set<std::pair<const TiledEvictable*, int64_t>> tried;
  // Whether this admission waited on evictions (evicting inline, or for a write-behind), and since when.
  std::optional<std::chrono::steady_clock::time_point> waited;
  auto start_wait = [&] {
    if (!waited) waited = std::chrono::steady_clock::now();
  };
  int64_t queued_ns = -1;  // of which waiting for queued writes (-1: it never did)
  struct CountWait {
    ResidencyBudget& b;
    std::optional<std::chrono::steady_clock::time_point>& since;
    int64_t& queued_ns;
    ~CountWait() {
      if (since)
        b.count_eviction_wait(std::chrono::duration_cast<std::chrono::nanoseconds>(
                                  std::chrono::steady_clock::now() - *since).count(),
                              queued_ns);
    }
  } count_wait{*this, waited, queued_ns};
  for (;;) {
    std::vector<Victim> victims;
    {
      std::unique_lock lock(m_);
      restart_after_fork_locked();
      const int64_t resident_now = resident_bytes_;
      const int64_t over = resident_bytes_ + bytes - max_bytes_;
      if (over <= 0) break;
      // The bytes that the queued writes will not free are made room for here, in this thread.
      int64_t need = over - behind_bytes_;
      for (const Key& k : lru_) {
        if (need <= 0) break;
        if (k.carrier == spare) continue;
        if (k.carrier == &requester && std::binary_search(keep.begin(), keep.end(), k.index)) continue;
        const Entry& e = entries_.at(k);
        if (e.behind) continue;  // already being written
        if (!tried.insert({k.carrier, k.index}).second) continue;
        auto* carrier = const_cast<TiledEvictable*>(k.carrier);
        std::shared_ptr<TiledEvictable> hold;
        if (k.carrier != &requester) {
          // A member being destroyed (its last reference gone) waits in leave() for this lock: skipped.
          hold = std::static_pointer_cast<TiledEvictable>(carrier->weak_from_this().lock());
          if (!hold) continue;
        }
        need -= e.bytes;
        auto v = std::find_if(victims.begin(), victims.end(), [&](const Victim& x) { return x.carrier == carrier; });
        if (v == victims.end()) victims.push_back({carrier, std::move(hold), {k.index}});
        else v->tiles.push_back(k.index);
      }
      if (victims.empty()) {
        if (behind_bytes_ > 0) {  // only the queued writes can make room: wait for the oldest to end
          start_wait();
          const auto t0 = std::chrono::steady_clock::now();
          behind_cv_.wait(lock);
          queued_ns = std::max<int64_t>(queued_ns, 0) +
                      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0).count();
          continue;
        }
        raise<RuntimeError>("residency budget: no room for ", bytes, " more bytes (", purpose, "): the budget of ",
                            max_bytes_, " bytes holds ", resident_now,
                            " bytes in tiles that running work pins, that another request or a gradient sum holds, "
                            "or that this request needs; wait for that work, or give the budget more bytes");
      }
    }
    start_wait();
    int64_t evicted = 0;
    for (Victim& v : victims) evicted += v.carrier->evict_for_budget(v.tiles);
    std::lock_guard lock(m_);
    evictions_ += evicted;
  }
  write_ahead(requester, keep, bytes, spare);
}

// Note [Write-behind evictions]: see cpp/src/tiled/write_behind.cpp.
void ResidencyBudget::write_ahead(const TiledEvictable& requester, std::span<const int64_t> keep, int64_t bytes,
                                  const TiledEvictable* spare) {
  std::vector<Victim> candidates;
  {
    std::lock_guard lock(m_);
    if (write_behind_limit_ <= 0 || behind_bytes_ >= write_behind_limit_) return;
    // The bytes resident once this admission's tiles are in and the queued writes have ended, beyond the room the
    // write-behind keeps free.
    int64_t excess = resident_bytes_ + bytes - behind_bytes_ - (max_bytes_ - write_behind_limit_);
    for (const Key& k : lru_) {
      if (excess <= 0) break;
      if (k.carrier == spare) continue;
      if (k.carrier == &requester && std::binary_search(keep.begin(), keep.end(), k.index)) continue;
      const Entry& e = entries_.at(k);
      if (e.behind) continue;
      auto* carrier = const_cast<TiledEvictable*>(k.carrier);
      // Every candidate is held: the write runs on an I/O thread (a clean one is skipped there, and still counts
      // here: it is dropped at no cost when room is needed).
      auto hold = std::static_pointer_cast<TiledEvictable>(carrier->weak_from_this().lock());
      if (!hold) continue;
      excess -= e.bytes;
      auto v = std::find_if(candidates.begin(), candidates.end(), [&](const Victim& x) { return x.carrier == carrier; });
      if (v == candidates.end()) candidates.push_back({carrier, std::move(hold), {k.index}});
      else v->tiles.push_back(k.index);
    }
  }
  for (Victim& v : candidates) v.carrier->queue_write_behind(v.tiles);
}

// ---------------------------------------------------------------- a TiledEvictable's side

int64_t TiledEvictable::tile_bytes() const noexcept {
  return tile_size() * static_cast<int64_t>(slot_bytes(dtype()));
}

void TiledEvictable::set_residency_budget(std::shared_ptr<ResidencyBudget> budget) {
  if (!budget) raise<TypeError>("set_residency_budget: budget must be a ResidencyBudget");
  {
    std::lock_guard lock(mutex_);
    check_live("draw from a residency budget");
    if (budget_ == budget) return;
    if (budget_)
      raise<RuntimeError>("set_residency_budget: this TiledEvictable already draws from another residency budget");
    budget_ = budget;
    budget_->join(*this);
    for (int64_t i = 0; i < tile_count(); ++i)
      if (tiles_[i].loc == TileLocation::Primary) budget_->resident(*this, i, tile_bytes());
  }
  budget->make_room(*this, {}, 0, "joining");  // evicts down to the bound when the carrier brought too much
}

int64_t TiledEvictable::evict_for_budget(const std::vector<int64_t>& tiles) {
  auto r = std::make_shared<Request>();
  r->promote = false;
  {
    std::lock_guard lock(mutex_);
    if (is_released()) return 0;
    prepare_eviction(tiles, *r, /*deferred=*/true);  // pinned, held or moving tiles are left out
    if (r->tiles.empty()) return 0;
  }
  start_request(r, /*inline_=*/true);
  r->done->value();  // a failed write raises its error; the tiles stay resident (all-or-nothing)
  return static_cast<int64_t>(r->tiles.size());
}

void TiledEvictable::admit(std::vector<int64_t> tiles, const char* purpose) {
  if (!budget_ || is_released()) return;  // a released carrier refuses the request itself
  std::sort(tiles.begin(), tiles.end());
  tiles.erase(std::unique(tiles.begin(), tiles.end()), tiles.end());
  int64_t fresh = 0;
  {
    std::lock_guard lock(mutex_);
    for (int64_t i : tiles)
      if (tiles_[i].loc != TileLocation::Primary) fresh++;
  }
  if (fresh == 0) return;
  budget_->check_working_set(*this, static_cast<int64_t>(tiles.size()), static_cast<int64_t>(tiles.size()) * tile_bytes(),
                             purpose);
  budget_->make_room(*this, tiles, fresh * tile_bytes(), purpose);
}

}  // namespace sw
