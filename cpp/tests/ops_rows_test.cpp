// The row operations in C++ (Note [Row operations] in cpp/src/ops/rows.cpp; docs/guide.md, "Row operations"):
// the polynomial exp's bound; softmax, topk, index_select and index_add against double references on dense,
// strided and broadcast layouts in Float32, BFloat16 and Float16, on the CPU (fast) and Generic (reference)
// backends and on every kind of carrier_kinds(); the VJPs against finite differences and their formulas; the
// adjointness of index_select and index_add; the errors (type, message, nothing changed); the table's rows.
//
// Bounds (u = 2^-24, u16 = 2^-8 for BFloat16 and 2^-11 for Float16; a 16-bit result adds u16 |r| and, for
// Float16's subnormals, 2^-25): softmax relative 2 (u R + e_exp) + (n + 1) u, R = max |x - max|, e_exp = 2u;
// topk and index_select exact; index_add gamma_c (|t| + sum |s|) for c source rows.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "../src/ops/rows.hpp"
#include "carrier_kinds.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using testing_support::carrier_kinds;
using testing_support::KindEnv;
using testing_support::KindSpec;
using testing_support::Rng;
using testing_support::test_seed;
using testing_support::values_of;

constexpr double kU = 0x1p-24;

double u16_of(const DType& d) {
  return d.id() == DTypeId::BFloat16 ? 0x1p-8 : d.id() == DTypeId::Float16 ? 0x1p-11 : 0.0;
}
double round_to(const DType& d, double v) {
  const Value c = d.convert(Value::from_float(v));
  return c.f;
}

// A (rows, cols) tensor on `c` holding `a` (row-major values, rounded to c's dtype) in one of four layouts:
// 0 column-major, 1 row-major, 2 sliced (gaps and an offset), 3 broadcast (mode 0 of stride 0: every row is row 0).
TensorPtr placed(const CarrierPtr& c, int how, int64_t rows, int64_t cols, std::vector<double>& a) {
  const DType& d = c->dtype();
  for (double& v : a) v = round_to(d, v);
  if (how == 3)
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) a[i * cols + j] = a[j];
  int64_t off = 0, s0 = 1, s1 = rows;
  if (how == 1) s0 = cols, s1 = 1;
  if (how == 2) off = 3, s0 = 2, s1 = 2 * rows + 1;
  if (how == 3) s0 = 0, s1 = 1;
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) c->write_value(off + i * s0 + j * s1, Value::from_float(a[i * cols + j]));
  return make_tensor(c, off, Layout(Shape::of({rows, cols}), Stride(IntTuple::tuple({s0, s1}))));
}

int64_t cosize_for(int how, int64_t rows, int64_t cols) { return how == 2 ? 3 + (2 * rows + 1) * cols : rows * cols; }

// The value at (i, j) of a two-mode tensor.
double at(const TensorPtr& t, int64_t i, int64_t j) {
  const Value v = t->get(IntTuple::tuple({IntTuple(i), IntTuple(j)}));
  return v.kind == Value::Kind::Int ? double(v.i) : v.f;
}

std::vector<double> random_values(Rng& rng, int64_t n, double scale) {
  std::normal_distribution<double> nd(0.0, scale);
  std::vector<double> v(static_cast<size_t>(n));
  for (double& x : v) x = nd(rng.g);
  return v;
}

CarrierPtr native(bool cpu, int64_t n, const DType& d) {
  return cpu ? CarrierPtr(std::make_shared<CPUCarrier>(n, d, true, false))
             : CarrierPtr(std::make_shared<GenericCarrier>(n, d, true));
}

TensorPtr index_tensor(const CarrierPtr& c) {
  return make_tensor(c, 0, Layout(Shape::of({c->size()}), Stride(IntTuple::tuple({int64_t{1}}))));
}
TensorPtr indices_on(bool cpu, const std::vector<int32_t>& idx) {
  CarrierPtr c = native(cpu, static_cast<int64_t>(idx.size()), DType::Int32());
  for (size_t i = 0; i < idx.size(); ++i) c->write_value(static_cast<int64_t>(i), Value::from_int(idx[i]));
  return index_tensor(c);
}

