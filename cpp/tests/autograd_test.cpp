// Backward through operations, without Python: gradients of small graphs on
// dense CPU and Generic tensors against an analytic reference in double,
// accumulation into leaves, and backward's errors (type and message).
//
// Error bound: every gradient here is a sum of terms, each computed by a
// chain of at most N = 16 Float32 operations (products, quotients, sums of at
// most 4 terms); to first order each term's relative error is at most N u
// (u = 2^-24), so |grad - reference| <= 16 u * (the same sum with every term
// taken in absolute value). Data is drawn so that no relu input lies within
// 1/4 of its kink at 0 (forward errors are far smaller than that, so the
// Float32 and the exact computation take the same side).
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "strideweave/autograd.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;

constexpr double kBound = 16 * 0x1p-24;

TensorPtr call(OpId id, std::vector<Operand> ops, OpOptions options = {}) { return call_op(id, ops, options); }
TensorPtr call(OpId id, const TensorPtr& a) { return call(id, {Operand::of(a)}); }
TensorPtr call(OpId id, const TensorPtr& a, const TensorPtr& b) { return call(id, {Operand::of(a), Operand::of(b)}); }

TensorPtr sum_all(const TensorPtr& t, const char* description) {
  OpOptions o;
  o.description = description;
  return call(OpId::ReduceSum, {Operand::of(t)}, o);
}

void expect_near_all(const TensorPtr& grad, const std::vector<double>& expected, const std::vector<double>& magnitude,
                     const char* what) {
  ASSERT_NE(grad, nullptr) << what << " has no gradient";
  std::vector<double> got = values_of(grad);
  ASSERT_EQ(got.size(), expected.size()) << what;
  for (size_t i = 0; i < got.size(); ++i)
    EXPECT_LE(std::abs(got[i] - expected[i]), kBound * magnitude[i])
        << what << " element " << i << ": got " << got[i] << ", expected " << expected[i] << " (seed " << test_seed()
        << ")";
}

// ---------------------------------------------------------------- a small network

class Backward : public ::testing::TestWithParam<bool> {};

// L = sum(0.5 * (relu(x w^T + b) / d)^2): matmul, a broadcast add, relu, div, elementwise_mul, mul by a weak
// scalar and reduce_sum, with the analytic gradients of x (2x3), w (4x3), b (1x4) and d (2x4).
TEST_P(Backward, SmallNetworkMatchesAnalyticGradients) {
  const bool cpu = GetParam();
  constexpr int64_t m = 2, k = 3, n = 4;
  Rng rng(test_seed() + 17);
  for (int trial = 0; trial < 8; ++trial) {
    std::vector<double> x, w, b, d, z(m * n);
    bool clear_of_kink = false;
    while (!clear_of_kink) {  // redraw until every relu input is at least 1/4 from 0
      x = draw_eighths(rng, m * k, -2, 2), w = draw_eighths(rng, n * k, -2, 2), b = draw_eighths(rng, n, -2, 2), d = draw_eighths(rng, m * n, 1, 4);
      clear_of_kink = true;
      for (int64_t j = 0; j < n; ++j)
        for (int64_t i = 0; i < m; ++i) {
          double s = b[j];
          for (int64_t p = 0; p < k; ++p) s += x[i + m * p] * w[j + n * p];
          z[i + m * j] = s;
          clear_of_kink &= std::abs(s) >= 0.25;
        }
    }
    TensorPtr tx = dense_tensor(cpu, Shape::of({m, k}), x), tw = dense_tensor(cpu, Shape::of({n, k}), w);
    TensorPtr tb = dense_tensor(cpu, Shape::of({1, n}), b), td = dense_tensor(cpu, Shape::of({m, n}), d);
    TensorPtr h = call(OpId::Relu, call(OpId::Add, call(OpId::Matmul, tx, tw), tb));
    TensorPtr q = call(OpId::Div, h, td);
    TensorPtr half = call(OpId::Mul, {Operand::of(call(OpId::ElementwiseMul, q, q)), Operand::weak(Value::from_float(0.5))});
    TensorPtr loss = sum_all(half, "a b -> ");
    ASSERT_EQ(loss->size(), 1);
    backward(loss, nullptr, false);

    // dL/dz = [z > 0] q / d, with q = relu(z) / d; then b, x and w through the broadcast add and the matmul.
    std::vector<double> dz(m * n), dz_abs(m * n), dd(m * n), dd_abs(m * n);
    for (int64_t i = 0; i < m * n; ++i) {
      double hv = z[i] > 0 ? z[i] : 0, qv = hv / d[i];
      dz[i] = z[i] > 0 ? qv / d[i] : 0;
      dz_abs[i] = std::abs(dz[i]);
      dd[i] = -qv * hv / (d[i] * d[i]);
      dd_abs[i] = std::abs(dd[i]);
    }
    std::vector<double> gx(m * k, 0), gx_abs(m * k, 0), gw(n * k, 0), gw_abs(n * k, 0), gb(n, 0), gb_abs(n, 0);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t i = 0; i < m; ++i) {
        gb[j] += dz[i + m * j], gb_abs[j] += dz_abs[i + m * j];
        for (int64_t p = 0; p < k; ++p) {
          gx[i + m * p] += dz[i + m * j] * w[j + n * p], gx_abs[i + m * p] += dz_abs[i + m * j] * std::abs(w[j + n * p]);
          gw[j + n * p] += dz[i + m * j] * x[i + m * p], gw_abs[j + n * p] += dz_abs[i + m * j] * std::abs(x[i + m * p]);
        }
      }
    expect_near_all(tx->grad, gx, gx_abs, "x");
    expect_near_all(tw->grad, gw, gw_abs, "w");
    expect_near_all(tb->grad, gb, gb_abs, "b");
    expect_near_all(td->grad, dd, dd_abs, "d");
    // Leaves' gradients live on the leaves' kind, in their shape.
    for (const TensorPtr& leaf : {tx, tw, tb, td}) {
      EXPECT_EQ(&leaf->grad->carrier->kind(), &leaf->carrier->kind());
      EXPECT_EQ(leaf->grad->layout.shape(), leaf->layout.shape());
    }
  }
}

