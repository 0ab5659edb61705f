// NaN and infinities through the activations (relu, silu, sigmoid, exp), their gradients and softmax, on both CPU
// kernel paths: run-time dispatch (AVX-512 where present) and the portable loops (activations, 16-bit conversions
// and row loops forced portable together). The expected results are PyTorch's (tests/test_nan_propagation.py
// compares against PyTorch itself on the dispatched path):
//   relu(x) = +0 at or below zero, else x itself: NaN passes with its sign (in Float32 every bit); -0 gives +0
//   (the engine's rule, tests/test_ops.py; PyTorch keeps -0);
//   relu'(x) * g = g where x > 0 or x is NaN, else 0 (threshold_backward on relu(x)), even for g NaN;
//   sigmoid(+-inf) = 1, 0 and sigmoid'(+-inf) = 0; silu(+inf) = +inf, silu(-inf) = NaN, silu'(+-inf) = NaN;
//   softmax of a row holding a NaN or a +inf, or only -inf, is NaN throughout; -inf beside finite values gives 0.
// Inputs hold the specials at every position of sizes reaching the 16-lane loops' bodies and tails, the 512-element
// 16-bit blocks and the compute threads.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include "../src/ops/activations.hpp"
#include "../src/ops/half.hpp"
#include "../src/ops/rows.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/ops.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;

constexpr double kInf = std::numeric_limits<double>::infinity();

// The three storage float dtypes and their specials as bits: NaNs (quiet, signalling, either sign, payloads),
// +inf, -inf, -0, +0, then two ordinary values (1.5, -2.25).
struct Dt {
  const DType* d;
  std::vector<uint32_t> specials;
};
const std::vector<Dt>& dtypes() {
  static const std::vector<Dt> v{
      {&DType::Float32(),
       {0x7FC00000u, 0xFFC00000u, 0x7FC12345u, 0xFFA00001u, 0x7F800000u, 0xFF800000u, 0x80000000u, 0u, 0x3FC00000u,
        0xC0100000u}},
      {&DType::BFloat16(), {0x7FC0u, 0xFFC0u, 0x7FC1u, 0xFFA1u, 0x7F80u, 0xFF80u, 0x8000u, 0u, 0x3FC0u, 0xC010u}},
      {&DType::Float16(), {0x7E00u, 0xFE00u, 0x7E01u, 0xFD01u, 0x7C00u, 0xFC00u, 0x8000u, 0u, 0x3E00u, 0xC080u}},
  };
  return v;
}
constexpr int kSpecials = 10;
const int64_t kSizes[] = {1, 15, 16, 17, 47, 529, 70001};

int width(const DType& d) { return d.id() == DTypeId::Float32 ? 4 : 2; }

float widen(const DType& d, uint32_t bits) {
  if (d.id() == DTypeId::Float32) return std::bit_cast<float>(bits);
  return d.id() == DTypeId::BFloat16 ? detail::bf16_to_float(static_cast<uint16_t>(bits))
                                     : detail::f16_to_float(static_cast<uint16_t>(bits));
}

// A dense CPU tensor of n elements of `dt`, element i holding special i % kSpecials (written as bits).
TensorPtr specials_tensor(const Dt& dt, int64_t n) {
  TensorPtr t = dense_tensor(true, Shape::of({n}), std::vector<double>(static_cast<size_t>(n), 0.0), *dt.d);
  std::byte* p = t->carrier->mutable_native_data();
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t b = dt.specials[static_cast<size_t>(i % kSpecials)];
    std::memcpy(p + i * width(*dt.d), &b, static_cast<size_t>(width(*dt.d)));
  }
  return t;
}

uint32_t bits_at(const TensorPtr& t, int64_t i) {
  uint32_t b = 0;
  std::memcpy(&b, t->carrier->native_data() + (t->offset + i) * width(t->dtype()), static_cast<size_t>(width(t->dtype())));
  return b;
}