const std::vector<const DType*>& floats() {
  static const std::vector<const DType*> f{&DType::Float32(), &DType::BFloat16(), &DType::Float16()};
  return f;
}

// ---------------------------------------------------------------- exp

TEST(RowExp, WithinTwoUlpOfExpForNonPositiveArguments) {
  double worst = 0;
  for (float x = 0.f; x > -87.f; x -= 0.000731f) {
    const double want = std::exp(static_cast<double>(x));
    const double got = detail::row_exp(x);
    worst = std::max(worst, std::abs(got - want) / want);
  }
  EXPECT_LE(worst, 2 * kU) << "relative error " << worst / kU << " u";
  EXPECT_EQ(detail::row_exp(-200.f), 0.f);
  EXPECT_TRUE(std::isnan(detail::row_exp(std::nanf(""))));
  EXPECT_EQ(detail::row_exp(-std::numeric_limits<float>::infinity()), 0.f);
  // Subnormal results: exp(-100) is about 3.7e-44; within one subnormal step (2^-149) of it.
  EXPECT_LE(std::abs(detail::row_exp(-100.f) - std::exp(-100.0)), 0x1p-149);
}

// ---------------------------------------------------------------- forward

class RowsForward : public ::testing::TestWithParam<std::tuple<bool, int, int>> {};

TEST_P(RowsForward, AgainstDouble) {
  const auto [cpu, how, dt] = GetParam();
  const DType& d = *floats()[static_cast<size_t>(dt)];
  Rng rng(test_seed() + static_cast<uint64_t>(how * 7 + dt));
  const int64_t rows = 5, cols = 37;
  std::vector<double> a = random_values(rng, rows * cols, 4.0);
  TensorPtr t = placed(native(cpu, cosize_for(how, rows, cols), d), how, rows, cols, a);
  const double u16 = u16_of(d), sub = d.id() == DTypeId::Float16 ? 0x1p-25 : 0.0;
  for (int64_t mode : {0, 1, -1}) {
    const int64_t m = mode < 0 ? mode + 2 : mode;
    TensorPtr y = softmax(t, mode);
    ASSERT_EQ(&y->dtype(), &d);
    const int64_t outer = m == 0 ? cols : rows, n = m == 0 ? rows : cols;
    for (int64_t o = 0; o < outer; ++o) {
      auto x = [&](int64_t i) { return m == 0 ? a[i * cols + o] : a[o * cols + i]; };
      double mx = -INFINITY, s = 0, R = 0;
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, x(i));
      for (int64_t i = 0; i < n; ++i) s += std::exp(x(i) - mx), R = std::max(R, mx - x(i));
      const double rel = 1.01 * (2 * (kU * R + 2 * kU) + (n + 1) * kU);
      for (int64_t i = 0; i < n; ++i) {
        const double want = std::exp(x(i) - mx) / s;
        const double got = m == 0 ? at(y, i, o) : at(y, o, i);
        EXPECT_LE(std::abs(got - want), u16 * want + (1 + u16) * rel * want + sub) << "mode " << mode << " row " << o;
      }
    }
    // topk: exact values, ties by the lower index.
    auto [v, ix] = topk(t, 3, mode);
    ASSERT_EQ(&ix->dtype(), &DType::Int32());
    for (int64_t o = 0; o < outer; ++o) {
      std::vector<int64_t> order(static_cast<size_t>(n));
      std::iota(order.begin(), order.end(), 0);
      auto x = [&](int64_t i) { return m == 0 ? a[i * cols + o] : a[o * cols + i]; };
      std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return x(p) > x(q); });
      for (int64_t j = 0; j < 3; ++j) {
        EXPECT_EQ(m == 0 ? at(ix, j, o) : at(ix, o, j), order[static_cast<size_t>(j)]);
        EXPECT_EQ(m == 0 ? at(v, j, o) : at(v, o, j), x(order[static_cast<size_t>(j)]));
      }
    }
  }
  // index_select is exact; index_add sums in Float32 and rounds once.
  const std::vector<int32_t> idx{4, 0, 4, 2, 4};
  TensorPtr sel = index_select(t, 0, indices_on(cpu, idx));
  for (size_t j = 0; j < idx.size(); ++j)
    for (int64_t c = 0; c < cols; ++c) EXPECT_EQ(at(sel, static_cast<int64_t>(j), c), a[idx[j] * cols + c]);
  std::vector<double> s = random_values(rng, 5 * cols, 4.0);
  TensorPtr src = placed(native(cpu, 5 * cols, d), 1, 5, cols, s);
  TensorPtr sum = index_add(t, 0, indices_on(cpu, idx), src);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < cols; ++c) {
      double want = a[r * cols + c], mag = std::abs(want);
      int count = 0;
      for (size_t j = 0; j < idx.size(); ++j)
        if (idx[j] == r) want += s[j * cols + c], mag += std::abs(s[j * cols + c]), ++count;
      const double bound = u16 * std::abs(want) + (1 + u16) * count * kU / (1 - count * kU) * mag + sub;
      EXPECT_LE(std::abs(at(sum, r, c) - want), bound) << r << "," << c;
    }
}

