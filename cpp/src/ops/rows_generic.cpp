// The row operations' reference kernels for the Generic backend (Note [Row operations] in rows.cpp): element by
// element through read_value / write_value, in double, each result rounded once to its dtype.
#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include "rows.hpp"

namespace sw::detail {

namespace {

double read(const TensorImpl& t, int64_t slot) {
  const Value v = t.carrier->read_value(slot);
  return v.kind == Value::Kind::Int ? double(v.i) : v.f;
}

void write(Carrier& c, int64_t slot, double v) { c.write_value(slot, c.dtype().convert(Value::from_float(v))); }

// The slot offsets of every row's start (outer ordinals in order) of `g` from `base`.
std::vector<int64_t> row_starts(const RowGeometry& g, int64_t base) {
  std::vector<int64_t> out(static_cast<size_t>(g.outer_size));
  for (int64_t o = 0; o < g.outer_size; ++o) {
    int64_t rest = o, off = base;
    for (size_t j = 0; j < g.outer_extents.size(); ++j) {
      off += (rest % g.outer_extents[j]) * g.outer_strides[j];
      rest /= g.outer_extents[j];
    }
    out[static_cast<size_t>(o)] = off;
  }
  return out;
}

size_t mode_of(const OpOptions& o, const TensorImpl& t, const char* op) {
  return normalized_mode(o.mode, t.layout.rank(), op);
}

}  // namespace

TensorPtr generic_softmax(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  const TensorImpl& t = *ops[0].tensor;
  const size_t m = mode_of(options, t, def.name);
  TensorPtr out = row_result(t, t.layout.shape(), t.dtype());
  const RowGeometry gi = row_geometry(t.layout, m, def.name), go = row_geometry(out->layout, m, def.name);
  const std::vector<int64_t> ri = row_starts(gi, t.offset), ro = row_starts(go, 0);
  std::vector<double> x(static_cast<size_t>(gi.extent));
  for (size_t r = 0; r < ri.size(); ++r) {
    double mx = -std::numeric_limits<double>::infinity();
    bool nan = false;
    for (int64_t i = 0; i < gi.extent; ++i) {
      x[static_cast<size_t>(i)] = read(t, ri[r] + i * gi.stride);
      nan |= std::isnan(x[static_cast<size_t>(i)]);
      mx = std::max(mx, x[static_cast<size_t>(i)]);
    }
    if (nan) mx = std::numeric_limits<double>::quiet_NaN();
    double s = 0;
    for (double& v : x) s += (v = std::exp(v - mx));
    for (int64_t i = 0; i < gi.extent; ++i) write(*out->carrier, ro[r] + i * go.stride, x[static_cast<size_t>(i)] / s);
  }
  return out;
}

TensorPtr generic_topk(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  const TensorImpl& t = *ops[0].tensor;
  const size_t m = mode_of(options, t, def.name);
  const int64_t k = options.k;
  const Shape rs = with_extent(t.layout.shape(), m, k);
  TensorPtr values = row_result(t, rs, t.dtype());
  TensorPtr indices = make_tensor(t.carrier->allocate_like(rs.size(), true, DType::Int32(), true), 0, values->layout);
  const RowGeometry gi = row_geometry(t.layout, m, def.name), go = row_geometry(values->layout, m, def.name);
  const std::vector<int64_t> ri = row_starts(gi, t.offset), ro = row_starts(go, 0);
  std::vector<double> x(static_cast<size_t>(gi.extent));
  std::vector<int64_t> order(static_cast<size_t>(gi.extent));
  for (size_t r = 0; r < ri.size(); ++r) {
    for (int64_t i = 0; i < gi.extent; ++i) x[static_cast<size_t>(i)] = read(t, ri[r] + i * gi.stride);
    std::iota(order.begin(), order.end(), 0);
    // A stable sort by "comes before": NaN first, then larger values; equal ones keep index order.
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
      const double va = x[static_cast<size_t>(a)], vb = x[static_cast<size_t>(b)];
      if (std::isnan(va) || std::isnan(vb)) return std::isnan(va) && !std::isnan(vb);
      return va > vb;
    });
    for (int64_t j = 0; j < k; ++j) {
      const int64_t i = order[static_cast<size_t>(j)];
      write(*values->carrier, ro[r] + j * go.stride, x[static_cast<size_t>(i)]);
      indices->carrier->write_value(ro[r] + j * go.stride, Value::from_int(i));
    }
  }
  *options.second = std::move(indices);
  return values;
}

TensorPtr generic_index_select(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  const TensorImpl& t = *ops[0].tensor;
  const size_t m = mode_of(options, t, def.name);
  const std::vector<int32_t> idx = index_values(*ops[1].tensor);
  TensorPtr out = row_result(t, with_extent(t.layout.shape(), m, static_cast<int64_t>(idx.size())), t.dtype());
  const RowGeometry gi = row_geometry(t.layout, m, def.name), go = row_geometry(out->layout, m, def.name);
  const std::vector<int64_t> ri = row_starts(gi, t.offset), ro = row_starts(go, 0);
  for (size_t j = 0; j < idx.size(); ++j)
    for (size_t r = 0; r < ri.size(); ++r)
      out->carrier->write_value(ro[r] + static_cast<int64_t>(j) * go.stride,
                                t.carrier->read_value(ri[r] + idx[j] * gi.stride));
  return out;
}

TensorPtr generic_index_add(std::span<const Operand> ops, const OpOptions& options, const OpDef& def) {
  const TensorImpl& t = *ops[0].tensor;
  const TensorImpl& src = *ops[2].tensor;
  const size_t m = mode_of(options, t, def.name);
  const std::vector<int32_t> idx = index_values(*ops[1].tensor);
  TensorPtr out = row_result(t, t.layout.shape(), t.dtype());
  const RowGeometry gt = row_geometry(t.layout, m, def.name), go = row_geometry(out->layout, m, def.name);
  const RowGeometry gs = row_geometry(src.layout, m, def.name);
  const std::vector<int64_t> rt = row_starts(gt, t.offset), ro = row_starts(go, 0), rs = row_starts(gs, src.offset);
  std::vector<double> acc(static_cast<size_t>(gt.extent));
  for (size_t r = 0; r < rt.size(); ++r) {
    for (int64_t d = 0; d < gt.extent; ++d) acc[static_cast<size_t>(d)] = read(t, rt[r] + d * gt.stride);
    for (size_t j = 0; j < idx.size(); ++j)
      acc[static_cast<size_t>(idx[j])] += read(src, rs[r] + static_cast<int64_t>(j) * gs.stride);
    for (int64_t d = 0; d < gt.extent; ++d) write(*out->carrier, ro[r] + d * go.stride, acc[static_cast<size_t>(d)]);
  }
  return out;
}

}  // namespace sw::detail
