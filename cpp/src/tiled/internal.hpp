// tiled/internal.hpp — what the engine's tiled code shares and users never see: the request and work records of a
// TiledEvictable, the work token, the hooks the data paths and gradient sums use (TiledInternals), and a held tile
// write (a gradient sink). Included by cpp/src/tiled/*.cpp and by the C++ tests; never by a public header.
//
// Where each topic lives:
//   tile_geometry.cpp   TileGeometry: index/coordinate, locate, footprint runs, regions, selections, limits
//   tile_table.cpp      construction, fork safety, footprint checks, tile states, references
//   residency.cpp       residency requests: promote, evict, transfers, commit
//   slot_access.cpp     slot reads and writes, allocate_like
//   work.cpp            work requests (begin/end, WorkToken), tile buffers, installing tiles
//   gradient_sums.cpp   gradient sums: accumulate_tiles, held tile writes, add_tiled_gradients
//   durability.cpp      flush, release, dirty tiles discarded at release, collection and exit
//   tile_copies.cpp     copying one tile between a tile buffer and a dense region (gather, scatter, gradient)
//   projection.cpp      project and its autograd node
//   scatter.cpp         scatter and its autograd node
//   backend.cpp         the operation backend of TiledEvictable (direct operations)
#pragma once

#include <atomic>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <variant>
#include <vector>

#include "strideweave/errors.hpp"
#include "strideweave/fork.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace sw {

// "(1, 0)" (and "(3,)" for rank one), for messages.
std::string coord_str(const TileCoord& t);

// The message of the exception `e` holds, and an exception of `model`'s error kind (RuntimeError when it is not an
// engine error) carrying `message` (work.cpp).
std::string tiled_error_message(const std::exception_ptr& e);
std::exception_ptr tiled_error_like(const std::exception_ptr& model, std::string message);

// A residency transition of a set of tiles, committed all-or-nothing.
struct TiledEvictable::Request {
  uint64_t id = 0;
  bool promote = true;
  bool flush = false;                  // with promote false: write dirty tiles, sync, keep them resident
  std::vector<int64_t> tiles;          // tiles that need a transfer
  std::vector<CarrierPtr> staged;      // promotion: new buffers
  std::vector<char> wrote;             // eviction: a write happened
  bool write_behind = false;          // an eviction the budget handed to the I/O executor (write_behind.cpp)
  std::atomic<size_t> remaining{0};
  std::mutex m;
  std::exception_ptr error;
  CompletionPtr<std::monostate> done = std::make_shared<Completion<std::monostate>>();
  // Keeps the carrier alive while queued transfers run; let go of before `done` is set
  // (Note [Letting go before completing]). `owner_count` is the carrier's request_refs_, which counts it.
  std::shared_ptr<TiledEvictable> owner;
  std::shared_ptr<std::atomic<int64_t>> owner_count;
};

// A work request: its tiles are pinned from begin_work to end_work.
struct TiledEvictable::Work {
  std::string purpose;  // what the policy was told ("projection", ...), for messages
  std::vector<int64_t> tiles;
  ResidencyPlan plan;
  CompletionPtr<std::monostate> ready;
  bool ended = false;
  uint64_t generation = fork_generation();  // work begun before fork() has no pins in a child (Note [Fork safety])
};

// A work request's pins, ended exactly once, like Carrier::Claim: by end(), which returns the error the work must
// report, or else by the destructor (on every other path, errors included), which drops that error. Holds the
// carrier until the work ends. Move-only; share it through a std::shared_ptr.
class WorkToken {
 public:
  WorkToken() = default;
  WorkToken(std::shared_ptr<TiledEvictable> carrier, std::shared_ptr<TiledEvictable::Work> work)
      : carrier_(std::move(carrier)), work_(std::move(work)) {}
  WorkToken(WorkToken&& o) noexcept : carrier_(std::move(o.carrier_)), work_(std::move(o.work_)) {}
  WorkToken& operator=(WorkToken&& o) noexcept;
  WorkToken(const WorkToken&) = delete;
  WorkToken& operator=(const WorkToken&) = delete;
  ~WorkToken();
  explicit operator bool() const noexcept { return work_ != nullptr; }
  // The completion that is set once the work's tiles are readable.
  const CompletionPtr<std::monostate>& ready() const noexcept;
  // Unpins and applies the plan's deferred evictions, in this thread. Returns the error the work must report:
  // `work_error` (the work's own failure, or null), joined by a deferred eviction's failure, which the work's
  // handle reports with its cause (Note [A failed deferred eviction reaches the work]). Idempotent: a second call
  // returns `work_error` unchanged.
  [[nodiscard]] std::exception_ptr end(std::exception_ptr work_error = nullptr);

