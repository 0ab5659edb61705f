// silu and sigmoid, their VJPs, and weak scalars on either side of every element-wise binary operation, without
// Python: values against a double-precision reference computed here, on every carrier kind of the registry
// (carrier_kinds.hpp) and on both CPU kernel paths (AVX-512 and portable), gradients against the analytic
// derivative, and extreme inputs.
//
// Error bounds (Note [Stable sigmoid] in cpp/src/ops/activations.hpp), u = 2^-24:
//  - sigmoid, silu in Float32: |err| <= 10 u |r| + (1 + |x|) 2^-149 (5 ulps, plus the subnormal quantum of
//    exp(-|x|) times x where that is subnormal);
//  - g sigmoid'(x): 12 u |r| + 2^-149; g silu'(x): |g| (12 u s (1 + |x| (1 - s)) + (1 + |x|) 2^-149),
//    s = sigmoid(x);
//  - a 16-bit result is the Float32 one rounded once: u16 |r| + (1 + u16) e32 (u16 = 2^-8 bf16, 2^-11 fp16),
//    plus half the dtype's smallest subnormal (2^-134 bf16, 2^-25 fp16) where the result is that small;
//  - weak-scalar add, sub, mul, div: one correctly rounded operation, u |r|.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../src/ops/activations.hpp"
#include "carrier_kinds.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;

constexpr double kU = 0x1p-24;
constexpr double kSub = 0x1p-149;  // Float32's smallest subnormal

double sigmoid_ref(double x) { return x >= 0 ? 1 / (1 + std::exp(-x)) : std::exp(x) / (1 + std::exp(x)); }
double silu_ref(double x) { return x * sigmoid_ref(x); }
double dsigmoid_ref(double x) { return sigmoid_ref(x) * sigmoid_ref(-x); }
double dsilu_ref(double x) { return sigmoid_ref(x) * (1 + x * sigmoid_ref(-x)); }
double dsilu_scale(double x) { return sigmoid_ref(x) * (1 + std::abs(x) * sigmoid_ref(-x)); }

TensorPtr call(OpId id, std::vector<Operand> ops) { return call_op(id, ops); }
TensorPtr call(OpId id, const TensorPtr& a) { return call(id, {Operand::of(a)}); }

// The sum of every element (of a tensor of any rank).
TensorPtr sum_all(const TensorPtr& t) {
  OpOptions o;
  o.description = "->";
  for (size_t k = 0; k < t->layout.rank(); ++k) o.description->insert(0, "m" + std::to_string(k) + " ");
  std::vector<Operand> ops{Operand::of(t)};
  return call_op(OpId::ReduceSum, ops, o);
}

// Inputs far and near: the extremes where a naive formula overflows (exp(-x) for x < -88), subnormals, zeros of
// both signs, the crossing of silu' near -1.28, and ordinary values.
// Each is rounded to Float32 first: the reference takes the value the tensor holds.
const std::vector<double>& extreme_inputs() {
  static const std::vector<double> v = [] {
    std::vector<double> r{-1e4, 1e4, -100, 100, 88.8, -88.8, -87.5, -103.9, -104.5, -150, 20, -20, 17,
                          -17, 1e-40, -1e-40, 0.0, -0.0, 1.5, -1.5, -1.25, -1.375, 0.125, -3, 3,
                          0x1p-126, -0x1p-126, 1e30, -1e30, 3.4e38, -3.4e38};
    for (double& x : r) x = static_cast<float>(x);
    return r;
  }();
  return v;
}

// Both CPU kernel paths: run-time dispatch (AVX-512 where present) and the portable loop.
class BothPaths : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override { previous_ = detail::force_portable_activation_kernels(GetParam()); }
  void TearDown() override { detail::force_portable_activation_kernels(previous_); }
  bool previous_ = false;
};

// ---------------------------------------------------------------- forward values

