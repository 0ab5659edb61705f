// Views (strideweave/views.hpp): narrow, chunk, permute and reshape on every carrier kind of the registry
// (carrier_kinds.hpp) and every storage dtype the kind stores, their values (exact: a view reads the base's
// own slots), shared storage, the one copying reshape, their VJPs (views are linear: the gradients are exact),
// composition, the kind without views (TiledEvictable) and every error with its message, changing nothing.
#include <gtest/gtest.h>

#include <map>
#include <string>
#include <vector>

#include "carrier_kinds.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "strideweave/views.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using testing_support::carrier_kinds;
using testing_support::dense_tensor;
using testing_support::draw_eighths;
using testing_support::KindEnv;
using testing_support::KindSpec;
using testing_support::Rng;
using testing_support::test_seed;
using testing_support::values_of;

const std::vector<const DType*>& all_dtypes() {
  static const std::vector<const DType*> d{&DType::Float32(), &DType::BFloat16(), &DType::Float16(), &DType::Int32(),
                                           &DType::Bool()};
  return d;
}

// The value stored at ordinal i of the test bases: small integers (exact in every dtype), i % 2 for Bool.
Value sample(const DType& d, int64_t i) {
  if (d.id() == DTypeId::Bool) return Value::from_bool(i % 2 == 1);
  if (d.id() == DTypeId::Int32) return Value::from_int(i - 7);
  return Value::from_float(static_cast<double>(i - 7));
}

double as_double(const Value& v) {
  return v.kind == Value::Kind::Int ? double(v.i) : v.kind == Value::Kind::Bool ? double(v.b) : v.f;
}

// A (4, 6, 2) column-major tensor of `kind`, at offset 3 of a larger carrier (a view starts anywhere), or null
// when the kind does not store `d`.
TensorPtr base_tensor(const KindSpec& kind, KindEnv& env, const DType& d) {
  const Shape shape = Shape::of({4, 6, 2});
  CarrierPtr c;
  try {
    c = kind.make(env, shape.size() + 5, d, true);
  } catch (const TypeError&) {
    return nullptr;
  }
  for (int64_t i = 0; i < shape.size(); ++i) c->set(3 + i, d.convert(sample(d, i)));
  return make_tensor(c, 3, column_major(shape));
}

Coord coord3(int64_t a, int64_t b, int64_t c) { return IntTuple::tuple({a, b, c}); }

class ViewsOnKinds : public ::testing::TestWithParam<size_t> {};

