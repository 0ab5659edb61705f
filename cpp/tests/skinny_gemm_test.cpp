// The direct skinny-product kernels (cpp/src/ops/skinny_gemm.cpp) against a
// double-precision reference: every path, every operand order in memory, row
// and column counts that exercise each partial register block and vector tail,
// padded leading dimensions, and the shapes that must stay with BLAS.
// The random seed is printed; set SW_TEST_SEED=<n> to replay a run.
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "../src/ops/skinny_gemm.hpp"
#include "test_support.hpp"

namespace {

using sw::detail::skinny_sgemm;
using sw::detail::skinny_sgemm_path;
using sw::testing_support::test_seed;

bool avx512() { return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma"); }

struct Operand {
  std::vector<float> data;
  int64_t s_row, s_p;  // element (r, p) at data[r * s_row + p * s_p]
};

// rows x k values; `p_contiguous` picks the order in memory, `pad` extra slots per leading dimension.
Operand make_operand(int64_t rows, int64_t k, bool p_contiguous, int64_t pad, std::mt19937_64& rng) {
  std::normal_distribution<float> d(0.f, 1.f);
  Operand o;
  if (p_contiguous) {
    o.s_p = 1;
    o.s_row = k + pad;
  } else {
    o.s_row = 1;
    o.s_p = rows + pad;
  }
  o.data.assign(static_cast<size_t>((rows - 1) * o.s_row + (k - 1) * o.s_p + 1), std::nanf(""));
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t p = 0; p < k; ++p) o.data[r * o.s_row + p * o.s_p] = d(rng);
  return o;
}

void check_product(int64_t m, int64_t n, int64_t k, bool a_pc, bool b_pc, int64_t pad, const char* want_path) {
  std::mt19937_64 rng(test_seed() ^ static_cast<uint64_t>(m * 1000003 + n * 1009 + k * 7 + a_pc * 2 + b_pc));
  Operand a = make_operand(m, k, a_pc, pad, rng), b = make_operand(n, k, b_pc, pad, rng);
  SCOPED_TRACE("SW_TEST_SEED=" + std::to_string(test_seed()) + " m=" + std::to_string(m) + " n=" +
               std::to_string(n) + " k=" + std::to_string(k) + " a_pc=" + std::to_string(a_pc) +
               " b_pc=" + std::to_string(b_pc) + " pad=" + std::to_string(pad));
  EXPECT_STREQ(skinny_sgemm_path(m, n, k, b.s_row, b.s_p), want_path);
  // A sentinel past the end of C: a kernel must not write beyond m * n.
  std::vector<float> c(static_cast<size_t>(m * n + 16), std::nanf(""));
  for (int64_t t = m * n; t < m * n + 16; ++t) c[t] = -12345.f;
  ASSERT_TRUE(skinny_sgemm(m, n, k, a.data.data(), a.s_row, a.s_p, b.data.data(), b.s_row, b.s_p, c.data()));
  double worst = 0;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double ref = 0, mag = 0;
      for (int64_t p = 0; p < k; ++p) {
        double t = double(a.data[i * a.s_row + p * a.s_p]) * double(b.data[j * b.s_row + p * b.s_p]);
        ref += t;
        mag += std::abs(t);
      }
      // Padding holds NaN: reading it, or leaving an element unwritten, shows up here.
      ASSERT_TRUE(std::isfinite(c[i + j * m])) << "C(" << i << ", " << j << ") = " << c[i + j * m];
      // Float32 accumulation over k terms: relative to the sum of magnitudes.
      worst = std::max(worst, std::abs(double(c[i + j * m]) - ref) / std::max(1.0, mag));
    }
  EXPECT_LT(worst, 1e-5);
  for (int64_t t = m * n; t < m * n + 16; ++t) ASSERT_EQ(c[t], -12345.f) << "wrote past the end at " << t;
}

TEST(SkinnyGemm, SmallMAlongJEveryRowBlockAndColumnTail) {
  if (!avx512()) GTEST_SKIP() << "no AVX-512F on this CPU: BLAS handles every product";
  for (int64_t m : {1, 2, 3, 7, 8, 9, 15, 16, 17, 19, 20})
    for (int64_t n : {256, 257, 271, 300})
      for (bool a_pc : {false, true}) check_product(m, n, 256 + (m % 3), a_pc, false, m % 2, "small-m/j");
}

TEST(SkinnyGemm, SmallMAlongPEveryBlockAndTail) {
  if (!avx512()) GTEST_SKIP() << "no AVX-512F on this CPU";
  for (int64_t m : {1, 2, 3, 4, 5, 7, 25, 32})
    for (int64_t n : {256, 257, 263})
      for (int64_t k : {256, 257, 271})
        for (bool a_pc : {false, true}) check_product(m, n, k, a_pc, true, (m + k) % 3, "small-m/p");
}

TEST(SkinnyGemm, SmallKEveryColumnBlockAndRowTail) {
  if (!avx512()) GTEST_SKIP() << "no AVX-512F on this CPU";
  for (int64_t k : {1, 2, 17, 31, 32})
    for (int64_t m : {256, 257, 272, 289})
      for (int64_t n : {256, 259, 267})
        for (bool a_pc : {false, true})
          for (bool b_pc : {false, true}) check_product(m, n, k, a_pc, b_pc, k % 2, "small-k");
}

TEST(SkinnyGemm, LargeProductsThreadedAgreeToo) {
  if (!avx512()) GTEST_SKIP() << "no AVX-512F on this CPU";
  check_product(20, 1024, 1024, false, false, 0, "small-m/j");
  check_product(32, 1024, 1024, false, true, 0, "small-m/p");
  check_product(1024, 1024, 32, true, true, 0, "small-k");
}

TEST(SkinnyGemm, OtherShapesAreLeftToBlas) {
  std::vector<float> a(64 * 64, 1.f), b(64 * 64, 1.f), c(64 * 64, 7.f);
  // Not skinny (m and k both large), too small on the wide side, or B strided along both indices.
  EXPECT_STREQ(skinny_sgemm_path(21, 1024, 1024, 1, 1024), "");
  EXPECT_STREQ(skinny_sgemm_path(33, 1024, 1024, 1024, 1), "");
  EXPECT_STREQ(skinny_sgemm_path(8, 255, 1024, 1, 255), "");
  EXPECT_STREQ(skinny_sgemm_path(8, 1024, 255, 1, 1024), "");
  EXPECT_STREQ(skinny_sgemm_path(8, 1024, 1024, 2, 4096), "");
  EXPECT_STREQ(skinny_sgemm_path(1024, 1024, 33, 1, 1024), "");
  EXPECT_STREQ(skinny_sgemm_path(0, 1024, 1024, 1, 1024), "");
  EXPECT_FALSE(skinny_sgemm(8, 8, 8, a.data(), 1, 8, b.data(), 1, 8, c.data()));
  EXPECT_EQ(c[0], 7.f);  // untouched
}

}  // namespace
