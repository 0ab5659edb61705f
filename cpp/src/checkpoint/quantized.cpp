// The kernels of quantized checkpoints: FP8 e4m3 block-scaled and MXFP4 bytes into Float32 or BFloat16 values, and
// back. See Note [Quantized element formats] in strideweave/checkpoint/quantized.hpp.
//
// Note [Dequantizing at memory speed]: promotion dequantizes a tile on every fault, so the kernels must keep up with
// reading the tile's BFloat16 bytes. The AVX-512 (F, BW, VL) paths:
//  * FP8 into BFloat16, blocks of 2048 elements or more (DeepSeek-V3's 128 x 128): a lookup per element in tables
//    of each block's 256 results, Note [Per-block product tables].
//  * FP8 otherwise: 32 bytes at a time; the 128 magnitudes (codes 0..127) are BFloat16 patterns (every e4m3 value
//    is exact in BFloat16: 3 mantissa bits, exponents 2^-9..2^8) held in 4 zmm registers; two VPERMT2W (each over
//    64 entries, the low 6 bits of the code) and a blend on bit 6 give the magnitude, the sign bit is OR'd in, and
//    the widened Float32 value is multiplied by its block's scale. BFloat16 output rounds the product to nearest
//    even on the integer bits (NaN -> 0x7FC0; not VCVTNEPS2BF16, which keeps a NaN's sign and payload) and one
//    VPERMT2W takes the high halves of 32 products in order. Columns are walked one block (one scale) at a time;
//    the last partial vector of a block, or of a row, is masked, so any block width and row length work.
//  * MXFP4 into BFloat16: Note [MXFP4 in the exponent field]. Into Float32, and for the scale bytes that note
//    leaves out: one group (16 bytes) at a time, low and high nibbles interleaved (value 2j the low nibble of byte
//    j), widened to 32-bit indices into the 16-entry e2m1 table (VPERMPS), times 2^(s - 127) built from the
//    exponent bits (s = 0: the subnormal 2^-127; s = 255: NaN).
// The portable path computes the same Float32 products from 256-entry tables, and uses the same per-block tables
// (FP8 into BFloat16) and exponent-field additions (MXFP4, into either type; two BFloat16 values a byte at once),
// one element at a time: both paths give the same bits.
//
// NaN results, Float32 output included, are the canonical quiet NaN (0x7FC00000; BFloat16 0x7FC0): a product of two
// NaN operands would otherwise keep whichever payload the compiler's operand order picks.
//
// Quantizing (on save only) is scalar: per element one Float32 division and integer rounding.
#include "strideweave/checkpoint/quantized.hpp"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string_view>

// GCC 12 reports the intrinsics headers' own deliberately undefined vectors as used uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

#define SW_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl")))
#define SW_AVX512_VBMI __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi")))

