// The operation table and dispatch, without Python: every row of the table is
// run through call_op on dense CPU and Generic tensors and compared with a
// double-precision reference computed here, within a stated error bound; the
// rows' properties (names, saved inputs, capabilities) and call_op's errors
// (exception type and message) are checked too.
//
// Error bounds: Float32 inputs are drawn as small multiples of 1/8 (exact in
// Float32); u = 2^-24 is Float32's unit roundoff.
//  - add, sub, mul, elementwise_mul, div: one correctly rounded IEEE operation, |err| <= u |r|.
//  - neg, relu: exact.
//  - exp: libm's expf is within one ulp (<= 2u |r|); two ulps are allowed: 4u |r|.
//  - reduce_sum of n values: accumulated in double, rounded once: u |r| + n 2^-53 sum|x|.
//  - matmul over k products: any order of Float32 sums and products (BLAS, the skinny kernels, or the
//    reference in double) is within gamma_k sum|a b|, gamma_k = k u / (1 - k u).
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "strideweave/autograd.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using testing_support::dense_tensor;
using testing_support::draw_eighths;
using testing_support::Rng;
using testing_support::test_seed;
using testing_support::values_of;


constexpr double kU = 0x1p-24;  // Float32 unit roundoff

const DType& F32() { return DType::Float32(); }
const DType& I32() { return DType::Int32(); }

// One call of an operation with its expected result.
struct Case {
  std::vector<Operand> operands;
  OpOptions options;
  Shape shape;
  std::vector<double> expected;
  std::vector<double> bound;  // per element, |result - expected| <= bound
};

constexpr int64_t kRows = 3, kCols = 4;

// A binary element-wise case: a (3, 4) with b (1, 4) broadcast along mode 0.
Case binary_case(bool cpu, Rng& rng, double (*f)(double, double), bool b_away_from_zero) {
  std::vector<double> a = draw_eighths(rng, kRows * kCols, -8, 8), b = draw_eighths(rng, kCols, -8, 8, b_away_from_zero);
  Case c{{Operand::of(dense_tensor(cpu, Shape::of({kRows, kCols}), a)), Operand::of(dense_tensor(cpu, Shape::of({1, kCols}), b))},
         {}, Shape::of({kRows, kCols}), {}, {}};
  for (int64_t i = 0; i < kRows * kCols; ++i) {
    double r = f(a[i], b[i / kRows]);  // column-major: element (i % 3, i / 3); b's element (0, i / 3)
    c.expected.push_back(r);
    c.bound.push_back(kU * std::abs(r));
  }
  return c;
}

Case unary_case(bool cpu, Rng& rng, double (*f)(double), double lo, double hi, double ulps_of_u) {
  std::vector<double> a = draw_eighths(rng, kRows * kCols, lo, hi, /*away_from_zero=*/true);  // relu: no kink at 0
  Case c{{Operand::of(dense_tensor(cpu, Shape::of({kRows, kCols}), a))}, {}, Shape::of({kRows, kCols}), {}, {}};
  for (double x : a) {
    c.expected.push_back(f(x));
    c.bound.push_back(ulps_of_u * kU * std::abs(f(x)));
  }
  return c;
}

Case reduce_case(bool cpu, Rng& rng) {
  std::vector<double> a = draw_eighths(rng, kRows * kCols, -8, 8);
  Case c{{Operand::of(dense_tensor(cpu, Shape::of({kRows, kCols}), a))}, {}, Shape::of({kRows}), {}, {}};
  c.options.description = "a b -> a";
  for (int64_t i = 0; i < kRows; ++i) {
    double r = 0, abs_sum = 0;
    for (int64_t j = 0; j < kCols; ++j) r += a[i + kRows * j], abs_sum += std::abs(a[i + kRows * j]);
    c.expected.push_back(r);
    c.bound.push_back(kU * std::abs(r) + kCols * 0x1p-53 * abs_sum);
  }
  return c;
}

