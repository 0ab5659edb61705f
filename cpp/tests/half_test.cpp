// 16-bit floats: conversions checked exhaustively (every bf16 and fp16 bit
// pattern) or against an exact reference (narrowing), and products against a
// Float64 reference within the bound of Note [Products of half-precision
// operands], on every kernel path this machine has.
#include "../src/ops/half.hpp"

#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <random>
#include <string>
#include <utility>
#include <cmath>
#include <cstring>
#include <vector>

#include "test_support.hpp"

using namespace sw::detail;
using sw::testing_support::Rng;
using sw::testing_support::test_seed;
using sw::testing_support::bits;
using sw::testing_support::from_bits;

namespace {

// The value of an fp16 bit pattern, computed in double from the format's definition.
double f16_value(uint16_t h) {
  const int sign = h >> 15, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  double v = exp == 0 ? std::ldexp(man, -24) : exp == 31 ? (man ? NAN : INFINITY) : std::ldexp(1024 + man, exp - 25);
  return sign ? -v : v;
}

// Nearest of two neighbouring candidates (ties to the even pattern), from double arithmetic.
uint16_t nearest(double x, uint16_t lo, double vlo, uint16_t hi, double vhi) {
  const double dlo = std::fabs(x - vlo), dhi = std::fabs(vhi - x);
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

// Exact reference narrowing to bf16: the two bf16 values around x by truncation of the Float32 pattern.
uint16_t ref_bf16(float x) {
  const uint32_t u = bits(x);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  if ((u & 0xFFFF) == 0) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);  // the next bf16 away from zero (may be infinity)
  // Past the largest finite bf16 the next value is 2^128 in an unbounded exponent: IEEE rounds to infinity there.
  const double vhi = (hi & 0x7FFF) == 0x7F80 ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(from_bits(uint32_t{hi} << 16)));
  return nearest(std::fabs(static_cast<double>(x)), lo & 0x7FFF, std::fabs(static_cast<double>(from_bits(uint32_t{lo} << 16))),
                 hi & 0x7FFF, vhi) |
         (lo & 0x8000);
}

// Exact reference narrowing to fp16: binary search over the finite non-negative patterns, with IEEE overflow
// (|x| >= 65504 + half an ulp of 32 rounds to infinity).
uint16_t ref_f16(float x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(static_cast<double>(x));
  if (a >= 65520.0) return sign | 0x7C00;
  uint16_t lo = 0, hi = 0x7BFF;  // largest finite
  while (lo < hi) {  // largest pattern with value <= a
    const uint16_t mid = static_cast<uint16_t>((lo + hi + 1) / 2);
    if (f16_value(mid) <= a) lo = mid;
    else hi = static_cast<uint16_t>(mid - 1);
  }
  if (f16_value(lo) == a) return sign | lo;
  const uint16_t up = static_cast<uint16_t>(lo + 1);
  return sign | nearest(a, lo, f16_value(lo), up, up == 0x7C00 ? 65536.0 : f16_value(up));
}

double real(Rng& rng, double lo, double hi) { return std::uniform_real_distribution<double>(lo, hi)(rng.g); }

// Runs f once with run-time dispatch and once with the portable kernels forced (when they differ).
template <class F>
void on_every_path(F&& f) {
  f("dispatch");
  const bool was = force_portable_half_kernels(true);
  f("portable");
  force_portable_half_kernels(was);
}

}  // namespace

TEST(HalfConversions, EveryBf16PatternWidensExactlyAndNarrowsBack) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = bf16_to_float(static_cast<uint16_t>(h));
    ASSERT_EQ(bits(f), h << 16);
    if (std::isnan(f)) ASSERT_EQ(float_to_bf16(f), static_cast<uint16_t>(h | 0x40)) << h;  // quieted, sign kept
    else ASSERT_EQ(float_to_bf16(f), h) << h;
  }
}

