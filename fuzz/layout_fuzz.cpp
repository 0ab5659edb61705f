// Layout construction, encode/decode, index/runs and view composition (strideweave/layout.hpp, views.hpp) under
// libFuzzer. The input decodes into a shape tree, a stride tree (usually congruent), coordinates and a chain of
// views; each result is checked against a naive model, not only for crashes (docs/reliability.md,
// "Coverage-guided fuzzing").
#include <algorithm>
#include <functional>
#include <set>
#include <vector>

#include "fuzz_input.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/layout.hpp"
#include "strideweave/tensor.hpp"
#include "strideweave/views.hpp"

using namespace sw;
using fuzz::Input;

namespace {

constexpr auto kValue = {ErrorKind::Value};

IntTuple tree(Input& in, int depth, bool shape) {
  const uint8_t b = in.byte();
  if (depth >= 3 || b % 4 != 0) return IntTuple(shape ? in.extent(6) : in.extent(20));
  std::vector<IntTuple> kids(in.below(4));
  for (auto& k : kids) k = tree(in, depth + 1, shape);
  return IntTuple::tuple(std::move(kids));
}

IntTuple top(Input& in, bool shape) {
  std::vector<IntTuple> modes(in.below(5));
  for (auto& m : modes) m = tree(in, 1, shape);
  return IntTuple::tuple(std::move(modes));
}

// A tree of the form of `t` with fresh leaves.
IntTuple like(const IntTuple& t, Input& in) {
  if (t.is_leaf()) return IntTuple(in.extent(20));
  std::vector<IntTuple> kids;
  for (const auto& k : t.children()) kids.push_back(like(k, in));
  return IntTuple::tuple(std::move(kids));
}

// A coordinate for `s`: per subtree either an ordinal or a nested coordinate (sometimes out of range or malformed).
IntTuple coord(const IntTuple& s, Input& in, int depth) {
  const uint8_t b = in.byte();
  if (s.is_leaf() || b % 3 == 0 || depth > 4) return IntTuple(in.extent(30));
  std::vector<IntTuple> kids;
  for (const auto& k : s.children()) kids.push_back(coord(k, in, depth + 1));
  if (b % 7 == 1) kids.push_back(IntTuple(0));  // one mode too many
  return IntTuple::tuple(std::move(kids));
}

int64_t naive_index(const FlatLayout& f, int64_t o) {
  int64_t at = 0;
  for (size_t j = 0; j < f.extents.size(); ++j) {
    at += (o % f.extents[j]) * f.strides[j];
    o /= f.extents[j];
  }
  return at;
}

void check_layout(const Layout& l, Input& in) {
  const Shape& s = l.shape();
  const int64_t n = l.size();
  const FlatLayout& f = l.flat();
  if (n > 4096) return;  // the model walks every ordinal
  int64_t hi = 0;
  std::set<int64_t> seen;
  bool contiguous = true;
  for (int64_t o = 0; o < n; ++o) {
    const Coord c = s.decode(o);
    FUZZ_CHECK(s.encode(c) == o, "ordinal ", o, " of ", s.str(), " decodes to ", c.str());
    const int64_t at = naive_index(f, o);
    FUZZ_CHECK(l.index(o) == at && l.index(c) == at && f.index(o) == at, l.str(), " ordinal ", o);
    hi = std::max(hi, at);
    seen.insert(at);
    contiguous = contiguous && at == o;
  }
  FUZZ_CHECK(l.cosize() == (n ? hi + 1 : 0) || (n == 0), l.str(), " cosize ", l.cosize());
  FUZZ_CHECK(l.is_injective() == (static_cast<int64_t>(seen.size()) == n), l.str());
  FUZZ_CHECK(l.is_contiguous() == contiguous, l.str());
  FUZZ_CHECK(l.is_column_major() == (l == column_major(s)), l.str());
  // runs: maximal, in ordinal order, covering every ordinal once
  int64_t next = 0;
  for (const Run& r : l.runs()) {
    FUZZ_CHECK(r.ordinal == next && r.length >= 1, l.str(), " run at ", r.ordinal);
    for (int64_t k = 0; k < r.length; ++k) FUZZ_CHECK(naive_index(f, r.ordinal + k) == r.offset + k, l.str());
    next += r.length;
  }
  FUZZ_CHECK(next == n, l.str(), " runs cover ", next);
  // modes
  for (size_t k = 0; k < l.rank(); ++k) {
    const Layout m = l.mode(k);
    FUZZ_CHECK(m.shape() == s.mode(k) || m.shape().size() == s.extents()[k], l.str(), " mode ", k);
    if (auto leaf = l.mode_as_leaf(k)) {
      for (int64_t j = 0; j < m.size(); ++j) FUZZ_CHECK(m.index(j) == j * leaf->second, l.str(), " mode ", k);
    }
  }
  // hostile coordinates: a ValueError, or an ordinal in range that decodes back
  for (int t = 0; t < 3; ++t) {
    const IntTuple c = coord(s.tree(), in, 0);
    int64_t o = -1;
    if (fuzz::attempt("Shape::encode", kValue, [&] { o = s.encode(c); })) {
      FUZZ_CHECK(o >= 0 && o < n, s.str(), " encodes ", c.str(), " to ", o);
      FUZZ_CHECK(s.encode(s.decode(o)) == o, s.str());
      FUZZ_CHECK(l.index(c) == naive_index(f, o), l.str(), " coord ", c.str());
    }
  }
  for (int64_t o : {n, n + 1, int64_t{-1}, INT64_MAX, INT64_MIN})
    FUZZ_CHECK(!fuzz::attempt("Shape::decode", kValue, [&] { (void)s.decode(o); }), s.str(), " decoded ", o);
  // broadcast: extent-1 leaves grow (a random target otherwise)
  std::vector<IntTuple> grown;
  const std::vector<IntTuple>& modes = s.tree().children();
  for (const auto& m : modes) grown.push_back(m.is_leaf() && m.value() == 1 && in.flag() ? IntTuple(3) : m);
  if (in.flag() && !grown.empty()) grown[in.below(grown.size())] = IntTuple(in.extent(5));
  fuzz::attempt("Layout::broadcast_to", kValue, [&] {
    Shape target(IntTuple::tuple(grown));
    Layout b = l.broadcast_to(target);
    FUZZ_CHECK(b.shape() == target, b.str());
  });
}

// The values of t in ordinal order, read through its layout (t's carrier holds slot numbers).
std::vector<int64_t> values(const TensorPtr& t) {
  std::vector<int64_t> out(t->size());
  for (int64_t o = 0; o < t->size(); ++o) out[o] = t->carrier->read_value(t->offset + t->layout.index(o)).i;
  return out;
}

// A model of a tensor: top-level extents and the values in colex order (nested modes as one ordinal).
struct Model {
  std::vector<int64_t> ext;
  std::vector<int64_t> vals;
  int64_t at(const std::vector<int64_t>& c) const {
    int64_t o = 0, scale = 1;
    for (size_t k = 0; k < ext.size(); ++k) o += c[k] * scale, scale *= ext[k];
    return vals[o];
  }
};

Model remap(const Model& m, const std::vector<int64_t>& ext,
            const std::function<std::vector<int64_t>(const std::vector<int64_t>&)>& to_source) {
  Model r{ext, {}};
  int64_t n = 1;
  for (int64_t e : ext) n *= e;
  for (int64_t o = 0; o < n; ++o) {
    std::vector<int64_t> c(ext.size());
    int64_t rest = o;
    for (size_t k = 0; k < ext.size(); ++k) c[k] = rest % ext[k], rest /= ext[k];
    r.vals.push_back(m.at(to_source(c)));
  }
  return r;
}

void compose_views(const Layout& l, Input& in) {
  if (l.size() > 4096 || l.cosize() > (1 << 16) || l.rank() == 0) return;
  const int64_t offset = in.below(4);
  auto carrier = std::make_shared<CPUCarrier>(offset + l.cosize(), DType::Int32(), true, false);
  for (int64_t i = 0; i < carrier->size(); ++i) carrier->write_value(i, Value::from_int(i));
  TensorPtr t = make_tensor(carrier, offset, l);
  Model m{l.shape().extents(), values(t)};
  for (int step = 0; step < 4 && !in.empty(); ++step) {
    const int64_t rank = static_cast<int64_t>(m.ext.size());
    TensorPtr v;
    Model expect;
    switch (in.below(4)) {
      case 0: {  // narrow
        const int64_t mode = in.extent(4), start = in.extent(6), length = in.extent(6);
        if (!fuzz::attempt("narrow", {ErrorKind::Value, ErrorKind::Index}, [&] { v = narrow(t, mode, start, length); }))
          continue;
        FUZZ_CHECK(mode >= 0 && mode < rank && start >= 0 && length >= 1 && length <= m.ext[mode] &&
                       start <= m.ext[mode] - length,
                   "narrow ", mode, " ", start, " ", length, " accepted");
        auto ext = m.ext;
        ext[mode] = length;
        expect = remap(m, ext, [&](auto c) { c[mode] += start; return c; });
        break;
      }
      case 1: {  // permute
        std::vector<int64_t> order(in.below(2) ? rank : in.below(5));
        for (size_t k = 0; k < order.size(); ++k) order[k] = static_cast<int64_t>(k);
        for (size_t k = order.size(); k > 1; --k) std::swap(order[k - 1], order[in.below(k)]);
        if (in.byte() > 240 && !order.empty()) order[0] = in.extent(4);
        if (!fuzz::attempt("permute", {ErrorKind::Value, ErrorKind::Index}, [&] { v = permute(t, order); })) continue;
        std::vector<int64_t> ext(order.size());
        for (size_t k = 0; k < order.size(); ++k) ext[k] = m.ext[order[k]];
        expect = remap(m, ext, [&](const auto& c) {
          std::vector<int64_t> src(c.size());
          for (size_t k = 0; k < c.size(); ++k) src[order[k]] = c[k];
          return src;
        });
        break;
      }
      case 2: {  // reshape (extents, one may be -1)
        std::vector<int64_t> ext(in.below(4) + 1);
        for (auto& e : ext) e = in.byte() % 9 == 0 ? -1 : in.extent(6);
        if (!fuzz::attempt("reshape", kValue, [&] { v = reshape(t, ext); })) continue;
        const Shape got = infer_reshape_extents(ext, t->size());
        expect = Model{got.extents(), m.vals};
        break;
      }
      default: {  // chunk, one piece
        const int64_t n = in.extent(5), mode = in.extent(3);
        std::vector<TensorPtr> pieces;
        if (!fuzz::attempt("chunk", {ErrorKind::Value, ErrorKind::Index}, [&] { pieces = chunk(t, n, mode); }))
          continue;
        const int64_t e = m.ext[mode], step_len = e / n + (e % n != 0);
        FUZZ_CHECK(static_cast<int64_t>(pieces.size()) == (e + step_len - 1) / step_len, "chunk count ", pieces.size());
        const int64_t k = in.below(pieces.size());
        v = pieces[k];
        auto ext = m.ext;
        ext[mode] = std::min(step_len, e - k * step_len);
        expect = remap(m, ext, [&](auto c) { c[mode] += k * step_len; return c; });
      }
    }
    FUZZ_CHECK(v->layout.shape().extents() == expect.ext, "view shape ", v->layout.str());
    FUZZ_CHECK(values(v) == expect.vals, "view values of ", v->layout.str(), " over ", t->layout.str());
    t = v;
    m = expect;
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const IntTuple st = top(in, true);
  Shape shape;
  if (!fuzz::attempt("Shape", kValue, [&] { shape = Shape(st); })) return 0;
  const IntTuple sd = in.byte() % 8 == 0 ? top(in, false) : like(st, in);
  Layout layout;
  const bool made = fuzz::attempt("Layout", kValue, [&] {
    layout = in.byte() % 5 == 0 ? (in.flag() ? column_major(shape) : row_major(shape)) : Layout(shape, Stride(sd));
  });
  if (!made) return 0;
  check_layout(layout, in);
  compose_views(layout, in);
  return 0;
}