void check_forward(const TensorPtr& r, const std::vector<double>& x, bool silu, const std::string& what) {
  std::vector<double> got = values_of(r);
  ASSERT_EQ(got.size(), x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = silu ? silu_ref(x[i]) : sigmoid_ref(x[i]);
    EXPECT_TRUE(std::isfinite(got[i])) << what << " x=" << x[i];
    EXPECT_LE(std::abs(got[i] - ref), 10 * kU * std::abs(ref) + (1 + std::abs(x[i])) * kSub)
        << what << " x=" << x[i] << ": got " << got[i] << ", expected " << ref;
  }
}

TEST_P(BothPaths, Float32ValuesWithinTheBoundAtEveryInput) {
  Rng rng(test_seed() + 1);
  std::vector<double> x = extreme_inputs();
  for (int i = 0; i < 3000; ++i) x.push_back(static_cast<double>(static_cast<float>((rng.uniform(-120000, 120000)) / 1000.0)));
  // Several lengths: the 16-lane tail of the AVX-512 loop, and past the threading grain.
  for (size_t n : {x.size(), size_t{1}, size_t{15}, size_t{17}}) {
    std::vector<double> xs(x.begin(), x.begin() + static_cast<std::ptrdiff_t>(n));
    for (bool cpu : {true, false}) {
      TensorPtr t = dense_tensor(cpu, Shape::of({static_cast<int64_t>(n)}), xs);
      check_forward(call(OpId::Silu, t), xs, true, std::string("silu ") + (cpu ? "CPU" : "Generic"));
      check_forward(call(OpId::Sigmoid, t), xs, false, std::string("sigmoid ") + (cpu ? "CPU" : "Generic"));
    }
  }
  std::vector<double> big(70000);
  for (size_t i = 0; i < big.size(); ++i) big[i] = -100 + 200.0 * static_cast<double>(i) / big.size();
  for (double& v : big) v = static_cast<float>(v);
  check_forward(call(OpId::Silu, dense_tensor(true, Shape::of({70000}), big)), big, true, "silu threaded");
  check_forward(call(OpId::Sigmoid, dense_tensor(true, Shape::of({70000}), big)), big, false, "sigmoid threaded");
}

TEST_P(BothPaths, NanAndInfinities) {
  const double inf = std::numeric_limits<double>::infinity(), nan = std::nan("");
  for (bool cpu : {true, false}) {
    TensorPtr t = dense_tensor(cpu, Shape::of({3}), {nan, inf, -inf});
    std::vector<double> s = values_of(call(OpId::Sigmoid, t)), z = values_of(call(OpId::Silu, t));
    EXPECT_TRUE(std::isnan(s[0]) && std::isnan(z[0]));
    EXPECT_EQ(s[1], 1.0);
    EXPECT_EQ(s[2], 0.0);
    EXPECT_EQ(z[1], inf);
    EXPECT_TRUE(std::isnan(z[2]));  // -inf * sigmoid(-inf) = -inf * 0, as in IEEE arithmetic
  }
}

// A strided view (every other slot, at an offset) runs the loop path, not the dense kernel.
TEST_P(BothPaths, StridedAndBroadcastViews) {
  std::vector<double> slots;
  for (int i = 0; i < 41; ++i) slots.push_back(-90 + 4.5 * i);
  for (bool cpu : {true, false}) {
    TensorPtr base = dense_tensor(cpu, Shape::of({41}), slots);
    TensorPtr strided = make_tensor(base->carrier, 1, Layout(Shape::of({4, 5}), Stride::of({2, 8})));
    TensorPtr bcast = make_tensor(base->carrier, 3, Layout(Shape::of({3, 4}), Stride::of({0, 1})));
    for (const TensorPtr& t : {strided, bcast}) {
      std::vector<double> x = values_of(t);
      TensorPtr r = call(OpId::Silu, t);
      EXPECT_TRUE(r->layout.is_column_major());
      EXPECT_EQ(r->layout.shape(), t->layout.shape());
      check_forward(r, x, true, "silu strided");
      check_forward(call(OpId::Sigmoid, t), x, false, "sigmoid strided");
    }
  }
}

