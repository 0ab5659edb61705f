// BFloat16 and Float16 (Note [16-bit floats] in strideweave/dtype.hpp; docs/guide.md, "DTypes"): the exact
// rounding of a double to either format against an exact reference (every pair of neighbours, their midpoints
// and the doubles next to them, plus random doubles), storage in every native and file kind, the promotion
// table, every operation on CPU and Generic against a Float64 reference, and autograd through a small graph.
//
// Error bounds: u16 = 2^-8 (BFloat16) or 2^-11 (Float16) is the unit roundoff of the result, u = 2^-24
// Float32's. Inputs are multiples of 1/8 in [-8, 8] (exact in both formats).
//  - add, sub, mul, elementwise_mul, div: a Float32 operation rounded once to 16 bits:
//    |err| <= u16 |r| + (1 + u16) u |r|.
//  - neg, relu: exact.  exp: expf within 2 ulps of Float32, then one rounding: u16 |r| + (1 + u16) 4u |r|.
//  - reduce_sum of n values: accumulated in double, rounded once: u16 |r| + n 2^-53 sum|x|.
//  - matmul over k products: a Float32 sum of exact products (half_gemm) rounded once:
//    u16 |r| + (1 + u16) gamma_k sum|a b|, gamma_k = k u / (1 - k u).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "strideweave/autograd.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/ops.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using testing_support::dense_tensor;
using testing_support::draw_eighths;
using testing_support::Rng;
using testing_support::test_seed;
using testing_support::values_of;

constexpr double kU = 0x1p-24;

const DType& BF() { return DType::BFloat16(); }
const DType& FH() { return DType::Float16(); }
double unit(const DType& d) { return d == BF() ? 0x1p-8 : 0x1p-11; }

double value_of_bits(const DType& d, uint16_t b) {
  return d == BF() ? double(bfloat16::from_bits(b)) : double(float16::from_bits(b));
}
uint16_t round_bits(const DType& d, double x) {
  return d == BF() ? detail::double_to_bf16_bits(x) : detail::double_to_f16_bits(x);
}

// The exact reference: every finite non-negative value of the format, in bit order (= value order).
std::vector<double> finite_values(const DType& d) {
  const uint16_t inf = d == BF() ? 0x7F80 : 0x7C00;
  std::vector<double> v;
  for (uint32_t b = 0; b < inf; ++b) v.push_back(value_of_bits(d, static_cast<uint16_t>(b)));
  return v;
}

// Round to nearest, ties to the even bit pattern, by comparing exact distances to the two neighbours; at or past
// the largest finite value plus half its ulp: infinity (IEEE).
uint16_t reference_bits(const std::vector<double>& table, uint16_t inf_bits, double x) {
  const uint16_t sign = std::signbit(x) ? 0x8000 : 0;
  const double a = std::fabs(x);
  const double top = table.back(), half_ulp = (top - table[table.size() - 2]) / 2;
  if (a >= top + half_ulp) return sign | inf_bits;
  if (a >= top) return sign | static_cast<uint16_t>(table.size() - 1);  // within half an ulp above the largest
  auto hi = std::lower_bound(table.begin(), table.end(), a);
  if (*hi == a) return sign | static_cast<uint16_t>(hi - table.begin());
  auto lo = hi - 1;
  const double dl = a - *lo, dh = *hi - a;  // exact: neighbours within a factor of two, or both tiny multiples
  size_t pick = static_cast<size_t>(lo - table.begin());
  if (dh < dl || (dh == dl && (pick & 1))) ++pick;
  return sign | static_cast<uint16_t>(pick);
}

class Half : public ::testing::TestWithParam<int> {
 protected:
  const DType& d() const { return GetParam() == 0 ? BF() : FH(); }
};

