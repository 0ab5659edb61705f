// Views with autograd (strideweave/views.hpp): narrow, chunk, permute and reshape as layouts over the base's
// carrier, the one copying case of reshape, and the view nodes' VJPs.
#include "strideweave/views.hpp"

#include <algorithm>
#include <array>
#include <cstring>
#include <functional>
#include <numeric>
#include <optional>
#include <string>

#include "strided.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"

namespace sw {

namespace {

std::string extents_str(const std::vector<int64_t>& e) {
  std::string s = "(";
  for (size_t i = 0; i < e.size(); ++i) s += (i ? ", " : "") + std::to_string(e[i]);
  return s + ")";
}

// ---------------------------------------------------------------- copying values between layouts

// Copies the elements of a layout with leaves `extents` in ordinal order: from `src` (strides `ss`, offset `so`)
// to `dst` (strides `ds`, offset `dof`), elements of `w` bytes; one memcpy per run where both are contiguous.
template <class T>
void copy_elements(const std::byte* src, const std::vector<int64_t>& ss, int64_t so, std::byte* dst,
                   const std::vector<int64_t>& ds, int64_t dof, const std::vector<int64_t>& extents, int64_t n) {
  std::array<const std::vector<int64_t>*, 2> strides{&ds, &ss};
  auto plan = detail::StridedPlan<2>::make(extents, strides, {dof, so});
  const T* s = reinterpret_cast<const T*>(src);
  T* d = reinterpret_cast<T*>(dst);
  const size_t L = plan.extents.size();
  if (L >= 2 && ((plan.strides[0][0] == 1 && plan.strides[1][1] == 1) || (plan.strides[0][1] == 1 && plan.strides[1][0] == 1))) {
    // A transposition of the two fastest leaves (each side contiguous along another one): copied in square blocks
    // (the outer leaves by an odometer), so that each cache line of the strided side is used whole rather than
    // for one element.
    constexpr int64_t kBlock = 64;
    const int64_t n0 = plan.extents[0], n1 = plan.extents[1];
    const std::array<int64_t, 2> s0 = plan.strides[0], s1 = plan.strides[1];
    std::vector<int64_t> c(L, 0);
    std::array<int64_t, 2> base = plan.base;
    for (int64_t o = 0, outer = plan.size / (n0 * n1); o < outer; ++o) {
      for (int64_t i1 = 0; i1 < n1; i1 += kBlock)
        for (int64_t i0 = 0; i0 < n0; i0 += kBlock)
          for (int64_t b = i1, e1 = std::min(n1, i1 + kBlock); b < e1; ++b) {
            T* dd = d + base[0] + b * s1[0];
            const T* ss = s + base[1] + b * s1[1];
            for (int64_t a = i0, e0 = std::min(n0, i0 + kBlock); a < e0; ++a) dd[a * s0[0]] = ss[a * s0[1]];
          }
      for (size_t j = 2; j < L; ++j) {  // the odometer of the outer leaves
        for (size_t k = 0; k < 2; ++k) base[k] += plan.strides[j][k];
        if (++c[j] < plan.extents[j]) break;
        for (size_t k = 0; k < 2; ++k) base[k] -= plan.strides[j][k] * plan.extents[j];
        c[j] = 0;
      }
    }
    return;
  }
  plan.for_each_run(0, n, [&](int64_t, const std::array<int64_t, 2>& off, int64_t count,
                              const std::array<int64_t, 2>& st) {
    if (st[0] == 1 && st[1] == 1) {
      std::memcpy(d + off[0], s + off[1], static_cast<size_t>(count) * sizeof(T));
      return;
    }
    for (int64_t i = 0; i < count; ++i) d[off[0] + i * st[0]] = s[off[1] + i * st[1]];
  });
}

// `native` (t's carrier's memory, slots from t.offset) or, when null, a bounce copy of t's span
// [offset, offset + cosize) read in one call (slots from 0); `at` is where t's slots start in what is returned.
template <class Ptr>
Ptr slots_of(const TensorImpl& t, Ptr native, std::vector<std::byte>& bounce, int64_t& at) {
  at = t.offset;
  if (native) return native;
  bounce.resize(static_cast<size_t>(t.layout.cosize()) * slot_bytes(t.dtype()));
  t.carrier->read_slots(t.offset, t.layout.cosize(), bounce.data());
  at = 0;
  return bounce.data();
}

// Writes the values of `src` into `dst` (a tensor of the same leaf extents and dtype on any carrier): in place
// in native memory, else through one bulk read of each side's span and one bulk write of the destination's.
void copy_values(const TensorImpl& src, TensorImpl& dst) {
  SW_ASSERT(src.layout.flat().extents == dst.layout.flat().extents && src.dtype() == dst.dtype(),
            "copy_values between tensors of different leaves or dtypes");
  const size_t w = slot_bytes(src.dtype());
  std::vector<std::byte> src_bounce, dst_bounce;
  int64_t so = 0, dof = 0;
  const std::byte* s = slots_of(src, src.carrier->native_data(), src_bounce, so);
  std::byte* d = slots_of(dst, dst.carrier->mutable_native_data(), dst_bounce, dof);
  const auto& ext = src.layout.flat().extents;
  const auto& ss = src.layout.flat().strides;
  const auto& ds = dst.layout.flat().strides;
  const int64_t n = src.size();
  switch (w) {
    case 1: copy_elements<uint8_t>(s, ss, so, d, ds, dof, ext, n); break;
    case 2: copy_elements<uint16_t>(s, ss, so, d, ds, dof, ext, n); break;
    case 4: copy_elements<uint32_t>(s, ss, so, d, ds, dof, ext, n); break;
    case 8: copy_elements<uint64_t>(s, ss, so, d, ds, dof, ext, n); break;
    default: SW_ASSERT(false, "copy_values: element width ", w);
  }
  if (!dst_bounce.empty()) dst.carrier->write_slots(dst.offset, dst.layout.cosize(), dst_bounce.data());
}

// A fresh dense (column-major) copy of `t` on its own carrier kind, dtype kept.
TensorPtr dense_copy(const TensorPtr& t) {
  TensorPtr out = dense_result(*t->carrier, t->layout.shape(), t->dtype());
  copy_values(*t, *out);
  return out;
}

// ---------------------------------------------------------------- layouts of the views

// Note [Narrowing a nested mode]: a top-level mode that is a tuple (c_0, ..., c_m) is ordered c_0 fastest. Its
// ordinals [start, start + length) are one layout when they are whole blocks of the slowest child (start and
// length multiples of inner = size(c_0 .. c_{m-1}): narrow c_m by start / inner, length / inner, the others
// kept), or lie within one block of it (fix c_m at start / inner and narrow the tuple of the rest). Otherwise a
// mode whose leaves coalesce into one (extent, stride) is narrowed as that leaf; any other range has no layout.
bool narrow_children(const std::vector<IntTuple>& sh, const std::vector<IntTuple>& st, size_t m, int64_t start,
                     int64_t length, std::vector<IntTuple>& out_sh, std::vector<IntTuple>& out_st, int64_t& delta);

bool narrow_node(const IntTuple& sh, const IntTuple& st, int64_t start, int64_t length, IntTuple& out_sh,
                 IntTuple& out_st, int64_t& delta) {
  if (sh.is_leaf()) {
    out_sh = IntTuple(length);
    out_st = IntTuple(st.value());
    delta += start * st.value();
    return true;
  }
  if (sh.rank() == 0) {  // an empty tuple: one ordinal
    out_sh = sh;
    out_st = st;
    return true;
  }
  std::vector<IntTuple> osh, ost;
  if (!narrow_children(sh.children(), st.children(), sh.rank(), start, length, osh, ost, delta)) return false;
  if (osh.size() == 1) {
    out_sh = osh[0];
    out_st = ost[0];
  } else {
    out_sh = IntTuple::tuple(std::move(osh));
    out_st = IntTuple::tuple(std::move(ost));
  }
  return true;
}

bool narrow_children(const std::vector<IntTuple>& sh, const std::vector<IntTuple>& st, size_t m, int64_t start,
                     int64_t length, std::vector<IntTuple>& out_sh, std::vector<IntTuple>& out_st, int64_t& delta) {
  if (m == 1) {
    IntTuple a, b;
    if (!narrow_node(sh[0], st[0], start, length, a, b, delta)) return false;
    out_sh.push_back(a);
    out_st.push_back(b);
    return true;
  }
  int64_t inner = 1;
  for (size_t i = 0; i + 1 < m; ++i) inner *= Shape(IntTuple::tuple({sh[i]})).size();
  const IntTuple& last_sh = sh[m - 1];
  const IntTuple& last_st = st[m - 1];
  if (start % inner == 0 && length % inner == 0) {
    IntTuple a, b;
    if (!narrow_node(last_sh, last_st, start / inner, length / inner, a, b, delta)) return false;
    out_sh.assign(sh.begin(), sh.begin() + static_cast<std::ptrdiff_t>(m - 1));
    out_st.assign(st.begin(), st.begin() + static_cast<std::ptrdiff_t>(m - 1));
    out_sh.push_back(a);
    out_st.push_back(b);
    return true;
  }
  if (start / inner != (start + length - 1) / inner) return false;
  delta += Layout(Shape(IntTuple::tuple({last_sh})), Stride(IntTuple::tuple({last_st}))).index(start / inner);
  return narrow_children(sh, st, m - 1, start % inner, length, out_sh, out_st, delta);
}

// The rank and mode checks shared by narrow and chunk (IndexError).
size_t checked_mode(const char* op, const TensorImpl& t, int64_t mode) {
  const int64_t rank = static_cast<int64_t>(t.layout.rank());
  if (mode < 0 || mode >= rank)
    raise<IndexError>(op, ": mode ", mode, " is out of range for a tensor of ", rank, " mode", rank == 1 ? "" : "s",
                      " (shape ", t.layout.shape().str(), ")");
  return static_cast<size_t>(mode);
}

// The layout and offset of ordinals [start, start + length) of mode k (checked by the caller).
std::pair<Layout, int64_t> narrow_layout(const char* op, const TensorImpl& t, size_t k, int64_t start, int64_t length) {
  const IntTuple& sh = t.layout.shape().tree();
  const IntTuple& st = t.layout.stride().tree();
  IntTuple msh, mst;
  int64_t delta = 0;
  if (!narrow_node(sh[k], st[k], start, length, msh, mst, delta)) {
    const auto leaf = t.layout.mode_as_leaf(k);
    if (!leaf)
      raise<ValueError>(op, ": ordinals [", start, ", ", start + length, ") of nested mode ", k, " ",
                        t.layout.shape().mode(k).str(), " (strides ", t.layout.stride().mode(k).str(),
                        ") are not one layout: they are neither whole blocks of its slowest child nor within one "
                        "(reshape the mode to one extent first)");
    delta = start * leaf->second;
    msh = IntTuple(length);
    mst = IntTuple(leaf->second);
  }
  std::vector<IntTuple> shs = sh.children(), sts = st.children();
  shs[k] = msh;
  sts[k] = mst;
  return {Layout(Shape(IntTuple::tuple(std::move(shs))), Stride(IntTuple::tuple(std::move(sts)))), delta};
}

// Note [Reshape without a copy]: the base's leaves in ordinal (colex) order, extent-1 leaves dropped and
// neighbours merged where one continues the other (stride_{j+1} == extent_j * stride_j), are runs of
// arithmetic progressions. The target's leaves, also in colex order, are a view exactly when each one lies
// inside one such progression: it takes the progression's current stride and consumes `extent` of it, which
// needs the extent to divide what is left of the progression. A target leaf that would straddle two
// progressions (or not divide one) has no stride: then reshape copies the values into a fresh dense tensor of
// the same kind (column-major, so any shape over it is a view) and says so through reshape_is_view. Extent-1
// target leaves take the progression's current stride, so a column-major base gives a column-major view.
std::optional<Layout> reshape_layout(const Layout& in, const Shape& target) {
  struct Prog {
    int64_t extent, stride;
  };
  std::vector<Prog> progs;
  const FlatLayout& f = in.flat();
  for (size_t j = 0; j < f.extents.size(); ++j) {
    if (f.extents[j] == 1) continue;
    if (!progs.empty() && f.strides[j] == progs.back().extent * progs.back().stride) progs.back().extent *= f.extents[j];
    else progs.push_back({f.extents[j], f.strides[j]});
  }
  size_t i = 0;
  int64_t rem = progs.empty() ? 1 : progs[0].extent, stride = progs.empty() ? 1 : progs[0].stride;
  std::vector<int64_t> strides;
  for (int64_t e : target.leaves()) {
    if (e != 1) {
      while (rem == 1 && i + 1 < progs.size()) {
        ++i;
        rem = progs[i].extent;
        stride = progs[i].stride;
      }
      if (rem % e != 0) return std::nullopt;
      rem /= e;
    }
    strides.push_back(stride);
    if (e != 1) stride *= e;
  }
  size_t next = 0;
  std::function<IntTuple(const IntTuple&)> congruent = [&](const IntTuple& node) -> IntTuple {
    if (node.is_leaf()) return IntTuple(strides[next++]);
    std::vector<IntTuple> kids;
    for (const IntTuple& c : node.children()) kids.push_back(congruent(c));
    return IntTuple::tuple(std::move(kids));
  };
  return Layout(target, Stride(congruent(target.tree())));
}

// ---------------------------------------------------------------- nodes

enum class ViewKind : uint8_t { Identity, Narrow, Permute, Reshape };

struct ViewNode final : Node {
  ViewKind kind = ViewKind::Identity;
  Shape base_shape;                   // narrow, reshape: the input's shape
  size_t mode = 0;                    // narrow
  int64_t start = 0;                  // narrow
  std::vector<int64_t> inverse;       // permute: result mode of each input mode
  std::vector<TensorPtr> apply(const TensorPtr& g) override {
    switch (kind) {
      case ViewKind::Identity: return {g};
      case ViewKind::Permute: {
        std::vector<size_t> order(inverse.begin(), inverse.end());
        return {permute_modes(g, order)};
      }
      case ViewKind::Reshape: {
        GradModeGuard off(false);
        return {reshape(g, base_shape)};
      }
      case ViewKind::Narrow: {
        // The cotangent placed in a zero gradient of the base's shape (g's kind and dtype): one pass over the
        // gradient's own values, the rest zeros.
        TensorPtr full = dense_result(*g->carrier, base_shape, g->dtype());
        const int64_t n = base_shape.size();
        const size_t w = slot_bytes(g->dtype());
        if (std::byte* d = full->carrier->mutable_native_data()) {
          std::memset(d, 0, static_cast<size_t>(n) * w);
        } else {
          std::vector<std::byte> zeros(static_cast<size_t>(n) * w);
          full->carrier->write_slots(0, n, zeros.data());
        }
        auto [layout, delta] = narrow_layout("narrow", *full, mode, start, g->layout.shape().extents()[mode]);
        TensorPtr region = make_tensor(full->carrier, delta, layout);
        copy_values(*g, *region);
        return {full};
      }
    }
    return {nullptr};
  }
};

// A kind whose operations take only whole tensors (TiledEvictable) has no view but the identity: TypeError.
void check_kind_has_views(const char* op, const TensorImpl& t, const Shape& shape) {
  if (OpBackend* b = backend_for(t.carrier->kind()); b && b->materializes())
    raise<TypeError>(op, ": a ", t.carrier->kind_name(), " tensor has no views but itself: its operations and "
                     "projections take the whole logical tensor, whose tile footprints a tensor of shape ",
                     shape.str(), " cannot match; project the tiles first and view the dense result "
                     "(docs/guide.md, \"Views\")");
}

// The view `layout` at `offset` over t's carrier, with its node when autograd records one.
TensorPtr make_view(const char* op, const TensorPtr& t, Layout layout, int64_t offset,
                    const std::shared_ptr<ViewNode>& node) {
  const bool identity = offset == t->offset && layout == t->layout;
  if (!identity) check_kind_has_views(op, *t, layout.shape());
  TensorPtr out = make_tensor(t->carrier, offset, std::move(layout));
  std::vector<TensorPtr> inputs{t};
  if (should_record(inputs, out)) {
    if (identity) node->kind = ViewKind::Identity;
    node->name = op;
    node->dispatch_kind = &t->carrier->kind();
    node->inputs = std::move(inputs);
    attach_node(node, out);
  }
  return out;
}

void check_view_input(const char* op, const TensorPtr& t) {
  if (!t) raise<TypeError>(op, ": the operand must be a Tensor");
  t->carrier->check_live(op);
}

TensorPtr narrow_as(const char* op, const TensorPtr& t, size_t k, int64_t start, int64_t length) {
  auto [layout, delta] = narrow_layout(op, *t, k, start, length);
  auto node = std::make_shared<ViewNode>();
  node->kind = ViewKind::Narrow;
  node->base_shape = t->layout.shape();
  node->mode = k;
  node->start = start;
  return make_view(op, t, std::move(layout), t->offset + delta, node);
}

}  // namespace

TensorPtr narrow(const TensorPtr& t, int64_t mode, int64_t start, int64_t length) {
  check_view_input("narrow", t);
  const size_t k = checked_mode("narrow", *t, mode);
  const int64_t extent = t->layout.shape().extents()[k];
  if (length < 1) raise<ValueError>("narrow: length must be >= 1, got ", length);
  if (start < 0 || start >= extent || length > extent - start) {
    int64_t end;  // start + length for the message, saturated: a hostile length must not overflow
    if (__builtin_add_overflow(start, length, &end)) end = INT64_MAX;
    raise<IndexError>("narrow: ordinals [", start, ", ", end, ") are out of range for mode ", k,
                      " of extent ", extent, " (shape ", t->layout.shape().str(), ")");
  }
  return narrow_as("narrow", t, k, start, length);
}

std::vector<TensorPtr> chunk(const TensorPtr& t, int64_t n, int64_t mode) {
  check_view_input("chunk", t);
  const size_t k = checked_mode("chunk", *t, mode);
  if (n < 1) raise<ValueError>("chunk: the number of chunks must be >= 1, got ", n);
  const int64_t extent = t->layout.shape().extents()[k];
  const int64_t size = extent / n + (extent % n != 0);  // ceil(extent / n), with no overflow for a huge n
  // Every piece's layout first: an inexpressible piece raises before any view exists.
  for (int64_t s = 0; s < extent; s += size) narrow_layout("chunk", *t, k, s, std::min(size, extent - s));
  std::vector<TensorPtr> out;
  for (int64_t s = 0; s < extent; s += size) out.push_back(narrow_as("chunk", t, k, s, std::min(size, extent - s)));
  return out;
}

TensorPtr permute(const TensorPtr& t, const std::vector<int64_t>& order) {
  check_view_input("permute", t);
  const size_t rank = t->layout.rank();
  std::vector<int64_t> inverse(rank, -1);
  bool ok = order.size() == rank;
  for (size_t i = 0; ok && i < order.size(); ++i) {
    const int64_t m = order[i];
    ok = m >= 0 && m < static_cast<int64_t>(rank) && inverse[static_cast<size_t>(m)] < 0;
    if (ok) inverse[static_cast<size_t>(m)] = static_cast<int64_t>(i);
  }
  if (!ok)
    raise<ValueError>("permute: order ", extents_str(order), " is not a permutation of the ", rank, " modes of shape ",
                      t->layout.shape().str());
  std::vector<size_t> o(order.begin(), order.end());
  TensorPtr view = permute_modes(t, o);
  auto node = std::make_shared<ViewNode>();
  node->kind = ViewKind::Permute;
  node->inverse = std::move(inverse);
  return make_view("permute", t, view->layout, view->offset, node);
}

bool reshape_is_view(const TensorPtr& t, const Shape& shape) {
  check_view_input("reshape", t);
  if (shape.size() != t->size())
    raise<ValueError>("reshape: shape ", shape.str(), " has ", shape.size(), " elements but the tensor (shape ",
                      t->layout.shape().str(), ") has ", t->size());
  return reshape_layout(t->layout, shape).has_value();
}

TensorPtr reshape(const TensorPtr& t, const Shape& shape) {
  const bool view = reshape_is_view(t, shape);
  auto node = std::make_shared<ViewNode>();
  node->kind = ViewKind::Reshape;
  node->base_shape = t->layout.shape();
  if (view) return make_view("reshape", t, *reshape_layout(t->layout, shape), t->offset, node);
  // The layout cannot express it: a fresh dense copy of the same kind, with the same node (its VJP is the
  // reshape back).
  check_kind_has_views("reshape", *t, shape);
  TensorPtr copy = dense_copy(t);
  TensorPtr out = make_tensor(copy->carrier, 0, column_major(shape));
  std::vector<TensorPtr> inputs{t};
  if (should_record(inputs, out)) {
    node->name = "reshape";
    node->dispatch_kind = &t->carrier->kind();
    node->inputs = std::move(inputs);
    attach_node(node, out);
  }
  return out;
}

Shape infer_reshape_extents(const std::vector<int64_t>& extents, int64_t size) {
  int64_t known = 1;
  bool overflow = false;  // the other extents' product beyond int64: it can divide no size
  std::optional<size_t> free;
  for (size_t i = 0; i < extents.size(); ++i) {
    if (extents[i] == -1) {
      if (free) raise<ValueError>("reshape: shape ", extents_str(extents), " has more than one -1");
      free = i;
    } else if (extents[i] < 1) {
      raise<ValueError>("reshape: extents must be >= 1 (or one -1), got ", extents_str(extents));
    } else {
      overflow = overflow || __builtin_mul_overflow(known, extents[i], &known);
    }
  }
  std::vector<int64_t> e = extents;
  if (free) {
    if (overflow)
      raise<ValueError>("reshape: shape ", extents_str(extents), " cannot hold ", size,
                        " elements (the other extents' product exceeds int64)");
    if (size % known != 0)
      raise<ValueError>("reshape: shape ", extents_str(extents), " cannot hold ", size,
                        " elements (the other extents' product ", known, " does not divide it)");
    e[*free] = size / known;
  }
  return Shape::flat(e);
}

TensorPtr reshape(const TensorPtr& t, const std::vector<int64_t>& extents) {
  check_view_input("reshape", t);
  return reshape(t, infer_reshape_extents(extents, t->size()));
}

}  // namespace sw
