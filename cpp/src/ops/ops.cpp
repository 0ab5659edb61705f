#include "strideweave/ops.hpp"

#include <functional>
#include <atomic>
#include <map>
#include <mutex>
#include <sstream>

#include "kernels.hpp"
#include "strided.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"

namespace sw {

// ---------------------------------------------------------------- the table

namespace {
constexpr std::array<OpDef, kOpCount> kTable{{
    {OpId::Add, "add", 2, true, false},
    {OpId::ElementwiseMul, "elementwise_mul", 2, true, false},
    {OpId::Mul, "mul", 2, true, true},
    {OpId::Relu, "relu", 1, true, false},
    {OpId::ReduceSum, "reduce_sum", 1, true, false},
    {OpId::Matmul, "matmul", 2, true, false},
    {OpId::Sub, "sub", 2, false, false},
    {OpId::Div, "div", 2, false, false},
    {OpId::Neg, "neg", 1, false, false},
    {OpId::Exp, "exp", 1, false, false},
}};

constexpr bool table_is_complete() {
  for (size_t i = 0; i < kTable.size(); ++i)
    if (static_cast<size_t>(kTable[i].id) != i || kTable[i].name == nullptr) return false;
  return true;
}
// Guard: adding an OpId without its table entry (or out of order) fails to compile.
static_assert(kTable.size() == kOpCount && table_is_complete(), "the operation table is incomplete");
static_assert(static_cast<size_t>(OpId::Exp) + 1 == kOpCount, "kOpCount must count every OpId");

bool is_elementwise(OpId id) {
  switch (id) {
    case OpId::ReduceSum:
    case OpId::Matmul: return false;
    default: return true;
  }
}
}  // namespace

const OpDef& op_def(OpId id) { return kTable[static_cast<size_t>(id)]; }
const std::array<OpDef, kOpCount>& op_table() { return kTable; }
std::optional<OpId> op_from_name(std::string_view name) {
  for (const auto& d : kTable)
    if (name == d.name) return d.id;
  return std::nullopt;
}

// ---------------------------------------------------------------- shapes and dtypes

namespace {
IntTuple broadcast_tree(const IntTuple& a, const IntTuple& b, bool& ok) {
  if (a.is_leaf() != b.is_leaf() || (!a.is_leaf() && a.rank() != b.rank())) {
    ok = false;
    return a;
  }
  if (a.is_leaf()) {
    if (a.value() == b.value() || b.value() == 1) return a;
    if (a.value() == 1) return b;
    ok = false;
    return a;
  }
  std::vector<IntTuple> out;
  for (size_t k = 0; k < a.rank(); ++k) out.push_back(broadcast_tree(a[k], b[k], ok));
  return IntTuple::tuple(std::move(out));
}
}  // namespace

Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  bool ok = true;
  IntTuple t = broadcast_tree(a.tree(), b.tree(), ok);
  if (!ok)
    raise<ValueError>(op, ": shapes ", a.str(), " and ", b.str(),
                      " do not broadcast (same hierarchical profile, each leaf extent equal or 1)");
  return Shape(t);
}

std::vector<size_t> parse_reduce_description(const std::optional<std::string>& description, size_t rank) {
  std::vector<size_t> kept;
  if (!description) {
    if (rank > 0) kept.push_back(0);
    return kept;
  }
  const std::string& d = *description;
  auto arrow = d.find("->");
  if (arrow == std::string::npos || d.find("->", arrow + 2) != std::string::npos)
    raise<ValueError>("reduce_sum description '", d, "' must look like 'a b -> a'");
  auto words = [](const std::string& s) {
    std::istringstream in(s);
    std::vector<std::string> out;
    for (std::string w; in >> w;) out.push_back(w);
    return out;
  };
  auto left = words(d.substr(0, arrow));
  auto right = words(d.substr(arrow + 2));
  if (left.size() != rank)
    raise<ValueError>("reduce_sum description '", d, "' names ", left.size(), " modes but the tensor has ", rank);
  for (size_t i = 0; i < left.size(); ++i)
    for (size_t j = i + 1; j < left.size(); ++j)
      if (left[i] == left[j]) raise<ValueError>("reduce_sum description '", d, "' repeats the name '", left[i], "'");
  for (const auto& w : right) {
    auto it = std::find(left.begin(), left.end(), w);
    if (it == left.end()) raise<ValueError>("reduce_sum description '", d, "' keeps unknown name '", w, "'");
    size_t k = static_cast<size_t>(it - left.begin());
    if (std::find(kept.begin(), kept.end(), k) != kept.end())
      raise<ValueError>("reduce_sum description '", d, "' keeps '", w, "' twice");
    kept.push_back(k);
  }
  return kept;
}

