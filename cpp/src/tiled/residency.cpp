// Residency requests of a TiledEvictable: promote, evict (Note [A read-only secondary tier]), the transfers on
// the I/O threads (Note [One writer per file]) and the all-or-nothing commit (Note [Letting go before completing]).
// A flush is a request too; it is built in durability.cpp.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <functional>
#include <sstream>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "internal.hpp"

namespace sw {

// ---------------------------------------------------------------- residency requests

namespace {
// The C++ residency requests take tile indices (the bindings and bind_selection check theirs first): one outside
// the grid is refused before anything is read or changed.
void check_tile_indices(const std::vector<int64_t>& tiles, const TileGeometry& g, const char* what) {
  for (int64_t i : tiles)
    if (i < 0 || i >= g.tile_count())
      raise<IndexError>(what, ": tile index ", i, " is outside the grid of ", g.tile_count(), " tiles");
}
}  // namespace

void TiledEvictable::ensure_secondary_storage() {
  if (secondary_->size() == 0) secondary_->grow(geometry_.size(), false);
}

CompletionPtr<std::monostate> TiledEvictable::promote_async(const std::vector<int64_t>& tiles) {
  return promote_tiles(tiles, false);
}

CompletionPtr<std::monostate> TiledEvictable::promote_tiles(const std::vector<int64_t>& tiles, bool inline_,
                                                            Turn* turn) {
  check_live("promote tiles");
  check_tile_indices(tiles, geometry_, "promote");
  {
    std::lock_guard lock(mutex_);
    raise_write_behind_failure();  // before any room is made (Note [Write-behind evictions])
  }
  admit(tiles, "promotion");  // under a budget: room first (Note [One residency budget])
  auto r = std::make_shared<Request>();
  r->promote = true;
  {
    std::unique_lock lock(mutex_);
    check_live("promote tiles");  // again under the lock: see Note [Release races with requests]
    if (turn) wait_turn(lock, *turn, /*pins_block=*/false, "promote");
    std::vector<int64_t> uniq = tiles;
    std::sort(uniq.begin(), uniq.end());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
    raise_write_behind_failure();
    settle_write_behind(lock, uniq);  // Note [Write-behind evictions]
    for (int64_t i : uniq) {
      const Tile& t = tiles_[i];
      if (t.pending) pending_conflict(i, "promoting it");
      if (t.loc == TileLocation::Invalid)
        raise<RuntimeError>("tile ", coord_str(tile_coord(i)), " of TiledEvictable is invalid: it has no value to promote");
    }
    for (int64_t i : uniq)
      if (tiles_[i].loc != TileLocation::Primary) r->tiles.push_back(i);
    if (r->tiles.empty()) {
      r->done->set_value({});
      return r->done;
    }
    r->id = next_request_++;
    for (int64_t i : r->tiles) tiles_[i].pending = r->id;
    active_requests_++;
    // Counted under a budget from now on (its buffer is being filled), uncounted if the promotion fails.
    if (budget_)
      for (int64_t i : r->tiles) budget_->resident(*this, i, tile_bytes());
  }
  start_request(r, inline_);
  return r->done;
}

CompletionPtr<std::monostate> TiledEvictable::evict_async(const std::vector<int64_t>& tiles) {
  return evict_tiles(tiles, false);
}

CompletionPtr<std::monostate> TiledEvictable::evict_tiles(const std::vector<int64_t>& tiles, bool inline_, Turn* turn) {
  check_live("evict tiles");
  check_tile_indices(tiles, geometry_, "evict");
  auto r = std::make_shared<Request>();
  r->promote = false;
  {
    std::unique_lock lock(mutex_);
    check_live("evict tiles");  // again under the lock: see Note [Release races with requests]
    if (turn) wait_turn(lock, *turn, /*pins_block=*/true, "evict");
    raise_write_behind_failure();
    settle_write_behind(lock, tiles);  // Note [Write-behind evictions]
    prepare_eviction(tiles, *r, /*deferred=*/false);
    if (r->tiles.empty()) {
      r->done->set_value({});
      return r->done;
    }
  }
  start_request(r, inline_);
  return r->done;
}

void TiledEvictable::prepare_eviction(std::vector<int64_t> tiles, Request& r, bool deferred) {
  std::sort(tiles.begin(), tiles.end());
  tiles.erase(std::unique(tiles.begin(), tiles.end()), tiles.end());
  for (int64_t i : tiles) {
    const Tile& t = tiles_[i];
    if (deferred) continue;
    if (t.pending) pending_conflict(i, "evicting it");
    if (t.pins > 0)
      raise<RuntimeError>("tile ", coord_str(tile_coord(i)),
                          " of TiledEvictable is pinned by running tiled work; wait for that work before evicting it");
  }
  // A deferred eviction leaves out a tile that other work pins or another request transitions: not the plan's to
  // evict now (Note [A failed deferred eviction reaches the work]).
  for (int64_t i : tiles) {
    const Tile& t = tiles_[i];
    if (t.loc == TileLocation::Primary && !(deferred && (t.pending || t.pins > 0))) r.tiles.push_back(i);
  }
  if (r.tiles.empty()) return;
  if (behind_tiles_ > 0 && !r.write_behind) {  // this eviction takes them back (Note [Write-behind evictions])
    for (int64_t i : r.tiles)
      if (tiles_[i].behind == kBehindQueued) {
        tiles_[i].behind = 0;
        behind_tiles_--;
        if (budget_) budget_->write_behind_ended(*this, i, /*failed=*/false);
      }
  }
  check_secondary_writable(r.tiles, "evict");
  ensure_secondary_storage();
  r.id = next_request_++;
  for (int64_t i : r.tiles) tiles_[i].pending = r.id;
  active_requests_++;
}

// ---------------------------------------------------------------- waiting in turn

// Note [Taking turns]: the residency requests refuse a tile that other work is transitioning, holding or (for an
// eviction) reading, with RuntimeError asking the caller to wait (the asynchronous forms must not block on another
// caller's work: tiled-carrier-composition, "Residency transitions"). Two loops that both retry on that refusal
// can starve each other: an optimizer stepping tiles while another thread evicts, flushes and promotes them let no
// step through in 60 tries, each side always finding the other's request or hold in the way. So the blocking
// forms (promote, evict, flush from Python, and an optimizer's step, which holds one tile at a time) wait instead
// of refusing, and wait in line: a caller that must wait takes a turn (TurnEntry, appended to turns_) for its
// tiles and proceeds once (1) no turn taken before it wants any of those tiles and (2) none of them is pending
// (under a request, or held by a sum or a step) or, for an eviction or a hold, pinned by running work. It marks
// its tiles (pending, or held) in the same critical section that saw them free, and only then leaves the line,
// so the next in line sees the marks and waits for them to end. Every end of a request, work, hold or turn
// notifies idle_cv_. First come, first served among the waiters: whoever waits longest for a tile gets it next,
// so neither loop can starve the other. A turn can span several requests (a step promotes a tile and then holds
// it: nobody who waits can take it in between). The asynchronous forms and work requests never wait: they still
// refuse a tile that is marked, and may overtake a waiter whose tiles are not yet free; the waiter then waits for
// them in turn. A wait is bounded by turn_wait_limit() (60 s by default): after that it raises RuntimeError
// asking to wait, and nothing has changed, so a cycle (two steps of one parameter holding each other's tiles)
// ends in an error rather than a hang.

namespace {
std::atomic<double> g_turn_wait_limit{60.0};

bool sorted_overlap(const std::vector<int64_t>& a, const std::vector<int64_t>& b) {
  auto i = a.begin(), j = b.begin();
  while (i != a.end() && j != b.end()) {
    if (*i == *j) return true;
    if (*i < *j) ++i;
    else ++j;
  }
  return false;
}
}  // namespace

void TiledEvictable::set_turn_wait_limit(double seconds) {
  if (!(seconds > 0) || !std::isfinite(seconds))
    raise<ValueError>("the wait limit must be a positive, finite number of seconds, got ", seconds);
  g_turn_wait_limit.store(seconds);
}

double TiledEvictable::turn_wait_limit() noexcept { return g_turn_wait_limit.load(); }

class TiledEvictable::Turn {
 public:
  Turn(TiledEvictable& owner, std::list<TurnEntry>::iterator entry)
      : owner_(owner), entry_(entry),
        deadline_(std::chrono::steady_clock::now() +
                  std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                      std::chrono::duration<double>(turn_wait_limit()))) {}
  Turn(const Turn&) = delete;
  Turn& operator=(const Turn&) = delete;
  ~Turn() {
    {
      std::lock_guard lock(owner_.mutex_);
      // A child forked while this turn waited forgot the line (Note [Fork safety]); its entry went with it.
      if (generation_ == fork_generation()) owner_.turns_.erase(entry_);
    }
    owner_.idle_cv_.notify_all();
  }
  const std::vector<int64_t>& tiles() const { return entry_->tiles; }