TEST_P(Half, DoubleRoundsDirectlyAsTheExactReferenceDoes) {
  const DType& dt = d();
  const std::vector<double> table = finite_values(dt);
  const uint16_t inf = static_cast<uint16_t>(table.size());
  int64_t checked = 0;
  auto check = [&](double x) {
    for (double s : {x, -x}) {
      const uint16_t want = reference_bits(table, inf, s);
      ASSERT_EQ(round_bits(dt, s), want) << dt.name() << " of " << s;
      // convert and a slot write round the same way, and read back the exact value
      Value v = dt.convert(Value::from_float(s));
      ASSERT_EQ(v.f, value_of_bits(dt, want)) << dt.name() << " convert of " << s;
      ++checked;
    }
  };
  for (size_t i = 0; i + 1 < table.size(); ++i) {  // every neighbour pair: both ends, the midpoint, next to it
    const double lo = table[i], hi = table[i + 1], mid = lo + (hi - lo) / 2;
    check(lo);
    check(mid);
    check(std::nextafter(mid, 0.0));
    check(std::nextafter(mid, INFINITY));
  }
  const double top = table.back(), over = top + (top - table[table.size() - 2]) / 2;
  for (double x : {over, std::nextafter(over, 0.0), std::nextafter(over, INFINITY), 1e300, 3.5e38, 0x1p128, 0x1p-1000, 0.0})
    check(x);
  Rng rng(test_seed() + 1600);
  std::uniform_real_distribution<double> e(-140, 130), m(1, 2);
  for (int k = 0; k < 200000; ++k) check(std::ldexp(m(rng.g), static_cast<int>(e(rng.g))));
  EXPECT_GT(checked, 200000);
  EXPECT_TRUE(std::isnan(dt.convert(Value::from_float(NAN)).f));
}

TEST(Half, NoDoubleRoundingThroughFloat32) {
  // 1 + 2^-8 + 2^-30 rounds to Float32 as the tie 1 + 2^-8, which would round to even 1; directly it is 1 + 2^-7.
  const double x = 1 + 0x1p-8 + 0x1p-30;
  EXPECT_EQ(BF().convert(Value::from_float(x)).f, 1 + 0x1p-7);
  EXPECT_EQ(float(bfloat16(static_cast<float>(x))), 1.0f);  // what rounding through Float32 gives
  const double y = 1 + 0x1p-11 + 0x1p-40;  // the same for Float16 (10 fraction bits)
  EXPECT_EQ(FH().convert(Value::from_float(y)).f, 1 + 0x1p-10);
  EXPECT_EQ(FH().convert(Value::from_float(65520.0)).f, INFINITY);  // IEEE: overflow is infinity, no error
  EXPECT_EQ(FH().convert(Value::from_float(65519.99)).f, 65504.0);
  EXPECT_EQ(FH().convert(Value::from_int(100000)).f, INFINITY);
  EXPECT_EQ(BF().convert(Value::from_int(257)).f, 256.0);  // 257 is a tie between 256 and 258: even
  EXPECT_EQ(BF().convert(Value::from_int(259)).f, 260.0);
}

TEST_P(Half, ConvertRefusesBoolAndConvertIntoMatchesConvert) {
  const DType& dt = d();
  EXPECT_THROW(dt.convert(Value::from_bool(true)), TypeError);
  try {
    dt.convert(Value::from_bool(true));
  } catch (const TypeError& e) {
    EXPECT_NE(std::string(e.what()).find(dt.name() + " element must be a float or an int, got bool"), std::string::npos);
  }
  Rng rng(test_seed() + 1601);
  std::uniform_real_distribution<double> e(-30, 20), m(-2, 2);
  std::vector<double> xs;
  for (int k = 0; k < 5000; ++k) xs.push_back(std::ldexp(m(rng.g), static_cast<int>(e(rng.g))));
  xs.push_back(1 + 0x1p-8 + 0x1p-30);
  std::vector<float> fs(xs.begin(), xs.end());
  std::vector<int64_t> is{0, 1, -3, 257, 65519, 65520, int64_t{1} << 40, -(int64_t{1} << 62)};
  std::vector<uint16_t> out(xs.size());
  dt.convert_into(xs.data(), xs.size(), out.data());
  for (size_t k = 0; k < xs.size(); ++k) ASSERT_EQ(value_of_bits(dt, out[k]), dt.convert(Value::from_float(xs[k])).f) << xs[k];
  dt.convert_into(fs.data(), fs.size(), out.data());
  for (size_t k = 0; k < fs.size(); ++k) ASSERT_EQ(value_of_bits(dt, out[k]), dt.convert(Value::from_float(fs[k])).f) << fs[k];
  dt.convert_into(is.data(), is.size(), out.data());
  for (size_t k = 0; k < is.size(); ++k) ASSERT_EQ(value_of_bits(dt, out[k]), dt.convert(Value::from_int(is[k])).f) << is[k];
}