Case matmul_case(bool cpu, Rng& rng) {
  constexpr int64_t m = 3, n = 5, k = 7;
  std::vector<double> a = draw_eighths(rng, m * k, -4, 4), b = draw_eighths(rng, n * k, -4, 4);
  Case c{{Operand::of(dense_tensor(cpu, Shape::of({m, k}), a)), Operand::of(dense_tensor(cpu, Shape::of({n, k}), b))},
         {}, Shape::of({m, n}), {}, {}};
  const double gamma = k * kU / (1 - k * kU);
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double r = 0, abs_sum = 0;
      for (int64_t p = 0; p < k; ++p) r += a[i + m * p] * b[j + n * p], abs_sum += std::abs(a[i + m * p] * b[j + n * p]);
      c.expected.push_back(r);
      c.bound.push_back(gamma * abs_sum);
    }
  return c;
}

// row operations (Note [Row operations] in cpp/src/ops/rows.cpp), along mode 1 of a (kRows, kCols) tensor:
// softmax within 2 (u R + 2u) + (kCols + 1) u relative (R = max |x - max| <= 16 here), topk and index_select
// exact, index_add within gamma_c (|t| + sum |s|) for c source rows.
TensorPtr row_indices(bool cpu, const std::vector<double>& idx) {
  return dense_tensor(cpu, Shape::of({static_cast<int64_t>(idx.size())}), idx, I32());
}

Case softmax_case(bool cpu, Rng& rng) {
  std::vector<double> a = draw_eighths(rng, kRows * kCols, -8, 8);
  Case c{{Operand::of(dense_tensor(cpu, Shape::of({kRows, kCols}), a))}, {}, Shape::of({kRows, kCols}), {}, {}};
  c.options.mode = 1;
  std::vector<double> e(a.size());
  for (int64_t i = 0; i < kRows; ++i) {
    double mx = -INFINITY, sum = 0;
    for (int64_t j = 0; j < kCols; ++j) mx = std::max(mx, a[i + kRows * j]);
    for (int64_t j = 0; j < kCols; ++j) sum += e[i + kRows * j] = std::exp(a[i + kRows * j] - mx);
    for (int64_t j = 0; j < kCols; ++j) e[i + kRows * j] /= sum;
  }
  for (double y : e) {
    c.expected.push_back(y);
    c.bound.push_back((2 * (16 * kU + 2 * kU) + (kCols + 1) * kU) * 1.01 * y);
  }
  return c;
}

Case topk_case(bool cpu, Rng& rng) {
  static TensorPtr indices;  // topk's second result (checked in ops_rows_test.cpp)
  std::vector<double> a = draw_eighths(rng, kRows * kCols, -1, 1);  // ties: the lower index first
  Case c{{Operand::of(dense_tensor(cpu, Shape::of({kRows, kCols}), a))}, {}, Shape::of({kRows, 2}), {}, {}};
  c.options.mode = 1;
  c.options.k = 2;
  c.options.second = &indices;
  std::vector<double> v(kRows * 2);
  for (int64_t i = 0; i < kRows; ++i) {
    std::vector<int64_t> order(kCols);
    for (int64_t j = 0; j < kCols; ++j) order[j] = j;
    std::stable_sort(order.begin(), order.end(), [&](int64_t p, int64_t q) { return a[i + kRows * p] > a[i + kRows * q]; });
    for (int64_t j = 0; j < 2; ++j) v[i + kRows * j] = a[i + kRows * order[j]];
  }
  c.expected = v;
  c.bound.assign(v.size(), 0.0);
  return c;
}

Case index_select_case(bool cpu, Rng& rng) {
  std::vector<double> a = draw_eighths(rng, kRows * kCols, -8, 8);
  const std::vector<double> idx{3, 0, 3, 1, 2};
  Case c{{Operand::of(dense_tensor(cpu, Shape::of({kRows, kCols}), a)), Operand::of(row_indices(cpu, idx))},
         {}, Shape::of({kRows, 5}), {}, {}};
  c.options.mode = 1;
  for (size_t j = 0; j < idx.size(); ++j)
    for (int64_t i = 0; i < kRows; ++i) c.expected.push_back(a[i + kRows * static_cast<int64_t>(idx[j])]);
  c.bound.assign(c.expected.size(), 0.0);
  return c;
}