namespace sw::quant {

namespace {

constexpr uint32_t kQuietNaN = 0x7FC00000u;

std::atomic<bool> g_portable{false};

bool cpu_has_avx512() {
  static const bool ok = [] {
    if (!(__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
          __builtin_cpu_supports("avx512vl")))
      return false;
    const char* v = std::getenv("SW_NO_AVX512");  // read once
    return !(v && *v && std::string_view(v) != "0");
  }();
  return ok;
}

bool avx512() { return cpu_has_avx512() && !g_portable.load(std::memory_order_relaxed); }

std::atomic<bool> g_no_vbmi{false};

// AVX-512 VBMI (byte permutes: Ice Lake, Zen 4 and later) for Note [Per-block product tables].
bool vbmi() {
  static const bool ok = __builtin_cpu_supports("avx512vbmi");
  return ok && avx512() && !g_no_vbmi.load(std::memory_order_relaxed);
}

float float_of(uint32_t u) { return std::bit_cast<float>(u); }
uint32_t bits_of(float f) { return std::bit_cast<uint32_t>(f); }

// The Float32 bit pattern of an e4m3 code, from the format: normal codes move their exponent and mantissa into
// place (bias 7 -> 127), subnormals m * 2^-9 are exact products, 0x7F / 0xFF the quiet NaN.
constexpr uint32_t e4m3_bits(uint32_t c) {
  const uint32_t sign = (c & 0x80u) << 24, e = (c >> 3) & 0xFu, m = c & 7u;
  if ((c & 0x7Fu) == 0x7Fu) return kQuietNaN;
  if (e == 0) return sign | std::bit_cast<uint32_t>(static_cast<float>(m) * (1.0f / 512.0f));
  return sign | ((e + 120u) << 23) | (m << 20);
}

constexpr std::array<float, 256> kE4m3 = [] {
  std::array<float, 256> t{};
  for (uint32_t c = 0; c < 256; ++c) t[c] = std::bit_cast<float>(e4m3_bits(c));
  return t;
}();

// The BFloat16 patterns of the e4m3 magnitudes 0..127 (exact: the low 16 bits of each Float32 pattern are zero).
alignas(64) constexpr std::array<uint16_t, 128> kE4m3Bf16 = [] {
  std::array<uint16_t, 128> t{};
  for (uint32_t c = 0; c < 128; ++c) t[c] = static_cast<uint16_t>(e4m3_bits(c) >> 16);
  return t;
}();

alignas(64) constexpr std::array<float, 16> kE2m1 = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                                                     -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};

constexpr uint32_t e8m0_bits(uint32_t b) { return b == 255 ? kQuietNaN : b == 0 ? 0x00400000u : b << 23; }

inline float canonical(float v) { return v != v ? float_of(kQuietNaN) : v; }

inline uint16_t narrow(float v) {
  const uint32_t u = bits_of(v);
  if (v != v) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// ---------------------------------------------------------------- portable dequantization

// Note [Per-block product tables] (below): block columns per band, and the elements of a block (within one call)
// from which building its table pays.
constexpr int64_t kTableBand = 64;
// Elements of a block (within one call) from which building its table pays.
constexpr int64_t kTabledElements = 2048;

// The portable form of Note [Per-block product tables]: the same results, one table load per element.
void fp8_bf16_tabled_portable(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0, const float* scales,
                              int64_t scale_cols, int64_t block_rows, int64_t block_cols, uint16_t* out);

void fp8_row_portable(const uint8_t* q, int64_t cols, const float* srow, int64_t block_cols, void* out, Out out_type) {
  for (int64_t c0 = 0, b = 0; c0 < cols; c0 += block_cols, ++b) {
    const int64_t n = std::min(block_cols, cols - c0);
    const float s = srow[b];
    if (out_type == Out::Float32) {
      float* o = static_cast<float*>(out) + c0;
      for (int64_t j = 0; j < n; ++j) o[j] = canonical(kE4m3[q[c0 + j]] * s);
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + c0;
      for (int64_t j = 0; j < n; ++j) o[j] = narrow(kE4m3[q[c0 + j]] * s);
    }
  }
}

// Per byte of MXFP4 blocks: its two values' BFloat16 patterns (low nibble in the low half, as they are stored),
// and 1 in each half whose value is nonzero.
constexpr std::array<uint32_t, 256> kE2m1PairBf16 = [] {
  std::array<uint32_t, 256> t{};
  for (uint32_t b = 0; b < 256; ++b)
    t[b] = (std::bit_cast<uint32_t>(kE2m1[b & 15]) >> 16) | (std::bit_cast<uint32_t>(kE2m1[b >> 4]) >> 16 << 16);
  return t;
}();
constexpr std::array<uint32_t, 256> kE2m1PairNonzero = [] {
  std::array<uint32_t, 256> t{};
  for (uint32_t b = 0; b < 256; ++b) t[b] = ((b & 7) ? 1u : 0u) | ((b & 0x70) ? 0x10000u : 0u);
  return t;
}();

void mxfp4_portable(const uint8_t* blocks, const uint8_t* scales, int64_t groups, void* out, Out out_type) {
  for (int64_t g = 0; g < groups; ++g) {
    const float s = float_of(e8m0_bits(scales[g]));
    const uint8_t* b = blocks + 16 * g;
    if (out_type == Out::BFloat16 && scales[g] >= 2 && scales[g] <= 252) {  // Note [MXFP4 in the exponent field]
      // Both values of a byte at once: the pair of unscaled patterns plus (s - 127) << 7 in each half that holds
      // a nonzero value. Each half's sum is a pattern (no carry or borrow crosses into the other half).
      const uint32_t add = static_cast<uint32_t>((int(scales[g]) - 127) * 128);
      uint16_t* o = static_cast<uint16_t*>(out) + 32 * g;
      for (int j = 0; j < 16; ++j) {
        const uint32_t pair = kE2m1PairBf16[b[j]] + kE2m1PairNonzero[b[j]] * add;
        std::memcpy(o + 2 * j, &pair, 4);
      }
      continue;
    }
    if (out_type == Out::Float32 && scales[g] >= 2 && scales[g] <= 252) {  // the same in Float32's exponent field
      const uint32_t add = static_cast<uint32_t>(int(scales[g]) - 127) << 23;
      float t[16];
      for (int n = 0; n < 16; ++n) t[n] = float_of(bits_of(kE2m1[n]) + ((n & 7) ? add : 0u));
      float* o = static_cast<float*>(out) + 32 * g;
      for (int j = 0; j < 16; ++j) {
        o[2 * j] = t[b[j] & 0xF];
        o[2 * j + 1] = t[b[j] >> 4];
      }
      continue;
    }
    if (out_type == Out::Float32) {
      float* o = static_cast<float*>(out) + 32 * g;
      for (int j = 0; j < 16; ++j) {
        o[2 * j] = canonical(kE2m1[b[j] & 0xF] * s);
        o[2 * j + 1] = canonical(kE2m1[b[j] >> 4] * s);
      }
    } else {
      uint16_t* o = static_cast<uint16_t*>(out) + 32 * g;
      for (int j = 0; j < 16; ++j) {
        o[2 * j] = narrow(kE2m1[b[j] & 0xF] * s);
        o[2 * j + 1] = narrow(kE2m1[b[j] >> 4] * s);
      }
    }
  }
}

void fp8_bf16_tabled_portable(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0, const float* scales,
                              int64_t scale_cols, int64_t block_rows, int64_t block_cols, uint16_t* out) {
  alignas(64) uint16_t tables[kTableBand][256];
  const int64_t first = row0 / block_rows;
  for (int64_t i0 = 0; i0 < rows;) {
    const int64_t br = (row0 + i0) / block_rows;
    const int64_t i1 = std::min(rows, (br + 1) * block_rows - row0);
    const float* srow = scales + (br - first) * scale_cols;
    for (int64_t b0 = 0; b0 < scale_cols; b0 += kTableBand) {
      const int64_t b1 = std::min(scale_cols, b0 + kTableBand);
      for (int64_t b = b0; b < b1; ++b)
        for (int c = 0; c < 256; ++c) tables[b - b0][c] = narrow(kE4m3[static_cast<size_t>(c)] * srow[b]);
      for (int64_t i = i0; i < i1; ++i)
        for (int64_t b = b0; b < b1; ++b) {
          const uint16_t* t = tables[b - b0];
          const int64_t c0 = b * block_cols, c1 = std::min(cols, c0 + block_cols);
          const uint8_t* qr = q + i * cols;
          uint16_t* o = out + i * cols;
          for (int64_t j = c0; j < c1; ++j) o[j] = t[qr[j]];
        }
    }
    i0 = i1;
  }
}

// ---------------------------------------------------------------- AVX-512 dequantization

SW_AVX512 inline __mmask16 lanes16(int64_t r) {
  return r >= 16 ? __mmask16(0xFFFF) : r <= 0 ? __mmask16(0) : __mmask16((1u << r) - 1u);
}
SW_AVX512 inline __mmask32 lanes32(int64_t r) {
  return r >= 32 ? __mmask32(0xFFFFFFFFu) : r <= 0 ? __mmask32(0) : __mmask32((1u << r) - 1u);
}

// Float32 -> (BFloat16 << 16) rounded to nearest even, NaN -> 0x7FC0 << 16 (the low 16 bits are garbage).
SW_AVX512 inline __m512i round_bf16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF)));
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(int(kQuietNaN)));
}

