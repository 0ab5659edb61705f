#include "strideweave/tiled/data.hpp"

#include <algorithm>
#include <atomic>
#include <sstream>
#include <utility>

#include "strideweave/autograd.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"

namespace sw {

namespace {

int64_t product(const std::vector<int64_t>& v) {
  int64_t n = 1;
  for (auto x : v) n *= x;
  return n;
}

std::vector<int64_t> dense_strides(const std::vector<int64_t>& shape) {
  std::vector<int64_t> s;
  int64_t run = 1;
  for (auto e : shape) {
    s.push_back(run);
    run *= e;
  }
  return s;
}

// Where the values of one source tile live for a given full tensor: for each
// logical within-tile ordinal, the within-tile ordinal of the carrier tile
// buffer holding it. Canonical tensors (offset 0, column-major) map identity.
struct TileAccess {
  const TiledEvictable& c;
  const TensorImpl& t;
  bool canonical;
  std::vector<int64_t> logical_stride;

  TileAccess(const TiledEvictable& carrier, const TensorImpl& tensor)
      : c(carrier), t(tensor), canonical(tensor.offset == 0 && tensor.layout.is_column_major()),
        logical_stride(dense_strides(carrier.logical_shape())) {}

  // Within-buffer ordinal of logical within-tile ordinal `w` of source tile `s`.
  int64_t physical_within(const TileCoord& s, int64_t w) const {
    if (canonical) return w;
    int64_t ordinal = 0;
    for (size_t i = 0; i < s.size(); ++i) {
      int64_t wi = w % c.tile_shape()[i];
      w /= c.tile_shape()[i];
      ordinal += (s[i] * c.tile_shape()[i] + wi) * logical_stride[i];
    }
    int64_t slot = t.offset + t.layout.flat().index(ordinal);
    return c.locate(slot).second;
  }
};

// Copies source tile `s` (buffer, or implicit zero when null) into the compact
// region of `dest` at compact tile coordinate `cc`.
void gather_tile(const TiledEvictable& c, const TileAccess& access, const TileCoord& s, const CarrierPtr& buffer,
                 Carrier& dest, const TileCoord& cc, const std::vector<int64_t>& dstride) {
  int64_t base = 0;
  for (size_t i = 0; i < cc.size(); ++i) base += cc[i] * c.tile_shape()[i] * dstride[i];
  const size_t w = slot_bytes(c.dtype());
  if (access.canonical && buffer) {
    Layout region(Shape::flat(c.tile_shape()), Stride::flat(dstride));
    for (const Run& r : region.runs()) copy_slots(*buffer, r.ordinal, dest, base + r.offset, r.length);
    return;
  }
  const int64_t n = c.tile_size();
  std::vector<std::byte> zero(w, std::byte{0});
  for (int64_t wo = 0; wo < n; ++wo) {
    int64_t off = base, rest = wo;
    for (size_t i = 0; i < cc.size(); ++i) {
      off += (rest % c.tile_shape()[i]) * dstride[i];
      rest /= c.tile_shape()[i];
    }
    if (buffer) copy_slots(*buffer, access.physical_within(s, wo), dest, off, 1);
    else dest.write_slots(off, 1, zero.data());
  }
}

// The inverse: a fresh tile buffer holding compact region `cc` of `compact`
// (plus `existing` values for "add"; null means zero).
CarrierPtr scatter_tile(const TiledEvictable& c, const TileAccess& access, const TileCoord& s,
                        const TensorImpl& compact, const TileCoord& cc, const std::vector<int64_t>& cstride,
                        const CarrierPtr& existing, bool add) {
  int64_t base = 0;
  for (size_t i = 0; i < cc.size(); ++i) base += cc[i] * c.tile_shape()[i] * cstride[i];
  const int64_t n = c.tile_size();
  // Fast path: canonical tile order and a dense compact tensor: one bulk copy
  // per contiguous run of the compact region, then (add) one vectorisable pass.
  const bool float_add_native = c.dtype().id() == DTypeId::Float32 &&
                                (!existing || existing->native_data() != nullptr);
  if (access.canonical && compact.layout.is_column_major() && (!add || float_add_native)) {
    CarrierPtr buf = c.primary()->allocate_like(n, true, c.dtype(), /*empty=*/true);
    Layout region(Shape::flat(c.tile_shape()), Stride::flat(cstride));
    for (const Run& r : region.runs())
      copy_slots(*compact.carrier, compact.offset + base + r.offset, *buf, r.ordinal, r.length);
    if (add && existing) {
      float* d = reinterpret_cast<float*>(buf->mutable_native_data());
      const float* e = reinterpret_cast<const float*>(existing->native_data());
      if (d) {
        for (int64_t k = 0; k < n; ++k) d[k] = e[k] + d[k];
      } else {
        std::vector<float> v(static_cast<size_t>(n));
        buf->read_slots(0, n, v.data());
        for (int64_t k = 0; k < n; ++k) v[k] = e[k] + v[k];
        buf->write_slots(0, n, v.data());
      }
    }
    return buf;
  }
  CarrierPtr buf = c.primary()->allocate_like(c.tile_size(), true, c.dtype(), /*empty=*/false);
  for (int64_t wo = 0; wo < n; ++wo) {
    int64_t ord = base, rest = wo;
    for (size_t i = 0; i < cc.size(); ++i) {
      ord += (rest % c.tile_shape()[i]) * cstride[i];
      rest /= c.tile_shape()[i];
    }
    int64_t pw = access.physical_within(s, wo);
    Value v = compact.carrier->read_value(compact.offset + compact.layout.flat().index(ord));
    if (add) {
      Value e = existing ? existing->read_value(pw) : Value::from_float(0.0);
      if (c.dtype().id() == DTypeId::Int32) {
        int64_t sum = (existing ? e.i : 0) + v.i;
        v = c.dtype().convert(Value::from_int(sum));
      } else {
        v = Value::from_float(double(float(e.f + v.f)));
      }
    }
    buf->write_value(pw, v);
  }
  return buf;
}

TileCoord decode_compact(int64_t k, const std::vector<int64_t>& counts) {
  TileCoord cc(counts.size());
  for (size_t i = 0; i < counts.size(); ++i) {
    cc[i] = k % counts[i];
    k /= counts[i];
  }
  return cc;
}

std::vector<int64_t> counts_of(const TileSelection& sel) {
  std::vector<int64_t> n;
  for (const auto& a : sel.per_axis) n.push_back(static_cast<int64_t>(a.size()));
  return n;
}

bool all_zero_bytes(const Carrier& buf, int64_t slots, std::vector<std::byte>& scratch) {
  const size_t bytes = static_cast<size_t>(slots) * slot_bytes(buf.dtype());
  const std::byte* p = buf.native_data();
  if (!p) {
    scratch.resize(bytes);
    buf.read_slots(0, slots, scratch.data());
    p = scratch.data();
  }
  return std::all_of(p, p + bytes, [](std::byte b) { return b == std::byte{0}; });
}

// --- projection node -------------------------------------------------------

// Note [Adopting a compact gradient]: the cotangent of a one-tile projection is
// usually a fresh dense tensor that only the backward engine holds (a matmul's
// VJP result, say). When its storage is exactly what the tile's buffer would
// hold — the primary's kind and dtype, one tile's slots, canonical order on
// both sides — the buffer becomes the gradient tile as is: no allocation, no
// copy. In the MoE workload this saves two passes over every expert's
// gradient (4 MiB each) per projection. Anything shared (the caller's seed, a
// gradient also handed to another input, a retained .grad) is copied as before.
CarrierPtr adoptable_gradient(const TiledEvictable& fresh, const TileAccess& access, const TensorPtr& g) {
  if (!access.canonical || g.use_count() != 1 || g->offset != 0 || !g->layout.is_column_major()) return nullptr;
  const CarrierPtr& buf = g->carrier;
  if (buf.use_count() != 1 || &buf->kind() != &fresh.primary()->kind() || !(buf->dtype() == fresh.dtype()) ||
      buf->size() != fresh.tile_size() || !buf->is_mutable() || buf->is_released() || !buf->native_data())
    return nullptr;
  return buf;
}

TensorPtr scatter_add_gradient(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& primal,
                               const TileSelection& sel, const TensorPtr& compact_grad) {
  auto fresh = std::static_pointer_cast<TiledEvictable>(c->allocate_like(c->size(), true, c->dtype(), false));
  TileAccess access(*fresh, *primal);
  std::vector<int64_t> src = bind_selection(*c, sel);
  std::vector<int64_t> counts = counts_of(sel);
  Layout cl = column_major(Shape::flat(compact_shape(*c, sel)));
  std::vector<int64_t> cstride = cl.flat().strides;
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  std::vector<std::byte> raw;
  for (size_t k = 0; k < src.size(); ++k) {
    CarrierPtr buf = src.size() == 1 ? adoptable_gradient(*fresh, access, compact_grad) : nullptr;
    if (!buf)
      buf = scatter_tile(*fresh, access, fresh->tile_coord(src[k]), *compact_grad, decode_compact(static_cast<int64_t>(k), counts),
                         cstride, nullptr, false);
    // A tile whose gradient is all (+0) zero stays a valid implicit zero: summed
    // gradients keep untouched tiles implicit.
    if (all_zero_bytes(*buf, fresh->tile_size(), raw)) {
      buf->release();
      continue;
    }
    tiles.emplace_back(src[k], std::move(buf));
  }
  if (!tiles.empty()) fresh->install_tiles(tiles);
  return make_tensor(fresh, primal->offset, primal->layout);
}

// Note [A projection saves no values]: a projection's VJP scatter-adds the
// cotangent into a fresh gradient laid out like the full tensor; it reads the
// full tensor's offset, layout and carrier geometry (never changed by writes),
// never its values. So the node saves nothing, and backward checks no version
// for it: a slot written between forward and backward, in a projected tile or
// another, cannot make the gradient wrong, and must not make backward fail with
// "modified in-place". Nodes whose VJP does read saved values (mul, relu,
// matmul, ...; saves_inputs in ops.cpp) still save and check them.
struct ProjectionNode final : Node {
  std::shared_ptr<TiledEvictable> carrier;
  TileSelection selection;
  std::vector<TensorPtr> apply(const TensorPtr& g) override {
    return {scatter_add_gradient(carrier, inputs[0], selection, g)};
  }

