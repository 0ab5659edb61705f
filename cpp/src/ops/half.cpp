// 16-bit floating-point conversions and products. See Note [Half-precision
// conversions] and Note [Products of half-precision operands] in half.hpp.
#include "half.hpp"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string_view>
#include <utility>
#include <vector>

#include "simd_masks.hpp"
#include "strided.hpp"

// GCC 12 reports the intrinsics header's own deliberately undefined vector in
// _mm512_reduce_add_ps as used uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define SW_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,fma")))
#define SW_AVX512_BF16 __attribute__((target("avx512f,avx512bw,avx512vl,avx512bf16,fma")))

namespace sw::detail {

namespace {

std::atomic<bool> g_portable{false};

bool has_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                         __builtin_cpu_supports("fma");
  return ok && !g_portable.load(std::memory_order_relaxed);
}

// SW_NO_AVX512_BF16=1 in the environment (read once) makes a machine with AVX-512 BF16 take the path of one
// without it (AVX-512F with widening in registers, as on an Intel CPU with AVX-512 but no BF16), so the test suite
// can be run through that path here.
bool has_avx512_bf16() {
  static const bool ok = __builtin_cpu_supports("avx512bf16") && [] {
    const char* v = std::getenv("SW_NO_AVX512_BF16");
    return !(v && *v && std::string_view(v) != "0");
  }();
  return ok && has_avx512();
}

uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

float float_of(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// ---------------------------------------------------------------- conversions, AVX-512F

SW_AVX512 __m512 widen_bf16(__m256i h) { return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); }

// Round to nearest even on the integer bits; NaN -> quiet NaN (Note [Half-precision conversions]).
SW_AVX512 __m256i narrow_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i rounded = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  const __m512i r = _mm512_mask_or_epi32(rounded, nan, u, _mm512_set1_epi32(0x00400000));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(r, 16));
}

SW_AVX512 void bf16_to_f32_avx512(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    _mm512_mask_storeu_ps(dst + i, m, widen_bf16(_mm256_maskz_loadu_epi16(m, src + i)));
  }
}

SW_AVX512 void f32_to_bf16_avx512(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    _mm256_mask_storeu_epi16(dst + i, m, narrow_bf16(_mm512_maskz_loadu_ps(m, src + i)));
  }
}

SW_AVX512 void f16_to_f32_avx512(const uint16_t* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    _mm512_mask_storeu_ps(dst + i, m, _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, src + i)));
  }
}

SW_AVX512 void f32_to_f16_avx512(const float* src, uint16_t* dst, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = lanes16(n - i);
    const __m256i h = _mm512_cvtps_ph(_mm512_maskz_loadu_ps(m, src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_mask_storeu_epi16(dst + i, m, h);
  }
}

// ---------------------------------------------------------------- products
// Blocks of MR rows of A by NR rows of B, each an inner-product over p; every
// accumulator is one zmm of Float32 partial sums, reduced once at the end.

template <int MR, int NR>
SW_AVX512_BF16 void block_bf16_dp(int64_t k, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                                  float* out) {
  __m512 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 32) {
    const __mmask32 m = lanes32(k - p);
    __m512bh a[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) a[i] = (__m512bh)_mm512_maskz_loadu_epi16(m, A + i * lda + p);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512bh b = (__m512bh)_mm512_maskz_loadu_epi16(m, B + j * ldb + p);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], a[i], b);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) out[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <HalfKind K>
SW_AVX512 __m512 widen16(const uint16_t* p, __mmask16 m) {
  const __m256i h = _mm256_maskz_loadu_epi16(m, p);
  if constexpr (K == HalfKind::BFloat16) return widen_bf16(h);
  else return _mm512_cvtph_ps(h);
}

template <HalfKind K, int MR, int NR>
SW_AVX512 void block_widen(int64_t k, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* out) {
  __m512 acc[MR][NR];
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < k; p += 16) {
    const __mmask16 m = lanes16(k - p);
    __m512 a[MR];
#pragma GCC unroll 4
    for (int i = 0; i < MR; ++i) a[i] = widen16<K>(A + i * lda + p, m);
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) {
      const __m512 b = widen16<K>(B + j * ldb + p, m);
#pragma GCC unroll 4
      for (int i = 0; i < MR; ++i) acc[i][j] = _mm512_fmadd_ps(a[i], b, acc[i][j]);
    }
  }
