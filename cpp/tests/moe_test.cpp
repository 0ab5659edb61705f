// SparseMoE (strideweave/moe.hpp) from C++: forward and backward against a double reference of the block on
// row-major (PyTorch (out, in)) Float32 tiles, and its errors. The full matrix of dtypes, layouts, checkpoints
// and budgets is tests/test_moe.py.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "strideweave/autograd.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/moe.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace sw {
namespace {

constexpr int64_t T = 5, H = 6, I = 7, E = 4, K = 2;

// (rows, cols, E) over a TiledEvictable with row-major tiles holding stack[e][r][c] = v[(e * rows + r) * cols + c].
TensorPtr tiled(const std::vector<float>& v, int64_t rows, int64_t cols) {
  auto primary = std::make_shared<CPUCarrier>(0, DType::Float32(), true, false);
  auto secondary = std::make_shared<FileBackedCarrier>("", DType::Float32(), true);
  secondary->grow(rows * cols * E, true);
  secondary->write_slots(0, rows * cols * E, v.data());
  auto c = std::make_shared<TiledEvictable>(primary, secondary, std::vector<int64_t>{1, 1, E},
                                            std::vector<int64_t>{rows, cols, 1}, nullptr);
  return make_tensor(c, 0, Layout(Shape::flat({rows, cols, E}), Stride::flat({cols, 1, rows * cols})));
}

// A (rows, cols) CPU Float32 tensor, row-major, holding v[r * cols + c].
TensorPtr dense(const std::vector<float>& v, int64_t rows, int64_t cols) {
  auto c = std::make_shared<CPUCarrier>(rows * cols, DType::Float32(), true, true);
  c->write_slots(0, rows * cols, v.data());
  return make_tensor(c, 0, Layout(Shape::flat({rows, cols}), Stride::flat({cols, 1})));
}

std::vector<float> normal(size_t n, std::mt19937& rng, float scale) {
  std::normal_distribution<float> d(0.f, scale);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  return v;
}

double silu(double z) { return z / (1 + std::exp(-z)); }
double dsilu(double z) {
  const double s = 1 / (1 + std::exp(-z));
  return s * (1 + z * (1 - s));
}

TEST(SparseMoE, ForwardAndExpertGradientsMatchADoubleReference) {
  const unsigned seed = 20261903;
  SCOPED_TRACE("seed " + std::to_string(seed));
  std::mt19937 rng(seed);
  auto w1 = normal(E * I * H, rng, 0.4f), w3 = normal(E * I * H, rng, 0.4f), w2 = normal(E * H * I, rng, 0.4f);
  auto x = normal(T * H, rng, 1.f), r = normal(E * H, rng, 1.f);
  SparseMoE moe(tiled(w1, I, H), tiled(w2, H, I), tiled(w3, I, H), K, true, nullptr, nullptr);
  GradModeGuard on(true);
  TensorPtr xt = dense(x, T, H), rt = dense(r, E, H);
  TensorPtr out = moe.forward(xt, rt);
  std::vector<float> ones(T * H, 1.0f);
  backward(out, dense(ones, T, H), false);

  // The reference: routing, output, and dW1 (gradient of sum(out)).
  std::vector<double> ref(T * H, 0.0), mag(T * H, 0.0), dw1(E * I * H, 0.0), dw1m(E * I * H, 0.0);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> p(E);
    double mx = -1e300, sum = 0;
    for (int64_t e = 0; e < E; ++e) {
      double l = 0;
      for (int64_t h = 0; h < H; ++h) l += double(x[t * H + h]) * r[e * H + h];
      p[e] = l;
      mx = std::max(mx, l);
    }
    for (auto& v : p) sum += (v = std::exp(v - mx));
    for (auto& v : p) v /= sum;
    std::vector<int64_t> order(E);
    for (int64_t e = 0; e < E; ++e) order[e] = e;
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
    ASSERT_GT(p[order[K - 1]] - p[order[K]], 1e-4) << "routing near a tie at token " << t;
    const double s = p[order[0]] + p[order[1]];
    for (int64_t j = 0; j < K; ++j) {
      const int64_t e = order[j];
      const double w = p[e] / s;
      std::vector<double> h1(I), h3(I), hh(I), ahh(I);
      for (int64_t i = 0; i < I; ++i) {
        double a = 0, b = 0;
        for (int64_t h = 0; h < H; ++h) {
          a += double(w1[(e * I + i) * H + h]) * x[t * H + h];
          b += double(w3[(e * I + i) * H + h]) * x[t * H + h];
        }
        h1[i] = a, h3[i] = b, hh[i] = silu(a) * b, ahh[i] = std::abs(hh[i]) + std::abs(a * b);
      }
      std::vector<double> dh(I, 0.0);
      for (int64_t h = 0; h < H; ++h) {
        double y = 0, ym = 0;
        for (int64_t i = 0; i < I; ++i) {
          y += double(w2[(e * H + h) * I + i]) * hh[i];
          ym += std::abs(double(w2[(e * H + h) * I + i])) * ahh[i];
          dh[i] += w * w2[(e * H + h) * I + i];  // d sum(out) / d hh
        }
        ref[t * H + h] += w * y;
        mag[t * H + h] += w * ym;
      }
      for (int64_t i = 0; i < I; ++i)
        for (int64_t h = 0; h < H; ++h) {
          dw1[(e * I + i) * H + h] += dh[i] * h3[i] * dsilu(h1[i]) * x[t * H + h];
          dw1m[(e * I + i) * H + h] += std::abs(dh[i] * h3[i] * x[t * H + h]) * 2;
        }
    }
  }
  // Float32 throughout: each result within 64 (H + I) 2^-24 of its magnitude (a Float32 sum of at most H + I terms
  // per stage, a handful of stages, and the routing weights' own Float32 error).
  const double u = std::ldexp(1.0, -24) * 64 * (H + I);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) EXPECT_NEAR(out->get(IntTuple::tuple({t, h})).f, ref[t * H + h], u * mag[t * H + h] + 1e-30);
  TensorPtr g1 = moe.w1()->grad;
  ASSERT_TRUE(g1);
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < I; ++i)
      for (int64_t h = 0; h < H; ++h)
        EXPECT_NEAR(g1->get(IntTuple::tuple({i, h, e})).f, dw1[(e * I + i) * H + h], u * dw1m[(e * I + i) * H + h] + 1e-30)
            << "dW1 expert " << e << " (" << i << ", " << h << ")";
  EXPECT_TRUE(xt->grad && rt->grad);
  MoEStats st = moe.stats();
  EXPECT_EQ(st.calls, 1);
  EXPECT_GT(st.expert_visits, 0);
}

TEST(SparseMoE, ErrorsNameTheArgument) {
  std::mt19937 rng(1);
  auto w = normal(E * I * H, rng, 1.f);
  TensorPtr a = tiled(w, I, H), b = tiled(w, H, I), c = tiled(w, I, H);
  try {
    SparseMoE moe(a, b, c, E + 1, true, nullptr, nullptr);
    FAIL() << "top_k out of range accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("top_k must be in [1, 4]"), std::string::npos) << e.what();
  }
  try {
    SparseMoE moe(a, c, c, 2, true, nullptr, nullptr);
    FAIL() << "w2 of w1's shape accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("w2 must have shape"), std::string::npos) << e.what();
  }
  SparseMoE moe(a, b, c, 2, true, nullptr, nullptr);
  std::vector<float> x(T * (H + 1), 0.f);
  EXPECT_THROW(moe.forward(dense(x, T, H + 1), dense(std::vector<float>(E * H, 0.f), E, H)), ValueError);
  EXPECT_EQ(moe.stats().calls, 0);
}

}  // namespace
}  // namespace sw
