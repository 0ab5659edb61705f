// silu and sigmoid: the dense kernels (AVX-512 with run-time dispatch, a portable loop elsewhere) and the VJPs,
// by Note [Stable sigmoid] in activations.hpp. The element-wise entries of the table's rows are in cpu_kernels.cpp
// and generic_kernels.cpp beside the other operations'.
#include "activations.hpp"

#include <immintrin.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "half.hpp"
#include "kernels.hpp"
#include "op_table.hpp"
#include "simd_masks.hpp"
#include "strided.hpp"
#include "strideweave/carriers/native.hpp"
#include "vjps.hpp"

// GCC 12 reports the intrinsics header's own deliberately undefined vectors (in the unmasked forms it builds
// on) as used uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define SW_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))

namespace sw::detail {

namespace {

constexpr int64_t kGrain = int64_t{1} << 15;
std::atomic<bool> g_portable{false};

bool use_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  return ok && !g_portable.load(std::memory_order_relaxed);
}

// ---------------------------------------------------------------- AVX-512F

// exp(-|x|) for 16 lanes: exp_core's reduction and polynomial, with scalef for the 2^n (one rounding into the
// subnormals, as exp_core's two steps). NaN lanes give garbage here; the callers blend x back in.
SW_AVX512 inline __m512 exp_neg_abs16(__m512 x) {
  const __m512 t = _mm512_max_ps(_mm512_set1_ps(-104.0f), _mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(x)));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(t, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), t);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The lanes' results: sigmoid or silu of x (forward), or g times its derivative (backward), x's NaNs kept.
template <Activation A, bool Grad>
SW_AVX512 inline __m512 lanes(__m512 x, __m512 g) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 e = exp_neg_abs16(x);
  const __m512 d = _mm512_add_ps(one, e);
  const __mmask16 pos = _mm512_cmp_ps_mask(x, _mm512_setzero_ps(), _CMP_GE_OQ);
  __m512 r;
  if constexpr (A == Activation::Sigmoid && Grad) {
    r = _mm512_mul_ps(g, _mm512_div_ps(e, _mm512_mul_ps(d, d)));
  } else {
    const __m512 s = _mm512_div_ps(_mm512_mask_blend_ps(pos, e, one), d);
    if constexpr (A == Activation::Sigmoid) {
      r = s;
    } else if constexpr (!Grad) {
      r = _mm512_mul_ps(x, s);
    } else {
      const __m512 c = _mm512_div_ps(_mm512_mask_blend_ps(pos, one, e), d);
      r = _mm512_mul_ps(g, _mm512_mul_ps(s, _mm512_fmadd_ps(x, c, one)));
    }
  }
  return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), r, x);
}

template <Activation A, bool Grad>
SW_AVX512 void run_avx512(const float* g, const float* x, float* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 gv = Grad ? _mm512_loadu_ps(g + i) : _mm512_setzero_ps();
    _mm512_storeu_ps(out + i, lanes<A, Grad>(_mm512_loadu_ps(x + i), gv));
  }
  if (i < n) {
    const __mmask16 m = lanes16(n - i);
    const __m512 gv = Grad ? _mm512_maskz_loadu_ps(m, g + i) : _mm512_setzero_ps();
    _mm512_mask_storeu_ps(out + i, m, lanes<A, Grad>(_mm512_maskz_loadu_ps(m, x + i), gv));
  }
}

// ---------------------------------------------------------------- portable

template <class F>
void run_portable(const float* x, float* out, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) out[i] = f(x[i]);
}
template <class F>
void run_portable(const float* g, const float* x, float* out, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) out[i] = f(g[i], x[i]);
}

void forward_f32(Activation a, const float* x, float* out, int64_t n) {
  if (use_avx512()) {
    if (a == Activation::Silu) run_avx512<Activation::Silu, false>(nullptr, x, out, n);
    else run_avx512<Activation::Sigmoid, false>(nullptr, x, out, n);
  } else if (a == Activation::Silu) {
    run_portable(x, out, n, SiluF{});
  } else {
    run_portable(x, out, n, SigmoidF{});
  }
}

void backward_f32(Activation a, const float* g, const float* x, float* out, int64_t n) {
  if (use_avx512()) {
    if (a == Activation::Silu) run_avx512<Activation::Silu, true>(g, x, out, n);
    else run_avx512<Activation::Sigmoid, true>(g, x, out, n);
  } else if (a == Activation::Silu) {
    run_portable(g, x, out, n, SiluGradF{});
  } else {
    run_portable(g, x, out, n, SigmoidGradF{});
  }
}

}  // namespace

