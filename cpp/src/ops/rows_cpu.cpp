// The row operations' fast CPU kernels and their VJPs' kernels (Note [Row operations] in rows.cpp): rows loaded
// into Float32 buffers (half.hpp's vector conversions for contiguous 16-bit runs), loops the compiler
// vectorises (compiled for AVX-512 and for the portable target, chosen at run time), rows split over the compute
// threads.
#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>

#include "activations.hpp"
#include "dense.hpp"
#include "half.hpp"
#include "rows.hpp"
#include "strided.hpp"
#include "strideweave/carriers/native.hpp"

#define SW_ROWS_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,fma")))
#define SW_ROWS_INLINE inline __attribute__((always_inline))

namespace sw::detail {

namespace {

constexpr int64_t kGrain = int64_t{1} << 15;  // elements per thread part
constexpr int kLanes = 16;

std::atomic<bool> g_portable{false};  // force_portable_row_kernels

bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
                         __builtin_cpu_supports("fma");
  return ok && !g_portable.load(std::memory_order_relaxed);
}

// ---------------------------------------------------------------- exp and the row loops

// exp(x) for x <= 0: exp_core (activations.hpp: Cephes' degree-6 polynomial after x = n ln2 + r, and 2^n in two
// exact factors so that results below 2^-126 stay subnormal) on x clamped to -104 (below it the result is 0, as
// exp's is in Float32); NaN stays NaN.
SW_ROWS_INLINE float exp_nonpositive(float x) {
  const float xc = x < -104.f ? -104.f : x;  // NaN compares false: it stays NaN
  const float y = exp_core(xc);              // garbage for NaN, replaced below
  return x != x ? x : y;
}

// softmax of buf[0, n) in place (Float32); the maximum, then exp(x - max) and their sum, then each / sum.
SW_ROWS_INLINE void softmax_row_impl(float* buf, int64_t n) {
  float mx[kLanes];
  for (int l = 0; l < kLanes; ++l) mx[l] = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  bool nan = false;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float v = buf[i + l];
      nan |= v != v;
      mx[l] = v > mx[l] ? v : mx[l];
    }
  for (; i < n; ++i) {
    nan |= buf[i] != buf[i];
    mx[0] = buf[i] > mx[0] ? buf[i] : mx[0];
  }
  float m = mx[0];
  for (int l = 1; l < kLanes; ++l) m = mx[l] > m ? mx[l] : m;
  if (nan) m = std::numeric_limits<float>::quiet_NaN();
  float acc[kLanes] = {};
  i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) {
      const float e = exp_nonpositive(buf[i + l] - m);
      buf[i + l] = e;
      acc[l] += e;
    }
  for (; i < n; ++i) {
    buf[i] = exp_nonpositive(buf[i] - m);
    acc[0] += buf[i];
  }
  float s = 0.f;
  for (int l = 0; l < kLanes; ++l) s += acc[l];
  for (i = 0; i < n; ++i) buf[i] = buf[i] / s;
}

// y = softmax(x) (x in buf, in place), then out = y (g - sum(g y)).
SW_ROWS_INLINE void softmax_backward_row_impl(float* buf, const float* g, float* out, int64_t n) {
  softmax_row_impl(buf, n);
  float acc[kLanes] = {};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int l = 0; l < kLanes; ++l) acc[l] += g[i + l] * buf[i + l];
  for (; i < n; ++i) acc[0] += g[i] * buf[i];
  float dot = 0.f;
  for (int l = 0; l < kLanes; ++l) dot += acc[l];
  for (i = 0; i < n; ++i) out[i] = buf[i] * (g[i] - dot);
}

SW_ROWS_INLINE void add_row_impl(float* acc, const float* x, int64_t n) {
  for (int64_t i = 0; i < n; ++i) acc[i] += x[i];
}