#pragma GCC unroll 4
  for (int i = 0; i < MR; ++i)
#pragma GCC unroll 4
    for (int j = 0; j < NR; ++j) out[i * NR + j] = _mm512_reduce_add_ps(acc[i][j]);
}

template <int MR, int NR>
void block_scalar(HalfKind kind, int64_t k, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb,
                  float* out) {
  float (*widen)(uint16_t) noexcept = kind == HalfKind::BFloat16 ? bf16_to_float : f16_to_float;
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < NR; ++j) {
      float s = 0.f;
      for (int64_t p = 0; p < k; ++p) s = std::fma(widen(A[i * lda + p]), widen(B[j * ldb + p]), s);
      out[i * NR + j] = s;
    }
}

// Note [Outer products for many rows]: with 16 or more rows of A and AVX-512 BF16, A is packed once into
// pairs of the inner index interleaved across rows (Ap[(q * mp + i) * 2 + h] = A(i, 2q + h), zero-padded to a
// multiple of 16 rows), and one pair of B(j, 2q), B(j, 2q + 1) is broadcast: each VDPBF16PS then adds the two
// products into 16 rows of one column of C. C's columns stay in registers for the whole inner loop and need no
// horizontal sum (the dot-product blocks above spend one per element of C), and each pair of B is read once per
// 64 rows. Up to 4 groups of 16 rows by 6 columns: 24 accumulators, 4 loads and 6 broadcasts per 24 products.
constexpr int kOuterGroups = 4, kOuterCols = 6;

template <int R, int NR>
SW_AVX512_BF16 void outer_bf16(int64_t k, const uint16_t* Ap, int64_t mp, const uint16_t* B, int64_t ldb, float* C,
                               int64_t c_si, int64_t c_sj, int64_t rows, bool accumulate) {
  __m512 acc[R][NR];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 6
    for (int j = 0; j < NR; ++j) acc[r][j] = _mm512_setzero_ps();
  const int64_t pairs = (k + 1) / 2, full = k / 2;
  const uint16_t* a = Ap;
  for (int64_t q = 0; q < pairs; ++q, a += 2 * mp) {
    __m512bh av[R];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r) av[r] = (__m512bh)_mm512_loadu_si512(a + 32 * r);
#pragma GCC unroll 6
    for (int j = 0; j < NR; ++j) {
      uint32_t pair;
      if (q < full) std::memcpy(&pair, B + j * ldb + 2 * q, 4);
      else pair = B[j * ldb + 2 * q];  // an odd k: the last value alone (its partner in Ap is zero)
      const __m512bh b = (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], av[r], b);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const int64_t here = std::min<int64_t>(16, rows - 16 * r);
    if (here <= 0) break;
#pragma GCC unroll 6
    for (int j = 0; j < NR; ++j) {
      float* c = C + 16 * r * c_si + j * c_sj;
      if (c_si == 1) {
        const __mmask16 m = lanes16(here);
        const __m512 v = accumulate ? _mm512_add_ps(_mm512_maskz_loadu_ps(m, c), acc[r][j]) : acc[r][j];
        _mm512_mask_storeu_ps(c, m, v);
      } else {
        alignas(64) float t[16];
        _mm512_store_ps(t, acc[r][j]);
        for (int64_t i = 0; i < here; ++i) c[i * c_si] = accumulate ? c[i * c_si] + t[i] : t[i];
      }
    }
  }
}

using OuterFn = void (*)(int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*, int64_t, int64_t,
                         int64_t, bool);
