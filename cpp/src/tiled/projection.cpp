// Projection (data.hpp): an asynchronous, autograd-visible gather of selected tiles into a compact dense tensor,
// as one work request; its autograd node (Note [A projection saves no values]) and gradient sink
// (Note [Gradient sinks]).
#include <algorithm>
#include <atomic>
#include <mutex>

#include "strideweave/autograd.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/tiled/tile_set.hpp"
#include "tile_copies.hpp"
#include "../ops/strided.hpp"

namespace sw {

namespace {

// Note [Gathering in the caller]: a projection whose tiles are all readable when it is asked for, whose copy is
// at most caller_gather_bytes() (4 MiB unless set_caller_gather_bytes says otherwise) and whose bytes all lie in
// native memory is copied by the caller before project returns, split over the compute pool's threads (the
// caller and workers that spin between regions, Note [Compute pool]) in pieces of about kGatherPiece bytes.
// Handing the copy to the select threads cost more than the copy: each job submitted is a futex wake-up, an
// interrupt to another CPU on a virtual machine, and the woken thread starts tens of microseconds later, when
// the caller (helping from its wait, Note [Waiters help]) has copied most of it and then sleeps until the late
// thread's tile is done. Measured on the 2-vCPU AMD EPYC of docs/performance.md, a C++ loop of two-expert
// projections (two 512 KiB tiles): 44-51 us a projection (34-40 us column-major) through the select threads,
// 16 us (11-13 us) copied by the caller and the compute pool. The caller's part is short by definition (4 MiB is
// 40-80 us of copying); larger projections, those waiting on a promotion, and those through a carrier's own
// reads or writes (which may call into Python) stay asynchronous.
std::atomic<int64_t> g_caller_gather{int64_t{4} << 20};
constexpr int64_t kGatherPiece = int64_t{64} << 10;

// Note [A projection saves no values]: a projection's VJP scatter-adds the
// cotangent into a fresh gradient laid out like the full tensor; it reads the
// full tensor's offset, layout and carrier geometry (never changed by writes),
// never its values. So the node saves nothing, and backward checks no version
// for it: a slot written between forward and backward, in a projected tile or
// another, cannot make the gradient wrong, and must not make backward fail with
// "modified in-place". Nodes whose VJP does read saved values (mul, relu,
// matmul, ...; the `saves` of its row in ops/op_table.hpp) still save and check them.
struct ProjectionNode final : Node {
  std::shared_ptr<TiledEvictable> carrier;
  TileSelection selection;
  // Note [Gradient reservations]: the projected tiles, reserved while the node lives; finished as delivered once
  // a backward through it has ended (the engine has added its gradient into the leaf by then).
  GradientReservation reservation;
  bool ran = false;
  std::vector<TensorPtr> apply(const TensorPtr& g) override {
    ran = true;
    return {scatter_add_gradient(carrier, inputs[0], selection, g)};
  }
  void release_saved() override {
    saved.clear();
    reservation.finish_all(ran);
  }