  // Note [Gradient sinks]: a one-tile projection of a leaf whose tiled .grad
  // accumulates in place (what accumulate_into would do with this node's
  // gradient: the same conditions) offers that gradient's resident tile, in
  // canonical within-tile order, so the tile's values are the compact
  // gradient's in column-major order.
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
    if (current->offset != 0 || !current->layout.is_column_major() || !(current->layout == leaf->layout) ||
        current->offset != leaf->offset)
      return std::nullopt;
    // Checked before `acc` below takes a reference of its own. Requests on other tiles may be under way
    // (Note [Requests' own references]); hold_tile_for_update refuses a tile one is transitioning.
    const auto* raw = dynamic_cast<const TiledEvictable*>(current->carrier.get());
    if (!raw || raw->is_released() || raw->dtype().id() != DTypeId::Float32 || raw->grid_shape() != carrier->grid_shape() ||
        raw->tile_shape() != carrier->tile_shape() || !raw->only_reference_is(current->carrier))
      return std::nullopt;
    auto acc = std::static_pointer_cast<TiledEvictable>(current->carrier);
    const int64_t index = acc->tile_index({selection.per_axis[0][0], selection.per_axis[1][0]});
    // The tile is held from here until the sink is committed or dropped: another thread that took a reference
    // to the gradient meanwhile cannot evict, promote, read or release it under the producer's writes
    // (Note [Gradient sums hold their tiles]).
    std::shared_ptr<TiledEvictable::TileWrite> write = acc->hold_tile_for_update(index);
    if (!write) return std::nullopt;
    GradientSink sink;
    sink.data = write->data();
    sink.rows = acc->tile_shape()[0];
    sink.cols = acc->tile_shape()[1];
    sink.keep_alive = write;  // the hold (and the carrier) until the sink is dropped
    sink.commit = [write] { write->commit(); };
    return sink;
  }
};

}  // namespace

