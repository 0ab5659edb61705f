// The row operations: softmax, topk, index_select and index_add (docs/guide.md, "Row operations"): validation,
// geometry, the C++ functions and the VJPs. Kernels: rows_cpu.cpp (fast) and rows_generic.cpp (reference).
//
// Note [Row operations]: each works along one top-level mode of its first operand, OpOptions::mode (negative
// counts from the end). A hierarchical mode is accepted when its leaves coalesce into one (extent, stride) and
// refused with ValueError otherwise. Along that mode the tensor is a set of rows: one row per ordinal of the
// other modes' leaves (RowGeometry). They do not fit the element-wise, reduction or contraction rules, so they
// have shape rules of their own (OpShape::AlongMode, TopK, Gather, Scatter) and options of their own
// (kOpMode: OpOptions::mode, kOpK: OpOptions::k); their tensor operands stay operands (index_add's three: t,
// indices, source), so carrier-kind checks, dispatch and autograd are those of every row of the table. The
// table's guards tie the four rules to their flags and arities (op_table.hpp, row_operations_consistent).
//
// Two results (topk: values and indices) do not pass through the single result of a kernel entry: the caller
// gives OpOptions::second, the kernel writes the indices there, call_op refuses a two-result row called without
// it (and a one-result row called with it), the Evictable backend wraps it like the first, and the node keeps
// it (saved, so a change to it before backward is reported) for the VJP (VjpArgs::second). The indices carry no
// gradient; the values' gradient scatters into the selected positions.
//
// Validation (check_row_operands) runs before anything is allocated or written: mode, coalescing, dtypes, k,
// the index tensor (Int32, one mode) and every index value (IndexError naming the index, its position and the
// extent). Results are fresh dense tensors of the first operand's kind: row-major when the operand is (its last
// mode contiguous), else column-major (row_result_layout).
//
// Arithmetic: softmax loads a row into a Float32 buffer (in cache), takes its maximum, then exp(x - max) and
// their sum (partial sums in Float32), then divides each by the sum and rounds once to the result dtype: two
// passes over the buffered row. exp is a polynomial (row_exp: relative error at most 2u = 2^-23 for x <= 0,
// checked by ops_rows_test.cpp), so the loops vectorise (AVX-512 where present, chosen at run time; portable
// otherwise). Where neighbouring rows are neighbouring slots and a row's own elements are not (along mode 1 of a
// column-major matrix), 16 rows are loaded and stored together, one cache line per element of the 16.
// A NaN in a row, or an infinite maximum, makes the row NaN (as PyTorch). topk orders by value, descending,
// NaN above every number (as PyTorch), equal values (and -0.0 with 0.0) by the lower index; its values are
// copies (exact). index_select copies rows (memcpy where a row's run is contiguous in both tensors, a strided
// copy otherwise). index_add writes t + the sum of the source rows sent to each row: per destination row, in
// Float32 (t's row, then the source rows in index order), rounded once; rows no index names are copied.
#include "rows.hpp"

#include <algorithm>

#include "dense.hpp"
#include "kernels.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"

