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
// Geometry is a TileGeometry value (tile_geometry.hpp). Engine code (the data paths, gradient sums) reaches the
// work and tile-buffer hooks through TiledInternals (cpp/src/tiled/internal.hpp); this header is the user contract.
//
// Thread-safety: the tile table is guarded by one mutex, never held while
// doing I/O or calling the residency policy. Methods marked "Blocks:" may wait
// (for that mutex, for I/O, or for running work); the others never do.
#pragma once

#include <atomic>
#include <condition_variable>
#include <deque>
#include <functional>
#include <list>
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
#include "strideweave/tiled/gradient_hook.hpp"
#include "strideweave/tiled/residency_budget.hpp"
#include "strideweave/tiled/tile_geometry.hpp"

namespace sw {

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

struct TiledInternals;  // the engine's hooks (cpp/src/tiled/internal.hpp)
class WorkToken;

class TiledEvictable final : public DependentCarrier {
 public:
  // Validation order (docs/guide.md, "TiledEvictable"): tiers are non-dependent (any storage
  // kind, user kinds included), distinct, live, unowned carriers of one dtype; grid and tile shapes have one rank
  // and positive extents; the extent is at most 2**62, the tile table at most
  // kMaxTiles tiles and kMaxRuns footprint runs (ValueError, before anything
  // is allocated: Note [Tile table limits]); each tier has 0 slots or the full
  // extent. Claims taken here are rolled back on failure.
  // Blocks: copies a full primary tier into tile buffers (I/O when the tier is a file); takes the registries' locks.
  TiledEvictable(CarrierPtr primary, CarrierPtr secondary, std::vector<int64_t> grid, std::vector<int64_t> tile,
                 std::shared_ptr<ResidencyPolicy> policy, bool is_mutable = true);
  // Blocks: the registries' locks, and the tile-table lock to count the dirty tiles of a named file.
  ~TiledEvictable() override;

  static constexpr int64_t kMaxTiles = TileGeometry::kMaxTiles;
  static constexpr int64_t kMaxRuns = TileGeometry::kMaxRuns;

  // -------- geometry (TileGeometry; fixed at construction)
  const TileGeometry& geometry() const noexcept { return geometry_; }
  const std::vector<int64_t>& grid_shape() const noexcept { return geometry_.grid_shape(); }
  const std::vector<int64_t>& tile_shape() const noexcept { return geometry_.tile_shape(); }
  const std::vector<int64_t>& logical_shape() const noexcept { return geometry_.logical_shape(); }
  int64_t tile_count() const noexcept { return geometry_.tile_count(); }
  int64_t tile_size() const noexcept { return geometry_.tile_size(); }
  int64_t size() const override { return is_released() ? 0 : geometry_.size(); }  // 0 once released, as every carrier
  size_t rank() const noexcept { return geometry_.rank(); }
  int64_t tile_index(const TileCoord& t) const { return geometry_.tile_index(t); }  // ValueError when out of grid
  TileCoord tile_coord(int64_t index) const { return geometry_.tile_coord(index); }
  // Slot s -> (tile index, within-tile ordinal).
  std::pair<int64_t, int64_t> locate(int64_t slot) const { return geometry_.locate(slot); }
  // The footprint of tile `index` in slot space as contiguous runs
  // (ordinal = within-tile ordinal).
  FootprintRuns footprint_runs(int64_t index) const { return geometry_.footprint_runs(index); }

  const CarrierPtr& primary() const noexcept { return primary_; }
  const CarrierPtr& secondary() const noexcept { return secondary_; }
  const std::shared_ptr<ResidencyPolicy>& policy() const noexcept { return policy_; }

  // -------- residency budget (Note [One residency budget], residency_budget.hpp)
  // Draws from `budget` from now on: its resident tiles are counted (and evicted down to the bound when they
  // exceed it), and every carrier derived by allocate_like (gradients, their sums, scatter results) draws from it
  // too. RuntimeError when the carrier already draws from another budget; setting the same one again does nothing.
  // Blocks: the tile-table lock, the budget's, and evictions (I/O) in this thread when over the bound.
  void set_residency_budget(std::shared_ptr<ResidencyBudget> budget);
  const std::shared_ptr<ResidencyBudget>& residency_budget() const noexcept { return budget_; }
  // Bytes of one tile in primary storage (tile_size() slots of the dtype).
  int64_t tile_bytes() const noexcept;