template <int R, int NR> struct PickOuter { static constexpr OuterFn fn = outer_bf16<R, NR>; };
template <int R, size_t... J>
constexpr std::array<OuterFn, kOuterCols> outer_row(std::index_sequence<J...>) {
  return {PickOuter<R, static_cast<int>(J) + 1>::fn...};
}
constexpr std::array<std::array<OuterFn, kOuterCols>, kOuterGroups> kOuterBlocks{{
    outer_row<1>(std::make_index_sequence<kOuterCols>{}), outer_row<2>(std::make_index_sequence<kOuterCols>{}),
    outer_row<3>(std::make_index_sequence<kOuterCols>{}), outer_row<4>(std::make_index_sequence<kOuterCols>{}),
}};

// Sixteen rows by sixteen pairs of A (rows i0.., pairs q0..), transposed into Ap: pair q of row i is 32 bits at
// out[q * mp + i]. Four rounds of in-register shuffles instead of 256 scattered 4-byte stores.
SW_AVX512 void pack_pairs_16x16(const uint16_t* A, int64_t lda, uint32_t* out, int64_t mp) {
  __m512i r[16], t[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_loadu_si512(A + i * lda);
  for (int i = 0; i < 16; i += 2) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3)
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int g = 0; g < 16; g += 4) {  // r[g + c], lane L: pair 4L + c of rows g .. g + 3
    r[g] = _mm512_unpacklo_epi64(t[g], t[g + 2]);
    r[g + 1] = _mm512_unpackhi_epi64(t[g], t[g + 2]);
    r[g + 2] = _mm512_unpacklo_epi64(t[g + 1], t[g + 3]);
    r[g + 3] = _mm512_unpackhi_epi64(t[g + 1], t[g + 3]);
  }
  for (int c = 0; c < 4; ++c) {  // pair 4L + c: lane L of r[c], r[4 + c], r[8 + c], r[12 + c]
    const __m512i v0 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0x44), v1 = _mm512_shuffle_i32x4(r[c], r[4 + c], 0xEE);
    const __m512i w0 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0x44);
    const __m512i w1 = _mm512_shuffle_i32x4(r[8 + c], r[12 + c], 0xEE);
    _mm512_storeu_si512(out + (0 + c) * mp, _mm512_shuffle_i32x4(v0, w0, 0x88));
    _mm512_storeu_si512(out + (4 + c) * mp, _mm512_shuffle_i32x4(v0, w0, 0xDD));
    _mm512_storeu_si512(out + (8 + c) * mp, _mm512_shuffle_i32x4(v1, w1, 0x88));
    _mm512_storeu_si512(out + (12 + c) * mp, _mm512_shuffle_i32x4(v1, w1, 0xDD));
  }
}

// Ap for rows [0, m) of A: pairs of the inner index interleaved across rows, zero-padded (Note [Outer products
// for many rows]). Reused per thread: the packed operand is a few hundred KiB at most for the shapes this serves.
// Called on the AVX-512 BF16 path only, so whole blocks of sixteen rows and sixteen pairs transpose in registers.
const uint16_t* pack_pairs(int64_t m, int64_t k, const uint16_t* A, int64_t lda, int64_t mp) {
  thread_local std::vector<uint32_t> buf;
  const int64_t pairs = (k + 1) / 2, full = k / 2;
  const int64_t mb = m / 16 * 16, qb = full / 16 * 16;  // the part whole blocks cover
  if (mb == mp && qb == pairs) buf.resize(static_cast<size_t>(pairs * mp));  // every entry is written below
  else buf.assign(static_cast<size_t>(pairs * mp), 0u);
  for (int64_t i0 = 0; i0 < mb; i0 += 16)
    for (int64_t q0 = 0; q0 < qb; q0 += 16) pack_pairs_16x16(A + i0 * lda + 2 * q0, lda, buf.data() + q0 * mp + i0, mp);
  for (int64_t i = 0; i < m; ++i) {
    const uint16_t* row = A + i * lda;
    uint32_t* out = buf.data() + i;
    for (int64_t q = i < mb ? qb : 0; q < full; ++q) std::memcpy(out + q * mp, row + 2 * q, 4);
    if (full < pairs) out[full * mp] = row[2 * full];
  }
  return reinterpret_cast<const uint16_t*>(buf.data());
}