Case index_add_case(bool cpu, Rng& rng) {
  std::vector<double> a = draw_eighths(rng, kRows * kCols, -8, 8), s = draw_eighths(rng, kRows * 5, -8, 8);
  const std::vector<double> idx{3, 0, 3, 1, 3};
  Case c{{Operand::of(dense_tensor(cpu, Shape::of({kRows, kCols}), a)), Operand::of(row_indices(cpu, idx)),
          Operand::of(dense_tensor(cpu, Shape::of({kRows, 5}), s))},
         {}, Shape::of({kRows, kCols}), {}, {}};
  c.options.mode = 1;
  std::vector<double> r = a, mag(a.size()), count(a.size(), 0);
  for (size_t k = 0; k < a.size(); ++k) mag[k] = std::abs(a[k]);
  for (size_t j = 0; j < idx.size(); ++j)
    for (int64_t i = 0; i < kRows; ++i) {
      const size_t d = static_cast<size_t>(i + kRows * static_cast<int64_t>(idx[j]));
      r[d] += s[i + kRows * static_cast<int64_t>(j)];
      mag[d] += std::abs(s[i + kRows * static_cast<int64_t>(j)]);
      count[d] += 1;
    }
  c.expected = r;
  for (size_t k = 0; k < r.size(); ++k) c.bound.push_back(count[k] * kU / (1 - count[k] * kU) * mag[k]);
  return c;
}

// The reference of every operation, by name: a row without one fails OpTable.EveryRowRunsAgainstItsReference.
const std::map<std::string, std::function<Case(bool, Rng&)>>& references() {
  static const std::map<std::string, std::function<Case(bool, Rng&)>> refs{
      {"add", [](bool cpu, Rng& r) { return binary_case(cpu, r, [](double x, double y) { return x + y; }, false); }},
      {"sub", [](bool cpu, Rng& r) { return binary_case(cpu, r, [](double x, double y) { return x - y; }, false); }},
      {"elementwise_mul",
       [](bool cpu, Rng& r) { return binary_case(cpu, r, [](double x, double y) { return x * y; }, false); }},
      {"mul", [](bool cpu, Rng& r) { return binary_case(cpu, r, [](double x, double y) { return x * y; }, false); }},
      {"div", [](bool cpu, Rng& r) { return binary_case(cpu, r, [](double x, double y) { return x / y; }, true); }},
      {"relu", [](bool cpu, Rng& r) { return unary_case(cpu, r, [](double x) { return x > 0 ? x : 0.0; }, -8, 8, 0); }},
      {"neg", [](bool cpu, Rng& r) { return unary_case(cpu, r, [](double x) { return -x; }, -8, 8, 0); }},
      {"exp", [](bool cpu, Rng& r) { return unary_case(cpu, r, [](double x) { return std::exp(x); }, -4, 4, 4); }},
      {"reduce_sum", [](bool cpu, Rng& r) { return reduce_case(cpu, r); }},
      {"matmul", [](bool cpu, Rng& r) { return matmul_case(cpu, r); }},
      // activations: within 5 ulps (Note [Stable sigmoid] in cpp/src/ops/activations.hpp): 10u |r|
      {"silu", [](bool cpu, Rng& r) { return unary_case(cpu, r, [](double x) { return x / (1 + std::exp(-x)); }, -8, 8, 10); }},
      {"sigmoid", [](bool cpu, Rng& r) { return unary_case(cpu, r, [](double x) { return 1 / (1 + std::exp(-x)); }, -8, 8, 10); }},
      // row operations
      {"softmax", [](bool cpu, Rng& r) { return softmax_case(cpu, r); }},
      {"topk", [](bool cpu, Rng& r) { return topk_case(cpu, r); }},
      {"index_select", [](bool cpu, Rng& r) { return index_select_case(cpu, r); }},
      {"index_add", [](bool cpu, Rng& r) { return index_add_case(cpu, r); }},
  };
  return refs;
}

// ---------------------------------------------------------------- every row against its reference

class OpTable : public ::testing::TestWithParam<std::tuple<size_t, bool>> {};