std::string forward_name(const ::testing::TestParamInfo<std::tuple<bool, int, int>>& info) {
  static const char* hows[] = {"ColumnMajor", "RowMajor", "Sliced", "Broadcast"};
  return std::string(std::get<0>(info.param) ? "CPU" : "Generic") + "_" + hows[std::get<1>(info.param)] + "_" +
         floats()[static_cast<size_t>(std::get<2>(info.param))]->name();
}

INSTANTIATE_TEST_SUITE_P(Rows, RowsForward,
                         ::testing::Combine(::testing::Bool(), ::testing::Range(0, 4), ::testing::Range(0, 3)),
                         forward_name);

TEST(Rows, TopKOrdersNanFirstAndTiesByIndex) {
  for (bool cpu : {true, false}) {
    std::vector<double> a{1.0, NAN, 3.0, -0.0, 0.0, NAN, 2.0};
    TensorPtr t = placed(native(cpu, 7, DType::Float32()), 1, 1, 7, a);
    auto [v, ix] = topk(t, 7, 1);
    const std::vector<double> want{1, 5, 2, 6, 0, 3, 4};
    for (int64_t j = 0; j < 7; ++j) EXPECT_EQ(at(ix, 0, j), want[static_cast<size_t>(j)]) << (cpu ? "CPU" : "Generic");
    EXPECT_TRUE(std::signbit(at(v, 0, 5)));
    EXPECT_FALSE(std::signbit(at(v, 0, 6)));
  }
  // k above 32 takes the partial-sort path: the same order.
  Rng rng(test_seed());
  std::vector<double> a(100);
  for (double& x : a) x = static_cast<double>(rng.uniform(-5, 5));
  TensorPtr t = placed(native(true, 100, DType::Float32()), 1, 1, 100, a);
  auto [v, ix] = topk(t, 40, 1);
  std::vector<int64_t> order(100);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return a[p] > a[q]; });
  for (int64_t j = 0; j < 40; ++j) EXPECT_EQ(at(ix, 0, j), order[static_cast<size_t>(j)]);
}

// ---------------------------------------------------------------- every carrier kind

