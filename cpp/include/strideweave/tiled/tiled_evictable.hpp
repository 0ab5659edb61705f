// strideweave/tiled/tiled_evictable.hpp — one flat logical extent, tiled and tiered.
//
// A TiledEvictable carrier holds prod(grid) * prod(tile) slots. Slot s is the
// logical coordinate c = decode(s) over logical_shape (grid times tile, per
// axis, first axis fastest); its tile is c / tile and its within-tile
// coordinate c % tile. Each tile is independently
//   primary   resident in its own buffer of the primary tier's kind (dirty when
//             the secondary copy is stale),
//   secondary valid only in the secondary tier (one carrier holding the full
//             extent in slot order: a tile is the runs of its footprint),
//   implicit  a valid implicit zero with no storage, or
//   invalid   no value yet.
// Residency transitions (promote/evict) are asynchronous requests: each
// validates its whole tile set, marks the tiles pending, runs one transfer
// per tile on the I/O executor and commits all-or-nothing under the tile
// table's mutex. A clean tile whose secondary copy is valid is evicted without
// writing. Work that needs tiles pins them; pinned tiles are never evicted. A
// gradient sum holds the tiles it writes in place, and everything else refuses
// them meanwhile (Note [Gradient sums hold their tiles]).
// Residency never changes the carrier's version.
//
// Thread-safety: the tile table is guarded by one mutex, never held while
// doing I/O or calling the residency policy.
#pragma once

#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <variant>
#include <string>
#include <vector>

#include "strideweave/carrier.hpp"
#include "strideweave/completion.hpp"
#include "strideweave/fork.hpp"
#include "strideweave/tensor.hpp"

namespace sw {

using TileCoord = std::vector<int64_t>;

enum class TileLocation : uint8_t { Primary, Secondary, Implicit, Invalid };
const char* location_name(TileLocation loc);

struct TileState {
  TileLocation location;
  bool valid;
  bool dirty;
};

struct ResidencyPlan {
  std::vector<TileCoord> promote, retain, evict;
};

// The residency policy (implemented by the bindings over a Python object).
class ResidencyPolicy {
 public:
  virtual ~ResidencyPolicy() = default;
  // `purpose` is "operation", "projection", "scatter" or "backward".
  virtual ResidencyPlan plan(const std::vector<TileCoord>& required, const char* purpose) = 0;
};

struct TiledStats {
  int64_t promotions = 0, evictions = 0;
  int64_t bytes_promoted = 0, bytes_evicted = 0;
  int64_t writes_skipped = 0;
  int64_t primary_tiles = 0, primary_bytes = 0;
  int64_t flushes = 0, bytes_flushed = 0;  // tiles a flush wrote and marked clean (they stay resident)
};

const CarrierKind& tiled_evictable_kind();

class TiledEvictable final : public DependentCarrier {
 public:
  // Validation order (docs/guide.md, "TiledEvictable"): tiers are non-dependent (any storage
  // kind, user kinds included), distinct, live, unowned carriers of one dtype; grid and tile shapes have one rank
  // and positive extents; the extent is at most 2**62, the tile table at most
  // kMaxTiles tiles and kMaxRuns footprint runs (ValueError, before anything
  // is allocated: Note [Tile table limits]); each tier has 0 slots or the full
  // extent. Claims taken here are rolled back on failure.
  TiledEvictable(CarrierPtr primary, CarrierPtr secondary, std::vector<int64_t> grid, std::vector<int64_t> tile,
                 std::shared_ptr<ResidencyPolicy> policy, bool is_mutable = true);
  ~TiledEvictable() override;

  static constexpr int64_t kMaxTiles = int64_t{1} << 24;
  static constexpr int64_t kMaxRuns = int64_t{1} << 26;

  // -------- geometry
  const std::vector<int64_t>& grid_shape() const noexcept { return grid_; }
  const std::vector<int64_t>& tile_shape() const noexcept { return tile_; }
  const std::vector<int64_t>& logical_shape() const noexcept { return logical_; }
  int64_t tile_count() const noexcept { return tile_count_; }
  int64_t tile_size() const noexcept { return tile_size_; }
  int64_t size() const override { return total_; }
  size_t rank() const noexcept { return grid_.size(); }
  int64_t tile_index(const TileCoord& t) const;  // ValueError when out of grid
  TileCoord tile_coord(int64_t index) const;
  // Slot s -> (tile index, within-tile ordinal).
  std::pair<int64_t, int64_t> locate(int64_t slot) const;
  // The footprint of tile `index` in slot space as contiguous runs
  // (ordinal = within-tile ordinal).
  const std::vector<Run>& footprint_runs(int64_t index) const;