const DType& result_dtype(OpId id, std::span<const Operand> ops, const OpOptions& options) {
  auto all_int = [&] {
    for (const auto& o : ops) {
      if (o.is_tensor() ? o.tensor->dtype().id() != DTypeId::Int32
                        : (o.scalar.kind != Value::Kind::Int && o.scalar.kind != Value::Kind::BigInt))
        return false;
    }
    return true;
  };
  switch (id) {
    case OpId::Add:
    case OpId::Sub:
    case OpId::ElementwiseMul:
    case OpId::Mul: return all_int() ? DType::Int32() : DType::Float32();
    case OpId::Div:
    case OpId::Exp: return DType::Float32();
    case OpId::Relu: return ops[0].tensor->dtype();
    case OpId::Neg: return ops[0].tensor->dtype().id() == DTypeId::Int32 ? DType::Int32() : DType::Float32();
    case OpId::ReduceSum: return options.accumulate_f64 ? DType::Float32() : ops[0].tensor->dtype();
    case OpId::Matmul: return (!options.accumulate_f64 && all_int()) ? DType::Int32() : DType::Float32();
  }
  return DType::Float32();
}

// ---------------------------------------------------------------- helpers

TensorPtr dense_result(const Carrier& prototype, const Shape& shape, const DType& dtype) {
  CarrierPtr c = prototype.allocate_like(shape.size(), true, dtype, /*empty=*/true);
  return make_tensor(std::move(c), 0, column_major(shape));
}

TensorPtr permute_modes(const TensorPtr& t, const std::vector<size_t>& order) {
  std::vector<IntTuple> sh, st;
  for (size_t k : order) {
    sh.push_back(t->layout.shape().tree()[k]);
    st.push_back(t->layout.stride().tree()[k]);
  }
  return make_tensor(t->carrier, t->offset, Layout(Shape(IntTuple::tuple(sh)), Stride(IntTuple::tuple(st))));
}

namespace {

// Values of `t` in ordinal order, as doubles.
std::vector<double> read_doubles(const TensorImpl& t) {
  const int64_t n = t.size();
  std::vector<double> out(static_cast<size_t>(n));
  std::array<const std::vector<int64_t>*, 1> strides{&t.layout.flat().strides};
  auto plan = detail::StridedPlan<1>::make(t.layout.flat().extents, strides, {t.offset});
  if (const std::byte* base = t.carrier->native_data()) {
    visit_dtype(t.dtype().id(), [&](auto tag) {
      using T = decltype(tag);
      const T* x = reinterpret_cast<const T*>(base);
      plan.for_each_run(0, n, [&](int64_t ord, const std::array<int64_t, 1>& off, int64_t cnt,
                                  const std::array<int64_t, 1>& st) {
        for (int64_t i = 0; i < cnt; ++i) out[ord + i] = double(x[off[0] + i * st[0]]);
      });
    });
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    Value v = t.carrier->read_value(t.offset + t.layout.flat().index(i));
    out[i] = v.kind == Value::Kind::Int ? double(v.i) : v.kind == Value::Kind::Bool ? double(v.b) : v.f;
  }
  return out;
}

// The Float32 values of `t` as one native array in ordinal order (a dense
// column-major tensor in host memory), or null.
const float* dense_floats(const TensorImpl& t) {
  if (t.dtype().id() != DTypeId::Float32 || !t.layout.is_column_major()) return nullptr;
  const std::byte* base = t.carrier->native_data();
  return base ? reinterpret_cast<const float*>(base) + t.offset : nullptr;
}

// A dense Float32 tensor of `shape` on `prototype`'s kind holding `values`.
TensorPtr write_floats(const Carrier& prototype, const Shape& shape, const std::vector<double>& values) {
  TensorPtr out = dense_result(prototype, shape, DType::Float32());
  std::vector<float> f(values.begin(), values.end());
  out->carrier->write_slots(0, static_cast<int64_t>(f.size()), f.data());
  return out;
}

}  // namespace