TEST(Rows, EveryCarrierKind) {
  const std::vector<std::string> executing{"Generic", "CPU", "Evictable", "TiledEvictable"};
  for (const KindSpec& spec : carrier_kinds()) {
    KindEnv env;
    const bool runs = std::find(executing.begin(), executing.end(), spec.name) != executing.end();
    SCOPED_TRACE(spec.name);
    std::vector<double> a(24);
    for (size_t i = 0; i < a.size(); ++i) a[i] = static_cast<double>((i * 7) % 11) - 5;
    CarrierPtr c = spec.make(env, 24, DType::Float32(), true);
    for (int64_t i = 0; i < 24; ++i) c->write_value(i, Value::from_float(a[static_cast<size_t>(i)]));
    TensorPtr t = make_tensor(c, 0, Layout(Shape::of({4, 6}), Stride(IntTuple::tuple({int64_t{1}, int64_t{4}}))));
    // A tensor covers a TiledEvictable's full logical shape: the indices' TiledEvictable has one axis.
    CarrierPtr ic = spec.make(env, 4, DType::Int32(), true);
    if (std::string(spec.name) == "TiledEvictable") {
      auto secondary = std::make_shared<FileBackedCarrier>("", DType::Int32(), true);
      secondary->grow(4, true);
      ic = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, DType::Int32(), true, false), secondary,
                                            std::vector<int64_t>{1}, std::vector<int64_t>{4}, nullptr, true);
    }
    const int32_t idx[4] = {2, 0, 2, 1};
    for (int64_t i = 0; i < 4; ++i) ic->write_value(i, Value::from_int(idx[i]));
    TensorPtr ind = index_tensor(ic);
    const uint64_t version = c->version();
    if (!runs) {
      EXPECT_THROW(softmax(t, 1), NotImplementedError);
      EXPECT_THROW(topk(t, 2, 1), NotImplementedError);
      EXPECT_THROW(index_select(t, 0, ind), NotImplementedError);
      EXPECT_THROW(index_add(t, 0, ind, t), NotImplementedError);
      EXPECT_EQ(c->version(), version);
      continue;
    }
    auto val = [&](int64_t i, int64_t j) { return a[static_cast<size_t>(i + 4 * j)]; };
    TensorPtr y = softmax(t, 1);
    for (int64_t i = 0; i < 4; ++i) {
      double s = 0, mx = -INFINITY;
      for (int64_t j = 0; j < 6; ++j) mx = std::max(mx, val(i, j));
      for (int64_t j = 0; j < 6; ++j) s += std::exp(val(i, j) - mx);
      for (int64_t j = 0; j < 6; ++j) EXPECT_NEAR(at(y, i, j), std::exp(val(i, j) - mx) / s, 1e-6);
    }
    auto [v, ix] = topk(t, 1, 1);
    for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(at(v, i, 0), val(i, static_cast<int64_t>(at(ix, i, 0))));
    TensorPtr sel = index_select(t, 0, ind);
    TensorPtr sum = index_add(t, 0, ind, t);  // t's rows 0..3 sent to rows 2, 0, 2, 1 (a source of t's kind)
    for (int64_t j = 0; j < 6; ++j) {
      EXPECT_EQ(at(sel, 1, j), val(0, j));
      EXPECT_EQ(at(sel, 3, j), val(1, j));
      EXPECT_EQ(at(sum, 2, j), val(2, j) + val(0, j) + val(2, j));
      EXPECT_EQ(at(sum, 0, j), val(0, j) + val(1, j));
      EXPECT_EQ(at(sum, 1, j), val(1, j) + val(3, j));
      EXPECT_EQ(at(sum, 3, j), val(3, j));
    }
    EXPECT_EQ(c->version(), version);
  }
}

// ---------------------------------------------------------------- VJPs and adjointness

