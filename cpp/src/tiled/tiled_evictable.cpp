#include "strideweave/tiled/tiled_evictable.hpp"

#include <algorithm>
#include <functional>
#include <new>
#include <sstream>
#include <thread>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "../ops/strided.hpp"

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

namespace {
std::string coord_str(const TileCoord& t) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < t.size(); ++i) out << (i ? ", " : "") << t[i];
  out << (t.size() == 1 ? ",)" : ")");
  return out.str();
}

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

// Live carriers whose secondary tier is a named file, for the report at interpreter exit (Note [Dirty tiles are
// never discarded silently]). Never destroyed: carriers may outlive static destruction.
struct NamedFileCarriers {
  std::mutex m;
  std::vector<TiledEvictable*> live;
};
NamedFileCarriers& named_file_carriers() {
  static auto* r = new NamedFileCarriers();
  return *r;
}
std::atomic<TiledEvictable::DiscardReporter> g_discard_reporter{nullptr};
}  // namespace

// A residency transition of a set of tiles, committed all-or-nothing.
struct TiledEvictable::Request {
  uint64_t id = 0;
  bool promote = true;
  bool flush = false;                  // with promote false: write dirty tiles, sync, keep them resident
  std::vector<int64_t> tiles;          // tiles that need a transfer
  std::vector<CarrierPtr> staged;      // promotion: new buffers
  std::vector<char> wrote;             // eviction: a write happened
  std::atomic<size_t> remaining{0};
  std::mutex m;
  std::exception_ptr error;
  CompletionPtr<std::monostate> done = std::make_shared<Completion<std::monostate>>();
  // Keeps the carrier alive while queued transfers run; let go of before `done` is set
  // (Note [Letting go before completing]). `owner_count` is the carrier's request_refs_, which counts it.
  std::shared_ptr<TiledEvictable> owner;
  std::shared_ptr<std::atomic<int64_t>> owner_count;
};

struct TiledEvictable::Work {
  std::string purpose;  // what the policy was told ("projection", ...), for messages
  std::vector<int64_t> tiles;
  ResidencyPlan plan;
  CompletionPtr<std::monostate> ready;
  bool ended = false;
  uint64_t generation = fork_generation();  // work begun before fork() has no pins in a child (Note [Fork safety])
};

// ---------------------------------------------------------------- construction

TiledEvictable::TiledEvictable(CarrierPtr primary, CarrierPtr secondary, std::vector<int64_t> grid,
                               std::vector<int64_t> tile, std::shared_ptr<ResidencyPolicy> policy, bool is_mutable)
    : DependentCarrier(&tiled_evictable_kind(), primary ? primary->dtype() : DType::Float32(), is_mutable),
      grid_(std::move(grid)),
      tile_(std::move(tile)),
      policy_(std::move(policy)) {
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
  if (grid_.empty() || grid_.size() != tile_.size())
    raise<ValueError>("grid_shape and tile_shape must have one non-zero rank, got ", grid_.size(), " and ", tile_.size());
  tile_count_ = 1;
  tile_size_ = 1;
  for (size_t i = 0; i < grid_.size(); ++i) {
    if (grid_[i] < 1 || tile_[i] < 1)
      raise<ValueError>("grid_shape and tile_shape extents must be >= 1 (axis ", i, ")");
  }
  // Every product below is bounded by the extent (Shape's 2**62 limit), so none overflows int64.
  constexpr int64_t kMaxExtent = int64_t{1} << 62;
  auto checked = [](int64_t a, int64_t b) {
    int64_t out;
    if (__builtin_mul_overflow(a, b, &out) || out > kMaxExtent)
      raise<ValueError>("TiledEvictable extent (grid_shape times tile_shape) exceeds the supported range (2**62)");
    return out;
  };
  for (size_t i = 0; i < grid_.size(); ++i) {
    logical_.push_back(checked(grid_[i], tile_[i]));
    tile_count_ = checked(tile_count_, grid_[i]);
    tile_size_ = checked(tile_size_, tile_[i]);
  }
  total_ = checked(tile_count_, tile_size_);
  // Geometry: dense strides of the logical shape (each tile's footprint runs are built below).
  int64_t run = 1;
  for (int64_t l : logical_) {
    slot_stride_.push_back(run);
    run *= l;
  }
  check_table_size();
  const int64_t p = primary->size(), s = secondary->size();
  if (p != 0 && p != total_) raise<ValueError>("TiledEvictable primary must have 0 or ", total_, " slots, got ", p);
  if (s != 0 && s != total_) raise<ValueError>("TiledEvictable secondary must have 0 or ", total_, " slots, got ", s);
  if (s == 0 && !secondary->can_grow())
    raise<ValueError>("TiledEvictable secondary ", secondary->kind_name(), " is empty and cannot grow to hold evicted tiles");
  // Each tile's footprint runs.
  runs_.resize(static_cast<size_t>(tile_count_));
  for (int64_t t = 0; t < tile_count_; ++t) {
    TileCoord tc = tile_coord(t);
    int64_t base = 0;
    for (size_t i = 0; i < rank(); ++i) base += tc[i] * tile_[i] * slot_stride_[i];
    Layout fp(Shape::flat(tile_), Stride::flat(slot_stride_));
    runs_[t] = fp.runs();
    for (auto& r : runs_[t]) r.offset += base;
  }
  tiles_.resize(static_cast<size_t>(tile_count_));
  // Claims, rolled back if anything below fails.
  Claim pc = primary->claim("a TiledEvictable carrier");
  Claim sc = secondary->claim("a TiledEvictable carrier");
  if (p == total_) {
    for (int64_t t = 0; t < tile_count_; ++t) {
      CarrierPtr buf = primary->allocate_like(tile_size_, true, dtype(), true);
      for (const Run& r : runs_[t]) copy_slots(*primary, r.offset, *buf, r.ordinal, r.length);
      tiles_[t].loc = TileLocation::Primary;
      tiles_[t].buffer = std::move(buf);
      tiles_[t].dirty = true;  // a full secondary holds unrelated values: the primary value must be preserved
      tiles_[t].secondary_valid = false;
      stats_.primary_tiles++;
      stats_.primary_bytes += tile_size_ * static_cast<int64_t>(slot_bytes(dtype()));
    }
  } else if (s == total_) {
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
    DiscardReporter report = g_discard_reporter.load();
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
    }
    c->active_requests_ = 0;
    c->active_work_ = 0;
    new (&c->idle_cv_) std::condition_variable();
  }
  unlock_tile_tables();
}