  // Note [Gradient sinks]: a one-tile projection of a leaf whose tiled .grad
  // accumulates in place (what accumulate_into would do with this node's
  // gradient: the same conditions) offers that gradient's resident tile, in
  // the buffer order of its tiles, so the tile's values are the compact
  // gradient's in column-major order (or row-major: a transposed sink).
  std::optional<GradientSink> gradient_sink() override {
    const TensorPtr& leaf = inputs[0];
    if (selection.per_axis.size() != 2 || selection.per_axis[0].size() != 1 || selection.per_axis[1].size() != 1)
      return std::nullopt;
    TensorPtr current;
    {
      std::lock_guard lock(leaf->mutex);
      if (leaf->node) return std::nullopt;
      current = leaf->grad;
    }
    if (!current || current.use_count() != 2 || !current->carrier->is_mutable() || current->carrier->is_owned() ||
        current->carrier.get() == carrier.get())
      return std::nullopt;
    if (!(current->layout == leaf->layout) || current->offset != leaf->offset) return std::nullopt;
    // Checked before `acc` below takes a reference of its own. Requests on other tiles may be under way
    // (Note [Requests' own references]); hold_tile_for_update refuses a tile one is transitioning.
    const auto* raw = dynamic_cast<const TiledEvictable*>(current->carrier.get());
    if (!raw || raw->is_released() || raw->dtype().id() != DTypeId::Float32 || raw->grid_shape() != carrier->grid_shape() ||
        raw->tile_shape() != carrier->tile_shape() || !TiledInternals::only_reference_is(*raw, current->carrier))
      return std::nullopt;
    // The tile holds the gradient in its buffer order: column-major, or row-major (the sink's transpose) for
    // PyTorch's (out, in) tiles (Note [Within-tile layouts]); any other order gets no sink.
    const TileAccess access(*raw, *current);
    if (!access.dense_permutation) return std::nullopt;
    const bool transposed = access.mode_order[0] == 1 && raw->tile_shape()[0] > 1 && raw->tile_shape()[1] > 1;
    auto acc = std::static_pointer_cast<TiledEvictable>(current->carrier);
    const int64_t index = acc->tile_index({selection.per_axis[0][0], selection.per_axis[1][0]});
    // The tile is held from here until the sink is committed or dropped: another thread that took a reference
    // to the gradient meanwhile cannot evict, promote, read or release it under the producer's writes
    // (Note [Gradient sums hold their tiles]).
    std::shared_ptr<TiledInternals::TileWrite> write = TiledInternals::hold_tile_for_update(*acc, index);
    if (!write) return std::nullopt;
    GradientSink sink;
    sink.data = write->data();
    sink.rows = acc->tile_shape()[0];
    sink.cols = acc->tile_shape()[1];
    sink.transposed = transposed;
    sink.keep_alive = write;  // the hold (and the carrier) until the sink is dropped
    sink.commit = [write] { write->commit(); };
    return sink;
  }
};

}  // namespace

std::vector<int64_t> bind_selection(const TiledEvictable& c, const TileSelection& sel) {
  check_selection_axes(sel.per_axis);  // an empty or repeated axis never completes a projection
  return c.geometry().select(sel.per_axis);
}

std::vector<int64_t> compact_shape(const TiledEvictable& c, const TileSelection& sel) {
  return c.geometry().compact_shape(sel.per_axis);
}

CompletionPtr<TensorPtr> project(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& tensor,
                                 const TileSelection& sel, const CarrierPtr& destination, bool tile_major) {
  return project_for(c, tensor, sel, destination, "projection", tile_major);
}

int64_t caller_gather_bytes() noexcept { return g_caller_gather.load(std::memory_order_relaxed); }
int64_t set_caller_gather_bytes(int64_t bytes) noexcept {
  return g_caller_gather.exchange(std::max<int64_t>(bytes, 0), std::memory_order_relaxed);
}

// `purpose` is what the residency policy is told: "projection" for carrier.project,
// "operation" for a direct operation's operands, "backward" inside backward.
CompletionPtr<TensorPtr> project_for(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& tensor,
                                     const TileSelection& sel, const CarrierPtr& destination, const char* purpose,
                                     bool tile_major) {
  if (!tensor) raise<TypeError>("project: tensor must be a Tensor");
  if (tensor->carrier.get() != c.get())
    raise<TypeError>("project: the tensor is backed by ", tensor->carrier->kind_name(),
                     ", not by this TiledEvictable");
  c->check_live("project");
  c->check_footprints(*tensor);
  std::vector<int64_t> src = bind_selection(*c, sel);
  std::vector<int64_t> cshape = compact_shape(*c, sel);
  const int64_t need = TileGeometry::product(cshape);
  const Carrier& proto = *c->primary();
  CarrierPtr dest = destination;
  if (dest) {
    if (dest->kind().dependent)
      raise<TypeError>("project: destination must be an ordinary carrier, not a dependent ", dest->kind_name());
    if (&dest->kind() != &proto.kind())
      raise<TypeError>("project: destination must be a ", proto.kind_name(), " carrier (the compute tier's class), got ",
                       dest->kind_name());
    if (dest->is_released()) raise<RuntimeError>("project: the destination carrier is released");
    if (!dest->is_mutable()) raise<RuntimeError>("project: the destination carrier is not publicly mutable");
    if (dest->dtype() != c->dtype())
      raise<TypeError>("project: destination dtype ", dest->dtype().name(), " does not match ", c->dtype().name());
    if (dest->size() < need && !dest->is_allocatable())
      raise<ValueError>("project: the destination's capacity is ", dest->size(), " slots but the projection needs ",
                        need, " and it is not allocatable");
    dest->check_storage_intact("project into it");  // Note [Files changed under a carrier] (storage.cpp)
  }
  const bool record = is_grad_enabled() && tensor->is_differentiable();
  // Work starts: one request pins the tiles and promotes the missing ones.
  // Note [Shared snapshots] (native.cpp): without a destination, one tile whose buffer already holds the compact
  // values in the compact tensor's order (a dense permutation: the buffer as is) is shared, not copied, once
  // readable.
  // The compact tensor keeps the tiles' own order where it is a dense permutation (Note [Within-tile layouts]),
  // tile by tile where that order is not column-major (Note [Tile-major projections]).
  // Derived once: the gathers below share it (`c` and `tensor`, which it refers to, live as long as they do).
  auto access = std::make_shared<const TileAccess>(*c, *tensor);
  std::vector<int64_t> counts = counts_of(sel);
  Layout clayout = access->compact_layout(cshape, counts, tile_major);
  const bool may_share = !dest && src.size() == 1 && access->dense_permutation && &proto.kind() == &cpu_kind();
  // The work's token ends it exactly once: in `finish`, or on an error path below.
  auto work = std::make_shared<WorkToken>(TiledInternals::begin_work(c, src, purpose));
  Carrier::Claim claim;
  try {
    if (may_share) {
      // The destination is decided when the tile is readable.
    } else if (!dest) {
      dest = proto.allocate_like(need, true, c->dtype(), /*empty=*/true);
    } else if (dest->size() < need) {
      dest->grow(need, false);
    }
    if (dest) claim = dest->claim("a projection");
  } catch (...) {
    std::rethrow_exception(work->end(std::current_exception()));
  }
  auto done = std::make_shared<Completion<TensorPtr>>();
  struct State {
    std::atomic<int64_t> remaining;
    std::mutex m;
    std::exception_ptr error;
    Carrier::Claim claim;
    CarrierPtr dest;  // null until the shared tile is readable (may_share)
  };
  auto st = std::make_shared<State>();
  st->remaining.store(static_cast<int64_t>(src.size()));
  st->claim = std::move(claim);
  st->dest = dest;
  auto finish = [c, tensor, sel, work, done, st, clayout, record]() {
    st->claim.end();
    // A failed deferred eviction fails the projection (Note [A failed deferred eviction reaches the work]).
    if (std::exception_ptr error = work->end(st->error)) {
      done->set_error(std::move(error));
      return;
    }
    TensorPtr result;
    try {
      const CarrierPtr& dest = st->dest;
      result = make_tensor(dest, 0, clayout);
      dest->bump_version();
      if (record) {
        auto node = std::make_shared<ProjectionNode>();
        node->name = "project";
        node->dispatch_kind = &c->kind();
        node->inputs = {tensor};
        node->carrier = c;
        node->selection = sel;
        node->reservation = c->reserve_gradients(bind_selection(*c, sel));
        // Nothing is saved (Note [A projection saves no values]): the VJP reads only the full tensor's geometry.
        attach_node(node, result);
      }
    } catch (...) {
      done->set_error(std::current_exception());
      return;
    }
    done->set_value(std::move(result));
  };
  auto gather = [c, tensor, access, st, counts, clayout, finish, need](int64_t k, int64_t index) {
    try {
      if (!st->error && !st->dest) {  // may_share: the one tile is readable now
        CarrierPtr buffer = TiledInternals::tile_buffer(*c, index);
        if (auto* cpu = dynamic_cast<const CPUCarrier*>(buffer.get())) st->dest = cpu->share_snapshot();
        if (!st->dest) {  // an implicit zero, or memory that cannot be shared: a fresh copy
          st->dest = c->primary()->allocate_like(need, true, c->dtype(), /*empty=*/buffer != nullptr);
          if (buffer) copy_slots(*buffer, 0, *st->dest, 0, need);
        }
      } else if (!st->error) {
        std::optional<TileRegion> region = tile_region(c->geometry(), clayout, TileGeometry::compact_coord(k, counts));
        SW_ASSERT(region, "a projection's compact layout ", clayout.str(), " has no tile regions");
        gather_tile(*c, *access, index, TiledInternals::tile_buffer(*c, index), *st->dest, *region);
      }
    } catch (...) {
      std::lock_guard lock(st->m);
      if (!st->error) st->error = std::current_exception();
    }
    if (st->remaining.fetch_sub(1) == 1) finish();
  };
  // Resident tiles are gathered at once; the others as soon as the request's promotion lands.
  // Each batch of tiles goes to at most one job per select thread; the jobs take
  // tiles from the batch's shared cursor, so a few wake-ups serve many tiles.
  using Batch = std::vector<std::pair<int64_t, int64_t>>;  // (compact ordinal, tile index)
  // A waiter takes tiles from the same cursor before it blocks (Note [Waiters help]).
  auto submit_batch = [gather, done](std::shared_ptr<const Batch> batch) {
    auto cursor = std::make_shared<std::atomic<size_t>>(0);
    auto drain = [gather, batch, cursor] {
      for (size_t n; (n = cursor->fetch_add(1)) < batch->size();) gather((*batch)[n].first, (*batch)[n].second);
    };
    const size_t jobs = std::min(batch->size(), Executor::select().max_threads());
    for (size_t j = 0; j < jobs; ++j) Executor::select().submit(drain);
    done->set_help(drain);
  };
  auto ready = work->ready();
  auto now = std::make_shared<Batch>();
  auto waiting = std::make_shared<Batch>();
  for (size_t k = 0; k < src.size(); ++k) {
    TileState s = c->tile_state(c->tile_coord(src[k]));
    if (s.location == TileLocation::Primary || s.location == TileLocation::Implicit)
      now->emplace_back(static_cast<int64_t>(k), src[k]);
    else
      waiting->emplace_back(static_cast<int64_t>(k), src[k]);
  }
  // Note [Gathering in the caller]: every tile readable, the copy short, and every byte in native memory (no
  // carrier's own read or write, which may call into Python, runs on a compute thread).
  std::vector<CarrierPtr> buffers;
  bool in_caller = !may_share && waiting->empty() && access->uniform &&
                   need * static_cast<int64_t>(slot_bytes(c->dtype())) <= caller_gather_bytes() &&
                   dest->mutable_native_data() != nullptr;
  for (size_t t = 0; in_caller && t < now->size(); ++t) {
    buffers.push_back(TiledInternals::tile_buffer(*c, (*now)[t].second));
    in_caller = !buffers.back() || buffers.back()->native_data() != nullptr;  // null: an implicit zero
  }
  if (may_share && !now->empty()) {
    gather(now->front().first, now->front().second);  // O(1): no thread hop
  } else if (in_caller) {
    const TileGeometry& g = c->geometry();
    const int64_t tile_bytes = g.tile_size() * static_cast<int64_t>(slot_bytes(c->dtype()));
    const int64_t per_tile = std::clamp<int64_t>(tile_bytes / kGatherPiece, 1, 64);
    // Small tiles: several to a part, so a copy of less than two pieces' bytes stays on the caller's thread.
    const int64_t grain = std::max<int64_t>(1, kGatherPiece / std::max<int64_t>(1, tile_bytes / per_tile));
    const int64_t tiles = static_cast<int64_t>(now->size());
    std::atomic<bool> failed{false};
    try {
      std::vector<TileRegion> regions;
      std::vector<RunWalk> walks;  // derived once a tile, not once a piece
      for (const auto& [k, index] : *now) {
        std::optional<TileRegion> region = tile_region(g, clayout, TileGeometry::compact_coord(k, counts));
        SW_ASSERT(region, "a projection's compact layout ", clayout.str(), " has no tile regions");
        walks.push_back(run_walk(*access, region->strides));
        regions.push_back(std::move(*region));
      }
      // Piece q is piece q / tiles of tile q % tiles: a thread's run of pieces covers whole rows of the result.
      detail::parallel_for(tiles * per_tile, grain, [&](int64_t b, int64_t e) {
        try {
          for (int64_t q = b; q < e && !failed.load(std::memory_order_relaxed); ++q) {
            const size_t t = static_cast<size_t>(q % tiles);
            gather_tile(*c, *access, (*now)[t].second, buffers[t], *dest, regions[t], q / tiles, per_tile,
                        &walks[t]);
          }
        } catch (...) {
          std::lock_guard lock(st->m);
          if (!st->error) st->error = std::current_exception();
          failed.store(true, std::memory_order_relaxed);
        }
      }, /*parts_per_thread=*/4);
    } catch (...) {
      std::lock_guard lock(st->m);
      if (!st->error) st->error = std::current_exception();
    }
    buffers.clear();  // the tiles' buffers go before the work ends
    st->remaining.store(0);
    finish();
  } else if (!now->empty()) {
    submit_batch(std::move(now));
  }
  if (!waiting->empty()) {
    ready->then([ready, waiting, submit_batch, st] {
      if (auto e = ready->error()) {
        std::lock_guard lock(st->m);
        if (!st->error) st->error = e;
      }
      submit_batch(waiting);
    });
  }
  return done;
}


}  // namespace sw
