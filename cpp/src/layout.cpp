#include "strideweave/layout.hpp"

#include <algorithm>
#include <limits>
#include <numeric>
#include <unordered_set>

#include "strideweave/errors.hpp"

namespace sw {

namespace {

constexpr int64_t kMaxExtent = int64_t{1} << 62;

int64_t checked_mul(int64_t a, int64_t b, const char* what) {
  int64_t out;
  if (__builtin_mul_overflow(a, b, &out) || out > kMaxExtent)
    raise<ValueError>(what, " exceeds the supported range (2**62)");
  return out;
}

int64_t tree_size(const IntTuple& t) {
  if (t.is_leaf()) return t.value();
  int64_t n = 1;
  for (const auto& c : t.children()) n = checked_mul(n, tree_size(c), "Shape size");
  return n;
}

void check_leaves(const IntTuple& t, int64_t minimum, const char* kind) {
  if (t.is_leaf()) {
    if (t.value() < minimum)
      raise<ValueError>(kind, " entries must be >= ", minimum, ", got ", t.value());
    if (t.value() > kMaxExtent) raise<ValueError>(kind, " entry ", t.value(), " exceeds 2**62");
    return;
  }
  for (const auto& c : t.children()) check_leaves(c, minimum, kind);
}

void hash_combine(size_t& seed, size_t v) { seed ^= v + 0x9e3779b97f4a7c15ULL + (seed << 6) + (seed >> 2); }

// Decodes `ordinal` (in range) over tree `shape` into out.
Coord decode_tree(const IntTuple& shape, int64_t ordinal) {
  if (shape.is_leaf()) return IntTuple(ordinal);
  std::vector<IntTuple> parts;
  parts.reserve(shape.rank());
  for (const auto& mode : shape.children()) {
    int64_t n = tree_size(mode);
    parts.push_back(decode_tree(mode, ordinal % n));
    ordinal /= n;
  }
  return IntTuple::tuple(std::move(parts));
}

// Encodes coord over shape; `path` names the position for errors.
int64_t encode_tree(const IntTuple& shape, const IntTuple& coord) {
  int64_t n = tree_size(shape);
  if (coord.is_leaf()) {
    if (coord.value() < 0 || coord.value() >= n)
      raise<ValueError>("coordinate ", coord.value(), " is out of range for mode ", shape.str(),
                        " of size ", n);
    return coord.value();
  }
  if (shape.is_leaf())
    raise<ValueError>("coordinate ", coord.str(), " does not match the hierarchy: mode ", shape.str(),
                      " is a single extent");
  if (coord.rank() != shape.rank())
    raise<ValueError>("coordinate ", coord.str(), " has ", coord.rank(), " modes but shape ", shape.str(),
                      " has ", shape.rank());
  int64_t ordinal = 0, scale = 1;
  for (size_t k = 0; k < shape.rank(); ++k) {
    ordinal += encode_tree(shape[k], coord[k]) * scale;
    scale *= tree_size(shape[k]);
  }
  return ordinal;
}

// Sum of coordinate times stride for a (validated, full-depth or ordinal) coordinate.
int64_t index_tree(const IntTuple& shape, const IntTuple& stride, const IntTuple& coord) {
  if (shape.is_leaf()) {
    int64_t c = coord.value();  // coord is a leaf here (validated by encode_tree)
    return c * stride.value();
  }
  if (coord.is_leaf()) {  // an ordinal for this subtree
    int64_t ordinal = coord.value();
    int64_t off = 0;
    for (size_t k = 0; k < shape.rank(); ++k) {
      int64_t n = tree_size(shape[k]);
      off += index_tree(shape[k], stride[k], IntTuple(ordinal % n));
      ordinal /= n;
    }
    return off;
  }
  int64_t off = 0;
  for (size_t k = 0; k < shape.rank(); ++k) off += index_tree(shape[k], stride[k], coord[k]);
  return off;
}

// Strides for `target` (a nested mode) refined from one leaf of stride `stride`: the nested mode's leaves in
// colexicographic order, the first fastest (Note [Compatible shapes]).
IntTuple refine_tree(const IntTuple& target, int64_t stride, int64_t& running) {
  if (target.is_leaf()) {
    int64_t s;
    if (__builtin_mul_overflow(stride, running, &s))
      raise<ValueError>("broadcast_to: stride ", stride, " refined into ", target.str(), " overflows 64 bits");
    running *= target.value();  // at most the leaf's extent: no overflow
    return IntTuple(s);
  }
  std::vector<IntTuple> out;
  for (const auto& c : target.children()) out.push_back(refine_tree(c, stride, running));
  return IntTuple::tuple(std::move(out));
}

IntTuple zero_tree(const IntTuple& target) {
  if (target.is_leaf()) return IntTuple(int64_t{0});
  std::vector<IntTuple> out;
  for (const auto& c : target.children()) out.push_back(zero_tree(c));
  return IntTuple::tuple(std::move(out));
}

// `self` and `want` (the whole shapes) only name the shapes in error messages;
// they are turned into text only when an error is raised.
IntTuple broadcast_tree(const IntTuple& shape, const IntTuple& stride, const IntTuple& target,
                        const Shape& self, const Shape& want) {
  if (shape.is_leaf() && !target.is_leaf()) {  // Note [Compatible shapes]
    const int64_t n = tree_size(target);
    if (shape.value() == n) {
      int64_t running = 1;
      return refine_tree(target, stride.value(), running);
    }
    if (shape.value() == 1) return zero_tree(target);
    raise<ValueError>("cannot broadcast layout shape ", self.str(), " to ", want.str(), ": extent ", shape.value(),
                      " is neither 1 nor the size ", n, " of ", target.str());
  }
  if (shape.is_leaf() != target.is_leaf() || (!shape.is_leaf() && shape.rank() != target.rank()))
    raise<ValueError>("cannot broadcast layout shape ", self.str(), " to ", want.str(),
                      ": the hierarchies differ (broadcast_to never inserts, removes or reorders modes, nor merges "
                      "a nested mode into one leaf)");
  if (shape.is_leaf()) {
    if (shape.value() == target.value()) return stride;
    if (shape.value() == 1) return IntTuple(int64_t{0});
    raise<ValueError>("cannot broadcast layout shape ", self.str(), " to ", want.str(), ": extent ", shape.value(),
                      " is neither 1 nor ", target.value());
  }
  std::vector<IntTuple> out;
  for (size_t k = 0; k < shape.rank(); ++k)
    out.push_back(broadcast_tree(shape[k], stride[k], target[k], self, want));
  return IntTuple::tuple(std::move(out));
}

// refine_shape's tree: nullopt where the hierarchies cannot meet.
std::optional<IntTuple> refine_tree_shape(const IntTuple& coarse, const IntTuple& fine) {
  if (coarse.is_leaf() && !fine.is_leaf()) {
    const int64_t n = tree_size(fine);
    if (coarse.value() == n) return fine;
    if (coarse.value() == 1) {
      std::vector<IntTuple> ones;
      for (const auto& c : fine.children()) ones.push_back(*refine_tree_shape(IntTuple(int64_t{1}), c));
      return IntTuple::tuple(std::move(ones));
    }
    return coarse;  // a leaf that broadcasts to no nested mode: left for the caller's own check
  }
  if (coarse.is_leaf()) return coarse;
  if (fine.is_leaf() || coarse.rank() != fine.rank()) return std::nullopt;
  std::vector<IntTuple> out;
  for (size_t k = 0; k < coarse.rank(); ++k) {
    std::optional<IntTuple> c = refine_tree_shape(coarse[k], fine[k]);
    if (!c) return std::nullopt;
    out.push_back(std::move(*c));
  }
  return IntTuple::tuple(std::move(out));
}

IntTuple dense_tree(const IntTuple& shape, int64_t& running, bool reversed) {
  if (shape.is_leaf()) {
    IntTuple s(running);
    running *= shape.value();
    return s;
  }
  std::vector<IntTuple> out(shape.rank());
  for (size_t i = 0; i < shape.rank(); ++i) {
    size_t k = reversed ? shape.rank() - 1 - i : i;
    out[k] = dense_tree(shape[k], running, reversed);
  }
  return IntTuple::tuple(std::move(out));
}

}  // namespace

// ---------------------------------------------------------------- IntTuple

IntTuple IntTuple::tuple(std::vector<IntTuple> children) {
  IntTuple t;
  if (!children.empty()) t.children_ = std::make_shared<const std::vector<IntTuple>>(std::move(children));
  return t;
}

const std::vector<IntTuple>& IntTuple::kids() const noexcept {
  static const std::vector<IntTuple> none;
  return children_ ? *children_ : none;
}

int64_t IntTuple::value() const {
  SW_ASSERT(leaf_, "value() of a tuple node");
  return value_;
}

const std::vector<IntTuple>& IntTuple::children() const {
  SW_ASSERT(!leaf_, "children() of a leaf node");
  return kids();
}

size_t IntTuple::rank() const {
  SW_ASSERT(!leaf_, "rank() of a leaf node");
  return kids().size();
}

const IntTuple& IntTuple::operator[](size_t k) const {
  SW_ASSERT(!leaf_ && k < kids().size(), "child ", k, " of ", str());
  return kids()[k];
}

void IntTuple::append_leaves(std::vector<int64_t>& out) const {
  if (leaf_) {
    out.push_back(value_);
    return;
  }
  for (const auto& c : kids()) c.append_leaves(out);
}

std::vector<int64_t> IntTuple::leaves() const {
  std::vector<int64_t> out;
  append_leaves(out);
  return out;
}

size_t IntTuple::leaf_count() const {
  if (leaf_) return 1;
  size_t n = 0;
  for (const auto& c : kids()) n += c.leaf_count();
  return n;
}

bool IntTuple::congruent(const IntTuple& o) const {
  if (leaf_ != o.leaf_) return false;
  if (leaf_) return true;
  if (kids().size() != o.kids().size()) return false;
  for (size_t k = 0; k < kids().size(); ++k)
    if (!kids()[k].congruent(o.kids()[k])) return false;
  return true;
}

int IntTuple::depth() const {
  if (leaf_) return 0;
  int d = 0;
  for (const auto& c : kids()) d = std::max(d, c.depth() + 1);
  return kids().empty() ? 0 : d;
}

bool IntTuple::operator==(const IntTuple& o) const {
  if (leaf_ != o.leaf_) return false;
  return leaf_ ? value_ == o.value_ : (children_ == o.children_ || kids() == o.kids());
}

size_t IntTuple::hash() const noexcept {
  if (leaf_) return std::hash<int64_t>{}(value_) * 31 + 7;
  size_t seed = 0x51ed270b + kids().size();
  for (const auto& c : kids()) hash_combine(seed, c.hash());
  return seed;
}

std::string IntTuple::str() const {
  if (leaf_) return std::to_string(value_);
  std::string s = "(";
  for (size_t k = 0; k < kids().size(); ++k) {
    if (k) s += ",";
    s += kids()[k].str();
  }
  return s + ")";
}

// ---------------------------------------------------------------- Shape

Shape::Shape(IntTuple modes) : tree_(std::move(modes)) {
  SW_ASSERT(!tree_.is_leaf(), "a Shape's top level is a mode list");
  check_leaves(tree_, 1, "Shape");
  size_ = tree_size(tree_);
}

Shape Shape::flat(const std::vector<int64_t>& extents) {
  std::vector<IntTuple> modes(extents.begin(), extents.end());
  return Shape(IntTuple::tuple(std::move(modes)));
}

std::vector<int64_t> Shape::extents() const {
  std::vector<int64_t> out;
  for (const auto& m : tree_.children()) out.push_back(tree_size(m));
  return out;
}

Shape Shape::mode(size_t k) const {
  if (k >= rank()) raise<IndexError>("mode ", k, " is out of range for Shape ", str(), " of rank ", rank());
  const IntTuple& m = tree_[k];
  return m.is_leaf() ? Shape(IntTuple::tuple({m})) : Shape(m);
}

Coord Shape::decode(int64_t ordinal) const {
  if (ordinal < 0 || ordinal >= size_)
    raise<ValueError>("ordinal ", ordinal, " is out of range for Shape ", str(), " of size ", size_);
  return decode_tree(tree_, ordinal);
}

int64_t Shape::encode(const Coord& coord) const { return encode_tree(tree_, coord); }

// ---------------------------------------------------------------- Stride

Stride::Stride(IntTuple modes) : tree_(std::move(modes)) {
  SW_ASSERT(!tree_.is_leaf(), "a Stride's top level is a mode list");
  check_leaves(tree_, 0, "Stride");
}

Stride Stride::flat(const std::vector<int64_t>& strides) {
  std::vector<IntTuple> modes(strides.begin(), strides.end());
  return Stride(IntTuple::tuple(std::move(modes)));
}

Stride Stride::mode(size_t k) const {
  if (k >= rank()) raise<IndexError>("mode ", k, " is out of range for Stride ", str(), " of rank ", rank());
  const IntTuple& m = tree_[k];
  return m.is_leaf() ? Stride(IntTuple::tuple({m})) : Stride(m);
}

// ---------------------------------------------------------------- FlatLayout

int64_t FlatLayout::size() const {
  int64_t n = 1;
  for (auto e : extents) n *= e;
  return n;
}

int64_t FlatLayout::index(int64_t ordinal) const {
  int64_t off = 0;
  for (size_t j = 0; j < extents.size(); ++j) {
    off += (ordinal % extents[j]) * strides[j];
    ordinal /= extents[j];
  }
  return off;
}

// ---------------------------------------------------------------- Layout

Layout::Layout() {
  static const auto empty = std::make_shared<const Data>();
  d_ = empty;
}

Layout::Layout(Shape shape, Stride stride) {
  auto d = std::make_shared<Data>();
  d->shape = std::move(shape);
  d->stride = std::move(stride);
  if (!d->shape.tree().congruent(d->stride.tree()))
    raise<ValueError>("Layout shape ", d->shape.str(), " and stride ", d->stride.str(), " are not congruent");
  d->flat.extents = d->shape.tree().leaves();
  d->flat.strides = d->stride.tree().leaves();
  int64_t last = 0;
  for (size_t j = 0; j < d->flat.extents.size(); ++j) {
    // Each term is <= 2**62 and `last` stays < 2**62, so the sum cannot overflow int64.
    last += checked_mul(d->flat.extents[j] - 1, d->flat.strides[j], "Layout cosize");
    if (last >= kMaxExtent) raise<ValueError>("Layout cosize exceeds the supported range (2**62)");
  }
  d->cosize = last + 1;
  int64_t expect = 1, running = 1;
  for (size_t j = 0; j < d->flat.extents.size(); ++j) {
    if (d->flat.strides[j] != running) d->column_major = false;
    running *= d->flat.extents[j];
    if (d->flat.extents[j] == 1) continue;
    if (d->flat.strides[j] != expect) d->contiguous = false;
    expect *= d->flat.extents[j];
  }
  d_ = std::move(d);
}

Layout Layout::mode(size_t k) const {
  if (k >= rank()) raise<IndexError>("mode ", k, " is out of range for Layout ", str(), " of rank ", rank());
  return Layout(d_->shape.mode(k), d_->stride.mode(k));
}

int64_t Layout::index(int64_t ordinal) const {
  if (ordinal < 0 || ordinal >= size())
    raise<ValueError>("ordinal ", ordinal, " is out of range for Layout ", str(), " of size ", size());
  return d_->flat.index(ordinal);
}

int64_t Layout::index(const Coord& coord) const {
  if (coord.is_leaf()) return index(coord.value());
  d_->shape.encode(coord);  // validates hierarchy and ranges
  return index_tree(d_->shape.tree(), d_->stride.tree(), coord);
}

bool Layout::is_injective() const {
  // Leaves that take more than one value.
  std::vector<std::pair<int64_t, int64_t>> live;  // (stride, extent)
  for (size_t j = 0; j < d_->flat.extents.size(); ++j) {
    if (d_->flat.extents[j] == 1) continue;
    if (d_->flat.strides[j] == 0) return false;
    live.emplace_back(d_->flat.strides[j], d_->flat.extents[j]);
  }
  if (size() > d_->cosize) return false;  // pigeonhole
  // Sufficient condition: sorted by stride, each stride exceeds the span of the smaller ones.
  std::sort(live.begin(), live.end());
  int64_t span = 0;  // largest offset reachable by the leaves so far
  bool nested = true;
  for (auto [s, e] : live) {
    if (s <= span) {
      nested = false;
      break;
    }
    span += (e - 1) * s;
  }
  if (nested) return true;
  // Exact answer by enumeration of the image.
  const int64_t n = size();
  if (d_->cosize <= (int64_t{1} << 31)) {
    std::vector<bool> seen(static_cast<size_t>(d_->cosize), false);
    for (int64_t i = 0; i < n; ++i) {
      int64_t off = d_->flat.index(i);
      if (seen[off]) return false;
      seen[off] = true;
    }
    return true;
  }
  std::unordered_set<int64_t> seen;
  seen.reserve(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i)
    if (!seen.insert(d_->flat.index(i)).second) return false;
  return true;
}

Layout Layout::broadcast_to(const Shape& target) const {
  return Layout(target, Stride(broadcast_tree(d_->shape.tree(), d_->stride.tree(), target.tree(), d_->shape, target)));
}

std::vector<Run> Layout::runs() const {
  // Coalesce leaves: drop extent-1 leaves, merge j and j+1 when stride_{j+1} == e_j * s_j.
  std::vector<int64_t> ext, str;
  for (size_t j = 0; j < d_->flat.extents.size(); ++j) {
    if (d_->flat.extents[j] == 1) continue;
    if (!ext.empty() && d_->flat.strides[j] == ext.back() * str.back()) {
      ext.back() *= d_->flat.extents[j];
      continue;
    }
    ext.push_back(d_->flat.extents[j]);
    str.push_back(d_->flat.strides[j]);
  }
  int64_t run = 1;
  size_t first = 0;
  if (!ext.empty() && str[0] == 1) {
    run = ext[0];
    first = 1;
  }
  const int64_t n = size();
  std::vector<Run> out;
  out.reserve(static_cast<size_t>(n / run));
  std::vector<int64_t> c(ext.size(), 0);
  int64_t off = 0;
  for (int64_t ord = 0; ord < n; ord += run) {
    out.push_back(Run{ord, off, run});
    for (size_t j = first; j < ext.size(); ++j) {  // odometer over the outer leaves
      off += str[j];
      if (++c[j] < ext[j]) break;
      off -= str[j] * ext[j];
      c[j] = 0;
    }
  }
  return out;
}


std::optional<std::pair<int64_t, int64_t>> Layout::mode_as_leaf(size_t k) const {
  const Layout m = mode(k);  // keep it alive: flat() refers into it
  const FlatLayout& f = m.flat();
  int64_t extent = 1, stride = 0;
  bool have = false;
  for (size_t j = 0; j < f.extents.size(); ++j) {
    if (f.extents[j] == 1) continue;
    if (!have) {
      extent = f.extents[j];
      stride = f.strides[j];
      have = true;
    } else if (f.strides[j] == extent * stride) {
      extent *= f.extents[j];
    } else {
      return std::nullopt;
    }
  }
  return std::make_pair(extent, stride);
}

size_t Layout::hash() const noexcept {
  size_t seed = d_->shape.hash();
  hash_combine(seed, d_->stride.hash());
  return seed;
}

std::string Layout::str() const { return d_->shape.str() + ":" + d_->stride.str(); }

std::optional<Shape> refine_shape(const Shape& coarse, const Shape& fine) {
  std::optional<IntTuple> t = refine_tree_shape(coarse.tree(), fine.tree());
  if (!t) return std::nullopt;
  return Shape(std::move(*t));
}

Layout column_major(const Shape& shape) {
  int64_t running = 1;
  return Layout(shape, Stride(dense_tree(shape.tree(), running, false)));
}

Layout row_major(const Shape& shape) {
  int64_t running = 1;
  return Layout(shape, Stride(dense_tree(shape.tree(), running, true)));
}

}  // namespace sw