 private:
  friend class TiledEvictable;
  TiledEvictable& owner_;
  std::list<TurnEntry>::iterator entry_;
  std::chrono::steady_clock::time_point deadline_;
  uint64_t generation_ = fork_generation();
};

std::unique_ptr<TiledEvictable::Turn> TiledEvictable::take_turn(std::vector<int64_t> tiles) {
  std::sort(tiles.begin(), tiles.end());
  tiles.erase(std::unique(tiles.begin(), tiles.end()), tiles.end());
  std::lock_guard lock(mutex_);
  turns_.push_back(TurnEntry{std::move(tiles)});
  return std::make_unique<Turn>(*this, std::prev(turns_.end()));
}

void TiledEvictable::wait_turn(std::unique_lock<std::mutex>& lock, const Turn& turn, bool pins_block,
                               const char* what) {
  const std::vector<int64_t>& mine = turn.tiles();
  int64_t blocker = -1;  // a tile in the way, for the message
  auto ready = [&] {
    if (is_released()) return true;
    for (auto e = turns_.begin(); e != turn.entry_; ++e)
      if (sorted_overlap(e->tiles, mine)) {
        blocker = -1;
        return false;
      }
    for (int64_t i : mine) {
      const Tile& t = tiles_[i];
      if (t.pending || (pins_block && t.pins > 0)) {
        blocker = i;
        return false;
      }
    }
    return true;
  };
  if (!idle_cv_.wait_until(lock, turn.deadline_, ready)) {
    std::ostringstream msg;
    msg << what << ": waited " << turn_wait_limit() << " s for ";
    if (blocker >= 0)
      msg << "tile " << coord_str(tile_coord(blocker)) << " of TiledEvictable, which other work still "
          << (tiles_[blocker].pending & kSumHold ? "holds (a gradient sum or an optimizer step)"
              : tiles_[blocker].pending          ? "moves (an incomplete residency request)"
                                                 : "pins (running tiled work)");
    else
      msg << "its turn: another caller waits for the same tiles";
    msg << "; nothing changed. Wait for that work and try again";
    raise<RuntimeError>(msg.str());
  }
  check_live(what);
}

