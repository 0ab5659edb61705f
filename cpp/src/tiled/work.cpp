// Work requests of a TiledEvictable (projection, scatter, operations, backward): begin_work pins, end_work
// unpins and applies the policy's deferred evictions; WorkToken ends each exactly once. Also the tile-buffer
// hooks of the data paths.
#include <algorithm>

#include "strideweave/errors.hpp"
#include "internal.hpp"

namespace sw {

namespace {
// The message of the exception `e` holds.
std::string message_of(const std::exception_ptr& e) {
  try {
    std::rethrow_exception(e);
  } catch (const std::exception& x) {
    return x.what();
  } catch (...) {
  }
  return "an unknown error";
}

// An exception of `model`'s error kind (RuntimeError when it is not an engine error) carrying `message`.
std::exception_ptr error_like(const std::exception_ptr& model, std::string message) {
  try {
    std::rethrow_exception(model);
  } catch (const Error& e) {
    switch (e.kind()) {
      case ErrorKind::Type: return std::make_exception_ptr(TypeError(std::move(message)));
      case ErrorKind::Value: return std::make_exception_ptr(ValueError(std::move(message)));
      case ErrorKind::Runtime: return std::make_exception_ptr(RuntimeError(std::move(message)));
      case ErrorKind::Index: return std::make_exception_ptr(IndexError(std::move(message)));
      case ErrorKind::NotImplemented: return std::make_exception_ptr(NotImplementedError(std::move(message)));
      case ErrorKind::Overflow: return std::make_exception_ptr(OverflowError(std::move(message)));
      case ErrorKind::Memory: return std::make_exception_ptr(MemoryError(std::move(message)));
      case ErrorKind::Internal: return std::make_exception_ptr(InternalError(std::move(message)));
    }
  } catch (...) {
  }
  return std::make_exception_ptr(RuntimeError(std::move(message)));
}
}  // namespace

std::string tiled_error_message(const std::exception_ptr& e) { return message_of(e); }
std::exception_ptr tiled_error_like(const std::exception_ptr& model, std::string message) {
  return error_like(model, std::move(message));
}

// ---------------------------------------------------------------- work requests

std::shared_ptr<TiledEvictable::Work> TiledEvictable::begin_work(const std::vector<int64_t>& tiles, const char* purpose,
                                                                std::vector<int64_t>& missing) {
  check_live("run tiled work");
  auto work = std::make_shared<Work>();
  work->purpose = purpose;
  work->tiles = tiles;
  std::sort(work->tiles.begin(), work->tiles.end());
  work->tiles.erase(std::unique(work->tiles.begin(), work->tiles.end()), work->tiles.end());
  if (budget_) {  // before the policy is asked: a working set that can never fit changes nothing
    int64_t held = 0;
    {
      std::lock_guard lock(mutex_);
      for (int64_t i : work->tiles)
        if (tiles_[i].loc != TileLocation::Implicit) held++;
    }
    budget_->check_working_set(*this, held, held * tile_bytes(), purpose);
  }
  if (policy_) {
    std::vector<TileCoord> required;
    for (int64_t i : work->tiles) required.push_back(tile_coord(i));
    work->plan = policy_->plan(required, purpose);  // exceptions propagate before any work
    for (auto* field : {&work->plan.promote, &work->plan.retain, &work->plan.evict})
      for (const auto& t : *field) tile_index(t);  // ValueError for out-of-grid plans
  }
  {
    std::unique_lock lock(mutex_);
    check_live("run tiled work");  // again under the lock: see Note [Release races with requests]
    raise_write_behind_failure();
    settle_write_behind(lock, work->tiles);  // Note [Write-behind evictions]
    for (int64_t i : work->tiles) {
      if (tiles_[i].pending) pending_conflict(i, "running tiled work on it");
      if (tiles_[i].loc == TileLocation::Invalid)
        raise<RuntimeError>("tile ", coord_str(tile_coord(i)), " of TiledEvictable is invalid: it has no value yet");
    }
    for (int64_t i : work->tiles) {
      tiles_[i].pins++;
      if (tiles_[i].loc == TileLocation::Secondary) missing.push_back(i);
    }
    if (budget_) budget_->touch(*this, work->tiles);
    for (const auto& t : work->plan.promote) {
      int64_t i = tile_index(t);
      const Tile& tile = tiles_[i];
      if (tile.loc == TileLocation::Secondary && !tile.pending &&
          std::find(missing.begin(), missing.end(), i) == missing.end())
        missing.push_back(i);
    }
    active_work_++;
  }
  return work;
}

WorkToken TiledInternals::begin_work(const std::shared_ptr<TiledEvictable>& c, const std::vector<int64_t>& tiles,
                                     const char* purpose) {
  std::vector<int64_t> missing;
  WorkToken token(c, c->begin_work(tiles, purpose, missing));  // pinned: the token unpins on every path
  try {
    token.work_->ready = missing.empty() ? nullptr : c->promote_async(missing);
  } catch (...) {
    std::rethrow_exception(token.end(std::current_exception()));
  }
  if (!token.work_->ready) {
    token.work_->ready = std::make_shared<Completion<std::monostate>>();
    token.work_->ready->set_value({});
  }
  return token;
}

WorkToken TiledInternals::pin_for_reading(const std::shared_ptr<TiledEvictable>& c) {
  return WorkToken(c, c->pin_for_reading());
}

// ---------------------------------------------------------------- WorkToken

WorkToken& WorkToken::operator=(WorkToken&& o) noexcept {
  if (this != &o) {
    (void)end_quietly();
    carrier_ = std::move(o.carrier_);
    work_ = std::move(o.work_);
  }
  return *this;
}

WorkToken::~WorkToken() { end_quietly(); }

void WorkToken::end_quietly() noexcept {
  try {
    (void)end();
  } catch (...) {  // ending never throws in practice (end_work reports errors by value); a destructor never does
  }
}

const CompletionPtr<std::monostate>& WorkToken::ready() const noexcept { return work_->ready; }

std::exception_ptr WorkToken::end(std::exception_ptr work_error) {
  if (!carrier_) return work_error;
  std::shared_ptr<TiledEvictable> carrier = std::move(carrier_);
  return carrier->end_work(work_, std::move(work_error));
}

// Note [A failed deferred eviction reaches the work]: a policy's evictions run when the work that planned them
// ends, in end_work, in the work's own thread and before its completion is published (a caller that waited for
// the work observes them). They used to be best effort, and a failure (a full disk: ENOSPC) vanished: the tiles
// stayed resident and dirty, memory grew past the policy's budget, and a later release() discarded the values,
// all without a word. A failed eviction is now reported by the handle of the work that planned it, with its
// cause; the work's result is not published, and the tiles stay resident (dirty ones dirty: the eviction commits
// all-or-nothing), so `stats()` counts no eviction for them. The alternative, a sticky error raised by the next
// request on the carrier, was rejected: under concurrency that request is another caller's (an unrelated prefetch,
// a read on another thread), chosen by timing; it would fail a request whose own work is fine; and with no later
// request the error would never surface. The work's handle is the one report that is ordered with the eviction
// and reaches the caller whose plan caused it, at the moment memory stops being bounded; retrying the work plans
// again. What is not a failure stays silent: a planned tile that other work pins, that another request is
// transitioning, or that is no longer resident is left out (those callers decide), and a carrier whose release
// waits for this work evicts nothing. When the work failed too, its own error is reported, naming the failed
// eviction as well.
std::exception_ptr TiledEvictable::end_work(const std::shared_ptr<Work>& work, std::exception_ptr work_error) {
  auto r = std::make_shared<Request>();
  r->promote = false;
  std::exception_ptr failure;  // the deferred eviction's, refused before any transfer or failed in one
  {
    std::lock_guard lock(mutex_);
    if (work->ended || work->generation != fork_generation()) return work_error;
    work->ended = true;
    for (int64_t i : work->tiles) tiles_[i].pins--;
    if (!is_released()) {  // a release waiting for this work drops every tile anyway
      std::vector<int64_t> planned;
      for (const auto& t : work->plan.evict) planned.push_back(tile_index(t));
      try {
        prepare_eviction(std::move(planned), *r, /*deferred=*/true);
      } catch (...) {  // a read-only tier, a secondary that cannot grow: nothing was marked
        failure = std::current_exception();
      }
    }
    active_work_--;
    idle_cv_.notify_all();
  }
  if (!failure && !r->tiles.empty()) {
    start_request(r, /*inline_=*/true);
    failure = r->done->error();
  }
  if (!failure) return work_error;
  const std::string planned = "the residency policy planned the eviction of " + tile_list(r->tiles, "") + " after ";
  const std::string kept = r->tiles.size() == 1 ? "the tile stays resident (and dirty if it was)"
                                                : "the tiles stay resident (dirty ones dirty)";
  if (work_error) {
    try {
      std::rethrow_exception(work_error);
    } catch (const Error&) {
      return error_like(work_error, message_of(work_error) + "; besides, " + planned + "this " + work->purpose +
                                        " and that eviction failed too (" + kept + "): " + message_of(failure));
    } catch (...) {
      return work_error;  // a foreign exception keeps its identity
    }
  }
  return error_like(failure, "the " + work->purpose + " failed: " + planned + "it and that eviction failed, so " +
                                 kept + ": " + message_of(failure));
}

CarrierPtr TiledEvictable::tile_buffer(int64_t index) const {
  std::lock_guard lock(mutex_);
  const Tile& t = tiles_[index];
  if (t.loc == TileLocation::Implicit) return nullptr;
  SW_ASSERT(t.loc == TileLocation::Primary && t.buffer, "tile ", index, " is not resident under running work");
  return t.buffer;
}

void TiledEvictable::install_tiles(const std::vector<std::pair<int64_t, CarrierPtr>>& buffers) {
  if (budget_) {
    std::vector<int64_t> indices;
    for (const auto& b : buffers) indices.push_back(b.first);
    admit(std::move(indices), "gradient or scatter result");  // Note [One residency budget]
  }
  std::vector<CarrierPtr> old;
  {
    std::unique_lock lock(mutex_);
    if (behind_tiles_ > 0) {  // Note [Write-behind evictions]: a tile replaced is taken back, or waited for
      std::vector<int64_t> indices;
      for (const auto& b : buffers) indices.push_back(b.first);
      settle_write_behind(lock, indices);
    }
    const int64_t bytes = tile_size() * static_cast<int64_t>(slot_bytes(dtype()));
    for (const auto& [i, buf] : buffers) {
      Tile& t = tiles_[i];
      SW_ASSERT(!t.pending && t.pins == 0, "install_tiles over running work");
      if (t.buffer) old.push_back(std::move(t.buffer));
      else {
        stats_.primary_tiles++;
        stats_.primary_bytes += bytes;
      }
      t.buffer = buf;
      t.loc = TileLocation::Primary;
      t.dirty = true;
      t.secondary_valid = false;
      if (budget_) budget_->resident(*this, i, bytes);
    }
  }
  bump_version();
  for (auto& b : old) b->release();
}

}  // namespace sw