SW_AVX512 inline __m512 canonical16(__m512 v) {
  return _mm512_mask_mov_ps(v, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_castsi512_ps(_mm512_set1_epi32(int(kQuietNaN))));
}

// The high halves of two vectors of 16 dwords, in order: words 1, 3, ..., 31 of a then of b.
SW_AVX512 inline __m512i high_halves(__m512i a, __m512i b) {
  const __m512i idx = _mm512_set_epi16(63, 61, 59, 57, 55, 53, 51, 49, 47, 45, 43, 41, 39, 37, 35, 33, 31, 29, 27, 25,
                                       23, 21, 19, 17, 15, 13, 11, 9, 7, 5, 3, 1);
  return _mm512_permutex2var_epi16(a, idx, b);
}

struct Fp8Table {
  __m512i t0, t1, t2, t3;
};

SW_AVX512 inline Fp8Table fp8_table() {
  return {_mm512_load_si512(kE4m3Bf16.data()), _mm512_load_si512(kE4m3Bf16.data() + 32),
          _mm512_load_si512(kE4m3Bf16.data() + 64), _mm512_load_si512(kE4m3Bf16.data() + 96)};
}

// 32 e4m3 codes (zero-extended to words) -> their values as BFloat16 patterns (exact).
SW_AVX512 inline __m512i fp8_lookup(const Fp8Table& t, __m512i codes) {
  const __m512i lo = _mm512_permutex2var_epi16(t.t0, codes, t.t1);
  const __m512i hi = _mm512_permutex2var_epi16(t.t2, codes, t.t3);
  const __m512i mag = _mm512_mask_blend_epi16(_mm512_test_epi16_mask(codes, _mm512_set1_epi16(0x40)), lo, hi);
  // mag | (codes << 8 & 0x8000): the sign bit.
  return _mm512_ternarylogic_epi32(mag, _mm512_slli_epi16(codes, 8), _mm512_set1_epi16(int16_t(0x8000)), 0xF8);
}