  const CarrierPtr& primary() const noexcept { return primary_; }
  const CarrierPtr& secondary() const noexcept { return secondary_; }
  const std::shared_ptr<ResidencyPolicy>& policy() const noexcept { return policy_; }

  // -------- footprints
  // ValueError ("tile footprints") unless `tensor` is tile-footprint compatible.
  void check_footprints(const TensorImpl& tensor) const;

  // -------- tile states
  TileState tile_state(const TileCoord& t) const;
  std::vector<TileCoord> tiles_where(const std::function<bool(const TileState&)>& pred) const;
  TiledStats stats() const;

  // -------- residency requests (tile indices already bound to the grid)
  // Asynchronous forms need the carrier to be held by a std::shared_ptr.
  CompletionPtr<std::monostate> promote_async(const std::vector<int64_t>& tiles);
  // A tile that must be written (dirty, or its secondary copy not valid) is refused before anything changes when
  // the secondary tier is read-only (Note [A read-only secondary tier]).
  CompletionPtr<std::monostate> evict_async(const std::vector<int64_t>& tiles);
  // Writes every dirty tile to the secondary tier, makes the secondary durable (Carrier::flush: fsync of its file
  // or device) and marks the tiles clean; they stay resident. Refused like other requests while any tile has an
  // incomplete residency request ("wait"), and before anything changes when dirty tiles meet a read-only secondary.
  // All-or-nothing: a failed write or fsync leaves every tile dirty and resident (Note [Flushing tiles]).
  CompletionPtr<std::monostate> flush_async();
  // Blocking flush_async(), run in the calling thread.
  void flush() override;
  bool has_incomplete_work() const;
  // Whether `self` (a reference to this carrier) is the only one apart from
  // those its own incomplete residency requests hold while their transfers
  // run: then nobody else can observe or change its tiles, and a gradient sum
  // may add into tiles no request is transitioning (Note [Requests' own
  // references]).
  bool only_reference_is(const CarrierPtr& self) const;

  // -------- data access
  void read_slots(int64_t start, int64_t count, void* out) const override;
  void write_slots(int64_t start, int64_t count, const void* in) override;
  Value read_value(int64_t slot) const override;
  void write_value(int64_t slot, const Value& value) override;
  bool supports_storage_dtype(const DType& dtype) const override;
  bool can_grow() const override { return false; }
  bool allows_elementwise_fallback() const override { return false; }
  // Same geometry, tier kinds and policy; zero-filled means implicit-zero
  // tiles, `empty` invalid ones (`slots` must be 0 or the full extent).
  CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const override;

  // -------- work requests (projection, scatter, operations, backward)
  struct Work;
  // Validates `tiles` against other callers' incomplete requests, asks the
  // policy for a plan, pins the tiles and promotes the missing ones as part of
  // this request. The completion is set once every required tile is readable.
  std::shared_ptr<Work> begin_work(const std::vector<int64_t>& tiles, const char* purpose);
  // Unpins and applies the plan's deferred evictions, in this thread. Returns the error the work must report:
  // `work_error` (the work's own failure, or null), joined by a deferred eviction's failure, which the work's
  // handle reports with its cause (Note [A failed deferred eviction reaches the work]). Idempotent: a second call
  // returns `work_error` unchanged.
  [[nodiscard]] std::exception_ptr end_work(const std::shared_ptr<Work>& work, std::exception_ptr work_error = nullptr);
  // The completion that is set once `work`'s tiles are readable.
  static CompletionPtr<std::monostate> work_ready(const std::shared_ptr<Work>& work);

  // -------- data-path access (engine code; tiles pinned by the caller's work)
  // The primary buffer of a resident tile, or nullptr for an implicit-zero tile.
  CarrierPtr tile_buffer(int64_t index) const;
  // Publishes `buffers` (one full tile each, in within-tile order) as primary,
  // dirty tiles in one commit and advances the version once.
  void install_tiles(const std::vector<std::pair<int64_t, CarrierPtr>>& buffers);
  // Marks every tile a valid implicit zero (fresh carriers: gradients).
  void make_all_implicit();