 private:
  friend struct TiledInternals;
  void end_quietly() noexcept;
  std::shared_ptr<TiledEvictable> carrier_;  // null once ended
  std::shared_ptr<TiledEvictable::Work> work_;
};

// An in-place write into one resident tile (a gradient sink: Note [Gradient sinks]). While it lives the tile is
// held (Note [Gradient sums hold their tiles]): requests, work, slot access and sums on it refuse with 'wait',
// and release waits. Destroying it without commit() ends the hold and leaves the tile as it was.
class TiledEvictable::TileWrite {
 public:
  TileWrite(const TileWrite&) = delete;
  TileWrite& operator=(const TileWrite&) = delete;
  ~TileWrite();
  // The tile's primary buffer, dense Float32 in within-tile order; write only while the hold lives.
  float* data() const noexcept { return data_; }
  // The tile was written: dirty, its secondary copy stale, the version advanced; then the hold ends.
  void commit();
  // The tile's value is zero from now on (a gradient consumed where it was made: Note [Stepping in backward] in
  // strideweave/optim.hpp): its buffer is let go unwritten (under a budget, its bytes stop counting), the tile
  // becomes an implicit zero (a stale secondary copy is never read back), the version advances; the hold ends.
  void commit_zero();

 private:
  friend class TiledEvictable;
  TileWrite(std::shared_ptr<TiledEvictable> owner, int64_t index, uint64_t hold, CarrierPtr buffer, float* data)
      : owner_(std::move(owner)), index_(index), hold_(hold), buffer_(std::move(buffer)), data_(data) {}
  std::shared_ptr<TiledEvictable> owner_;
  int64_t index_;
  uint64_t hold_;
  CarrierPtr buffer_;
  float* data_;
  bool ended_ = false;
};

// The engine's hooks into a TiledEvictable (data paths, gradient sums, tests); tiles are bound to the grid.
struct TiledInternals {
  using Work = TiledEvictable::Work;
  using TileWrite = TiledEvictable::TileWrite;

  // -------- work requests (projection, scatter, operations, backward)
  // Validates `tiles` against other callers' incomplete requests, asks the policy for a plan, pins the tiles and
  // promotes the missing ones as part of this request. The token's ready() is set once every required tile is
  // readable; ending the token unpins them.
  static WorkToken begin_work(const std::shared_ptr<TiledEvictable>& c, const std::vector<int64_t>& tiles,
                              const char* purpose);
  // Pins every tile for reading through tile_value, without asking the policy or changing residency (the operands
  // of a fresh gradient sum); ending the token unpins. RuntimeError (asking to wait) when a tile is under an
  // incomplete request or being added into, or is invalid; nothing is pinned then.
  static WorkToken pin_for_reading(const std::shared_ptr<TiledEvictable>& c);

  // -------- data-path access (tiles pinned by the caller's work)
  // The primary buffer of a resident tile, or nullptr for an implicit-zero tile.
  static CarrierPtr tile_buffer(const TiledEvictable& c, int64_t index) { return c.tile_buffer(index); }
  // Tile `index`'s value without changing residency: nullptr for an implicit zero, the primary buffer itself for a
  // resident tile (read it, never write it), or a fresh primary-kind buffer read from the secondary tier. The
  // caller holds a pin on the tile (pin_for_reading, begin_work), so nothing evicts or writes it meanwhile.
  // RuntimeError for an invalid tile or one a request or a sum is changing.
  static CarrierPtr tile_value(const TiledEvictable& c, int64_t index) { return c.tile_value(index); }
  // Publishes `buffers` (one full tile each, in within-tile order) as primary, dirty tiles in one commit and
  // advances the version once.
  static void install_tiles(TiledEvictable& c, const std::vector<std::pair<int64_t, CarrierPtr>>& buffers) {
    c.install_tiles(buffers);
  }

