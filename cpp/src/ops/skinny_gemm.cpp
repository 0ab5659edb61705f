// Direct Float32 kernels for skinny products. See Note [Skinny products] in skinny_gemm.hpp.
#include "skinny_gemm.hpp"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <utility>
#include <vector>

#include "simd_masks.hpp"
#include "strided.hpp"

#define SW_AVX512 __attribute__((target("avx512f,fma")))

// GCC 12 reports the intrinsics header's own deliberately undefined vector in
// _mm512_reduce_add_ps as used uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace sw::detail {

namespace {

bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("fma");
  return ok;
}


// Work of at least this many multiply-adds is split over threads (by output
// columns). These kernels stream a large operand from memory, and two cores
// stream it about twice as fast as one, so even a one-token product with a
// 1024 x 1024 expert (a quarter of a millisecond) is split: with the compute
// pool's workers spinning between regions (Note [Compute pool]) a region costs
// a few microseconds. In the Mixture-of-Experts example, splitting products of
// 2^18 multiply-adds and more instead of 2^21 took 6% off the step time.
constexpr int64_t kParallelFlops = int64_t{1} << 18;

template <class F>
void over_columns(int64_t blocks, int64_t work, F&& f) {
  if (work < kParallelFlops) f(int64_t{0}, blocks);
  else parallel_for(blocks, 1, f);
}

// ---------------------------------------------------------------- small m, B contiguous along j
// B's rows (fixed p, consecutive j) are read whole and in order, Q at a time, so
// the large operand streams through memory once at full bandwidth (reading it
// in column blocks instead touches a new 4 KiB page for every p, which
// defeats the hardware prefetchers). The m x (columns) partial sums live in T
// (row i at T + i * ts, at most 48 x 1024 floats: L1/L2), each updated by Q
// multiply-adds per load and store. Ap: A packed column-major (Ap[p * m + i]).
template <int Q>
SW_AVX512 void rows_step(int64_t m, const float* Ap, const float* Bp, int64_t ldb, int64_t nj, float* T, int64_t ts) {
  for (int64_t jv = 0; jv < nj; jv += 16) {
    const __mmask16 mask = lanes16(nj - jv);
    __m512 b[Q];
#pragma GCC unroll 8
    for (int q = 0; q < Q; ++q) b[q] = _mm512_maskz_loadu_ps(mask, Bp + q * ldb + jv);
    float* t = T + jv;
    for (int64_t i = 0; i < m; ++i, t += ts) {
      __m512 acc = _mm512_loadu_ps(t);
#pragma GCC unroll 8
      for (int q = 0; q < Q; ++q) acc = _mm512_fmadd_ps(_mm512_set1_ps(Ap[q * m + i]), b[q], acc);
      _mm512_storeu_ps(t, acc);
    }
  }
}

SW_AVX512 void small_m_j(int64_t m, int64_t k, const float* Ap, const float* B, int64_t ldb, float* C, int64_t jb,
                         int64_t je, bool accumulate) {
  const int64_t nj = je - jb, ts = (nj + 15) / 16 * 16;
  std::vector<float> T(static_cast<size_t>(m * ts), 0.f);
  int64_t p = 0;
  for (; p + 8 <= k; p += 8) rows_step<8>(m, Ap + p * m, B + p * ldb + jb, ldb, nj, T.data(), ts);
  for (; p < k; ++p) rows_step<1>(m, Ap + p * m, B + p * ldb + jb, ldb, nj, T.data(), ts);
  for (int64_t j = 0; j < nj; ++j) {
    float* c = C + (jb + j) * m;
    if (accumulate) {
      for (int64_t i = 0; i < m; ++i) c[i] += T[i * ts + j];
    } else {
      for (int64_t i = 0; i < m; ++i) c[i] = T[i * ts + j];
    }
  }
}

// ---------------------------------------------------------------- small m, B contiguous along p
// Ar: A packed row-major (Ar[i * k + p]). Dot products of MI rows with NJ columns (B column j at Bc + j * ldb),
// vectorised along p; writes C(i0 + ii, j0 + jj) at C[jj * m + ii].
template <int MI, int NJ>
SW_AVX512 void mp_block(int64_t k, const float* Ai, const float* Bc, int64_t ldb, float* C, int64_t m, bool accumulate) {
  __m512 acc[MI][NJ];
#pragma GCC unroll 8
  for (int ii = 0; ii < MI; ++ii)
#pragma GCC unroll 8
    for (int jj = 0; jj < NJ; ++jj) acc[ii][jj] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 16) {
    const __mmask16 mask = lanes16(k - p);
    __m512 b[NJ];
#pragma GCC unroll 8
    for (int jj = 0; jj < NJ; ++jj) b[jj] = _mm512_maskz_loadu_ps(mask, Bc + jj * ldb + p);
#pragma GCC unroll 8
    for (int ii = 0; ii < MI; ++ii) {
      const __m512 a = _mm512_maskz_loadu_ps(mask, Ai + ii * k + p);
#pragma GCC unroll 8
      for (int jj = 0; jj < NJ; ++jj) acc[ii][jj] = _mm512_fmadd_ps(a, b[jj], acc[ii][jj]);
    }
  }