CompletionPtr<std::monostate> TiledEvictable::promote_in_turn(const std::vector<int64_t>& tiles) {
  check_live("promote tiles");
  check_tile_indices(tiles, geometry_, "promote");
  auto turn = take_turn(tiles);
  return promote_tiles(tiles, false, turn.get());
}

CompletionPtr<std::monostate> TiledEvictable::evict_in_turn(const std::vector<int64_t>& tiles) {
  check_live("evict tiles");
  check_tile_indices(tiles, geometry_, "evict");
  auto turn = take_turn(tiles);
  return evict_tiles(tiles, false, turn.get());
}

CompletionPtr<std::monostate> TiledEvictable::flush_in_turn() {
  check_live("flush");
  std::vector<int64_t> all(static_cast<size_t>(tile_count()));
  for (int64_t i = 0; i < tile_count(); ++i) all[static_cast<size_t>(i)] = i;
  auto turn = take_turn(std::move(all));
  return flush_tiles(false, turn.get());
}

std::unique_ptr<TiledEvictable::TileWrite> TiledEvictable::hold_in_turn(int64_t index, const char* what) {
  auto self = std::static_pointer_cast<TiledEvictable>(weak_from_this().lock());
  SW_ASSERT(self, "hold_in_turn: the carrier must be held by a std::shared_ptr");
  check_live(what);
  auto turn = take_turn({index});
  for (;;) {
    {
      std::unique_lock lock(mutex_);
      wait_turn(lock, *turn, /*pins_block=*/true, what);
      const Tile& t = tiles_[index];
      if (t.loc == TileLocation::Primary) {
        lock.unlock();
        if (auto h = hold_tile_for_update(index)) return h;  // nobody in line can take it in between
        // Not native memory: the caller reports it. (A request or work that does not wait may also have taken
        // it in between: then wait again.)
        lock.lock();
        if (!tiles_[index].pending && tiles_[index].pins == 0) return nullptr;
        continue;
      }
    }
    promote_tiles({index}, false, turn.get())->value();  // in this turn: nobody who waits evicts it meanwhile
  }
}

