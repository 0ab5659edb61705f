// The per-kind backends: the registry (register_backend / backend_for), the
// native backends (CPU: fast kernels; Generic: reference loops), which run the
// kernel entry of the operation's table row (Note [The operation table]), and
// the Evictable backend, which runs its primary tier's.
#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

#include "kernels.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"

namespace sw {

// ---------------------------------------------------------------- the kernel glue

namespace detail {

namespace {
const TensorImpl& first_tensor(std::span<const Operand> ops) {
  return *std::find_if(ops.begin(), ops.end(), [](const Operand& o) { return o.is_tensor(); })->tensor;
}
}  // namespace

TensorPtr run_elementwise(std::span<const Operand> ops, const OpOptions& options, const OpDef& def,
                          ElementwiseKernel kernel) {
  const TensorImpl& first = first_tensor(ops);
  const DType& rd = def.result_dtype(ops, options);
  Shape shape = first.layout.shape();
  for (const auto& o : ops)
    if (o.is_tensor() && !(o.tensor->layout.shape() == shape))
      shape = broadcast_shapes(shape, o.tensor->layout.shape(), def.name);
  // Reuse the first operand's (shared, immutable) layout when it already is the dense result layout.
  TensorPtr out = first.layout.is_column_major() && first.layout.shape() == shape
                      ? make_tensor(first.carrier->allocate_like(shape.size(), true, rd, true), 0, first.layout)
                      : dense_result(*first.carrier, shape, rd);
  std::vector<KernelInput> ins(ops.size());
  for (size_t i = 0; i < ops.size(); ++i) {
    auto& k = ins[i];
    if (ops[i].is_tensor()) {
      const TensorImpl& t = *ops[i].tensor;
      k.carrier = t.carrier.get();
      k.data = t.carrier->native_data();
      k.dtype = t.dtype().id();
      k.offset = t.offset;
      k.strides = t.layout.shape() == shape ? t.layout.flat().strides : t.layout.broadcast_to(shape).flat().strides;
    } else {
      const DType& sd = rd.id() == DTypeId::Int32 ? DType::Int32() : DType::Float32();
      k.scalar = sd.convert(ops[i].scalar);
      k.dtype = sd.id();
      k.strides.assign(shape.leaves().size(), 0);
      store_value(sd, k.scalar_bytes, k.scalar);
    }
  }
  std::vector<int64_t> ext = shape.leaves();
  kernel(ElementwiseCall{ins, ext, *out->carrier, def.name});
  return out;
}

TensorPtr run_reduce_sum(std::span<const Operand> ops, const OpOptions& options, const OpDef& def,
                         ReduceKernel kernel) {
  const TensorImpl& first = first_tensor(ops);
  const DType& rd = def.result_dtype(ops, options);
  std::vector<size_t> kept = parse_reduce_description(options.description, first.layout.rank());
  std::vector<IntTuple> ks;
  for (size_t k : kept) ks.push_back(first.layout.shape().tree()[k]);
  Shape rshape(IntTuple::tuple(ks));
  std::vector<size_t> order = kept;
  for (size_t k = 0; k < first.layout.rank(); ++k)
    if (std::find(kept.begin(), kept.end(), k) == kept.end()) order.push_back(k);
  // Permute with nested modes flattened into the order: kept leaves first.
  std::vector<IntTuple> sh, st;
  for (size_t k : order) {
    sh.push_back(first.layout.shape().tree()[k]);
    st.push_back(first.layout.stride().tree()[k]);
  }
  Layout permuted(Shape(IntTuple::tuple(sh)), Stride(IntTuple::tuple(st)));
  TensorPtr out = dense_result(*first.carrier, rshape, rd);
  kernel(first, permuted, rshape.size(), options.accumulate_f64, *out->carrier);
  return out;
}

TensorPtr run_matmul(std::span<const Operand> ops, const OpOptions& options, const OpDef& def, MatmulKernel kernel) {
  const DType& rd = def.result_dtype(ops, options);
  const TensorImpl& lhs = *ops[0].tensor;
  const TensorImpl& rhs = *ops[1].tensor;
  int64_t m = lhs.layout.shape().extents()[0], k = lhs.layout.shape().extents()[1];
  int64_t n = rhs.layout.shape().extents()[0];
  Shape rshape(IntTuple::tuple({lhs.layout.shape().tree()[0], rhs.layout.shape().tree()[0]}));
  TensorPtr out = dense_result(*lhs.carrier, rshape, rd);
  kernel(lhs, rhs, m, n, k, options.accumulate_f64, *out->carrier);
  return out;
}

}  // namespace detail

// ---------------------------------------------------------------- backends

namespace {

std::mutex g_backend_mutex;
std::atomic<uint64_t> g_backend_generation{1};
auto& g_backends = *new std::map<const CarrierKind*, std::shared_ptr<OpBackend>>();

// CPU (fast kernels) or Generic (reference loops): the row's kernel entry, one indirect call per operation.
class KernelBackend final : public OpBackend {
 public:
  explicit KernelBackend(bool fast) : fast_(fast) {}
  bool supports(OpId) const override { return true; }