SW_ROWS_AVX512 void softmax_row_avx512(float* b, int64_t n) { softmax_row_impl(b, n); }
void softmax_row_portable(float* b, int64_t n) { softmax_row_impl(b, n); }
SW_ROWS_AVX512 void softmax_backward_row_avx512(float* b, const float* g, float* o, int64_t n) {
  softmax_backward_row_impl(b, g, o, n);
}
void softmax_backward_row_portable(float* b, const float* g, float* o, int64_t n) {
  softmax_backward_row_impl(b, g, o, n);
}
SW_ROWS_AVX512 void add_row_avx512(float* a, const float* x, int64_t n) { add_row_impl(a, x, n); }
void add_row_portable(float* a, const float* x, int64_t n) { add_row_impl(a, x, n); }

using SoftmaxRow = void (*)(float*, int64_t);
using SoftmaxBackwardRow = void (*)(float*, const float*, float*, int64_t);
using AddRow = void (*)(float*, const float*, int64_t);
SoftmaxRow softmax_row() { return has_avx512() ? &softmax_row_avx512 : &softmax_row_portable; }
SoftmaxBackwardRow softmax_backward_row() {
  return has_avx512() ? &softmax_backward_row_avx512 : &softmax_backward_row_portable;
}
AddRow add_row() { return has_avx512() ? &add_row_avx512 : &add_row_portable; }

}  // namespace

const char* row_kernel_path() { return has_avx512() ? "avx512f" : "portable"; }
bool force_portable_row_kernels(bool on) noexcept { return g_portable.exchange(on); }

namespace {

// ---------------------------------------------------------------- typed loads and stores

// n elements `s` slots apart from p, widened to Float32 (exact).
template <class T>
void load_row(const T* p, int64_t s, int64_t n, float* buf) {
  if (s == 1) {
    if constexpr (std::is_same_v<T, float>) std::memcpy(buf, p, static_cast<size_t>(n) * 4);
    else if constexpr (std::is_same_v<T, bfloat16>) bf16_to_f32(reinterpret_cast<const uint16_t*>(p), buf, n);
    else f16_to_f32(reinterpret_cast<const uint16_t*>(p), buf, n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<float>(p[i * s]);
}

// n Float32 values rounded once (to nearest even) to T, `s` slots apart from p.
template <class T>
void store_row(const float* buf, int64_t n, T* p, int64_t s) {
  if (s == 1) {
    if constexpr (std::is_same_v<T, float>) std::memcpy(p, buf, static_cast<size_t>(n) * 4);
    else if constexpr (std::is_same_v<T, bfloat16>) f32_to_bf16(buf, reinterpret_cast<uint16_t*>(p), n);
    else f32_to_f16(buf, reinterpret_cast<uint16_t*>(p), n);
    return;
  }
  for (int64_t i = 0; i < n; ++i) p[i * s] = T(buf[i]);
}

template <class F>
void visit_float(DTypeId id, F&& f) {
  switch (id) {
    case DTypeId::BFloat16: f(bfloat16{}); return;
    case DTypeId::Float16: f(float16{}); return;
    default: f(float{}); return;
  }
}

// Calls f(in_offset, out_offset, count, in_step, out_step) for runs of `count` rows, row r of a run starting at
// in_offset + r in_step (out_offset + r out_step), split over the compute threads.
template <class F>
void for_each_row_run(const RowGeometry& in, int64_t in_base, const RowGeometry& out, int64_t out_base, int64_t work,
                      F&& f) {
  const std::array<const std::vector<int64_t>*, 2> st{&in.outer_strides, &out.outer_strides};
  const auto plan = StridedPlan<2>::make(in.outer_extents, st, {in_base, out_base});
  parallel_for(in.outer_size, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, work)), [&](int64_t b, int64_t e) {
    plan.for_each_run(b, e, [&](int64_t, const std::array<int64_t, 2>& off, int64_t cnt, const std::array<int64_t, 2>& s) {
      f(off[0], off[1], cnt, s[0], s[1]);
    });
  });
}

// Rows loaded and stored a block at a time. When neighbouring rows are neighbouring slots (step 1) and a row's
// own elements are not (a softmax along mode 1 of a column-major matrix: a matmul's result), kRowBlock rows are
// read together, kRowBlock contiguous slots per element of the row, instead of one cache line per element.
constexpr int64_t kRowBlock = 16;

template <class T>
void load_rows(const T* p, int64_t step, int64_t stride, int64_t rows, int64_t n, float* buf) {
  if (step == 1 && stride != 1) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t b = 0; b < rows; ++b) buf[b * n + i] = static_cast<float>(p[b + i * stride]);
    return;
  }
  for (int64_t b = 0; b < rows; ++b) load_row(p + b * step, stride, n, buf + b * n);
}