TEST_P(ViewsOnKinds, ValuesAndSharedStorageInEveryDtype) {
  const KindSpec& kind = carrier_kinds()[GetParam()];
  for (const DType* d : all_dtypes()) {
    SCOPED_TRACE(d->name());
    KindEnv env;
    TensorPtr x = base_tensor(kind, env, *d);
    if (!x) continue;
    if (std::string(kind.name) == "TiledEvictable") {
      // No view but the identity (the footprints of anything else cannot match): TypeError naming the kind.
      EXPECT_SW_THROW(TypeError, "narrow: a TiledEvictable tensor has no views but itself", narrow(x, 1, 2, 3));
      EXPECT_SW_THROW(TypeError, "TiledEvictable", permute(x, {2, 0, 1}));
      EXPECT_SW_THROW(TypeError, "TiledEvictable", reshape(x, std::vector<int64_t>{8, 6}));
      EXPECT_SW_THROW(TypeError, "TiledEvictable", reshape(x, std::vector<int64_t>{48}));
      EXPECT_SW_THROW(TypeError, "TiledEvictable", chunk(x, 2, 1));
      for (const TensorPtr& v : {narrow(x, 1, 0, 6), permute(x, {0, 1, 2}), reshape(x, x->layout.shape()),
                                 chunk(x, 1, 2)[0]}) {
        EXPECT_EQ(v->carrier, x->carrier);
        EXPECT_EQ(v->layout, x->layout);
      }
      continue;
    }
    // narrow: view (a, b, c) is base (a, b + 2, c).
    TensorPtr n = narrow(x, 1, 2, 3);
    EXPECT_EQ(n->carrier, x->carrier);
    EXPECT_EQ(n->layout.shape(), Shape::of({4, 3, 2}));
    for (int64_t a = 0; a < 4; ++a)
      for (int64_t b = 0; b < 3; ++b)
        for (int64_t c = 0; c < 2; ++c) EXPECT_EQ(n->get(coord3(a, b, c)), x->get(coord3(a, b + 2, c)));
    // chunk: torch's rule, ceil(6 / 4) = 2 ordinals a piece, so three pieces, not four.
    std::vector<TensorPtr> parts = chunk(x, 4, 1);
    ASSERT_EQ(parts.size(), 3u);
    for (size_t p = 0; p < parts.size(); ++p) {
      EXPECT_EQ(parts[p]->carrier, x->carrier);
      EXPECT_EQ(parts[p]->layout.shape(), Shape::of({4, 2, 2}));
      for (int64_t a = 0; a < 4; ++a)
        for (int64_t b = 0; b < 2; ++b)
          EXPECT_EQ(parts[p]->get(coord3(a, b, 1)), x->get(coord3(a, 2 * static_cast<int64_t>(p) + b, 1)));
    }
    // permute: view (i0, i1, i2) is base (i1, i2, i0) for order (2, 0, 1): mode i is base mode order[i].
    TensorPtr p = permute(x, {2, 0, 1});
    EXPECT_EQ(p->carrier, x->carrier);
    EXPECT_EQ(p->layout.shape(), Shape::of({2, 4, 6}));
    for (int64_t a = 0; a < 4; ++a)
      for (int64_t b = 0; b < 6; ++b)
        for (int64_t c = 0; c < 2; ++c) EXPECT_EQ(p->get(coord3(c, a, b)), x->get(coord3(a, b, c)));
    // reshape: colex ordinal i of the view is ordinal i of the base; a dense base reshapes without a copy.
    for (const Shape& s : {Shape::of({8, 6}), Shape::of({48}), Shape::of({2, 2, 12}),
                           Shape::of({IntTuple::tuple({2, 2}), IntTuple::tuple({6, 2})})}) {
      ASSERT_TRUE(reshape_is_view(x, s)) << s.str();
      TensorPtr r = reshape(x, s);
      EXPECT_EQ(r->carrier, x->carrier);
      EXPECT_EQ(r->layout.shape(), s);
      for (int64_t i = 0; i < 48; ++i) EXPECT_EQ(r->get(IntTuple(i)), x->get(IntTuple(i)));
    }
    // A write through the base is seen in every view (and versions are the carrier's).
    const Value w = d->convert(d->id() == DTypeId::Bool ? Value::from_bool(true) : Value::from_int(42));
    x->set(coord3(1, 3, 0), w);
    EXPECT_EQ(n->get(coord3(1, 1, 0)), w);
    EXPECT_EQ(parts[1]->get(coord3(1, 1, 0)), w);
    EXPECT_EQ(p->get(coord3(0, 1, 3)), w);
    EXPECT_EQ(reshape(x, std::vector<int64_t>{48})->get(IntTuple(1 + 3 * 4)), w);
    EXPECT_EQ(n->version(), x->version());
    // The copying reshape: a transposed (6, 4) is not one progression in colex order, so (24) copies into a
    // fresh dense carrier of the same kind and dtype; a later write to the base is not seen in the copy.
    TensorPtr t = permute(narrow(x, 2, 1, 1), {1, 0, 2});
    ASSERT_FALSE(reshape_is_view(t, Shape::of({24})));
    TensorPtr flat = reshape(t, std::vector<int64_t>{-1});
    EXPECT_NE(flat->carrier, x->carrier);
    EXPECT_EQ(&flat->carrier->kind(), &x->carrier->kind());
    EXPECT_EQ(flat->dtype(), *d);
    EXPECT_TRUE(flat->layout.is_column_major());
    for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(flat->get(IntTuple(i)), t->get(IntTuple(i)));
    // Three leaves, the two fastest transposed: the blocked copy with its outer odometer.
    TensorPtr swapped = permute(x, {1, 0, 2});
    ASSERT_FALSE(reshape_is_view(swapped, Shape::of({48})));
    TensorPtr all = reshape(swapped, Shape::of({48}));
    for (int64_t i = 0; i < 48; ++i) EXPECT_EQ(all->get(IntTuple(i)), swapped->get(IntTuple(i)));
    const Value before = flat->get(IntTuple(0));
    x->set(coord3(0, 0, 1), d->convert(d->id() == DTypeId::Bool ? Value::from_bool(true) : Value::from_int(-3)));  // was false, 17
    EXPECT_EQ(flat->get(IntTuple(0)), before);
    EXPECT_NE(t->get(IntTuple(0)), before);
  }
}