// n (1..32) codes at q, times s, into o (Float32 or BFloat16).
template <Out O, bool Full>
SW_AVX512 inline void fp8_chunk(const Fp8Table& t, const uint8_t* q, int64_t n, __m512 s, void* o) {
  const __mmask32 m = Full ? __mmask32(0xFFFFFFFFu) : lanes32(n);
  const __m256i bytes = Full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)) : _mm256_maskz_loadu_epi8(m, q);
  const __m512i v = fp8_lookup(t, _mm512_cvtepu8_epi16(bytes));
  const __m512 a = _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_castsi512_si256(v)), 16)), s);
  const __m512 b =
      _mm512_mul_ps(_mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm512_extracti64x4_epi64(v, 1)), 16)), s);
  if constexpr (O == Out::Float32) {
    float* f = static_cast<float*>(o);
    if constexpr (Full) {
      _mm512_storeu_ps(f, canonical16(a));
      _mm512_storeu_ps(f + 16, canonical16(b));
    } else {
      _mm512_mask_storeu_ps(f, lanes16(n), canonical16(a));
      _mm512_mask_storeu_ps(f + 16, lanes16(n - 16), canonical16(b));
    }
  } else {
    const __m512i h = high_halves(round_bf16(a), round_bf16(b));
    if constexpr (Full) _mm512_storeu_si512(o, h);
    else _mm512_mask_storeu_epi16(o, m, h);
  }
}

template <Out O>
SW_AVX512 void fp8_avx512(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0, const float* scales,
                          int64_t scale_cols, int64_t block_rows, int64_t block_cols, void* out) {
  constexpr int64_t width = O == Out::Float32 ? 4 : 2;
  const Fp8Table t = fp8_table();
  const int64_t first = row0 / block_rows;
  for (int64_t i = 0; i < rows; ++i) {
    const float* srow = scales + ((row0 + i) / block_rows - first) * scale_cols;
    const uint8_t* qrow = q + i * cols;
    char* orow = static_cast<char*>(out) + i * cols * width;
    for (int64_t c0 = 0, b = 0; c0 < cols; c0 += block_cols, ++b) {
      const int64_t n = std::min(block_cols, cols - c0);
      const __m512 s = _mm512_set1_ps(srow[b]);
      int64_t j = 0;
      for (; j + 32 <= n; j += 32) fp8_chunk<O, true>(t, qrow + c0 + j, 32, s, orow + (c0 + j) * width);
      if (j < n) fp8_chunk<O, false>(t, qrow + c0 + j, n - j, s, orow + (c0 + j) * width);
    }
  }
}

// Note [Per-block product tables]: a block shares one scale, so BFloat16 output has at most 256 distinct values per
// block: round_bf16(e4m3(c) * s) for each code c. Where blocks are large enough to pay for it, each block's results
// are computed once (the same products, rounded by the same code) and every element is a lookup instead of a
// widening, a product and a rounding. Only the 128 magnitudes' results are looked up: rounding to nearest even
// commutes with negation (round(-x) = -round(x)), so the result of code c | 0x80 is that of c with its sign bit
// flipped (a masked add of 0x8000). NaN results stay 0x7FC0: a magnitude's result that is NaN is not flipped (code
// 0x7F's; zero's where the scale is infinite; every one where the scale is NaN). AVX-512 F/BW: two
// VPERMT2W over the 64-entry halves of the table and a blend on bit 6 of the code, 32 codes at a time. With VBMI,
// below, 64 at a time in bytes. Up to kTableBand block columns' tables are built per block row, then the rows
// stream through in order.

SW_AVX512 inline void build_bf16_table(float scale, uint16_t* t) {
  const __m512 s = _mm512_set1_ps(scale);
  for (int k = 0; k < 256; k += 32) {
    const __m512 a = _mm512_mul_ps(_mm512_loadu_ps(kE4m3.data() + k), s);
    const __m512 b = _mm512_mul_ps(_mm512_loadu_ps(kE4m3.data() + k + 16), s);
    _mm512_store_si512(t + k, high_halves(round_bf16(a), round_bf16(b)));
  }
}

// The lanes of 32 BFloat16 patterns that hold a NaN.
SW_AVX512 inline __mmask32 nan_lanes(__m512i w) {
  return _mm512_cmpgt_epu16_mask(_mm512_and_si512(w, _mm512_set1_epi16(0x7FFF)), _mm512_set1_epi16(0x7F80));
}

template <bool Full>
SW_AVX512 inline void fp8_table_chunk(const __m512i* t, const uint8_t* q, int64_t n, uint16_t* o) {
  const __mmask32 m = Full ? __mmask32(0xFFFFFFFFu) : lanes32(n);
  const __m256i bytes = Full ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)) : _mm256_maskz_loadu_epi8(m, q);
  const __m512i c = _mm512_cvtepu8_epi16(bytes);
  const __mmask32 b6 = _mm512_test_epi16_mask(c, _mm512_set1_epi16(0x40));
  // Index bits 0..5 pick one of 64 entries of a pair; bit 6 the pair.
  const __m512i mag = _mm512_mask_blend_epi16(b6, _mm512_permutex2var_epi16(t[0], c, t[1]),
                                              _mm512_permutex2var_epi16(t[2], c, t[3]));
  const __mmask32 flip = _kandn_mask32(nan_lanes(mag), _mm512_test_epi16_mask(c, _mm512_set1_epi16(0x80)));
  const __m512i r = _mm512_mask_add_epi16(mag, flip, mag, _mm512_set1_epi16(int16_t(0x8000)));
  if constexpr (Full) _mm512_storeu_si512(o, r);
  else _mm512_mask_storeu_epi16(o, m, r);
}