// L = sum(exp(a) - neg(c)): dL/da = exp(a), dL/dc = 1.
TEST_P(Backward, ExpSubNeg) {
  const bool cpu = GetParam();
  Rng rng(test_seed() + 29);
  std::vector<double> a = draw_eighths(rng, 5, -2, 2), c = draw_eighths(rng, 5, -2, 2);
  TensorPtr ta = dense_tensor(cpu, Shape::of({5}), a), tc = dense_tensor(cpu, Shape::of({5}), c);
  backward(sum_all(call(OpId::Sub, call(OpId::Exp, ta), call(OpId::Neg, tc)), "a -> "), nullptr, false);
  std::vector<double> ea, ones(5, 1.0);
  for (double v : a) ea.push_back(std::exp(v));
  expect_near_all(ta->grad, ea, ea, "a");
  EXPECT_EQ(values_of(tc->grad), ones);
}

INSTANTIATE_TEST_SUITE_P(Kinds, Backward, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& info) { return info.param ? "CPU" : "Generic"; });

// ---------------------------------------------------------------- accumulation into a leaf

TEST(BackwardAccumulation, ALeafUsedTwiceAndTwoBackwardsAdd) {
  TensorPtr x = dense_tensor(true, Shape::of({3}), {1.5, -2, 0.25});
  backward(sum_all(call(OpId::Add, x, x), "a -> "), nullptr, false);  // x used twice in one graph
  EXPECT_EQ(values_of(x->grad), (std::vector<double>{2, 2, 2}));
  TensorPtr first = x->grad;
  backward(sum_all(call(OpId::Mul, {Operand::weak(Value::from_int(3)), Operand::of(x)}), "a -> "), nullptr, false);
  EXPECT_EQ(values_of(x->grad), (std::vector<double>{5, 5, 5}));  // a second backward adds into .grad
  EXPECT_EQ(values_of(first), (std::vector<double>{2, 2, 2}));     // ... without writing a gradient handed out
}

TEST(BackwardAccumulation, RetainGraphRunsTwiceAndOtherwiseTheGraphIsFreed) {
  TensorPtr x = dense_tensor(true, Shape::of({2}), {1, 2});
  TensorPtr loss = sum_all(call(OpId::ElementwiseMul, x, x), "a -> ");
  backward(loss, nullptr, /*retain_graph=*/true);
  backward(loss, nullptr, /*retain_graph=*/false);
  EXPECT_EQ(values_of(x->grad), (std::vector<double>{4, 8}));  // 2 * (2x)
  EXPECT_SW_THROW(RuntimeError, "retain_graph=True", backward(loss, nullptr, false));
}

TEST(BackwardAccumulation, AnExplicitSeedScalesTheGradient) {
  TensorPtr x = dense_tensor(false, Shape::of({2}), {1, -3});
  TensorPtr y = call(OpId::Neg, x);
  backward(y, dense_tensor(false, Shape::of({2}), {0.5, 4}), false);
  EXPECT_EQ(values_of(x->grad), (std::vector<double>{-0.5, -4}));
}

// ---------------------------------------------------------------- errors

TEST(BackwardErrors, ASavedInputWrittenAfterForward) {
  TensorPtr x = dense_tensor(true, Shape::of({2}), {1, -2});
  TensorPtr loss = sum_all(call(OpId::Relu, x), "a -> ");  // relu saves x
  x->carrier->set(0, Value::from_float(5));
  EXPECT_SW_THROW(RuntimeError, "modified in-place: relu saved a tensor of shape", backward(loss, nullptr, false));
}

TEST(BackwardErrors, SeedsAndOutputs) {
  TensorPtr x = dense_tensor(true, Shape::of({2}), {1, -2});
  TensorPtr y = call(OpId::Neg, x);
  EXPECT_SW_THROW(ValueError, "gradient can be omitted only for single-element outputs", backward(y, nullptr, false));
  EXPECT_SW_THROW(ValueError, "does not match the output's", backward(y, dense_tensor(true, Shape::of({3}), {1, 1, 1}), false));
  EXPECT_SW_THROW(TypeError, "gradient must be a Float32 tensor",
                  backward(y, dense_tensor(true, Shape::of({2}), {1, 1}, DType::Int32()), false));
  TensorPtr ints = call(OpId::Neg, dense_tensor(true, Shape::of({1}), {3}, DType::Int32()));
  EXPECT_SW_THROW(RuntimeError, "tensor is not differentiable", backward(ints, nullptr, false));
  EXPECT_EQ(x->grad, nullptr);  // nothing accumulated by a refused backward
}

}  // namespace
}  // namespace sw