  // -------- gradient hook (Note [Gradient reservations], gradient_hook.hpp)
  // Installs `hook` (null: removes the one installed). ValueError when another hook is installed (one consumer of
  // a parameter's gradients in backward at a time); installing the same one again does nothing.
  // Blocks: a lock of its own, briefly.
  void set_gradient_hook(std::shared_ptr<TileGradientHook> hook);
  std::shared_ptr<TileGradientHook> gradient_hook() const;
  // Reserves `tiles` through the hook (an empty reservation when there is none); the hook's errors propagate.
  GradientReservation reserve_gradients(std::vector<int64_t> tiles) const;

  // -------- footprints
  // ValueError ("tile footprints") unless `tensor` is tile-footprint compatible.
  // Blocks: the footprint cache's lock, briefly.
  void check_footprints(const TensorImpl& tensor) const;

  // -------- tile states
  // Blocks: the tile-table lock, briefly.
  TileState tile_state(const TileCoord& t) const;
  // Blocks: the tile-table lock, held while `pred` runs (keep it short; never call back into this carrier).
  std::vector<TileCoord> tiles_where(const std::function<bool(const TileState&)>& pred) const;
  // Blocks: the tile-table lock, briefly.
  TiledStats stats() const;

  // -------- residency requests (tile indices already bound to the grid)
  // Asynchronous forms need the carrier to be held by a std::shared_ptr.
  // Blocks: the tile-table lock, briefly; transfers run on the I/O threads (inline if no shared_ptr owns this).
  CompletionPtr<std::monostate> promote_async(const std::vector<int64_t>& tiles);
  // A tile that must be written (dirty, or its secondary copy not valid) is refused before anything changes when
  // the secondary tier is read-only (Note [A read-only secondary tier]).
  // Blocks: the tile-table lock, briefly; transfers run on the I/O threads (inline if no shared_ptr owns this).
  CompletionPtr<std::monostate> evict_async(const std::vector<int64_t>& tiles);
  // Writes every dirty tile to the secondary tier, makes the secondary durable (Carrier::flush: fsync of its file
  // or device) and marks the tiles clean; they stay resident. Refused like other requests while any tile has an
  // incomplete residency request ("wait"), and before anything changes when dirty tiles meet a read-only secondary.
  // All-or-nothing: a failed write or fsync leaves every tile dirty and resident (Note [Flushing tiles]).
  // Blocks: the tile-table lock, briefly; writes and sync run on the I/O threads (inline if no shared_ptr owns this).
  CompletionPtr<std::monostate> flush_async();
  // Blocking flush_async(), run in the calling thread.
  // Blocks: runs every write and the sync (I/O) in this thread.
  void flush() override;
  // Blocks: the tile-table lock, briefly.
  bool has_incomplete_work() const;

  // -------- waiting in turn (Note [Taking turns] in cpp/src/tiled/residency.cpp)
  // The blocking forms: promote_async / evict_async / flush_async, except that a tile under another request, held
  // by a gradient sum or an optimizer's step, or (eviction) pinned by running work is waited for instead of
  // refused, first come first served among the callers that wait, for at most turn_wait_limit() seconds (then
  // RuntimeError asking to wait, nothing changed). The returned completion is the request's own.
  // Blocks: until the tiles are free (or the limit), on the tile-table lock's condition.
  CompletionPtr<std::monostate> promote_in_turn(const std::vector<int64_t>& tiles);
  CompletionPtr<std::monostate> evict_in_turn(const std::vector<int64_t>& tiles);
  CompletionPtr<std::monostate> flush_in_turn();
  // The bound on one wait in turn, in seconds (default 60); process-wide. ValueError unless positive and finite.
  static void set_turn_wait_limit(double seconds);
  static double turn_wait_limit() noexcept;

  // -------- data access
  // Blocks: the tile-table lock; reads a secondary tile's slots from the secondary tier, in this thread (I/O).
  void read_slots(int64_t start, int64_t count, void* out) const override;
  // Blocks: the tile-table lock; promotes a secondary or implicit tile first, in this thread (I/O).
  void write_slots(int64_t start, int64_t count, const void* in) override;
  // Blocks: the tile-table lock; reads a secondary tile's slot from the secondary tier, in this thread (I/O).
  Value read_value(int64_t slot) const override;
  // Blocks: the tile-table lock; promotes a secondary or implicit tile first, in this thread (I/O).
  void write_value(int64_t slot, const Value& value) override;
  bool supports_storage_dtype(const DType& dtype) const override;
  bool can_grow() const override { return false; }
  bool allows_elementwise_fallback() const override { return false; }
  // Same geometry, tier kinds and policy; zero-filled means implicit-zero
  // tiles, `empty` invalid ones (`slots` must be 0 or the full extent).
  // Blocks: allocates the new tiers (a file for a FileBacked tier) and takes the new carrier's tile-table lock.
  CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const override;