// Note [Few rows times a row-major 16-bit matrix]: Q (<= 8) Float32 rows times 32 columns of a 16-bit matrix
// W (k, cols) whose columns are contiguous, contracted over W's rows: each W row segment is widened in registers
// (exact) and multiplied with FMA into Q x 2 accumulators, r in order, so W streams once per group of rows and is
// never widened into memory. Out: Q rows of 32 Float32 values at out[i * 32].
template <int Q, bool BF>
SW_AVX512 void rows_times_block(int64_t k, const float* L, int64_t ldl, const uint16_t* W, int64_t ldw, int64_t nc,
                                float* out) {
  __m512 acc[Q][2];
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const __mmask32 m = nc >= 32 ? ~__mmask32{0} : static_cast<__mmask32>((uint32_t{1} << nc) - 1);
  for (int64_t r = 0; r < k; ++r) {
    const __m512i raw = _mm512_maskz_loadu_epi16(m, W + r * ldw);
    const __m256i lo = _mm512_castsi512_si256(raw), hi = _mm512_extracti64x4_epi64(raw, 1);
    const __m512 w0 = BF ? widen_bf16(lo) : _mm512_cvtph_ps(lo);
    const __m512 w1 = BF ? widen_bf16(hi) : _mm512_cvtph_ps(hi);
#pragma GCC unroll 8
    for (int i = 0; i < Q; ++i) {
      const __m512 l = _mm512_set1_ps(L[i + ldl * r]);
      acc[i][0] = _mm512_fmadd_ps(l, w0, acc[i][0]);
      acc[i][1] = _mm512_fmadd_ps(l, w1, acc[i][1]);
    }
  }
#pragma GCC unroll 8
  for (int i = 0; i < Q; ++i) {
    _mm512_storeu_ps(out + i * 32, acc[i][0]);
    _mm512_storeu_ps(out + i * 32 + 16, acc[i][1]);
  }
}

using RowsFn = void (*)(int64_t, const float*, int64_t, const uint16_t*, int64_t, int64_t, float*);
template <bool BF>
constexpr std::array<RowsFn, 8> kRowsBlocks{rows_times_block<1, BF>, rows_times_block<2, BF>, rows_times_block<3, BF>,
                                            rows_times_block<4, BF>, rows_times_block<5, BF>, rows_times_block<6, BF>,
                                            rows_times_block<7, BF>, rows_times_block<8, BF>};

constexpr int kMR = 4, kNR = 4;
using BlockFn = void (*)(int64_t, const uint16_t*, int64_t, const uint16_t*, int64_t, float*);

// One table of block kernels per path, indexed [rows - 1][columns - 1].
template <template <int, int> class Pick>
constexpr auto block_table() {
  return std::array<std::array<BlockFn, kNR>, kMR>{{
      {Pick<1, 1>::fn, Pick<1, 2>::fn, Pick<1, 3>::fn, Pick<1, 4>::fn},
      {Pick<2, 1>::fn, Pick<2, 2>::fn, Pick<2, 3>::fn, Pick<2, 4>::fn},
      {Pick<3, 1>::fn, Pick<3, 2>::fn, Pick<3, 3>::fn, Pick<3, 4>::fn},
      {Pick<4, 1>::fn, Pick<4, 2>::fn, Pick<4, 3>::fn, Pick<4, 4>::fn},
  }};
}
template <int MR, int NR> struct PickDp { static constexpr BlockFn fn = block_bf16_dp<MR, NR>; };
template <int MR, int NR> struct PickWideBf { static constexpr BlockFn fn = block_widen<HalfKind::BFloat16, MR, NR>; };
template <int MR, int NR> struct PickWideF16 { static constexpr BlockFn fn = block_widen<HalfKind::Float16, MR, NR>; };
template <int MR, int NR> struct PickScalarBf {
  static void run(int64_t k, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* out) {
    block_scalar<MR, NR>(HalfKind::BFloat16, k, A, lda, B, ldb, out);
  }
  static constexpr BlockFn fn = run;
};
template <int MR, int NR> struct PickScalarF16 {
  static void run(int64_t k, const uint16_t* A, int64_t lda, const uint16_t* B, int64_t ldb, float* out) {
    block_scalar<MR, NR>(HalfKind::Float16, k, A, lda, B, ldb, out);
  }
  static constexpr BlockFn fn = run;
};