TensorPtr full_like_kind(const Carrier& prototype, const Shape& shape, const DType& dtype, double value) {
  TensorPtr out = dense_result(prototype, shape, dtype);
  if (dtype.id() == DTypeId::Float32) {
    std::vector<float> f(static_cast<size_t>(shape.size()), static_cast<float>(value));
    out->carrier->write_slots(0, shape.size(), f.data());
  } else {
    for (int64_t i = 0; i < shape.size(); ++i)
      out->carrier->write_value(i, dtype.id() == DTypeId::Int32 ? Value::from_int(int64_t(value))
                                                                : Value::from_bool(value != 0));
  }
  return out;
}

TensorPtr unbroadcast(const TensorPtr& grad, const Shape& target) {
  if (grad->layout.shape() == target) return grad;
  std::vector<int64_t> ge = grad->layout.shape().leaves(), te = target.leaves();
  SW_ASSERT(ge.size() == te.size(), "unbroadcast across profiles");
  std::vector<int64_t> tstride(te.size());
  int64_t run = 1;
  for (size_t j = 0; j < te.size(); ++j) {
    tstride[j] = te[j] == ge[j] ? run : 0;
    run *= te[j];
  }
  std::vector<double> out(static_cast<size_t>(target.size()), 0.0);
  if (const float* gf = dense_floats(*grad)) {
    // Hot path (a gradient of a broadcast operand): one pass over the dense
    // gradient with an odometer over its leaves, no per-element division.
    const int64_t n = grad->size(), inner = ge.empty() ? 1 : ge[0], s0 = ge.empty() ? 0 : tstride[0];
    std::vector<int64_t> idx(ge.size(), 0);
    int64_t o = 0;
    for (int64_t i = 0; i < n; i += inner) {
      if (s0 == 1) {
        for (int64_t r = 0; r < inner; ++r) out[o + r] += gf[i + r];
      } else {
        double acc = 0;
        for (int64_t r = 0; r < inner; ++r) acc += gf[i + r];
        out[o] += acc;
      }
      for (size_t j = 1; j < ge.size(); ++j) {  // advance leaves 1.. (leaf 0 is the inner run)
        o += tstride[j];
        if (++idx[j] < ge[j]) break;
        o -= tstride[j] * ge[j];
        idx[j] = 0;
      }
    }
  } else {
    std::vector<double> g = read_doubles(*grad);
    for (int64_t i = 0; i < static_cast<int64_t>(g.size()); ++i) {
      int64_t rest = i, o = 0;
      for (size_t j = 0; j < ge.size(); ++j) {
        o += (rest % ge[j]) * tstride[j];
        rest /= ge[j];
      }
      out[o] += g[i];
    }
  }
  return write_floats(*grad->carrier, target, out);
}

TensorPtr expand_dense(const TensorPtr& t, const Shape& to) {
  TensorPtr view = make_tensor(t->carrier, t->offset, t->layout.broadcast_to(to));
  return write_floats(*t->carrier, to, read_doubles(*view));
}

// ---------------------------------------------------------------- backends