template <class T>
void store_rows(const float* buf, int64_t rows, int64_t n, T* p, int64_t step, int64_t stride) {
  if (step == 1 && stride != 1) {
    for (int64_t i = 0; i < n; ++i)
      for (int64_t b = 0; b < rows; ++b) p[b + i * stride] = T(buf[b * n + i]);
    return;
  }
  for (int64_t b = 0; b < rows; ++b) store_row(buf + b * n, n, p + b * step, stride);
}

// Copies the `outer` elements of a slice (one mode coordinate fixed) between two tensors of `bytes`-sized
// elements: memcpy where a run is contiguous in both, a strided copy otherwise.
void copy_slice(const StridedPlan<2>& plan, int64_t outer, const std::byte* src, int64_t src_base, std::byte* dst,
                int64_t dst_base, size_t bytes) {
  plan.for_each_run(0, outer, [&](int64_t, const std::array<int64_t, 2>& off, int64_t cnt, const std::array<int64_t, 2>& s) {
    const std::byte* a = src + static_cast<size_t>(src_base + off[0]) * bytes;
    std::byte* b = dst + static_cast<size_t>(dst_base + off[1]) * bytes;
    if ((s[0] == 1 && s[1] == 1) || cnt == 1) {
      std::memcpy(b, a, static_cast<size_t>(cnt) * bytes);
      return;
    }
    auto strided = [&](auto tag) {
      using U = decltype(tag);
      const U* x = reinterpret_cast<const U*>(a);
      U* y = reinterpret_cast<U*>(b);
      for (int64_t i = 0; i < cnt; ++i) y[i * s[1]] = x[i * s[0]];
    };
    if (bytes == 4) strided(uint32_t{});
    else if (bytes == 2) strided(uint16_t{});
    else strided(uint8_t{});
  });
}

// Loads a slice into buf (Float32, outer-ordinal order) with plan operand `k`.
template <class T, size_t K>
void load_slice(const StridedPlan<K>& plan, size_t k, int64_t outer, const T* base, int64_t slice_base, float* buf) {
  plan.for_each_run(0, outer, [&](int64_t ord, const std::array<int64_t, K>& off, int64_t cnt, const std::array<int64_t, K>& s) {
    load_row(base + slice_base + off[k], s[k], cnt, buf + ord);
  });
}

template <class T, size_t K>
void store_slice(const StridedPlan<K>& plan, size_t k, int64_t outer, const float* buf, T* base, int64_t slice_base) {
  plan.for_each_run(0, outer, [&](int64_t ord, const std::array<int64_t, K>& off, int64_t cnt, const std::array<int64_t, K>& s) {
    store_row(buf + ord, cnt, base + slice_base + off[k], s[k]);
  });
}

// A host tensor with native memory: `t` itself, or a dense CPU Float32 copy of a tensor without (Generic,
// Evictable), for the VJPs' kernels.
TensorPtr on_host(const TensorImpl& t) {
  if (t.carrier->native_data()) return std::const_pointer_cast<TensorImpl>(t.shared_from_this());
  auto c = std::make_shared<CPUCarrier>(t.size(), DType::Float32(), true, true);
  std::vector<double> v = read_doubles(t);
  std::vector<float> f(v.begin(), v.end());
  c->write_slots(0, t.size(), f.data());
  return make_tensor(std::move(c), 0, column_major(t.layout.shape()));
}