// d/dx of sum(w * f(x)) by backward, and by central differences in Float32 (float sums of the results).
TEST(Rows, VjpsAgainstFiniteDifferences) {
  Rng rng(test_seed());
  const int64_t rows = 3, cols = 5;
  std::vector<double> x0 = random_values(rng, rows * cols, 1.0);
  for (double& v : x0) v = std::round(v * 64) / 64;  // x +- h exact (h = 2^-7)
  std::vector<double> w = random_values(rng, rows * cols, 1.0);
  std::vector<std::pair<const char*, std::function<TensorPtr(const TensorPtr&)>>> fs{
      {"softmax", [](const TensorPtr& x) { return softmax(x, 1); }},
      {"softmax mode 0", [](const TensorPtr& x) { return softmax(x, 0); }},
      {"index_select", [](const TensorPtr& x) { return index_select(x, 1, indices_on(true, {4, 0, 4, 2, 1})); }},
  };
  for (auto& [name, f] : fs) {
    SCOPED_TRACE(name);
    GradModeGuard on(true);
    std::vector<double> xs = x0;
    TensorPtr x = placed(native(true, rows * cols, DType::Float32()), 0, rows, cols, xs);
    TensorPtr y = f(x);
    std::vector<double> wv(w.begin(), w.begin() + y->size());
    backward(y, testing_support::dense_tensor(true, y->layout.shape(), wv), false);
    const std::vector<double> g = values_of(x->grad);
    const double h = 0x1p-7;
    auto loss = [&](std::vector<double> v) {
      GradModeGuard off(false);
      TensorPtr out = f(testing_support::dense_tensor(true, Shape::of({rows, cols}), v));
      double s = 0;
      std::vector<double> ov = values_of(out);
      for (size_t i = 0; i < ov.size(); ++i) s += wv[i] * ov[i];
      return s;
    };
    for (int64_t i = 0; i < rows * cols; ++i) {
      std::vector<double> p = values_of(x), q = p;  // ordinal order (column-major)
      p[static_cast<size_t>(i)] += h;
      q[static_cast<size_t>(i)] -= h;
      const double fd = (loss(p) - loss(q)) / (2 * h);
      // rounding: 2 * (sum |w| * 1e-6) / (2h) (the softmax bound is below 1e-6 here); truncation h^2 / 6 * sum |w|.
      EXPECT_NEAR(g[static_cast<size_t>(i)], fd, 15 * 1e-6 / h + h * h / 6 * 15) << i;
    }
  }
}

TEST(Rows, TopKGradientScattersIntoTheSelectedPositions) {
  GradModeGuard on(true);
  std::vector<double> a{0.5, 3.0, 3.0, -2.0, 0.0, 0.0, 0.0, 5.0};
  TensorPtr x = placed(native(true, 8, DType::BFloat16()), 1, 2, 4, a);
  auto [v, ix] = topk(x, 2, 1);
  backward(v, testing_support::dense_tensor(true, v->layout.shape(), {0.5, 2.0, -0.25, 4.0}), false);  // column-major
  // row 0: values 3 (index 1), 3 (index 2); row 1: 5 (index 3), 0 (index 0)
  EXPECT_EQ(at(x->grad, 0, 1), 0.5);
  EXPECT_EQ(at(x->grad, 0, 2), -0.25);
  EXPECT_EQ(at(x->grad, 1, 3), 2.0);
  EXPECT_EQ(at(x->grad, 1, 0), 4.0);
  EXPECT_EQ(at(x->grad, 0, 0), 0.0);
  EXPECT_FALSE(ix->is_differentiable());
}

TEST(Rows, IndexSelectAndIndexAddAreAdjoint) {
  Rng rng(test_seed());
  for (int64_t mode : {0, 1}) {
    const int64_t rows = 6, cols = 4, n = mode == 0 ? rows : cols;
    std::vector<int32_t> idx;
    for (int i = 0; i < 9; ++i) idx.push_back(static_cast<int32_t>(rng.uniform(0, n - 1)));
    std::vector<double> xv(rows * cols), yv(9 * (mode == 0 ? cols : rows));
    for (double& v : xv) v = static_cast<double>(rng.uniform(-20, 20));
    for (double& v : yv) v = static_cast<double>(rng.uniform(-20, 20));
    TensorPtr x = testing_support::dense_tensor(true, Shape::of({rows, cols}), xv);
    const Shape ys = mode == 0 ? Shape::of({9, cols}) : Shape::of({rows, 9});
    TensorPtr y = testing_support::dense_tensor(true, ys, yv);
    TensorPtr zero = testing_support::dense_tensor(true, Shape::of({rows, cols}), std::vector<double>(rows * cols, 0.0));
    const std::vector<double> sx = values_of(index_select(x, mode, indices_on(true, idx)));
    const std::vector<double> ay = values_of(index_add(zero, mode, indices_on(true, idx), y));
    double lhs = 0, rhs = 0;
    for (size_t i = 0; i < sx.size(); ++i) lhs += sx[i] * yv[i];
    for (size_t i = 0; i < ay.size(); ++i) rhs += xv[i] * ay[i];
    EXPECT_EQ(lhs, rhs) << "mode " << mode;
  }
}