TEST_P(BothPaths, HalfDtypesRoundOnceAndInt32GivesFloat32) {
  std::vector<double> x{-100, -20, -3, -1.5, -0.5, 0, 0.25, 1, 2.5, 7, 30, 88};
  for (const DType* d : {&DType::BFloat16(), &DType::Float16()}) {
    const double u16 = d == &DType::BFloat16() ? 0x1p-8 : 0x1p-11;
    const double tiny = d == &DType::Float16() ? 0x1p-25 : 0x1p-134;  // half the dtype's smallest subnormal
    for (bool cpu : {true, false}) {
      TensorPtr t = dense_tensor(cpu, Shape::of({static_cast<int64_t>(x.size())}), x, *d);
      std::vector<double> xs = values_of(t);  // the values as the 16-bit dtype holds them
      for (bool silu : {true, false}) {
        TensorPtr r = call(silu ? OpId::Silu : OpId::Sigmoid, t);
        EXPECT_EQ(&r->dtype(), d);
        std::vector<double> got = values_of(r);
        for (size_t i = 0; i < x.size(); ++i) {
          const double ref = silu ? silu_ref(xs[i]) : sigmoid_ref(xs[i]);
          const double e32 = 10 * kU * std::abs(ref) + (1 + std::abs(xs[i])) * kSub;
          EXPECT_LE(std::abs(got[i] - ref), u16 * std::abs(ref) + (1 + u16) * e32 + tiny)
              << d->name() << (silu ? " silu x=" : " sigmoid x=") << xs[i] << ": got " << got[i];
        }
      }
    }
  }
  TensorPtr i = dense_tensor(true, Shape::of({3}), {-200, 0, 5}, DType::Int32());
  TensorPtr r = call(OpId::Sigmoid, i);
  EXPECT_EQ(&r->dtype(), &DType::Float32());
  check_forward(r, {-200, 0, 5}, false, "sigmoid Int32");
  EXPECT_EQ(r->node, nullptr);  // Int32 operands are not differentiable
}

INSTANTIATE_TEST_SUITE_P(Paths, BothPaths, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "portable" : "dispatched"; });

TEST(ActivationKernels, PathNamesTheMachinesKernel) {
  const bool before = detail::force_portable_activation_kernels(true);
  EXPECT_STREQ(detail::activation_kernel_path(), "portable");
  detail::force_portable_activation_kernels(false);
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("fma");
  EXPECT_STREQ(detail::activation_kernel_path(), avx512 ? "avx512f" : "portable");
  detail::force_portable_activation_kernels(before);
}

// ---------------------------------------------------------------- gradients

// d/dx sum(c * f(x)) = c * f'(x), on CPU (both paths), Generic, and an Evictable (whose VJP composes the
// derivative from table operations).
void check_grad(const TensorPtr& leaf, const std::vector<double>& x, const std::vector<double>& c, bool silu,
                const std::string& what) {
  ASSERT_NE(leaf->grad, nullptr) << what;
  std::vector<double> got = values_of(leaf->grad);
  for (size_t i = 0; i < x.size(); ++i) {
    const double ref = c[i] * (silu ? dsilu_ref(x[i]) : dsigmoid_ref(x[i]));
    const double scale = std::abs(c[i]) * (silu ? dsilu_scale(x[i]) : dsigmoid_ref(x[i]));
    EXPECT_TRUE(std::isfinite(got[i])) << what << " x=" << x[i];
    EXPECT_LE(std::abs(got[i] - ref), 12 * kU * scale + std::abs(c[i]) * (1 + std::abs(x[i])) * kSub) << what << " x=" << x[i] << ": got " << got[i]
                                                             << ", expected " << ref;
  }
}