// A Float32 result of `layout` on `prototype`'s kind holding `values` (ordered by the layout's slots).
TensorPtr float_result_on(const Carrier& prototype, const Layout& layout, std::vector<float>& values) {
  CarrierPtr c = prototype.allocate_like(layout.size(), true, DType::Float32(), true);
  if (std::byte* d = c->mutable_native_data()) std::memcpy(d, values.data(), values.size() * 4);
  else c->write_slots(0, static_cast<int64_t>(values.size()), values.data());
  return make_tensor(std::move(c), 0, layout);
}

int64_t mode_of(const OpOptions& o, const TensorImpl& t, const char* op) {
  return static_cast<int64_t>(normalized_mode(o.mode, t.layout.rank(), op));
}

}  // namespace

float row_exp(float x) noexcept { return exp_nonpositive(x); }

// ---------------------------------------------------------------- softmax

TensorPtr cpu_softmax(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  const TensorImpl& t = *ops[0].tensor;
  const size_t m = static_cast<size_t>(mode_of(options, t, def.name));
  TensorPtr out = row_result(t, t.layout.shape(), t.dtype());
  const RowGeometry gi = row_geometry(t.layout, m, def.name), go = row_geometry(out->layout, m, def.name);
  const int64_t n = gi.extent;
  const SoftmaxRow row = softmax_row();
  visit_float(t.dtype().id(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = reinterpret_cast<const T*>(t.carrier->native_data());
    T* y = reinterpret_cast<T*>(out->carrier->mutable_native_data());
    for_each_row_run(gi, t.offset, go, 0, n, [&](int64_t io, int64_t oo, int64_t cnt, int64_t si, int64_t so) {
      std::vector<float> buf(static_cast<size_t>(std::min(cnt, kRowBlock) * n));
      for (int64_t r = 0; r < cnt; r += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, cnt - r);
        load_rows(x + io + r * si, si, gi.stride, rows, n, buf.data());
        for (int64_t b = 0; b < rows; ++b) row(buf.data() + b * n, n);
        store_rows(buf.data(), rows, n, y + oo + r * so, so, go.stride);
      }
    });
  });
  return out;
}

TensorPtr softmax_backward(const TensorImpl& x_in, const TensorImpl& g_in, size_t m, const Carrier& prototype) {
  TensorPtr x = on_host(x_in), g = on_host(g_in);
  const Layout layout = row_result_layout(x_in.layout, x_in.layout.shape());
  const RowGeometry gx = row_geometry(x->layout, m, "softmax"), gg = row_geometry(g->layout, m, "softmax");
  const RowGeometry go = row_geometry(layout, m, "softmax");
  const int64_t n = gx.extent;
  std::vector<float> out(static_cast<size_t>(layout.size()));
  const SoftmaxBackwardRow row = softmax_backward_row();
  // Rows of x and of g: the outer leaves of both are those of x's shape, so one plan pairs them (then the output).
  const std::array<const std::vector<int64_t>*, 3> st{&gx.outer_strides, &gg.outer_strides, &go.outer_strides};
  const auto plan = StridedPlan<3>::make(gx.outer_extents, st, {x->offset, g->offset, 0});
  visit_float(x->dtype().id(), [&](auto xtag) {
    visit_float(g->dtype().id(), [&](auto gtag) {
      using TX = decltype(xtag);
      using TG = decltype(gtag);
      const TX* xp = reinterpret_cast<const TX*>(x->carrier->native_data());
      const TG* gp = reinterpret_cast<const TG*>(g->carrier->native_data());
      parallel_for(gx.outer_size, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, n)), [&](int64_t b, int64_t e) {
        const size_t size = static_cast<size_t>(kRowBlock * n);
        std::vector<float> buf(size), gb(size), ob(size);
        plan.for_each_run(b, e, [&](int64_t, const std::array<int64_t, 3>& off, int64_t cnt, const std::array<int64_t, 3>& s) {
          for (int64_t r = 0; r < cnt; r += kRowBlock) {
            const int64_t rows = std::min(kRowBlock, cnt - r);
            load_rows(xp + off[0] + r * s[0], s[0], gx.stride, rows, n, buf.data());
            load_rows(gp + off[1] + r * s[1], s[1], gg.stride, rows, n, gb.data());
            for (int64_t q = 0; q < rows; ++q) row(buf.data() + q * n, gb.data() + q * n, ob.data() + q * n, n);
            store_rows(ob.data(), rows, n, out.data() + off[2] + r * s[2], s[2], go.stride);
          }
        });
      });
    });
  });
  return float_result_on(prototype, layout, out);
}