// Note [Tile table limits]. The constructor builds its tile table eagerly: one entry and one list of
// footprint runs per tile (10**7 one-run tiles take about 0.8 GB and 5 s), 24 bytes a run. An extent
// within 2**62 may still ask for 10**14 tiles (grid (10**7, 10**7), tile (1, 1)) or 2**40 runs (tile
// (1, 2**40) under a grid whose first axis is not 1), which would take terabytes or fail deep inside
// std::vector. So the table is bounded up front, before any allocation or claim: at most kMaxTiles
// tiles and kMaxRuns runs in all (every tile has tile_size / run_length runs, run_length being the
// first coalesced leaf of its footprint when that leaf has stride 1, as Layout::runs() coalesces).
// Beyond either, ValueError. The bounds allow realistic tilings (a 65536 x 65536 matrix in 256 x 256
// tiles has 2**16 tiles and 2**24 runs) and keep the largest table to a few GB and seconds.
void TiledEvictable::check_table_size() const {
  if (tile_count_ > kMaxTiles)
    raise<ValueError>("TiledEvictable grid_shape ", coord_str(grid_), " has ", tile_count_,
                      " tiles; at most 2**24 (", kMaxTiles, ") tiles are supported");
  std::vector<int64_t> ext, str;  // the footprint's leaves, coalesced like Layout::runs()
  for (size_t i = 0; i < rank(); ++i) {
    if (tile_[i] == 1) continue;
    if (!ext.empty() && slot_stride_[i] == ext.back() * str.back()) {
      ext.back() *= tile_[i];
      continue;
    }
    ext.push_back(tile_[i]);
    str.push_back(slot_stride_[i]);
  }
  const int64_t run_length = !ext.empty() && str[0] == 1 ? ext[0] : 1;
  const int64_t runs = total_ / run_length;  // tile_count * (tile_size / run_length)
  if (runs > kMaxRuns)
    raise<ValueError>("TiledEvictable tile footprints of tile_shape ", coord_str(tile_), " in logical_shape ",
                      coord_str(logical_), " need ", runs, " contiguous runs; at most 2**26 (", kMaxRuns,
                      ") are supported");
}

int64_t TiledEvictable::tile_index(const TileCoord& t) const {
  if (t.size() != rank())
    raise<ValueError>("tile coordinate ", coord_str(t), " has rank ", t.size(), " but the tile grid has rank ", rank());
  int64_t index = 0, scale = 1;
  for (size_t i = 0; i < rank(); ++i) {
    if (t[i] < 0 || t[i] >= grid_[i])
      raise<ValueError>("tile coordinate ", coord_str(t), " is out of range for the tile grid ", coord_str(grid_));
    index += t[i] * scale;
    scale *= grid_[i];
  }
  return index;
}

TileCoord TiledEvictable::tile_coord(int64_t index) const {
  TileCoord t(rank());
  for (size_t i = 0; i < rank(); ++i) {
    t[i] = index % grid_[i];
    index /= grid_[i];
  }
  return t;
}

std::pair<int64_t, int64_t> TiledEvictable::locate(int64_t slot) const {
  int64_t tile = 0, within = 0, tscale = 1, wscale = 1;
  for (size_t i = 0; i < rank(); ++i) {
    int64_t c = slot % logical_[i];
    slot /= logical_[i];
    tile += (c / tile_[i]) * tscale;
    within += (c % tile_[i]) * wscale;
    tscale *= grid_[i];
    wscale *= tile_[i];
  }
  return {tile, within};
}

