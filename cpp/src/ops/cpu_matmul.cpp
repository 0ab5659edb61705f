// The CPU matmul: BLAS (OpenBLAS) views of the operands as they lie, the skinny kernels (skinny_gemm.cpp), products
// block by block over nested modes, 16-bit products (half.hpp), exact Int32 and mixed-dtype products.
#include <cblas.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <mutex>
#include <optional>
#include <span>

#include "half.hpp"
#include "kernels.hpp"
#include "skinny_gemm.hpp"
#include "strided.hpp"
#include "strideweave/errors.hpp"

namespace sw::detail {

namespace {

// Packs a 2-mode tensor into a dense column-major rows x cols buffer of C.
template <class C>
std::vector<C> pack(const TensorImpl& t, int64_t rows, int64_t cols) {
  std::vector<C> out(static_cast<size_t>(rows * cols));
  std::array<const std::vector<int64_t>*, 1> strides{&t.layout.flat().strides};
  auto plan = StridedPlan<1>::make(t.layout.flat().extents, strides, {t.offset});
  visit_dtype(t.dtype().id(), [&](auto tag) {
    using T = decltype(tag);
    if constexpr (!std::is_same_v<T, double>) {
      const T* x = reinterpret_cast<const T*>(t.carrier->native_data());
      plan.for_each_run(0, plan.size, [&](int64_t ord, const std::array<int64_t, 1>& off, int64_t n,
                                          const std::array<int64_t, 1>& st) {
        for (int64_t i = 0; i < n; ++i) out[ord + i] = C(x[off[0] + i * st[0]]);
      });
    }
  });
  return out;
}

// A BLAS view of a column-major-or-transposed matrix at `p`: mode 0 (e0, s0), mode 1 (e1, s1), one of them of
// unit stride (an extent-1 mode counts as unit stride).
bool blas_view_of(const float* p, int64_t e0, int64_t s0, int64_t e1, int64_t s1, const float*& ptr, bool& transposed,
                  int& ld) {
  if (e0 == 1) s0 = 1;
  if (e1 == 1) s1 = 1;
  ptr = p;
  if (s0 == 1 && (e1 == 1 || s1 >= std::max<int64_t>(1, e0))) {
    transposed = false;
    ld = static_cast<int>(std::max<int64_t>(e1 == 1 ? e0 : s1, 1));
    return true;
  }
  if (s1 == 1 && (e0 == 1 || s0 >= std::max<int64_t>(1, e1))) {
    transposed = true;
    ld = static_cast<int>(std::max<int64_t>(e0 == 1 ? e1 : s0, 1));
    return true;
  }
  return false;
}

// A BLAS view of a Float32 2-mode tensor without copying, when each mode is one
// leaf and one of them has unit stride. Returns false otherwise.
bool blas_view(const TensorImpl& t, const float*& ptr, bool& transposed, int& ld) {
  if (t.dtype().id() != DTypeId::Float32 || t.layout.rank() != 2) return false;
  int64_t s[2], e[2];
  for (size_t k = 0; k < 2; ++k) {
    auto leaf = t.layout.mode_as_leaf(k);
    if (!leaf) return false;
    e[k] = leaf->first;
    s[k] = leaf->second;
  }
  return blas_view_of(reinterpret_cast<const float*>(t.carrier->native_data()) + t.offset, e[0], s[0], e[1], s[1], ptr,
                      transposed, ld);
}

// Note [BLAS threads]: OpenBLAS runs its calls on its own worker threads, and
// after each call those workers spin (yielding) for a while waiting for the
// next one. Between BLAS calls the kernels here run on the compute pool, and
// I/O on the executors; on a 2-core machine a spinning BLAS worker takes one
// of the two cores from them (a quarter of all CPU samples of the MoE
// example went to that spinning). So OpenBLAS is asked for one thread, and a
// large product is split here into column (or row) blocks of C, one
// single-threaded BLAS call per compute thread: the same split OpenBLAS makes
// itself, with threads that sleep when idle.
void blas_single_threaded() {
  static std::once_flag once;
  std::call_once(once, [] { openblas_set_num_threads(1); });
}

// C = sum over blocks i of op(A_i) op(B_i), each block an inner dimension of k (one block: one product), plus
// beta C. The threads split C once; each part runs the blocks one after another (beta 1 after the first).
template <class T, class Gemm>
void gemm_split_blocks(Gemm gemm, bool a_trans, bool b_no_trans, int64_t m, int64_t n, int64_t k,
                       std::span<const T* const> As, int lda, std::span<const T* const> Bs, int ldb, T* C, T beta) {
  blas_single_threaded();
  const auto ta = a_trans ? CblasTrans : CblasNoTrans;
  const auto tb = b_no_trans ? CblasNoTrans : CblasTrans;
  constexpr int64_t kFlopsPerPart = int64_t{1} << 23;
  const int64_t blocks = static_cast<int64_t>(As.size());
  const int64_t parts =
      std::min<int64_t>(compute_threads(), std::max<int64_t>(1, 2 * m * n * k * blocks / kFlopsPerPart));
  const bool by_columns = n >= m;
  const int64_t extent = by_columns ? n : m;
  parallel_for(extent, std::max<int64_t>(1, extent / std::max<int64_t>(parts, 1)), [&](int64_t b, int64_t e) {
    for (size_t i = 0; i < As.size(); ++i) {
      const T* A = As[i];
      const T* B = Bs[i];
      const T bi = i == 0 ? beta : T(1);
      if (by_columns) {  // C[:, b:e] = op(A) op(B)[:, b:e]; op(B) column j is B row j (Trans) or column j (NoTrans)
        const T* Bb = b_no_trans ? B + b * ldb : B + b;
        gemm(CblasColMajor, ta, tb, static_cast<int>(m), static_cast<int>(e - b), static_cast<int>(k), T(1), A, lda,
             Bb, ldb, bi, C + b * m, static_cast<int>(m));
      } else {  // C[b:e, :] = op(A)[b:e, :] op(B)
        const T* Ab = a_trans ? A + b * lda : A + b;
        gemm(CblasColMajor, ta, tb, static_cast<int>(e - b), static_cast<int>(n), static_cast<int>(k), T(1), Ab, lda,
             B, ldb, bi, C + b, static_cast<int>(m));
      }
    }
  });
}

template <class T, class Gemm>
void gemm_split(Gemm gemm, bool a_trans, bool b_no_trans, int64_t m, int64_t n, int64_t k, const T* A, int lda,
                const T* B, int ldb, T* C, T beta = T(0)) {
  gemm_split_blocks<T>(gemm, a_trans, b_no_trans, m, n, k, std::span<const T* const>(&A, 1), lda,
                       std::span<const T* const>(&B, 1), ldb, C, beta);
}

// C (m x n) = A B^T (or C += ...): the skinny kernels where they apply, split BLAS calls for the rest.
void sgemm_block(int64_t m, int64_t n, int64_t k, const float* A, bool ta, int lda, const float* B, bool tb, int ldb,
                 float* C, bool accumulate) {
  // Few rows or a short inner dimension: see Note [Skinny products].
  if (detail::skinny_sgemm(m, n, k, A, ta ? lda : 1, ta ? 1 : lda, B, tb ? ldb : 1, tb ? 1 : ldb, C, accumulate))
    return;
  // C (m x n) = A (m x k) * B^T, B stored (n x k): op(B) = B^T.
  gemm_split<float>(cblas_sgemm, ta, tb, m, n, k, A, lda, B, ldb, C, accumulate ? 1.0f : 0.0f);
}

// The leaves of extent > 1 of top-level mode k, at most `most` of them (none beyond: nullopt).
std::optional<std::vector<std::pair<int64_t, int64_t>>> mode_leaves(const Layout& layout, size_t k, size_t most) {
  size_t first = 0;
  for (size_t j = 0; j < k; ++j) {
    const IntTuple& mode = layout.shape().tree()[j];
    first += mode.is_leaf() ? 1 : mode.leaf_count();
  }
  const IntTuple& mode = layout.shape().tree()[k];
  const size_t count = mode.is_leaf() ? 1 : mode.leaf_count();
  std::vector<std::pair<int64_t, int64_t>> out;
  for (size_t j = first; j < first + count; ++j) {
    if (layout.flat().extents[j] == 1) continue;
    if (out.size() == most) return std::nullopt;
    out.emplace_back(layout.flat().extents[j], layout.flat().strides[j]);
  }
  return out;
}

// One mode split into `count` blocks of `inner` coordinates: block j starts `j * step` slots on, and steps `stride`
// within.
struct ModeBlocks {
  int64_t inner = 1, count = 1, stride = 1, step = 0;
};

// Mode leaves (at most two) as blocks of `inner` coordinates (0: the first leaf's extent, or the whole mode).
std::optional<ModeBlocks> blocks_of(const std::vector<std::pair<int64_t, int64_t>>& leaves, int64_t extent,
                                    int64_t inner) {
  ModeBlocks b;
  if (leaves.empty()) {
    b.inner = extent;
    return b;
  }
  if (leaves.size() == 1) {
    b.inner = inner ? inner : extent;
    b.stride = leaves[0].second;
    b.count = extent / b.inner;
    b.step = b.inner * b.stride;
    return b;
  }
  if (inner && leaves[0].first != inner) return std::nullopt;
  b.inner = leaves[0].first;
  b.stride = leaves[0].second;
  b.count = leaves[1].first;
  b.step = leaves[1].second;
  return b;
}

// Note [Products over nested modes]: a tile-major projection (Note [Tile-major projections] in
// cpp/src/tiled/tile_copies.hpp) has a nested mode (tile extent, count): two row-major experts side by side are
// (out, (in, 2)) : (in, (1, out x in)), no BLAS matrix. Packing such an operand costs more than the product of a
// few tokens (3x the product's time for 64 tokens and two (512, 256) experts). Instead the product runs block by
// block: a nested contraction mode (k) is a sum of products over its blocks, accumulated into C (beta 1 after the
// first), the other operand's contraction mode cut into the same blocks; a nested rhs mode (n) is column blocks
// of C, which C's column-major order keeps contiguous. Each block is a BLAS view (or a skinny kernel) of the
// operands as they lie; blocks too large for the skinny kernels share one split of C over the threads, each part
// summing its contraction blocks (one parallel region, not one per block: the nested product then runs at the
// flat one's speed). The rounding is that of a product whose sum runs block after block: still a sum of k
// products accumulated in Float32, the bound of a k-term sum.
bool sgemm_blocks(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, float* C,
                  bool accumulate) {
  if (lhs.dtype().id() != DTypeId::Float32 || rhs.dtype().id() != DTypeId::Float32 || lhs.layout.rank() != 2 ||
      rhs.layout.rank() != 2)
    return false;
  auto lm = mode_leaves(lhs.layout, 0, 1), lk = mode_leaves(lhs.layout, 1, 2);
  auto rn = mode_leaves(rhs.layout, 0, 2), rk = mode_leaves(rhs.layout, 1, 2);
  if (!lm || !lk || !rn || !rk || (lk->size() < 2 && rk->size() < 2 && rn->size() < 2)) return false;
  const int64_t kin = lk->size() == 2 ? (*lk)[0].first : rk->size() == 2 ? (*rk)[0].first : 0;
  auto kl = blocks_of(*lk, k, kin), kr = blocks_of(*rk, k, kin), nb = blocks_of(*rn, n, 0);
  if (!kl || !kr || !nb || kl->count != kr->count || kl->inner * kl->count != k || nb->inner * nb->count != n)
    return false;
  const float* a0 = reinterpret_cast<const float*>(lhs.carrier->native_data()) + lhs.offset;
  const float* b0 = reinterpret_cast<const float*>(rhs.carrier->native_data()) + rhs.offset;
  const int64_t ms = lm->empty() ? 1 : (*lm)[0].second;
  struct Block {
    const float *A, *B;
    bool ta, tb;
    int lda, ldb;
  };
  std::vector<Block> blocks;
  for (int64_t j = 0; j < nb->count; ++j)
    for (int64_t p = 0; p < kl->count; ++p) {
      Block b{};
      if (!blas_view_of(a0 + p * kl->step, m, ms, kl->inner, kl->stride, b.A, b.ta, b.lda) ||
          !blas_view_of(b0 + j * nb->step + p * kr->step, nb->inner, nb->stride, kr->inner, kr->stride, b.B, b.tb,
                        b.ldb))
        return false;
      blocks.push_back(b);
    }
  // The blocks of one column block alike (one BLAS view pattern, shifted) and too large for the skinny kernels:
  // one split of C over the threads, each part summing the contraction blocks.
  bool alike = true;
  for (const Block& b : blocks)
    alike &= b.ta == blocks[0].ta && b.tb == blocks[0].tb && b.lda == blocks[0].lda && b.ldb == blocks[0].ldb;
  const Block& first = blocks[0];
  if (alike && !*detail::skinny_sgemm_path(m, nb->inner, kl->inner, first.tb ? first.ldb : 1, first.tb ? 1 : first.ldb)) {
    std::vector<const float*> as(static_cast<size_t>(kl->count)), bs(static_cast<size_t>(kl->count));
    for (int64_t j = 0; j < nb->count; ++j) {
      for (int64_t p = 0; p < kl->count; ++p) {
        as[static_cast<size_t>(p)] = blocks[static_cast<size_t>(j * kl->count + p)].A;
        bs[static_cast<size_t>(p)] = blocks[static_cast<size_t>(j * kl->count + p)].B;
      }
      gemm_split_blocks<float>(cblas_sgemm, first.ta, first.tb, m, nb->inner, kl->inner, as, first.lda, bs, first.ldb,
                               C + j * nb->inner * m, accumulate ? 1.0f : 0.0f);
    }
    return true;
  }
  size_t i = 0;
  for (int64_t j = 0; j < nb->count; ++j)
    for (int64_t p = 0; p < kl->count; ++p, ++i) {
      const Block& b = blocks[i];
      sgemm_block(m, nb->inner, kl->inner, b.A, b.ta, b.lda, b.B, b.tb, b.ldb, C + j * nb->inner * m,
                  accumulate || p > 0);
    }
  return true;
}

// C (m x n) = lhs rhs^T (or C += ... with `accumulate`) for Float32 operands:
// BLAS views of the operands where their layouts allow, block by block over nested modes
// (Note [Products over nested modes]), packed copies otherwise.
void sgemm_views(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, float* C,
                 bool accumulate) {
  const float *A, *B;
  bool ta, tb;
  int lda, ldb;
  std::vector<float> pa, pb;
  const bool la = blas_view(lhs, A, ta, lda), rb = blas_view(rhs, B, tb, ldb);
  if ((!la || !rb) && m > 0 && n > 0 && k > 0 && sgemm_blocks(lhs, rhs, m, n, k, C, accumulate)) return;
  if (!la) {
    pa = pack<float>(lhs, m, k);
    A = pa.data();
    ta = false;
    lda = static_cast<int>(m);
  }
  if (!rb) {
    pb = pack<float>(rhs, n, k);
    B = pb.data();
    tb = false;
    ldb = static_cast<int>(n);
  }
  sgemm_block(m, n, k, A, ta, lda, B, tb, ldb, C, accumulate);
}

}  // namespace

bool cpu_matmul_accumulate(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, float* out) {
  if (lhs.dtype().id() != DTypeId::Float32 || rhs.dtype().id() != DTypeId::Float32 || !lhs.carrier->native_data() ||
      !rhs.carrier->native_data() || m < 1 || n < 1)
    return false;
  if (k == 0) return true;  // adds nothing
  sgemm_views(lhs, rhs, m, n, k, out, true);
  return true;
}

// ---------------------------------------------------------------- 16-bit products
//
// matmul of two BFloat16 (or two Float16) operands: half_gemm (Note [Products of half-precision operands] in
// half.hpp) accumulates in Float32, and the result is rounded once to the operands' dtype. half_gemm reads both
// operands inner-contiguous (the contracted index p with unit stride): a row-major lhs and a row-major (out, in)
// weight as rhs are read where they lie; an operand in another layout (a column-major one) is packed into that
// form first (a copy of that operand only).

namespace {

// Element (r, p) of a 2-mode 16-bit tensor at ptr[r * ld + p], without a copy; false when p has no unit stride.
bool inner_contiguous(const TensorImpl& t, const uint16_t*& ptr, int64_t& ld) {
  if (t.layout.rank() != 2) return false;
  auto r = t.layout.mode_as_leaf(0), p = t.layout.mode_as_leaf(1);
  if (!r || !p || (p->first > 1 && p->second != 1)) return false;
  ld = r->first > 1 ? r->second : std::max<int64_t>(p->first, 1);
  if (ld < p->first && r->first > 1) return false;  // rows overlap: not a plain matrix
  ptr = reinterpret_cast<const uint16_t*>(t.carrier->native_data()) + t.offset;
  return true;
}

// The rows x k elements of `t` packed inner-contiguous (row r at r * k): a blocked transpose when each mode is one
// strided leaf, the layout's runs otherwise.
std::vector<uint16_t> pack_inner(const TensorImpl& t, int64_t rows, int64_t k) {
  std::vector<uint16_t> out(static_cast<size_t>(rows * k));
  const auto* x = reinterpret_cast<const uint16_t*>(t.carrier->native_data());
  auto r = t.layout.rank() == 2 ? t.layout.mode_as_leaf(0) : std::nullopt;
  auto p = t.layout.rank() == 2 ? t.layout.mode_as_leaf(1) : std::nullopt;
  if (r && p) {
    const int64_t sr = r->second, sp = p->second;
    constexpr int64_t kB = 64;
    parallel_for((rows + kB - 1) / kB, 1, [&](int64_t b0, int64_t b1) {
      for (int64_t rb = b0 * kB; rb < std::min(rows, b1 * kB); rb += kB)
        for (int64_t pb = 0; pb < k; pb += kB)
          for (int64_t q = pb; q < std::min(k, pb + kB); ++q)
            for (int64_t i = rb; i < std::min(rows, rb + kB); ++i)
              out[static_cast<size_t>(i * k + q)] = x[t.offset + i * sr + q * sp];
    });
    return out;
  }
  std::array<const std::vector<int64_t>*, 1> strides{&t.layout.flat().strides};
  auto plan = StridedPlan<1>::make(t.layout.flat().extents, strides, {t.offset});
  plan.for_each_run(0, plan.size, [&](int64_t ord, const std::array<int64_t, 1>& off, int64_t n,
                                      const std::array<int64_t, 1>& st) {
    for (int64_t i = 0; i < n; ++i) {
      const int64_t o = ord + i;  // ordinal r + rows * p
      out[static_cast<size_t>((o % rows) * k + o / rows)] = x[off[0] + i * st[0]];
    }
  });
  return out;
}

void half_matmul(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, Carrier& out) {
  const HalfKind kind = lhs.dtype().id() == DTypeId::BFloat16 ? HalfKind::BFloat16 : HalfKind::Float16;
  const uint16_t *A = nullptr, *B = nullptr;
  int64_t lda = 0, ldb = 0;
  std::vector<uint16_t> pa, pb;
  if (!inner_contiguous(lhs, A, lda)) {
    pa = pack_inner(lhs, m, k);
    A = pa.data();
    lda = k;
  }
  if (!inner_contiguous(rhs, B, ldb)) {
    pb = pack_inner(rhs, n, k);
    B = pb.data();
    ldb = k;
  }
  std::vector<float> c(static_cast<size_t>(m * n), 0.0f);
  if (m > 0 && n > 0 && k > 0) half_gemm(kind, m, n, k, A, lda, B, ldb, c.data(), 1, m, false);
  auto* dst = reinterpret_cast<uint16_t*>(out.mutable_native_data());
  if (kind == HalfKind::BFloat16) f32_to_bf16(c.data(), dst, m * n);
  else f32_to_f16(c.data(), dst, m * n);
}

}  // namespace

void cpu_matmul(const TensorImpl& lhs, const TensorImpl& rhs, int64_t m, int64_t n, int64_t k, bool f64,
                Carrier& out) {
  const DTypeId ld = lhs.dtype().id(), rd = rhs.dtype().id();
  std::byte* dst = out.mutable_native_data();
  if (ld == rd && lhs.dtype().is_half() && !f64) {
    half_matmul(lhs, rhs, m, n, k, out);
    return;
  }
  if (ld == DTypeId::Int32 && rd == DTypeId::Int32 && !f64) {
    auto a = pack<int64_t>(lhs, m, k);
    auto b = pack<int64_t>(rhs, n, k);
    std::vector<int64_t> c(static_cast<size_t>(m * n), 0);
    for (int64_t j = 0; j < n; ++j)
      for (int64_t p = 0; p < k; ++p) {
        int64_t bv = b[j + p * n];
        if (!bv) continue;
        for (int64_t i = 0; i < m; ++i) {
          int64_t r;
          if (__builtin_mul_overflow(a[i + p * m], bv, &r) || __builtin_add_overflow(c[i + j * m], r, &c[i + j * m]))
            raise<OverflowError>("matmul: Int32 result overflows");
        }
      }
    bool ok = true;
    for (int64_t i = 0; i < m * n; ++i) {
      reinterpret_cast<int32_t*>(dst)[i] = static_cast<int32_t>(c[i]);
      ok &= c[i] >= std::numeric_limits<int32_t>::min() && c[i] <= std::numeric_limits<int32_t>::max();
    }
    if (!ok) raise<OverflowError>("matmul: Int32 result overflows");
    return;
  }
  if (ld == DTypeId::Float32 && rd == DTypeId::Float32 && !f64) {
    sgemm_views(lhs, rhs, m, n, k, reinterpret_cast<float*>(dst), false);
    return;
  }
  // Mixed dtypes or a Float64 accumulator: exact inputs in double, one rounding.
  auto a = pack<double>(lhs, m, k);
  auto b = pack<double>(rhs, n, k);
  std::vector<double> c(static_cast<size_t>(m * n));
  gemm_split<double>(cblas_dgemm, false, false, m, n, k, a.data(), static_cast<int>(m), b.data(), static_cast<int>(n),
                     c.data());
  if (out.dtype().id() != DTypeId::Float32) {  // a 16-bit result (a 16-bit dtype with Int32 or Bool): rounded once
    const DType& od = out.dtype();
    for (int64_t i = 0; i < m * n; ++i) store_value(od, dst + i * 2, Value::from_float(c[i]));
    return;
  }
  float* o = reinterpret_cast<float*>(dst);
  for (int64_t i = 0; i < m * n; ++i) o[i] = static_cast<float>(c[i]);
}

}  // namespace sw::detail