// The expected result for special s (the input x): NaN, or a value whose sign is checked too.
struct Want {
  bool nan = false;
  double v = 0;
  bool any_finite = false;  // an ordinary value: only finiteness is checked here
};

void expect_like(const TensorPtr& r, const Dt& dt, int64_t n, const std::function<Want(double)>& want,
                 const std::string& what) {
  ASSERT_EQ(&r->dtype(), dt.d) << what;
  int bad = 0;
  for (int64_t i = 0; i < n && bad < 5; ++i) {
    const double x = widen(*dt.d, dt.specials[static_cast<size_t>(i % kSpecials)]);
    const double got = widen(*dt.d, bits_at(r, i));
    const Want w = want(x);
    bool ok;
    if (w.nan) ok = std::isnan(got);
    else if (w.any_finite) ok = std::isfinite(got);
    else ok = got == w.v && std::signbit(got) == std::signbit(w.v);
    if (!ok) {
      ++bad;
      ADD_FAILURE() << what << " n=" << n << " at " << i << ": x=" << x << " got " << got
                    << (w.nan ? " expected NaN" : w.any_finite ? " expected finite" : " expected ") << w.v;
    }
  }
}

Want relu_want(double x) {
  if (std::isnan(x)) return {true};
  return {false, x <= 0 ? 0.0 : x};
}
Want silu_want(double x) {
  if (std::isnan(x) || x == -kInf) return {true};
  if (x == kInf || x == 0) return {false, x};
  return {false, 0, true};
}
Want sigmoid_want(double x) {
  if (std::isnan(x)) return {true};
  if (std::isinf(x)) return {false, x > 0 ? 1.0 : 0.0};
  if (x == 0) return {false, 0.5};
  return {false, 0, true};
}
Want exp_want(double x) {
  if (std::isnan(x)) return {true};
  if (std::isinf(x)) return {false, x > 0 ? kInf : 0.0};
  if (x == 0) return {false, 1.0};
  return {false, 0, true};
}

// Both paths: run-time dispatch and the portable loops of the activations, the 16-bit conversions and the rows.
class NanBothPaths : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    act_ = detail::force_portable_activation_kernels(GetParam());
    half_ = detail::force_portable_half_kernels(GetParam());
    rows_ = detail::force_portable_row_kernels(GetParam());
  }
  void TearDown() override {
    detail::force_portable_activation_kernels(act_);
    detail::force_portable_half_kernels(half_);
    detail::force_portable_row_kernels(rows_);
  }
  bool act_ = false, half_ = false, rows_ = false;
};

TEST_P(NanBothPaths, ThePathIsTheOneAskedFor) {
  if (GetParam()) {
    EXPECT_STREQ(detail::activation_kernel_path(), "portable");
    EXPECT_STREQ(detail::row_kernel_path(), "portable");
    EXPECT_STREQ(detail::half_gemm_path(detail::HalfKind::Float16), "scalar");
  } else {
    const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                        __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
    EXPECT_STREQ(detail::activation_kernel_path(), avx512 ? "avx512f" : "portable");
    EXPECT_STREQ(detail::row_kernel_path(),
                 avx512 && __builtin_cpu_supports("avx512dq") ? "avx512f" : "portable");
  }
}

TEST_P(NanBothPaths, ReluKeepsNanInEveryDtype) {
  for (const Dt& dt : dtypes())
    for (int64_t n : kSizes) {
      TensorPtr x = specials_tensor(dt, n);
      TensorPtr r = call_op(OpId::Relu, std::vector<Operand>{Operand::of(x)});
      expect_like(r, dt, n, relu_want, std::string("relu ") + dt.d->name());
      // a NaN keeps its sign; Float32 keeps every bit
      for (int64_t i = 0; i < std::min<int64_t>(n, kSpecials); ++i) {
        const uint32_t in = dt.specials[static_cast<size_t>(i)], out = bits_at(r, i);
        if (std::isnan(widen(*dt.d, in))) {
          EXPECT_EQ(std::signbit(widen(*dt.d, out)), std::signbit(widen(*dt.d, in))) << dt.d->name() << " " << i;
          if (dt.d->id() == DTypeId::Float32) EXPECT_EQ(out, in) << i;
        }
      }
    }
}