// Note [A read-only secondary tier]: a secondary tier created with mutable=False is read in place and never
// written (FileBacked(path, mutable=False) is a checkpoint opened O_RDONLY: the example's expert weights). Writing
// a dirty tile there failed deep in the transfer ("pwrite ... EBADF") for a file, and for a tier whose read-only
// mode is only a permission it would have written anyway. So an eviction or flush that would write a tile
// (dirty, or with no valid secondary copy) refuses before anything changes, naming the tiles and the tier; a clean
// tile whose secondary copy is valid is evicted without writing, as always.
void TiledEvictable::check_secondary_writable(const std::vector<int64_t>& tiles, const char* what) const {
  if (secondary_->created_mutable()) return;
  std::vector<int64_t> dirty;
  for (int64_t i : tiles)
    if (tiles_[i].dirty || !tiles_[i].secondary_valid) dirty.push_back(i);
  if (dirty.empty()) return;
  raise<RuntimeError>("cannot ", what, " ", tile_list(dirty, "dirty "), " of TiledEvictable: its secondary tier ",
                      secondary_description(), " is read-only (created with mutable=False), so ",
                      dirty.size() == 1 ? "its value" : "their values", " cannot be written there; ",
                      dirty.size() == 1 ? "it stays" : "they stay", " resident and dirty");
}

std::string TiledEvictable::secondary_description() const {
  if (const auto* file = dynamic_cast<const FileBackedCarrier*>(secondary_.get()))
    return "FileBacked '" + file->filename() + "'";
  return secondary_->kind_name();
}

std::string TiledEvictable::tile_list(const std::vector<int64_t>& tiles, const char* adjective) const {
  constexpr size_t kShown = 8;
  std::ostringstream out;
  out << adjective << (tiles.size() == 1 ? "tile " : "tiles ");
  for (size_t k = 0; k < tiles.size() && k < kShown; ++k) out << (k ? ", " : "") << coord_str(tile_coord(tiles[k]));
  if (tiles.size() > kShown) out << " and " << tiles.size() - kShown << " more";
  return out.str();
}