TEST_P(Half, EveryNativeAndFileKindStoresIt) {
  const DType& dt = d();
  EXPECT_TRUE(dt.is_storage());
  EXPECT_TRUE(dt.is_floating());
  EXPECT_EQ(dt.itemsize(), 2u);
  std::vector<CarrierPtr> carriers{std::make_shared<CPUCarrier>(4, dt, true, false),
                                   std::make_shared<GenericCarrier>(4, dt, true)};
  carriers.push_back(std::make_shared<FileBackedCarrier>("", dt, true)->allocate_like(4, true, dt, false));
  carriers.push_back(std::make_shared<EvictableCarrier>(std::make_shared<CPUCarrier>(4, dt, true, false),
                                                        std::make_shared<FileBackedCarrier>("", dt, true)));
  const double x = dt == BF() ? 1 + 0x1p-8 + 0x1p-30 : 1 + 0x1p-11 + 0x1p-40;
  const double want = dt == BF() ? 1 + 0x1p-7 : 1 + 0x1p-10;
  for (const CarrierPtr& c : carriers) {
    SCOPED_TRACE(c->kind_name());
    EXPECT_EQ(&c->dtype(), &dt);
    EXPECT_TRUE(c->supports_storage_dtype(dt));
    c->set(1, Value::from_float(x));  // a slot write converts per convert: once, directly
    c->set(2, Value::from_int(-3));
    EXPECT_EQ(c->read_value(0), Value::from_float(0.0));
    EXPECT_EQ(c->read_value(1), Value::from_float(want));  // the exact double of the stored value
    EXPECT_EQ(c->read_value(2), Value::from_float(-3.0));
    uint16_t raw[4];
    c->read_slots(0, 4, raw);
    EXPECT_EQ(value_of_bits(dt, raw[1]), want);
  }
}

TEST_P(Half, ASafetensorsCheckpointHoldsItAndItsTierReadsTheBytesWhereTheyLie) {
  const DType& dt = d();
  testing_support::TempPath file("sw-dtype16");
  TensorPtr a = dense_tensor(true, Shape::of({6}), {0.5, -1.25, 3, 0, 7.5, -2}, dt);
  TensorPtr b = dense_tensor(true, Shape::of({6}), {1, 2, 3, 4, 5, 6}, dt);
  safetensors::save(file.path(), {{"a", a}, {"b", b}}, {});
  EXPECT_EQ(safetensors::element_type_of(dt), dt == BF() ? "BF16" : "F16");
  auto ck = safetensors::Checkpoint::open({file.path()});
  EXPECT_EQ(&ck->dtype("a"), &dt);
  auto tier = ck->tier({"a", "b"}, CheckpointCarrier::Writes::Overlay);
  EXPECT_EQ(&tier->dtype(), &dt);
  EXPECT_TRUE(tier->supports_storage_dtype(dt));
  std::vector<uint16_t> raw(12);
  tier->read_slots(0, 12, raw.data());
  const std::vector<double> want{0.5, -1.25, 3, 0, 7.5, -2, 1, 2, 3, 4, 5, 6};
  for (size_t k = 0; k < want.size(); ++k) EXPECT_EQ(value_of_bits(dt, raw[k]), want[k]) << k;
}

