// Internal: silu and sigmoid, their derivatives, and the kernels that run them (activations.cpp).
//
// Note [Stable sigmoid]: with e = exp(-|x|), which lies in [0, 1] for every x and never overflows,
//   sigmoid(x) = 1 / (1 + e)      for x >= 0,     e / (1 + e)      for x < 0;
//   1 - sigmoid(x) = e / (1 + e)  for x >= 0,     1 / (1 + e)      for x < 0 (no cancellation);
//   sigmoid'(x) = sigmoid(x) (1 - sigmoid(x)) = e / (1 + e)^2;
//   silu(x) = x sigmoid(x);  silu'(x) = sigmoid(x) (1 + x (1 - sigmoid(x))).
// Every finite x gives a finite result: far below zero e underflows to a subnormal and then to 0, so
// sigmoid(-100) is the subnormal exp(-100) and sigmoid(-1e4) and silu'(-1e4) are 0 (where
// z / (1 + exp(-z)) overflows exp(-z) below z = -88 and its gradient is inf * 0 = NaN). NaN stays NaN;
// sigmoid(+-inf) is 1 and 0, silu(+inf) is +inf and silu(-inf) is -inf * 0 = NaN, as x * sigmoid(x) is in
// IEEE arithmetic.
//
// Float32 error: the CPU kernels' exp(-|x|) is Cody-Waite range reduction and a degree-5 polynomial (the
// Cephes expf coefficients), within 2 ulps; one addition, one division and (silu) one product follow, so
// |err| <= 10 u |r| (5 ulps, u = 2^-24) plus, where exp(-|x|) is subnormal (x < -87.3), its quantum 2^-149
// (sigmoid) or |x| 2^-149 (silu, the quantum times x). The derivatives: sigmoid' within 12 u |r| + 2^-149;
// silu' within 12 u s (1 + |x| (1 - s)) + (1 + |x|) 2^-149 (s = sigmoid(x): 1 + x (1 - s) cancels near
// x = -1.28, so the bound is relative to the size of its terms). Measured on 2e7 random inputs: 1.4 ulps (exp),
// 3.0 u, 3.6 u, 4.8 u and 4.5 u of those scales. The Generic backend computes the same formulas in double with
// std::exp and rounds once to Float32. Int32 operands are computed in double as exp's are.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>
#include <type_traits>