// ---------------------------------------------------------------- topk

namespace {

// Whether (a, ia) comes before (b, ib): larger first, NaN above every number, equal values by the lower index.
inline bool before(float a, int32_t ia, float b, int32_t ib) {
  const bool an = a != a, bn = b != b;
  if (an || bn) return an && (!bn || ia < ib);
  if (a != b) return a > b;
  return ia < ib;
}

// The k first of row[0, n) in that order: values into vals, indices into idx.
void select_top(const float* row, int64_t n, int64_t k, float* vals, int32_t* idx, std::vector<int32_t>& scratch) {
  if (k <= 32) {
    int64_t count = 0;
    for (int64_t i = 0; i < n; ++i) {
      const float v = row[i];
      const int32_t ii = static_cast<int32_t>(i);
      if (count == k && !before(v, ii, vals[k - 1], idx[k - 1])) continue;
      int64_t p = count < k ? count++ : k - 1;  // the slot to fill, then bubble it up
      while (p > 0 && before(v, ii, vals[p - 1], idx[p - 1])) {
        vals[p] = vals[p - 1];
        idx[p] = idx[p - 1];
        --p;
      }
      vals[p] = v;
      idx[p] = ii;
    }
    return;
  }
  scratch.resize(static_cast<size_t>(n));
  std::iota(scratch.begin(), scratch.end(), 0);
  std::partial_sort(scratch.begin(), scratch.begin() + k, scratch.end(),
                    [&](int32_t a, int32_t b) { return before(row[a], a, row[b], b); });
  for (int64_t j = 0; j < k; ++j) {
    idx[j] = scratch[static_cast<size_t>(j)];
    vals[j] = row[idx[j]];
  }
}

}  // namespace

TensorPtr cpu_topk(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  const TensorImpl& t = *ops[0].tensor;
  const size_t m = static_cast<size_t>(mode_of(options, t, def.name));
  const int64_t k = options.k;
  const Shape rs = with_extent(t.layout.shape(), m, k);
  TensorPtr values = row_result(t, rs, t.dtype());
  TensorPtr indices = make_tensor(t.carrier->allocate_like(rs.size(), true, DType::Int32(), true), 0, values->layout);
  const RowGeometry gi = row_geometry(t.layout, m, def.name), go = row_geometry(values->layout, m, def.name);
  const int64_t n = gi.extent;
  visit_float(t.dtype().id(), [&](auto tag) {
    using T = decltype(tag);
    const T* x = reinterpret_cast<const T*>(t.carrier->native_data());
    T* v = reinterpret_cast<T*>(values->carrier->mutable_native_data());
    int32_t* ix = reinterpret_cast<int32_t*>(indices->carrier->mutable_native_data());
    for_each_row_run(gi, t.offset, go, 0, n, [&](int64_t io, int64_t oo, int64_t cnt, int64_t si, int64_t so) {
      std::vector<float> buf(static_cast<size_t>(std::min(cnt, kRowBlock) * n)), vals(static_cast<size_t>(k));
      std::vector<int32_t> idx(static_cast<size_t>(k)), scratch;
      for (int64_t r = 0; r < cnt; r += kRowBlock) {
        const int64_t rows = std::min(kRowBlock, cnt - r);
        load_rows(x + io + r * si, si, gi.stride, rows, n, buf.data());
        for (int64_t b = 0; b < rows; ++b) {
          const int64_t o = oo + (r + b) * so;
          select_top(buf.data() + b * n, n, k, vals.data(), idx.data(), scratch);
          store_row(vals.data(), k, v + o, go.stride);  // exact: each value came from T
          for (int64_t j = 0; j < k; ++j) ix[o + j * go.stride] = idx[static_cast<size_t>(j)];
        }
      }
    });
  });
  *options.second = std::move(indices);
  return values;
}

