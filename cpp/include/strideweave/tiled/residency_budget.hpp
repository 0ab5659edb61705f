// strideweave/tiled/residency_budget.hpp — one bound on the resident tiles of several TiledEvictables.
//
// Note [One residency budget]: a residency policy decides for one carrier, and a
// tiled gradient's carrier (allocate_like of its parameter's) had no bound at
// all: training an expert stack kept every touched expert's gradient tile
// resident unless user code evicted it by hand. A ResidencyBudget bounds the
// primary bytes of every carrier that draws from it together: weights, their
// gradients (a carrier under a budget passes it to every carrier derived from
// it by allocate_like: fresh gradients, their sums, scatter results) and any
// other carrier set to draw from it.
//  * Admission, before a tile becomes resident (a promotion, a work request's
//    missing tiles, a gradient's installed or read-back tiles): when the tiles
//    resident under the budget plus the new ones would exceed it, the least
//    recently used resident tiles of any member are evicted first, in the
//    calling thread, to their carrier's secondary tier (a dirty tile is written,
//    a clean one dropped). Tiles that running work pins, that a request or a
//    gradient sum holds, and the tiles the request itself needs are skipped.
//    A tile evicted from a gradient is read back when a later backward adds
//    into it (accumulate_tiles reads its secondary copy). A gradient's tier is
//    a scratch file of its own: allocate_like of a file or checkpoint tier, and
//    under a budget an anonymous FileBacked when the tier is memory (evicting
//    into memory would free nothing).
//  * Recency: a tile is most recent when it becomes resident, when work
//    requires it, and when a gradient sum adds into it.
//  * A work request whose own tiles (non-implicit, resident or not) exceed the
//    budget is refused with ValueError before anything changes (the policy is
//    not asked, nothing is evicted or pinned). When room cannot be made because
//    everything resident is in use, the request fails with RuntimeError; tiles
//    evicted while trying stay evicted (their values are safe in their tiers).
//  * Untouched gradient tiles are implicit zeros: they take no room.
//  * Write-behind (Note [Write-behind evictions] in cpp/src/tiled/write_behind.cpp): after an admission, when
//    less than write_behind_bytes() of the budget would be free once the queued writes end, least recently used
//    dirty tiles are handed to the I/O executor to be written and evicted there, up to write_behind_bytes() at
//    once (the bounded queue). A tile queued or being written still counts as resident until its write commits,
//    so the bound holds; an admission waits only when it cannot fit without the bytes those writes will free (it
//    then waits for the oldest), and that wait is counted in stats(). A queued tile used again before its write
//    starts is taken back (it stays resident); one being written is waited for.
// The bound holds for the requests of one thread at a time (a fresh gradient
// that is added into .grad shares its tile buffer, which is counted once);
// requests admitted concurrently by several threads may overshoot it by the
// tiles they bring in together. A budget holds no references to its members:
// a carrier leaves it when released or destroyed.
//
// Thread-safety: one mutex, never held while calling into a carrier (lock order: a carrier's tile-table lock, then
// the budget's).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <unordered_map>
#include <vector>

#include "strideweave/fork.hpp"

namespace sw {

class TiledEvictable;

struct BudgetStats {
  int64_t max_bytes = 0;
  int64_t resident_tiles = 0, resident_bytes = 0;
  int64_t peak_tiles = 0, peak_bytes = 0;  // since construction or reset_peak()
  int64_t evictions = 0;                   // tiles the budget evicted to make room
  int64_t members = 0;                     // live carriers drawing from it
  // Write-behind (Note [Write-behind evictions]): the bound on bytes queued or being written at once (0: off),
  // the tiles and bytes queued or being written now (counted in resident_*), tiles evicted that way (also counted
  // in `evictions`), queued tiles taken back because they were used again first, and failed writes.
  int64_t write_behind_limit = 0;
  int64_t write_behind_tiles = 0, write_behind_bytes = 0;
  int64_t write_behind_evictions = 0, write_behind_cancelled = 0, write_behind_failures = 0;
  // Admissions and accesses that waited on evictions (evicting inline, or waiting for a queued or running write),
  // and the time they waited, in nanoseconds; of these, the admissions that waited for queued writes to end, and
  // that part of their time.
  int64_t eviction_waits = 0, eviction_wait_ns = 0;
  int64_t write_behind_waits = 0, write_behind_wait_ns = 0;
};

class ResidencyBudget {
 public:
  // ValueError unless max_bytes >= 1.
  // write_behind_bytes: the write-behind queue's bound in bytes; negative means max_bytes / 8, 0 turns it off.
  explicit ResidencyBudget(int64_t max_bytes, int64_t write_behind_bytes = -1);
  ResidencyBudget(const ResidencyBudget&) = delete;
  ResidencyBudget& operator=(const ResidencyBudget&) = delete;

