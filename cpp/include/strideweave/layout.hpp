// strideweave/layout.hpp — hierarchical (CuTe-style) shapes, strides and layouts.
//
// A Shape is a tree whose leaves are extents >= 1; its top level is always a
// list of modes (rank 0 is the empty list). A Stride has the same tree form
// with leaves >= 0 (0 broadcasts). A Layout pairs congruent trees and maps a
// logical coordinate to a physical slot offset: the sum over leaves of
// coordinate times stride.
//
// Ordering is first-mode-fastest (colexicographic) at every level, so the
// ordinal order of a nested shape equals the colex order of its leaves taken
// depth-first. That makes `FlatLayout` (the leaves in that order) an exact,
// cheap stand-in for the tree on hot paths: decode/index/runs work on flat
// arrays with no recursion.
//
// Coordinates (`IntTuple` used as a coordinate) may give, for any subtree,
// either a nested coordinate or one integer ordinal for that subtree:
//   Shape{5, {20, 4}}.encode((4, (2, 2))) == encode((4, 42)) == encode(214) == 214.
//
// All types are immutable values; every member is thread-safe. Errors:
// ValueError for out-of-range values or mismatched hierarchies.
//
// Example:
//   Layout l(Shape::of({2, IntTuple::tuple({3, 4})}), Stride::of({1, IntTuple::tuple({10, 100})}));
//   l.index(Coord) == 321 for coordinate (1, (2, 3)).
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <string>
#include <vector>

namespace sw {

// One node of a tree of integers: a leaf value or an ordered list of children.
class IntTuple {
 public:
  IntTuple() = default;  // the empty tuple
  IntTuple(int64_t leaf) : leaf_(true), value_(leaf) {}  // NOLINT: implicit leaf
  IntTuple(int leaf) : leaf_(true), value_(leaf) {}      // NOLINT: implicit leaf
  static IntTuple tuple(std::vector<IntTuple> children);
  static IntTuple tuple(std::initializer_list<IntTuple> children) {
    return tuple(std::vector<IntTuple>(children));
  }

  bool is_leaf() const noexcept { return leaf_; }
  int64_t value() const;                           // leaf only
  const std::vector<IntTuple>& children() const;   // tuple only
  size_t rank() const;                             // tuple only: number of children
  const IntTuple& operator[](size_t k) const;      // tuple only
  // Leaves in depth-first order.
  std::vector<int64_t> leaves() const;
  void append_leaves(std::vector<int64_t>& out) const;
  size_t leaf_count() const;
  // Same tree form (ignoring leaf values).
  bool congruent(const IntTuple& other) const;
  int depth() const;  // leaf 0, tuple 1 + max child depth (empty tuple 0)

  bool operator==(const IntTuple& other) const;
  size_t hash() const noexcept;
  // "(2,(3,4))"; a leaf prints as its value.
  std::string str() const;

 private:
  // Children are shared and immutable, so copying a tree is one reference count.
  const std::vector<IntTuple>& kids() const noexcept;
  bool leaf_ = false;
  int64_t value_ = 0;
  std::shared_ptr<const std::vector<IntTuple>> children_;
};

using Coord = IntTuple;

class Shape {
 public:
  Shape() = default;  // rank 0
  // `modes` must be a tuple node; leaves must be >= 1 (ValueError otherwise).
  explicit Shape(IntTuple modes);
  static Shape of(std::initializer_list<IntTuple> modes) { return Shape(IntTuple::tuple(modes)); }
  static Shape flat(const std::vector<int64_t>& extents);

  const IntTuple& tree() const noexcept { return tree_; }
  size_t rank() const noexcept { return tree_.rank(); }
  int64_t size() const noexcept { return size_; }
  std::vector<int64_t> extents() const;  // top-level mode sizes
  int depth() const { return tree_.depth(); }
  // Sub-shape of mode k: a leaf mode e gives Shape(e); a tuple mode its children.
  Shape mode(size_t k) const;
  std::vector<int64_t> leaves() const { return tree_.leaves(); }

  // Colex decode of an ordinal in [0, size) (ValueError otherwise).
  Coord decode(int64_t ordinal) const;
  // Inverse of decode; `coord` may use ordinals for whole subtrees.
  int64_t encode(const Coord& coord) const;

  bool operator==(const Shape& o) const { return tree_ == o.tree_; }
  size_t hash() const noexcept { return tree_.hash(); }
  std::string str() const { return tree_.str(); }

 private:
  IntTuple tree_ = IntTuple::tuple({});
  int64_t size_ = 1;
};

class Stride {
 public:
  Stride() = default;
  explicit Stride(IntTuple modes);  // leaves >= 0
  static Stride of(std::initializer_list<IntTuple> modes) { return Stride(IntTuple::tuple(modes)); }
  static Stride flat(const std::vector<int64_t>& strides);
  const IntTuple& tree() const noexcept { return tree_; }
  size_t rank() const noexcept { return tree_.rank(); }
  Stride mode(size_t k) const;
  bool operator==(const Stride& o) const { return tree_ == o.tree_; }
  size_t hash() const noexcept { return tree_.hash(); }
  std::string str() const { return tree_.str(); }