SW_AVX512 void fp8_bf16_tabled(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0, const float* scales,
                               int64_t scale_cols, int64_t block_rows, int64_t block_cols, uint16_t* out) {
  alignas(64) uint16_t tables[kTableBand][256];
  const int64_t first = row0 / block_rows;
  for (int64_t i0 = 0; i0 < rows;) {
    const int64_t br = (row0 + i0) / block_rows;
    const int64_t i1 = std::min(rows, (br + 1) * block_rows - row0);
    const float* srow = scales + (br - first) * scale_cols;
    for (int64_t b0 = 0; b0 < scale_cols; b0 += kTableBand) {
      const int64_t b1 = std::min(scale_cols, b0 + kTableBand);
      for (int64_t b = b0; b < b1; ++b) build_bf16_table(srow[b], tables[b - b0]);
      for (int64_t i = i0; i < i1; ++i) {
        const uint8_t* qrow = q + i * cols;
        uint16_t* orow = out + i * cols;
        for (int64_t b = b0; b < b1; ++b) {
          __m512i t[4];
          for (int k = 0; k < 4; ++k) t[k] = _mm512_load_si512(tables[b - b0] + 32 * k);
          const int64_t c0 = b * block_cols, n = std::min(block_cols, cols - c0);
          int64_t j = 0;
          for (; j + 32 <= n; j += 32) fp8_table_chunk<true>(t, qrow + c0 + j, 32, orow + c0 + j);
          if (j < n) fp8_table_chunk<false>(t, qrow + c0 + j, n - j, orow + c0 + j);
        }
      }
    }
    i0 = i1;
  }
}

// With AVX-512 VBMI (Note [Per-block product tables]) the tables are bytes: per 64 codes, two VPERMT2B (each over
// the 128 low or high bytes of the magnitudes' results, held in two registers) look them up, two more interleave
// them into 32 + 32 results, and the sign is flipped as above. Four permutes per 64 results, where the F/BW kernel
// takes six (a zero-extension and two VPERMT2W per 32): the permutes are what bounds both.
SW_AVX512_VBMI inline void build_byte_tables(float scale, uint8_t* t) {
  alignas(64) uint16_t words[256];
  build_bf16_table(scale, words);  // codes 128..255 unused
  for (int k = 0; k < 128; k += 32) {
    const __m512i w = _mm512_load_si512(words + k);
    _mm256_store_si256(reinterpret_cast<__m256i*>(t + k), _mm512_cvtepi16_epi8(w));
    _mm256_store_si256(reinterpret_cast<__m256i*>(t + 128 + k), _mm512_cvtepi16_epi8(_mm512_srli_epi16(w, 8)));
  }
}

template <bool Full>
SW_AVX512_VBMI inline void fp8_byte_chunk(const __m512i* t, __m512i inter0, __m512i inter1, const uint8_t* q,
                                          int64_t n, uint16_t* o) {
  const __m512i c =
      Full ? _mm512_loadu_si512(q) : _mm512_maskz_loadu_epi8(n >= 64 ? ~__mmask64(0) : (__mmask64(1) << n) - 1, q);
  const __mmask64 negative = _mm512_movepi8_mask(c);  // code order: bits 0..31 are w0's, 32..63 w1's
  const __m512i lo = _mm512_permutex2var_epi8(t[0], c, t[1]);  // index bits 0..6: the magnitude
  const __m512i hi = _mm512_permutex2var_epi8(t[2], c, t[3]);
  const __m512i sign = _mm512_set1_epi16(int16_t(0x8000));
  const __m512i w0 = _mm512_permutex2var_epi8(lo, inter0, hi), w1 = _mm512_permutex2var_epi8(lo, inter1, hi);
  const __m512i r0 = _mm512_mask_add_epi16(w0, _kandn_mask32(nan_lanes(w0), __mmask32(negative)), w0, sign);
  const __m512i r1 = _mm512_mask_add_epi16(w1, _kandn_mask32(nan_lanes(w1), __mmask32(negative >> 32)), w1, sign);
  if constexpr (Full) {
    _mm512_storeu_si512(o, r0);
    _mm512_storeu_si512(o + 32, r1);
  } else {
    _mm512_mask_storeu_epi16(o, lanes32(n), r0);
    _mm512_mask_storeu_epi16(o + 32, lanes32(n - 32), r1);
  }
}

