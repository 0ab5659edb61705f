// The fast CPU kernels: contiguous fast paths the compiler vectorises,
// broadcast/strided runs without per-element dispatch, threads for large
// work. Matmul (BLAS) is in cpu_matmul.cpp.
#include <algorithm>
#include <cassert>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>

#include "activations.hpp"
#include "kernels.hpp"
#include "half.hpp"
#include "skinny_gemm.hpp"
#include "strided.hpp"
#include "strideweave/errors.hpp"

namespace sw::detail {

namespace {

constexpr int64_t kGrain = int64_t{1} << 16;

template <class T>
inline constexpr bool is_half_v = std::is_same_v<T, bfloat16> || std::is_same_v<T, float16>;

// Float32 results narrowed to a 16-bit dtype a block at a time (half.hpp's vector conversions): a run is computed
// into a Float32 block by `fill(block, first, count)`, then rounded once per element.
constexpr int64_t kHalfBlock = 512;
template <class TO, class Fill>
void through_float_blocks(TO* out, int64_t n, Fill fill) {
  float block[kHalfBlock];
  for (int64_t b = 0; b < n; b += kHalfBlock) {
    const int64_t len = std::min(kHalfBlock, n - b);
    fill(block, b, len);
    if constexpr (std::is_same_v<TO, bfloat16>) f32_to_bf16(block, reinterpret_cast<uint16_t*>(out + b), len);
    else f32_to_f16(block, reinterpret_cast<uint16_t*>(out + b), len);
  }
}

template <class T>
const T* typed(const KernelInput& in) {
  return reinterpret_cast<const T*>(in.carrier ? in.data : in.scalar_bytes);
}

struct AddF { template <class C> C operator()(C a, C b) const { return a + b; } };
struct SubF { template <class C> C operator()(C a, C b) const { return a - b; } };
struct MulF { template <class C> C operator()(C a, C b) const { return a * b; } };
struct DivF { template <class C> C operator()(C a, C b) const { return a / b; } };
// relu: +0 at or below zero, else x itself, so a NaN passes through with its sign and payload, as PyTorch's does
// (`a > 0 ? a : 0` gave 0 for NaN: every comparison with NaN is false). -0.0 gives +0.0 (PyTorch keeps -0.0).
struct ReluF { template <class C> C operator()(C a) const { return a <= C(0) ? C(0) : a; } };
struct NegF { template <class C> C operator()(C a) const { return -a; } };
struct ExpF {
  float operator()(float a) const { return std::exp(a); }
  double operator()(double a) const { return std::exp(a); }
};

template <class TO, class C>
inline bool store(TO* dst, C v) {
  if constexpr (std::is_same_v<TO, int32_t>) {
    *dst = static_cast<int32_t>(v);
    return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
  } else if constexpr (std::is_same_v<TO, bool>) {
    *dst = v != C(0);
    return true;
  } else if constexpr (is_half_v<TO>) {
    *dst = TO(static_cast<float>(v));  // the Float32 result, rounded once (Note [16-bit floats])
    return true;
  } else {
    *dst = static_cast<TO>(v);
    return true;
  }
}

// Whether `strides` walk the leaves `ext` densely in ordinal order (each
// non-trivial leaf's stride is the product of the extents before it), so that
// ordinal i sits at offset + i. StridedPlan would merge such leaves into one
// unit-stride run; the kernels then skip building the plan.
bool dense_in_order(const std::vector<int64_t>& ext, const std::vector<int64_t>& strides) {
  int64_t expect = 1;
  for (size_t j = 0; j < ext.size(); ++j) {
    if (ext[j] == 1) continue;
    if (strides[j] != expect) return false;
    expect *= ext[j];
  }
  return true;
}

int64_t product(const std::vector<int64_t>& ext) {
  int64_t n = 1;
  for (int64_t e : ext) n *= e;
  return n;
}

template <class C, class TO, class TA, class TB, class F>
void binary(const KernelInput& a, const KernelInput& b, TO* out, const std::vector<int64_t>& ext, F f,
            std::atomic<bool>& overflow) {
  const std::array<int64_t, 2> base{a.carrier ? a.offset : 0, b.carrier ? b.offset : 0};
  const bool dense = dense_in_order(ext, a.strides) && dense_in_order(ext, b.strides);
  StridedPlan<2> plan;
  if (!dense) {
    std::array<const std::vector<int64_t>*, 2> strides{&a.strides, &b.strides};
    plan = StridedPlan<2>::make(ext, strides, base);
  }
  const TA* pa = typed<TA>(a);
  const TB* pb = typed<TB>(b);
  parallel_for(dense ? product(ext) : plan.size, kGrain, [&](int64_t begin, int64_t end) {
    bool ok = true;
    auto loops = [&](auto* o, const TA* x, const TB* y, int64_t n, const std::array<int64_t, 2>& st) {
      if constexpr (std::is_integral_v<C>) {
        for (int64_t i = 0; i < n; ++i) ok &= store(o + i, f(C(x[i * st[0]]), C(y[i * st[1]])));
      } else if (st[0] == 1 && st[1] == 1) {
        for (int64_t i = 0; i < n; ++i) store(o + i, f(C(x[i]), C(y[i])));
      } else if (st[0] == 1 && st[1] == 0) {
        const C yv = C(*y);
        for (int64_t i = 0; i < n; ++i) store(o + i, f(C(x[i]), yv));
      } else if (st[0] == 0 && st[1] == 1) {
        const C xv = C(*x);
        for (int64_t i = 0; i < n; ++i) store(o + i, f(xv, C(y[i])));
      } else {
        for (int64_t i = 0; i < n; ++i) store(o + i, f(C(x[i * st[0]]), C(y[i * st[1]])));
      }
    };
    auto run = [&](int64_t ord, const std::array<int64_t, 2>& off, int64_t n, const std::array<int64_t, 2>& st) {
      const TA* x = pa + off[0];
      const TB* y = pb + off[1];
      if constexpr (is_half_v<TO>) {
        through_float_blocks(out + ord, n, [&](float* blk, int64_t b, int64_t len) {
          loops(blk, x + b * st[0], y + b * st[1], len, st);
        });
      } else {
        loops(out + ord, x, y, n, st);
      }
    };
    if (dense) run(begin, {base[0] + begin, base[1] + begin}, end - begin, {1, 1});
    else plan.for_each_run(begin, end, run);
    if (!ok) overflow.store(true);
  });
}

template <class C, class TO, class TA, class F>
void unary(const KernelInput& a, TO* out, const std::vector<int64_t>& ext, F f, std::atomic<bool>& overflow) {
  const bool dense = dense_in_order(ext, a.strides);
  StridedPlan<1> plan;
  if (!dense) {
    std::array<const std::vector<int64_t>*, 1> strides{&a.strides};
    plan = StridedPlan<1>::make(ext, strides, {a.offset});
  }
  const TA* pa = typed<TA>(a);
  parallel_for(dense ? product(ext) : plan.size, kGrain, [&](int64_t begin, int64_t end) {
    bool ok = true;
    auto loops = [&](auto* o, const TA* x, int64_t n, int64_t st) {
      if (st == 1) {
        for (int64_t i = 0; i < n; ++i) ok &= store(o + i, f(C(x[i])));
      } else {
        for (int64_t i = 0; i < n; ++i) ok &= store(o + i, f(C(x[i * st])));
      }
    };
    auto run = [&](int64_t ord, const std::array<int64_t, 1>& off, int64_t n, const std::array<int64_t, 1>& st) {
      const TA* x = pa + off[0];
      if constexpr (is_half_v<TO>) {
        through_float_blocks(out + ord, n, [&](float* blk, int64_t b, int64_t len) { loops(blk, x + b * st[0], len, st[0]); });
      } else {
        loops(out + ord, x, n, st[0]);
      }
    };
    if (dense) run(begin, {a.offset + begin}, end - begin, {1});
    else plan.for_each_run(begin, end, run);
    if (!ok) overflow.store(true);
  });
}

// Calls f(T{}) with the element type of a float result dtype: Float32, BFloat16 or Float16.
template <class F>
void visit_float_result(DTypeId od, F&& f) {
  if (od == DTypeId::BFloat16) f(bfloat16{});
  else if (od == DTypeId::Float16) f(float16{});
  else f(float{});
}

template <class F>
void dispatch_binary(const std::vector<KernelInput>& in, const std::vector<int64_t>& ext, Carrier& out, F f,
                     std::atomic<bool>& overflow) {
  const DTypeId od = out.dtype().id();
  const bool any_int = in[0].dtype == DTypeId::Int32 || in[1].dtype == DTypeId::Int32;
  visit_dtype(in[0].dtype, [&](auto ta) {
    visit_dtype(in[1].dtype, [&](auto tb) {
      using TA = decltype(ta);
      using TB = decltype(tb);
      if constexpr (!std::is_same_v<TA, double> && !std::is_same_v<TB, double>) {
        if (od == DTypeId::Int32) {
          binary<int64_t, int32_t, TA, TB>(in[0], in[1], reinterpret_cast<int32_t*>(out.mutable_native_data()), ext, f,
                                           overflow);
        } else {
          visit_float_result(od, [&](auto to) {
            using TO = decltype(to);
            TO* o = reinterpret_cast<TO*>(out.mutable_native_data());
            if (any_int) binary<double, TO, TA, TB>(in[0], in[1], o, ext, f, overflow);  // exact, as the reference
            else binary<float, TO, TA, TB>(in[0], in[1], o, ext, f, overflow);
          });
        }
      }
    });
  });
}

template <class F>
void dispatch_unary(const KernelInput& a, const std::vector<int64_t>& ext, Carrier& out, F f,
                    std::atomic<bool>& overflow) {
  const DTypeId od = out.dtype().id();
  visit_dtype(a.dtype, [&](auto ta) {
    using TA = decltype(ta);
    if constexpr (!std::is_same_v<TA, double>) {
      if (od == DTypeId::Int32) {
        if constexpr (!std::is_same_v<F, ExpF>)
          unary<int64_t, int32_t, TA>(a, reinterpret_cast<int32_t*>(out.mutable_native_data()), ext, f, overflow);
      } else if (od == DTypeId::Bool) {
        if constexpr (std::is_same_v<F, ReluF>)
          unary<int32_t, bool, TA>(a, reinterpret_cast<bool*>(out.mutable_native_data()), ext, f, overflow);
      } else {
        visit_float_result(od, [&](auto to) {
          using TO = decltype(to);
          TO* o = reinterpret_cast<TO*>(out.mutable_native_data());
          if (a.dtype == DTypeId::Int32) unary<double, TO, TA>(a, o, ext, f, overflow);
          else unary<float, TO, TA>(a, o, ext, f, overflow);
        });
      }
    }
  });
}

}  // namespace

namespace {

template <class F>
void binary_op(const ElementwiseCall& c, F f) {
  std::atomic<bool> overflow{false};
  dispatch_binary(c.in, c.result_extents, c.out, f, overflow);
  if (overflow.load()) raise<OverflowError>(c.op, ": Int32 result overflows");
}

template <class F>
void unary_op(const ElementwiseCall& c, F f) {
  std::atomic<bool> overflow{false};
  dispatch_unary(c.in[0], c.result_extents, c.out, f, overflow);
  if (overflow.load()) raise<OverflowError>(c.op, ": Int32 result overflows");
}

}  // namespace

// The CPU backend's element-wise kernels, named by the table's rows (Note [The operation table]).
namespace cpu {
void add(const ElementwiseCall& c) { binary_op(c, AddF{}); }
void sub(const ElementwiseCall& c) { binary_op(c, SubF{}); }
void mul(const ElementwiseCall& c) { binary_op(c, MulF{}); }
void div(const ElementwiseCall& c) { binary_op(c, DivF{}); }
void relu(const ElementwiseCall& c) { unary_op(c, ReluF{}); }
void neg(const ElementwiseCall& c) { unary_op(c, NegF{}); }
void exp(const ElementwiseCall& c) { unary_op(c, ExpF{}); }
}  // namespace cpu

// silu and sigmoid (activations.hpp): a dense Float32 or 16-bit operand of the result's dtype runs the dense kernel
// (AVX-512 where present), anything else (strided, broadcast, Int32, Bool) the functor through the loops above.
namespace {
int half_code(DTypeId d) { return d == DTypeId::BFloat16 ? 1 : d == DTypeId::Float16 ? 2 : d == DTypeId::Float32 ? 0 : -1; }

template <Activation A, class F>
void activation_op(const ElementwiseCall& c, F f) {
  const KernelInput& x = c.in[0];
  const int code = half_code(x.dtype);
  if (code >= 0 && x.dtype == c.out.dtype().id() && dense_in_order(c.result_extents, x.strides)) {
    const std::byte* base = x.data + x.offset * static_cast<int64_t>(code == 0 ? 4 : 2);
    activation_dense(A, base, code, c.out.mutable_native_data(), code, product(c.result_extents));
    return;
  }
  unary_op(c, f);
}

// The backward kernels see float operands only (a gradient and a differentiable input): the loops are
// instantiated for those alone, in Float32.
template <Activation A, class F>
void activation_grad_op(const ElementwiseCall& c, F f) {
  const KernelInput &g = c.in[0], &x = c.in[1];
  const DTypeId od = c.out.dtype().id();
  assert(half_code(g.dtype) >= 0 && half_code(x.dtype) >= 0 && half_code(od) >= 0);
  if (g.dtype == DTypeId::Float32 && x.dtype == DTypeId::Float32 && od == DTypeId::Float32 &&
      dense_in_order(c.result_extents, g.strides) && dense_in_order(c.result_extents, x.strides)) {
    activation_grad_dense(A, typed<float>(g) + g.offset, typed<float>(x) + x.offset,
                          reinterpret_cast<float*>(c.out.mutable_native_data()), product(c.result_extents));
    return;
  }
  std::atomic<bool> overflow{false};
  visit_float_result(g.dtype, [&](auto tg) {
    visit_float_result(x.dtype, [&](auto tx) {
      visit_float_result(od, [&](auto to) {
        using TO = decltype(to);
        binary<float, TO, decltype(tg), decltype(tx)>(g, x, reinterpret_cast<TO*>(c.out.mutable_native_data()),
                                                      c.result_extents, f, overflow);
      });
    });
  });
}
}  // namespace

namespace cpu {
void silu(const ElementwiseCall& c) { activation_op<Activation::Silu>(c, SiluF{}); }
void sigmoid(const ElementwiseCall& c) { activation_op<Activation::Sigmoid>(c, SigmoidF{}); }
void silu_backward(const ElementwiseCall& c) { activation_grad_op<Activation::Silu>(c, SiluGradF{}); }
void sigmoid_backward(const ElementwiseCall& c) { activation_grad_op<Activation::Sigmoid>(c, SigmoidGradF{}); }
}  // namespace cpu

void cpu_reduce_sum(const TensorImpl& in, const Layout& permuted, int64_t kept, bool f64, Carrier& out) {
  std::array<const std::vector<int64_t>*, 1> strides{&permuted.flat().strides};
  auto plan = StridedPlan<1>::make(permuted.flat().extents, strides, {in.offset});
  const std::byte* base = in.carrier->native_data();
  const DTypeId d = in.dtype().id();
  (void)f64;  // float sums (Float32, BFloat16, Float16) always accumulate in double here, rounded once
  visit_dtype(d, [&](auto t) {
    using T = decltype(t);
    if constexpr (!std::is_same_v<T, double>) {
      using Acc = std::conditional_t<std::is_same_v<T, int32_t>, int64_t, double>;
      std::vector<Acc> acc(static_cast<size_t>(kept), Acc(0));
      const T* x = reinterpret_cast<const T*>(base);
      plan.for_each_run(0, plan.size, [&](int64_t ord, const std::array<int64_t, 1>& off, int64_t n,
                                          const std::array<int64_t, 1>& st) {
        int64_t o = ord % kept;
        const T* p = x + off[0];
        if (st[0] == 1 && o + n <= kept) {
          for (int64_t i = 0; i < n; ++i) acc[o + i] += Acc(p[i]);
          return;
        }
        for (int64_t i = 0; i < n; ++i) {
          acc[o] += Acc(p[i * st[0]]);
          if (++o == kept) o = 0;
        }
      });
      std::byte* dst = out.mutable_native_data();
      const DTypeId od = out.dtype().id();
      bool ok = true;
      for (int64_t i = 0; i < kept; ++i) {
        if (od == DTypeId::Float32) ok &= store(reinterpret_cast<float*>(dst) + i, double(acc[i]));
        else if (od == DTypeId::BFloat16) reinterpret_cast<uint16_t*>(dst)[i] = double_to_bf16_bits(double(acc[i]));
        else if (od == DTypeId::Float16) reinterpret_cast<uint16_t*>(dst)[i] = double_to_f16_bits(double(acc[i]));
        else if (od == DTypeId::Int32) ok &= store(reinterpret_cast<int32_t*>(dst) + i, int64_t(acc[i]));
        else ok &= store(reinterpret_cast<bool*>(dst) + i, acc[i]);
      }
      if (!ok) raise<OverflowError>("reduce_sum: Int32 result overflows");
    }
  });
}

}  // namespace sw::detail