void TiledEvictable::start_request(const std::shared_ptr<Request>& r, bool inline_) {
  const size_t n = r->tiles.size();
  r->staged.resize(n);
  r->wrote.assign(n, 0);
  r->remaining.store(n);
  // Each tile's state when the request starts (its pending mark keeps it so until the commit).
  struct Start {
    TileLocation loc;
    bool needs_write;
    CarrierPtr buffer;
  };
  std::vector<Start> start(n);
  bool writes = false;
  {
    std::lock_guard lock(mutex_);
    for (size_t k = 0; k < n; ++k) {
      const Tile& t = tiles_[r->tiles[k]];
      start[k] = {t.loc, t.dirty || !t.secondary_valid, t.buffer};
      writes = writes || (!r->promote && start[k].needs_write);
    }
  }
  if (writes) {
    // Once per eviction request, before any tile is written: a named secondary file that was deleted, replaced
    // or truncated fails the whole request, which then changes nothing (Note [Files changed under a carrier]).
    try {
      secondary_->check_storage_intact(r->flush ? "flush tiles to it" : "evict tiles to it");
    } catch (...) {
      r->error = std::current_exception();
      r->remaining.store(0);
      commit(r);
      return;
    }
  }
  // Queued work holds a reference (through the request); a carrier no shared_ptr owns yet runs its transfers
  // inline.
  // Counted before it is taken, and uncounted after it is dropped (Note [Requests' own references]).
  if (!inline_) {
    r->owner_count = request_refs_;
    r->owner_count->fetch_add(1, std::memory_order_seq_cst);
    r->owner = std::static_pointer_cast<TiledEvictable>(weak_from_this().lock());
    if (!r->owner) {
      r->owner_count->fetch_sub(1, std::memory_order_seq_cst);
      r->owner_count.reset();
      inline_ = true;
    }
  }
  if (n == 0) {  // a flush with nothing to write: only the sync (Note [Flushing tiles])
    if (inline_) complete(r);
    else Executor::io().submit([this, r] { complete(r); });
    return;
  }
  // Note [One writer per file]: buffered writes to one file serialise on its inode lock, and writers waiting
  // for it spin; so an eviction into a FileBacked tier writes its tiles one after another in one job (the other
  // I/O threads stay free for promotions). Reads, and writes to other tiers, run one job per tile.
  const bool one_job = !inline_ && !r->promote && n > 1 && &secondary_->kind() == &file_backed_kind();
  std::vector<std::function<void()>> chain;
  for (size_t k = 0; k < n; ++k) {
    const int64_t index = r->tiles[k];
    const TileLocation loc = start[k].loc;
    const bool needs_write = start[k].needs_write;
    CarrierPtr buffer = std::move(start[k].buffer);
    auto job = [this, r, k, index, loc, needs_write, buffer]() mutable {
      TiledEvictable* me = this;
      CarrierPtr staged;
      std::exception_ptr error;
      try {
        if (r->promote) {
          if (loc == TileLocation::Secondary && &me->primary_->kind() == &cpu_kind()) {
            // A tile that is one run of its tier may be mapped rather than read (Note [Promotion by mapping]).
            const FootprintRuns runs = me->geometry_.footprint_runs(index);
            auto q = runs.begin();
            if (q != runs.end()) {
              const Run run = *q;
              if (run.ordinal == 0 && run.length == me->tile_size() && ++q == runs.end())
                staged = me->secondary_->map_slots(run.offset, run.length);
            }
          }
          if (!staged) {
            staged = me->primary_->allocate_like(me->tile_size(), true, me->dtype(), loc == TileLocation::Secondary);
            if (loc == TileLocation::Secondary)
              for (const Run& run : me->geometry_.footprint_runs(index))
                copy_slots(*me->secondary_, run.offset, *staged, run.ordinal, run.length);
          }
        } else if (needs_write) {
          me->write_tile(*buffer, index);
          r->wrote[k] = 1;
        }
      } catch (...) {
        error = std::current_exception();
      }
      buffer.reset();  // an evicted tile's memory is not held past the transfer
      me->finish_tile(r, k, std::move(staged), std::move(error));
    };
    // A cold read that bypasses the page cache waits on the device, not the CPU (Note [Background I/O threads]).
    bool device_read = r->promote && loc == TileLocation::Secondary && !inline_;
    const FootprintRuns runs = geometry_.footprint_runs(index);
    for (auto q = runs.begin(); device_read && q != runs.end(); ++q)
      device_read = secondary_->read_waits_on_device((*q).offset, (*q).length);
    // r->owner keeps the carrier alive while queued work runs; inline work runs under the caller's reference.
    if (inline_) job();
    else if (one_job) chain.emplace_back(std::move(job));
    else (device_read ? Executor::device_reads() : Executor::io()).submit(std::move(job));
  }
  if (!chain.empty())
    Executor::io().submit([chain = std::move(chain)]() mutable {
      for (auto& job : chain) {
        job();
        job = nullptr;  // each tile's captures go as soon as it is written
      }
    });
}

// A crash-safe secondary tier takes a tile's runs as one unit, so that a crash never leaves it torn (Note [A
// crash-safe tier] in carriers/journal.cpp); any other is written run by run.
void TiledEvictable::write_tile(const Carrier& buffer, int64_t index) {
  auto* unit = dynamic_cast<AtomicSlotWrites*>(secondary_.get());
  if (!unit || !unit->crash_safe() || buffer.dtype() != secondary_->dtype()) {
    for (const Run& run : geometry_.footprint_runs(index)) copy_slots(buffer, run.ordinal, *secondary_, run.offset, run.length);
    return;
  }
  const size_t w = slot_bytes(dtype());
  const std::byte* data = buffer.native_data();
  AlignedBuffer bounce(data ? 0 : static_cast<size_t>(tile_size()) * w, false);
  if (!data) {
    buffer.read_slots(0, tile_size(), bounce.data());
    data = bounce.data();
  }
  std::vector<SlotPiece> pieces;
  for (const Run& run : geometry_.footprint_runs(index))
    pieces.push_back({run.offset, run.length, data + static_cast<size_t>(run.ordinal) * w});
  unit->write_unit(index, pieces);
}