namespace sw::detail {

enum class Activation : uint8_t { Silu, Sigmoid };

// exp(t) for t in [-104, 0] in Float32 (Note [Stable sigmoid]). Below -104 exp is under half the smallest
// subnormal, so the callers clamp |x| to 104 (the result is 0 either way).
inline __attribute__((always_inline)) float exp_core(float t) {  // inlined into the AVX-512 clones
  // n = round(t / ln 2) to nearest, by the 1.5 * 2^23 shift (no libm call, so the loop vectorises).
  const float n = (t * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
  float r = t - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  // p * 2^n for n in [-150, 0] in two normal steps (the first exact), so a subnormal result rounds once.
  const int32_t ni = static_cast<int32_t>(n);
  const int32_t n1 = ni >> 1, n2 = ni - n1;
  const float s1 = std::bit_cast<float>(static_cast<uint32_t>(n1 + 127) << 23);
  const float s2 = std::bit_cast<float>(static_cast<uint32_t>(n2 + 127) << 23);
  return p * s1 * s2;
}

// What the formulas need of x: e = exp(-|x|), whether x is negative (its sign bit: -0 counts as negative, which
// gives the same 1/2) and whether it is NaN. In Float32 these come from integer operations on x's bits (no float
// comparison, which GCC will not turn into a select under IEEE trapping rules), so that a loop over the functors
// below has no branch and vectorises; in double (the reference, and Int32 operands) from the plain operations.
template <class C>
struct SigmoidParts {
  C e;
  uint32_t neg, nan;
};
inline SigmoidParts<float> parts_of(float x) {
  const uint32_t b = std::bit_cast<uint32_t>(x), a = b & 0x7fffffffu;
  const uint32_t clamped = a < 0x42D00000u ? a : 0x42D00000u;  // |x| up to 104.0f (for a >= 0, integer order is
                                                                // float order; a NaN is above every number)
  return {exp_core(-std::bit_cast<float>(clamped)), b >> 31, a > 0x7f800000u ? 1u : 0u};
}
inline SigmoidParts<double> parts_of(double x) {
  return {std::exp(-std::fabs(x)), std::signbit(x) ? 1u : 0u, x != x ? 1u : 0u};
}
// x where x is NaN, else v (a bit select in Float32).
inline float keep_nan(float x, float v, uint32_t nan) {
  const uint32_t m = 0u - nan;
  return std::bit_cast<float>((std::bit_cast<uint32_t>(x) & m) | (std::bit_cast<uint32_t>(v) & ~m));
}
inline double keep_nan(double x, double v, uint32_t nan) { return nan ? x : v; }

// sigmoid(x), silu(x) and the two derivatives times g, in C (float: the CPU kernels; double: the reference and
// Int32 operands), by Note [Stable sigmoid]; NaN passes through.
template <class C>
inline C sigmoid_of(C x) {
  const SigmoidParts<C> p = parts_of(x);
  const C num = p.neg ? p.e : C(1);
  return keep_nan(x, num / (C(1) + p.e), p.nan);
}
template <class C>
inline C silu_of(C x) {
  return x * sigmoid_of(x);
}
template <class C>
inline C sigmoid_grad_of(C g, C x) {
  const SigmoidParts<C> p = parts_of(x);
  const C d = C(1) + p.e;
  return keep_nan(x, g * (p.e / (d * d)), p.nan);
}
template <class C>
inline C silu_grad_of(C g, C x) {
  const SigmoidParts<C> p = parts_of(x);
  const C d = C(1) + p.e;
  const C lo = p.neg ? p.e : C(1), hi = p.neg ? C(1) : p.e;  // both selects first: the loop stays branch-free
  const C s = lo / d, c = hi / d;                              // sigmoid(x) and 1 - sigmoid(x)
  return keep_nan(x, g * (s * (C(1) + x * c)), p.nan);
}

// The functors the element-wise kernels take (an integral C never runs: these results are never Int32).
struct SigmoidF {
  template <class C> C operator()(C x) const { if constexpr (std::is_integral_v<C>) return C(0); else return sigmoid_of(x); }
};
struct SiluF {
  template <class C> C operator()(C x) const { if constexpr (std::is_integral_v<C>) return C(0); else return silu_of(x); }
};
struct SigmoidGradF {  // (g, x) -> g sigmoid'(x)
  template <class C> C operator()(C g, C x) const {
    if constexpr (std::is_integral_v<C>) return C(0); else return sigmoid_grad_of(g, x);
  }
};
struct SiluGradF {  // (g, x) -> g silu'(x)
  template <class C> C operator()(C g, C x) const {
    if constexpr (std::is_integral_v<C>) return C(0); else return silu_grad_of(g, x);
  }
};

// n dense Float32 values: out[i] = f(x[i]) (forward) or f(g[i], x[i]) (backward), split over the compute pool,
// on the AVX-512 kernel where the CPU has it, else on the portable loop (the functors above, which the compiler
// vectorises). 16-bit variants widen blocks of x (and g) to Float32, run the Float32 kernel and round each result
// once to the output's 16-bit dtype (half.hpp conversions). `half_out`: 0 Float32, 1 BFloat16, 2 Float16 output;
// `half_in`: the same for the operands.
void activation_dense(Activation a, const void* x, int half_in, void* out, int half_out, int64_t n);
void activation_grad_dense(Activation a, const float* g, const float* x, float* out, int64_t n);

// The kernel activation_dense runs on this machine: "avx512f" or "portable".
const char* activation_kernel_path();
// Forces the portable loops (true) or restores run-time dispatch (false), so tests can compare both paths on a
// machine that has AVX-512. Returns the previous setting.
bool force_portable_activation_kernels(bool on) noexcept;

}  // namespace sw::detail
