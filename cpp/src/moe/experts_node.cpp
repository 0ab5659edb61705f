// SparseMoE's expert part: the forward visit of the routed experts and its autograd node (Note [A sparse MoE
// block] in sparse_moe.cpp), plus the dense helpers both use.
#include <cstring>
#include <deque>

#include "../ops/activations.hpp"
#include "../ops/dense.hpp"
#include "../ops/half.hpp"
#include "../ops/strided.hpp"
#include "../tiled/internal.hpp"
#include "../tiled/tile_copies.hpp"
#include "internal.hpp"
#include "strideweave/autograd.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"

namespace sw::moe {

// ---------------------------------------------------------------- dense helpers

std::vector<float> floats_of(const TensorImpl& t) {
  const int64_t n = t.size();
  std::vector<float> v(static_cast<size_t>(n));
  const std::byte* base = t.carrier->native_data();
  if (base && t.layout.is_column_major()) {
    switch (t.dtype().id()) {
      case DTypeId::Float32:
        std::memcpy(v.data(), reinterpret_cast<const float*>(base) + t.offset, static_cast<size_t>(n) * 4);
        return v;
      case DTypeId::BFloat16:
        detail::bf16_to_f32(reinterpret_cast<const uint16_t*>(base) + t.offset, v.data(), n);
        return v;
      case DTypeId::Float16:
        detail::f16_to_f32(reinterpret_cast<const uint16_t*>(base) + t.offset, v.data(), n);
        return v;
      default:
        break;
    }
  }
  std::vector<double> d = detail::read_doubles(t);
  for (size_t i = 0; i < d.size(); ++i) v[i] = static_cast<float>(d[i]);
  return v;
}

void round_to(std::vector<float>& v, const DType& dtype) {
  const auto n = static_cast<int64_t>(v.size());
  std::vector<uint16_t> bits(v.size());
  if (dtype.id() == DTypeId::BFloat16) {
    detail::f32_to_bf16(v.data(), bits.data(), n);
    detail::bf16_to_f32(bits.data(), v.data(), n);
  } else if (dtype.id() == DTypeId::Float16) {
    detail::f32_to_f16(v.data(), bits.data(), n);
    detail::f16_to_f32(bits.data(), v.data(), n);
  }
}

TensorPtr tensor_of(const std::vector<float>& v, int64_t rows, int64_t cols, const DType& dtype) {
  auto c = std::make_shared<CPUCarrier>(rows * cols, dtype, true, /*empty=*/true);
  std::byte* dst = c->mutable_native_data();
  const int64_t n = rows * cols;
  if (dtype.id() == DTypeId::Float32) std::memcpy(dst, v.data(), static_cast<size_t>(n) * 4);
  else if (dtype.id() == DTypeId::BFloat16) detail::f32_to_bf16(v.data(), reinterpret_cast<uint16_t*>(dst), n);
  else if (dtype.id() == DTypeId::Float16) detail::f32_to_f16(v.data(), reinterpret_cast<uint16_t*>(dst), n);
  else raise<InternalError>("SparseMoE: tensor_of of ", dtype.name());
  return make_tensor(std::move(c), 0, column_major(Shape::flat({rows, cols})));
}

TensorPtr int_tensor(const std::vector<int32_t>& v) {
  const auto n = static_cast<int64_t>(v.size());
  auto c = std::make_shared<CPUCarrier>(n, DType::Int32(), true, /*empty=*/true);
  std::memcpy(c->mutable_native_data(), v.data(), v.size() * sizeof(int32_t));
  return make_tensor(std::move(c), 0, column_major(Shape::flat({n})));
}

TensorPtr op(OpId id, const TensorPtr& a, const TensorPtr& b) {
  GradModeGuard off(false);
  std::vector<Operand> ops{Operand::of(a)};
  if (b) ops.push_back(Operand::of(b));
  return call_op(id, ops);
}

TensorPtr matrix_of(const TensorPtr& compact) {
  const FlatLayout& f = compact->layout.flat();
  return make_tensor(compact->carrier, compact->offset,
                     Layout(Shape::flat({f.extents[0], f.extents[1]}), Stride::flat({f.strides[0], f.strides[1]})));
}

TensorPtr compact_of(const TensorPtr& matrix) {
  const FlatLayout& f = matrix->layout.flat();
  return make_tensor(matrix->carrier, matrix->offset,
                     Layout(Shape::flat({f.extents[0], f.extents[1], 1}),
                            Stride::flat({f.strides[0], f.strides[1], f.extents[0] * f.extents[1]})));
}

TensorPtr transposed(const TensorPtr& t) { return permute_modes(t, {1, 0}); }

namespace {

// Whether a two-mode tensor is row-major (mode 1 contiguous): a PyTorch (out, in) tile.
bool row_major(const TensorImpl& t) {
  const FlatLayout& f = t.layout.flat();
  return f.extents.size() == 2 && f.strides[1] == 1 && f.strides[0] == f.extents[1] && f.extents[0] > 1 &&
         f.extents[1] > 1;
}

// a b^T (a (m, k), b (n, k)), laid out like `like` (row-major when it is: the tile's own order, so the
// projection's VJP copies it into the tile run by run).
TensorPtr product_like(const TensorPtr& a, const TensorPtr& b, const TensorImpl& like) {
  if (row_major(like)) return transposed(op(OpId::Matmul, b, a));
  return op(OpId::Matmul, a, b);
}

// `t` (a view of a whole native carrier) over a Float32 copy of that carrier, widened exactly; `t` itself when
// it is Float32. A 16-bit cotangent would reach backward's seed copy, which converts slot by slot.
TensorPtr widened(const TensorPtr& t) {
  if (t->dtype().id() == DTypeId::Float32) return t;
  const int64_t n = t->carrier->size();
  auto c = std::make_shared<CPUCarrier>(n, DType::Float32(), true, /*empty=*/true);
  const auto* src = reinterpret_cast<const uint16_t*>(t->carrier->native_data());
  auto* dst = reinterpret_cast<float*>(c->mutable_native_data());
  if (t->dtype().id() == DTypeId::BFloat16) detail::bf16_to_f32(src, dst, n);
  else detail::f16_to_f32(src, dst, n);
  return make_tensor(std::move(c), t->offset, t->layout);
}

// The hold on tile `e` of the weight's .grad, to add a dW laid out as `dw_layout` (a (rows, cols, 1) layout of
// `size` elements) into it in place: when that tile is resident, nobody but the leaf holds the gradient and dW's
// memory is in the tile buffer's order, what backward through the tile's projection would do (a Float32 sum,
// rounded once to a 16-bit .grad), without the fresh one-tile gradient in between (Note [A sparse MoE block]).
// `gd` is the gradient's dtype. nullptr, changing nothing, otherwise. With `promote`, a tile that is not resident
// (an implicit zero, or written to its secondary tier) is promoted first and then held (hold_in_turn), as the
// optimizers hold gradient tiles; `was_zero` (when given) then says whether the tile was an implicit zero before
// (its buffer holds zeros: nothing but this thread adds into a gradient nobody else references).
std::unique_ptr<TiledInternals::TileWrite> hold_resident_gradient(const Weight& w, int64_t e, const Layout& dw_layout,
                                                                  int64_t size, DTypeId& gd, bool promote = false,
                                                                  bool* was_zero = nullptr) {
  const TensorPtr& leaf = w.full;
  TensorPtr current;
  {
    std::lock_guard lock(leaf->mutex);
    if (leaf->node) return nullptr;
    current = leaf->grad;
  }
  // The same conditions as the projection's gradient sink (Note [Gradient sinks]): `current` is held here once
  // beside the leaf's .grad, and its carrier by nobody else.
  if (!current || current.use_count() != 2 || !current->carrier->is_mutable() || current->carrier->is_owned() ||
      current->carrier == leaf->carrier || !(current->layout == leaf->layout) || current->offset != leaf->offset)
    return nullptr;
  const auto* raw = dynamic_cast<const TiledEvictable*>(current->carrier.get());
  if (!raw || raw->is_released() || raw->grid_shape() != w.carrier->grid_shape() ||
      raw->tile_shape() != w.carrier->tile_shape() || !TiledInternals::only_reference_is(*raw, current->carrier))
    return nullptr;
  auto acc = std::static_pointer_cast<TiledEvictable>(current->carrier);  // checked before this reference
  gd = acc->dtype().id();
  if ((gd != DTypeId::Float32 && acc->dtype() != leaf->dtype()) || size != acc->tile_size()) return nullptr;
  if (!TileAccess(*acc, *current).buffer_order_is(dw_layout)) return nullptr;
  const int64_t index = acc->tile_index({0, 0, e});
  if (was_zero) *was_zero = acc->tile_state(acc->tile_coord(index)).location == TileLocation::Implicit;
  if (promote) return TiledInternals::hold_in_turn(*acc, index, "add a SparseMoE weight gradient into");
  return TiledInternals::hold_tile_for_update(*acc, index);
}

// Adds dW (a (rows, cols) tensor over a whole native carrier of one tile's size) into tile `e` of the weight's
// .grad in place (hold_resident_gradient, promoting the tile first where it is not resident). False, changing
// nothing, when that cannot be done.
bool add_into_resident_gradient(const Weight& w, int64_t e, const TensorPtr& dW) {
  if (dW->offset != 0 || !dW->carrier->native_data()) return false;
  DTypeId gd = DTypeId::Float32;
  std::unique_ptr<TiledInternals::TileWrite> write =
      hold_resident_gradient(w, e, compact_of(dW)->layout, dW->carrier->size(), gd, /*promote=*/true);
  if (!write) return false;
  const int64_t n = dW->carrier->size();
  const std::vector<float> d = floats_of(*make_tensor(dW->carrier, 0, column_major(Shape::flat({n}))));
  if (gd == DTypeId::Float32) {
    float* g = write->data();
    for (int64_t i = 0; i < n; ++i) g[i] += d[static_cast<size_t>(i)];
  } else {  // widened, added in Float32, rounded once
    auto* g = reinterpret_cast<uint16_t*>(write->data());
    constexpr int64_t kBlock = 4096;
    float buf[kBlock];
    for (int64_t b = 0; b < n; b += kBlock) {
      const int64_t m = std::min(kBlock, n - b);
      if (gd == DTypeId::BFloat16) detail::bf16_to_f32(g + b, buf, m);
      else detail::f16_to_f32(g + b, buf, m);
      for (int64_t i = 0; i < m; ++i) buf[i] += d[static_cast<size_t>(b + i)];
      if (gd == DTypeId::BFloat16) detail::f32_to_bf16(buf, g + b, m);
      else detail::f32_to_f16(buf, g + b, m);
    }
  }
  write->commit();
  return true;
}

// Note [Weight gradients of 16-bit experts]: dW = a b^T for 16-bit a (ra, n) and b (rb, n) (n routed tokens),
// computed by the same 16-bit product as matmul (half_gemm, Float32 sums, each element's sum in the same order
// whatever columns it is computed with) and rounded once to the block's dtype, as matmul's result is: the values
// are those of product_like. What differs is where they go: no zeroed Float32 result, no 16-bit result tensor and
// no widened copy of it (three passes over a tile-sized buffer per product). The product runs in blocks of
// columns, each rounded and then either stored (a Float32 tensor holding values of the block's dtype: what
// backward's projection VJP would get from `widened`) or added straight into a resident gradient tile (a Float32
// sum, rounded once to a 16-bit .grad: add_into_resident_gradient's arithmetic).
// A gradient tile that was an implicit zero is stored into rather than added to (0 + x = x, but for -0, which a
// first gradient keeps, as backward's conversion of a fresh tiled gradient does).
enum class Into { Store, AddFloat32, AddHalf, StoreHalf };

// `a` (ra x n) and `b` (rb x n) hold 16-bit values with the token index contiguous (row r at r * n). Writes the
// (ra, rb) product in the order of `like` (row-major when it is: the tile's own order) into `dst`.
void product16_into(detail::HalfKind kind, const uint16_t* a, int64_t ra, const uint16_t* b, int64_t rb, int64_t n,
                    bool row_major_like, float* dst, Into into) {
  // Column-major C (m, cols) = A B^T as matmul computes it: product_like's Matmul(b, a) for a row-major tile.
  const uint16_t* A = row_major_like ? b : a;
  const uint16_t* B = row_major_like ? a : b;
  const int64_t m = row_major_like ? rb : ra, cols = row_major_like ? ra : rb;
  const bool bf = kind == detail::HalfKind::BFloat16;
  constexpr int64_t kCols = 16;
  const int64_t blocks = (cols + kCols - 1) / kCols;
  detail::parallel_for(blocks, 1, [&](int64_t b0, int64_t b1) {
    std::vector<float> buf, wide;
    std::vector<uint16_t> bits;
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t j0 = blk * kCols, nj = std::min(kCols, cols - j0), count = m * nj;
      float* out = into == Into::Store || into == Into::AddFloat32 ? dst + j0 * m : nullptr;  // a Float32 tile
      float* c = out;
      if (into != Into::Store) {  // a 16-bit tile, or one added to: the block's product in a buffer first
        buf.resize(static_cast<size_t>(count));
        c = buf.data();
      }
      if (n > 0) detail::half_gemm(kind, m, nj, n, A, n, B + j0 * n, n, c, 1, m, false);
      else std::fill(c, c + count, 0.0f);
      bits.resize(static_cast<size_t>(count));
      if (into == Into::StoreHalf) {  // rounded once, straight into the 16-bit tile
        auto* g = reinterpret_cast<uint16_t*>(dst) + j0 * m;
        if (bf) detail::f32_to_bf16(c, g, count);
        else detail::f32_to_f16(c, g, count);
        continue;
      }
      if (bf) {
        detail::f32_to_bf16(c, bits.data(), count);
        detail::bf16_to_f32(bits.data(), c, count);
      } else {
        detail::f32_to_f16(c, bits.data(), count);
        detail::f16_to_f32(bits.data(), c, count);
      }
      if (into == Into::AddFloat32) {
        for (int64_t i = 0; i < count; ++i) out[i] += c[i];
      } else if (into == Into::AddHalf) {
        auto* g = reinterpret_cast<uint16_t*>(dst) + j0 * m;
        wide.resize(static_cast<size_t>(count));
        if (bf) detail::bf16_to_f32(g, wide.data(), count);
        else detail::f16_to_f32(g, wide.data(), count);
        for (int64_t i = 0; i < count; ++i) wide[static_cast<size_t>(i)] += c[i];
        if (bf) detail::f32_to_bf16(wide.data(), g, count);
        else detail::f32_to_f16(wide.data(), g, count);
      }
    }
  });
}

// The weight gradient a b^T of expert `e`'s tile `tile` (Note [Weight gradients of 16-bit experts]) into the
// weight's tiled .grad: added in place where the gradient tile is resident, otherwise through the tile's
// projection node (backward of a Float32 dW holding values of the block's dtype).
void weight_gradient16(detail::HalfKind kind, const Weight& w, int64_t e, const TensorPtr& compact,
                       const TensorImpl& like, const std::vector<uint16_t>& a, int64_t ra,
                       const std::vector<uint16_t>& b, int64_t rb, int64_t n) {
  const bool rm = row_major(like);
  const Layout layout = rm ? Layout(Shape::flat({ra, rb}), Stride::flat({rb, 1}))
                           : Layout(Shape::flat({ra, rb}), Stride::flat({1, ra}));
  const Layout compact_layout(Shape::flat({ra, rb, 1}),
                              Stride::flat({layout.flat().strides[0], layout.flat().strides[1], ra * rb}));
  DTypeId gd = DTypeId::Float32;
  bool zero = false;
  if (std::unique_ptr<TiledInternals::TileWrite> write =
          hold_resident_gradient(w, e, compact_layout, ra * rb, gd, /*promote=*/true, &zero)) {
    const Into into = gd == DTypeId::Float32 ? (zero ? Into::Store : Into::AddFloat32)
                                             : (zero ? Into::StoreHalf : Into::AddHalf);
    product16_into(kind, a.data(), ra, b.data(), rb, n, rm, write->data(), into);
    write->commit();
    return;
  }
  auto c = std::make_shared<CPUCarrier>(ra * rb, DType::Float32(), true, /*empty=*/true);
  product16_into(kind, a.data(), ra, b.data(), rb, n, rm, reinterpret_cast<float*>(c->mutable_native_data()),
                 Into::Store);
  backward(compact, make_tensor(std::move(c), 0, compact_layout), false);
}

// The 16-bit bits of `v` (values of that dtype already: exact).
std::vector<uint16_t> bits_of(const std::vector<float>& v, DTypeId dtype) {
  std::vector<uint16_t> out(v.size());
  if (dtype == DTypeId::BFloat16) detail::f32_to_bf16(v.data(), out.data(), static_cast<int64_t>(v.size()));
  else detail::f32_to_f16(v.data(), out.data(), static_cast<int64_t>(v.size()));
  return out;
}

// lhs (n, rows) times a weight tile (rows, cols), contracted over the tile's rows: (n, cols) in Float32, column-major.
// `lhs` holds values of the block's dtype. A 16-bit tile is widened (exactly) into `scratch` first, so that BLAS
// reads it in its own order: a 16-bit product would pack the tile transposed (its contiguous index is not the
// contracted one), which costs more than widening. Float32 sums either way, as the 16-bit product's.
std::vector<float> times_tile(const std::vector<float>& lhs, int64_t n, const TensorPtr& tile,
                              std::shared_ptr<CPUCarrier>& scratch) {
  TensorPtr w = tile;
  const DTypeId td = tile->dtype().id();
  if (td != DTypeId::Float32 && row_major(*tile) && tile->carrier->native_data()) {
    // A few rows: the tile read where it lies, widened in registers (Note [Few rows times a row-major 16-bit
    // matrix] in half.cpp); a Float32 sum of the same exact products, in order of the tile's rows.
    const FlatLayout& f = tile->layout.flat();
    const auto* src = reinterpret_cast<const uint16_t*>(tile->carrier->native_data()) + tile->offset;
    std::vector<float> out(static_cast<size_t>(n * f.extents[1]));
    if (detail::rows_times_half(td == DTypeId::BFloat16 ? detail::HalfKind::BFloat16 : detail::HalfKind::Float16, n,
                                f.extents[1], f.extents[0], lhs.data(), src, f.strides[0], out.data()))
      return out;
  }
  if (tile->dtype().id() != DTypeId::Float32) {
    const int64_t size = tile->carrier->size();
    if (!scratch || scratch->size() != size)
      scratch = std::make_shared<CPUCarrier>(size, DType::Float32(), true, /*empty=*/true);
    const auto* src = reinterpret_cast<const uint16_t*>(tile->carrier->native_data());
    auto* dst = reinterpret_cast<float*>(scratch->mutable_native_data());
    if (tile->dtype().id() == DTypeId::BFloat16) detail::bf16_to_f32(src, dst, size);
    else detail::f16_to_f32(src, dst, size);
    w = make_tensor(scratch, tile->offset, tile->layout);
  }
  return floats_of(*op(OpId::Matmul, tensor_of(lhs, n, tile->layout.flat().extents[0], DType::Float32()), transposed(w)));
}

// One value rounded to `dtype` (Float32: as is).
inline float round1(float v, DTypeId dtype) {
  if (dtype == DTypeId::BFloat16) return detail::bf16_to_float(detail::float_to_bf16(v));
  if (dtype == DTypeId::Float16) return detail::f16_to_float(detail::float_to_f16(v));
  return v;
}

struct ExpertRecord {
  int64_t expert = 0;
  std::vector<int32_t> tokens;
  std::vector<int64_t> positions;  // t + T j
  TensorPtr token_tensor;          // Int32 (n,)
  TensorPtr h1, h3, y;             // (n, I), (n, I), (n, H), the block's dtype
};

struct ExpertsNode final : Node {
  std::shared_ptr<MoEShared> s;
  TensorPtr x, weights;
  int64_t tokens = 0;
  std::vector<ExpertRecord> records;  // in forward order
  // The routed experts' tiles of w1, w2, w3 (Note [Gradient reservations]): each finished as delivered once its
  // gradients are in the tiled .grad (an optimizer stepping in backward steps the expert then).
  std::array<GradientReservation, 3> reservations;