TensorPtr topk_backward(const TensorImpl& g_in, const TensorImpl& idx_in, const Shape& shape, size_t m,
                        const Carrier& prototype) {
  TensorPtr g = on_host(g_in), ind = on_host(idx_in);
  const Layout layout = row_result_layout(g_in.layout, shape);
  const RowGeometry gg = row_geometry(g->layout, m, "topk"), gi = row_geometry(ind->layout, m, "topk");
  const RowGeometry go = row_geometry(layout, m, "topk");
  const int64_t k = gg.extent;
  std::vector<float> out(static_cast<size_t>(layout.size()), 0.f);
  const bool int_indices = ind->dtype().id() == DTypeId::Int32;  // on_host widened a non-native one to Float32
  const std::array<const std::vector<int64_t>*, 3> st{&gg.outer_strides, &gi.outer_strides, &go.outer_strides};
  const auto plan = StridedPlan<3>::make(gg.outer_extents, st, {g->offset, ind->offset, 0});
  visit_float(g->dtype().id(), [&](auto tag) {
    using T = decltype(tag);
    const T* gp = reinterpret_cast<const T*>(g->carrier->native_data());
    const std::byte* ip = ind->carrier->native_data();
    parallel_for(gg.outer_size, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, k)), [&](int64_t b, int64_t e) {
      plan.for_each_run(b, e, [&](int64_t, const std::array<int64_t, 3>& off, int64_t cnt, const std::array<int64_t, 3>& s) {
        for (int64_t r = 0; r < cnt; ++r)
          for (int64_t j = 0; j < k; ++j) {
            const int64_t slot = off[1] + r * s[1] + j * gi.stride;
            const int64_t i = int_indices ? reinterpret_cast<const int32_t*>(ip)[slot]
                                          : static_cast<int64_t>(reinterpret_cast<const float*>(ip)[slot]);
            out[static_cast<size_t>(off[2] + r * s[2] + i * go.stride)] +=
                static_cast<float>(gp[off[0] + r * s[0] + j * gg.stride]);
          }
      });
    });
  });
  return float_result_on(prototype, layout, out);
}

// ---------------------------------------------------------------- index_select and index_add

TensorPtr cpu_index_select(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  const TensorImpl& t = *ops[0].tensor;
  const size_t m = static_cast<size_t>(mode_of(options, t, def.name));
  const std::vector<int32_t> idx = index_values(*ops[1].tensor);
  const int64_t J = static_cast<int64_t>(idx.size());
  TensorPtr out = row_result(t, with_extent(t.layout.shape(), m, J), t.dtype());
  const RowGeometry gi = row_geometry(t.layout, m, def.name), go = row_geometry(out->layout, m, def.name);
  const std::array<const std::vector<int64_t>*, 2> st{&gi.outer_strides, &go.outer_strides};
  const auto plan = StridedPlan<2>::make(gi.outer_extents, st, {0, 0});
  const size_t bytes = t.dtype().itemsize();
  const std::byte* src = t.carrier->native_data();
  std::byte* dst = out->carrier->mutable_native_data();
  parallel_for(J, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, gi.outer_size)), [&](int64_t b, int64_t e) {
    for (int64_t j = b; j < e; ++j)
      copy_slice(plan, gi.outer_size, src, t.offset + idx[static_cast<size_t>(j)] * gi.stride, dst, j * go.stride, bytes);
  });
  return out;
}