TEST_P(OpTable, EveryRowRunsAgainstItsReference) {
  const OpDef& def = op_table()[std::get<0>(GetParam())];
  const bool cpu = std::get<1>(GetParam());
  auto ref = references().find(def.name);
  ASSERT_NE(ref, references().end()) << "no reference for the operation '" << def.name << "': add one here";
  Rng rng(test_seed() + std::get<0>(GetParam()));
  for (int trial = 0; trial < 8; ++trial) {
    Case c = ref->second(cpu, rng);
    TensorPtr r = call_op(def.id, c.operands, c.options);
    ASSERT_EQ(r->layout.shape(), c.shape) << def.name;
    EXPECT_EQ(&r->dtype(), &F32()) << def.name;
    EXPECT_EQ(&r->carrier->kind(), cpu ? &cpu_kind() : &generic_kind()) << def.name;
    std::vector<double> got = values_of(r);
    ASSERT_EQ(got.size(), c.expected.size());
    for (size_t i = 0; i < got.size(); ++i)
      EXPECT_LE(std::abs(got[i] - c.expected[i]), c.bound[i])
          << def.name << " element " << i << ": got " << got[i] << ", expected " << c.expected[i] << " (seed "
          << test_seed() << ")";
  }
}

INSTANTIATE_TEST_SUITE_P(Rows, OpTable, ::testing::Combine(::testing::Range<size_t>(0, kOpCount), ::testing::Bool()),
                         [](const ::testing::TestParamInfo<std::tuple<size_t, bool>>& info) {
                           return std::string(op_table()[std::get<0>(info.param)].name) +
                                  (std::get<1>(info.param) ? "_CPU" : "_Generic");
                         });

// ---------------------------------------------------------------- the rows' properties

TEST(OpTableRows, IdsNamesAndLookupAgree) {
  for (size_t i = 0; i < kOpCount; ++i) {
    const OpDef& d = op_table()[i];
    EXPECT_EQ(static_cast<size_t>(d.id), i);
    EXPECT_EQ(&op_def(d.id), &d);
    EXPECT_EQ(op_from_name(d.name), d.id);
    EXPECT_EQ(d.arity, d.operand_names[2] ? 3 : d.operand_names[1] ? 2 : 1);  // three: index_add
  }
  EXPECT_EQ(op_from_name("no_such_op"), std::nullopt);
  EXPECT_EQ(op_from_name(""), std::nullopt);
  EXPECT_EQ(op_from_name("Add"), std::nullopt);  // names are exact
}

// A node records its row's name, the tensor operands as inputs, and saves exactly what the row says.
TEST(OpTableRows, NodesSaveWhatTheirRowSays) {
  Rng rng(test_seed());
  for (const OpDef& d : op_table()) {
    Case c = references().at(d.name)(true, rng);
    TensorPtr r = call_op(d.id, c.operands, c.options);
    ASSERT_NE(r->node, nullptr) << d.name;
    EXPECT_EQ(r->node->name, d.name);
    EXPECT_EQ(r->node->inputs.size(), c.operands.size());
    // a row with two results saves its second (topk's indices: Note [Row operations])
    EXPECT_EQ(r->node->saved.size(), (d.saves == OpSaves::Inputs ? c.operands.size() : 0u) + (d.results() - 1))
        << d.name;
  }
}

TEST(OpTableRows, CapabilitiesFollowArityAndWeakScalars) {
  auto cpu = std::make_shared<CPUCarrier>(1, F32(), true, false);
  for (const OpDef& d : op_table()) {
    ASSERT_TRUE(backend_for(cpu_kind())->executes(*cpu, d.id)) << d.name;
    auto caps = operation_capabilities(*cpu, d.id);
    if (d.takes_mode()) {  // row operations take a mode besides their operands: not listed (Note [Row operations])
      EXPECT_TRUE(caps.empty()) << d.name;
      continue;
    }
    ASSERT_FALSE(caps.empty()) << d.name;
    bool any_weak = false;
    for (const auto& cap : caps) {
      EXPECT_EQ(cap.op, d.id);
      EXPECT_EQ(static_cast<int>(cap.operands.size()), d.arity) << d.name;
      for (const auto& o : cap.operands) any_weak |= o.weak_scalar;
    }
    EXPECT_EQ(any_weak, d.weak_scalars) << d.name;
  }
}

// ---------------------------------------------------------------- dtypes and weak scalars

