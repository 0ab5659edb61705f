// The vector-Jacobian products of the operations, one function per table row
// (Note [The operation table]). Each reads the output's gradient and, where
// its row saves them (OpSaves::Inputs), the tensor operands' values; broadcast
// operands get their gradient summed back to their own shape (unbroadcast).
#include "vjps.hpp"

#include <algorithm>
#include <functional>

#include "dense.hpp"
#include "kernels.hpp"
#include "strided.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/views.hpp"

namespace sw::detail {

namespace {

TensorPtr op(OpId id, const TensorPtr& a, const TensorPtr& b = nullptr) {
  std::vector<Operand> ops{Operand::of(a)};
  if (b) ops.push_back(Operand::of(b));
  return call_op(id, ops);
}

TensorPtr transpose(const TensorPtr& t) { return permute_modes(t, {1, 0}); }

// sink += lhs rhs^T (matmul's contraction) when both are CPU Float32 tensors of
// the sink's result shape; false (nothing written) otherwise.
bool add_product_into(GradientSink& sink, const TensorImpl& lhs, const TensorImpl& rhs) {
  if (&lhs.carrier->kind() != &cpu_kind() || &rhs.carrier->kind() != &cpu_kind()) return false;
  if (lhs.layout.rank() != 2 || rhs.layout.rank() != 2) return false;
  const int64_t m = lhs.layout.shape().extents()[0], k = lhs.layout.shape().extents()[1];
  const int64_t n = rhs.layout.shape().extents()[0];
  if (m != sink.rows || n != sink.cols || rhs.layout.shape().extents()[1] != k) return false;
  // A transposed sink holds (lhs rhs^T)^T = rhs lhs^T column-major.
  if (sink.transposed) return cpu_matmul_accumulate(rhs, lhs, n, m, k, sink.data);
  return cpu_matmul_accumulate(lhs, rhs, m, n, k, sink.data);
}

// Whether a two-mode tensor is row-major (mode 1 contiguous, mode 0 one row apart, neither of extent 1): PyTorch's
// (out, in) weight, a projection of row-major tiles (Note [Within-tile layouts] in cpp/src/tiled/tile_copies.hpp).
bool row_major_2d(const TensorImpl& t) {
  if (t.layout.rank() != 2) return false;
  auto r = t.layout.mode_as_leaf(0), c = t.layout.mode_as_leaf(1);
  if (r && c) return r->first > 1 && c->first > 1 && c->second == 1 && r->second == c->first;
  // A tile-major projection of row-major tiles (Note [Tile-major projections] in cpp/src/tiled/tile_copies.hpp):
  // rows of the first column block one after another, (out, (in, count)) : (in, (1, out x in)).
  const FlatLayout& f = t.layout.flat();
  const IntTuple& rows = t.layout.shape().tree()[0];
  return r && !c && rows.is_leaf() && f.extents.size() == 3 && r->first > 1 && f.strides[1] == 1 &&
         r->second == f.extents[1] && f.strides[2] == r->first * r->second;
}

// g where a > 0 or a is NaN, else 0 (also where g is NaN or infinite): PyTorch's threshold_backward(g, relu(a), 0),
// which zeroes where relu(a) <= 0, so a NaN input passes its gradient through.
TensorPtr relu_grad(const TensorPtr& g, const TensorPtr& a) {
  const float* gf = dense_floats(*g);
  const float* af = dense_floats(*a);
  if (gf && af && g->layout.shape() == a->layout.shape()) {  // dense operands: one vectorisable pass
    TensorPtr out = dense_result(*g->carrier, g->layout.shape(), DType::Float32());
    float* o = reinterpret_cast<float*>(out->carrier->mutable_native_data());
    if (o) {
      parallel_for(g->size(), int64_t{1} << 16, [&](int64_t b, int64_t e) {
        for (int64_t i = b; i < e; ++i) o[i] = af[i] <= 0 ? 0.f : gf[i];
      });
      return out;
    }
  }
  std::vector<double> gv = read_doubles(*g), av = read_doubles(*a);
  for (size_t i = 0; i < gv.size(); ++i)
    if (av[i] <= 0) gv[i] = 0;
  return write_floats(*g->carrier, g->layout.shape(), gv);
}

// Same tree form as `mode`, every stride 0.
IntTuple zero_strides(const IntTuple& mode) {
  if (mode.is_leaf()) return IntTuple(int64_t{0});
  std::vector<IntTuple> c;
  for (const auto& ch : mode.children()) c.push_back(zero_strides(ch));
  return IntTuple::tuple(std::move(c));
}

}  // namespace

void vjp_add(const VjpArgs& a, std::span<TensorPtr> grads) {
  for (size_t i = 0; i < a.inputs.size(); ++i)
    if (a.wants(i)) grads[i] = unbroadcast(a.grad, a.shape_of(i));
}

void vjp_sub(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (a.inputs.size() == 1) {  // with a weak scalar: t - s gives g, s - t gives -g
    if (a.wants(0)) grads[0] = unbroadcast(a.operands[0].is_tensor() ? a.grad : op(OpId::Neg, a.grad), a.shape_of(0));
    return;
  }
  if (a.wants(0)) grads[0] = unbroadcast(a.grad, a.shape_of(0));
  if (a.wants(1)) grads[1] = unbroadcast(op(OpId::Neg, a.grad), a.shape_of(1));
}

void vjp_mul(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (a.inputs.size() == 2) {
    if (a.wants(0)) grads[0] = unbroadcast(op(OpId::ElementwiseMul, a.grad, a.inputs[1]), a.shape_of(0));
    if (a.wants(1)) grads[1] = unbroadcast(op(OpId::ElementwiseMul, a.grad, a.inputs[0]), a.shape_of(1));
    return;
  }
  // A tensor times a weak scalar (either side): g times the scalar.
  const Operand& s = a.operands[a.operands[0].is_tensor() ? 1 : 0];
  std::vector<Operand> ops{Operand::of(a.grad), Operand::weak(s.scalar)};
  if (a.wants(0)) grads[0] = unbroadcast(call_op(OpId::Mul, ops), a.shape_of(0));
}

void vjp_div(const VjpArgs& a, std::span<TensorPtr> grads) {
  const TensorPtr& g = a.grad;
  if (a.inputs.size() == 1) {  // with a weak scalar s: t / s gives g / s, s / t gives -(g s / t) / t
    if (!a.wants(0)) return;
    const TensorPtr& t = a.inputs[0];
    const bool numerator = a.operands[0].is_tensor();
    const Value s = a.operands[numerator ? 1 : 0].scalar;
    auto with_scalar = [&](OpId id, const TensorPtr& x) {
      std::vector<Operand> ops{Operand::of(x), Operand::weak(s)};
      return call_op(id, ops);
    };
    grads[0] = unbroadcast(numerator ? with_scalar(OpId::Div, g)
                                     : op(OpId::Neg, op(OpId::Div, op(OpId::Div, with_scalar(OpId::Mul, g), t), t)),
                           a.shape_of(0));
    return;
  }
  if (a.wants(0)) grads[0] = unbroadcast(op(OpId::Div, g, a.inputs[1]), a.shape_of(0));
  if (a.wants(1)) {
    TensorPtr q = op(OpId::Div, op(OpId::ElementwiseMul, g, a.inputs[0]), op(OpId::ElementwiseMul, a.inputs[1], a.inputs[1]));
    grads[1] = unbroadcast(op(OpId::Neg, q), a.shape_of(1));
  }
}

void vjp_neg(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (a.wants(0)) grads[0] = op(OpId::Neg, a.grad);
}

void vjp_exp(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (a.wants(0)) grads[0] = op(OpId::ElementwiseMul, a.grad, op(OpId::Exp, a.inputs[0]));
}

void vjp_relu(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (a.wants(0)) grads[0] = relu_grad(a.grad, a.inputs[0]);
}

// The gradient repeated along the reduced modes: a view of g with stride 0 there, written densely.
void vjp_reduce_sum(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (!a.wants(0)) return;
  const TensorPtr& g = a.grad;
  const TensorImpl& in = *a.inputs[0];
  std::vector<size_t> kept = parse_reduce_description(a.options.description, in.layout.rank());
  std::vector<IntTuple> sh, st;
  for (size_t k = 0; k < in.layout.rank(); ++k) {
    auto it = std::find(kept.begin(), kept.end(), k);
    const IntTuple& mode = in.layout.shape().tree()[k];
    sh.push_back(mode);
    if (it != kept.end()) st.push_back(g->layout.stride().tree()[static_cast<size_t>(it - kept.begin())]);
    else st.push_back(zero_strides(mode));
  }
  TensorPtr view = make_tensor(g->carrier, g->offset, Layout(Shape(IntTuple::tuple(sh)), Stride(IntTuple::tuple(st))));
  grads[0] = write_floats(*g->carrier, in.layout.shape(), read_doubles(*view));
}

void vjp_matmul(const VjpArgs& a, std::span<TensorPtr> grads) {
  // d lhs = g rhs, d rhs = g^T lhs: each a matmul of views, or added straight into a sink.
  const TensorPtr lhs[2] = {a.grad, transpose(a.grad)};
  const TensorPtr rhs[2] = {transpose(a.inputs[1]), transpose(a.inputs[0])};
  for (size_t i = 0; i < 2; ++i) {
    if (!a.wants(i)) continue;
    GradientSink* sink = i < a.sinks.size() ? a.sinks[i] : nullptr;
    if (sink && !a.options.accumulate_f64 && add_product_into(*sink, *lhs[i], *rhs[i])) {
      sink->used = true;
      continue;
    }
    // A row-major operand gets its gradient row-major: the transposed product, computed as such (BLAS writes
    // either order at the same speed), so that a projection's VJP copies it into row-major tiles run by run, or
    // adopts it whole, instead of transposing it element by element.
    if (row_major_2d(*a.inputs[i])) grads[i] = transpose(op(OpId::Matmul, rhs[i], lhs[i]));
    else grads[i] = op(OpId::Matmul, lhs[i], rhs[i]);
    // The product's modes come from the other operand: a nested mode there (a tile-major projection's) gives the
    // gradient that nesting. It takes the input's own profile (same extents, same order of elements: a view).
    if (!(grads[i]->layout.shape() == a.inputs[i]->layout.shape()))
      grads[i] = reshape(grads[i], a.inputs[i]->layout.shape());
  }
}

}  // namespace sw::detail
