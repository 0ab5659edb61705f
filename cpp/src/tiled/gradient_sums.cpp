// Gradient sums over TiledEvictable tiles (Note [Tiled gradient accumulation], data.hpp): in-place
// accumulation into a leaf's .grad (accumulate_tiles), a held tile write for a gradient sink, and a fresh sum of two
// tiled gradients (add_tiled_gradients). Every tile a sum touches is held (Note [Gradient sums hold their tiles]).
#include <algorithm>
#include <functional>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/tiled/data.hpp"
#include "internal.hpp"
#include "../ops/strided.hpp"

namespace sw {

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
void add_runs_into(Carrier& dst, const Carrier& src, const FootprintRuns& runs) {
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
  work->tiles.resize(static_cast<size_t>(tile_count()));
  for (int64_t i = 0; i < tile_count(); ++i) work->tiles[static_cast<size_t>(i)] = i;
  std::unique_lock lock(mutex_);
  check_live("read its tiles");  // under the lock: Note [Release races with requests]
  settle_write_behind(lock, {}, /*all=*/true);  // Note [Write-behind evictions]
  for (int64_t i = 0; i < tile_count(); ++i) {
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
  CarrierPtr buf = primary_->allocate_like(tile_size(), true, dtype(), true);
  for (const Run& run : geometry_.footprint_runs(index))
    copy_slots(*secondary_, run.offset, *buf, run.ordinal, run.length);
  return buf;
}

std::unique_ptr<TiledEvictable::TileWrite> TiledEvictable::hold_tile_for_update(int64_t index) {
  auto self = std::static_pointer_cast<TiledEvictable>(weak_from_this().lock());
  if (!self) return nullptr;
  // Made before the hold is taken, so that once taken only its destructor ends it.
  std::unique_ptr<TileWrite> write(new TileWrite(self, index, 0, nullptr, nullptr));
  {
    std::unique_lock lock(mutex_);
    if (is_released()) return nullptr;
    settle_write_behind(lock, {&index, 1});  // Note [Write-behind evictions]
    Tile& t = tiles_[index];
    if (t.loc != TileLocation::Primary || t.pending || t.pins > 0 || !t.buffer || !t.buffer->native_data())
      return nullptr;
    write->hold_ = next_request_++ | kSumHold;
    t.pending = write->hold_;
    active_work_++;
    write->buffer_ = t.buffer;
    if (budget_) budget_->touch(*this, {&index, 1});
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
  SW_ASSERT(&other != this && other.geometry_ == geometry_, "accumulate_tiles over a different geometry");
  if (!dtype().is_floating() || !other.dtype().is_floating() || is_released() || other.is_released() ||
      !is_mutable())
    return false;
  // Float32 into Float32 adds in place below; any other pair of float dtypes (a Float32 gradient into a 16-bit
  // .grad, Note [Tiled gradients of 16-bit parameters]) widens both, adds in Float32 and rounds once into a new
  // buffer of this carrier's dtype.
  const bool widen = dtype().id() != DTypeId::Float32 || other.dtype().id() != DTypeId::Float32;
  const bool same_dtype = dtype() == other.dtype();
  // Plan under both locks: which tiles contribute and what each does here; hold them (Note [Gradient sums hold
  // their tiles]): ours for writing, `other`'s for reading.
  struct Step {
    int64_t index;
    TileLocation here, theirs;
    CarrierPtr mine;
  };
  // Write-behinds of the tiles the sum touches (those `other` holds a value for), on either side, are taken back or
  // waited for first (Note [Write-behind evictions]); the room made below never queues them again (it spares
  // `other` and keeps the tiles touched here).
  {
    std::vector<int64_t> summed;
    {
      std::lock_guard lock(other.mutex_);
      for (int64_t i = 0; i < tile_count(); ++i)
        if (other.tiles_[i].loc != TileLocation::Implicit && other.tiles_[i].loc != TileLocation::Invalid)
          summed.push_back(i);
    }
    settle_write_behind(summed);
    other.settle_write_behind(summed);
  }
  // Under a budget, room first for the tiles that become resident here (Note [One residency budget]): an implicit
  // or secondary tile that does not take `other`'s buffer as it is (that buffer moves, counted once). `other`'s
  // tiles, about to be read, are never evicted for it.
  if (budget_) {
    std::vector<int64_t> touched;
    int64_t fresh = 0;
    {
      std::scoped_lock lock(mutex_, other.mutex_);
      for (int64_t i = 0; i < tile_count(); ++i) {
        const Tile& o = other.tiles_[i];
        if (o.loc == TileLocation::Implicit || o.loc == TileLocation::Invalid) continue;
        const Tile& t = tiles_[i];
        touched.push_back(i);
        if (t.loc == TileLocation::Primary) continue;
        const bool moves = share_other && o.loc == TileLocation::Primary &&
                           (t.loc == TileLocation::Implicit ? same_dtype
                                                            : !widen && o.buffer && o.buffer->native_data());
        if (!moves) fresh++;
      }
    }
    if (fresh > 0) budget_->make_room(*this, touched, fresh * tile_bytes(), "gradient sum", &other);
  }
  std::vector<Step> steps;
  std::vector<int64_t> held;
  uint64_t hold = 0;
  {
    std::scoped_lock lock(mutex_, other.mutex_);
    if (is_released() || other.is_released()) return false;  // Note [Release races with requests]
    for (int64_t i = 0; i < tile_count(); ++i) {
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
  const int64_t bytes = tile_size() * static_cast<int64_t>(slot_bytes(dtype()));
  struct Result {
    CarrierPtr out;           // the tile's new primary buffer
    bool moved = false;       // `out` is other's resident buffer itself (counted once under a budget)
    float* into = nullptr;    // or: added into this tile's buffer in place ...
    CarrierPtr theirs;        // ... from this one
  };
  std::vector<Result> results(steps.size());
  try {
    std::vector<float> mine, add;
    if (widen) mine.resize(static_cast<size_t>(tile_size())), add.resize(static_cast<size_t>(tile_size()));
    for (size_t k = 0; k < steps.size(); ++k) {
      const Step& st = steps[k];
      Result& r = results[k];
      CarrierPtr theirs = other.tile_value(st.index);
      if (widen && !(same_dtype && share_other && st.here == TileLocation::Implicit &&
                     st.theirs == TileLocation::Primary)) {
        const int64_t n = tile_size();
        if (st.here == TileLocation::Implicit) {
          std::fill(mine.begin(), mine.end(), 0.0f);
        } else if (st.here == TileLocation::Primary) {
          load_floats(*st.mine, n, mine.data());
        } else {  // secondary: read back
          CarrierPtr back = primary_->allocate_like(n, true, dtype(), true);
          for (const Run& run : geometry_.footprint_runs(st.index))
            copy_slots(*secondary_, run.offset, *back, run.ordinal, run.length);
          load_floats(*back, n, mine.data());
        }
        load_floats(*theirs, n, add.data());
        for (int64_t j = 0; j < n; ++j) mine[j] += add[j];
        r.out = primary_->allocate_like(n, true, dtype(), true);
        store_floats(*r.out, n, mine.data());  // one rounding per slot
        continue;
      }
      if (st.here == TileLocation::Implicit) {
        if (share_other && st.theirs == TileLocation::Primary) {
          r.out = theirs;
          r.moved = true;
        } else if (st.theirs == TileLocation::Primary) {
          r.out = primary_->allocate_like(tile_size(), true, dtype(), true);
          copy_slots(*theirs, 0, *r.out, 0, tile_size());
        } else {
          r.out = theirs;  // already a fresh buffer read from other's secondary tier
        }
      } else if (st.here == TileLocation::Primary) {
        std::byte* d = st.mine->mutable_native_data();  // a copy-on-write happens here (Note [Shared snapshots])
        if (d && theirs->native_data()) {
          r.into = reinterpret_cast<float*>(d);
          r.theirs = std::move(theirs);
        } else {  // no native memory to add into in place: a new buffer replaces the tile's
          r.out = primary_->allocate_like(tile_size(), true, dtype(), true);
          copy_slots(*st.mine, 0, *r.out, 0, tile_size());
          add_tile_into(*r.out, *theirs, tile_size());
        }
      } else if (share_other && st.theirs == TileLocation::Primary && theirs->native_data()) {
        // Secondary here, a fresh gradient there: the secondary values are added into the fresh buffer, which
        // becomes the promoted tile (Note [Adding a secondary tile]).
        add_runs_into(*theirs, *secondary_, geometry_.footprint_runs(st.index));
        r.out = theirs;
        r.moved = true;
      } else {  // secondary: read back, then add
        r.out = primary_->allocate_like(tile_size(), true, dtype(), true);
        for (const Run& run : geometry_.footprint_runs(st.index))
          copy_slots(*secondary_, run.offset, *r.out, run.ordinal, run.length);
        add_tile_into(*r.out, *theirs, tile_size());
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
    detail::parallel_for(tile_size(), int64_t{1} << 18, [df, sf](int64_t b, int64_t e) {
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
      if (budget_ || other.budget_) {  // Note [One residency budget]
        if (r.moved && other.budget_) other.budget_->evicted(other, st.index);
        if (budget_) budget_->resident(*this, st.index, bytes);  // counted, or made most recent
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

// ---------------------------------------------------------------- fresh sums of two tiled gradients

bool tiled_gradients_compatible(const TensorPtr& a, const TensorPtr& b) {
  auto ca = std::dynamic_pointer_cast<TiledEvictable>(a->carrier);
  auto cb = std::dynamic_pointer_cast<TiledEvictable>(b->carrier);
  if (!ca || !cb || ca == cb) return false;
  // Float32 with Float32, or a 16-bit gradient with one of its dtype or a Float32 one (Note [Tiled gradients of
  // 16-bit parameters]).
  auto float_like = [](const DType& d) { return d.id() == DTypeId::Float32 || d.is_half(); };
  if (!(ca->geometry() == cb->geometry()) || !float_like(ca->dtype()) || !float_like(cb->dtype())) return false;
  if (ca->dtype() != cb->dtype() && ca->dtype().is_half() && cb->dtype().is_half()) return false;
  if (a->offset != b->offset || !(a->layout == b->layout)) return false;
  if (ca->is_released() || cb->is_released()) return false;
  // One check covers both: footprints are a function of the geometry, the layout and the offset, equal here. `a`
  // (the accumulating .grad) has its answer cached after the first sum; `b`, a fresh gradient, never has, and its
  // check would be a pass over the whole extent per sum for a non-canonical layout (row-major tiles, say).
  try {
    ca->check_footprints(*a);
  } catch (const ValueError&) {
    return false;
  }
  return true;
}

TensorPtr add_tiled_gradients(const TensorPtr& a, const TensorPtr& b) {
  auto ca = std::static_pointer_cast<TiledEvictable>(a->carrier);
  auto cb = std::static_pointer_cast<TiledEvictable>(b->carrier);
  // Another thread may hold either operand (a .grad it read) and move its tiles: both are pinned while read, and
  // unpinned when the tokens go (a reading pin plans no eviction: ending it has nothing to report).
  // Note [Gradient sums hold their tiles].
  const WorkToken pin_a = TiledInternals::pin_for_reading(ca), pin_b = TiledInternals::pin_for_reading(cb);
  // The sum's dtype: Float32 when either is (a 16-bit gradient with a Float32 one), else the operands' (Note
  // [Tiled gradients of 16-bit parameters]).
  const DType& dtype = ca->dtype().id() == DTypeId::Float32 ? ca->dtype() : cb->dtype();
  auto fresh = std::static_pointer_cast<TiledEvictable>(ca->allocate_like(ca->size(), true, dtype, false));
  const int64_t n = ca->tile_size();
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  const bool widen = ca->dtype().id() != DTypeId::Float32 || cb->dtype().id() != DTypeId::Float32;
  std::vector<float> sum, add;
  if (widen) sum.resize(static_cast<size_t>(n)), add.resize(static_cast<size_t>(n));
  for (int64_t i = 0; i < ca->tile_count(); ++i) {
    CarrierPtr va = TiledInternals::tile_value(*ca, i), vb = TiledInternals::tile_value(*cb, i);
    if (!va && !vb) continue;  // implicit + implicit stays implicit
    if (widen) {  // widened, added in Float32, rounded once into the sum's dtype
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (const CarrierPtr& v : {va, vb}) {
        if (!v) continue;
        load_floats(*v, n, add.data());
        for (int64_t k = 0; k < n; ++k) sum[k] += add[k];
      }
      CarrierPtr out = fresh->primary()->allocate_like(n, true, dtype, /*empty=*/true);
      store_floats(*out, n, sum.data());
      tiles.emplace_back(i, std::move(out));
      continue;
    }
    CarrierPtr out = fresh->primary()->allocate_like(n, true, fresh->dtype(), /*empty=*/true);
    const CarrierPtr& first = va ? va : vb;
    copy_slots(*first, 0, *out, 0, n);
    if (va && vb) {
      float* d = reinterpret_cast<float*>(out->mutable_native_data());
      std::vector<float> other(static_cast<size_t>(n)), mine;
      vb->read_slots(0, n, other.data());
      if (!d) {
        mine.resize(static_cast<size_t>(n));
        out->read_slots(0, n, mine.data());
        d = mine.data();
      }
      for (int64_t k = 0; k < n; ++k) d[k] += other[k];
      if (!mine.empty()) out->write_slots(0, n, mine.data());
    }
    tiles.emplace_back(i, std::move(out));
  }
  if (!tiles.empty()) TiledInternals::install_tiles(*fresh, tiles);
  return make_tensor(fresh, a->offset, a->layout);
}

}  // namespace sw