namespace sw {

namespace detail {

size_t normalized_mode(int64_t mode, size_t rank, const char* op) {
  const int64_t r = static_cast<int64_t>(rank);
  if (r == 0) raise<ValueError>(op, ": a tensor of no modes has no mode to work along");
  if (mode < -r || mode >= r)
    raise<ValueError>(op, ": mode ", mode, " is out of range for a tensor of ", r, " modes (-", r, " <= mode < ", r, ")");
  return static_cast<size_t>(mode < 0 ? mode + r : mode);
}

RowGeometry row_geometry(const Layout& layout, size_t m, const char* op) {
  auto leaf = layout.mode_as_leaf(m);
  if (!leaf)
    raise<ValueError>(op, ": mode ", m, " of ", layout.str(),
                      " is hierarchical and its leaves do not coalesce into one stride; row operations work along "
                      "a mode with one stride");
  RowGeometry g;
  g.extent = leaf->first;
  g.stride = leaf->second;
  for (size_t k = 0; k < layout.rank(); ++k) {
    if (k == m) continue;
    const Layout mode_k = layout.mode(k);  // the flat leaves live in it
    const FlatLayout& f = mode_k.flat();
    g.outer_extents.insert(g.outer_extents.end(), f.extents.begin(), f.extents.end());
    g.outer_strides.insert(g.outer_strides.end(), f.strides.begin(), f.strides.end());
  }
  for (int64_t e : g.outer_extents) g.outer_size *= e;
  return g;
}

Layout row_result_layout(const Layout& like, const Shape& shape) {
  const size_t r = like.rank();
  if (r >= 2) {
    auto last = like.mode_as_leaf(r - 1), first = like.mode_as_leaf(0);
    if (last && first && last->first > 1 && last->second == 1 && !(first->first > 1 && first->second == 1))
      return row_major(shape);
  }
  return column_major(shape);
}

TensorPtr row_result(const TensorImpl& like, const Shape& shape, const DType& dtype) {
  CarrierPtr c = like.carrier->allocate_like(shape.size(), true, dtype, /*empty=*/true);
  return make_tensor(std::move(c), 0, row_result_layout(like.layout, shape));
}

Shape with_extent(const Shape& shape, size_t m, int64_t extent) {
  std::vector<IntTuple> modes;
  for (size_t k = 0; k < shape.rank(); ++k) modes.push_back(k == m ? IntTuple(extent) : shape.tree()[k]);
  return Shape(IntTuple::tuple(std::move(modes)));
}

std::vector<int32_t> index_values(const TensorImpl& indices) {
  const int64_t n = indices.size();
  std::vector<int32_t> out(static_cast<size_t>(n));
  const FlatLayout& f = indices.layout.flat();
  const std::byte* base = indices.carrier->native_data();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t slot = indices.offset + f.index(i);
    if (base) out[static_cast<size_t>(i)] = reinterpret_cast<const int32_t*>(base)[slot];
    else out[static_cast<size_t>(i)] = static_cast<int32_t>(indices.carrier->read_value(slot).i);
  }
  return out;
}

namespace {
void check_floating(const char* op, const char* what, const TensorImpl& t) {
  if (!t.dtype().is_floating())
    raise<TypeError>(op, ": ", what, " must be a floating-point tensor (Float32, BFloat16 or Float16), got ",
                     t.dtype().name());
}
}  // namespace

void check_row_operands(const OpDef& def, std::span<const Operand> ops, const OpOptions& options) {
  const TensorImpl& t = *ops[0].tensor;
  const size_t m = normalized_mode(options.mode, t.layout.rank(), def.name);
  const RowGeometry g = row_geometry(t.layout, m, def.name);
  if (def.shape != OpShape::Gather) check_floating(def.name, "t", t);
  if (def.shape == OpShape::TopK && (options.k < 1 || options.k > g.extent))
    raise<ValueError>(def.name, ": k=", options.k, " is out of range for mode ", m, " of extent ", g.extent,
                      " (1 <= k <= ", g.extent, ")");
  if (def.shape != OpShape::Gather && def.shape != OpShape::Scatter) return;
  const TensorImpl& idx = *ops[1].tensor;
  if (idx.dtype().id() != DTypeId::Int32)
    raise<TypeError>(def.name, ": indices must be an Int32 tensor, got ", idx.dtype().name());
  if (idx.layout.rank() != 1)
    raise<ValueError>(def.name, ": indices must have one mode, got shape ", idx.layout.shape().str());
  const std::vector<int32_t> values = index_values(idx);
  for (size_t i = 0; i < values.size(); ++i)
    if (values[i] < 0 || values[i] >= g.extent)
      raise<IndexError>(def.name, ": index ", values[i], " (position ", i, " of indices) is out of range for mode ",
                        m, " of extent ", g.extent);
  if (def.shape != OpShape::Scatter) return;
  const TensorImpl& src = *ops[2].tensor;
  if (&src.dtype() != &t.dtype())
    raise<TypeError>(def.name, ": source is ", src.dtype().name(), " but t is ", t.dtype().name(),
                     "; nothing is converted implicitly");
  const Shape want = with_extent(t.layout.shape(), m, static_cast<int64_t>(values.size()));
  if (!(src.layout.shape() == want))
    raise<ValueError>(def.name, ": source has shape ", src.layout.shape().str(), " but t ", t.layout.shape().str(),
                      " with mode ", m, " of extent len(indices) = ", values.size(), " needs ", want.str());
}

// ---------------------------------------------------------------- VJPs

namespace {
OpOptions along(int64_t mode) {
  OpOptions o;
  o.mode = mode;
  return o;
}
}  // namespace

void vjp_softmax(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (!a.wants(0)) return;
  const size_t m = normalized_mode(a.options.mode, a.inputs[0]->layout.rank(), "softmax");
  grads[0] = softmax_backward(*a.inputs[0], *a.grad, m, *a.grad->carrier);
}

void vjp_topk(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (!a.wants(0)) return;
  const size_t m = normalized_mode(a.options.mode, a.inputs[0]->layout.rank(), "topk");
  grads[0] = topk_backward(*a.grad, *a.second, a.shape_of(0), m, *a.grad->carrier);
}

// The gradient of t: the output's gradient added into zeros at the selected rows (index_add), in Float32 (in
// the gradient's 16-bit dtype when it is one).
void vjp_index_select(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (!a.wants(0)) return;
  const DType& d = a.grad->dtype().is_half() ? a.grad->dtype() : DType::Float32();
  TensorPtr g = a.grad;
  if (&g->dtype() != &d) g = write_floats(*g->carrier, g->layout.shape(), read_doubles(*g));
  TensorPtr zeros = full_like_kind(*g->carrier, a.shape_of(0), d, 0.0);
  std::vector<Operand> ops{Operand::of(zeros), Operand::of(a.inputs[1]), Operand::of(g)};
  grads[0] = call_op(OpId::IndexAdd, ops, along(a.options.mode));
}

// t's gradient is the output's (same shape); source's the output's gradient at the selected rows.
void vjp_index_add(const VjpArgs& a, std::span<TensorPtr> grads) {
  if (a.wants(0)) grads[0] = a.grad;
  if (a.wants(2)) {
    std::vector<Operand> ops{Operand::of(a.grad), Operand::of(a.inputs[1])};
    grads[2] = call_op(OpId::IndexSelect, ops, along(a.options.mode));
  }
}

}  // namespace detail