namespace {

std::mutex g_backend_mutex;
std::atomic<uint64_t> g_backend_generation{1};
auto& g_backends = *new std::map<const CarrierKind*, std::shared_ptr<OpBackend>>();

class KernelBackend final : public OpBackend {
 public:
  explicit KernelBackend(bool fast) : fast_(fast) {}
  bool supports(OpId) const override { return true; }

  TensorPtr forward(OpId id, std::span<const Operand> ops, const OpOptions& options) override {
    const TensorImpl& first = *std::find_if(ops.begin(), ops.end(), [](const Operand& o) { return o.is_tensor(); })->tensor;
    const DType& rd = result_dtype(id, ops, options);
    if (is_elementwise(id)) {
      Shape shape = first.layout.shape();
      for (const auto& o : ops)
        if (o.is_tensor() && !(o.tensor->layout.shape() == shape))
          shape = broadcast_shapes(shape, o.tensor->layout.shape(), op_def(id).name);
      // Reuse the first operand's (shared, immutable) layout when it already is the dense result layout.
      TensorPtr out = first.layout.is_column_major() && first.layout.shape() == shape
                          ? make_tensor(first.carrier->allocate_like(shape.size(), true, rd, true), 0, first.layout)
                          : dense_result(*first.carrier, shape, rd);
      std::vector<detail::KernelInput> ins(ops.size());
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
      if (fast_) detail::cpu_elementwise(id, ins, ext, *out->carrier);
      else detail::generic_elementwise(id, ins, ext, *out->carrier);
      return out;
    }
    if (id == OpId::ReduceSum) {
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
      if (fast_) detail::cpu_reduce_sum(first, permuted, rshape.size(), options.accumulate_f64, *out->carrier);
      else detail::generic_reduce_sum(first, permuted, rshape.size(), options.accumulate_f64, *out->carrier);
      return out;
    }
    // Matmul
    const TensorImpl& lhs = *ops[0].tensor;
    const TensorImpl& rhs = *ops[1].tensor;
    int64_t m = lhs.layout.shape().extents()[0], k = lhs.layout.shape().extents()[1];
    int64_t n = rhs.layout.shape().extents()[0];
    Shape rshape(IntTuple::tuple({lhs.layout.shape().tree()[0], rhs.layout.shape().tree()[0]}));
    TensorPtr out = dense_result(*lhs.carrier, rshape, rd);
    if (fast_) detail::cpu_matmul(lhs, rhs, m, n, k, options.accumulate_f64, *out->carrier);
    else detail::generic_matmul(lhs, rhs, m, n, k, options.accumulate_f64, *out->carrier);
    return out;
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
    auto wrapped = std::make_shared<EvictableCarrier>(r->carrier, secondary->allocate_like(0, true, r->dtype(), true));
    return make_tensor(wrapped, 0, r->layout);
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

// ---------------------------------------------------------------- autograd nodes

namespace {

TensorPtr op(OpId id, const TensorPtr& a, const TensorPtr& b = nullptr) {
  std::vector<Operand> ops{Operand::of(a)};
  if (b) ops.push_back(Operand::of(b));
  return call_op(id, ops);
}

TensorPtr transpose(const TensorPtr& t) { return permute_modes(t, {1, 0}); }

// sink += lhs rhs^T (matmul's contraction) when both are CPU Float32 tensors of
// the sink's result shape; false (nothing written) otherwise.
bool add_product_into(GradientSink& sink, const TensorImpl& lhs, const TensorImpl& rhs) {
  if (&lhs.carrier->kind() != &cpu_kind() || &rhs.carrier->kind() != &cpu_kind()) return false;
  if (lhs.layout.rank() != 2 || rhs.layout.rank() != 2) return false;
  const int64_t m = lhs.layout.shape().extents()[0], k = lhs.layout.shape().extents()[1];
  const int64_t n = rhs.layout.shape().extents()[0];
  if (m != sink.rows || n != sink.cols || rhs.layout.shape().extents()[1] != k) return false;
  return detail::cpu_matmul_accumulate(lhs, rhs, m, n, k, sink.data);
}

// g where a > 0, else 0.
TensorPtr relu_grad(const TensorPtr& g, const TensorPtr& a) {
  const float* gf = dense_floats(*g);
  const float* af = dense_floats(*a);
  if (gf && af && g->layout.shape() == a->layout.shape()) {  // dense operands: one vectorisable pass
    TensorPtr out = dense_result(*g->carrier, g->layout.shape(), DType::Float32());
    float* o = reinterpret_cast<float*>(out->carrier->mutable_native_data());
    if (o) {
      detail::parallel_for(g->size(), int64_t{1} << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) o[i] = af[i] > 0 ? gf[i] : 0.f;
      });
      return out;
    }
  }
  std::vector<double> gv = read_doubles(*g), av = read_doubles(*a);
  for (size_t i = 0; i < gv.size(); ++i)
    if (!(av[i] > 0)) gv[i] = 0;
  return write_floats(*g->carrier, g->layout.shape(), gv);
}

struct OpNode final : Node {
  OpId id;
  std::vector<Operand> operands;  // tensors (as inputs) and weak scalars, in call order
  OpOptions options;