constexpr auto kDpBlocks = block_table<PickDp>();
constexpr auto kWideBfBlocks = block_table<PickWideBf>();
constexpr auto kWideF16Blocks = block_table<PickWideF16>();
constexpr auto kScalarBfBlocks = block_table<PickScalarBf>();
constexpr auto kScalarF16Blocks = block_table<PickScalarF16>();

const std::array<std::array<BlockFn, kNR>, kMR>& blocks_for(HalfKind kind) {
  if (kind == HalfKind::BFloat16) return has_avx512_bf16() ? kDpBlocks : has_avx512() ? kWideBfBlocks : kScalarBfBlocks;
  return has_avx512() ? kWideF16Blocks : kScalarF16Blocks;
}

// Work of at least this many multiply-adds is split over the compute threads (as the Float32 skinny kernels).
constexpr int64_t kParallelMacs = int64_t{1} << 18;

}  // namespace

// The widening conversions and bf16's narrowing are inline in strideweave/dtype.hpp (the element types use them).
float bf16_to_float(uint16_t bits) noexcept { return bf16_bits_to_float(bits); }
uint16_t float_to_bf16(float value) noexcept { return float_to_bf16_bits(value); }
uint16_t float_to_f16_bits(float value) noexcept { return float_to_f16(value); }

float f16_to_float(uint16_t h) noexcept { return f16_bits_to_float(h); }

uint16_t float_to_f16(float value) noexcept {
  const uint32_t u = bits_of(value);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return static_cast<uint16_t>(sign | 0x7E00u | ((a >> 13) & 0x3FFu));  // NaN -> quiet NaN
  if (a >= 0x477FF000u) return static_cast<uint16_t>(sign | 0x7C00u);  // >= 65520: rounds to infinity
  if (a < 0x38800000u) {  // below 2^-14: a subnormal (or zero) half, in units of 2^-24, rounded to nearest even
    const float units = float_of(a) * 0x1p24f;  // exact: a power-of-two scaling of a value >= 2^-149
    return static_cast<uint16_t>(sign | static_cast<uint16_t>(std::nearbyint(units)));
  }
  const uint32_t rounded = a + 0xFFFu + ((a >> 13) & 1u);
  return static_cast<uint16_t>(sign | ((rounded - 0x38000000u) >> 13));
}