  // -------- gradient accumulation (engine code: autograd's tiled gradient sums)
  // Every tile a gradient sum reads or writes is held while it does (Note [Gradient sums hold their tiles]).
  //
  // Pins every tile for reading through tile_value, without asking the policy or changing residency (the operands
  // of a fresh gradient sum); end_work unpins. RuntimeError (asking to wait) when a tile is under an incomplete
  // request or being added into, or is invalid; nothing is pinned then.
  std::shared_ptr<Work> pin_for_reading();
  // Tile `index`'s value without changing residency: nullptr for an implicit zero, the primary buffer itself for a
  // resident tile (read it, never write it), or a fresh primary-kind buffer read from the secondary tier. The
  // caller holds a pin on the tile (pin_for_reading, begin_work), so nothing evicts or writes it meanwhile.
  // RuntimeError for an invalid tile or one a request or a sum is changing.
  CarrierPtr tile_value(int64_t index) const;
  // this += other, tile by tile and in place, for a gradient that only the caller is meant to observe (the caller
  // checks that). `other` must have this carrier's geometry and dtype and be read with the same offset and Layout,
  // so tile i of both holds the same logical values in the same order. Implicit tiles of `other` cost nothing; an
  // implicit tile here takes `other`'s value (its buffer itself when `share_other`, i.e. `other` is a fresh
  // gradient about to be dropped); a secondary tile here is read back and added to. The tiles written are held
  // for the whole sum and `other`'s tiles pinned, so the sum lands whole or not at all. Returns false, changing
  // nothing, when a tile is invalid, pinned or under an incomplete request or another sum; otherwise advances the
  // version once when anything was added. An error (reading a secondary tile) changes nothing.
  bool accumulate_tiles(TiledEvictable& other, bool share_other);

  // An in-place write into one resident tile (a gradient sink: Note [Gradient sinks]). While it lives the tile is
  // held (Note [Gradient sums hold their tiles]): requests, work, slot access and sums on it refuse with 'wait',
  // and release waits. Destroying it without commit() ends the hold and leaves the tile as it was.
  class TileWrite {
   public:
    TileWrite(const TileWrite&) = delete;
    TileWrite& operator=(const TileWrite&) = delete;
    ~TileWrite();
    // The tile's primary buffer, dense Float32 in within-tile order; write only while the hold lives.
    float* data() const noexcept { return data_; }
    // The tile was written: dirty, its secondary copy stale, the version advanced; then the hold ends.
    void commit();

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
  // Holds tile `index` for an in-place write when it is resident in native memory, unpinned and under no request
  // or other sum; else nullptr, changing nothing. The carrier must be held by a std::shared_ptr.
  std::unique_ptr<TileWrite> hold_tile_for_update(int64_t index);

  // -------- dirty tiles that would be discarded (Note [Dirty tiles are never discarded silently])
  // Whether the secondary tier is a file the user named (FileBacked with a filename): only then does discarding a
  // dirty tile lose values the user expects in a file.
  bool secondary_is_named_file() const noexcept { return !named_file_.empty(); }
  // After release(): the warning for the dirty tiles that release discarded (empty when none, when the secondary
  // is not a named file, or when already taken). Taken once.
  std::string take_release_discard_warning();
  // The warning for a carrier of a named file still holding dirty tiles at interpreter exit, one per such live,
  // unreleased carrier; each is reported once (its destructor then stays silent).
  static std::vector<std::string> exit_discard_warnings();
  // Called by the destructor of an unreleased carrier of a named file that still holds dirty tiles (and was not
  // reported at exit) with its warning; installed by the language binding. Must not throw.
  using DiscardReporter = void (*)(const std::string& warning) noexcept;
  static void set_discard_reporter(DiscardReporter reporter) noexcept;

 protected:
  void do_release() override;
  void check_releasable() const override;