SW_AVX512_VBMI void fp8_bf16_tabled_vbmi(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0,
                                         const float* scales, int64_t scale_cols, int64_t block_rows,
                                         int64_t block_cols, uint16_t* out) {
  alignas(64) uint8_t tables[kTableBand][256];
  alignas(64) uint8_t inter_bytes[128];  // byte 2i: low byte i, byte 2i + 1: high byte i (64 + i), then i + 32
  for (int i = 0; i < 32; ++i) {
    inter_bytes[2 * i] = static_cast<uint8_t>(i);
    inter_bytes[2 * i + 1] = static_cast<uint8_t>(64 + i);
    inter_bytes[64 + 2 * i] = static_cast<uint8_t>(32 + i);
    inter_bytes[64 + 2 * i + 1] = static_cast<uint8_t>(96 + i);
  }
  const __m512i inter0 = _mm512_load_si512(inter_bytes), inter1 = _mm512_load_si512(inter_bytes + 64);
  const int64_t first = row0 / block_rows;
  for (int64_t i0 = 0; i0 < rows;) {
    const int64_t br = (row0 + i0) / block_rows;
    const int64_t i1 = std::min(rows, (br + 1) * block_rows - row0);
    const float* srow = scales + (br - first) * scale_cols;
    for (int64_t b0 = 0; b0 < scale_cols; b0 += kTableBand) {
      const int64_t b1 = std::min(scale_cols, b0 + kTableBand);
      for (int64_t b = b0; b < b1; ++b) build_byte_tables(srow[b], tables[b - b0]);
      for (int64_t i = i0; i < i1; ++i) {
        const uint8_t* qrow = q + i * cols;
        uint16_t* orow = out + i * cols;
        for (int64_t b = b0; b < b1; ++b) {
          const __m512i t[4] = {_mm512_load_si512(tables[b - b0]), _mm512_load_si512(tables[b - b0] + 64),
                                _mm512_load_si512(tables[b - b0] + 128), _mm512_load_si512(tables[b - b0] + 192)};
          const int64_t c0 = b * block_cols, n = std::min(block_cols, cols - c0);
          int64_t j = 0;
          for (; j + 64 <= n; j += 64) fp8_byte_chunk<true>(t, inter0, inter1, qrow + c0 + j, 64, orow + c0 + j);
          if (j < n) fp8_byte_chunk<false>(t, inter0, inter1, qrow + c0 + j, n - j, orow + c0 + j);
        }
      }
    }
    i0 = i1;
  }
}

template <Out O>
SW_AVX512 void mxfp4_avx512(const uint8_t* blocks, const uint8_t* scales, int64_t groups, void* out) {
  const __m512 table = _mm512_load_ps(kE2m1.data());
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + 16 * g));
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m512i i0 = _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi));  // values 0..15
    const __m512i i1 = _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi));  // values 16..31
    const __m512 s = _mm512_set1_ps(float_of(e8m0_bits(scales[g])));
    const __m512 a = _mm512_mul_ps(_mm512_permutexvar_ps(i0, table), s);
    const __m512 b = _mm512_mul_ps(_mm512_permutexvar_ps(i1, table), s);
    if constexpr (O == Out::Float32) {
      float* f = static_cast<float*>(out) + 32 * g;
      _mm512_storeu_ps(f, canonical16(a));
      _mm512_storeu_ps(f + 16, canonical16(b));
    } else {
      _mm512_storeu_si512(static_cast<uint16_t*>(out) + 32 * g, high_halves(round_bf16(a), round_bf16(b)));
    }
  }
}

// Note [MXFP4 in the exponent field]: for scale bytes 2..252 every product e2m1 * 2^(s - 127) is a normal finite
// BFloat16 (0.5 * 2^-125 = 2^-126 up to 6 * 2^125 = 1.5 * 2^127), so its pattern is the e2m1 value's pattern with
// s - 127 added to the exponent field (zeros stay zeros): one VPERMW of the 16-entry BFloat16 table and one masked
// add per group. The other scale bytes (subnormal, overflowing or NaN products) take the Float32 product.
alignas(64) constexpr std::array<uint16_t, 32> kE2m1Bf16 = [] {
  std::array<uint16_t, 32> t{};
  for (int k = 0; k < 32; ++k) t[static_cast<size_t>(k)] = static_cast<uint16_t>(std::bit_cast<uint32_t>(kE2m1[k % 16]) >> 16);
  return t;
}();

SW_AVX512 void mxfp4_bf16_avx512(const uint8_t* blocks, const uint8_t* scales, int64_t groups, uint16_t* out) {
  const __m512i table = _mm512_load_si512(kE2m1Bf16.data());
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t g = 0; g < groups; ++g) {
    const uint32_t sb = scales[g];
    if (sb < 2 || sb > 252) {
      mxfp4_avx512<Out::BFloat16>(blocks + 16 * g, scales + g, 1, out + 32 * g);
      continue;
    }
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(blocks + 16 * g));
    const __m128i lo = _mm_and_si128(bytes, low4), hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    const __m256i nib = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_unpacklo_epi8(lo, hi)), _mm_unpackhi_epi8(lo, hi), 1);
    const __m512i idx = _mm512_cvtepu8_epi16(nib);
    const __m512i v = _mm512_permutexvar_epi16(idx, table);
    const __mmask32 nonzero = _mm512_test_epi16_mask(idx, _mm512_set1_epi16(7));
    const __m512i r = _mm512_mask_add_epi16(v, nonzero, v, _mm512_set1_epi16(static_cast<int16_t>((int(sb) - 127) * 128)));
    _mm512_storeu_si512(out + 32 * g, r);
  }
}