// ---------------------------------------------------------------- the C++ functions

TensorPtr softmax(const TensorPtr& t, int64_t mode) {
  OpOptions o;
  o.mode = mode;
  const Operand ops[1] = {Operand::of(t)};
  return call_op(OpId::Softmax, ops, o);
}

std::pair<TensorPtr, TensorPtr> topk(const TensorPtr& t, int64_t k, int64_t mode) {
  TensorPtr indices;
  OpOptions o;
  o.mode = mode;
  o.k = k;
  o.second = &indices;
  const Operand ops[1] = {Operand::of(t)};
  TensorPtr values = call_op(OpId::TopK, ops, o);
  return {std::move(values), std::move(indices)};
}

TensorPtr index_select(const TensorPtr& t, int64_t mode, const TensorPtr& indices) {
  OpOptions o;
  o.mode = mode;
  const Operand ops[2] = {Operand::of(t), Operand::of(indices)};
  return call_op(OpId::IndexSelect, ops, o);
}

TensorPtr index_add(const TensorPtr& t, int64_t mode, const TensorPtr& indices, const TensorPtr& source) {
  OpOptions o;
  o.mode = mode;
  const Operand ops[3] = {Operand::of(t), Operand::of(indices), Operand::of(source)};
  return call_op(OpId::IndexAdd, ops, o);
}

}  // namespace sw