  // -------- dirty tiles that would be discarded (Note [Dirty tiles are never discarded silently])
  // Whether the secondary tier is a file the user named (FileBacked with a filename): only then does discarding a
  // dirty tile lose values the user expects in a file.
  bool secondary_is_named_file() const noexcept { return !named_file_.empty(); }
  // After release(): the warning for the dirty tiles that release discarded (empty when none, when the secondary
  // is not a named file, or when already taken). Taken once.
  std::string take_release_discard_warning();
  // The warning for a carrier of a named file still holding dirty tiles at interpreter exit, one per such live,
  // unreleased carrier; each is reported once (its destructor then stays silent).
  // Blocks: the registry's lock and each such carrier's tile-table lock.
  static std::vector<std::string> exit_discard_warnings();
  // Called by the destructor of an unreleased carrier of a named file that still holds dirty tiles (and was not
  // reported at exit) with its warning; installed by the language binding. Must not throw.
  using DiscardReporter = void (*)(const std::string& warning) noexcept;
  static void set_discard_reporter(DiscardReporter reporter) noexcept;

 protected:
  // Blocks (release()): waits for the requests and work that began before it to end.
  void do_release() override;
  void check_releasable() const override;

 private:
  // Engine hooks, documented in cpp/src/tiled/internal.hpp and reached only through TiledInternals.
  friend struct TiledInternals;
  friend class WorkToken;
  friend class ResidencyBudget;
  // Evicts those of `tiles` that are resident and not pinned, held or moving, in this thread (writing dirty ones);
  // returns how many. A failed write raises (the tiles stay resident).
  int64_t evict_for_budget(const std::vector<int64_t>& tiles);
  // Under a budget: makes room for those of `tiles` that are not resident yet, before they become resident
  // (ValueError when `tiles` can never fit; RuntimeError when room cannot be made). Call without the lock.
  void admit(std::vector<int64_t> tiles, const char* purpose);
  // -------- write-behind (Note [Write-behind evictions] in cpp/src/tiled/write_behind.cpp)
  // Queues those of `tiles` that are resident, dirty, unpinned and under no request for an eviction on the I/O
  // executor, while the budget's queue has room. Call without the lock.
  void queue_write_behind(const std::vector<int64_t>& tiles);
  // The carrier's job on the I/O executor: evicts the queued tiles one by one, in this thread, until the queue is
  // empty; a failure is kept for the next request.
  void run_write_behind() noexcept;
  // Under mutex_: takes back the queued write-behinds of `tiles` (they stay resident) and waits for the ones being
  // written (every tile when `all`).
  void settle_write_behind(std::unique_lock<std::mutex>& lock, std::span<const int64_t> tiles, bool all = false);
  // The same, taking the lock.
  void settle_write_behind(std::span<const int64_t> tiles, bool all = false);
  // Under mutex_: raises (once) the failure of a write-behind eviction, before the request changes anything.
  void raise_write_behind_failure();
  struct Work;
  class TileWrite;
  // Pins `tiles` (after asking the policy) and lists in `missing` those the work must promote.
  std::shared_ptr<Work> begin_work(const std::vector<int64_t>& tiles, const char* purpose,
                                   std::vector<int64_t>& missing);
  [[nodiscard]] std::exception_ptr end_work(const std::shared_ptr<Work>& work, std::exception_ptr work_error);
  std::shared_ptr<Work> pin_for_reading();
  CarrierPtr tile_buffer(int64_t index) const;
  CarrierPtr tile_value(int64_t index) const;
  void install_tiles(const std::vector<std::pair<int64_t, CarrierPtr>>& buffers);
  bool accumulate_tiles(TiledEvictable& other, bool share_other);
  std::unique_ptr<TileWrite> hold_tile_for_update(int64_t index);
  bool only_reference_is(const CarrierPtr& self) const;