TEST(OpDispatch, Int32StaysInt32AndExact) {
  for (bool cpu : {true, false}) {
    TensorPtr a = dense_tensor(cpu, Shape::of({4}), {3, -7, 100000, 0}, I32());
    TensorPtr b = dense_tensor(cpu, Shape::of({4}), {2, 5, -3, 9}, I32());
    std::vector<Operand> ab{Operand::of(a), Operand::of(b)};
    TensorPtr s = call_op(OpId::Add, ab);
    EXPECT_EQ(&s->dtype(), &I32());
    EXPECT_EQ(values_of(s), (std::vector<double>{5, -2, 99997, 9}));
    EXPECT_EQ(values_of(call_op(OpId::ElementwiseMul, ab)), (std::vector<double>{6, -35, -300000, 0}));
    EXPECT_EQ(&call_op(OpId::Div, ab)->dtype(), &F32());  // div is always Float32
    std::vector<Operand> weak{Operand::weak(Value::from_int(-3)), Operand::of(a)};
    TensorPtr m = call_op(OpId::Mul, weak);
    EXPECT_EQ(&m->dtype(), &I32());
    EXPECT_EQ(values_of(m), (std::vector<double>{-9, 21, -300000, 0}));
    std::vector<Operand> weak_float{Operand::of(a), Operand::weak(Value::from_float(0.5))};
    TensorPtr h = call_op(OpId::Mul, weak_float);
    EXPECT_EQ(&h->dtype(), &F32());
    EXPECT_EQ(values_of(h), (std::vector<double>{1.5, -3.5, 50000, 0}));
  }
}

TEST(OpDispatch, MixedDtypesGiveFloat32) {
  TensorPtr a = dense_tensor(true, Shape::of({2}), {3, -7}, I32());
  TensorPtr b = dense_tensor(true, Shape::of({2}), {0.5, 0.25});
  std::vector<Operand> ab{Operand::of(a), Operand::of(b)};
  TensorPtr s = call_op(OpId::Sub, ab);
  EXPECT_EQ(&s->dtype(), &F32());
  EXPECT_EQ(values_of(s), (std::vector<double>{2.5, -7.25}));
  EXPECT_EQ(&result_dtype(OpId::Sub, ab, {}), &F32());
}

// ---------------------------------------------------------------- errors

TEST(OpDispatchErrors, WrongArity) {
  TensorPtr a = dense_tensor(true, Shape::of({2}), {1, 2});
  std::vector<Operand> one{Operand::of(a)}, two{Operand::of(a), Operand::of(a)};
  EXPECT_SW_THROW(TypeError, "add takes 2 operands, got 1", call_op(OpId::Add, one));
  EXPECT_SW_THROW(TypeError, "relu takes 1 operand, got 2", call_op(OpId::Relu, two));
  EXPECT_SW_THROW(TypeError, "matmul takes 2 operands, got 0", call_op(OpId::Matmul, std::vector<Operand>{}));
}

TEST(OpDispatchErrors, WeakScalarsOnlyWhereTheRowTakesThem) {
  TensorPtr a = dense_tensor(true, Shape::of({2}), {1, 2});
  std::vector<Operand> with_scalar{Operand::of(a), Operand::weak(Value::from_float(2))};
  EXPECT_SW_THROW(TypeError, "matmul operands must be Tensors", call_op(OpId::Matmul, with_scalar));
  std::vector<Operand> lone_scalar{Operand::weak(Value::from_float(2))};
  EXPECT_SW_THROW(TypeError, "silu operands must be Tensors", call_op(OpId::Silu, lone_scalar));
  std::vector<Operand> with_bool{Operand::of(a), Operand::weak(Value::from_bool(true))};
  EXPECT_SW_THROW(TypeError, "mul: a weak scalar must be an int or a float, not a bool", call_op(OpId::Mul, with_bool));
  std::vector<Operand> scalars{Operand::weak(Value::from_int(1)), Operand::weak(Value::from_int(2))};
  EXPECT_SW_THROW(TypeError, "mul needs at least one Tensor operand", call_op(OpId::Mul, scalars));
}