// ---------------------------------------------------------------- promotion

TEST(HalfPromotion, TheWrittenTable) {
  auto t = [](const DType& dt) { return Operand::of(dense_tensor(true, Shape::of({2}), {1, 2}, dt)); };
  const DType *F32 = &DType::Float32(), *I32 = &DType::Int32(), *B = &DType::Bool();
  struct Row {
    OpId op;
    std::vector<Operand> ops;
    const DType* want;
  };
  const Operand weak_float = Operand::weak(Value::from_float(2.0)), weak_int = Operand::weak(Value::from_int(2));
  std::vector<Row> rows{
      {OpId::Add, {t(BF()), t(BF())}, &BF()},       {OpId::Add, {t(FH()), t(FH())}, &FH()},
      {OpId::Add, {t(BF()), t(FH())}, F32},         {OpId::Add, {t(FH()), t(BF())}, F32},
      {OpId::Add, {t(BF()), t(*F32)}, F32},         {OpId::Sub, {t(*F32), t(FH())}, F32},
      {OpId::Add, {t(BF()), t(*I32)}, &BF()},       {OpId::ElementwiseMul, {t(*I32), t(FH())}, &FH()},
      {OpId::Add, {t(BF()), t(*B)}, &BF()},         {OpId::Mul, {t(BF()), weak_float}, &BF()},
      {OpId::Mul, {weak_int, t(FH())}, &FH()},      {OpId::Div, {t(BF()), t(BF())}, &BF()},
      {OpId::Div, {t(*I32), t(*I32)}, F32},         {OpId::Div, {t(FH()), t(*I32)}, &FH()},
      {OpId::Neg, {t(BF())}, &BF()},                {OpId::Exp, {t(FH())}, &FH()},
      {OpId::Relu, {t(BF())}, &BF()},               {OpId::ReduceSum, {t(FH())}, &FH()},
      {OpId::Matmul, {t(BF()), t(BF())}, &BF()},    {OpId::Matmul, {t(BF()), t(FH())}, F32},
      {OpId::Matmul, {t(BF()), t(*F32)}, F32},      {OpId::Matmul, {t(*I32), t(FH())}, &FH()},
  };
  for (const Row& r : rows) {
    std::vector<Operand> ops = r.ops;
    if (r.op == OpId::Matmul) {  // (1, 2) x (1, 2)^T
      for (auto& o : ops) o = Operand::of(make_tensor(o.tensor->carrier, 0, column_major(Shape::of({1, 2}))));
    }
    EXPECT_EQ(&result_dtype(r.op, ops, {}), r.want) << op_def(r.op).name;
    EXPECT_EQ(&call_op(r.op, ops, {})->dtype(), r.want) << op_def(r.op).name;  // the kernels write that dtype
  }
  OpOptions f64;
  f64.accumulate_f64 = true;
  std::vector<Operand> one{t(BF())};
  EXPECT_EQ(&result_dtype(OpId::ReduceSum, one, f64), F32);  // an explicit Float64 accumulator returns Float32
}

// ---------------------------------------------------------------- operations against Float64

struct Expect {
  std::vector<double> value, bound;
};

void check(const TensorPtr& got, const DType& dt, const Expect& e, const char* what) {
  ASSERT_EQ(&got->dtype(), &dt) << what;
  std::vector<double> v = values_of(got);
  ASSERT_EQ(v.size(), e.value.size()) << what;
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(v[i], dt.convert(Value::from_float(v[i])).f) << what << " holds a value of another dtype";
  for (size_t i = 0; i < v.size(); ++i)
    EXPECT_LE(std::abs(v[i] - e.value[i]), e.bound[i])
        << what << " " << dt.name() << " element " << i << ": got " << v[i] << ", want " << e.value[i] << " (seed "
        << test_seed() << ")";
}