 private:
  IntTuple tree_ = IntTuple::tuple({});
};

// The leaves of a layout in colex order: ordinal i decodes over `extents`
// first-leaf-fastest and maps to sum(c_j * strides[j]).
struct FlatLayout {
  std::vector<int64_t> extents;
  std::vector<int64_t> strides;
  int64_t size() const;
  int64_t index(int64_t ordinal) const;
};

// A contiguous run of physical slots: logical ordinals [ordinal, ordinal+length)
// map to physical [offset, offset+length).
struct Run {
  int64_t ordinal;
  int64_t offset;
  int64_t length;
};

class Layout {
 public:
  Layout();  // rank 0
  Layout(Shape shape, Stride stride);  // congruent trees (ValueError otherwise)

  const Shape& shape() const noexcept { return d_->shape; }
  const Stride& stride() const noexcept { return d_->stride; }
  int64_t size() const noexcept { return d_->shape.size(); }
  size_t rank() const noexcept { return d_->shape.rank(); }
  int64_t cosize() const noexcept { return d_->cosize; }
  bool is_injective() const;
  Layout mode(size_t k) const;

  int64_t index(int64_t ordinal) const;  // decodes first (ValueError if out of range)
  int64_t index(const Coord& coord) const;

  // Extent-1 leaves become the target extent with stride 0; a leaf meeting a nested mode of the target becomes
  // that mode, refined (its size equal to the leaf's extent) or broadcast (extent 1); nothing else may differ
  // (Note [Compatible shapes]).
  Layout broadcast_to(const Shape& target) const;

  const FlatLayout& flat() const noexcept { return d_->flat; }
  // The layout as maximal contiguous runs in ordinal order (adjacent leaves
  // with stride_{j+1} == extent_j * stride_j and unit leading stride merge).
  std::vector<Run> runs() const;
  // Top-level mode k as one (extent, stride) when its non-trivial leaves coalesce
  // (stride_{j+1} == extent_j * stride_j); a mode of extent 1 gives (1, 0).
  std::optional<std::pair<int64_t, int64_t>> mode_as_leaf(size_t k) const;
  // True when ordinals map to [0, size) in order (stride-1 contiguous).
  bool is_contiguous() const noexcept { return d_->contiguous; }
  // True when every leaf stride is the running product of the extents before
  // it: exactly column_major(shape()).
  bool is_column_major() const noexcept { return d_->column_major; }

  bool operator==(const Layout& o) const {
    return d_ == o.d_ || (d_->shape == o.d_->shape && d_->stride == o.d_->stride);
  }
  size_t hash() const noexcept;
  std::string str() const;  // "(2,(3,4)):(1,(10,100))"

 private:
  // Immutable and shared: copying a Layout (tensors hold one each) is one reference count.
  struct Data {
    Shape shape;
    Stride stride;
    FlatLayout flat;
    int64_t cosize = 1;
    bool contiguous = true;
    bool column_major = true;
  };
  std::shared_ptr<const Data> d_;
};

// Note [Compatible shapes]: a leaf mode of extent n and a nested mode of size n name the same coordinates (the
// nested mode's, in colexicographic order, first leaf fastest, are the leaf's 0 .. n-1), so elementwise
// operations and backward's gradient accept one where the other is expected: broadcasting refines the leaf into
// the nested mode (a view: strides s, s e0, s e0 e1, ...), and a leaf of extent 1 broadcasts to any mode. A
// nested mode is never merged into one leaf by a view (its strides need not coalesce); the result of an operation
// takes the finer profile. refine_shape returns `coarse` with each leaf that meets a nested mode of `fine` replaced
// by that mode (extent equal to its size) or by its structure in extent-1 leaves (extent 1), other leaves as they
// are; nullopt where a nested mode of `coarse` meets a leaf of `fine` or the ranks differ.
std::optional<Shape> refine_shape(const Shape& coarse, const Shape& fine);

// Canonical dense layout: running product of extents, first mode fastest, at every depth.
Layout column_major(const Shape& shape);
// Last mode fastest at every depth: row_major(2, 3, 4) has strides (12, 4, 1).
Layout row_major(const Shape& shape);

}  // namespace sw

template <>
struct std::hash<sw::Shape> {
  size_t operator()(const sw::Shape& s) const noexcept { return s.hash(); }
};
template <>
struct std::hash<sw::Layout> {
  size_t operator()(const sw::Layout& l) const noexcept { return l.hash(); }
};