const std::vector<Run>& TiledEvictable::footprint_runs(int64_t index) const { return runs_[static_cast<size_t>(index)]; }

// ---------------------------------------------------------------- footprints

void TiledEvictable::check_footprints(const TensorImpl& t) const {
  if (t.carrier.get() != this) raise<TypeError>("the tensor is not backed by this TiledEvictable");
  std::vector<int64_t> ext = t.layout.shape().extents();
  if (ext != logical_) {
    std::ostringstream s;
    for (size_t i = 0; i < ext.size(); ++i) s << (i ? ", " : "") << ext[i];
    raise<ValueError>("the tensor's shape (", s.str(), ") is not the TiledEvictable's full logical shape ",
                      coord_str(logical_), ": tile footprints cannot match");
  }
  {
    std::lock_guard lock(footprint_cache_mutex_);
    for (const auto& [l, off] : footprint_cache_)
      if (off == t.offset && l == t.layout) return;
  }
  bool ok = t.offset == 0 && t.layout.is_column_major();  // the canonical layout
  if (!ok) {
    // One pass over the tensor's slots: each must lie in its own tile's footprint, and no slot twice.
    std::vector<uint8_t> seen(static_cast<size_t>(total_), 0);
    const FlatLayout& flat = t.layout.flat();
    // Top-level mode boundaries among the flat leaves.
    std::vector<size_t> first_leaf;
    size_t leaf = 0;
    for (size_t k = 0; k < t.layout.rank(); ++k) {
      first_leaf.push_back(leaf);
      leaf += t.layout.shape().tree()[k].is_leaf() ? 1 : t.layout.shape().tree()[k].leaf_count();
    }
    const int64_t n = t.size();
    std::vector<int64_t> c(flat.extents.size(), 0);
    int64_t off = t.offset;
    for (int64_t o = 0; o < n; ++o) {
      // Logical tile of ordinal o: per top-level mode, its ordinal / tile extent.
      int64_t tile = 0, tscale = 1;
      for (size_t k = 0; k < rank(); ++k) {
        size_t end = k + 1 < first_leaf.size() ? first_leaf[k + 1] : flat.extents.size();
        int64_t mode_ord = 0, mscale = 1;
        for (size_t j = first_leaf[k]; j < end; ++j) {
          mode_ord += c[j] * mscale;
          mscale *= flat.extents[j];
        }
        tile += (mode_ord / tile_[k]) * tscale;
        tscale *= grid_[k];
      }
      if (off < 0 || off >= total_)
        raise<ValueError>("tensor slot ", off, " lies outside the TiledEvictable extent: tile footprints do not match");
      auto [phys_tile, within] = locate(off);
      (void)within;
      if (phys_tile != tile)
        raise<ValueError>("logical tile ", coord_str(tile_coord(tile)), " reaches slot ", off, " of carrier tile ",
                          coord_str(tile_coord(phys_tile)), ": the tensor's tile footprints do not match the carrier's");
      if (seen[off]) raise<ValueError>("the tensor reaches slot ", off, " twice: its tile footprints alias");
      seen[off] = 1;
      for (size_t j = 0; j < c.size(); ++j) {  // odometer
        off += flat.strides[j];
        if (++c[j] < flat.extents[j]) break;
        off -= flat.strides[j] * flat.extents[j];
        c[j] = 0;
      }
    }
    // n == total_ and no slot repeats, so every footprint is covered exactly.
  }
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
  for (int64_t i = 0; i < tile_count_; ++i) {
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

// ---------------------------------------------------------------- residency requests

void TiledEvictable::ensure_secondary_storage() {
  if (secondary_->size() == 0) secondary_->grow(total_, false);
}

CompletionPtr<std::monostate> TiledEvictable::promote_async(const std::vector<int64_t>& tiles) {
  return promote_tiles(tiles, false);
}

CompletionPtr<std::monostate> TiledEvictable::promote_tiles(const std::vector<int64_t>& tiles, bool inline_) {
  check_live("promote tiles");
  auto r = std::make_shared<Request>();
  r->promote = true;
  {
    std::lock_guard lock(mutex_);
    check_live("promote tiles");  // again under the lock: see Note [Release races with requests]
    std::vector<int64_t> uniq = tiles;
    std::sort(uniq.begin(), uniq.end());
    uniq.erase(std::unique(uniq.begin(), uniq.end()), uniq.end());
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
  }
  start_request(r, inline_);
  return r->done;
}

CompletionPtr<std::monostate> TiledEvictable::evict_async(const std::vector<int64_t>& tiles) {
  return evict_tiles(tiles, false);
}

CompletionPtr<std::monostate> TiledEvictable::evict_tiles(const std::vector<int64_t>& tiles, bool inline_) {
  check_live("evict tiles");
  auto r = std::make_shared<Request>();
  r->promote = false;
  {
    std::lock_guard lock(mutex_);
    check_live("evict tiles");  // again under the lock: see Note [Release races with requests]
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
  check_secondary_writable(r.tiles, "evict");
  ensure_secondary_storage();
  r.id = next_request_++;
  for (int64_t i : r.tiles) tiles_[i].pending = r.id;
  active_requests_++;
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

CompletionPtr<std::monostate> TiledEvictable::flush_tiles(bool inline_) {
  check_live("flush");
  auto r = std::make_shared<Request>();
  r->promote = false;
  r->flush = true;
  {
    std::lock_guard lock(mutex_);
    check_live("flush");  // again under the lock: see Note [Release races with requests]
    for (int64_t i = 0; i < tile_count_; ++i)
      if (tiles_[i].pending) pending_conflict(i, "flushing");
    for (int64_t i = 0; i < tile_count_; ++i) {
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
      secondary_->check_storage_intact("evict tiles to it");
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
          staged = me->primary_->allocate_like(me->tile_size_, true, me->dtype(), loc == TileLocation::Secondary);
          if (loc == TileLocation::Secondary)
            for (const Run& run : me->runs_[index])
              copy_slots(*me->secondary_, run.offset, *staged, run.ordinal, run.length);
        } else if (needs_write) {
          for (const Run& run : me->runs_[index])
            copy_slots(*buffer, run.ordinal, *me->secondary_, run.offset, run.length);
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
    for (size_t q = 0; device_read && q < runs_[index].size(); ++q)
      device_read = secondary_->read_waits_on_device(runs_[index][q].offset, runs_[index][q].length);
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
    const int64_t bytes = tile_size_ * static_cast<int64_t>(slot_bytes(dtype()));
    for (size_t k = 0; k < r->tiles.size(); ++k) {
      Tile& t = tiles_[r->tiles[k]];
      t.pending = 0;
      if (r->error) continue;  // all-or-nothing: the prior state stands
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
      }
    }
    if (r->error) r->staged.clear();
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

// ---------------------------------------------------------------- data access

const TiledEvictable::Tile& TiledEvictable::readable_tile(int64_t index, std::unique_lock<std::mutex>& lock) const {
  for (;;) {
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
  auto [index, within] = locate(slot);
  std::unique_lock lock(mutex_);
  {
    const Tile& t = tiles_[index];
    if (t.pending) pending_conflict(index, "accessing its values");
    if (t.loc == TileLocation::Secondary) {
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
      return secondary_->read_value(slot);
    }
  }
  const Tile& t = readable_tile(index, lock);
  if (t.loc == TileLocation::Implicit) {
    switch (dtype().id()) {
      case DTypeId::Int32: return Value::from_int(0);
      case DTypeId::Bool: return Value::from_bool(false);
      default: return Value::from_float(0.0);
    }
  }
  return t.buffer->read_value(within);
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

void TiledEvictable::read_slots(int64_t start, int64_t count, void* out) const {
  auto* bytes = static_cast<std::byte*>(out);
  const size_t w = slot_bytes(dtype());
  for (int64_t k = 0; k < count; ++k) store_value(dtype(), bytes + k * w, read_value(start + k));
}

void TiledEvictable::write_slots(int64_t start, int64_t count, const void* in) {
  // A bulk write that covers the whole footprint of an invalid tile initialises it (new_like, gradients):
  // such a tile gets a fresh primary buffer first, and the writes below fill all of it.
  std::vector<int64_t> covered;
  {
    std::lock_guard lock(mutex_);
    for (int64_t t = 0; t < tile_count_; ++t) {
      if (tiles_[t].loc != TileLocation::Invalid || tiles_[t].pending) continue;
      const auto& runs = runs_[t];
      if (std::all_of(runs.begin(), runs.end(),
                      [&](const Run& r) { return r.offset >= start && r.offset + r.length <= start + count; }))
        covered.push_back(t);
    }
  }
  for (int64_t t : covered) {
    CarrierPtr buf = primary_->allocate_like(tile_size_, true, dtype(), true);  // outside the lock
    std::lock_guard lock(mutex_);
    Tile& tile = tiles_[t];
    if (tile.loc != TileLocation::Invalid || tile.pending) continue;
    tile.buffer = std::move(buf);
    tile.loc = TileLocation::Primary;
    tile.dirty = true;
    tile.secondary_valid = false;
    stats_.primary_tiles++;
    stats_.primary_bytes += tile_size_ * static_cast<int64_t>(slot_bytes(dtype()));
  }
  auto* bytes = static_cast<const std::byte*>(in);
  const size_t w = slot_bytes(dtype());
  for (int64_t k = 0; k < count; ++k) write_value(start + k, load_value(dtype(), bytes + k * w));
}

bool TiledEvictable::supports_storage_dtype(const DType& d) const {
  return primary_->supports_storage_dtype(d) && secondary_->supports_storage_dtype(d);
}

CarrierPtr TiledEvictable::allocate_like(int64_t slots, bool is_mutable, const DType& d, bool empty) const {
  if (slots != 0 && slots != total_)
    raise<ValueError>("TiledEvictable.allocate_like size must be 0 or the full extent ", total_, ", got ", slots);
  CarrierPtr p = primary_->allocate_like(0, true, d, true);
  CarrierPtr s = secondary_->allocate_like(0, true, d, true);
  auto out = std::make_shared<TiledEvictable>(p, s, grid_, tile_, policy_, is_mutable);
  if (!empty) {
    std::lock_guard lock(out->mutex_);
    for (auto& t : out->tiles_) t.loc = TileLocation::Implicit;
  }
  return out;
}

// ---------------------------------------------------------------- work requests

std::shared_ptr<TiledEvictable::Work> TiledEvictable::begin_work(const std::vector<int64_t>& tiles, const char* purpose) {
  check_live("run tiled work");
  auto work = std::make_shared<Work>();
  work->purpose = purpose;
  work->tiles = tiles;
  std::sort(work->tiles.begin(), work->tiles.end());
  work->tiles.erase(std::unique(work->tiles.begin(), work->tiles.end()), work->tiles.end());
  if (policy_) {
    std::vector<TileCoord> required;
    for (int64_t i : work->tiles) required.push_back(tile_coord(i));
    work->plan = policy_->plan(required, purpose);  // exceptions propagate before any work
    for (auto* field : {&work->plan.promote, &work->plan.retain, &work->plan.evict})
      for (const auto& t : *field) tile_index(t);  // ValueError for out-of-grid plans
  }
  std::vector<int64_t> missing;
  {
    std::lock_guard lock(mutex_);
    check_live("run tiled work");  // again under the lock: see Note [Release races with requests]
    for (int64_t i : work->tiles) {
      if (tiles_[i].pending) pending_conflict(i, "running tiled work on it");
      if (tiles_[i].loc == TileLocation::Invalid)
        raise<RuntimeError>("tile ", coord_str(tile_coord(i)), " of TiledEvictable is invalid: it has no value yet");
    }
    for (int64_t i : work->tiles) {
      tiles_[i].pins++;
      if (tiles_[i].loc == TileLocation::Secondary) missing.push_back(i);
    }
    for (const auto& t : work->plan.promote) {
      int64_t i = tile_index(t);
      const Tile& tile = tiles_[i];
      if (tile.loc == TileLocation::Secondary && !tile.pending &&
          std::find(missing.begin(), missing.end(), i) == missing.end())
        missing.push_back(i);
    }
    active_work_++;
  }
  try {
    work->ready = missing.empty() ? nullptr : promote_async(missing);
  } catch (...) {
    std::rethrow_exception(end_work(work, std::current_exception()));
  }
  if (!work->ready) {
    work->ready = std::make_shared<Completion<std::monostate>>();
    work->ready->set_value({});
  }
  return work;
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

CompletionPtr<std::monostate> TiledEvictable::work_ready(const std::shared_ptr<Work>& work) { return work->ready; }

CarrierPtr TiledEvictable::tile_buffer(int64_t index) const {
  std::lock_guard lock(mutex_);
  const Tile& t = tiles_[index];
  if (t.loc == TileLocation::Implicit) return nullptr;
  SW_ASSERT(t.loc == TileLocation::Primary && t.buffer, "tile ", index, " is not resident under running work");
  return t.buffer;
}

void TiledEvictable::install_tiles(const std::vector<std::pair<int64_t, CarrierPtr>>& buffers) {
  std::vector<CarrierPtr> old;
  {
    std::lock_guard lock(mutex_);
    const int64_t bytes = tile_size_ * static_cast<int64_t>(slot_bytes(dtype()));
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
    }
  }
  bump_version();
  for (auto& b : old) b->release();
}

void TiledEvictable::make_all_implicit() {
  std::lock_guard lock(mutex_);
  for (auto& t : tiles_)
    if (t.loc == TileLocation::Invalid) t.loc = TileLocation::Implicit;
}

// ---------------------------------------------------------------- gradient accumulation

namespace {
// dst[k] += src[k] over one Float32 tile (native host memory when both have it).
void add_tile_into(Carrier& dst, const Carrier& src, int64_t n) {
  std::byte* d = dst.mutable_native_data();
  const std::byte* s = src.native_data();
  if (d && s) {
    float* df = reinterpret_cast<float*>(d);
    const float* sf = reinterpret_cast<const float*>(s);
    // Bound by memory bandwidth: a large tile (an expert's 4 MiB) is split over the cores.
    detail::parallel_for(n, int64_t{1} << 18, [df, sf](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) df[k] += sf[k];
    });
    return;
  }
  std::vector<float> a(static_cast<size_t>(n)), b(static_cast<size_t>(n));
  dst.read_slots(0, n, a.data());
  src.read_slots(0, n, b.data());
  for (int64_t k = 0; k < n; ++k) a[k] += b[k];
  dst.write_slots(0, n, a.data());
}

// dst[ordinal] += src[offset] over a tile's footprint runs in `src` (a tier holding the full extent): the
// secondary copy is read in small pieces that stay in cache and added as they arrive, split over the cores.
// Note [Adding a secondary tile]: no tile-sized buffer is allocated (and page-faulted) for the read.
void add_runs_into(Carrier& dst, const Carrier& src, const std::vector<Run>& runs) {
  float* d = reinterpret_cast<float*>(dst.mutable_native_data());
  SW_ASSERT(d != nullptr, "add_runs_into needs native memory");
  constexpr int64_t kPiece = int64_t{1} << 14;  // 64 KiB of Float32 per read
  for (const Run& run : runs) {
    detail::parallel_for(run.length, kPiece * 4, [&](int64_t b, int64_t e) {
      float piece[kPiece];
      for (int64_t at = b; at < e; at += kPiece) {
        const int64_t n = std::min(kPiece, e - at);
        src.read_slots(run.offset + at, n, piece);
        float* o = d + run.ordinal + at;
        for (int64_t k = 0; k < n; ++k) o[k] += piece[k];
      }
    });
  }
}
}  // namespace

// Note [Gradient sums hold their tiles]: a gradient sum writes into tiles of a
// leaf's .grad in place (accumulate_tiles, and a gradient sink that a matmul
// adds its product into: Note [Gradient sinks]), and reads the tiles of the
// gradients it adds. Whether it may write in place is decided by counting
// references (Note [Tiled gradient accumulation]), but nothing stops another
// thread from taking a reference to the .grad right after that check and
// evicting, promoting, projecting or releasing its tiles while the sum writes
// them: an eviction then wrote a half-added tile to the file and freed the
// buffer under the writer (a crash, or a contribution silently lost). So every
// tile a sum touches is held, exactly as work requests hold theirs, from before
// its value is read until the result is recorded:
//  * a tile written in place is *held*: Tile::pending carries the sum's id with
//    kSumHold set, so everything that refuses a tile under a request refuses it
//    too, with RuntimeError asking to wait (promotion, eviction, projection and
//    other work, slot reads and writes, other sums), and release waits for it
//    (active_work_), as for projections (promise 3 of docs/reliability.md).
//    A tile that is secondary when the sum begins is held the same way and read
//    back by the sum itself, which installs the sum as the resident, dirty tile;
//    an implicit tile takes the contribution. The sum never waits for other
//    requests: a tile already under a request, pinned by running work or held
//    by another sum makes accumulate_tiles refuse (false, nothing changed), and
//    the caller falls back to a fresh sum, whose reading pin then asks to wait.
//  * a tile only read (the gradient being added, both operands of a fresh sum)
//    is pinned: it is not evicted or written meanwhile, and a promotion that
//    begins meanwhile only reads the secondary copy that tile_value reads too.
// Everything that can fail (reading a secondary copy, allocating) happens
// before the first in-place write and before anything is published, so a sum
// lands whole or not at all; the in-place additions that follow cannot fail.
// Holding costs one lock per sum (and per sink), not per slot.

void TiledEvictable::end_hold_locked(std::span<const int64_t> tiles, uint64_t hold) {
  for (int64_t i : tiles) {
    SW_ASSERT(tiles_[i].pending == hold, "tile ", i, " is not held by this gradient sum");
    tiles_[i].pending = 0;
  }
  active_work_--;
  idle_cv_.notify_all();
}

std::shared_ptr<TiledEvictable::Work> TiledEvictable::pin_for_reading() {
  auto work = std::make_shared<Work>();
  work->tiles.resize(static_cast<size_t>(tile_count_));
  for (int64_t i = 0; i < tile_count_; ++i) work->tiles[static_cast<size_t>(i)] = i;
  std::lock_guard lock(mutex_);
  check_live("read its tiles");  // under the lock: Note [Release races with requests]
  for (int64_t i = 0; i < tile_count_; ++i) {
    const Tile& t = tiles_[i];
    if (t.pending) pending_conflict(i, "reading it");
    if (t.loc == TileLocation::Invalid)
      raise<RuntimeError>("tile ", coord_str(tile_coord(i)), " of TiledEvictable is invalid: it has no value yet");
  }
  for (auto& t : tiles_) t.pins++;
  active_work_++;
  return work;
}

CarrierPtr TiledEvictable::tile_value(int64_t index) const {
  {
    std::lock_guard lock(mutex_);
    const Tile& t = tiles_[index];
    // The caller's pin keeps evictions and sums away; a request on a pinned tile is a promotion, which only reads
    // the secondary copy that is read below (Note [Gradient sums hold their tiles]).
    if (t.pending && (t.pins == 0 || (t.pending & kSumHold))) pending_conflict(index, "reading it");
    if (t.loc == TileLocation::Invalid)
      raise<RuntimeError>("tile ", coord_str(tile_coord(index)), " of TiledEvictable is invalid: it has no value yet");
    if (t.loc == TileLocation::Implicit) return nullptr;
    if (t.loc == TileLocation::Primary) return t.buffer;
  }
  CarrierPtr buf = primary_->allocate_like(tile_size_, true, dtype(), true);
  for (const Run& run : runs_[index]) copy_slots(*secondary_, run.offset, *buf, run.ordinal, run.length);
  return buf;
}

std::unique_ptr<TiledEvictable::TileWrite> TiledEvictable::hold_tile_for_update(int64_t index) {
  auto self = std::static_pointer_cast<TiledEvictable>(weak_from_this().lock());
  if (!self) return nullptr;
  // Made before the hold is taken, so that once taken only its destructor ends it.
  std::unique_ptr<TileWrite> write(new TileWrite(self, index, 0, nullptr, nullptr));
  {
    std::lock_guard lock(mutex_);
    if (is_released()) return nullptr;
    Tile& t = tiles_[index];
    if (t.loc != TileLocation::Primary || t.pending || t.pins > 0 || !t.buffer || !t.buffer->native_data())
      return nullptr;
    write->hold_ = next_request_++ | kSumHold;
    t.pending = write->hold_;
    active_work_++;
    write->buffer_ = t.buffer;
  }
  // Held: nobody shares the buffer from now on, so a copy-on-write (Note [Shared snapshots]) happens here, once.
  write->data_ = reinterpret_cast<float*>(write->buffer_->mutable_native_data());
  return write;
}

TiledEvictable::TileWrite::~TileWrite() {
  if (ended_ || !hold_) return;
  std::lock_guard lock(owner_->mutex_);
  owner_->end_hold_locked({&index_, 1}, hold_);
}

void TiledEvictable::TileWrite::commit() {
  SW_ASSERT(!ended_ && hold_, "TileWrite::commit without a hold");
  std::lock_guard lock(owner_->mutex_);
  Tile& t = owner_->tiles_[index_];
  SW_ASSERT(t.buffer == buffer_ && t.loc == TileLocation::Primary, "a held tile changed under its writer");
  t.dirty = true;
  t.secondary_valid = false;
  owner_->bump_version();  // before the hold ends: whoever reads the sum next sees the new version
  owner_->end_hold_locked({&index_, 1}, hold_);
  ended_ = true;
}

bool TiledEvictable::accumulate_tiles(TiledEvictable& other, bool share_other) {
  SW_ASSERT(&other != this && other.grid_ == grid_ && other.tile_ == tile_ && other.dtype() == dtype(),
            "accumulate_tiles over a different geometry");
  if (dtype().id() != DTypeId::Float32 || is_released() || other.is_released() || !is_mutable()) return false;
  // Plan under both locks: which tiles contribute and what each does here; hold them (Note [Gradient sums hold
  // their tiles]): ours for writing, `other`'s for reading.
  struct Step {
    int64_t index;
    TileLocation here, theirs;
    CarrierPtr mine;
  };
  std::vector<Step> steps;
  std::vector<int64_t> held;
  uint64_t hold = 0;
  {
    std::scoped_lock lock(mutex_, other.mutex_);
    if (is_released() || other.is_released()) return false;  // Note [Release races with requests]
    for (int64_t i = 0; i < tile_count_; ++i) {
      const Tile& o = other.tiles_[i];
      if (o.pending || o.loc == TileLocation::Invalid) return false;
      if (o.loc == TileLocation::Implicit) continue;
      const Tile& t = tiles_[i];
      if (t.pending || t.pins > 0 || t.loc == TileLocation::Invalid) return false;
      steps.push_back({i, t.loc, o.loc, t.buffer});
    }
    if (steps.empty()) return true;
    hold = next_request_++ | kSumHold;
    for (const Step& st : steps) {
      tiles_[st.index].pending = hold;
      other.tiles_[st.index].pins++;
      held.push_back(st.index);
    }
    active_work_++;
    other.active_work_++;
  }
  // Ends the holds (with `publish` run under both locks first).
  auto end_holds = [&](const std::function<void()>& publish) {
    {
      std::scoped_lock lock(mutex_, other.mutex_);
      if (publish) publish();
      end_hold_locked(held, hold);
      for (int64_t i : held) other.tiles_[i].pins--;
      other.active_work_--;
      other.idle_cv_.notify_all();
    }
  };
  // First everything that can fail, with nothing visible changed: each step's new primary buffer (`out`), or,
  // for a resident native tile, the memory the contribution is added into below.
  const int64_t bytes = tile_size_ * static_cast<int64_t>(slot_bytes(dtype()));
  struct Result {
    CarrierPtr out;           // the tile's new primary buffer
    float* into = nullptr;    // or: added into this tile's buffer in place ...
    CarrierPtr theirs;        // ... from this one
  };
  std::vector<Result> results(steps.size());
  try {
    for (size_t k = 0; k < steps.size(); ++k) {
      const Step& st = steps[k];
      Result& r = results[k];
      CarrierPtr theirs = other.tile_value(st.index);
      if (st.here == TileLocation::Implicit) {
        if (share_other && st.theirs == TileLocation::Primary) {
          r.out = theirs;
        } else if (st.theirs == TileLocation::Primary) {
          r.out = primary_->allocate_like(tile_size_, true, dtype(), true);
          copy_slots(*theirs, 0, *r.out, 0, tile_size_);
        } else {
          r.out = theirs;  // already a fresh buffer read from other's secondary tier
        }
      } else if (st.here == TileLocation::Primary) {
        std::byte* d = st.mine->mutable_native_data();  // a copy-on-write happens here (Note [Shared snapshots])
        if (d && theirs->native_data()) {
          r.into = reinterpret_cast<float*>(d);
          r.theirs = std::move(theirs);
        } else {  // no native memory to add into in place: a new buffer replaces the tile's
          r.out = primary_->allocate_like(tile_size_, true, dtype(), true);
          copy_slots(*st.mine, 0, *r.out, 0, tile_size_);
          add_tile_into(*r.out, *theirs, tile_size_);
        }
      } else if (share_other && st.theirs == TileLocation::Primary && theirs->native_data()) {
        // Secondary here, a fresh gradient there: the secondary values are added into the fresh buffer, which
        // becomes the promoted tile (Note [Adding a secondary tile]).
        add_runs_into(*theirs, *secondary_, runs_[st.index]);
        r.out = theirs;
      } else {  // secondary: read back, then add
        r.out = primary_->allocate_like(tile_size_, true, dtype(), true);
        for (const Run& run : runs_[st.index]) copy_slots(*secondary_, run.offset, *r.out, run.ordinal, run.length);
        add_tile_into(*r.out, *theirs, tile_size_);
      }
    }
  } catch (...) {
    end_holds(nullptr);  // nothing was published; the buffers made above are dropped
    throw;
  }
  // The in-place additions: native memory, nothing left that can fail.
  for (const Result& r : results) {
    if (!r.into) continue;
    float* df = r.into;
    const float* sf = reinterpret_cast<const float*>(r.theirs->native_data());
    // Bound by memory bandwidth: a large tile (an expert's 4 MiB) is split over the cores.
    detail::parallel_for(tile_size_, int64_t{1} << 18, [df, sf](int64_t b, int64_t e) {
      for (int64_t k = b; k < e; ++k) df[k] += sf[k];
    });
  }
  std::vector<CarrierPtr> replaced;
  end_holds([&] {
    for (size_t k = 0; k < steps.size(); ++k) {
      const Step& st = steps[k];
      Result& r = results[k];
      Tile& t = tiles_[st.index];
      SW_ASSERT(t.loc == st.here && t.buffer == st.mine, "a held tile changed under its gradient sum");
      if (st.here == TileLocation::Secondary) {
        stats_.promotions++;
        stats_.bytes_promoted += bytes;
      }
      if (r.out) {
        if (t.buffer) replaced.push_back(std::move(t.buffer));
        t.buffer = std::move(r.out);
        if (t.loc != TileLocation::Primary) {
          stats_.primary_tiles++;
          stats_.primary_bytes += bytes;
        }
        // An implicit tile has no secondary copy; a read-back one keeps its (now stale) copy, as a replaced
        // resident one does.
        if (st.here == TileLocation::Implicit) t.secondary_valid = false;
        if (st.here == TileLocation::Secondary) t.secondary_valid = true;
        t.loc = TileLocation::Primary;
      }
      t.dirty = true;
    }
    bump_version();  // before the holds end: whoever reads the sum next sees the new version
  });
  for (auto& b : replaced) b->release();
  return true;
}

// ---------------------------------------------------------------- release

void TiledEvictable::check_releasable() const {
  std::lock_guard lock(mutex_);
  if (active_requests_ > 0 || active_work_ > 0)
    raise<RuntimeError>("TiledEvictable has incomplete work (", active_requests_, " residency request(s), ",
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
    idle_cv_.wait(lock, [&] { return active_requests_ == 0 && active_work_ == 0; });
    if (!named_file_.empty()) release_discards_.store(unsaved_tiles_locked());
    for (auto& t : tiles_) {
      if (t.buffer) buffers.push_back(std::move(t.buffer));
      t.loc = TileLocation::Invalid;
    }
    stats_.primary_tiles = 0;
    stats_.primary_bytes = 0;
  }
  for (auto& b : buffers) b->release();
  primary_claim_.end();
  secondary_claim_.end();
  primary_->release();
  secondary_->release();
}

}  // namespace sw

namespace sw {

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
