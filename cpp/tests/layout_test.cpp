// Layout algebra tested over whole domains (design/practices.md): every layout
// function is checked for every coordinate of many random nested shapes against
// naive references written independently here, plus the worked examples and
// error cases of docs/guide.md, "Layouts".
//
// The random seed is printed; set SW_TEST_SEED=<n> to replay a run.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <iostream>
#include <random>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "strideweave/errors.hpp"
#include "strideweave/layout.hpp"
#include "test_support.hpp"

namespace sw {

// Readable GoogleTest failure messages (found by ADL, so outside the unnamed namespace).
void PrintTo(const IntTuple& t, std::ostream* os) { *os << t.str(); }
void PrintTo(const Shape& s, std::ostream* os) { *os << "Shape" << s.str(); }
void PrintTo(const Stride& s, std::ostream* os) { *os << "Stride" << s.str(); }
void PrintTo(const Layout& l, std::ostream* os) { *os << "Layout(" << l.str() << ")"; }

namespace {

using testing_support::test_seed;
using testing_support::Rng;

// ---------------------------------------------------------------- helpers

IntTuple T(std::initializer_list<IntTuple> children) { return IntTuple::tuple(children); }

// ---------------------------------------------------------------- independent references

// Leaves in depth-first order.
void ref_leaves(const IntTuple& t, std::vector<int64_t>& out) {
  if (t.is_leaf()) {
    out.push_back(t.value());
    return;
  }
  for (const auto& c : t.children()) ref_leaves(c, out);
}
std::vector<int64_t> ref_leaves(const IntTuple& t) {
  std::vector<int64_t> out;
  ref_leaves(t, out);
  return out;
}

int64_t ref_size(const IntTuple& t) {
  int64_t n = 1;
  for (auto e : ref_leaves(t)) n *= e;
  return n;
}

int ref_depth(const IntTuple& t) {
  if (t.is_leaf()) return 0;
  int d = 0;
  for (const auto& c : t.children()) d = std::max(d, 1 + ref_depth(c));
  return d;
}

// A tree of the same form as `form` whose leaves are `values` in depth-first order.
IntTuple with_leaves(const IntTuple& form, const std::vector<int64_t>& values, size_t& pos) {
  if (form.is_leaf()) return IntTuple(values.at(pos++));
  std::vector<IntTuple> out;
  for (const auto& c : form.children()) out.push_back(with_leaves(c, values, pos));
  return IntTuple::tuple(std::move(out));
}
IntTuple with_leaves(const IntTuple& form, const std::vector<int64_t>& values) {
  size_t pos = 0;
  IntTuple t = with_leaves(form, values, pos);
  EXPECT_EQ(pos, values.size());
  return t;
}

// The i-th coordinate in colex order: an odometer over the depth-first leaves,
// first leaf fastest (spec: first-mode-fastest at every level).
std::vector<int64_t> ref_leaf_coords(const std::vector<int64_t>& extents, int64_t i) {
  std::vector<int64_t> c(extents.size());
  for (size_t j = 0; j < extents.size(); ++j) {
    c[j] = i % extents[j];
    i /= extents[j];
  }
  return c;
}

// Colex ordinal of a full nested coordinate within a subtree.
int64_t ref_encode(const IntTuple& shape, const IntTuple& coord) {
  std::vector<int64_t> e = ref_leaves(shape), c = ref_leaves(coord);
  int64_t ord = 0, scale = 1;
  for (size_t j = 0; j < e.size(); ++j) {
    ord += c[j] * scale;
    scale *= e[j];
  }
  return ord;
}

// Recursive sum of coordinate * stride over the tree (full nested coordinate).
int64_t ref_index(const IntTuple& stride, const IntTuple& coord) {
  if (stride.is_leaf()) return coord.value() * stride.value();
  int64_t off = 0;
  for (size_t k = 0; k < stride.children().size(); ++k) off += ref_index(stride.children()[k], coord.children()[k]);
  return off;
}

// Replaces random non-leaf subtrees of a full coordinate by their ordinal.
IntTuple mix_ordinals(const IntTuple& shape, const IntTuple& coord, Rng& rng, double p) {
  if (shape.is_leaf()) return coord;
  if (rng.chance(p)) return IntTuple(ref_encode(shape, coord));
  std::vector<IntTuple> out;
  for (size_t k = 0; k < shape.children().size(); ++k)
    out.push_back(mix_ordinals(shape.children()[k], coord.children()[k], rng, p));
  return IntTuple::tuple(std::move(out));
}

// Dense strides over the depth-first leaves: prefix products (column-major) or
// suffix products (row-major).
std::vector<int64_t> ref_col_major(const std::vector<int64_t>& e) {
  std::vector<int64_t> s(e.size());
  int64_t run = 1;
  for (size_t j = 0; j < e.size(); ++j) {
    s[j] = run;
    run *= e[j];
  }
  return s;
}
std::vector<int64_t> ref_row_major(const std::vector<int64_t>& e) {
  std::vector<int64_t> s(e.size());
  int64_t run = 1;
  for (size_t j = e.size(); j-- > 0;) {
    s[j] = run;
    run *= e[j];
  }
  return s;
}

// Length of the maximal leading contiguous run: skip extent-1 leaves, then
// multiply extents while each stride equals the running length.
int64_t ref_leading_run(const std::vector<int64_t>& e, const std::vector<int64_t>& s) {
  int64_t len = 1;
  for (size_t j = 0; j < e.size(); ++j) {
    if (e[j] == 1) continue;
    if (s[j] != len) break;
    len *= e[j];
  }
  return len;
}

// ---------------------------------------------------------------- random generation

constexpr int64_t kMaxSize = 360;  // keeps every domain small enough to enumerate

// A random mode tree at `level` (1 = top-level modes); depth of the whole shape <= 3.
IntTuple random_mode(Rng& rng, int level, int64_t& size) {
  if (level < 3 && rng.chance(0.35)) {
    int n = static_cast<int>(rng.chance(0.04) ? 0 : rng.uniform(1, 3));  // rarely an empty subtree
    std::vector<IntTuple> kids;
    for (int k = 0; k < n; ++k) kids.push_back(random_mode(rng, level + 1, size));
    return IntTuple::tuple(std::move(kids));
  }
  int64_t e = rng.chance(0.25) ? 1 : rng.uniform(2, 5);
  if (size * e > kMaxSize) e = 1;
  size *= e;
  return IntTuple(e);
}

Shape random_shape(Rng& rng) {
  int64_t size = 1;
  int rank = static_cast<int>(rng.chance(0.03) ? 0 : rng.uniform(1, 4));
  std::vector<IntTuple> modes;
  for (int k = 0; k < rank; ++k) modes.push_back(random_mode(rng, 1, size));
  return Shape(IntTuple::tuple(std::move(modes)));
}

enum class StrideKind { Random, ColMajor, ColMajorLooseUnit, RowMajor, PermutedPadded, Overlapping, kCount };

std::vector<int64_t> random_strides(Rng& rng, const std::vector<int64_t>& e, StrideKind kind) {
  const size_t n = e.size();
  std::vector<int64_t> s(n);
  switch (kind) {
    case StrideKind::Random:
      for (auto& x : s) {
        int64_t r = rng.uniform(0, 99);
        x = r < 15 ? 0 : r < 30 ? 1 : r < 90 ? rng.uniform(2, 12) : rng.uniform(13, 1000);
      }
      break;
    case StrideKind::ColMajor: s = ref_col_major(e); break;
    case StrideKind::ColMajorLooseUnit:  // extent-1 leaves may carry any stride
      s = ref_col_major(e);
      for (size_t j = 0; j < n; ++j)
        if (e[j] == 1) s[j] = rng.uniform(0, 50);
      break;
    case StrideKind::RowMajor: s = ref_row_major(e); break;
    case StrideKind::PermutedPadded: {  // injective, non-compact: dense over a permutation, with gaps
      std::vector<size_t> order(n);
      for (size_t j = 0; j < n; ++j) order[j] = j;
      std::shuffle(order.begin(), order.end(), rng.g);
      int64_t run = rng.uniform(1, 3);
      for (size_t j : order) {
        s[j] = run;
        run = run * e[j] + rng.uniform(0, 2);
      }
      break;
    }
    case StrideKind::Overlapping:  // small strides: offsets collide
      for (auto& x : s) x = rng.uniform(0, 3);
      break;
    case StrideKind::kCount: break;
  }
  return s;
}

// ---------------------------------------------------------------- the whole-domain check

struct Coverage {
  int layouts = 0, contiguous = 0, injective = 0, non_injective = 0, multi_run = 0, single_run = 0,
      deep = 0, rank0 = 0, broadcasts = 0, refinements = 0;
  int64_t coordinates = 0;
};

void check_layout(const Layout& lay, Rng& rng, Coverage& cov) {
  const Shape& shape = lay.shape();
  const IntTuple& st = shape.tree();
  const std::vector<int64_t> ext = ref_leaves(st);
  const std::vector<int64_t> str = ref_leaves(lay.stride().tree());
  const int64_t n = ref_size(st);

  // Shape / Stride / Layout basics.
  ASSERT_EQ(shape.size(), n);
  ASSERT_EQ(lay.size(), n);
  ASSERT_EQ(shape.leaves(), ext);
  ASSERT_EQ(shape.depth(), ref_depth(st));
  ASSERT_EQ(shape.rank(), st.children().size());
  ASSERT_EQ(lay.rank(), shape.rank());
  std::vector<int64_t> want_extents;
  for (const auto& m : st.children()) want_extents.push_back(ref_size(m));
  ASSERT_EQ(shape.extents(), want_extents);
  ASSERT_EQ(lay.flat().extents, ext);
  ASSERT_EQ(lay.flat().strides, str);
  ASSERT_EQ(lay.flat().size(), n);
  ASSERT_EQ(lay.str(), st.str() + ":" + lay.stride().tree().str());
  Layout copy(Shape(st), Stride(lay.stride().tree()));
  ASSERT_TRUE(copy == lay);
  ASSERT_EQ(copy.hash(), lay.hash());
  ASSERT_EQ(Shape(st).hash(), shape.hash());

  // Every coordinate.
  std::vector<int64_t> offsets(static_cast<size_t>(n));
  bool contiguous = true;
  for (int64_t i = 0; i < n; ++i) {
    const IntTuple c = with_leaves(st, ref_leaf_coords(ext, i));
    const Coord d = shape.decode(i);
    ASSERT_EQ(d, c) << "decode(" << i << ") = " << d.str() << ", expected " << c.str();
    ASSERT_EQ(shape.encode(c), i) << "encode(" << c.str() << ")";
    ASSERT_EQ(shape.decode(shape.encode(c)), c);
    ASSERT_EQ(shape.encode(IntTuple(i)), i);

    const int64_t want = ref_index(lay.stride().tree(), c);
    ASSERT_EQ(lay.index(i), want) << "index(" << i << ")";
    ASSERT_EQ(lay.index(IntTuple(i)), want) << "index(Coord " << i << ")";
    ASSERT_EQ(lay.index(c), want) << "index(" << c.str() << ")";
    ASSERT_EQ(lay.flat().index(i), want);
    for (double p : {0.3, 0.7}) {
      const IntTuple m = mix_ordinals(st, c, rng, p);
      ASSERT_EQ(shape.encode(m), i) << "encode(" << m.str() << ")";
      ASSERT_EQ(lay.index(m), want) << "index(" << m.str() << ")";
    }
    offsets[static_cast<size_t>(i)] = want;
    contiguous = contiguous && want == i;
  }
  cov.coordinates += n;

  // Out-of-range ordinals at the domain's edges.
  EXPECT_SW_THROW(ValueError, "out of range", shape.decode(n));
  EXPECT_SW_THROW(ValueError, "out of range", shape.decode(-1));
  EXPECT_SW_THROW(ValueError, "out of range", lay.index(n));
  EXPECT_SW_THROW(ValueError, "out of range", lay.index(IntTuple(int64_t{-1})));
  EXPECT_SW_THROW(ValueError, "out of range", shape.encode(IntTuple(n)));

  // cosize and is_injective by brute force.
  const int64_t max_off = *std::max_element(offsets.begin(), offsets.end());
  ASSERT_EQ(lay.cosize(), max_off + 1);
  const bool injective = std::set<int64_t>(offsets.begin(), offsets.end()).size() == offsets.size();
  ASSERT_EQ(lay.is_injective(), injective);
  ASSERT_EQ(lay.is_contiguous(), contiguous);
  cov.contiguous += contiguous;
  cov.injective += injective;
  cov.non_injective += !injective;

  // runs() reproduces the offsets in ordinal order.
  const std::vector<Run> runs = lay.runs();
  int64_t ord = 0;
  for (const Run& r : runs) {
    ASSERT_EQ(r.ordinal, ord);
    ASSERT_GE(r.length, 1);
    for (int64_t t = 0; t < r.length; ++t) {
      ASSERT_LT(ord, n);
      ASSERT_EQ(r.offset + t, offsets[static_cast<size_t>(ord)]) << "run at ordinal " << r.ordinal;
      ++ord;
    }
  }
  ASSERT_EQ(ord, n) << "run lengths must sum to size";
  // Runs have the maximal leading-contiguous length; the second run never just
  // continues the first (its stride would have been merged).
  const int64_t lead = ref_leading_run(ext, str);
  for (const Run& r : runs) ASSERT_EQ(r.length, lead);
  if (runs.size() > 1) {
    ASSERT_NE(runs[1].offset, runs[0].offset + runs[0].length);
    ++cov.multi_run;
  } else {
    ++cov.single_run;
  }
  if (contiguous) {
    ASSERT_EQ(runs.size(), 1u);
    ASSERT_EQ(lay.cosize(), n);
  }

  // Sub-layouts: mode k over its own ordinals, other modes at 0.
  for (size_t k = 0; k < lay.rank(); ++k) {
    const Layout sub = lay.mode(k);
    ASSERT_EQ(sub.size(), want_extents[k]);
    ASSERT_EQ(sub.shape(), shape.mode(k));
    ASSERT_EQ(sub.stride(), lay.stride().mode(k));
    for (int64_t j = 0; j < sub.size(); ++j) {
      std::vector<IntTuple> parts(lay.rank(), IntTuple(int64_t{0}));
      parts[k] = IntTuple(j);
      ASSERT_EQ(lay.index(IntTuple::tuple(parts)), sub.index(j));
    }
  }
  EXPECT_SW_THROW(IndexError, "out of range", lay.mode(lay.rank()));
  EXPECT_SW_THROW(IndexError, "out of range", shape.mode(shape.rank()));
  EXPECT_SW_THROW(IndexError, "out of range", lay.stride().mode(lay.rank()));

  cov.deep += shape.depth() >= 3;
  cov.rank0 += shape.rank() == 0;
  ++cov.layouts;
}

// broadcast_to: extent-1 leaves take the target extent with stride 0; all else is kept.
void check_broadcast(const Layout& lay, Rng& rng, Coverage& cov) {
  const IntTuple& st = lay.shape().tree();
  const std::vector<int64_t> ext = ref_leaves(st), str = ref_leaves(lay.stride().tree());
  std::vector<int64_t> target_ext = ext;
  int64_t size = 1;
  for (size_t j = 0; j < ext.size(); ++j) {
    if (ext[j] == 1 && rng.chance(0.7)) target_ext[j] = rng.uniform(1, 4);
    size *= target_ext[j];
  }
  if (size > 4 * kMaxSize) return;
  const Shape target(with_leaves(st, target_ext));
  const Layout b = lay.broadcast_to(target);
  ASSERT_EQ(b.shape(), target);
  const std::vector<int64_t> bs = ref_leaves(b.stride().tree());
  ASSERT_TRUE(b.stride().tree().congruent(st));
  for (size_t j = 0; j < ext.size(); ++j) {
    if (ext[j] != target_ext[j]) ASSERT_EQ(bs[j], 0) << "leaf " << j;
    if (ext[j] > 1) ASSERT_EQ(bs[j], str[j]) << "leaf " << j;
  }
  // Every target coordinate maps where the source coordinate with the
  // broadcast leaves at 0 maps.
  for (int64_t i = 0; i < size; ++i) {
    std::vector<int64_t> c = ref_leaf_coords(target_ext, i);
    const int64_t got = b.index(with_leaves(st, c));
    for (size_t j = 0; j < ext.size(); ++j)
      if (ext[j] == 1) c[j] = 0;
    ASSERT_EQ(got, lay.index(with_leaves(st, c)));
  }
  ++cov.broadcasts;

  // Changing a leaf whose extent is not 1 is refused.
  for (size_t j = 0; j < ext.size(); ++j) {
    if (ext[j] == 1) continue;
    std::vector<int64_t> bad = ext;
    bad[j] = ext[j] + 1;
    EXPECT_SW_THROW(ValueError, "cannot broadcast", lay.broadcast_to(Shape(with_leaves(st, bad))));
    break;
  }
  // Inserting or removing a mode is refused.
  if (lay.rank() > 0) {
    std::vector<IntTuple> more = st.children();
    more.push_back(IntTuple(int64_t{1}));
    EXPECT_SW_THROW(ValueError, "hierarchies differ", lay.broadcast_to(Shape(IntTuple::tuple(more))));
    std::vector<IntTuple> fewer(st.children().begin(), st.children().end() - 1);
    EXPECT_SW_THROW(ValueError, "hierarchies differ", lay.broadcast_to(Shape(IntTuple::tuple(fewer))));
    // Note [Compatible shapes]: a nested first mode is never merged into one leaf of its size; a leaf first mode
    // refined into (2, extent / 2) (when even) is a view of the same offsets.
    std::vector<IntTuple> modes = st.children();
    if (!modes[0].is_leaf()) {
      std::vector<IntTuple> merged = modes;
      int64_t n = 1;
      for (int64_t e : modes[0].leaves()) n *= e;
      merged[0] = IntTuple(n);
      EXPECT_SW_THROW(ValueError, "hierarchies differ", lay.broadcast_to(Shape(IntTuple::tuple(merged))));
    } else if (modes[0].value() % 2 == 0) {
      std::vector<IntTuple> refined = modes;
      refined[0] = IntTuple::tuple({IntTuple(int64_t{2}), IntTuple(modes[0].value() / 2)});
      const Layout r = lay.broadcast_to(Shape(IntTuple::tuple(refined)));
      ASSERT_EQ(r.size(), lay.size());
      for (int64_t i = 0; i < lay.size(); ++i) ASSERT_EQ(r.index(i), lay.index(i)) << "ordinal " << i;
      ++cov.refinements;
    }
  }
}

TEST(LayoutProperty, WholeDomainsOfRandomNestedLayouts) {
  const uint64_t seed = test_seed();
  RecordProperty("seed", std::to_string(seed));
  Rng rng(seed);
  Coverage cov;
  constexpr int kShapes = 1500;
  for (int t = 0; t < kShapes; ++t) {
    const Shape shape = random_shape(rng);
    const auto kind = static_cast<StrideKind>(t % static_cast<int>(StrideKind::kCount));
    const std::vector<int64_t> strides = random_strides(rng, shape.leaves(), kind);
    const Layout lay(shape, Stride(with_leaves(shape.tree(), strides)));
    SCOPED_TRACE("SW_TEST_SEED=" + std::to_string(seed) + " case " + std::to_string(t) + " layout " + lay.str());
    check_layout(lay, rng, cov);
    if (HasFatalFailure()) return;
    check_broadcast(lay, rng, cov);
    if (HasFatalFailure()) return;
  }
  std::printf(
      "[ COVERAGE ] %d layouts, %lld coordinates; contiguous %d, injective %d, non-injective %d, "
      "multi-run %d, single-run %d, depth 3 %d, rank 0 %d, broadcasts %d\n",
      cov.layouts, static_cast<long long>(cov.coordinates), cov.contiguous, cov.injective, cov.non_injective,
      cov.multi_run, cov.single_run, cov.deep, cov.rank0, cov.broadcasts);
  // The generator must actually reach every interesting case.
  EXPECT_GE(cov.layouts, 1000);
  EXPECT_GT(cov.contiguous, 100);
  EXPECT_GT(cov.injective, 200);
  EXPECT_GT(cov.non_injective, 200);
  EXPECT_GT(cov.multi_run, 200);
  EXPECT_GT(cov.single_run, 100);
  EXPECT_GT(cov.deep, 50);
  EXPECT_GT(cov.broadcasts, 500);
  EXPECT_GT(cov.refinements, 50);
}

// Dense layouts of random nested shapes: strides are prefix / suffix products
// of the depth-first leaves, and column_major is the identity map.
TEST(LayoutProperty, ColumnAndRowMajorOfRandomShapes) {
  const uint64_t seed = test_seed() ^ 0x5eedULL;
  Rng rng(seed);
  for (int t = 0; t < 1000; ++t) {
    const Shape shape = random_shape(rng);
    SCOPED_TRACE("SW_TEST_SEED=" + std::to_string(test_seed()) + " shape " + shape.str());
    const Layout col = column_major(shape), row = row_major(shape);
    ASSERT_EQ(col.shape(), shape);
    ASSERT_EQ(row.shape(), shape);
    ASSERT_EQ(ref_leaves(col.stride().tree()), ref_col_major(shape.leaves()));
    ASSERT_EQ(ref_leaves(row.stride().tree()), ref_row_major(shape.leaves()));
    ASSERT_TRUE(col.is_contiguous());
    ASSERT_TRUE(col.is_injective());
    ASSERT_TRUE(row.is_injective());
    ASSERT_EQ(col.cosize(), shape.size());
    ASSERT_EQ(row.cosize(), shape.size());
    ASSERT_EQ(col.runs().size(), 1u);
    for (int64_t i = 0; i < shape.size(); ++i) ASSERT_EQ(col.index(i), i);
  }
}

// ---------------------------------------------------------------- worked examples of the layout rules

TEST(Shape, ColexOrdering) {
  const Shape s = Shape::of({3, 4});
  EXPECT_EQ(s.decode(0), T({0, 0}));
  EXPECT_EQ(s.decode(1), T({1, 0}));
  EXPECT_EQ(s.decode(2), T({2, 0}));
  EXPECT_EQ(s.decode(3), T({0, 1}));
  EXPECT_EQ(s.decode(4), T({1, 1}));
  EXPECT_EQ(s.decode(11), T({2, 3}));
}

TEST(Shape, NestedDecodeEncodeExample) {
  const Shape s = Shape::of({5, T({20, 4})});
  EXPECT_EQ(s.size(), 400);
  EXPECT_EQ(s.rank(), 2u);
  EXPECT_EQ(s.depth(), 2);
  EXPECT_EQ(s.extents(), (std::vector<int64_t>{5, 80}));
  EXPECT_EQ(s.leaves(), (std::vector<int64_t>{5, 20, 4}));
  EXPECT_EQ(s.decode(214), T({4, T({2, 2})}));
  EXPECT_EQ(s.decode(214).str(), "(4,(2,2))");
  EXPECT_EQ(s.encode(T({4, T({2, 2})})), 214);
  EXPECT_EQ(s.encode(T({4, 42})), 214);
  EXPECT_EQ(s.encode(IntTuple(214)), 214);
  EXPECT_EQ(s.str(), "(5,(20,4))");
  EXPECT_EQ(s.mode(1), Shape::of({20, 4}));
  EXPECT_EQ(s.mode(0), Shape::of({5}));
}

TEST(Shape, EqualityAndConstruction) {
  EXPECT_EQ(Shape::of({2, T({3, 4})}), Shape(T({2, T({3, 4})})));
  EXPECT_FALSE(Shape::of({2, T({3, 4})}) == Shape::of({2, 3, 4}));
  EXPECT_FALSE(Shape::of({2, 3}) == Shape::of({3, 2}));
  EXPECT_EQ(Shape::flat({2, 3, 4}), Shape::of({2, 3, 4}));
  EXPECT_EQ(Shape::of({4}).rank(), 1u);
  EXPECT_EQ(Shape::of({4}).size(), 4);
  EXPECT_EQ(std::hash<Shape>{}(Shape::of({2, T({3, 4})})), std::hash<Shape>{}(Shape(T({2, T({3, 4})}))));
}

TEST(Shape, RankZero) {
  const Shape s;
  EXPECT_EQ(s.rank(), 0u);
  EXPECT_EQ(s.size(), 1);
  EXPECT_EQ(s.depth(), 0);
  EXPECT_EQ(s.str(), "()");
  EXPECT_EQ(s.decode(0), T({}));
  EXPECT_EQ(s.encode(T({})), 0);
  EXPECT_EQ(s.encode(IntTuple(0)), 0);
  EXPECT_EQ(s, Shape::of({}));
  EXPECT_SW_THROW(ValueError, "out of range", s.decode(1));
  EXPECT_SW_THROW(ValueError, "has 1 modes", s.encode(T({0})));

  const Layout l;
  EXPECT_EQ(l.size(), 1);
  EXPECT_EQ(l.cosize(), 1);
  EXPECT_TRUE(l.is_injective());
  EXPECT_TRUE(l.is_contiguous());
  EXPECT_EQ(l.index(0), 0);
  EXPECT_EQ(l.index(T({})), 0);
  EXPECT_EQ(l.str(), "():()");
  ASSERT_EQ(l.runs().size(), 1u);
  EXPECT_EQ(l.runs()[0].ordinal, 0);
  EXPECT_EQ(l.runs()[0].offset, 0);
  EXPECT_EQ(l.runs()[0].length, 1);
  EXPECT_EQ(column_major(Shape()), l);
  EXPECT_SW_THROW(IndexError, "out of range", l.mode(0));
}

TEST(Layout, WorkedExample) {
  const Layout l(Shape::of({2, T({3, 4})}), Stride::of({1, T({10, 100})}));
  EXPECT_EQ(l.index(T({1, T({2, 3})})), 321);
  EXPECT_EQ(l.index(T({1, 11})), 321);                          // ordinal for the (3,4) subtree
  EXPECT_EQ(l.index(l.shape().encode(T({1, T({2, 3})}))), 321);  // one ordinal for the whole tree
  EXPECT_EQ(l.index(IntTuple(23)), 321);
  EXPECT_EQ(l.str(), "(2,(3,4)):(1,(10,100))");
  EXPECT_EQ(l.size(), 24);
  EXPECT_EQ(l.rank(), 2u);
  EXPECT_EQ(l.cosize(), 1 + 1 + 20 + 300);
  EXPECT_TRUE(l.is_injective());
  EXPECT_FALSE(l.is_contiguous());
  EXPECT_EQ(l.mode(1), Layout(Shape::of({3, 4}), Stride::of({10, 100})));
  EXPECT_EQ(l.mode(0), Layout(Shape::of({2}), Stride::of({1})));
  EXPECT_EQ(l, Layout(Shape(T({2, T({3, 4})})), Stride(T({1, T({10, 100})}))));
  EXPECT_FALSE(l == Layout(Shape::of({2, T({3, 4})}), Stride::of({1, T({10, 101})})));
  EXPECT_EQ(std::hash<Layout>{}(l), std::hash<Layout>{}(Layout(Shape::of({2, T({3, 4})}), Stride::of({1, T({10, 100})}))));
  // Runs of length 2 (the stride-1 leaf), one per (3,4) coordinate.
  const auto runs = l.runs();
  ASSERT_EQ(runs.size(), 12u);
  EXPECT_EQ(runs[5].ordinal, 10);
  EXPECT_EQ(runs[5].offset, 2 * 10 + 1 * 100);
  EXPECT_EQ(runs[5].length, 2);
}

TEST(Layout, DenseLayouts) {
  EXPECT_EQ(column_major(Shape::of({2, 3})), Layout(Shape::of({2, 3}), Stride::of({1, 2})));
  EXPECT_EQ(row_major(Shape::of({2, 3, 4})).stride(), Stride::of({12, 4, 1}));
  EXPECT_EQ(column_major(Shape::of({2, 3, 4})).stride(), Stride::of({1, 2, 6}));
  EXPECT_EQ(column_major(Shape::of({2, T({3, 4})})).stride(), Stride::of({1, T({2, 6})}));
  EXPECT_EQ(row_major(Shape::of({2, T({3, 4})})).stride(), Stride::of({12, T({4, 1})}));
  EXPECT_EQ(row_major(Shape::of({T({2, 3}), 4})).stride(), Stride::of({T({12, 4}), 1}));
  EXPECT_TRUE(column_major(Shape::of({2, 3})).is_contiguous());
  EXPECT_FALSE(row_major(Shape::of({2, 3})).is_contiguous());
  EXPECT_TRUE(row_major(Shape::of({1, 3})).is_contiguous());
}

TEST(Layout, CosizeInjectivityAndRuns) {
  // Broadcast (stride 0): not injective, runs of length 1 at repeated offsets.
  const Layout bc(Shape::of({3, 2}), Stride::of({0, 1}));
  EXPECT_EQ(bc.cosize(), 2);
  EXPECT_FALSE(bc.is_injective());
  EXPECT_FALSE(bc.is_contiguous());
  EXPECT_EQ(bc.runs().size(), 6u);
  // Overlapping without zero strides: (3,3):(1,2) hits offset 2 twice.
  const Layout ov(Shape::of({3, 3}), Stride::of({1, 2}));
  EXPECT_EQ(ov.cosize(), 7);
  EXPECT_FALSE(ov.is_injective());
  // Interleaved but injective: (2,2):(2,1).
  const Layout il(Shape::of({2, 2}), Stride::of({2, 1}));
  EXPECT_TRUE(il.is_injective());
  EXPECT_FALSE(il.is_contiguous());
  EXPECT_EQ(il.cosize(), 4);
  // Injective with collisions only found by enumeration: (2,3):(3,2) offsets 0,3,2,5,4,7.
  const Layout en(Shape::of({2, 3}), Stride::of({3, 2}));
  EXPECT_TRUE(en.is_injective());
  EXPECT_EQ(en.cosize(), 8);
  // Extent-1 leaves are ignored by contiguity and run merging.
  const Layout one(Shape::of({1, 4, T({1, 2})}), Stride::of({9, 1, T({7, 4})}));
  EXPECT_TRUE(one.is_contiguous());
  EXPECT_TRUE(one.is_injective());
  ASSERT_EQ(one.runs().size(), 1u);
  EXPECT_EQ(one.runs()[0].length, 8);
  // Size-1 layout with a nonzero stride.
  const Layout single(Shape::of({1}), Stride::of({5}));
  EXPECT_EQ(single.cosize(), 1);
  EXPECT_TRUE(single.is_contiguous());
  EXPECT_EQ(single.index(0), 0);
}

TEST(Layout, BroadcastTo) {
  const Layout l(Shape::of({1, T({3, 1})}), Stride::of({5, T({1, 7})}));
  const Layout b = l.broadcast_to(Shape::of({4, T({3, 2})}));
  EXPECT_EQ(b, Layout(Shape::of({4, T({3, 2})}), Stride::of({0, T({1, 0})})));
  EXPECT_EQ(b.index(T({3, T({2, 1})})), 2);
  EXPECT_FALSE(b.is_injective());
  EXPECT_EQ(b.cosize(), 3);
  EXPECT_SW_THROW(ValueError, "cannot broadcast", l.broadcast_to(Shape::of({4, T({2, 2})})));
  EXPECT_SW_THROW(ValueError, "hierarchies differ", l.broadcast_to(Shape::of({4, 3, 2})));
  EXPECT_SW_THROW(ValueError, "hierarchies differ", l.broadcast_to(Shape::of({4, T({3, 2}), 1})));
  EXPECT_SW_THROW(ValueError, "hierarchies differ", l.broadcast_to(Shape::of({4, 6})));  // never merged
  EXPECT_SW_THROW(ValueError, "hierarchies differ", l.broadcast_to(Shape::of({4, 3})));  // (3, 1) never merged
  // Note [Compatible shapes]: a leaf meets a nested mode: extent 1 broadcasts to all of it, an equal size refines.
  EXPECT_EQ(l.broadcast_to(Shape::of({T({2, 2}), T({3, 2})})),
            Layout(Shape::of({T({2, 2}), T({3, 2})}), Stride::of({T({0, 0}), T({1, 0})})));
  const Layout flat(Shape::of({4, 6}), Stride::of({6, 1}));  // row-major (4, 6)
  const Layout refined = flat.broadcast_to(Shape::of({4, T({3, 2})}));
  EXPECT_EQ(refined, Layout(Shape::of({4, T({3, 2})}), Stride::of({6, T({1, 3})})));
  for (int64_t i = 0; i < 24; ++i) EXPECT_EQ(refined.index(i), flat.index(i));
  EXPECT_SW_THROW(ValueError, "neither 1 nor the size 6 of (3,2)", Layout(Shape::of({4, 5}), Stride::of({5, 1}))
                                                                        .broadcast_to(Shape::of({4, T({3, 2})})));
  EXPECT_EQ(refine_shape(Shape::of({4, 6}), Shape::of({4, T({3, 2})})), Shape::of({4, T({3, 2})}));
  EXPECT_EQ(refine_shape(Shape::of({1, 1}), Shape::of({4, T({3, 2})})), Shape::of({1, T({1, 1})}));
  EXPECT_EQ(refine_shape(Shape::of({4, T({3, 2})}), Shape::of({4, 6})), std::nullopt);
  EXPECT_EQ(Layout().broadcast_to(Shape()), Layout());
}

// ---------------------------------------------------------------- errors

TEST(LayoutErrors, Extents) {
  EXPECT_SW_THROW(ValueError, "must be >= 1", Shape::of({0}));
  EXPECT_SW_THROW(ValueError, "must be >= 1", Shape::of({2, T({3, -1})}));
  EXPECT_SW_THROW(ValueError, "got 0", Shape::flat({4, 0}));
  EXPECT_SW_THROW(ValueError, "exceeds", Shape::flat({int64_t{1} << 40, int64_t{1} << 40}));
}

TEST(LayoutErrors, Strides) {
  EXPECT_SW_THROW(ValueError, "must be >= 0", Stride::of({-1}));
  EXPECT_SW_THROW(ValueError, "must be >= 0", Stride::of({1, T({2, -3})}));
  EXPECT_SW_THROW(ValueError, "got -2", Stride::flat({0, -2}));
  EXPECT_NO_THROW(Stride::of({0, T({0, 0})}));
}

TEST(LayoutErrors, NonCongruent) {
  EXPECT_SW_THROW(ValueError, "not congruent", Layout(Shape::of({2, T({3, 4})}), Stride::of({1, 6})));
  EXPECT_SW_THROW(ValueError, "not congruent", Layout(Shape::of({2, 3}), Stride::of({1, 2, 6})));
  EXPECT_SW_THROW(ValueError, "not congruent", Layout(Shape::of({2, 3}), Stride::of({1, T({2})})));
  EXPECT_SW_THROW(ValueError, "not congruent", Layout(Shape::of({6}), Stride()));
}

TEST(LayoutErrors, CosizeOverflow) {
  EXPECT_SW_THROW(ValueError, "exceeds", Layout(Shape::of({3}), Stride::of({int64_t{1} << 61})));
  // Each term fits, but their sum passes 2**62 (and 2**63).
  EXPECT_SW_THROW(ValueError, "exceeds",
                  Layout(Shape::of({2, 2, 2}), Stride::flat({int64_t{1} << 61, int64_t{1} << 61, int64_t{1} << 61})));
  EXPECT_SW_THROW(ValueError, "exceeds",
                  Layout(Shape::of({2, 2, 2}), Stride::flat({int64_t{1} << 62, int64_t{1} << 62, int64_t{1} << 62})));
}

TEST(LayoutErrors, OrdinalsAndCoordinates) {
  const Shape s = Shape::of({5, T({20, 4})});
  EXPECT_SW_THROW(ValueError, "out of range", s.decode(400));
  EXPECT_SW_THROW(ValueError, "out of range", s.decode(-1));
  EXPECT_SW_THROW(ValueError, "out of range", s.encode(IntTuple(400)));
  EXPECT_SW_THROW(ValueError, "out of range", s.encode(T({5, 0})));
  EXPECT_SW_THROW(ValueError, "out of range", s.encode(T({-1, 0})));
  EXPECT_SW_THROW(ValueError, "out of range", s.encode(T({4, 80})));
  EXPECT_SW_THROW(ValueError, "out of range", s.encode(T({4, T({20, 0})})));
  EXPECT_SW_THROW(ValueError, "out of range", s.encode(T({4, T({0, 4})})));
  const Layout l(s, Stride::of({1, T({5, 100})}));
  EXPECT_SW_THROW(ValueError, "out of range", l.index(400));
  EXPECT_SW_THROW(ValueError, "out of range", l.index(-5));
  EXPECT_SW_THROW(ValueError, "out of range", l.index(T({0, T({0, 4})})));
  EXPECT_SW_THROW(ValueError, "out of range", l.index(T({0, 80})));
}

TEST(LayoutErrors, MismatchedHierarchies) {
  const Shape s = Shape::of({5, T({20, 4})});
  EXPECT_SW_THROW(ValueError, "does not match the hierarchy", s.encode(T({T({1, 2}), 0})));
  EXPECT_SW_THROW(ValueError, "does not match the hierarchy", s.encode(T({T({}), 0})));
  EXPECT_SW_THROW(ValueError, "has 3 modes", s.encode(T({1, 2, 3})));
  EXPECT_SW_THROW(ValueError, "has 1 modes", s.encode(T({1})));
  EXPECT_SW_THROW(ValueError, "has 3 modes", s.encode(T({1, T({2, 3, 0})})));
  EXPECT_SW_THROW(ValueError, "has 0 modes", s.encode(T({})));
  const Layout l(s, Stride::of({1, T({5, 100})}));
  EXPECT_SW_THROW(ValueError, "does not match the hierarchy", l.index(T({T({1, 2}), 0})));
  EXPECT_SW_THROW(ValueError, "has 3 modes", l.index(T({1, 2, 3})));
  EXPECT_SW_THROW(ValueError, "has 1 modes", l.index(T({1, T({2})})));
}

TEST(LayoutErrors, ModeOutOfRange) {
  const Shape s = Shape::of({5, T({20, 4})});
  EXPECT_SW_THROW(IndexError, "mode 2 is out of range", s.mode(2));
  EXPECT_SW_THROW(IndexError, "mode 2 is out of range", Stride::of({1, T({5, 100})}).mode(2));
  EXPECT_SW_THROW(IndexError, "mode 2 is out of range", Layout(s, Stride::of({1, T({5, 100})})).mode(2));
  EXPECT_SW_THROW(IndexError, "out of range", Shape().mode(0));
  EXPECT_NO_THROW(s.mode(1));
}

}  // namespace
}  // namespace sw