void TiledEvictable::finish_tile(const std::shared_ptr<Request>& r, size_t k, CarrierPtr buffer, std::exception_ptr error) {
  {
    std::lock_guard lock(r->m);
    r->staged[k] = std::move(buffer);
    if (error && !r->error) r->error = std::move(error);
  }
  if (r->remaining.fetch_sub(1) == 1) complete(r);
}

void TiledEvictable::complete(const std::shared_ptr<Request>& r) {
  // Every transfer has returned; a flush's tiles are clean only once the tier holds them durably.
  if (r->flush && !r->error) {
    try {
      secondary_->flush();
    } catch (...) {
      r->error = std::current_exception();
    }
  }
  commit(r);
}

void TiledEvictable::commit(const std::shared_ptr<Request>& r) {
  std::vector<CarrierPtr> discard;
  {
    std::lock_guard lock(mutex_);
    const int64_t bytes = tile_size() * static_cast<int64_t>(slot_bytes(dtype()));
    for (size_t k = 0; k < r->tiles.size(); ++k) {
      Tile& t = tiles_[r->tiles[k]];
      t.pending = 0;
      if (r->write_behind && t.behind) {  // Note [Write-behind evictions]: its write has ended
        t.behind = 0;
        behind_tiles_--;
        if (r->error && budget_) budget_->write_behind_ended(*this, r->tiles[k], /*failed=*/true);
      }
      if (r->error) {  // all-or-nothing: the prior state stands
        if (budget_ && r->promote) budget_->evicted(*this, r->tiles[k]);  // counted when it was admitted
        continue;
      }
      if (r->promote) {
        bool was_implicit = t.loc == TileLocation::Implicit;
        t.buffer = std::move(r->staged[k]);
        t.loc = TileLocation::Primary;
        t.dirty = was_implicit;
        t.secondary_valid = !was_implicit;
        stats_.promotions++;
        if (!was_implicit) stats_.bytes_promoted += bytes;
        stats_.primary_tiles++;
        stats_.primary_bytes += bytes;
        if (budget_) budget_->resident(*this, r->tiles[k], bytes);
      } else if (r->flush) {
        t.dirty = false;
        t.secondary_valid = true;
        stats_.flushes++;
        stats_.bytes_flushed += bytes;
      } else {
        discard.push_back(std::move(t.buffer));
        t.loc = TileLocation::Secondary;
        t.dirty = false;
        t.secondary_valid = true;
        stats_.evictions++;
        if (r->wrote[k]) stats_.bytes_evicted += bytes;
        else stats_.writes_skipped++;
        stats_.primary_tiles--;
        stats_.primary_bytes -= bytes;
        if (budget_) budget_->evicted(*this, r->tiles[k]);
      }
    }
    if (r->error) r->staged.clear();
    if (r->write_behind) {
      behind_requests_--;
      if (r->error && !write_behind_failure_)  // reported by the next request (Note [Write-behind evictions])
        write_behind_failure_ = tiled_error_like(
            r->error, "a write-behind eviction of " + tile_list(r->tiles, "") + " of TiledEvictable to its secondary tier " +
                          secondary_description() + " failed, so " + (r->tiles.size() == 1 ? "it stays" : "they stay") +
                          " resident and dirty (nothing is lost): " + tiled_error_message(r->error));
    }
    active_requests_--;
  }
  idle_cv_.notify_all();
  for (auto& b : discard)
    if (b) b->release();
  discard.clear();
  // Note [Letting go before completing]: whoever waits for `done` may next ask whether it holds the only
  // reference to this carrier (a tiled gradient adds in place only then; otherwise it builds a new one with
  // every tile read back into memory). So the request drops its reference first. `this` may be destroyed by
  // that; nothing below touches it.
  // The error moves into the completion: the request keeps no share of it, so the exception is destroyed with
  // the completion, by whoever drops that last.
  std::shared_ptr<TiledEvictable> owner = std::move(r->owner);
  owner.reset();
  if (r->owner_count) {
    r->owner_count->fetch_sub(1, std::memory_order_seq_cst);
    r->owner_count.reset();
  }
  if (std::exception_ptr error = std::move(r->error)) r->done->set_error(std::move(error));
  else r->done->set_value({});
}

}  // namespace sw