TEST(OpDispatchErrors, CarrierKindsMustMatch) {
  std::vector<Operand> ops{Operand::of(dense_tensor(true, Shape::of({2}), {1, 2})),
                           Operand::of(dense_tensor(false, Shape::of({2}), {1, 2}))};
  EXPECT_SW_THROW(TypeError, "add: Tensor backing carriers must match (CPU and Generic)", call_op(OpId::Add, ops));
}

TEST(OpDispatchErrors, ShapesAndOptions) {
  TensorPtr a = dense_tensor(true, Shape::of({2, 3}), {1, 2, 3, 4, 5, 6});
  TensorPtr b = dense_tensor(true, Shape::of({3, 2}), {1, 2, 3, 4, 5, 6});
  std::vector<Operand> ab{Operand::of(a), Operand::of(b)};
  EXPECT_SW_THROW(ValueError, "do not broadcast", call_op(OpId::Add, ab));
  EXPECT_SW_THROW(ValueError, "disagree on the contracted mode 1 (3 vs 2)", call_op(OpId::Matmul, ab));
  std::vector<Operand> flat{Operand::of(dense_tensor(true, Shape::of({6}), {1, 2, 3, 4, 5, 6})), Operand::of(a)};
  EXPECT_SW_THROW(ValueError, "matmul operands must have two top-level modes", call_op(OpId::Matmul, flat));
  OpOptions f64;
  f64.accumulate_f64 = true;
  std::vector<Operand> aa{Operand::of(a), Operand::of(a)};
  EXPECT_SW_THROW(TypeError, "add takes no accumulator_dtype", call_op(OpId::Add, aa, f64));
  OpOptions bad;
  bad.description = "a b";
  std::vector<Operand> just_a{Operand::of(a)};
  EXPECT_SW_THROW(ValueError, "must look like 'a b -> a'", call_op(OpId::ReduceSum, just_a, bad));
  bad.description = "a b -> c";
  EXPECT_SW_THROW(ValueError, "keeps unknown name 'c'", call_op(OpId::ReduceSum, just_a, bad));
}

TEST(OpDispatchErrors, Int32Overflow) {
  for (bool cpu : {true, false}) {
    std::vector<Operand> ops{Operand::of(dense_tensor(cpu, Shape::of({2}), {2147483647, 0}, I32())),
                             Operand::of(dense_tensor(cpu, Shape::of({2}), {1, 0}, I32()))};
    EXPECT_SW_THROW(OverflowError, "Int32 result overflows", call_op(OpId::Add, ops));
  }
}

TEST(OpDispatchErrors, ReleasedAndStorageOnlyCarriers) {
  TensorPtr a = dense_tensor(true, Shape::of({2}), {1, 2});
  a->carrier->release();
  std::vector<Operand> released{Operand::of(a)};
  EXPECT_SW_THROW(RuntimeError, "CPU carrier is released; cannot compute with it", call_op(OpId::Neg, released));
  // A kind without a backend (a user storage kind) executes nothing.
  auto user = testing_support::make_test_carrier(2);
  EXPECT_EQ(backend_for(user->kind()), nullptr);
  EXPECT_TRUE(operation_capabilities(*user, std::nullopt).empty());
  std::vector<Operand> stored{Operand::of(make_tensor(user, 0, column_major(Shape::of({2}))))};
  EXPECT_SW_THROW(NotImplementedError, "TestCarrier executes no operations (it is storage only)",
                  call_op(OpId::Neg, stored));
}

TEST(OpDispatch, GradModeOffRecordsNoNode) {
  TensorPtr a = dense_tensor(true, Shape::of({2}), {1, -2});
  std::vector<Operand> ops{Operand::of(a)};
  {
    GradModeGuard off(false);
    EXPECT_EQ(call_op(OpId::Relu, ops)->node, nullptr);
  }
  EXPECT_NE(call_op(OpId::Relu, ops)->node, nullptr);
  // Int32 results are not differentiable: no node either.
  std::vector<Operand> ints{Operand::of(dense_tensor(true, Shape::of({2}), {1, -2}, I32()))};
  EXPECT_EQ(call_op(OpId::Neg, ints)->node, nullptr);
}

}  // namespace
}  // namespace sw