  // -------- gradient accumulation (Note [Tiled gradient accumulation], Note [Gradient sums hold their tiles])
  // c += other, tile by tile and in place, for a gradient that only the caller is meant to observe (the caller
  // checks that). `other` must have c's geometry and be read with the same offset and Layout, so tile i of both
  // holds the same logical values in the same order; its dtype is c's, or any float dtype when c's is (a Float32
  // gradient into a 16-bit .grad: widened, added in Float32, rounded once into c's dtype). Implicit tiles of `other` cost nothing; an implicit
  // tile of c takes `other`'s value (its buffer itself when `share_other`, i.e. `other` is a fresh gradient about
  // to be dropped); a secondary tile of c is read back and added to. The tiles written are held for the whole sum
  // and `other`'s tiles pinned, so the sum lands whole or not at all. Returns false, changing nothing, when a tile
  // is invalid, pinned or under an incomplete request or another sum; otherwise advances the version once when
  // anything was added. An error (reading a secondary tile) changes nothing. Under a residency budget, room for the
  // tiles that become resident is made first (evictions of other tiles; RuntimeError when none can be made).
  static bool accumulate_tiles(TiledEvictable& c, TiledEvictable& other, bool share_other) {
    return c.accumulate_tiles(other, share_other);
  }
  // Holds tile `index` for an in-place write when it is resident in native memory, unpinned and under no request
  // or other sum; else nullptr, changing nothing. The carrier must be held by a std::shared_ptr.
  static std::unique_ptr<TileWrite> hold_tile_for_update(TiledEvictable& c, int64_t index) {
    return c.hold_tile_for_update(index);
  }
  // hold_tile_for_update of a tile promoted first, waiting in turn (Note [Taking turns]) for other work to let go
  // of it: a hold, or nullptr when the resident tile is not in native memory; RuntimeError naming `what` after the
  // wait limit, nothing changed.
  static std::unique_ptr<TileWrite> hold_in_turn(TiledEvictable& c, int64_t index, const char* what) {
    return c.hold_in_turn(index, what);
  }
  // Whether `self` (a reference to c) is the only one apart from those its own incomplete residency requests hold
  // while their transfers run: then nobody else can observe or change its tiles, and a gradient sum may add into
  // tiles no request is transitioning (Note [Requests' own references]).
  static bool only_reference_is(const TiledEvictable& c, const CarrierPtr& self) { return c.only_reference_is(self); }

  // -------- optimizer state (cpp/src/optim; Note [Optimizers on tiled parameters] in strideweave/optim.hpp)
  // A fresh carrier (empty tiers, every tile invalid, no request or work yet) whose tiles all become implicit zeros.
  static void make_implicit_zeros(TiledEvictable& c) {
    std::lock_guard lock(c.mutex_);
    for (auto& t : c.tiles_) {
      SW_ASSERT(t.loc == TileLocation::Invalid && !t.pending && t.pins == 0,
                "make_implicit_zeros of a carrier in use");
      t.loc = TileLocation::Implicit;
    }
  }
};

// Live carriers whose secondary tier is a named file, for the report at interpreter exit
// (Note [Dirty tiles are never discarded silently]). Never destroyed: carriers may outlive static destruction.
// Defined in durability.cpp.
struct NamedFileCarriers {
  std::mutex m;
  std::vector<TiledEvictable*> live;
};
NamedFileCarriers& named_file_carriers();
TiledEvictable::DiscardReporter discard_reporter() noexcept;

// -------- tiled gradients of 16-bit parameters (gradient_dtypes.cpp; Note [Tiled gradients of 16-bit parameters])
// The dtype of a fresh tiled gradient of a `param` carrier from a `cotangent` of that dtype: Float32 for a 16-bit
// parameter and a Float32 cotangent (summed in Float32, rounded once at the leaf), else the parameter's.
const DType& tiled_gradient_dtype(const DType& param, const DType& cotangent);
// A tile buffer's n values widened to Float32 (exact), and n Float32 values stored into one (rounded once, nearest
// even, for a 16-bit buffer). Float32, BFloat16 and Float16 buffers.
void load_floats(const Carrier& buf, int64_t n, float* out);
void store_floats(Carrier& buf, int64_t n, const float* in);
// A tiled gradient `g` with its values in `dtype` (rounded once), tile by tile into a fresh carrier of g's geometry,
// offset and Layout; implicit tiles stay implicit. `g` itself when it already has that dtype.
TensorPtr convert_tiled_gradient(const TensorPtr& g, const DType& dtype);

}  // namespace sw