class HalfOps : public ::testing::TestWithParam<std::tuple<int, bool>> {
 protected:
  const DType& d() const { return std::get<0>(GetParam()) == 0 ? BF() : FH(); }
  bool cpu() const { return std::get<1>(GetParam()); }
};

TEST_P(HalfOps, ElementwiseIsAFloat32OperationRoundedOnce) {
  const DType& dt = d();
  const double u16 = unit(dt), one = u16 + (1 + u16) * kU, expb = u16 + (1 + u16) * 4 * kU;
  Rng rng(test_seed() + 1602);
  constexpr int64_t n = 1500;  // more than a 512-element block of the CPU kernels
  std::vector<double> a = draw_eighths(rng, n, -8, 8), b = draw_eighths(rng, n, -8, 8, true);
  TensorPtr ta = dense_tensor(cpu(), Shape::of({n}), a, dt), tb = dense_tensor(cpu(), Shape::of({n}), b, dt);
  auto bin = [&](OpId id, double (*f)(double, double), double rel, const char* what) {
    Expect e;
    for (int64_t i = 0; i < n; ++i) {
      e.value.push_back(f(a[i], b[i]));
      e.bound.push_back(rel * std::abs(e.value.back()));
    }
    std::vector<Operand> ops{Operand::of(ta), Operand::of(tb)};
    check(call_op(id, ops, {}), dt, e, what);
  };
  bin(OpId::Add, [](double x, double y) { return x + y; }, one, "add");
  bin(OpId::Sub, [](double x, double y) { return x - y; }, one, "sub");
  bin(OpId::ElementwiseMul, [](double x, double y) { return x * y; }, one, "elementwise_mul");
  bin(OpId::Div, [](double x, double y) { return x / y; }, one, "div");
  auto un = [&](OpId id, double (*f)(double), double rel, const char* what) {
    Expect e;
    for (int64_t i = 0; i < n; ++i) {
      e.value.push_back(f(a[i]));
      e.bound.push_back(rel * std::abs(e.value.back()));
    }
    std::vector<Operand> ops{Operand::of(ta)};
    check(call_op(id, ops, {}), dt, e, what);
  };
  un(OpId::Neg, [](double x) { return -x; }, 0, "neg");
  un(OpId::Relu, [](double x) { return x > 0 ? x : 0.0; }, 0, "relu");
  un(OpId::Exp, [](double x) { return std::exp(x); }, expb, "exp");
  // a weak scalar does not promote: times 0.3 (Float32's 0.3 in the Float32 product)
  Expect e;
  for (int64_t i = 0; i < n; ++i) {
    e.value.push_back(a[i] * 0.3);
    e.bound.push_back(one * std::abs(e.value.back()) + 2 * kU * std::abs(e.value.back()));
  }
  std::vector<Operand> ops{Operand::of(ta), Operand::weak(Value::from_float(0.3))};
  check(call_op(OpId::Mul, ops, {}), dt, e, "mul by a weak float");
  // mixed with Float32: a Float32 result, exactly Float32's operation on the exact 16-bit values
  TensorPtr tf = dense_tensor(cpu(), Shape::of({n}), b, DType::Float32());
  std::vector<Operand> mixed{Operand::of(ta), Operand::of(tf)};
  TensorPtr r = call_op(OpId::Add, mixed, {});
  ASSERT_EQ(&r->dtype(), &DType::Float32());
  std::vector<double> rv = values_of(r);
  for (int64_t i = 0; i < n; ++i) ASSERT_EQ(rv[i], double(static_cast<float>(a[i] + b[i])));
}