TEST(HalfConversions, EveryF16PatternWidensToItsValueAndNarrowsBack) {
  for (uint32_t h = 0; h <= 0xFFFF; ++h) {
    const float f = f16_to_float(static_cast<uint16_t>(h));
    const double v = f16_value(static_cast<uint16_t>(h));
    if (std::isnan(v)) {
      ASSERT_TRUE(std::isnan(f)) << h;
      ASSERT_EQ(float_to_f16(f), static_cast<uint16_t>(h | 0x200)) << h;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), v) << h;
    ASSERT_EQ(std::signbit(f), (h & 0x8000) != 0) << h;
    ASSERT_EQ(float_to_f16(f), h) << h;
  }
}

TEST(HalfConversions, NarrowingRoundsToNearestEvenAsTheExactReference) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  std::vector<float> xs = {0.f, -0.f, 1.f, 65504.f, 65519.99f, 65520.f, -65520.f, 1e-8f, 2.98e-8f, 5.96e-8f,
                           6.1e-5f, 3.4e38f, -3.4e38f, INFINITY, -INFINITY, 1.00390625f, 1.01171875f,
                           from_bits(0x3F808000u), from_bits(0x3F818000u), from_bits(0x7F7FFFFFu)};
  for (int i = 0; i < 200000; ++i) xs.push_back(from_bits(static_cast<uint32_t>(rng.g())));  // every exponent
  for (int i = 0; i < 200000; ++i) xs.push_back(static_cast<float>(real(rng, -70000.0, 70000.0)));
  for (float x : xs) {
    if (std::isnan(x)) continue;
    ASSERT_EQ(float_to_bf16(x), ref_bf16(x)) << "x=" << x << " bits=" << std::hex << bits(x) << " seed=" << seed;
    ASSERT_EQ(float_to_f16(x), ref_f16(x)) << "x=" << x << " bits=" << std::hex << bits(x) << " seed=" << seed;
  }
}

TEST(HalfConversions, VectorConversionsMatchScalarOnEveryPathAndTail) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  for (int64_t n : {0, 1, 15, 16, 17, 33, 1000}) {
    std::vector<float> x(static_cast<size_t>(n));
    for (float& v : x) v = from_bits(static_cast<uint32_t>(rng.g()));
    on_every_path([&](const char* path) {
      SCOPED_TRACE(path);
      std::vector<uint16_t> hb(static_cast<size_t>(n) + 1, 0xABCD), hf(static_cast<size_t>(n) + 1, 0xABCD);
      f32_to_bf16(x.data(), hb.data(), n);
      f32_to_f16(x.data(), hf.data(), n);
      ASSERT_EQ(hb[static_cast<size_t>(n)], 0xABCD) << "wrote past the end";
      ASSERT_EQ(hf[static_cast<size_t>(n)], 0xABCD) << "wrote past the end";
      std::vector<float> wb(static_cast<size_t>(n) + 1, 7.f), wf(static_cast<size_t>(n) + 1, 7.f);
      bf16_to_f32(hb.data(), wb.data(), n);
      f16_to_f32(hf.data(), wf.data(), n);
      ASSERT_EQ(wb[static_cast<size_t>(n)], 7.f);
      for (int64_t i = 0; i < n; ++i) {
        const size_t s = static_cast<size_t>(i);
        ASSERT_EQ(hb[s], float_to_bf16(x[s])) << i << " seed=" << seed;
        ASSERT_EQ(hf[s], float_to_f16(x[s])) << i << " seed=" << seed;
        ASSERT_EQ(bits(wb[s]), bits(bf16_to_float(hb[s])));
        ASSERT_EQ(bits(wf[s]), bits(f16_to_float(hf[s])));
      }
    });
  }
}