std::vector<int64_t> bind_selection(const TiledEvictable& c, const TileSelection& sel) {
  if (sel.per_axis.size() != c.rank())
    raise<ValueError>("the TileSelection has rank ", sel.per_axis.size(), " but the tile grid has rank ", c.rank());
  std::vector<int64_t> counts = counts_of(sel);
  for (size_t i = 0; i < c.rank(); ++i)
    for (int64_t v : sel.per_axis[i])
      if (v < 0 || v >= c.grid_shape()[i])
        raise<ValueError>("TileSelection coordinate ", v, " on axis ", i, " is out of range for the tile grid extent ",
                          c.grid_shape()[i]);
  const int64_t n = product(counts);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n));
  for (int64_t k = 0; k < n; ++k) {
    TileCoord cc = decode_compact(k, counts), s(c.rank());
    for (size_t i = 0; i < c.rank(); ++i) s[i] = sel.per_axis[i][cc[i]];
    out.push_back(c.tile_index(s));
  }
  return out;
}

std::vector<int64_t> compact_shape(const TiledEvictable& c, const TileSelection& sel) {
  std::vector<int64_t> out;
  for (size_t i = 0; i < sel.per_axis.size(); ++i)
    out.push_back(static_cast<int64_t>(sel.per_axis[i].size()) * c.tile_shape()[i]);
  return out;
}