#pragma GCC unroll 8
  for (int ii = 0; ii < MI; ++ii)
#pragma GCC unroll 8
    for (int jj = 0; jj < NJ; ++jj)
      C[jj * m + ii] = (accumulate ? C[jj * m + ii] : 0.f) + _mm512_reduce_add_ps(acc[ii][jj]);
}

using MpFn = void (*)(int64_t, const float*, const float*, int64_t, float*, int64_t, bool);
constexpr int kMpRows = 3, kMpCols = 8;  // 24 accumulators + 8 column loads

template <int MI, int... J>
constexpr auto mp_row(std::integer_sequence<int, J...>) {
  return std::array<MpFn, sizeof...(J)>{&mp_block<MI, J + 1>...};
}

SW_AVX512 void small_m_p(int64_t m, int64_t k, const float* Ar, const float* B, int64_t ldb, float* C, int64_t jb,
                         int64_t je, bool accumulate) {
  static constexpr std::array<std::array<MpFn, kMpCols>, kMpRows> table{
      mp_row<1>(std::make_integer_sequence<int, kMpCols>{}), mp_row<2>(std::make_integer_sequence<int, kMpCols>{}),
      mp_row<3>(std::make_integer_sequence<int, kMpCols>{})};
  for (int64_t j0 = jb; j0 < je; j0 += kMpCols) {
    const int64_t nj = std::min<int64_t>(kMpCols, je - j0);
    for (int64_t i0 = 0; i0 < m; i0 += kMpRows) {
      const int64_t mi = std::min<int64_t>(kMpRows, m - i0);
      table[mi - 1][nj - 1](k, Ar + i0 * k, B + j0 * ldb, ldb, C + j0 * m + i0, m, accumulate);
    }
  }
}

// ---------------------------------------------------------------- small k
// Ap: A packed column-major (Ap[p * m + i]); Bp: B packed with p contiguous (Bp[j * k + p]). Writes the 32-row
// (masked) by NJ-column block of C at Ci (column jj at Ci + jj * m).
template <int NJ>
SW_AVX512 void sk_block(int64_t k, int64_t m, const float* Ai, const float* Bj, __mmask16 mask0, __mmask16 mask1,
                        float* Ci, bool accumulate) {
  __m512 acc0[NJ], acc1[NJ];
#pragma GCC unroll 16
  for (int jj = 0; jj < NJ; ++jj) acc0[jj] = acc1[jj] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; ++p) {
    const __m512 a0 = _mm512_maskz_loadu_ps(mask0, Ai + p * m);
    const __m512 a1 = _mm512_maskz_loadu_ps(mask1, Ai + p * m + 16);
#pragma GCC unroll 16
    for (int jj = 0; jj < NJ; ++jj) {
      const __m512 bv = _mm512_set1_ps(Bj[jj * k + p]);
      acc0[jj] = _mm512_fmadd_ps(a0, bv, acc0[jj]);
      acc1[jj] = _mm512_fmadd_ps(a1, bv, acc1[jj]);
    }
  }
#pragma GCC unroll 16
  for (int jj = 0; jj < NJ; ++jj) {
    if (accumulate) {
      acc0[jj] = _mm512_add_ps(acc0[jj], _mm512_maskz_loadu_ps(mask0, Ci + jj * m));
      acc1[jj] = _mm512_add_ps(acc1[jj], _mm512_maskz_loadu_ps(mask1, Ci + jj * m + 16));
    }
    _mm512_mask_storeu_ps(Ci + jj * m, mask0, acc0[jj]);
    _mm512_mask_storeu_ps(Ci + jj * m + 16, mask1, acc1[jj]);
  }
}

using SkFn = void (*)(int64_t, int64_t, const float*, const float*, __mmask16, __mmask16, float*, bool);
constexpr int kSkCols = 12;  // 24 accumulators + 2 loads + 1 broadcast