// Products: C = A B^T over inner-contiguous rows, against Float64 with the bound gamma_k * sum |a||b| per element.
TEST(HalfGemm, MatchesFloat64WithinTheFloat32SumBoundOnEveryPath) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  for (HalfKind kind : {HalfKind::BFloat16, HalfKind::Float16}) {
    const auto narrow = kind == HalfKind::BFloat16 ? float_to_bf16 : float_to_f16;
    const auto widen = kind == HalfKind::BFloat16 ? bf16_to_float : f16_to_float;
    for (auto [m, n, k] : std::vector<std::array<int64_t, 3>>{
             {1, 1, 1}, {3, 5, 31}, {4, 4, 32}, {5, 9, 33}, {7, 6, 100}, {9, 13, 257}, {64, 96, 512},
             {16, 1, 2}, {17, 7, 33}, {33, 12, 64}, {80, 13, 65}, {130, 5, 9}}) {
      const int64_t lda = k + 3, ldb = k + 5;  // padded rows: the kernels must not read the padding
      std::vector<uint16_t> A(static_cast<size_t>(m * lda), narrow(NAN)), B(static_cast<size_t>(n * ldb), narrow(NAN));
      for (int64_t i = 0; i < m; ++i)
        for (int64_t p = 0; p < k; ++p) A[static_cast<size_t>(i * lda + p)] = narrow(static_cast<float>(real(rng, -2.0, 2.0)));
      for (int64_t j = 0; j < n; ++j)
        for (int64_t p = 0; p < k; ++p) B[static_cast<size_t>(j * ldb + p)] = narrow(static_cast<float>(real(rng, -2.0, 2.0)));
      on_every_path([&](const char* path) {
        SCOPED_TRACE(std::string(path) + " " + half_gemm_path(kind) + " m=" + std::to_string(m) + " n=" +
                     std::to_string(n) + " k=" + std::to_string(k) + " seed=" + std::to_string(seed));
        for (auto [accumulate, row_major_c] : {std::pair{false, false}, {true, false}, {false, true}, {true, true}}) {
          // C column-major (or row-major) with a padded leading dimension; accumulate starts from 1.5 everywhere.
          const int64_t ldc = row_major_c ? n + 2 : m + 2, outer = row_major_c ? m : n;
          const int64_t c_si = row_major_c ? ldc : 1, c_sj = row_major_c ? 1 : ldc;
          std::vector<float> C(static_cast<size_t>(ldc * outer), 1.5f);
          half_gemm(kind, m, n, k, A.data(), lda, B.data(), ldb, C.data(), c_si, c_sj, accumulate);
          const double gamma = static_cast<double>(k + 1) * 0x1p-24 / (1 - static_cast<double>(k + 1) * 0x1p-24);
          for (int64_t i = 0; i < m; ++i)
            for (int64_t j = 0; j < n; ++j) {
              double exact = accumulate ? 1.5 : 0.0, mag = std::fabs(exact);
              for (int64_t p = 0; p < k; ++p) {
                const double prod = static_cast<double>(widen(A[static_cast<size_t>(i * lda + p)])) *
                                    static_cast<double>(widen(B[static_cast<size_t>(j * ldb + p)]));
                exact += prod;
                mag += std::fabs(prod);
              }
              ASSERT_LE(std::fabs(static_cast<double>(C[static_cast<size_t>(i * c_si + j * c_sj)]) - exact), gamma * mag)
                  << "C(" << i << ", " << j << ") accumulate=" << accumulate << " row-major C=" << row_major_c;
            }
          const int64_t inner = row_major_c ? n : m;
          for (int64_t o = 0; o < outer; ++o)  // the padding of C is untouched
            for (int64_t x = inner; x < ldc; ++x) ASSERT_EQ(C[static_cast<size_t>(x + o * ldc)], 1.5f);
        }
      });
    }
  }
}

TEST(HalfGemm, NamesItsPath) {
  const std::string bf = half_gemm_path(HalfKind::BFloat16), f16 = half_gemm_path(HalfKind::Float16);
  EXPECT_TRUE(bf == "avx512-bf16" || bf == "avx512f" || bf == "scalar") << bf;
  EXPECT_TRUE(f16 == "avx512f" || f16 == "scalar") << f16;
  const bool was = force_portable_half_kernels(true);
  EXPECT_STREQ(half_gemm_path(HalfKind::BFloat16), "scalar");
  force_portable_half_kernels(was);
  std::printf("bf16 products: %s, fp16 products: %s\n", bf.c_str(), f16.c_str());
}