namespace {
CompletionPtr<TensorPtr> project_for(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& tensor,
                                     const TileSelection& sel, const CarrierPtr& destination, const char* purpose);
}  // namespace

CompletionPtr<TensorPtr> project(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& tensor,
                                 const TileSelection& sel, const CarrierPtr& destination) {
  return project_for(c, tensor, sel, destination, "projection");
}

namespace {

// `purpose` is what the residency policy is told: "projection" for carrier.project,
// "operation" for a direct operation's operands, "backward" inside backward.
CompletionPtr<TensorPtr> project_for(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& tensor,
                                     const TileSelection& sel, const CarrierPtr& destination, const char* purpose) {
  if (!tensor) raise<TypeError>("project: tensor must be a Tensor");
  if (tensor->carrier.get() != c.get())
    raise<TypeError>("project: the tensor is backed by ", tensor->carrier->kind_name(),
                     ", not by this TiledEvictable");
  c->check_live("project");
  c->check_footprints(*tensor);
  std::vector<int64_t> src = bind_selection(*c, sel);
  std::vector<int64_t> cshape = compact_shape(*c, sel);
  const int64_t need = product(cshape);
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
  // values in dense order (canonical access: the identity within the tile) is shared, not copied, once readable.
  const bool may_share = !dest && src.size() == 1 && TileAccess(*c, *tensor).canonical && &proto.kind() == &cpu_kind();
  auto work = c->begin_work(src, purpose);
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
    std::rethrow_exception(c->end_work(work, std::current_exception()));
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
  std::vector<int64_t> counts = counts_of(sel);
  std::vector<int64_t> dstride = dense_strides(cshape);
  auto finish = [c, tensor, sel, work, done, st, cshape, record]() {
    st->claim.end();
    // A failed deferred eviction fails the projection (Note [A failed deferred eviction reaches the work]).
    if (std::exception_ptr error = c->end_work(work, st->error)) {
      done->set_error(std::move(error));
      return;
    }
    TensorPtr result;
    try {
      const CarrierPtr& dest = st->dest;
      result = make_tensor(dest, 0, column_major(Shape::flat(cshape)));
      dest->bump_version();
      if (record) {
        auto node = std::make_shared<ProjectionNode>();
        node->name = "project";
        node->dispatch_kind = &c->kind();
        node->inputs = {tensor};
        node->carrier = c;
        node->selection = sel;
        // Nothing is saved (Note [A projection saves no values]): the VJP reads only the full tensor's geometry.
        attach_node(node, result);
      }
    } catch (...) {
      done->set_error(std::current_exception());
      return;
    }
    done->set_value(std::move(result));
  };
  auto gather = [c, tensor, st, counts, dstride, finish, need](int64_t k, int64_t index) {
    try {
      if (!st->error && !st->dest) {  // may_share: the one tile is readable now
        CarrierPtr buffer = c->tile_buffer(index);
        if (auto* cpu = dynamic_cast<const CPUCarrier*>(buffer.get())) st->dest = cpu->share_snapshot();
        if (!st->dest) {  // an implicit zero, or memory that cannot be shared: a fresh copy
          st->dest = c->primary()->allocate_like(need, true, c->dtype(), /*empty=*/buffer != nullptr);
          if (buffer) copy_slots(*buffer, 0, *st->dest, 0, need);
        }
      } else if (!st->error) {
        TileAccess access(*c, *tensor);
        gather_tile(*c, access, c->tile_coord(index), c->tile_buffer(index), *st->dest, decode_compact(k, counts),
                    dstride);
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
  auto ready = TiledEvictable::work_ready(work);
  auto now = std::make_shared<Batch>();
  auto waiting = std::make_shared<Batch>();
  for (size_t k = 0; k < src.size(); ++k) {
    TileState s = c->tile_state(c->tile_coord(src[k]));
    if (s.location == TileLocation::Primary || s.location == TileLocation::Implicit)
      now->emplace_back(static_cast<int64_t>(k), src[k]);
    else
      waiting->emplace_back(static_cast<int64_t>(k), src[k]);
  }
  if (may_share && !now->empty()) gather(now->front().first, now->front().second);  // O(1): no thread hop
  else if (!now->empty()) submit_batch(std::move(now));
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

}  // namespace

// --- tiled gradient sums ------------------------------------------------------

bool tiled_gradients_compatible(const TensorPtr& a, const TensorPtr& b) {
  auto ca = std::dynamic_pointer_cast<TiledEvictable>(a->carrier);
  auto cb = std::dynamic_pointer_cast<TiledEvictable>(b->carrier);
  if (!ca || !cb || ca == cb) return false;
  if (ca->grid_shape() != cb->grid_shape() || ca->tile_shape() != cb->tile_shape() || ca->dtype() != cb->dtype() ||
      ca->dtype().id() != DTypeId::Float32)
    return false;
  if (a->offset != b->offset || !(a->layout == b->layout)) return false;
  if (ca->is_released() || cb->is_released()) return false;
  try {
    ca->check_footprints(*a);
    cb->check_footprints(*b);
  } catch (const ValueError&) {
    return false;
  }
  return true;
}

namespace {
// A reading pin on every tile of a gradient sum's operand, ended on scope exit (Note [Gradient sums hold their
// tiles]).
struct ReadPin {
  std::shared_ptr<TiledEvictable> carrier;
  std::shared_ptr<TiledEvictable::Work> work;
  explicit ReadPin(std::shared_ptr<TiledEvictable> c) : carrier(std::move(c)), work(carrier->pin_for_reading()) {}
  ReadPin(const ReadPin&) = delete;
  ReadPin& operator=(const ReadPin&) = delete;
  ~ReadPin() { (void)carrier->end_work(work); }  // a reading pin plans no eviction: end_work has nothing to report
};
}  // namespace

TensorPtr add_tiled_gradients(const TensorPtr& a, const TensorPtr& b) {
  auto ca = std::static_pointer_cast<TiledEvictable>(a->carrier);
  auto cb = std::static_pointer_cast<TiledEvictable>(b->carrier);
  // Another thread may hold either operand (a .grad it read) and move its tiles: both are pinned while read.
  ReadPin pin_a(ca), pin_b(cb);
  auto fresh = std::static_pointer_cast<TiledEvictable>(ca->allocate_like(ca->size(), true, ca->dtype(), false));
  const int64_t n = ca->tile_size();
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  for (int64_t i = 0; i < ca->tile_count(); ++i) {
    CarrierPtr va = ca->tile_value(i), vb = cb->tile_value(i);
    if (!va && !vb) continue;  // implicit + implicit stays implicit
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
  if (!tiles.empty()) fresh->install_tiles(tiles);
  return make_tensor(fresh, a->offset, a->layout);
}

// --- scatter ---------------------------------------------------------------

namespace {

struct ScatterNode final : Node {
  std::shared_ptr<TiledEvictable> carrier;
  TileSelection selection;
  bool add = false;
  bool compact_input = false, template_input = false;  // which of inputs[] are present
  std::vector<TensorPtr> apply(const TensorPtr& g) override {
    // g is a full tiled cotangent of the result's carrier kind.
    auto gc = std::dynamic_pointer_cast<TiledEvictable>(g->carrier);
    SW_ASSERT(gc, "scatter backward received a ", g->carrier->kind_name(), " cotangent, not a TiledEvictable one");
    std::vector<TensorPtr> grads(inputs.size());
    TensorPtr selected;  // the cotangent at the saved selection, compact
    {
      GradModeGuard off(false);
      selected = project_for(gc, g, selection, nullptr, "backward")->value();
    }
    size_t slot = 0;
    if (compact_input) grads[slot++] = selected;
    // The result holds no template values outside the selection (those tiles are
    // invalid), and replace overwrote the selected ones: only add propagates to
    // the template, and only the selected cotangent.
    if (template_input && add) grads[slot] = scatter_add_gradient(carrier, inputs[slot], selection, selected);
    return grads;
  }
};

}  // namespace

CompletionPtr<TensorPtr> scatter(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& compact,
                                 const TensorPtr& templ, const TileSelection& sel, bool add) {
  if (!compact) raise<TypeError>("scatter: compact must be a Tensor");
  if (!templ) raise<TypeError>("scatter: template must be a Tensor");
  const CarrierKind& ck = compact->carrier->kind();
  if (ck.dependent) raise<TypeError>("scatter: compact must be backed by an ordinary carrier, not ", ck.name);
  if (&ck != &c->primary()->kind())
    raise<TypeError>("scatter: compact must be backed by ", c->primary()->kind_name(), " (the compute tier's class), got ",
                     ck.name);
  if (templ->carrier.get() != c.get()) raise<TypeError>("scatter: template must be backed by this TiledEvictable");
  c->check_live("scatter");
  compact->carrier->check_live("scatter it");
  if (compact->dtype() != c->dtype())
    raise<TypeError>("scatter: compact dtype ", compact->dtype().name(), " does not match ", c->dtype().name());
  if (add) {
    // "add" combines like the central add: its result dtype must be the one the fresh carrier keeps
    // (Bool + Bool is Float32 there, never a Bool), so a sum that cannot keep it is refused before any work.
    const Operand operands[] = {Operand::of(templ), Operand::of(compact)};
    const DType& sum = result_dtype(OpId::Add, operands, {});
    if (sum != c->dtype())
      raise<TypeError>("scatter: reduction 'add' of ", c->dtype().name(), " values gives ", sum.name(),
                       " values (as add does), which a ", c->dtype().name(),
                       " TiledEvictable cannot hold; use reduction 'replace', or scatter into a ", sum.name(),
                       " carrier");
  }
  c->check_footprints(*templ);
  std::vector<int64_t> src = bind_selection(*c, sel);
  std::vector<int64_t> cshape = compact_shape(*c, sel);
  if (compact->layout.shape().extents() != cshape) {
    std::ostringstream want;
    for (size_t i = 0; i < cshape.size(); ++i) want << (i ? ", " : "") << cshape[i];
    raise<ValueError>("scatter: compact shape ", compact->layout.shape().str(), " does not match the selected region (",
                      want.str(), ")");
  }
  const bool record = is_grad_enabled() && (compact->is_differentiable() || templ->is_differentiable());
  auto work = add ? c->begin_work(src, "scatter") : nullptr;
  auto done = std::make_shared<Completion<TensorPtr>>();
  auto ccl = compact->carrier->claim("a scatter");
  auto job = [c, compact, templ, sel, add, work, done, src, cshape, record,
              claim = std::make_shared<Carrier::Claim>(std::move(ccl))]() mutable {
    try {
      if (work) TiledEvictable::work_ready(work)->value();
      auto fresh = std::static_pointer_cast<TiledEvictable>(c->allocate_like(c->size(), true, c->dtype(), true));
      TileAccess access(*c, *templ);
      std::vector<int64_t> counts = counts_of(sel);
      std::vector<int64_t> cstride = dense_strides(cshape);
      std::vector<std::pair<int64_t, CarrierPtr>> tiles;
      for (size_t k = 0; k < src.size(); ++k)
        tiles.emplace_back(src[k], scatter_tile(*c, access, c->tile_coord(src[k]), *compact,
                                                decode_compact(static_cast<int64_t>(k), counts), cstride,
                                                add ? c->tile_buffer(src[k]) : nullptr, add));
      // A failed deferred eviction fails the scatter before it publishes anything (Note [A failed deferred
      // eviction reaches the work]).
      if (work)
        if (std::exception_ptr error = c->end_work(std::exchange(work, nullptr))) std::rethrow_exception(error);
      fresh->install_tiles(tiles);  // valid, dirty, version advanced once
      claim->end();
      TensorPtr result = make_tensor(fresh, templ->offset, templ->layout);
      if (record) {
        auto node = std::make_shared<ScatterNode>();
        node->name = "scatter";
        node->dispatch_kind = &c->kind();
        node->carrier = c;
        node->selection = sel;
        node->add = add;
        // The scatter node saves `compact`, as the public contract says (docs/guide.md, "TiledEvictable",
        // Scatter): a backward after it was written in place raises "modified in-place" with both versions, like
        // any saved tensor. Its VJP reads no value of it (unlike Note [A projection saves no values], the contract
        // decides here): the check tells a user that the values the result was built from are gone.
        node->save(compact);
        if (compact->is_differentiable()) {
          node->inputs.push_back(compact);
          node->compact_input = true;
        }
        if (templ->is_differentiable()) {
          node->inputs.push_back(templ);
          node->template_input = true;
        }
        attach_node(node, result);
      }
      done->set_value(std::move(result));
    } catch (...) {
      std::exception_ptr error = std::current_exception();
      if (work) error = c->end_work(std::exchange(work, nullptr), error);
      claim->end();
      done->set_error(std::move(error));
    }
  };
  Executor::select().submit(std::move(job));
  return done;
}

// --- direct operations -----------------------------------------------------

namespace {

TileSelection full_selection(const TiledEvictable& c) {
  TileSelection sel;
  for (int64_t g : c.grid_shape()) {
    std::vector<int64_t> axis(static_cast<size_t>(g));
    for (int64_t i = 0; i < g; ++i) axis[static_cast<size_t>(i)] = i;
    sel.per_axis.push_back(std::move(axis));
  }
  return sel;
}

// The full logical tensor as a dense compute-carrier tensor (blocking).
TensorPtr materialize(const TensorPtr& t, const char* purpose) {
  auto c = std::static_pointer_cast<TiledEvictable>(t->carrier);
  GradModeGuard off(false);
  TensorPtr dense = project_for(c, t, full_selection(*c), nullptr, purpose)->value();
  // Keep the caller's hierarchy (nested modes) over the dense values.
  return make_tensor(dense->carrier, 0, column_major(t->layout.shape()));
}

class TiledBackend final : public OpBackend {
 public:
  bool supports(OpId id) const override { return op_def(id).central; }
  bool materializes() const override { return true; }
  TensorPtr materialize_for_backward(const TensorPtr& input) override { return materialize(input, "backward"); }
  TensorPtr gradient_from_dense(const TensorPtr& input, const TensorPtr& dense) override {
    auto c = std::static_pointer_cast<TiledEvictable>(input->carrier);
    TileSelection sel = full_selection(*c);
    TensorPtr flat = make_tensor(dense->carrier, dense->offset, column_major(Shape::flat(c->logical_shape())));
    if (!dense->layout.is_column_major() || dense->offset != 0) flat = expand_dense(dense, dense->layout.shape());
    return scatter_add_gradient(c, input, sel, make_tensor(flat->carrier, 0, column_major(Shape::flat(c->logical_shape()))));
  }
  TensorPtr forward(OpId id, std::span<const Operand> ops, const OpOptions& options) override {
    std::vector<Operand> dense;
    for (const auto& o : ops) dense.push_back(o.is_tensor() ? Operand::of(materialize(o.tensor, "operation")) : o);
    GradModeGuard off(false);  // one outer node: the caller records it
    return call_op(id, dense, options);
  }
  // Tiled gradients of one geometry and layout add tile by tile (no dense temporary); others: the engine's rule.
  TensorPtr add_gradients(const TensorPtr& a, const TensorPtr& b) override {
    return tiled_gradients_compatible(a, b) ? add_tiled_gradients(a, b) : nullptr;
  }
  // A tiled .grad that only its leaf holds (no Python reference, no saved copy: the tensor is referenced by the
  // leaf's .grad and the engine's `current`, its carrier by the tensor alone, apart from its own residency
  // requests) accumulates in place, tile by tile: the cost is the tiles `g` touches, not the full extent. See
  // Note [Tiled gradient accumulation].
  bool accumulate_in_place(const TensorPtr& current, const TensorPtr& g, bool owned) override {
    if (!tiled_gradients_compatible(current, g) || current.use_count() != 2 || !current->carrier->is_mutable() ||
        current->carrier->is_owned())
      return false;
    auto& acc = static_cast<TiledEvictable&>(*current->carrier);
    const bool share = owned && g->carrier.use_count() == 1;  // g's tile buffers die with g
    // Residency requests of other tiles may be under way (Note [Requests' own references]); accumulate_tiles
    // refuses a tile that one is transitioning.
    return acc.only_reference_is(current->carrier) &&
           acc.accumulate_tiles(static_cast<TiledEvictable&>(*g->carrier), share);
  }
};

}  // namespace

void install_tiled_backend() {
  static const bool done = [] {
    register_backend(&tiled_evictable_kind(), std::make_shared<TiledBackend>());
    return true;
  }();
  (void)done;
}

}  // namespace sw