  struct Tile {
    TileLocation loc = TileLocation::Invalid;
    bool dirty = false;
    bool secondary_valid = false;
    CarrierPtr buffer;      // primary storage when resident
    int pins = 0;
    uint64_t pending = 0;   // id of the incomplete residency request transitioning it, or of the sum holding it
                            // (kSumHold set: Note [Gradient sums hold their tiles])
    uint8_t behind = 0;     // kBehindQueued / kBehindWriting (Note [Write-behind evictions])
  };
  static constexpr uint8_t kBehindQueued = 1, kBehindWriting = 2;
  struct Request;
  // A place in line for a set of tiles (Note [Taking turns]); leaves the line when destroyed.
  class Turn;
  struct TurnEntry {
    std::vector<int64_t> tiles;  // sorted, unique
  };
  std::unique_ptr<Turn> take_turn(std::vector<int64_t> tiles);
  // Under `lock` (mutex_): waits until no turn taken before `turn` wants any of its tiles and none of them is
  // pending (or pinned, when `pins_block`); RuntimeError naming `what` after the limit, or when released.
  void wait_turn(std::unique_lock<std::mutex>& lock, const Turn& turn, bool pins_block, const char* what);
  // Holds tile `index` for an in-place update, promoting it first, waiting in turn (Note [Taking turns]).
  std::unique_ptr<TileWrite> hold_in_turn(int64_t index, const char* what);
  // Runs the request's transfers on the I/O executor, or in this thread when `inline_`.
  void start_request(const std::shared_ptr<Request>& r, bool inline_ = false);
  // With a `turn`, conflicts are waited for in that turn instead of refused.
  CompletionPtr<std::monostate> promote_tiles(const std::vector<int64_t>& tiles, bool inline_, Turn* turn = nullptr);
  CompletionPtr<std::monostate> evict_tiles(const std::vector<int64_t>& tiles, bool inline_, Turn* turn = nullptr);
  CompletionPtr<std::monostate> flush_tiles(bool inline_, Turn* turn = nullptr);
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
  // Writes tile `index` from its buffer to the secondary tier: one unit where the tier is crash-safe.
  void write_tile(const Carrier& buffer, int64_t index);
  // After every transfer of `r`: a flush makes the secondary durable, then commit.
  void complete(const std::shared_ptr<Request>& r);
  void commit(const std::shared_ptr<Request>& r);
  int64_t unsaved_tiles_locked() const;  // dirty primary tiles (under mutex_)
  std::string discard_warning(int64_t tiles, const char* when) const;
  // Blocking promotion of one tile for slot access (lock held by caller is released inside).
  const Tile& readable_tile(int64_t index, std::unique_lock<std::mutex>& lock) const;
  // Reads n slots of tile `index` from `slot` (within-tile ordinal `within`), one footprint run: from the
  // secondary for a secondary tile (Note [Reading a slot never moves a tile]), else from the tile's buffer.
  void read_tile_run(int64_t index, int64_t slot, int64_t within, int64_t n, std::byte* out) const;
  void ensure_secondary_storage();
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

  TileGeometry geometry_;
  CarrierPtr primary_, secondary_;
  Claim primary_claim_, secondary_claim_;
  std::shared_ptr<ResidencyPolicy> policy_;
  std::shared_ptr<ResidencyBudget> budget_;  // set once (set_residency_budget); null when none
  mutable std::mutex hook_mutex_;
  std::shared_ptr<TileGradientHook> gradient_hook_;  // under hook_mutex_

  mutable std::mutex mutex_;
  mutable std::vector<Tile> tiles_;
  mutable TiledStats stats_;
  uint64_t next_request_ = 1;
  int active_requests_ = 0;
  int active_work_ = 0;
  // Write-behind (Note [Write-behind evictions]): tiles queued or being written, the write-behind requests among
  // active_requests_, jobs queued on the I/O executor, and the failure the next request reports.
  int64_t behind_tiles_ = 0;
  int behind_requests_ = 0;
  int behind_jobs_ = 0;  // 1 while the carrier's job is queued or running
  std::deque<int64_t> behind_queue_;  // queued tiles, oldest first (taken-back ones are skipped)
  std::exception_ptr write_behind_failure_;
  // References to this carrier that queued requests hold (Request::owner); shared with them, so a request
  // can uncount its reference after dropping it (Note [Requests' own references]).
  std::shared_ptr<std::atomic<int64_t>> request_refs_ = std::make_shared<std::atomic<int64_t>>(0);
  std::condition_variable idle_cv_;  // notified when active_requests_ or active_work_ drops, or a turn ends
  std::list<TurnEntry> turns_;       // callers waiting in turn, in the order they came (Note [Taking turns])
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