// rows_times_half (Note [Few rows times a row-major 16-bit matrix]): a Float32 sum of k exact products per element,
// FMA in order of r, so |C - exact| <= gamma_k sum_r |L||W| with gamma_k = k u / (1 - k u), u = 2^-24 (each product
// of a bf16 or fp16 value and a value of the same kind is exact in Float32, each FMA rounds once). Padding of W's
// rows holds NaN: a kernel that read it would poison C. More than kRowsTimesHalfMax rows, or the portable path,
// return false and write nothing.
TEST(RowsTimesHalf, MatchesFloat64WithinTheFloat32SumBound) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  for (HalfKind kind : {HalfKind::BFloat16, HalfKind::Float16}) {
    const auto narrow = kind == HalfKind::BFloat16 ? float_to_bf16 : float_to_f16;
    const auto widen = kind == HalfKind::BFloat16 ? bf16_to_float : f16_to_float;
    for (int64_t n : {1, 3, 8, 9, 16})
      for (int64_t cols : {1, 31, 32, 33, 100})
        for (int64_t k : {1, 7, 64}) {
          SCOPED_TRACE("n=" + std::to_string(n) + " cols=" + std::to_string(cols) + " k=" + std::to_string(k) +
                       " seed=" + std::to_string(seed));
          const int64_t ldw = cols + 3;
          std::vector<uint16_t> W(static_cast<size_t>(k * ldw), narrow(NAN));
          for (int64_t r = 0; r < k; ++r)
            for (int64_t c = 0; c < cols; ++c)
              W[static_cast<size_t>(r * ldw + c)] = narrow(static_cast<float>(real(rng, -2.0, 2.0)));
          std::vector<float> L(static_cast<size_t>(n * k));
          for (float& v : L) v = widen(narrow(static_cast<float>(real(rng, -2.0, 2.0))));
          std::vector<float> C(static_cast<size_t>(n * cols), 7.0f);
          ASSERT_TRUE(rows_times_half(kind, n, cols, k, L.data(), W.data(), ldw, C.data()));
          const double gamma = static_cast<double>(k) * 0x1p-24 / (1 - static_cast<double>(k) * 0x1p-24);
          for (int64_t q = 0; q < n; ++q)
            for (int64_t c = 0; c < cols; ++c) {
              double exact = 0, mag = 0;
              for (int64_t r = 0; r < k; ++r) {
                const double prod = static_cast<double>(L[static_cast<size_t>(q + n * r)]) *
                                    static_cast<double>(widen(W[static_cast<size_t>(r * ldw + c)]));
                exact += prod;
                mag += std::fabs(prod);
              }
              ASSERT_LE(std::fabs(static_cast<double>(C[static_cast<size_t>(q + n * c)]) - exact), gamma * mag)
                  << "C(" << q << ", " << c << ")";
            }
        }
  }
  std::vector<uint16_t> W(4 * 40, 0);
  std::vector<float> L(static_cast<size_t>((kRowsTimesHalfMax + 1) * 4), 1.0f);
  std::vector<float> C(static_cast<size_t>((kRowsTimesHalfMax + 1) * 40), 7.0f);
  EXPECT_FALSE(rows_times_half(HalfKind::BFloat16, kRowsTimesHalfMax + 1, 40, 4, L.data(), W.data(), 40, C.data()));
  const bool was = force_portable_half_kernels(true);
  EXPECT_FALSE(rows_times_half(HalfKind::BFloat16, 2, 40, 4, L.data(), W.data(), 40, C.data()));
  force_portable_half_kernels(was);
  for (float v : C) ASSERT_EQ(v, 7.0f);  // nothing written when it declines
}