  int64_t max_bytes() const noexcept { return max_bytes_; }
  // Blocks: the budget's lock, briefly.
  BudgetStats stats() const;
  // The peaks restart from what is resident now. Blocks: the budget's lock, briefly.
  void reset_peak();
  // The write-behind queue's bound (Note [Write-behind evictions]); ValueError when negative; 0 turns it off
  // (tiles already queued are still written). Blocks: the budget's lock, briefly.
  int64_t write_behind_bytes() const;
  void set_write_behind_bytes(int64_t bytes);

  // -------- engine hooks (cpp/src/tiled): called by member carriers
  void join(const TiledEvictable& c);
  void leave(const TiledEvictable& c) noexcept;              // forgets every tile of c
  void resident(const TiledEvictable& c, int64_t index, int64_t bytes);  // now resident: most recent
  void evicted(const TiledEvictable& c, int64_t index) noexcept;
  void touch(const TiledEvictable& c, std::span<const int64_t> tiles);
  // Evicts least recently used tiles of members (never `keep`, sorted, of `requester`, nor any tile of `spare`)
  // until `bytes` more fit, counting the bytes that queued write-behinds will free; then hands tiles beyond the
  // write-behind's room to the I/O executor (Note [Write-behind evictions]). RuntimeError when room cannot be made;
  // `purpose` names the request in messages. Call with no tile-table lock held.
  // Blocks: evicts (I/O) in this thread, or waits for a queued write-behind, only when `bytes` do not fit.
  void make_room(const TiledEvictable& requester, std::span<const int64_t> keep, int64_t bytes, const char* purpose,
                 const TiledEvictable* spare = nullptr);
  // Write-behind hooks, called under c's tile-table lock: whether tile `index` of c (resident here, not queued) may
  // be queued now (the queue has room), marking it queued if so; and the end of a queued tile's write-behind that
  // did not evict it (taken back when `failed` is false, a failed write otherwise).
  bool write_behind_admit(const TiledEvictable& c, int64_t index);
  void write_behind_ended(const TiledEvictable& c, int64_t index, bool failed) noexcept;
  // Counts one wait on evictions of `ns` nanoseconds, `queued_ns` of them waiting for queued writes (-1: none).
  void count_eviction_wait(int64_t ns, int64_t queued_ns = -1) noexcept;
  // ValueError (nothing changed) when `tiles` of c, holding `bytes`, can never fit.
  void check_working_set(const TiledEvictable& c, int64_t tiles, int64_t bytes, const char* purpose) const;

 private:
  struct Key {
    const TiledEvictable* carrier;
    int64_t index;
    bool operator==(const Key& o) const noexcept { return carrier == o.carrier && index == o.index; }
  };
  struct KeyHash {
    size_t operator()(const Key& k) const noexcept {
      return std::hash<const void*>()(k.carrier) ^ (std::hash<int64_t>()(k.index) * 0x9e3779b97f4a7c15ULL);
    }
  };
  struct Entry {
    int64_t bytes;
    std::list<Key>::iterator pos;
    bool behind = false;  // queued for write-behind or being written
  };
  void remove_locked(Key k) noexcept;
  // After an admission: hands least recently used dirty tiles to write-behind (Note [Write-behind evictions]).
  void write_ahead(const TiledEvictable& requester, std::span<const int64_t> keep, int64_t bytes,
                   const TiledEvictable* spare);
  // In a child after fork(): the writes queued in the parent do not run here (Note [Fork safety]).
  void restart_after_fork_locked() noexcept;

  const int64_t max_bytes_;
  // A striped lock, held across fork() (Note [Fork safety]): a pool thread admitting a tile may hold it then.
  std::mutex& m_ = detail::budget_lock(this);
  std::list<Key> lru_;  // least recent first
  std::unordered_map<Key, Entry, KeyHash> entries_;
  std::unordered_map<const TiledEvictable*, int64_t> members_;  // carrier -> its resident tiles here
  int64_t resident_bytes_ = 0, peak_bytes_ = 0, peak_tiles_ = 0, evictions_ = 0;
  int64_t write_behind_limit_ = 0, behind_tiles_ = 0, behind_bytes_ = 0;
  int64_t behind_evictions_ = 0, behind_cancelled_ = 0, behind_failures_ = 0;
  int64_t eviction_waits_ = 0, eviction_wait_ns_ = 0, behind_waits_ = 0, behind_wait_ns_ = 0;
  std::condition_variable behind_cv_;  // notified whenever a write-behind ends (behind_bytes_ drops)
  uint64_t generation_ = fork_generation();
};

}  // namespace sw