 private:
  struct Tile {
    TileLocation loc = TileLocation::Invalid;
    bool dirty = false;
    bool secondary_valid = false;
    CarrierPtr buffer;      // primary storage when resident
    int pins = 0;
    uint64_t pending = 0;   // id of the incomplete residency request transitioning it, or of the sum holding it
                            // (kSumHold set: Note [Gradient sums hold their tiles])
  };
  struct Request;
  // Runs the request's transfers on the I/O executor, or in this thread when `inline_`.
  void start_request(const std::shared_ptr<Request>& r, bool inline_ = false);
  CompletionPtr<std::monostate> promote_tiles(const std::vector<int64_t>& tiles, bool inline_);
  CompletionPtr<std::monostate> evict_tiles(const std::vector<int64_t>& tiles, bool inline_);
  CompletionPtr<std::monostate> flush_tiles(bool inline_);
  // Under mutex_: validates an eviction of `tiles` and marks those that need a transfer pending for `r` (left
  // empty when none does). `deferred` (a policy's eviction after work): tiles that are pinned, pending or not
  // resident are left out instead of refused.
  void prepare_eviction(std::vector<int64_t> tiles, Request& r, bool deferred);
  // Under mutex_: RuntimeError, naming the tiles and the tier, when some of `tiles` must be written and the
  // secondary tier is read-only (Note [A read-only secondary tier]).
  void check_secondary_writable(const std::vector<int64_t>& tiles, const char* what) const;
  std::string secondary_description() const;
  // "tiles (0,), (1,)" (at most eight named), with `adjective` before "tile(s)", for messages.
  std::string tile_list(const std::vector<int64_t>& tiles, const char* adjective) const;
  void finish_tile(const std::shared_ptr<Request>& r, size_t k, CarrierPtr buffer, std::exception_ptr error);
  // After every transfer of `r`: a flush makes the secondary durable, then commit.
  void complete(const std::shared_ptr<Request>& r);
  void commit(const std::shared_ptr<Request>& r);
  int64_t unsaved_tiles_locked() const;  // dirty primary tiles (under mutex_)
  std::string discard_warning(int64_t tiles, const char* when) const;
  // Blocking promotion of one tile for slot access (lock held by caller is released inside).
  const Tile& readable_tile(int64_t index, std::unique_lock<std::mutex>& lock) const;
  void ensure_secondary_storage();
  void check_table_size() const;  // Note [Tile table limits]
  [[noreturn]] void pending_conflict(int64_t index, const char* what) const;
  // Ends a sum's hold `hold` on `tiles` (lock held by the caller); Note [Gradient sums hold their tiles].
  void end_hold_locked(std::span<const int64_t> tiles, uint64_t hold);
  // Tile::pending of a tile a gradient sum holds: the sum's id with this bit set (never a request's id).
  static constexpr uint64_t kSumHold = uint64_t{1} << 63;
  // Note [Fork safety] (fork.hpp): every live tile table is locked across fork(); in the child, the requests
  // and work in flight are forgotten.
  void register_for_fork();
  void unregister_for_fork() noexcept;
  static void lock_tile_tables();
  static void unlock_tile_tables();
  static void restart_tile_tables_in_child();

  std::vector<int64_t> grid_, tile_, logical_;
  int64_t tile_count_ = 0, tile_size_ = 0, total_ = 0;
  std::vector<int64_t> slot_stride_;  // dense strides of logical_shape
  std::vector<std::vector<Run>> runs_;
  CarrierPtr primary_, secondary_;
  Claim primary_claim_, secondary_claim_;
  std::shared_ptr<ResidencyPolicy> policy_;

  mutable std::mutex mutex_;
  mutable std::vector<Tile> tiles_;
  mutable TiledStats stats_;
  uint64_t next_request_ = 1;
  int active_requests_ = 0;
  int active_work_ = 0;
  // References to this carrier that queued requests hold (Request::owner); shared with them, so a request
  // can uncount its reference after dropping it (Note [Requests' own references]).
  std::shared_ptr<std::atomic<int64_t>> request_refs_ = std::make_shared<std::atomic<int64_t>>(0);
  std::condition_variable idle_cv_;  // notified when active_requests_ or active_work_ drops
  // The secondary tier's file name when the user named it (empty otherwise), and what release() discarded
  // (Note [Dirty tiles are never discarded silently]).
  std::string named_file_;
  std::atomic<int64_t> release_discards_{0};
  std::atomic<bool> exit_reported_{false};
  mutable std::mutex footprint_cache_mutex_;
  mutable std::vector<std::pair<Layout, int64_t>> footprint_cache_;  // compatible (layout, offset) pairs
  TiledEvictable* fork_prev_ = nullptr;  // the list of live tile tables (register_for_fork)
  TiledEvictable* fork_next_ = nullptr;
};

}  // namespace sw