TensorPtr cpu_index_add(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  const TensorImpl& t = *ops[0].tensor;
  const TensorImpl& src = *ops[2].tensor;
  const size_t m = static_cast<size_t>(mode_of(options, t, def.name));
  const std::vector<int32_t> idx = index_values(*ops[1].tensor);
  TensorPtr out = row_result(t, t.layout.shape(), t.dtype());
  const RowGeometry gt = row_geometry(t.layout, m, def.name), go = row_geometry(out->layout, m, def.name);
  const RowGeometry gs = row_geometry(src.layout, m, def.name);
  // The source rows sent to each destination row, in index order (counting sort).
  const int64_t n = gt.extent, outer = gt.outer_size;
  std::vector<int64_t> start(static_cast<size_t>(n) + 1, 0), order(idx.size());
  for (int32_t d : idx) ++start[static_cast<size_t>(d) + 1];
  for (int64_t d = 0; d < n; ++d) start[static_cast<size_t>(d) + 1] += start[static_cast<size_t>(d)];
  {
    std::vector<int64_t> fill(start.begin(), start.end() - 1);
    for (size_t j = 0; j < idx.size(); ++j) order[static_cast<size_t>(fill[static_cast<size_t>(idx[j])]++)] = static_cast<int64_t>(j);
  }
  const std::array<const std::vector<int64_t>*, 3> st{&gt.outer_strides, &go.outer_strides, &gs.outer_strides};
  const auto plan = StridedPlan<3>::make(gt.outer_extents, st, {0, 0, 0});
  const std::array<const std::vector<int64_t>*, 2> st2{&gt.outer_strides, &go.outer_strides};
  const auto copy_plan = StridedPlan<2>::make(gt.outer_extents, st2, {0, 0});
  const AddRow add = add_row();
  visit_float(t.dtype().id(), [&](auto tag) {
    using T = decltype(tag);
    const T* tp = reinterpret_cast<const T*>(t.carrier->native_data());
    const T* sp = reinterpret_cast<const T*>(src.carrier->native_data());
    T* op = reinterpret_cast<T*>(out->carrier->mutable_native_data());
    const int64_t per_row = outer * (1 + static_cast<int64_t>(idx.size()) / std::max<int64_t>(1, n));
    parallel_for(n, std::max<int64_t>(1, kGrain / std::max<int64_t>(1, per_row)), [&](int64_t b, int64_t e) {
      std::vector<float> acc, tmp;
      for (int64_t d = b; d < e; ++d) {
        const int64_t tb = t.offset + d * gt.stride, ob = d * go.stride;
        const int64_t first = start[static_cast<size_t>(d)], last = start[static_cast<size_t>(d) + 1];
        if (first == last) {
          copy_slice(copy_plan, outer, reinterpret_cast<const std::byte*>(tp), tb, reinterpret_cast<std::byte*>(op), ob,
                     sizeof(T));
          continue;
        }
        acc.resize(static_cast<size_t>(outer));
        tmp.resize(static_cast<size_t>(outer));
        load_slice(plan, 0, outer, tp, tb, acc.data());
        for (int64_t q = first; q < last; ++q) {
          load_slice(plan, 2, outer, sp, src.offset + order[static_cast<size_t>(q)] * gs.stride, tmp.data());
          add(acc.data(), tmp.data(), outer);
        }
        store_slice(plan, 1, outer, acc.data(), op, ob);
      }
    });
  });
  return out;
}

}  // namespace sw::detail