TEST_P(NanBothPaths, ReluOnAStridedView) {
  for (const Dt& dt : dtypes()) {
    TensorPtr base = specials_tensor(dt, 2 * 41 + 1);
    TensorPtr x = make_tensor(base->carrier, 0, Layout(Shape::of({41}), Stride::of({2})));
    TensorPtr r = call_op(OpId::Relu, std::vector<Operand>{Operand::of(x)});
    for (int64_t i = 0; i < 41; ++i) {
      const double in = widen(*dt.d, dt.specials[static_cast<size_t>((2 * i) % kSpecials)]);
      const double got = widen(*dt.d, bits_at(r, i));
      const Want w = relu_want(in);
      if (w.nan) EXPECT_TRUE(std::isnan(got)) << dt.d->name() << " " << i;
      else EXPECT_TRUE(got == w.v && std::signbit(got) == std::signbit(w.v)) << dt.d->name() << " " << i;
    }
  }
}

TEST_P(NanBothPaths, SiluSigmoidAndExpKeepNanInEveryDtype) {
  for (const Dt& dt : dtypes())
    for (int64_t n : kSizes) {
      TensorPtr x = specials_tensor(dt, n);
      const std::vector<Operand> ops{Operand::of(x)};
      expect_like(call_op(OpId::Silu, ops), dt, n, silu_want, std::string("silu ") + dt.d->name());
      expect_like(call_op(OpId::Sigmoid, ops), dt, n, sigmoid_want, std::string("sigmoid ") + dt.d->name());
      expect_like(call_op(OpId::Exp, ops), dt, n, exp_want, std::string("exp ") + dt.d->name());
    }
}

// Gradients of Float32 inputs (the dense backward kernels): cotangent 1, and for relu also a NaN cotangent.
TEST_P(NanBothPaths, GradientsAtNanAndInfinities) {
  const Dt& dt = dtypes()[0];
  for (int64_t n : {int64_t{17}, int64_t{529}, int64_t{70001}}) {
    for (OpId id : {OpId::Relu, OpId::Silu, OpId::Sigmoid}) {
      TensorPtr x = specials_tensor(dt, n);
      TensorPtr cot = dense_tensor(true, Shape::of({n}), std::vector<double>(static_cast<size_t>(n), 1.0));
      TensorPtr y = call_op(id, std::vector<Operand>{Operand::of(x)});
      backward(y, cot, false);
      ASSERT_NE(x->grad, nullptr);
      std::vector<double> g = values_of(x->grad);
      for (int64_t i = 0; i < n; ++i) {
        const double xi = widen(*dt.d, dt.specials[static_cast<size_t>(i % kSpecials)]);
        bool ok;
        if (id == OpId::Relu) ok = g[i] == (std::isnan(xi) || xi > 0 ? 1.0 : 0.0);
        else if (std::isnan(xi) || (id == OpId::Silu && std::isinf(xi))) ok = std::isnan(g[i]);
        else if (std::isinf(xi)) ok = g[i] == 0.0;
        else ok = std::isfinite(g[i]);
        ASSERT_TRUE(ok) << (id == OpId::Relu ? "relu" : id == OpId::Silu ? "silu" : "sigmoid") << " n=" << n
                        << " at " << i << ": x=" << xi << " gradient " << g[i];
      }
    }
    // relu: a NaN or infinite cotangent is zeroed where x <= 0 and passes where x > 0 or x is NaN
    TensorPtr x = specials_tensor(dt, n);
    std::vector<double> c(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) c[static_cast<size_t>(i)] = (i / kSpecials) % 2 ? std::nan("") : kInf;
    backward(call_op(OpId::Relu, std::vector<Operand>{Operand::of(x)}), dense_tensor(true, Shape::of({n}), c), false);
    std::vector<double> g = values_of(x->grad);
    for (int64_t i = 0; i < n; ++i) {
      const double xi = widen(*dt.d, dt.specials[static_cast<size_t>(i % kSpecials)]);
      const double ci = c[static_cast<size_t>(i)];
      if (std::isnan(xi) || xi > 0) ASSERT_TRUE(std::isnan(ci) ? std::isnan(g[i]) : g[i] == ci) << i;
      else ASSERT_TRUE(g[i] == 0.0 && !std::signbit(g[i])) << i << ": x=" << xi << " gradient " << g[i];
    }
  }
}