INSTANTIATE_TEST_SUITE_P(Kinds, ViewsOnKinds, ::testing::Range<size_t>(0, carrier_kinds().size()),
                         testing_support::kind_param_name);

// ---------------------------------------------------------------- layouts (no carrier kind involved)

TEST(ViewLayouts, ReshapeIsAViewExactlyWhenEachTargetLeafLiesInOneProgression) {
  TensorPtr x = dense_tensor(true, Shape::of({4, 6}), std::vector<double>(24, 0.0));
  TensorPtr cols = narrow(x, 0, 0, 2);  // (2, 6):(1, 4): two progressions
  EXPECT_TRUE(reshape_is_view(cols, Shape::of({2, 3, 2})));
  EXPECT_TRUE(reshape_is_view(cols, Shape::of({1, 2, 1, 6})));
  EXPECT_FALSE(reshape_is_view(cols, Shape::of({12})));    // straddles both
  EXPECT_FALSE(reshape_is_view(cols, Shape::of({4, 3})));  // 4 does not divide the first (2)
  TensorPtr r = reshape(cols, Shape::of({2, 3, 2}));
  EXPECT_EQ(r->layout, Layout(Shape::of({2, 3, 2}), Stride::of({1, 4, 12})));
  EXPECT_EQ(r->offset, x->offset);
  // A column-major base gives a column-major view, extent-1 leaves included.
  EXPECT_TRUE(reshape(x, Shape::of({2, 1, 12}))->layout.is_column_major());
  // A broadcast (stride 0) leaf splits into stride-0 leaves.
  TensorPtr b = make_tensor(x->carrier, 0, Layout(Shape::of({4, 6}), Stride::of({0, 1})));
  EXPECT_EQ(reshape(b, Shape::of({2, 2, 6}))->layout, Layout(Shape::of({2, 2, 6}), Stride::of({0, 0, 1})));
}

TEST(ViewLayouts, NarrowOfANestedModeKeepsItsHierarchyOrCoalesces) {
  // Mode 1 is (in=3, E=4) with PyTorch's row-major strides, like an expert stack; whole experts keep the nesting.
  TensorPtr x = dense_tensor(true, Shape::of({24}), std::vector<double>(24, 0.0));
  TensorPtr w = make_tensor(x->carrier, 0,
                            Layout(Shape::of({2, IntTuple::tuple({3, 4})}), Stride::of({3, IntTuple::tuple({1, 6})})));
  TensorPtr experts = narrow(w, 1, 3, 6);  // experts 1 and 2
  EXPECT_EQ(experts->layout, Layout(Shape::of({2, IntTuple::tuple({3, 2})}), Stride::of({3, IntTuple::tuple({1, 6})})));
  EXPECT_EQ(experts->offset, 6);
  TensorPtr inside = narrow(w, 1, 7, 2);  // within expert 2: ordinals 1, 2 of its `in`
  EXPECT_EQ(inside->layout, Layout(Shape::of({2, 2}), Stride::of({3, 1})));
  EXPECT_EQ(inside->offset, 13);
  for (int64_t a = 0; a < 2; ++a)
    for (int64_t b = 0; b < 2; ++b)
      EXPECT_EQ(inside->slot_of(IntTuple::tuple({a, b})), w->slot_of(IntTuple::tuple({a, b + 7})));
  // Ordinals 2..4 straddle experts 0 and 1 and the mode does not coalesce: no layout.
  EXPECT_SW_THROW(ValueError, "narrow: ordinals [2, 5) of nested mode 1 (3,4)", narrow(w, 1, 2, 3));
  // A nested mode that coalesces narrows as one leaf.
  TensorPtr c = make_tensor(x->carrier, 0, Layout(Shape::of({IntTuple::tuple({2, 3}), 4}), Stride::of({IntTuple::tuple({1, 2}), 6})));
  EXPECT_EQ(narrow(c, 0, 1, 4)->layout, Layout(Shape::of({4, 4}), Stride::of({1, 6})));
}

// ---------------------------------------------------------------- autograd

