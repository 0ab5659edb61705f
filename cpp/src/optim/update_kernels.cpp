// The optimizers' element updates (update_kernels.hpp): one AVX-512F loop and one portable loop per algorithm, the
// same operations in the same order. Each operation is one IEEE Float32 operation (round to nearest even), and a
// fused multiply-add is one rounding: std::fma and _mm512_fmadd_ps agree bit for bit, so both paths give identical
// results. This file is compiled with -ffp-contract=off (CMakeLists.txt): GCC's default for C++ would contract a
// product feeding a sum into one fused multiply-add (one rounding fewer) where torch rounds twice.
#include "update_kernels.hpp"

#include <immintrin.h>

#include <atomic>
#include <cmath>

// GCC 12 reports the intrinsics header's own deliberately undefined vectors (in the unmasked forms it builds
// on) as used uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define SW_OPTIM_AVX512 __attribute__((target("avx512f,fma")))

namespace sw::optim::detail {

namespace {

std::atomic<bool> g_portable{false};

bool use_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return ok && !g_portable.load(std::memory_order_relaxed);
}

// ---------------------------------------------------------------- one element (the portable path and the tails)

inline void sgd_one(float& w, float g, float* buf, const SgdCoefficients& c) {
  if (c.weight_decay != 0.0f) g = std::fma(w, c.weight_decay, g);
  if (c.momentum != 0.0f) {
    const float b = c.first ? g : std::fma(g, c.one_minus_dampening, *buf * c.momentum);
    *buf = b;
    g = c.nesterov ? std::fma(b, c.momentum, g) : b;
  }
  w = std::fma(g, c.neg_lr, w);
}

inline void adam_one(float& w, float g, float& m, float& v, const AdamCoefficients& c) {
  float x = w;
  if (c.decoupled) x = x * c.decay;
  if (c.weight_decay != 0.0f) g = std::fma(x, c.weight_decay, g);
  const float d = g - m;
  // torch's lerp: weight < 0.5 adds to the start, else subtracts from the end (both fused).
  m = c.lerp_weight < 0.5f ? std::fma(c.lerp_weight, d, m) : std::fma(c.lerp_weight - 1.0f, d, g);
  v = std::fma(c.one_minus_beta2 * g, g, v * c.beta2);
  const float denom = std::sqrt(v) / c.bias_correction2_sqrt + c.eps;
  w = x + (c.neg_step_size * m) / denom;
}

// ---------------------------------------------------------------- AVX-512F

SW_OPTIM_AVX512 void sgd_avx512(float* w, const float* g, float* buf, int64_t n, const SgdCoefficients& c) {
  const __m512 wd = _mm512_set1_ps(c.weight_decay), mom = _mm512_set1_ps(c.momentum);
  const __m512 omd = _mm512_set1_ps(c.one_minus_dampening), nlr = _mm512_set1_ps(c.neg_lr);
  const bool decay = c.weight_decay != 0.0f, momentum = c.momentum != 0.0f;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    __m512 x = _mm512_loadu_ps(w + k), gr = _mm512_loadu_ps(g + k);
    if (decay) gr = _mm512_fmadd_ps(x, wd, gr);
    if (momentum) {
      const __m512 b = c.first ? gr : _mm512_fmadd_ps(gr, omd, _mm512_mul_ps(_mm512_loadu_ps(buf + k), mom));
      _mm512_storeu_ps(buf + k, b);
      gr = c.nesterov ? _mm512_fmadd_ps(b, mom, gr) : b;
    }
    _mm512_storeu_ps(w + k, _mm512_fmadd_ps(gr, nlr, x));
  }
  for (; k < n; ++k) sgd_one(w[k], g[k], momentum ? buf + k : nullptr, c);
}

SW_OPTIM_AVX512 void adam_avx512(float* w, const float* g, float* m, float* v, int64_t n, const AdamCoefficients& c) {
  const __m512 decay = _mm512_set1_ps(c.decay), wd = _mm512_set1_ps(c.weight_decay);
  const bool small = c.lerp_weight < 0.5f;
  const __m512 coeff = _mm512_set1_ps(small ? c.lerp_weight : c.lerp_weight - 1.0f);
  const __m512 b2 = _mm512_set1_ps(c.beta2), omb2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 bc2 = _mm512_set1_ps(c.bias_correction2_sqrt), eps = _mm512_set1_ps(c.eps);
  const __m512 nss = _mm512_set1_ps(c.neg_step_size);
  const bool coupled = c.weight_decay != 0.0f;
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    __m512 x = _mm512_loadu_ps(w + k), gr = _mm512_loadu_ps(g + k);
    if (c.decoupled) x = _mm512_mul_ps(x, decay);
    if (coupled) gr = _mm512_fmadd_ps(x, wd, gr);
    const __m512 mo = _mm512_loadu_ps(m + k), d = _mm512_sub_ps(gr, mo);
    const __m512 mn = _mm512_fmadd_ps(coeff, d, small ? mo : gr);
    const __m512 vn = _mm512_fmadd_ps(_mm512_mul_ps(omb2, gr), gr, _mm512_mul_ps(_mm512_loadu_ps(v + k), b2));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vn), bc2), eps);
    _mm512_storeu_ps(m + k, mn);
    _mm512_storeu_ps(v + k, vn);
    _mm512_storeu_ps(w + k, _mm512_add_ps(x, _mm512_div_ps(_mm512_mul_ps(nss, mn), denom)));
  }
  for (; k < n; ++k) adam_one(w[k], g[k], m[k], v[k], c);
}

}  // namespace

void sgd_update(float* w, const float* g, float* buf, int64_t n, const SgdCoefficients& c) noexcept {
  if (use_avx512()) return sgd_avx512(w, g, buf, n, c);
  const bool momentum = c.momentum != 0.0f;
  for (int64_t k = 0; k < n; ++k) sgd_one(w[k], g[k], momentum ? buf + k : nullptr, c);
}

void adam_update(float* w, const float* g, float* m, float* v, int64_t n, const AdamCoefficients& c) noexcept {
  if (use_avx512()) return adam_avx512(w, g, m, v, n, c);
  for (int64_t k = 0; k < n; ++k) adam_one(w[k], g[k], m[k], v[k], c);
}

const char* update_kernel_path() noexcept { return use_avx512() ? "avx512f" : "portable"; }

void force_portable_update_kernels(bool portable) noexcept { g_portable.store(portable, std::memory_order_relaxed); }

}  // namespace sw::optim::detail