TEST_P(HalfOps, ReduceSumRoundsOnce) {
  const DType& dt = d();
  Rng rng(test_seed() + 1603);
  constexpr int64_t rows = 7, cols = 60;
  std::vector<double> a = draw_eighths(rng, rows * cols, -8, 8);
  TensorPtr ta = dense_tensor(cpu(), Shape::of({rows, cols}), a, dt);
  OpOptions o;
  o.description = "a b -> a";
  Expect e;
  for (int64_t i = 0; i < rows; ++i) {
    double s = 0, sa = 0;
    for (int64_t j = 0; j < cols; ++j) s += a[i + rows * j], sa += std::abs(a[i + rows * j]);
    e.value.push_back(s);
    e.bound.push_back(unit(dt) * std::abs(s) + cols * 0x1p-53 * sa);
  }
  std::vector<Operand> ops{Operand::of(ta)};
  check(call_op(OpId::ReduceSum, ops, o), dt, e, "reduce_sum");
}

TEST_P(HalfOps, MatmulAccumulatesInFloat32AndRoundsOnce) {
  const DType& dt = d();
  Rng rng(test_seed() + 1604);
  constexpr int64_t m = 5, n = 40, k = 70;
  std::vector<double> a = draw_eighths(rng, m * k, -2, 2), b = draw_eighths(rng, n * k, -2, 2);
  const double gamma = k * kU / (1 - k * kU);
  Expect e;
  for (int64_t j = 0; j < n; ++j)
    for (int64_t i = 0; i < m; ++i) {
      double s = 0, sa = 0;
      for (int64_t p = 0; p < k; ++p) s += a[i + m * p] * b[j + n * p], sa += std::abs(a[i + m * p] * b[j + n * p]);
      e.value.push_back(s);
      e.bound.push_back(unit(dt) * std::abs(s) + (1 + unit(dt)) * gamma * sa);
    }
  // column-major operands (packed for half_gemm) and row-major ones (read in place: x (m, k) and a PyTorch weight
  // (n, k), both with the contracted index contiguous)
  for (bool row_major_operands : {false, true}) {
    TensorPtr ta = dense_tensor(cpu(), Shape::of({m, k}), a, dt), tb = dense_tensor(cpu(), Shape::of({n, k}), b, dt);
    if (row_major_operands) {
      auto relaid = [&](const TensorPtr& t, int64_t r, int64_t c, const std::vector<double>& v) {
        TensorPtr out = make_tensor(t->carrier->allocate_like(r * c, true, dt, true), 0, row_major(Shape::of({r, c})));
        for (int64_t q = 0; q < r * c; ++q) out->set(IntTuple::tuple({IntTuple(q % r), IntTuple(q / r)}), Value::from_float(v[q]));
        return out;
      };
      ta = relaid(ta, m, k, a);
      tb = relaid(tb, n, k, b);
    }
    std::vector<Operand> ops{Operand::of(ta), Operand::of(tb)};
    check(call_op(OpId::Matmul, ops, {}), dt, e, row_major_operands ? "matmul (row-major)" : "matmul (column-major)");
  }
}

INSTANTIATE_TEST_SUITE_P(Both, Half, ::testing::Values(0, 1),
                         [](const auto& info) { return info.param == 0 ? "BFloat16" : "Float16"; });
INSTANTIATE_TEST_SUITE_P(Both, HalfOps, ::testing::Combine(::testing::Values(0, 1), ::testing::Bool()),
                         [](const auto& info) {
                           return std::string(std::get<0>(info.param) == 0 ? "BFloat16" : "Float16") +
                                  (std::get<1>(info.param) ? "_CPU" : "_Generic");
                         });

// ---------------------------------------------------------------- autograd