// ---------------------------------------------------------------- quantizing

inline float load(const void* in, bool in_bf16, int64_t k) {
  if (in_bf16) return float_of(uint32_t{static_cast<const uint16_t*>(in)[k]} << 16);
  return static_cast<const float*>(in)[k];
}

// The e2m1 code (0..7) nearest a magnitude y >= 0, ties to the even code (the even mantissa), saturating at 6.
// Each comparison adds one at the midpoint above a value: strict where the lower neighbour's code is even.
inline uint8_t e2m1_code(float y) {
  return static_cast<uint8_t>((y > 0.25f) + (y >= 0.75f) + (y > 1.25f) + (y >= 1.75f) + (y > 2.5f) + (y >= 3.5f) +
                              (y > 5.0f));
}

}  // namespace

// ---------------------------------------------------------------- public

float e4m3_to_float(uint8_t byte) noexcept { return kE4m3[byte]; }
float e2m1_to_float(uint8_t nibble) noexcept { return kE2m1[nibble & 0xF]; }
float e8m0_to_float(uint8_t byte) noexcept { return float_of(e8m0_bits(byte)); }
uint16_t float_to_bf16(float value) noexcept { return narrow(value); }

void scales_to_float(const void* raw, Scales type, int64_t count, float* out) noexcept {
  const auto* bytes = static_cast<const unsigned char*>(raw);
  switch (type) {
    case Scales::F32: std::memcpy(out, raw, static_cast<size_t>(count) * 4); break;
    case Scales::BF16:
      for (int64_t i = 0; i < count; ++i) {
        uint16_t h;
        std::memcpy(&h, bytes + 2 * i, 2);
        out[i] = float_of(static_cast<uint32_t>(h) << 16);
      }
      break;
    case Scales::E8M0:
      for (int64_t i = 0; i < count; ++i) out[i] = e8m0_to_float(bytes[i]);
      break;
  }
}

void dequantize_fp8(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0, const float* scales,
                    int64_t scale_cols, int64_t block_rows, int64_t block_cols, void* out, Out out_type) noexcept {
  if (rows <= 0 || cols <= 0) return;
  if (avx512()) {
    if (out_type == Out::Float32)
      fp8_avx512<Out::Float32>(q, rows, cols, row0, scales, scale_cols, block_rows, block_cols, out);
    else if (std::min(rows, block_rows) * std::min(cols, block_cols) >= kTabledElements)  // Note [Per-block product tables]
      (vbmi() ? fp8_bf16_tabled_vbmi : fp8_bf16_tabled)(q, rows, cols, row0, scales, scale_cols, block_rows,
                                                        block_cols, static_cast<uint16_t*>(out));
    else
      fp8_avx512<Out::BFloat16>(q, rows, cols, row0, scales, scale_cols, block_rows, block_cols, out);
    return;
  }
  if (out_type == Out::BFloat16 && std::min(rows, block_rows) * std::min(cols, block_cols) >= kTabledElements)
    return fp8_bf16_tabled_portable(q, rows, cols, row0, scales, scale_cols, block_rows, block_cols,
                                    static_cast<uint16_t*>(out));
  const int64_t width = out_type == Out::Float32 ? 4 : 2, first = row0 / block_rows;
  for (int64_t i = 0; i < rows; ++i)
    fp8_row_portable(q + i * cols, cols, scales + ((row0 + i) / block_rows - first) * scale_cols, block_cols,
                     static_cast<char*>(out) + i * cols * width, out_type);
}

void dequantize_mxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t groups, void* out, Out out_type) noexcept {
  if (groups <= 0) return;
  if (avx512()) {
    if (out_type == Out::Float32) mxfp4_avx512<Out::Float32>(blocks, scales, groups, out);
    else mxfp4_bf16_avx512(blocks, scales, groups, static_cast<uint16_t*>(out));  // Note [MXFP4 in the exponent field]
    return;
  }
  mxfp4_portable(blocks, scales, groups, out, out_type);
}

