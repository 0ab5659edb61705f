// Helpers shared by the backends and the VJPs: dense results, mode permutations, and the dense Float32 paths
// of broadcasting's VJP (unbroadcast) and of expansion.
#include <array>

#include "dense.hpp"
#include "strided.hpp"
#include "strideweave/errors.hpp"

namespace sw {

TensorPtr dense_result(const Carrier& prototype, const Shape& shape, const DType& dtype) {
  CarrierPtr c = prototype.allocate_like(shape.size(), true, dtype, /*empty=*/true);
  return make_tensor(std::move(c), 0, column_major(shape));
}

TensorPtr permute_modes(const TensorPtr& t, const std::vector<size_t>& order) {
  std::vector<IntTuple> sh, st;
  for (size_t k : order) {
    sh.push_back(t->layout.shape().tree()[k]);
    st.push_back(t->layout.stride().tree()[k]);
  }
  return make_tensor(t->carrier, t->offset, Layout(Shape(IntTuple::tuple(sh)), Stride(IntTuple::tuple(st))));
}

namespace detail {

std::vector<double> read_doubles(const TensorImpl& t) {
  const int64_t n = t.size();
  std::vector<double> out(static_cast<size_t>(n));
  std::array<const std::vector<int64_t>*, 1> strides{&t.layout.flat().strides};
  auto plan = detail::StridedPlan<1>::make(t.layout.flat().extents, strides, {t.offset});
  if (const std::byte* base = t.carrier->native_data()) {
    visit_dtype(t.dtype().id(), [&](auto tag) {
      using T = decltype(tag);
      const T* x = reinterpret_cast<const T*>(base);
      plan.for_each_run(0, n, [&](int64_t ord, const std::array<int64_t, 1>& off, int64_t cnt,
                                  const std::array<int64_t, 1>& st) {
        for (int64_t i = 0; i < cnt; ++i) out[ord + i] = double(x[off[0] + i * st[0]]);
      });
    });
    return out;
  }
  for (int64_t i = 0; i < n; ++i) {
    Value v = t.carrier->read_value(t.offset + t.layout.flat().index(i));
    out[i] = v.kind == Value::Kind::Int ? double(v.i) : v.kind == Value::Kind::Bool ? double(v.b) : v.f;
  }
  return out;
}

const float* dense_floats(const TensorImpl& t) {
  if (t.dtype().id() != DTypeId::Float32 || !t.layout.is_column_major()) return nullptr;
  const std::byte* base = t.carrier->native_data();
  return base ? reinterpret_cast<const float*>(base) + t.offset : nullptr;
}

TensorPtr write_floats(const Carrier& prototype, const Shape& shape, const std::vector<double>& values) {
  TensorPtr out = dense_result(prototype, shape, DType::Float32());
  std::vector<float> f(values.begin(), values.end());
  out->carrier->write_slots(0, static_cast<int64_t>(f.size()), f.data());
  return out;
}

}  // namespace detail

using detail::dense_floats;
using detail::read_doubles;
using detail::write_floats;

TensorPtr full_like_kind(const Carrier& prototype, const Shape& shape, const DType& dtype, double value) {
  TensorPtr out = dense_result(prototype, shape, dtype);
  if (dtype.id() == DTypeId::Float32) {
    std::vector<float> f(static_cast<size_t>(shape.size()), static_cast<float>(value));
    out->carrier->write_slots(0, shape.size(), f.data());
  } else {
    const Value v = dtype.is_floating()           ? dtype.convert(Value::from_float(value))
                    : dtype.id() == DTypeId::Int32 ? Value::from_int(int64_t(value))
                                                   : Value::from_bool(value != 0);
    for (int64_t i = 0; i < shape.size(); ++i) out->carrier->write_value(i, v);
  }
  return out;
}

TensorPtr unbroadcast(const TensorPtr& grad, const Shape& target) {
  if (grad->layout.shape() == target) return grad;
  std::optional<Shape> refined = refine_shape(target, grad->layout.shape());
  SW_ASSERT(refined, "unbroadcast: ", target.str(), " does not refine to the gradient's ", grad->layout.shape().str());
  if (!(*refined == target)) {
    // An operand whose leaf met a nested mode (Note [Compatible shapes] in layout.hpp): its gradient is summed
    // over the target refined to the gradient's profile; that sum, dense and column-major, is the target's dense
    // tensor too (the same values in the same order).
    TensorPtr sum = unbroadcast(grad, *refined);
    if (!sum->layout.is_column_major()) sum = expand_dense(sum, *refined);
    return make_tensor(sum->carrier, sum->offset, column_major(target));
  }
  std::vector<int64_t> ge = grad->layout.shape().leaves(), te = target.leaves();
  SW_ASSERT(ge.size() == te.size(), "unbroadcast across profiles");
  std::vector<int64_t> tstride(te.size());
  int64_t run = 1;
  for (size_t j = 0; j < te.size(); ++j) {
    tstride[j] = te[j] == ge[j] ? run : 0;
    run *= te[j];
  }
  std::vector<double> out(static_cast<size_t>(target.size()), 0.0);
  if (const float* gf = dense_floats(*grad)) {
    // Hot path (a gradient of a broadcast operand): one pass over the dense
    // gradient with an odometer over its leaves, no per-element division.
    const int64_t n = grad->size(), inner = ge.empty() ? 1 : ge[0], s0 = ge.empty() ? 0 : tstride[0];
    std::vector<int64_t> idx(ge.size(), 0);
    int64_t o = 0;
    for (int64_t i = 0; i < n; i += inner) {
      if (s0 == 1) {
        for (int64_t r = 0; r < inner; ++r) out[o + r] += gf[i + r];
      } else {
        double acc = 0;
        for (int64_t r = 0; r < inner; ++r) acc += gf[i + r];
        out[o] += acc;
      }
      for (size_t j = 1; j < ge.size(); ++j) {  // advance leaves 1.. (leaf 0 is the inner run)
        o += tstride[j];
        if (++idx[j] < ge[j]) break;
        o -= tstride[j] * ge[j];
        idx[j] = 0;
      }
    }
  } else {
    std::vector<double> g = read_doubles(*grad);
    for (int64_t i = 0; i < static_cast<int64_t>(g.size()); ++i) {
      int64_t rest = i, o = 0;
      for (size_t j = 0; j < ge.size(); ++j) {
        o += (rest % ge[j]) * tstride[j];
        rest /= ge[j];
      }
      out[o] += g[i];
    }
  }
  return write_floats(*grad->carrier, target, out);
}

TensorPtr expand_dense(const TensorPtr& t, const Shape& to) {
  TensorPtr view = make_tensor(t->carrier, t->offset, t->layout.broadcast_to(to));
  return write_floats(*t->carrier, to, read_doubles(*view));
}

}  // namespace sw