TEST_P(BothPaths, GradientsMatchTheDerivativeEverywhere) {
  std::vector<double> x = extreme_inputs();
  Rng rng(test_seed() + 2);
  std::vector<double> c;
  for (size_t i = 0; i < x.size(); ++i) c.push_back(static_cast<double>(rng.uniform(-16, 16)) / 4 + 0.125);
  const int64_t n = static_cast<int64_t>(x.size());
  for (int kind = 0; kind < 3; ++kind) {
    for (bool silu : {true, false}) {
      TensorPtr t;
      if (kind < 2) {
        t = dense_tensor(kind == 0, Shape::of({n}), x);
      } else {
        CarrierPtr e = make_evictable(n, DType::Float32(), true);
        for (int64_t i = 0; i < n; ++i) e->write_value(i, Value::from_float(x[static_cast<size_t>(i)]));
        t = make_tensor(e, 0, column_major(Shape::of({n})));
      }
      TensorPtr cot = kind < 2 ? dense_tensor(kind == 0, Shape::of({n}), c) : nullptr;
      TensorPtr y = call(silu ? OpId::Silu : OpId::Sigmoid, t);
      ASSERT_NE(y->node, nullptr);
      EXPECT_EQ(y->node->name, silu ? "silu" : "sigmoid");
      if (kind < 2) {
        backward(y, cot, false);
        check_grad(t, x, c, silu, std::string(silu ? "silu" : "sigmoid") + (kind == 0 ? " CPU" : " Generic"));
      } else {  // sum(y): cotangent 1
        backward(sum_all(y), nullptr, false);
        check_grad(t, x, std::vector<double>(x.size(), 1.0), silu, std::string(silu ? "silu" : "sigmoid") + " Evictable");
        EXPECT_EQ(&t->grad->carrier->kind(), &evictable_kind());
      }
    }
  }
}

// ---------------------------------------------------------------- every carrier kind

TEST(ActivationKinds, EveryKindComputesOrRefusesWithoutChange) {
  const std::vector<double> x{-100, -2.5, -0.5, 0, 0.75, 3, 90, -1e4};
  const int64_t n = static_cast<int64_t>(x.size());
  for (const KindSpec& k : carrier_kinds()) {
    KindEnv env;
    CarrierPtr c = k.make(env, n, DType::Float32(), true);
    for (int64_t i = 0; i < n; ++i) c->write_value(i, Value::from_float(x[static_cast<size_t>(i)]));
    // A TiledEvictable computes on its full logical shape; its values are the slots in its own order.
    const auto* tiled = dynamic_cast<const TiledEvictable*>(c.get());
    TensorPtr t = make_tensor(c, 0, column_major(tiled ? Shape::flat(tiled->logical_shape()) : Shape::of({n})));
    const std::vector<double> before = values_of(t);
    const std::vector<double>& xs = before;
    for (bool silu : {true, false}) {
      const OpId id = silu ? OpId::Silu : OpId::Sigmoid;
      OpBackend* b = backend_for(*k.kind);
      if (!b || !b->executes(*c, id)) {
        EXPECT_THROW(call(id, t), NotImplementedError) << k.name;
        EXPECT_EQ(values_of(t), before) << k.name;
        continue;
      }
      TensorPtr y = call(id, t);
      EXPECT_EQ(&y->dtype(), &DType::Float32()) << k.name;
      check_forward(y, xs, silu, std::string(k.name) + (silu ? " silu" : " sigmoid"));
      backward(sum_all(y), nullptr, false);
      check_grad(t, xs, std::vector<double>(x.size(), 1.0), silu, std::string(k.name) + " gradient");
      t->grad = nullptr;
      EXPECT_EQ(values_of(t), before) << k.name;
    }
  }
}

// ---------------------------------------------------------------- weak scalars on either side

TEST(WeakScalars, EveryElementwiseBinaryOperationTakesOneOnEitherSide) {
  for (const OpDef& d : op_table())
    EXPECT_EQ(d.weak_scalars, d.elementwise() && d.arity == 2) << d.name;
  for (bool cpu : {true, false}) {
    TensorPtr t = dense_tensor(cpu, Shape::of({4}), {1, -2, 0.5, 8});
    const Value two = Value::from_float(2.0);
    auto run = [&](OpId id, bool scalar_first) {
      return values_of(scalar_first ? call(id, {Operand::weak(two), Operand::of(t)}) : call(id, {Operand::of(t), Operand::weak(two)}));
    };
    EXPECT_EQ(run(OpId::Add, false), (std::vector<double>{3, 0, 2.5, 10}));
    EXPECT_EQ(run(OpId::Add, true), (std::vector<double>{3, 0, 2.5, 10}));
    EXPECT_EQ(run(OpId::Sub, false), (std::vector<double>{-1, -4, -1.5, 6}));
    EXPECT_EQ(run(OpId::Sub, true), (std::vector<double>{1, 4, 1.5, -6}));
    EXPECT_EQ(run(OpId::Div, false), (std::vector<double>{0.5, -1, 0.25, 4}));
    EXPECT_EQ(run(OpId::Div, true), (std::vector<double>{2, -1, 4, 0.25}));
    EXPECT_EQ(run(OpId::ElementwiseMul, true), (std::vector<double>{2, -4, 1, 16}));
  }
}