// sum(w * y) for a fixed w of y's shape: d loss / d y = w.
TensorPtr weighted_sum(const TensorPtr& y, const std::vector<double>& w, bool cpu) {
  TensorPtr wt = dense_tensor(cpu, y->layout.shape(), w);
  std::vector<Operand> prod{Operand::of(y), Operand::of(wt)};
  std::string desc;
  for (size_t k = 0; k < y->layout.rank(); ++k) desc += std::string(k ? " " : "") + char('a' + k);
  OpOptions o;
  o.description = desc + " ->";
  std::vector<Operand> sum{Operand::of(call_op(OpId::ElementwiseMul, prod))};
  return call_op(OpId::ReduceSum, sum, o);
}

class ViewGradients : public ::testing::TestWithParam<bool> {};  // CPU or Generic

TEST_P(ViewGradients, EachViewSendsTheCotangentBackExactly) {
  const bool cpu = GetParam();
  Rng rng(test_seed());
  const Shape shape = Shape::of({4, 6, 2});
  auto fresh = [&] { return dense_tensor(cpu, shape, draw_eighths(rng, 48, -8, 8)); };
  auto grad_of = [](const TensorPtr& x) { return values_of(x->grad); };
  // narrow: w in the slice, zeros elsewhere.
  {
    TensorPtr x = fresh();
    TensorPtr y = narrow(x, 1, 2, 3);
    ASSERT_TRUE(y->node);
    EXPECT_EQ(y->node->name, "narrow");
    std::vector<double> w = draw_eighths(rng, y->size(), -8, 8);
    backward(weighted_sum(y, w, cpu), nullptr, false);
    std::vector<double> g = grad_of(x), expect(48, 0.0);
    for (int64_t i = 0; i < y->size(); ++i) {
      Coord c = y->layout.shape().decode(i);
      expect[shape.encode(coord3(c[0].value(), c[1].value() + 2, c[2].value()))] = w[i];
    }
    EXPECT_EQ(g, expect);
  }
  // chunk: every piece's cotangent in its place; the pieces' contributions sum.
  {
    TensorPtr x = fresh();
    std::vector<TensorPtr> parts = chunk(x, 2, 0);
    ASSERT_EQ(parts.size(), 2u);
    EXPECT_EQ(parts[0]->node->name, "chunk");
    std::vector<double> w0 = draw_eighths(rng, 24, -8, 8), w1 = draw_eighths(rng, 24, -8, 8);
    std::vector<Operand> both{Operand::of(weighted_sum(parts[0], w0, cpu)), Operand::of(weighted_sum(parts[1], w1, cpu))};
    backward(call_op(OpId::Add, both), nullptr, false);
    std::vector<double> expect(48);
    for (int64_t i = 0; i < 48; ++i) {
      Coord c = shape.decode(i);
      const int64_t a = c[0].value();
      const int64_t j = (a % 2) + 2 * c[1].value() + 12 * c[2].value();  // ordinal in the (2, 6, 2) piece
      expect[i] = a < 2 ? w0[j] : w1[j];
    }
    EXPECT_EQ(grad_of(x), expect);
  }
  // permute: the inverse permutation.
  {
    TensorPtr x = fresh();
    TensorPtr y = permute(x, {2, 0, 1});
    std::vector<double> w = draw_eighths(rng, 48, -8, 8);
    backward(weighted_sum(y, w, cpu), nullptr, false);
    std::vector<double> expect(48);
    for (int64_t i = 0; i < 48; ++i) {
      Coord c = shape.decode(i);
      expect[i] = w[y->layout.shape().encode(coord3(c[2].value(), c[0].value(), c[1].value()))];
    }
    EXPECT_EQ(grad_of(x), expect);
  }
  // reshape, as a view and as a copy: the cotangent reshaped back (ordinal for ordinal).
  for (bool copying : {false, true}) {
    TensorPtr x = fresh();
    TensorPtr src = copying ? permute(x, {1, 0, 2}) : x;
    TensorPtr y = reshape(src, std::vector<int64_t>{12, -1});
    EXPECT_EQ(y->carrier == x->carrier, !copying);
    std::vector<double> w = draw_eighths(rng, 48, -8, 8);
    backward(weighted_sum(y, w, cpu), nullptr, false);
    std::vector<double> expect(48);
    for (int64_t i = 0; i < 48; ++i) {  // x ordinal of src ordinal i
      Coord c = src->layout.shape().decode(i);
      const int64_t xo = copying ? shape.encode(coord3(c[1].value(), c[0].value(), c[2].value())) : i;
      expect[xo] = w[i];
    }
    EXPECT_EQ(grad_of(x), expect);
  }
  // Composition: narrow of permute of reshape; the gradient is w scattered through all three.
  {
    TensorPtr x = fresh();
    TensorPtr r = reshape(x, std::vector<int64_t>{8, 6});  // x ordinal o -> r (o % 8, o / 8)
    TensorPtr p = permute(r, {1, 0});                    // (6, 8)
    TensorPtr y = narrow(p, 1, 3, 4);                    // (6, 4): p (i, j + 3)
    std::vector<double> w = draw_eighths(rng, 24, -8, 8);
    backward(weighted_sum(y, w, cpu), nullptr, false);
    std::vector<double> expect(48, 0.0);
    for (int64_t i = 0; i < 6; ++i)
      for (int64_t j = 0; j < 4; ++j) expect[(j + 3) + 8 * i] = w[i + 6 * j];
    EXPECT_EQ(grad_of(x), expect);
  }
}

