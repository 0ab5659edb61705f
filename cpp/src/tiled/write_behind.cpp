// Write-behind evictions of a TiledEvictable under a residency budget: the queue (queue_write_behind), the job on
// the I/O executor (run_write_behind), taking back or waiting for a tile used again (settle_write_behind) and the
// report of a failed write (raise_write_behind_failure).
#include <chrono>

#include "strideweave/io.hpp"
#include "internal.hpp"

namespace sw {

// Note [Write-behind evictions]: under a budget, a dirty tile evicted to make room used to be written in the thread
// that needed the room (a training step's backward wrote most of its gradient tiles to their scratch file, 217
// evictions a step in bench/finetune.py, each a write the computing thread waited for). Now the budget writes ahead:
// after each admission (make_room), when less than write_behind_bytes() of the budget would be free once the queued
// writes end, the least recently used tiles beyond that are handed to queue_write_behind; those that are dirty (a
// clean tile is dropped at no cost when room is needed, so it is left) are marked queued (Tile::behind, and
// Entry::behind in the budget) and one job per carrier goes to the I/O executor, which evicts them there as an
// eviction request per tile (pending while written, one job per carrier at a time: Note [One writer per file],
// all-or-nothing commit). The queue is bounded: at most
// write_behind_bytes() are queued or being written at once (a tile beyond that stays, to be evicted when needed).
//  * The bound. A tile queued or being written stays resident under the budget until its eviction commits, so
//    resident bytes never exceed max_bytes. An admission that does not fit evicts inline, as before, only the bytes
//    that the queued writes will not free; when those writes alone would make room, it waits for them (the oldest
//    first: it wakes at each end and looks again). Both count as a wait on evictions (stats(): eviction_waits,
//    eviction_wait_ns); an admission that fits never waits for a write it did not ask for.
//  * A tile used again. A queued tile is taken back rather than written (cancelled: it stays resident and dirty, as
//    if never queued) by whatever uses it next: work (begin_work, pin_for_reading), a promotion or eviction, a flush,
//    a gradient sum or step that holds it, slot access (settle_write_behind, under the tile-table lock, before the
//    request looks at the tile; a gradient sum settles only the tiles it adds, so a write of a tile it does not
//    touch never holds up a backward); the job also skips a tile that is pinned, held or under another request
//    when it starts, and writes one tile at a time, so that only the tile being written is out of reach. Taking back is chosen over waiting because the tile is about to be used: writing it would be a write
//    and a read for nothing. A tile whose write has started is pending (an eviction request); the same callers wait
//    for that write to commit (one tile's write, counted as a wait on evictions) instead of refusing with "wait",
//    so no caller sees an eviction it did not ask for; then it finds the tile in the secondary tier, clean.
//  * Failure. A failed write commits nothing (the tiles stay resident and dirty, counted by the budget, never lost;
//    the budget counts write_behind_failures). There is no handle to report it to, so the carrier keeps it and the
//    next request on that carrier (a promotion, an eviction, a flush, or work: projection, scatter, an operation,
//    backward) raises it once, with its cause's error type, before changing anything; a retry proceeds. That request
//    is the next one to rely on the carrier's tiers. (A failed inline eviction still fails the admission that ran it.)
//  * Durability. flush() takes back the queued tiles (it writes every dirty tile itself) and waits for the running
//    writes before it syncs, so it covers them. release() waits for the queued jobs, which still write their tiles
//    (a released carrier's tiles are dropped only after): a dirty tile the budget chose to evict reaches its tier
//    as when it was written inline, and is not counted as discarded. The queued jobs hold the carrier (and are
//    counted in request_refs_: Note [Requests' own references]) until they end.
//  * Fork: a child forgets the queued and running write-behinds (the parent writes them); see restart_tile_tables.

void TiledEvictable::queue_write_behind(const std::vector<int64_t>& tiles) {
  auto count = request_refs_;
  count->fetch_add(1, std::memory_order_seq_cst);  // counted before it is taken (Note [Requests' own references])
  auto owner = std::static_pointer_cast<TiledEvictable>(weak_from_this().lock());
  bool submit = false;
  if (owner && budget_) {
    std::lock_guard lock(mutex_);
    if (!is_released() && secondary_->created_mutable()) {
      bool queued = false;
      for (int64_t i : tiles) {
        Tile& t = tiles_[i];
        if (t.loc != TileLocation::Primary || t.pending || t.pins > 0 || t.behind) continue;
        if (!t.dirty && t.secondary_valid) continue;  // clean: dropped at no cost when room is needed
        if (!budget_->write_behind_admit(*this, i)) continue;  // the queue is full (or the tile not counted)
        t.behind = kBehindQueued;
        behind_tiles_++;
        behind_queue_.push_back(i);
        queued = true;
      }
      // One job per carrier at a time, writing its queue in order (Note [One writer per file]).
      if (queued && behind_jobs_ == 0) {
        behind_jobs_ = 1;
        submit = true;
      }
    }
  }
  if (!submit) {
    owner.reset();
    count->fetch_sub(1, std::memory_order_seq_cst);
    return;
  }
  Executor::io().submit([owner = std::move(owner), count = std::move(count)]() mutable {
    owner->run_write_behind();
    owner.reset();  // dropped, then uncounted
    count->fetch_sub(1, std::memory_order_seq_cst);
  });
}

void TiledEvictable::run_write_behind() noexcept {
  for (;;) {
    auto r = std::make_shared<Request>();
    r->promote = false;
    r->write_behind = true;
    {
      std::lock_guard lock(mutex_);
      int64_t index = -1;
      while (index < 0 && !behind_queue_.empty()) {
        const int64_t i = behind_queue_.front();
        behind_queue_.pop_front();
        Tile& t = tiles_[i];
        if (t.behind != kBehindQueued) continue;  // taken back
        if (t.loc == TileLocation::Primary && !t.pending && t.pins == 0) {
          index = i;
          break;
        }
        t.behind = 0;  // in use since it was queued: it stays
        behind_tiles_--;
        if (budget_) budget_->write_behind_ended(*this, i, /*failed=*/false);
      }
      if (index < 0) {
        behind_jobs_ = 0;
        idle_cv_.notify_all();
        return;
      }
      // One tile at a time: the others stay queued, and can still be taken back, while it is written.
      std::exception_ptr refused;
      try {
        prepare_eviction({index}, *r, /*deferred=*/true);
      } catch (...) {  // a secondary that cannot grow: nothing was marked
        refused = std::current_exception();
        r->tiles.clear();
      }
      if (refused) {
        tiles_[index].behind = 0;
        behind_tiles_--;
        if (budget_) budget_->write_behind_ended(*this, index, /*failed=*/true);
        if (!write_behind_failure_)
          write_behind_failure_ = tiled_error_like(refused, "a write-behind eviction of " + tile_list({index}, "") +
                                                          " of TiledEvictable to its secondary tier " +
                                                          secondary_description() + " failed, so it stays resident "
                                                          "and dirty (nothing is lost): " + tiled_error_message(refused));
        continue;
      }
      tiles_[index].behind = kBehindWriting;
      behind_requests_++;
    }
    try {
      start_request(r, /*inline_=*/true);  // commit() ends the tile's write-behind and keeps a failure
    } catch (...) {  // start_request reports failures through the request; nothing is expected here
    }
  }
}

void TiledEvictable::settle_write_behind(std::unique_lock<std::mutex>& lock, std::span<const int64_t> tiles,
                                         bool all) {
  if (behind_tiles_ == 0) return;
  const uint64_t generation = fork_generation();
  auto writing = [&] {
    if (generation != fork_generation()) return false;
    if (all) {
      for (const Tile& t : tiles_)
        if (t.behind == kBehindWriting) return true;
      return false;
    }
    for (int64_t i : tiles)
      if (tiles_[i].behind == kBehindWriting) return true;
    return false;
  };
  auto take_back = [&](Tile& t, int64_t i) {
    if (t.behind != kBehindQueued) return;
    t.behind = 0;
    behind_tiles_--;
    if (budget_) budget_->write_behind_ended(*this, i, /*failed=*/false);
  };
  if (all)
    for (int64_t i = 0; i < tile_count(); ++i) take_back(tiles_[i], i);
  else
    for (int64_t i : tiles) take_back(tiles_[i], i);
  if (!writing()) return;
  const auto since = std::chrono::steady_clock::now();
  idle_cv_.wait(lock, [&] { return !writing(); });
  if (budget_) {  // a wait for a write-behind, counted as such
    const int64_t ns =
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - since).count();
    budget_->count_eviction_wait(ns, ns);
  }
}

void TiledEvictable::settle_write_behind(std::span<const int64_t> tiles, bool all) {
  std::unique_lock lock(mutex_);
  settle_write_behind(lock, tiles, all);
}

void TiledEvictable::raise_write_behind_failure() {
  if (!write_behind_failure_) return;
  std::exception_ptr failure = std::move(write_behind_failure_);
  write_behind_failure_ = nullptr;
  std::rethrow_exception(tiled_error_like(failure, tiled_error_message(failure) + "; this request changed nothing (retry it)"));
}

}  // namespace sw