uint8_t float_to_e4m3(float value) noexcept {
  const uint32_t u = bits_of(value);
  const uint8_t sign = static_cast<uint8_t>((u >> 24) & 0x80u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return 0x7F;                          // NaN
  if (a >= 0x43E00000u) return sign | 0x7E;                  // |x| >= 448 (infinity included): saturate
  if (a >= 0x3C800000u) {                                    // |x| >= 2^-6: a normal e4m3 result
    const uint32_t r = (a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;  // round the mantissa to 3 bits, nearest even
    return static_cast<uint8_t>(sign | (r - (120u << 3)));   // rebias 127 -> 7 (a carry moves to the exponent)
  }
  // Subnormal results m * 2^-9, m = |x| * 2^9 rounded to nearest even (m = 8 is the smallest normal, code 8).
  const int e = static_cast<int>(a >> 23);  // biased; 0 for a Float32 subnormal
  if (e < 127 - 11) return sign;            // |x| < 2^-11: below a quarter of 2^-9, rounds to zero
  const uint32_t mant = (a & 0x7FFFFFu) | 0x800000u;  // |x| = mant * 2^(e - 150)
  const int sh = 150 - 9 - e;                          // m = mant / 2^sh, 21 <= sh <= 25
  const uint32_t m = (mant + ((1u << (sh - 1)) - 1u) + ((mant >> sh) & 1u)) >> sh;
  return static_cast<uint8_t>(sign | m);
}

void quantize_fp8(const void* in, bool in_bf16, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                  uint8_t* q, float* scales) noexcept {
  const int64_t scale_cols = (cols + block_cols - 1) / block_cols;
  const float finite_max = std::numeric_limits<float>::max();
  for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
    const int64_t r1 = std::min(rows, r0 + block_rows);
    float* srow = scales + (r0 / block_rows) * scale_cols;
    std::fill(srow, srow + scale_cols, 0.0f);  // amax of each block first
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t c0 = 0, b = 0; c0 < cols; c0 += block_cols, ++b) {
        const int64_t c1 = std::min(cols, c0 + block_cols);
        float m = srow[b];
        for (int64_t j = c0; j < c1; ++j) {
          const float a = std::fabs(load(in, in_bf16, i * cols + j));
          if (a <= finite_max && a > m) m = a;
        }
        srow[b] = m;
      }
    // scale = amax / 448; 1 where amax is 0, and where amax / 448 underflows to 0 (amax < 2^-140: every value of
    // the block then quantizes to a signed zero instead of dividing by zero).
    for (int64_t b = 0; b < scale_cols; ++b) {
      const float s = srow[b] / 448.0f;
      srow[b] = s == 0.0f ? 1.0f : s;
    }
    for (int64_t i = r0; i < r1; ++i)
      for (int64_t c0 = 0, b = 0; c0 < cols; c0 += block_cols, ++b) {
        const int64_t c1 = std::min(cols, c0 + block_cols);
        const float s = srow[b];
        for (int64_t j = c0; j < c1; ++j) q[i * cols + j] = float_to_e4m3(load(in, in_bf16, i * cols + j) / s);
      }
  }
}

bool quantize_mxfp4(const void* in, bool in_bf16, int64_t groups, uint8_t* blocks, uint8_t* scales) noexcept {
  const float finite_max = std::numeric_limits<float>::max();
  for (int64_t g = 0; g < groups; ++g) {
    float x[32], amax = 0.0f;
    bool nan = false;
    for (int k = 0; k < 32; ++k) {
      x[k] = load(in, in_bf16, 32 * g + k);
      const float a = std::fabs(x[k]);
      nan |= a != a;
      if (a <= finite_max && a > amax) amax = a;
    }
    if (nan) return false;
    // e = floor(log2(amax)) - 2, clamped to [-127, 127]: ilogb is exact for normal and subnormal amax.
    const int e = amax == 0.0f ? -127 : std::clamp(std::ilogb(amax) - 2, -127, 127);
    scales[g] = static_cast<uint8_t>(e + 127);
    // x / 2^e as x * 2^-e: exact (a power of two; |x| / 2^e < 8, and results below 2^-126 are far under the first
    // rounding threshold 0.25); -e in [-127, 127] is a normal Float32.
    const float inv = std::ldexp(1.0f, -e);
    uint8_t* out = blocks + 16 * g;
    for (int j = 0; j < 16; ++j) {
      const float a = x[2 * j], b = x[2 * j + 1];
      const uint8_t lo = static_cast<uint8_t>(e2m1_code(std::fabs(a) * inv) | (std::signbit(a) ? 8 : 0));
      const uint8_t hi = static_cast<uint8_t>(e2m1_code(std::fabs(b) * inv) | (std::signbit(b) ? 8 : 0));
      out[j] = static_cast<uint8_t>(lo | (hi << 4));
    }
  }
  return true;
}

bool uses_avx512() noexcept { return avx512(); }

void force_portable(bool portable) noexcept { g_portable.store(portable, std::memory_order_relaxed); }

void force_avx512_without_vbmi(bool without) noexcept { g_no_vbmi.store(without, std::memory_order_relaxed); }

bool uses_avx512_vbmi() noexcept { return vbmi(); }

}  // namespace sw::quant