INSTANTIATE_TEST_SUITE_P(NativeKinds, ViewGradients, ::testing::Bool(),
                         [](const ::testing::TestParamInfo<bool>& i) { return i.param ? "CPU" : "Generic"; });

TEST(ViewGradients, SixteenBitLeavesGetExactGradients) {
  Rng rng(test_seed());
  for (const DType* d : {&DType::BFloat16(), &DType::Float16()}) {
    SCOPED_TRACE(d->name());
    // Eighths in [-8, 8] have at most 7 significant bits: exact in both 16-bit formats.
    TensorPtr x = dense_tensor(true, Shape::of({4, 6}), draw_eighths(rng, 24, -8, 8), *d);
    TensorPtr y = narrow(permute(x, {1, 0}), 0, 1, 2);  // (2, 4): x (j, i + 1)
    std::vector<double> w = draw_eighths(rng, 8, -8, 8);
    backward(weighted_sum(y, w, true), nullptr, false);
    ASSERT_EQ(x->grad->dtype(), *d);
    std::vector<double> expect(24, 0.0);
    for (int64_t i = 0; i < 2; ++i)
      for (int64_t j = 0; j < 4; ++j) expect[j + 4 * (i + 1)] = w[i + 2 * j];
    EXPECT_EQ(values_of(x->grad), expect);
  }
}

// A view's VJP may return another tensor over its cotangent's carrier (permute, a reshape that is a view): the
// engine must still give every leaf a .grad of its own, and never the caller's seed.
TEST(ViewGradients, TwoLeavesNeverShareAGradientThroughAView) {
  TensorPtr x = dense_tensor(true, Shape::of({4, 6}), std::vector<double>(24, 1.0));
  TensorPtr z = dense_tensor(true, Shape::of({24}), std::vector<double>(24, 2.0));
  std::vector<Operand> both{Operand::of(reshape(x, std::vector<int64_t>{24})), Operand::of(z)};
  TensorPtr s = call_op(OpId::Add, both);
  std::vector<Operand> one{Operand::of(s)};
  OpOptions all;
  all.description = "a ->";
  backward(call_op(OpId::ReduceSum, one, all), nullptr, false);
  ASSERT_TRUE(x->grad && z->grad);
  EXPECT_NE(x->grad->carrier, z->grad->carrier);
  EXPECT_EQ(values_of(x->grad), std::vector<double>(24, 1.0));
  EXPECT_EQ(values_of(z->grad), std::vector<double>(24, 1.0));
  // The seed itself, through a view: the leaf's gradient is a copy.
  TensorPtr w = dense_tensor(true, Shape::of({4, 6}), std::vector<double>(24, 1.0));
  TensorPtr seed = dense_tensor(true, Shape::of({24}), std::vector<double>(24, 3.0));
  backward(reshape(w, std::vector<int64_t>{24}), seed, false);
  EXPECT_NE(w->grad->carrier, seed->carrier);
  EXPECT_EQ(values_of(w->grad), std::vector<double>(24, 3.0));
}

TEST(ViewGradients, NoNodeWithoutGradModeOrForIntegerTensors) {
  TensorPtr x = dense_tensor(true, Shape::of({4, 6}), std::vector<double>(24, 1.0));
  {
    GradModeGuard off(false);
    EXPECT_FALSE(narrow(x, 0, 0, 2)->node);
    EXPECT_FALSE(reshape(permute(x, {1, 0}), std::vector<int64_t>{24})->node);
  }
  TensorPtr i = dense_tensor(true, Shape::of({4, 6}), std::vector<double>(24, 1.0), DType::Int32());
  EXPECT_FALSE(permute(i, {1, 0})->node);
}