  TensorPtr forward(OpId id, std::span<const Operand> ops, const OpOptions& options) override {
    const OpDef& def = op_def(id);
    return (fast_ ? def.cpu : def.generic)(ops, options, def);
  }

 private:
  bool fast_;
};

// Operations run on the primary tier's kernels; results are fresh Evictables.
class EvictableBackend final : public OpBackend {
 public:
  bool supports(OpId) const override { return true; }
  // Only what the primary tier executes (a storage-only primary executes nothing).
  bool executes(const Carrier& carrier, OpId id) const override {
    CarrierPtr primary = static_cast<const EvictableCarrier&>(carrier).primary();
    OpBackend* inner = backend_for(primary->kind());
    return inner && inner->executes(*primary, id);
  }
  TensorPtr forward(OpId id, std::span<const Operand> ops, const OpOptions& options) override {
    std::vector<Operand> views;
    CarrierPtr secondary;
    for (const auto& o : ops) {
      if (!o.is_tensor()) {
        views.push_back(o);
        continue;
      }
      auto* ev = static_cast<EvictableCarrier*>(o.tensor->carrier.get());
      if (ev->is_evicted())
        raise<RuntimeError>(op_def(id).name, ": Evictable carrier is evicted; promote() it before computing");
      if (!secondary) secondary = ev->secondary();
      views.push_back(Operand::of(make_tensor(ev->primary(), o.tensor->offset, o.tensor->layout)));
    }
    const CarrierKind& pk = views[0].is_tensor() ? views[0].tensor->carrier->kind() : views[1].tensor->carrier->kind();
    OpBackend* inner = backend_for(pk);
    if (!inner) raise<NotImplementedError>(op_def(id).name, ": the Evictable primary tier ", pk.name, " executes no operations");
    TensorPtr r = inner->forward(id, views, options);
    auto wrap = [&](const TensorPtr& t) {
      auto w = std::make_shared<EvictableCarrier>(t->carrier, secondary->allocate_like(0, true, t->dtype(), true));
      return make_tensor(w, 0, t->layout);
    };
    // row operations: a second result (topk's indices) is a fresh Evictable too
    if (options.second && *options.second) *options.second = wrap(*options.second);
    return wrap(r);
  }
};

void ensure_default_backends() {
  static const bool done = [] {
    g_backends[&generic_kind()] = std::make_shared<KernelBackend>(false);
    g_backends[&cpu_kind()] = std::make_shared<KernelBackend>(true);
    g_backends[&evictable_kind()] = std::make_shared<EvictableBackend>();
    return true;
  }();
  (void)done;
}

}  // namespace

void register_backend(const CarrierKind* kind, std::shared_ptr<OpBackend> backend) {
  std::lock_guard lock(g_backend_mutex);
  ensure_default_backends();
  g_backends[kind] = std::move(backend);  // backends live for the process (the map is never shrunk)
  g_backend_generation.fetch_add(1, std::memory_order_acq_rel);
}

OpBackend* backend_for(const CarrierKind& kind) {
  // One-entry per-thread cache: the op hot path takes no lock.
  thread_local const CarrierKind* cached_kind = nullptr;
  thread_local OpBackend* cached_backend = nullptr;
  thread_local uint64_t cached_generation = 0;
  const uint64_t generation = g_backend_generation.load(std::memory_order_acquire);
  if (cached_kind == &kind && cached_generation == generation) return cached_backend;
  std::lock_guard lock(g_backend_mutex);
  ensure_default_backends();
  auto it = g_backends.find(&kind);
  OpBackend* found = it == g_backends.end() ? nullptr : it->second.get();
  cached_kind = &kind;
  cached_backend = found;
  cached_generation = generation;
  return found;
}

}  // namespace sw