template <int... J>
constexpr auto sk_table(std::integer_sequence<int, J...>) {
  return std::array<SkFn, sizeof...(J)>{&sk_block<J + 1>...};
}

SW_AVX512 void small_k(int64_t m, int64_t k, const float* Ap, const float* Bp, float* C, int64_t jb, int64_t je,
                       bool accumulate) {
  static constexpr auto table = sk_table(std::make_integer_sequence<int, kSkCols>{});
  for (int64_t j0 = jb; j0 < je; j0 += kSkCols) {
    const int64_t nj = std::min<int64_t>(kSkCols, je - j0);
    for (int64_t i0 = 0; i0 < m; i0 += 32) {
      const int64_t mi = std::min<int64_t>(32, m - i0);
      table[nj - 1](k, m, Ap + i0, Bp + j0 * k, lanes16(mi), lanes16(mi - 16), C + j0 * m + i0, accumulate);
    }
  }
}

// X(r, p) = X[r * s_r + p * s_p] packed so that element (r, p) is at out[r * r_step + p * p_step].
const float* pack(const float* X, int64_t rows, int64_t k, int64_t s_r, int64_t s_p, int64_t r_step, int64_t p_step,
                  std::vector<float>& buf) {
  if (s_r == r_step && s_p == p_step) return X;  // already in that order
  buf.resize(static_cast<size_t>(rows * k));
  if (p_step == 1) {
    for (int64_t r = 0; r < rows; ++r)
      for (int64_t p = 0; p < k; ++p) buf[r * r_step + p] = X[r * s_r + p * s_p];
  } else {
    for (int64_t p = 0; p < k; ++p)
      for (int64_t r = 0; r < rows; ++r) buf[r * r_step + p * p_step] = X[r * s_r + p * s_p];
  }
  return buf.data();
}

enum class Path { None, SmallMJ, SmallMP, SmallK };

Path path_of(int64_t m, int64_t n, int64_t k, int64_t b_sj, int64_t b_sp) {
  if (!has_avx512() || m < 1 || n < 1 || k < 1) return Path::None;
  if (n >= kWide && k >= kWide) {
    if (b_sj == 1 && m <= kRowsAlongJ) return Path::SmallMJ;
    if (b_sp == 1 && m <= kRowsAlongP) return Path::SmallMP;
    return Path::None;
  }
  if (k <= kInner && m >= kWide && n >= kWide) return Path::SmallK;
  return Path::None;
}

}  // namespace

const char* skinny_sgemm_path(int64_t m, int64_t n, int64_t k, int64_t b_sj, int64_t b_sp) {
  switch (path_of(m, n, k, b_sj, b_sp)) {
    case Path::SmallMJ: return "small-m/j";
    case Path::SmallMP: return "small-m/p";
    case Path::SmallK: return "small-k";
    case Path::None: break;
  }
  return "";
}

bool skinny_sgemm(int64_t m, int64_t n, int64_t k, const float* A, int64_t a_si, int64_t a_sp, const float* B,
                  int64_t b_sj, int64_t b_sp, float* C, bool accumulate) {
  const Path path = path_of(m, n, k, b_sj, b_sp);
  if (path == Path::None) return false;
  std::vector<float> abuf, bbuf;
  const int64_t work = m * n * k;
  if (path == Path::SmallMJ) {
    const float* Ap = pack(A, m, k, a_si, a_sp, 1, m, abuf);
    const int64_t blocks = (n + 15) / 16;
    over_columns(blocks, work, [&](int64_t b, int64_t e) {
      small_m_j(m, k, Ap, B, b_sp, C, b * 16, std::min(n, e * 16), accumulate);
    });
  } else if (path == Path::SmallMP) {
    const float* Ar = pack(A, m, k, a_si, a_sp, k, 1, abuf);
    const int64_t blocks = (n + kMpCols - 1) / kMpCols;
    over_columns(blocks, work, [&](int64_t b, int64_t e) {
      small_m_p(m, k, Ar, B, b_sj, C, b * kMpCols, std::min(n, e * kMpCols), accumulate);
    });
  } else {
    const float* Ap = pack(A, m, k, a_si, a_sp, 1, m, abuf);
    const float* Bp = pack(B, n, k, b_sj, b_sp, k, 1, bbuf);
    const int64_t blocks = (n + kSkCols - 1) / kSkCols;
    over_columns(blocks, work, [&](int64_t b, int64_t e) {
      small_k(m, k, Ap, Bp, C, b * kSkCols, std::min(n, e * kSkCols), accumulate);
    });
  }
  return true;
}

}  // namespace sw::detail