// ---------------------------------------------------------------- the fused gate_up projection

TEST(ViewUseCases, GateUpOfAnExpertStackSplitsWithoutACopy) {
  // transformers' (E, 2I, H) gate_up_proj, row-major: chunk mode 1 in two gives gate and up over the same bytes.
  const int64_t E = 3, I2 = 8, H = 5;
  std::vector<double> v(E * I2 * H);
  for (size_t i = 0; i < v.size(); ++i) v[i] = static_cast<double>(i);
  TensorPtr flat = dense_tensor(true, Shape::of({E * I2 * H}), v);
  TensorPtr gate_up = make_tensor(flat->carrier, 0, row_major(Shape::of({E, I2, H})));
  std::vector<TensorPtr> halves = chunk(gate_up, 2, 1);
  ASSERT_EQ(halves.size(), 2u);
  for (int64_t h = 0; h < 2; ++h) {
    EXPECT_EQ(halves[h]->carrier, flat->carrier);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t i = 0; i < I2 / 2; ++i)
        for (int64_t k = 0; k < H; ++k)
          EXPECT_EQ(as_double(halves[h]->get(coord3(e, i, k))), v[(e * I2 + h * I2 / 2 + i) * H + k]);
  }
}

// ---------------------------------------------------------------- errors: type, message, nothing changed

TEST(ViewErrors, EachNamesTheProblemAndChangesNothing) {
  TensorPtr x = dense_tensor(true, Shape::of({4, 6}), std::vector<double>(24, 1.0));
  const Layout layout = x->layout;
  const uint64_t version = x->version();
  EXPECT_SW_THROW(IndexError, "narrow: mode 2 is out of range for a tensor of 2 modes (shape (4,6))", narrow(x, 2, 0, 1));
  EXPECT_SW_THROW(IndexError, "mode -1 is out of range", narrow(x, -1, 0, 1));
  EXPECT_SW_THROW(IndexError, "narrow: ordinals [4, 7) are out of range for mode 1 of extent 6", narrow(x, 1, 4, 3));
  EXPECT_SW_THROW(IndexError, "ordinals [-1, 1) are out of range", narrow(x, 1, -1, 2));
  EXPECT_SW_THROW(ValueError, "narrow: length must be >= 1, got 0", narrow(x, 1, 0, 0));
  EXPECT_SW_THROW(IndexError, "chunk: mode 3 is out of range", chunk(x, 2, 3));
  EXPECT_SW_THROW(ValueError, "chunk: the number of chunks must be >= 1, got 0", chunk(x, 0, 1));
  EXPECT_SW_THROW(ValueError, "permute: order (0, 0) is not a permutation of the 2 modes of shape (4,6)", permute(x, {0, 0}));
  EXPECT_SW_THROW(ValueError, "order (1) is not a permutation", permute(x, {1}));
  EXPECT_SW_THROW(ValueError, "order (0, 2) is not a permutation", permute(x, {0, 2}));
  EXPECT_SW_THROW(ValueError, "reshape: shape (5,5) has 25 elements but the tensor (shape (4,6)) has 24", reshape(x, Shape::of({5, 5})));
  EXPECT_SW_THROW(ValueError, "reshape: shape (-1, -1) has more than one -1", reshape(x, std::vector<int64_t>{-1, -1}));
  EXPECT_SW_THROW(ValueError, "(the other extents' product 5 does not divide it)", reshape(x, std::vector<int64_t>{5, -1}));
  EXPECT_SW_THROW(ValueError, "reshape: extents must be >= 1 (or one -1), got (0, 24)", reshape(x, std::vector<int64_t>{0, 24}));
  EXPECT_SW_THROW(ValueError, "got (-2, -12)", reshape(x, std::vector<int64_t>{-2, -12}));
  EXPECT_EQ(x->layout, layout);
  EXPECT_EQ(x->offset, 0);
  EXPECT_EQ(x->version(), version);
  EXPECT_FALSE(x->node);
  EXPECT_FALSE(x->grad);
  x->carrier->release();
  EXPECT_SW_THROW(RuntimeError, "released", narrow(x, 0, 0, 1));
}

}  // namespace
}  // namespace sw