void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) noexcept {
  if (has_avx512()) return bf16_to_f32_avx512(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_to_float(src[i]);
}
void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) noexcept {
  if (has_avx512()) return f32_to_bf16_avx512(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_bf16(src[i]);
}
void f16_to_f32(const uint16_t* src, float* dst, int64_t n) noexcept {
  if (has_avx512()) return f16_to_f32_avx512(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = f16_to_float(src[i]);
}
void f32_to_f16(const float* src, uint16_t* dst, int64_t n) noexcept {
  if (has_avx512()) return f32_to_f16_avx512(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = float_to_f16(src[i]);
}

const char* half_gemm_path(HalfKind kind) {
  if (kind == HalfKind::BFloat16 && has_avx512_bf16()) return "avx512-bf16";
  return has_avx512() ? "avx512f" : "scalar";
}

bool force_portable_half_kernels(bool on) noexcept { return g_portable.exchange(on); }

void half_gemm(HalfKind kind, int64_t m, int64_t n, int64_t k, const uint16_t* A, int64_t lda, const uint16_t* B,
               int64_t ldb, float* C, int64_t c_si, int64_t c_sj, bool accumulate) {
  if (m <= 0 || n <= 0) return;
  if (kind == HalfKind::BFloat16 && m >= 16 && has_avx512_bf16()) {  // Note [Outer products for many rows]
    const int64_t mp = (m + 15) / 16 * 16;
    const uint16_t* Ap = pack_pairs(m, k, A, lda, mp);
    const int64_t cblocks = (n + kOuterCols - 1) / kOuterCols;
    auto run = [&](int64_t b0, int64_t b1) {
      for (int64_t g0 = 0; g0 < mp / 16; g0 += kOuterGroups) {
        const int64_t groups = std::min<int64_t>(kOuterGroups, mp / 16 - g0);
        const int64_t rows = std::min<int64_t>(m - 16 * g0, 16 * groups);
        for (int64_t cb = b0; cb < b1; ++cb) {
          const int64_t j0 = cb * kOuterCols, nc = std::min<int64_t>(kOuterCols, n - j0);
          kOuterBlocks[static_cast<size_t>(groups - 1)][static_cast<size_t>(nc - 1)](
              k, Ap + 32 * g0, mp, B + j0 * ldb, ldb, C + 16 * g0 * c_si + j0 * c_sj, c_si, c_sj, rows, accumulate);
        }
      }
    };
    // A weight-sized product runs for milliseconds: in parts of at least 16 column blocks, claimed as the
    // threads go (parallel_for), so a thread that loses its core for a while delays nothing.
    if (m * n * k < kParallelMacs) run(0, cblocks);
    else parallel_for(cblocks, 16, run, /*parts_per_thread=*/8);
    return;
  }
  const auto& blocks = blocks_for(kind);
  // Rows of B in blocks of kNR, each block against every row of A: B (the large operand: a weight) streams
  // through memory once, A (a few token rows) stays in cache.
  const int64_t nblocks = (n + kNR - 1) / kNR;
  auto run = [&](int64_t b0, int64_t b1) {
    float out[kMR * kNR];
    for (int64_t jb = b0; jb < b1; ++jb) {
      const int64_t j0 = jb * kNR, nr = std::min<int64_t>(kNR, n - j0);
      for (int64_t i0 = 0; i0 < m; i0 += kMR) {
        const int64_t mr = std::min<int64_t>(kMR, m - i0);
        blocks[static_cast<size_t>(mr - 1)][static_cast<size_t>(nr - 1)](k, A + i0 * lda, lda, B + j0 * ldb, ldb,
                                                                         out);
        for (int64_t i = 0; i < mr; ++i)
          for (int64_t j = 0; j < nr; ++j) {
            float& c = C[(i0 + i) * c_si + (j0 + j) * c_sj];
            c = accumulate ? c + out[i * nr + j] : out[i * nr + j];
          }
      }
    }
  };
  if (m * n * k < kParallelMacs) run(0, nblocks);
  else parallel_for(nblocks, 1, run);
}

bool rows_times_half(HalfKind kind, int64_t n, int64_t cols, int64_t k, const float* L, const uint16_t* W,
                     int64_t ldw, float* C) {
  if (n <= 0 || n > kRowsTimesHalfMax || !has_avx512()) return false;
  const bool bf = kind == HalfKind::BFloat16;
  const int64_t blocks = (cols + 31) / 32;
  auto run = [&](int64_t b0, int64_t b1) {
    alignas(64) float out[8 * 32];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t c0 = b * 32, nc = std::min<int64_t>(32, cols - c0);
      for (int64_t q0 = 0; q0 < n; q0 += 8) {
        const int64_t q = std::min<int64_t>(8, n - q0);
        (bf ? kRowsBlocks<true> : kRowsBlocks<false>)[static_cast<size_t>(q - 1)](k, L + q0, n, W + c0, ldw, nc, out);
        for (int64_t i = 0; i < q; ++i)
          for (int64_t j = 0; j < nc; ++j) C[(q0 + i) + n * (c0 + j)] = out[i * 32 + j];
      }
    }
  };
  if (n * cols * k < kParallelMacs) run(0, blocks);
  else parallel_for(blocks, 4, run, /*parts_per_thread=*/4);
  return true;
}

}  // namespace sw::detail