  std::vector<TensorPtr> apply(const TensorPtr& g) override;
  void release_saved() override {
    saved.clear();
    records.clear();
    x = weights = nullptr;
    for (auto& r : reservations) r.finish_all(false);
  }
};

std::vector<TensorPtr> ExpertsNode::apply(const TensorPtr& g) {
  MoEShared& st = *s;
  std::lock_guard lock(st.call_mutex);
  st.settle_prefetches();
  const int64_t T = tokens, H = st.hidden, I = st.inter;
  const DTypeId bd = st.dtype->id();
  const std::vector<float> gv = floats_of(*g);        // (T, H) column-major
  const std::vector<float> wv = floats_of(*weights);  // (T, k) column-major
  std::vector<float> dx(static_cast<size_t>(T * H), 0.0f);
  std::vector<double> dw(wv.size(), 0.0);
  const int64_t depth = st.depth(true);
  std::deque<ExpertTiles> window;
  std::shared_ptr<CPUCarrier> scratch;  // a 16-bit tile widened (times_tile), reused from expert to expert
  size_t next = 0;  // records are visited from the last
  const size_t count = records.size();
  for (size_t i = 0; i < count; ++i) {
    while (next < count && next <= i + static_cast<size_t>(depth)) {
      window.push_back(start_expert(st, records[count - 1 - next].expert, /*record=*/true));
      ++next;
    }
    ExpertTiles& tiles = window.front();
    finish_expert(st, tiles);
    const ExpertRecord& r = records[count - 1 - i];
    const auto n = static_cast<int64_t>(r.tokens.size());
    // dY = g[tokens] w (the block's dtype), dw = <g_t, y_t>.
    const std::vector<float> yf = floats_of(*r.y);
    std::vector<float> dy(static_cast<size_t>(n * H));
    for (int64_t q = 0; q < n; ++q) {
      const int64_t t = r.tokens[static_cast<size_t>(q)];
      const float w = wv[static_cast<size_t>(r.positions[static_cast<size_t>(q)])];
      double dot = 0;
      for (int64_t h = 0; h < H; ++h) {
        const float gt = gv[static_cast<size_t>(t + T * h)];
        dy[static_cast<size_t>(q + n * h)] = gt * w;
        dot += static_cast<double>(gt) * yf[static_cast<size_t>(q + n * h)];
      }
      dw[static_cast<size_t>(r.positions[static_cast<size_t>(q)])] += dot;
    }
    round_to(dy, *st.dtype);  // rounded once to the block's dtype
    // dA = dY W2 (n, I); a = silu(h1); dh3 = dA * a; dh1 = (dA * h3) silu'(h1).
    std::vector<float> daf = times_tile(dy, n, tiles.matrix[1], scratch);
    round_to(daf, *st.dtype);
    TensorPtr a = op(OpId::Silu, r.h1);
    const std::vector<float> af = floats_of(*a), h1f = floats_of(*r.h1), h3f = floats_of(*r.h3);
    std::vector<float> dh1(daf.size()), dh3(daf.size());
    for (size_t p = 0; p < daf.size(); ++p) {
      dh3[p] = daf[p] * af[p];
      dh1[p] = detail::silu_grad_of(round1(daf[p] * h3f[p], bd), h1f[p]);
    }
    round_to(dh1, *st.dtype);
    round_to(dh3, *st.dtype);
    // Weight gradients, each in its tile's order.
    TensorPtr xe;
    {
      GradModeGuard off(false);
      xe = index_select(x, 0, r.token_tensor);
    }
    TensorPtr hh = op(OpId::ElementwiseMul, a, r.h3);
    const bool half = bd != DTypeId::Float32;
    TensorPtr dW[3];
    if (!half) {
      const TensorPtr dyt = tensor_of(dy, n, H, *st.dtype), dh1t = tensor_of(dh1, n, I, *st.dtype),
                      dh3t = tensor_of(dh3, n, I, *st.dtype);
      dW[0] = product_like(transposed(dh1t), transposed(xe), *tiles.matrix[0]);
      dW[1] = product_like(transposed(dyt), transposed(hh), *tiles.matrix[1]);
      dW[2] = product_like(transposed(dh3t), transposed(xe), *tiles.matrix[2]);
    }
    // dx_e = dh1 W1 + dh3 W3, summed in Float32 and rounded once (PyTorch's product with the fused [W1; W3]).
    std::vector<float> dxe = times_tile(dh1, n, tiles.matrix[0], scratch);
    const std::vector<float> dx3 = times_tile(dh3, n, tiles.matrix[2], scratch);
    for (size_t p = 0; p < dxe.size(); ++p) dxe[p] += dx3[p];
    round_to(dxe, *st.dtype);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t q = 0; q < n; ++q)
        dx[static_cast<size_t>(r.tokens[static_cast<size_t>(q)] + T * h)] += dxe[static_cast<size_t>(q + n * h)];
    // Into the tiled gradients, through each tile's projection node.
    if (half) {  // Note [Weight gradients of 16-bit experts]
      const detail::HalfKind kind = bd == DTypeId::BFloat16 ? detail::HalfKind::BFloat16 : detail::HalfKind::Float16;
      // Each (rows, n) operand with the token index contiguous: the column-major (n, rows) values as they are.
      const std::vector<uint16_t> xb = bits_of(floats_of(*xe), bd), hb = bits_of(floats_of(*hh), bd);
      const std::vector<uint16_t> d1 = bits_of(dh1, bd), d2 = bits_of(dy, bd), d3 = bits_of(dh3, bd);
      weight_gradient16(kind, st.w[0], r.expert, tiles.compact[0], *tiles.matrix[0], d1, I, xb, H, n);
      weight_gradient16(kind, st.w[1], r.expert, tiles.compact[1], *tiles.matrix[1], d2, H, hb, I, n);
      weight_gradient16(kind, st.w[2], r.expert, tiles.compact[2], *tiles.matrix[2], d3, I, xb, H, n);
    } else {
      for (size_t k = 0; k < 3; ++k)
        if (!add_into_resident_gradient(st.w[k], r.expert, dW[k]))
          backward(tiles.compact[k], compact_of(widened(dW[k])), false);
    }
    // The projections' own reservations (Note [Gradient reservations]) end here, not when their last reference
    // goes (an I/O thread may still hold a completion's copy for a while): a gradient added in place above never
    // ran through a projection node, and a reservation of it finishing after the expert's own delivered finish
    // below would leave an optimizer stepping in backward waiting for a use that has already delivered. Ending
    // one that ran in backward again changes nothing.
    for (const TensorPtr& c : tiles.compact) {
      std::shared_ptr<Node> node;
      {
        std::lock_guard l(c->mutex);
        node = c->node;
      }
      if (node) node->release_saved();
    }
    window.pop_front();  // the expert's tiles go
    for (auto& res : reservations) res.finish(r.expert, true);
  }
  std::vector<float> dwf(dw.begin(), dw.end());
  const int64_t k = st.top_k;
  return {tensor_of(dx, T, H, DType::Float32()), tensor_of(dwf, T, k, DType::Float32())};
}

}  // namespace