void activation_dense(Activation a, const void* x, int half_in, void* out, int half_out, int64_t n) {
  if (half_in == 0 && half_out == 0) {
    parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
      forward_f32(a, static_cast<const float*>(x) + b, static_cast<float*>(out) + b, e - b);
    });
    return;
  }
  constexpr int64_t kBlock = 512;  // widen a block, run the Float32 kernel, round the block once
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) {
    float in[kBlock], res[kBlock];
    for (int64_t o = b; o < e; o += kBlock) {
      const int64_t len = std::min(kBlock, e - o);
      const float* src = static_cast<const float*>(x) + o;
      if (half_in != 0) {
        const uint16_t* h = static_cast<const uint16_t*>(x) + o;
        if (half_in == 1) bf16_to_f32(h, in, len);
        else f16_to_f32(h, in, len);
        src = in;
      }
      float* dst = half_out == 0 ? static_cast<float*>(out) + o : res;
      forward_f32(a, src, dst, len);
      if (half_out == 1) f32_to_bf16(res, static_cast<uint16_t*>(out) + o, len);
      else if (half_out == 2) f32_to_f16(res, static_cast<uint16_t*>(out) + o, len);
    }
  });
}

void activation_grad_dense(Activation a, const float* g, const float* x, float* out, int64_t n) {
  parallel_for(n, kGrain, [&](int64_t b, int64_t e) { backward_f32(a, g + b, x + b, out + b, e - b); });
}

const char* activation_kernel_path() { return use_avx512() ? "avx512f" : "portable"; }
bool force_portable_activation_kernels(bool on) noexcept { return g_portable.exchange(on); }

// ---------------------------------------------------------------- VJPs

namespace {

// Rows run by the gradient kernels (not in the table: never a public operation, never recorded): g times the
// derivative at x, as an element-wise operation of the float dtype of (g, x).
constexpr OpDef kSiluBackward(OpId::Silu, "silu backward", {"grad", "t"}, 0, OpShape::Elementwise, OpSaves::Nothing,
                              &dtype_float, nullptr, &elementwise<cpu::silu_backward>,
                              &elementwise<generic::silu_backward>);
constexpr OpDef kSigmoidBackward(OpId::Sigmoid, "sigmoid backward", {"grad", "t"}, 0, OpShape::Elementwise,
                                 OpSaves::Nothing, &dtype_float, nullptr, &elementwise<cpu::sigmoid_backward>,
                                 &elementwise<generic::sigmoid_backward>);

TensorPtr op(OpId id, std::vector<Operand> ops) { return call_op(id, ops); }

// g times the derivative of `a` at x. Native operands (CPU or Generic, as a TiledEvictable's backward gives them)
// run one fused kernel; other kinds (an Evictable) compose it from table operations, which each kind executes:
// sigmoid' = sigmoid(x) sigmoid(-x), silu' = s (1 + x sigmoid(-x)) with s = sigmoid(x), both free of cancellation.
TensorPtr activation_grad(Activation a, const TensorPtr& g, const TensorPtr& x) {
  const CarrierKind& kind = x->carrier->kind();
  if (&g->carrier->kind() == &kind && (&kind == &cpu_kind() || &kind == &generic_kind())) {
    const OpDef& def = a == Activation::Silu ? kSiluBackward : kSigmoidBackward;
    const Operand ops[2] = {Operand::of(g), Operand::of(x)};
    return (&kind == &cpu_kind() ? def.cpu : def.generic)(std::span<const Operand>(ops, 2), {}, def);
  }
  TensorPtr s = op(OpId::Sigmoid, {Operand::of(x)});
  TensorPtr c = op(OpId::Sigmoid, {Operand::of(op(OpId::Neg, {Operand::of(x)}))});
  TensorPtr d;
  if (a == Activation::Sigmoid) {
    d = op(OpId::ElementwiseMul, {Operand::of(s), Operand::of(c)});
  } else {
    TensorPtr xc = op(OpId::ElementwiseMul, {Operand::of(x), Operand::of(c)});
    d = op(OpId::ElementwiseMul, {Operand::of(s), Operand::of(op(OpId::Add, {Operand::weak(Value::from_float(1.0)), Operand::of(xc)}))});
  }
  return op(OpId::ElementwiseMul, {Operand::of(g), Operand::of(d)});
}

}  // namespace

void vjp_silu(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (a.wants(0)) grads[0] = activation_grad(Activation::Silu, a.grad, a.inputs[0]);
}

void vjp_sigmoid(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (a.wants(0)) grads[0] = activation_grad(Activation::Sigmoid, a.grad, a.inputs[0]);
}

}  // namespace sw::detail