  std::vector<TensorPtr> apply(const TensorPtr& g) override {
    OpBackend* backend = backend_for(*dispatch_kind);
    if (!backend || !backend->materializes()) return vjp(inputs, g, offered_sinks());
    std::vector<TensorPtr> dense;
    for (const auto& in : inputs) dense.push_back(backend->materialize_for_backward(in));
    std::vector<TensorPtr> grads = vjp(dense, g);
    for (size_t i = 0; i < grads.size(); ++i)
      if (grads[i]) grads[i] = backend->gradient_from_dense(inputs[i], grads[i]);
    return grads;
  }

  // Gradients for `inputs` (the operands, or dense copies of them) given the output's gradient; a gradient
  // added into one of `sinks` (Note [Gradient sinks]) is returned as nullptr.
  std::vector<TensorPtr> vjp(const std::vector<TensorPtr>& inputs, const TensorPtr& g,
                             std::span<GradientSink* const> sinks = {}) {
    std::vector<TensorPtr> grads(inputs.size());
    auto want = [&](size_t i) { return inputs[i]->is_differentiable(); };
    // Position of each operand among the tensor inputs.
    std::vector<int> slot(operands.size(), -1);
    for (size_t i = 0, t = 0; i < operands.size(); ++i)
      if (operands[i].is_tensor()) slot[i] = static_cast<int>(t++);
    auto shape_of = [&](size_t i) { return inputs[i]->layout.shape(); };
    switch (id) {
      case OpId::Add:
        for (size_t i = 0; i < inputs.size(); ++i)
          if (want(i)) grads[i] = unbroadcast(g, shape_of(i));
        break;
      case OpId::Sub:
        if (want(0)) grads[0] = unbroadcast(g, shape_of(0));
        if (want(1)) grads[1] = unbroadcast(op(OpId::Neg, g), shape_of(1));
        break;
      case OpId::ElementwiseMul:
      case OpId::Mul:
        if (inputs.size() == 2) {
          if (want(0)) grads[0] = unbroadcast(op(OpId::ElementwiseMul, g, inputs[1]), shape_of(0));
          if (want(1)) grads[1] = unbroadcast(op(OpId::ElementwiseMul, g, inputs[0]), shape_of(1));
        } else {
          const Operand& s = operands[slot[0] == 0 ? 1 : 0];
          std::vector<Operand> ops{Operand::of(g), Operand::weak(s.scalar)};
          if (want(0)) grads[0] = unbroadcast(call_op(OpId::Mul, ops), shape_of(0));
        }
        break;
      case OpId::Div:
        if (want(0)) grads[0] = unbroadcast(op(OpId::Div, g, inputs[1]), shape_of(0));
        if (want(1)) {
          TensorPtr q = op(OpId::Div, op(OpId::ElementwiseMul, g, inputs[0]), op(OpId::ElementwiseMul, inputs[1], inputs[1]));
          grads[1] = unbroadcast(op(OpId::Neg, q), shape_of(1));
        }
        break;
      case OpId::Neg:
        if (want(0)) grads[0] = op(OpId::Neg, g);
        break;
      case OpId::Exp:
        if (want(0)) grads[0] = op(OpId::ElementwiseMul, g, op(OpId::Exp, inputs[0]));
        break;
      case OpId::Relu:
        if (want(0)) grads[0] = relu_grad(g, inputs[0]);
        break;
      case OpId::ReduceSum: {
        if (!want(0)) break;
        const TensorImpl& in = *inputs[0];
        std::vector<size_t> kept = parse_reduce_description(options.description, in.layout.rank());
        std::vector<IntTuple> sh, st;
        for (size_t k = 0; k < in.layout.rank(); ++k) {
          auto it = std::find(kept.begin(), kept.end(), k);
          const IntTuple& mode = in.layout.shape().tree()[k];
          sh.push_back(mode);
          if (it != kept.end()) {
            st.push_back(g->layout.stride().tree()[static_cast<size_t>(it - kept.begin())]);
          } else {
            std::vector<int64_t> zeros(mode.leaf_count(), 0);
            // Same tree form as `mode`, every stride 0.
            std::function<IntTuple(const IntTuple&)> zero = [&](const IntTuple& m) -> IntTuple {
              if (m.is_leaf()) return IntTuple(int64_t{0});
              std::vector<IntTuple> c;
              for (const auto& ch : m.children()) c.push_back(zero(ch));
              return IntTuple::tuple(std::move(c));
            };
            st.push_back(zero(mode));
          }
        }
        TensorPtr view = make_tensor(g->carrier, g->offset, Layout(Shape(IntTuple::tuple(sh)), Stride(IntTuple::tuple(st))));
        grads[0] = write_floats(*g->carrier, in.layout.shape(), read_doubles(*view));
        break;
      }
      case OpId::Matmul: {
        // d lhs = g rhs, d rhs = g^T lhs: each a matmul of views, or added straight into a sink.
        const TensorPtr a[2] = {g, transpose(g)};
        const TensorPtr b[2] = {transpose(inputs[1]), transpose(inputs[0])};
        for (size_t i = 0; i < 2; ++i) {
          if (!want(i)) continue;
          GradientSink* sink = i < sinks.size() ? sinks[i] : nullptr;
          if (sink && !options.accumulate_f64 && add_product_into(*sink, *a[i], *b[i])) {
            sink->used = true;
            continue;
          }
          grads[i] = op(OpId::Matmul, a[i], b[i]);
        }
        break;
      }
    }
    return grads;
  }
};

bool saves_inputs(OpId id) {
  switch (id) {
    case OpId::ElementwiseMul:
    case OpId::Mul:
    case OpId::Div:
    case OpId::Relu:
    case OpId::Exp:
    case OpId::Matmul: return true;
    default: return false;
  }
}

}  // namespace

// ---------------------------------------------------------------- call_op

TensorPtr call_op(OpId id, std::span<const Operand> ops, const OpOptions& options) {
  const OpDef& def = op_def(id);
  if (static_cast<int>(ops.size()) != def.arity)
    raise<TypeError>(def.name, " takes ", def.arity, " operand", def.arity == 1 ? "" : "s", ", got ", ops.size());
  const Operand* first = nullptr;
  for (const auto& o : ops) {
    if (o.is_tensor()) {
      if (!first) first = &o;
      continue;
    }
    if (!def.weak_scalars) raise<TypeError>(def.name, " operands must be Tensors");
    if (o.scalar.kind == Value::Kind::Bool) raise<TypeError>(def.name, ": a weak scalar must be an int or a float, not a bool");
  }
  if (!first) raise<TypeError>(def.name, " needs at least one Tensor operand");
  const Carrier& dispatch = *first->tensor->carrier;
  for (const auto& o : ops) {
    if (!o.is_tensor()) continue;
    if (&o.tensor->carrier->kind() != &dispatch.kind())
      raise<TypeError>(def.name, ": Tensor backing carriers must match (", dispatch.kind_name(), " and ",
                       o.tensor->carrier->kind_name(), "); move a tensor first");
  }
  for (const auto& o : ops)
    if (o.is_tensor()) o.tensor->carrier->check_live("compute with it");
  OpBackend* backend = backend_for(dispatch.kind());
  if (!backend || !backend->supports(id))
    raise<NotImplementedError>(dispatch.kind_name(), backend ? " does not execute " : " executes no operations (",
                               backend ? def.name : "it is storage only", backend ? "" : ")");
  // Shapes, before any allocation.
  if (is_elementwise(id)) {
    Shape s = first->tensor->layout.shape();
    for (const auto& o : ops)
      if (o.is_tensor() && !(o.tensor->layout.shape() == s)) s = broadcast_shapes(s, o.tensor->layout.shape(), def.name);
  } else if (id == OpId::ReduceSum) {
    parse_reduce_description(options.description, first->tensor->layout.rank());
  } else {
    const Layout& l = ops[0].tensor->layout;
    const Layout& r = ops[1].tensor->layout;
    if (l.rank() != 2 || r.rank() != 2)
      raise<ValueError>("matmul operands must have two top-level modes, got ", l.shape().str(), " and ", r.shape().str());
    if (l.shape().extents()[1] != r.shape().extents()[1])
      raise<ValueError>("matmul: lhs ", l.shape().str(), " and rhs ", r.shape().str(),
                        " disagree on the contracted mode 1 (", l.shape().extents()[1], " vs ", r.shape().extents()[1], ")");
  }
  if (options.accumulate_f64 && id != OpId::ReduceSum && id != OpId::Matmul)
    raise<TypeError>(def.name, " takes no accumulator_dtype");

  TensorPtr result = backend->forward(id, ops, options);

  // Nothing is recorded with grad mode off: skip gathering the inputs then.
  if (!is_grad_enabled()) return result;
  std::vector<TensorPtr> inputs;
  for (const auto& o : ops)
    if (o.is_tensor()) inputs.push_back(o.tensor);
  if (should_record(inputs, result)) {
    auto node = std::make_shared<OpNode>();
    node->name = def.name;
    node->dispatch_kind = &dispatch.kind();
    node->id = id;
    node->operands.assign(ops.begin(), ops.end());
    node->options = options;
    node->inputs = inputs;
    if (saves_inputs(id))
      for (const auto& t : inputs) node->save(t);
    attach_node(node, result);
  }
  return result;
}

// ---------------------------------------------------------------- capabilities

std::vector<Capability> operation_capabilities(const Carrier& carrier, std::optional<OpId> only) {
  std::vector<Capability> out;
  OpBackend* backend = backend_for(carrier.kind());
  if (!backend) return out;
  std::vector<const DType*> dtypes;
  for (const DType* d : DType::registered())
    if (d->is_storage() && carrier.supports_storage_dtype(*d)) dtypes.push_back(d);
  for (const auto& def : kTable) {
    if (only && *only != def.id) continue;
    if (!backend->executes(carrier, def.id)) continue;
    if (def.arity == 1) {
      for (const DType* a : dtypes) out.push_back({def.id, {{false, a}}});
      continue;
    }
    for (const DType* a : dtypes)
      for (const DType* b : dtypes) out.push_back({def.id, {{false, a}, {false, b}}});
    if (def.weak_scalars) {
      for (const DType* a : dtypes)
        for (const DType* s : {&DType::Int32(), &DType::Float32()}) {
          out.push_back({def.id, {{false, a}, {true, s}}});
          out.push_back({def.id, {{true, s}, {false, a}}});
        }
    }
  }
  return out;
}

}  // namespace sw