TensorPtr run_experts(const std::shared_ptr<MoEShared>& sp, const TensorPtr& x, const TensorPtr& weights,
                      const TensorPtr& indices) {
  MoEShared& s = *sp;
  std::lock_guard lock(s.call_mutex);
  const bool record = is_grad_enabled() && (x->is_differentiable() || weights->is_differentiable());
  GradModeGuard off(false);
  s.settle_prefetches();
  const int64_t T = x->layout.flat().extents[0], H = s.hidden, k = s.top_k;
  const DTypeId bd = s.dtype->id();
  const Dispatch d = dispatch(detail::read_doubles(*indices), T, k, s.experts);
  // Reserved before any work: a refusal (Note [Gradient reservations]) changes nothing.
  std::array<GradientReservation, 3> reservations;
  if (record)
    for (size_t w = 0; w < 3; ++w) reservations[w] = s.w[w].carrier->reserve_gradients(d.experts);
  {
    std::lock_guard l(s.stats_mutex);
    s.stats.calls++;
  }
  const std::vector<float> wv = floats_of(*weights);
  std::vector<float> out(static_cast<size_t>(T * H), 0.0f);  // row-major
  std::vector<ExpertRecord> records;
  const int64_t depth = s.depth(false);
  std::deque<ExpertTiles> window;
  size_t next = 0;
  for (size_t i = 0; i < d.experts.size(); ++i) {
    while (next < d.experts.size() && next <= i + static_cast<size_t>(depth)) {
      window.push_back(start_expert(s, d.experts[next], /*record=*/false));
      ++next;
    }
    ExpertTiles& tiles = window.front();
    finish_expert(s, tiles);
    const std::vector<int32_t>& tok = d.tokens[i];
    const std::vector<int64_t>& pos = d.positions[i];
    const auto n = static_cast<int64_t>(tok.size());
    TensorPtr tok_t = int_tensor(tok);
    TensorPtr xe = index_select(x, 0, tok_t);
    TensorPtr h1 = op(OpId::Matmul, xe, tiles.matrix[0]);
    TensorPtr h3 = op(OpId::Matmul, xe, tiles.matrix[2]);
    TensorPtr y = op(OpId::Matmul, op(OpId::ElementwiseMul, op(OpId::Silu, h1), h3), tiles.matrix[1]);
    const std::vector<float> yf = floats_of(*y);  // (n, H) column-major
    for (int64_t q = 0; q < n; ++q) {
      const float w = wv[static_cast<size_t>(pos[static_cast<size_t>(q)])];
      float* row = out.data() + static_cast<size_t>(tok[static_cast<size_t>(q)]) * static_cast<size_t>(H);
      for (int64_t h = 0; h < H; ++h) row[h] = round1(row[h] + round1(yf[static_cast<size_t>(q + n * h)] * w, bd), bd);
    }
    if (record) records.push_back({d.experts[i], tok, pos, tok_t, h1, h3, y});
    window.pop_front();
  }
  auto c = std::make_shared<CPUCarrier>(T * H, *s.dtype, true, /*empty=*/true);
  std::byte* dst = c->mutable_native_data();
  if (bd == DTypeId::Float32) std::memcpy(dst, out.data(), out.size() * 4);
  else if (bd == DTypeId::BFloat16) detail::f32_to_bf16(out.data(), reinterpret_cast<uint16_t*>(dst), T * H);
  else detail::f32_to_f16(out.data(), reinterpret_cast<uint16_t*>(dst), T * H);
  TensorPtr result = make_tensor(std::move(c), 0, Layout(Shape::flat({T, H}), Stride::flat({H, 1})));
  if (record) {
    auto node = std::make_shared<ExpertsNode>();
    node->name = "sparse_moe_experts";
    node->dispatch_kind = &cpu_kind();
    node->inputs = {x, weights};
    node->save(x);
    node->save(weights);
    node->s = sp;
    node->x = x;
    node->weights = weights;
    node->tokens = T;
    node->records = std::move(records);
    node->reservations = std::move(reservations);
    attach_node(node, result);
  }
  return result;
}

}  // namespace sw::moe