TEST(HalfAutograd, GradientsHaveTheParametersDtypeAndRoundOnce) {
  // L = 0.5 * sum relu(x w^T): dL/dx = 0.5 [z > 0] w, dL/dw = 0.5 [z > 0]^T x, computed in Float32 (exact for
  // these eighths: every product and partial sum is a multiple of 2^-7 far below 2^24 of them) and rounded once
  // to the leaf's dtype: |err| <= u16 |g|. A second backward accumulates in Float32 and rounds once more (Note
  // [Gradients of 16-bit parameters]): |G2 - 2g| <= u16 |G1 + g| + u16 |g|.
  for (const DType* dt : {&BF(), &FH()}) {
    for (bool cpu : {true, false}) {
      SCOPED_TRACE(dt->name() + (cpu ? " CPU" : " Generic"));
      Rng rng(test_seed() + 1605);
      constexpr int64_t m = 3, n = 4, k = 5;
      std::vector<double> x = draw_eighths(rng, m * k, -2, 2), w = draw_eighths(rng, n * k, -2, 2);
      TensorPtr tx = dense_tensor(cpu, Shape::of({m, k}), x, *dt), tw = dense_tensor(cpu, Shape::of({n, k}), w, *dt);
      EXPECT_TRUE(tx->is_differentiable());
      std::vector<Operand> mm{Operand::of(tx), Operand::of(tw)};
      TensorPtr z = call_op(OpId::Matmul, mm, {});
      std::vector<Operand> rl{Operand::of(z)};
      std::vector<Operand> sc{Operand::of(call_op(OpId::Relu, rl, {})), Operand::weak(Value::from_float(0.5))};
      OpOptions all;
      all.description = "a b -> ";
      std::vector<Operand> sm{Operand::of(call_op(OpId::Mul, sc, {}))};
      TensorPtr loss = call_op(OpId::ReduceSum, sm, all);
      ASSERT_EQ(&loss->dtype(), dt);
      std::vector<double> gx(m * k, 0), gw(n * k, 0);
      for (int64_t i = 0; i < m; ++i)
        for (int64_t j = 0; j < n; ++j) {
          double s = 0;
          for (int64_t p = 0; p < k; ++p) s += x[i + m * p] * w[j + n * p];
          if (!(s > 0)) continue;
          for (int64_t p = 0; p < k; ++p) gx[i + m * p] += 0.5 * w[j + n * p], gw[j + n * p] += 0.5 * x[i + m * p];
        }
      backward(loss, nullptr, true);
      const double u16 = unit(*dt);
      auto expect = [&](const TensorPtr& leaf, const std::vector<double>& g, int times) {
        ASSERT_NE(leaf->grad, nullptr);
        EXPECT_EQ(&leaf->grad->dtype(), dt);
        EXPECT_EQ(&leaf->grad->carrier->kind(), &leaf->carrier->kind());
        std::vector<double> got = values_of(leaf->grad);
        for (size_t q = 0; q < g.size(); ++q)
          EXPECT_LE(std::abs(got[q] - times * g[q]), (times == 1 ? 1 : 3) * u16 * std::abs(g[q]) * times)
              << "element " << q << " seed " << test_seed();
      };
      expect(tx, gx, 1);
      expect(tw, gw, 1);
      backward(loss, nullptr, false);
      expect(tx, gx, 2);
      expect(tw, gw, 2);
    }
  }
}

TEST(HalfAutograd, ASeedOfAnotherDtypeIsRefusedBeforeAnyWork) {
  TensorPtr x = dense_tensor(true, Shape::of({2}), {1, 2}, BF());
  std::vector<Operand> ops{Operand::of(x), Operand::weak(Value::from_float(3.0))};
  TensorPtr y = call_op(OpId::Mul, ops, {});
  TensorPtr seed = dense_tensor(true, Shape::of({2}), {1, 1}, FH());
  try {
    backward(y, seed, false);
    FAIL() << "no error";
  } catch (const TypeError& e) {
    EXPECT_NE(std::string(e.what()).find("gradient must be a Float32 tensor (or of the output's dtype BFloat16), got Float16"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(x->grad, nullptr);  // nothing accumulated
  backward(y, dense_tensor(true, Shape::of({2}), {1, 0.5}, BF()), false);  // the output's own dtype is accepted
  EXPECT_EQ(values_of(x->grad), (std::vector<double>{3, 1.5}));
}

}  // namespace
}  // namespace sw