TEST(WeakScalars, DtypesNeverPromote) {
  TensorPtr i = dense_tensor(true, Shape::of({2}), {3, -4}, DType::Int32());
  TensorPtr h = dense_tensor(true, Shape::of({2}), {3, -4}, DType::BFloat16());
  auto dtype = [](OpId id, std::vector<Operand> ops) -> const DType& { return call_op(id, ops)->dtype(); };
  const Operand wi = Operand::weak(Value::from_int(2)), wf = Operand::weak(Value::from_float(2.0));
  EXPECT_EQ(&dtype(OpId::Add, {Operand::of(i), wi}), &DType::Int32());
  EXPECT_EQ(&dtype(OpId::Sub, {wi, Operand::of(i)}), &DType::Int32());
  EXPECT_EQ(&dtype(OpId::Add, {wf, Operand::of(i)}), &DType::Float32());  // a weak float with Int32: the float dtype
  EXPECT_EQ(&dtype(OpId::Div, {wi, Operand::of(i)}), &DType::Float32());  // div is always a float
  EXPECT_EQ(&dtype(OpId::Add, {Operand::of(h), wf}), &DType::BFloat16());
  EXPECT_EQ(&dtype(OpId::Div, {wi, Operand::of(h)}), &DType::BFloat16());
  EXPECT_EQ(values_of(call(OpId::Sub, {wi, Operand::of(i)})), (std::vector<double>{-1, 6}));
  EXPECT_SW_THROW(OverflowError, "Int32 result overflows",
                  call(OpId::Add, {Operand::weak(Value::from_int(2147483647)), Operand::of(i)}));
}

// d/dt of sum(c * op(t, s)) and of sum(c * op(s, t)); the scalar gets no gradient.
TEST(WeakScalars, GradientsOnEitherSide) {
  const std::vector<double> x{1.5, -2, 0.25, 4}, c{1, -0.5, 2, 0.125};
  const double s = 3.0;
  struct Expect {
    OpId id;
    bool scalar_first;
    double (*d)(double x, double s);
  };
  const Expect cases[] = {
      {OpId::Add, false, [](double, double) { return 1.0; }},
      {OpId::Add, true, [](double, double) { return 1.0; }},
      {OpId::Sub, false, [](double, double) { return 1.0; }},
      {OpId::Sub, true, [](double, double) { return -1.0; }},
      {OpId::Div, false, [](double, double s) { return 1 / s; }},
      {OpId::Div, true, [](double x, double s) { return -s / (x * x); }},
      {OpId::ElementwiseMul, true, [](double, double s) { return s; }},
  };
  for (bool cpu : {true, false})
    for (const Expect& e : cases) {
      TensorPtr t = dense_tensor(cpu, Shape::of({4}), x);
      const Operand w = Operand::weak(Value::from_float(s));
      TensorPtr y = e.scalar_first ? call(e.id, {w, Operand::of(t)}) : call(e.id, {Operand::of(t), w});
      ASSERT_NE(y->node, nullptr);
      EXPECT_EQ(y->node->inputs.size(), 1u);  // only the tensor is an input
      backward(y, dense_tensor(cpu, Shape::of({4}), c), false);
      std::vector<double> got = values_of(t->grad);
      for (size_t i = 0; i < x.size(); ++i) {
        const double ref = c[i] * e.d(x[i], s);
        EXPECT_LE(std::abs(got[i] - ref), 4 * kU * std::abs(ref))
            << op_def(e.id).name << (e.scalar_first ? " scalar first" : " tensor first") << " x=" << x[i];
      }
    }
}

}  // namespace
}  // namespace sw
