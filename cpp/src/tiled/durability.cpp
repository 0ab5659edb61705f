// Durability and the end of a TiledEvictable: flush (Note [Flushing tiles]), release
// (Note [Release races with requests]) and the dirty tiles a release, a collection or interpreter exit discards
// (Note [Dirty tiles are never discarded silently]).
#include <algorithm>
#include <sstream>

#include "strideweave/errors.hpp"
#include "internal.hpp"

namespace sw {

namespace {
std::atomic<TiledEvictable::DiscardReporter> g_discard_reporter{nullptr};
}  // namespace

NamedFileCarriers& named_file_carriers() {
  static auto* r = new NamedFileCarriers();
  return *r;
}

TiledEvictable::DiscardReporter discard_reporter() noexcept { return g_discard_reporter.load(); }

// ---------------------------------------------------------------- flush

// Note [Flushing tiles]: flush makes the secondary tier hold every value, durably, without giving up memory.
// Every dirty tile (or one without a valid secondary copy) is written with an eviction's transfers (one writer per
// file: Note [One writer per file]); once every write has returned, the secondary is synced (Carrier::flush:
// fsync of the file or device), and only then do the tiles become clean, all together; they stay resident. A
// failed write or fsync leaves every tile dirty: a later flush or eviction writes them all again. That rewrite is
// what makes a retry honest: after a failed fsync Linux may drop the unwritten pages and report success to the
// next fsync, so syncing again alone would lose them silently. A flush with nothing dirty still syncs, so tiles
// evicted earlier (written, never synced) become durable too. A flush covers every tile, so it refuses, like other
// requests, while any tile has an incomplete residency request ("wait"): that request's writes would escape the
// sync. Pinned tiles are flushed: running work only reads them and the flush keeps their buffers. While the flush
// runs its tiles are pending, so writes to them refuse with "wait" and their values cannot change under it.
CompletionPtr<std::monostate> TiledEvictable::flush_async() { return flush_tiles(false); }

void TiledEvictable::flush() { flush_tiles(true)->value(); }

CompletionPtr<std::monostate> TiledEvictable::flush_tiles(bool inline_, Turn* turn) {
  check_live("flush");
  auto r = std::make_shared<Request>();
  r->promote = false;
  r->flush = true;
  {
    std::unique_lock lock(mutex_);
    check_live("flush");  // again under the lock: see Note [Release races with requests]
    if (turn) wait_turn(lock, *turn, /*pins_block=*/false, "flush");
    raise_write_behind_failure();
    settle_write_behind(lock, {}, /*all=*/true);  // takes back the queued writes, waits for the running ones
    for (int64_t i = 0; i < tile_count(); ++i)
      if (tiles_[i].pending) pending_conflict(i, "flushing");
    for (int64_t i = 0; i < tile_count(); ++i) {
      const Tile& t = tiles_[i];
      if (t.loc == TileLocation::Primary && (t.dirty || !t.secondary_valid)) r->tiles.push_back(i);
    }
    check_secondary_writable(r->tiles, "flush");
    if (r->tiles.empty() && !secondary_->created_mutable()) {  // never written: nothing to make durable
      r->done->set_value({});
      return r->done;
    }
    if (!r->tiles.empty()) ensure_secondary_storage();
    r->id = next_request_++;
    for (int64_t i : r->tiles) tiles_[i].pending = r->id;
    active_requests_++;
  }
  start_request(r, inline_);
  return r->done;
}

// ---------------------------------------------------------------- release

void TiledEvictable::check_releasable() const {
  std::lock_guard lock(mutex_);
  // A write-behind (Note [Write-behind evictions]) is not the caller's work: do_release waits for it.
  if (active_requests_ - behind_requests_ > 0 || active_work_ > 0)
    raise<RuntimeError>("TiledEvictable has incomplete work (", active_requests_ - behind_requests_, " residency request(s), ",
                        active_work_, " tiled operation(s)); wait for it before release()");
}

// Note [Release races with requests]: Carrier::release() runs check_releasable() and only then
// marks the carrier released, so a request or work that another thread begins in between passes
// both checks and would commit into (or read from) released storage. Entry points therefore check
// liveness again under the tile-table mutex, and do_release() first waits for what began in that
// window. Neither needs the releasing thread (nor the GIL) to finish: residency requests leave
// active_requests_ before publishing their completion, and data paths end their work from C++.
void TiledEvictable::do_release() {
  std::vector<CarrierPtr> buffers;
  {
    std::unique_lock lock(mutex_);
    // Queued write-behinds still write their tiles first (Note [Write-behind evictions]).
    idle_cv_.wait(lock, [&] { return active_requests_ == 0 && active_work_ == 0 && behind_jobs_ == 0; });
    if (!named_file_.empty()) release_discards_.store(unsaved_tiles_locked());
    for (auto& t : tiles_) {
      if (t.buffer) buffers.push_back(std::move(t.buffer));
      t.loc = TileLocation::Invalid;
    }
    stats_.primary_tiles = 0;
    stats_.primary_bytes = 0;
    if (budget_) budget_->leave(*this);
  }
  for (auto& b : buffers) b->release();
  primary_claim_.end();
  secondary_claim_.end();
  primary_->release();
  secondary_->release();
  idle_cv_.notify_all();  // callers waiting in turn see the release (Note [Taking turns])
}

// ---------------------------------------------------------------- dirty tiles at release, collection and exit

// Note [Dirty tiles are never discarded silently]: release() discards the tiles by definition, but a user whose
// secondary tier is a file they named expects that file to hold the values, as a file object's writes reach its
// file when it is closed. A dirty tile's latest value is in memory only; releasing, collecting or leaving the
// carrier alive at interpreter exit loses it. So each of the three emits a ResourceWarning that names the file
// and how many dirty tiles are discarded (as Python warns about an unclosed file); flush() first keeps them. An
// anonymous secondary (a temporary file the library creates and removes) warns never: no one could have read
// the values from it afterwards. The count and the decision are made here, under the tile table's lock, at the
// moment of discarding; the binding emits the warning through Python's warnings machinery: after release()
// returns (so a filter that turns it into an error raises from release()), from the destructor through the
// installed reporter (a collected object: the warning is written as unraisable if a filter makes it an error),
// and at interpreter exit from the binding's exit handler, after the pools drained (a dirty tile evicted just
// before exit reaches its file and is not counted). A carrier reported at exit is not reported again when it is
// destroyed during finalization.
int64_t TiledEvictable::unsaved_tiles_locked() const {
  int64_t n = 0;
  for (const Tile& t : tiles_) n += t.loc == TileLocation::Primary && (t.dirty || !t.secondary_valid);
  return n;
}

std::string TiledEvictable::discard_warning(int64_t tiles, const char* when) const {
  std::ostringstream out;
  out << "TiledEvictable over the file '" << named_file_ << "' discards " << tiles << " dirty "
      << (tiles == 1 ? "tile " : "tiles ") << when << ": " << (tiles == 1 ? "its latest value was" : "their latest values were")
      << " never written to the file; call flush() before release() to keep them";
  return out.str();
}

std::string TiledEvictable::take_release_discard_warning() {
  const int64_t tiles = release_discards_.exchange(0);
  return tiles > 0 ? discard_warning(tiles, "on release()") : std::string();
}

std::vector<std::string> TiledEvictable::exit_discard_warnings() {
  std::vector<std::string> out;
  auto& named = named_file_carriers();
  std::lock_guard registry(named.m);  // before any carrier's mutex_, as everywhere
  for (TiledEvictable* c : named.live) {
    if (c->is_released() || c->exit_reported_.load()) continue;
    int64_t tiles;
    {
      std::lock_guard lock(c->mutex_);
      tiles = c->unsaved_tiles_locked();
    }
    if (tiles == 0) continue;
    c->exit_reported_.store(true);
    out.push_back(c->discard_warning(tiles, "at interpreter exit"));
  }
  return out;
}

void TiledEvictable::set_discard_reporter(DiscardReporter reporter) noexcept { g_discard_reporter.store(reporter); }

}  // namespace sw