// softmax along mode 1 of (rows, n): a NaN, a +inf, only -inf, and -inf beside finite values.
TEST_P(NanBothPaths, SoftmaxRowsWithNanAndInfinities) {
  const double nan = std::nan("");
  for (const Dt& dt : dtypes())
    for (int64_t n : {int64_t{5}, int64_t{16}, int64_t{37}, int64_t{600}}) {
      const int64_t rows = 6;
      std::vector<std::vector<double>> r(rows, std::vector<double>(static_cast<size_t>(n)));
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < n; ++j) r[i][j] = static_cast<double>((i * 7 + j * 3) % 11) / 4 - 1;
      r[0][static_cast<size_t>(n - 1)] = nan;  // a NaN in the tail
      r[1][0] = kInf;
      for (double& v : r[2]) v = -kInf;
      for (int64_t j = 0; j < n; j += 2) r[3][j] = -kInf;
      r[4][static_cast<size_t>(n / 2)] = -nan;
      std::vector<double> vals;  // column-major (rows, n)
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < rows; ++i) vals.push_back(r[i][j]);
      TensorPtr x = dense_tensor(true, Shape::of({rows, n}), vals, *dt.d);
      std::vector<double> y = values_of(softmax(x, 1));
      for (int64_t i = 0; i < rows; ++i) {
        double sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double v = y[static_cast<size_t>(j * rows + i)];
          const std::string what = std::string(dt.d->name()) + " n=" + std::to_string(n) + " row " +
                                   std::to_string(i) + " col " + std::to_string(j) + ": " + std::to_string(v);
          if (i <= 2 || i == 4) ASSERT_TRUE(std::isnan(v)) << what;
          else if (i == 3 && j % 2 == 0) ASSERT_TRUE(v == 0.0) << what;
          else ASSERT_TRUE(std::isfinite(v) && v > 0) << what;
          sum += v;
        }
        if (i == 3 || i == 5) EXPECT_NEAR(sum, 1.0, 0.02 + 1e-3 * n) << dt.d->name() << " row " << i;
      }
      if (dt.d->id() != DTypeId::Float32) continue;
      // the gradient (cotangent 1 + j/8): NaN throughout the NaN rows, 0 at -inf beside finite values
      std::vector<double> c;
      for (int64_t k = 0; k < rows * n; ++k) c.push_back(1 + static_cast<double>(k % 8) / 8);
      backward(softmax(x, 1), dense_tensor(true, Shape::of({rows, n}), c), false);
      std::vector<double> g = values_of(x->grad);
      for (int64_t i = 0; i < rows; ++i)
        for (int64_t j = 0; j < n; ++j) {
          const double v = g[static_cast<size_t>(j * rows + i)];
          if (i <= 2 || i == 4) ASSERT_TRUE(std::isnan(v)) << "gradient row " << i << " col " << j << ": " << v;
          else if (i == 3 && j % 2 == 0) ASSERT_TRUE(v == 0.0) << "gradient row " << i << " col " << j << ": " << v;
          else ASSERT_TRUE(std::isfinite(v)) << "gradient row " << i << " col " << j << ": " << v;
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Paths, NanBothPaths, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "portable" : "dispatched"; });

}  // namespace
}  // namespace sw