// ---------------------------------------------------------------- errors and the table

TEST(Rows, ErrorsChangeNothing) {
  std::vector<double> a(12);
  std::iota(a.begin(), a.end(), 0.0);
  TensorPtr t = testing_support::dense_tensor(true, Shape::of({3, 4}), a);
  TensorPtr it = testing_support::dense_tensor(true, Shape::of({3, 4}), a, DType::Int32());
  const uint64_t version = t->carrier->version();
  EXPECT_SW_THROW(TypeError, "softmax: t must be a floating-point tensor", softmax(it, 0));
  EXPECT_SW_THROW(ValueError, "softmax: mode 2 is out of range for a tensor of 2 modes", softmax(t, 2));
  EXPECT_SW_THROW(ValueError, "topk: k=5 is out of range for mode 1 of extent 4 (1 <= k <= 4)", topk(t, 5, 1));
  EXPECT_SW_THROW(ValueError, "k=0 is out of range", topk(t, 0, -1));
  EXPECT_SW_THROW(TypeError, "index_select: indices must be an Int32 tensor, got Float32", index_select(t, 0, t));
  EXPECT_SW_THROW(IndexError, "index_select: index 3 (position 1 of indices) is out of range for mode 0 of extent 3",
                  index_select(t, 0, indices_on(true, {0, 3})));
  EXPECT_SW_THROW(IndexError, "index -1 (position 0 of indices) is out of range for mode 1 of extent 4",
                  index_add(t, 1, indices_on(true, {-1}), t));
  EXPECT_SW_THROW(ValueError, "index_add: source has shape (3,4)", index_add(t, 0, indices_on(true, {0}), t));
  EXPECT_SW_THROW(TypeError, "Tensor backing carriers must match", index_select(t, 0, indices_on(false, {0})));
  // a two-result row needs the place of its second result
  const Operand ops[1] = {Operand::of(t)};
  OpOptions o;
  o.k = 1;
  EXPECT_SW_THROW(TypeError, "topk has two results", call_op(OpId::TopK, ops, o));
  TensorPtr unused;
  o.second = &unused;
  EXPECT_SW_THROW(TypeError, "softmax has one result", call_op(OpId::Softmax, ops, o));
  EXPECT_EQ(unused, nullptr);
  EXPECT_EQ(t->carrier->version(), version);
  EXPECT_EQ(values_of(t), a);
}

TEST(Rows, TableRows) {
  const OpDef& s = op_def(OpId::Softmax);
  EXPECT_STREQ(s.name, "softmax");
  EXPECT_TRUE(s.takes_mode() && !s.takes_k() && s.results() == 1 && s.arity == 1 && s.differentiable());
  const OpDef& k = op_def(OpId::TopK);
  EXPECT_TRUE(k.takes_mode() && k.takes_k() && k.results() == 2 && k.arity == 1);
  const OpDef& g = op_def(OpId::IndexSelect);
  EXPECT_TRUE(g.arity == 2 && g.shape == OpShape::Gather && std::string(g.operand_names[1]) == "indices");
  const OpDef& a = op_def(OpId::IndexAdd);
  EXPECT_TRUE(a.arity == 3 && a.shape == OpShape::Scatter && std::string(a.operand_names[2]) == "source");
  EXPECT_EQ(op_from_name("index_add"), OpId::IndexAdd);
  EXPECT_FALSE(op_def(OpId::Add).takes_mode());
}

}  // namespace
}  // namespace sw
