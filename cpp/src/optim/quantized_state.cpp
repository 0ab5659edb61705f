// 8-bit block-wise optimizer state (quantized_state.hpp; Note [Compact optimizer state] in strideweave/optim.hpp):
// the dynamic quantization maps of Dettmers et al. 2021 ("8-bit Optimizers via Block-wise Quantization",
// bitsandbytes' create_dynamic_map), and the block-wise quantizer over packed tiles: a portable loop and an AVX-512F
// one (runtime dispatch) that give identical codes.
#include "quantized_state.hpp"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>

#include "strideweave/carriers/native.hpp"
#include "strideweave/optim.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"
#include "../tiled/internal.hpp"

// GCC 12 reports the intrinsics header's own deliberately undefined vectors as used uninitialized.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"

namespace sw::optim::detail {

namespace {

// Note [The dynamic quantization map]: bitsandbytes' create_dynamic_map(signed, max_exponent_bits=7, total_bits=8).
// For each decade i = 0..6 (scale 10^(i-6)), the interval [0.1, 1] is cut into k equal parts (k = 2^i signed,
// 2^(i+1) unsigned) and the midpoints of the parts, times the scale, are entries; the signed map has them negated
// too; then 0 and 1. Signed: 2 * 127 + 2 = 256 entries in [-0.99296875, 1] (so -1 is not one: a block's most
// negative value at -absmax is stored as -0.99296875 * absmax); unsigned: 254 + 2 = 256 entries in [0, 1]. Each
// entry here is the exact value of that definition, 10^(i-6) * (0.1 + 0.9 * (2j + 1) / (2k)) evaluated in Float64 and
// rounded once to Float32; bitsandbytes evaluates it in Float32 (torch.linspace, a Float32 mean and product), which
// differs from these in the last bits of some entries (at most 2 Float32 ulps; tests/test_optim_state_8bit.py).
struct Map {
  std::array<float, 256> value;
  // threshold[c] (c < 255): the smallest Float32 >= the midpoint of value[c] and value[c + 1] (exact in Float64), so
  // that for a Float32 q, q >= threshold[c] exactly when q >= the midpoint; threshold[255] = NaN (never reached).
  // The nearest entry of q is value[#{c : q >= threshold[c]}] (a tie goes to the larger entry).
  alignas(64) std::array<float, 256> threshold;
  // Note [Bucketed search]: the code of q without a search. The Float32 values q are cut into buckets by sign,
  // exponent (one row per exponent from 2^-23 to 2^0; |q| < 2^-23 is row 0, larger exponents are clamped to the
  // last) and the top 8 bits of the fraction: a bucket spans a relative width of at most 2^-8, less than the
  // smallest relative distance between two thresholds of either map (0.7%: the unsigned map's top decade), so at
  // most one threshold lies inside a bucket. bucket_lo[b] counts the thresholds at or below the bucket's lowest q,
  // and the code is bucket_lo[b] + (q >= threshold[bucket_lo[b]]): one table read and one comparison.
  // `bucketed` is false when a bucket would hold two thresholds (never for these maps: checked when built); the
  // binary search over the thresholds is used then.
  static constexpr int kRows = 25, kBucketsPerSign = kRows * 256;
  alignas(64) std::array<uint8_t, 2 * kBucketsPerSign + 4> bucket_lo;  // + 4: a 32-bit read of the last entry
  bool bucketed = true;
  uint8_t zero_code;
};

inline float float_of_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

inline uint32_t bits_of(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
}

// The bucket of q (Note [Bucketed search]).
inline uint32_t bucket_of(float q) {
  const uint32_t u = bits_of(q);
  const int e = static_cast<int>((u >> 23) & 0xFF);
  const int row = std::clamp(e - 103, 0, Map::kRows - 1);
  return (u >> 31) * Map::kBucketsPerSign + static_cast<uint32_t>(row) * 256 + ((u >> 15) & 0xFF);
}

Map build_map(bool is_signed) {
  static constexpr double kScale[7] = {1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1e0};
  std::array<double, 256> v{};
  int at = 0;
  for (int i = 0; i < 7; ++i) {
    const int64_t k = is_signed ? int64_t{1} << i : int64_t{1} << (i + 1);
    for (int64_t j = 0; j < k; ++j) {
      const double mean = 0.1 + 0.9 * static_cast<double>(2 * j + 1) / static_cast<double>(2 * k);
      const double x = static_cast<double>(static_cast<float>(kScale[i] * mean));
      v[static_cast<size_t>(at++)] = x;
      if (is_signed) v[static_cast<size_t>(at++)] = -x;
    }
  }
  v[static_cast<size_t>(at++)] = 0.0;
  v[static_cast<size_t>(at++)] = 1.0;
  std::sort(v.begin(), v.end());
  Map m{};
  for (size_t c = 0; c < 256; ++c) {
    m.value[c] = static_cast<float>(v[c]);
    if (v[c] == 0.0) m.zero_code = static_cast<uint8_t>(c);
  }
  for (size_t c = 0; c + 1 < 256; ++c) {
    const double mid = (v[c] + v[c + 1]) / 2;  // exact: two Float32 values
    float t = static_cast<float>(mid);
    if (static_cast<double>(t) < mid) t = std::nextafter(t, std::numeric_limits<float>::infinity());
    m.threshold[c] = t;
  }
  m.threshold[255] = std::numeric_limits<float>::quiet_NaN();
  // The buckets (Note [Bucketed search]): positive q in [low, high), negative q in (-high, -low].
  auto count_at_or_below = [&](float x) {
    int k = 0;
    while (k < 255 && m.threshold[static_cast<size_t>(k)] <= x) ++k;
    return k;
  };
  m.bucket_lo.fill(0);
  for (int row = 0; row < Map::kRows; ++row)
    for (uint32_t f = 0; f < 256; ++f) {
      const uint32_t e = static_cast<uint32_t>(103 + row);
      const float low = row == 0 ? 0.0f : float_of_bits(e << 23 | f << 15);
      const float high = row == 0 ? float_of_bits(104u << 23) : float_of_bits((e << 23) + ((f + 1) << 15));
      const size_t b = static_cast<size_t>(row) * 256 + f;
      const int lo = count_at_or_below(low), nlo = count_at_or_below(-high);
      m.bucket_lo[b] = static_cast<uint8_t>(lo);
      m.bucket_lo[Map::kBucketsPerSign + b] = static_cast<uint8_t>(nlo);
      // At most one threshold strictly inside (low, high), and one inside (-high, -low].
      if (lo + 1 < 255 && m.threshold[static_cast<size_t>(lo + 1)] < high) m.bucketed = false;
      if (nlo + 1 < 255 && m.threshold[static_cast<size_t>(nlo + 1)] <= -low) m.bucketed = false;
    }
  return m;
}

const Map& map_of(bool is_signed) {
  static const Map s = build_map(true), u = build_map(false);
  return is_signed ? s : u;
}

std::atomic<bool> g_portable{false};

bool use_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok && !g_portable.load(std::memory_order_relaxed);
}

// The largest magnitude of x[0, n): NaN when one is NaN.
float block_absmax(const float* x, int64_t n) {
  float m[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  bool nan = false;
  int64_t k = 0;
  for (; k + 8 <= n; k += 8)
    for (int l = 0; l < 8; ++l) {
      const float a = std::fabs(x[k + l]);
      nan |= a != a;
      m[l] = a > m[l] ? a : m[l];
    }
  for (; k < n; ++k) {
    const float a = std::fabs(x[k]);
    nan |= a != a;
    m[0] = a > m[0] ? a : m[0];
  }
  if (nan) return std::numeric_limits<float>::quiet_NaN();
  return std::max({m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7]});
}

// The code of q: #{c : q >= threshold[c]}, by its bucket (Note [Bucketed search]).
inline uint8_t code_of(const Map& m, float q) {
  const unsigned lo = m.bucket_lo[bucket_of(q)];
  return static_cast<uint8_t>(lo + (q >= m.threshold[lo] ? 1u : 0u));
}

// The same count by a binary search over the thresholds (8 comparisons): when the buckets do not apply.
inline uint8_t code_by_search(const Map& m, float q) {
  unsigned pos = 0;
  for (unsigned step = 128; step >= 1; step >>= 1) pos += q >= m.threshold[pos + step - 1] ? step : 0;
  return static_cast<uint8_t>(pos);
}

void quantize_portable(const Map& m, const float* x, float absmax, uint8_t* codes, int64_t n) {
  if (!m.bucketed) {
    for (int64_t k = 0; k < n; ++k) codes[k] = code_by_search(m, x[k] / absmax);
    return;
  }
  for (int64_t k = 0; k < n; ++k) codes[k] = code_of(m, x[k] / absmax);
}

__attribute__((target("avx512f"))) void quantize_avx512(const Map& m, const float* x, float absmax, uint8_t* codes,
                                                         int64_t n) {
  // Note [Bucketed search], 16 values at a time: the bucket from the bits, its count gathered (a 32-bit read at a
  // byte offset, low byte kept), the threshold after it gathered and compared.
  const __m512 a = _mm512_set1_ps(absmax);
  const __m512i byte = _mm512_set1_epi32(0xFF), rows = _mm512_set1_epi32(Map::kRows - 1);
  const __m512i per_sign = _mm512_set1_epi32(Map::kBucketsPerSign), bias = _mm512_set1_epi32(103);
  const __m512i one = _mm512_set1_epi32(1);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512 q = _mm512_div_ps(_mm512_loadu_ps(x + k), a);
    const __m512i u = _mm512_castps_si512(q);
    const __m512i e = _mm512_and_si512(_mm512_srli_epi32(u, 23), byte);
    const __m512i row = _mm512_min_epi32(_mm512_max_epi32(_mm512_sub_epi32(e, bias), _mm512_setzero_si512()), rows);
    __m512i b = _mm512_add_epi32(_mm512_slli_epi32(row, 8), _mm512_and_si512(_mm512_srli_epi32(u, 15), byte));
    b = _mm512_add_epi32(b, _mm512_mullo_epi32(_mm512_srli_epi32(u, 31), per_sign));
    const __m512i lo = _mm512_and_si512(_mm512_i32gather_epi32(b, m.bucket_lo.data(), 1), byte);
    const __mmask16 ge = _mm512_cmp_ps_mask(q, _mm512_i32gather_ps(lo, m.threshold.data(), 4), _CMP_GE_OQ);
    const __m512i code = _mm512_mask_add_epi32(lo, ge, lo, one);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + k), _mm512_cvtepi32_epi8(code));
  }
  for (; k < n; ++k) codes[k] = code_of(m, x[k] / absmax);
}

// out[k] = map[codes[k]] * absmax over n values: the map entries gathered 16 at a time.
__attribute__((target("avx512f"))) void decode_avx512(const Map& m, const uint8_t* codes, float absmax, float* out,
                                                       int64_t n) {
  const __m512 a = _mm512_set1_ps(absmax);
  int64_t k = 0;
  for (; k + 16 <= n; k += 16) {
    const __m512i c = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k)));
    _mm512_storeu_ps(out + k, _mm512_mul_ps(_mm512_i32gather_ps(c, m.value.data(), 4), a));
  }
  for (; k < n; ++k) out[k] = m.value[codes[k]] * absmax;
}

}  // namespace

const float* quantization_map(bool is_signed) noexcept { return map_of(is_signed).value.data(); }

void dequantize_blocks(const void* packed, int64_t n, int64_t first, int64_t count, float* out,
                       bool is_signed) noexcept {
  const Map& m = map_of(is_signed);
  const auto* absmax = static_cast<const float*>(packed);
  const auto* codes = reinterpret_cast<const uint8_t*>(absmax + quant_blocks(n));
  const bool avx = use_avx512();
  for (int64_t b = 0; b < count; b += kQuantBlock) {
    const int64_t len = std::min(kQuantBlock, count - b);
    const float a = absmax[(first + b) / kQuantBlock];
    const uint8_t* c = codes + first + b;
    float* o = out + b;
    if (a == 0.0f) std::fill(o, o + len, 0.0f);
    else if (avx) decode_avx512(m, c, a, o, len);
    else
      for (int64_t k = 0; k < len; ++k) o[k] = m.value[c[k]] * a;
  }
}

void quantize_blocks(const float* in, void* packed, int64_t n, int64_t first, int64_t count, bool is_signed) noexcept {
  const Map& m = map_of(is_signed);
  auto* absmax = static_cast<float*>(packed);
  auto* codes = reinterpret_cast<uint8_t*>(absmax + quant_blocks(n));
  const bool avx = use_avx512();
  for (int64_t b = 0; b < count; b += kQuantBlock) {
    const int64_t len = std::min(kQuantBlock, count - b);
    const float* x = in + b;
    uint8_t* c = codes + first + b;
    const float a = block_absmax(x, len);
    absmax[(first + b) / kQuantBlock] = a;
    if (a == 0.0f) std::memset(c, m.zero_code, static_cast<size_t>(len));
    else if (avx && m.bucketed) quantize_avx512(m, x, a, c, len);
    else quantize_portable(m, x, a, c, len);
  }
  // The padding after the last code: zeros, so that a tile's bytes depend on its values alone.
  if (first + count == n) {
    auto* tile_end = reinterpret_cast<uint8_t*>(absmax + quant_tile_slots(n));
    std::fill(codes + n, tile_end, uint8_t{0});
  }
}

TensorPtr decoded_state(const TensorPtr& param, const std::shared_ptr<TiledEvictable>& tiled, const TensorPtr& state,
                        bool is_signed) {
  const int64_t total = param->layout.cosize();
  auto out = std::make_shared<CPUCarrier>(total, DType::Float32(), true, /*empty=*/false);  // zeros
  auto* dst = reinterpret_cast<float*>(out->mutable_native_data());
  if (!tiled) {
    const Carrier::Claim claim = state->carrier->claim("Optimizer.state");
    dequantize_blocks(state->carrier->native_data(), total, 0, total, dst, is_signed);
    return make_tensor(out, param->offset, param->layout);
  }
  auto c = std::static_pointer_cast<TiledEvictable>(state->carrier);
  const int64_t n = tiled->tile_size(), m = quant_tile_slots(n);
  std::vector<float> packed(static_cast<size_t>(m)), values(static_cast<size_t>(n));
  const WorkToken pin = TiledInternals::pin_for_reading(c);
  for (int64_t i = 0; i < c->tile_count(); ++i) {
    CarrierPtr v = TiledInternals::tile_value(*c, i);
    if (!v) continue;  // implicit: zeros
    if (const std::byte* p = v->native_data()) std::memcpy(packed.data(), p, static_cast<size_t>(m) * 4);
    else v->read_slots(0, m, packed.data());
    dequantize_blocks(packed.data(), n, 0, n, values.data(), is_signed);
    for (const Run& r : tiled->footprint_runs(i))
      std::memcpy(dst + r.offset, values.data() + r.ordinal, static_cast<size_t>(r.length) * sizeof(float));
  }
  return make_tensor(out, param->offset, param->layout);
}

const char* quantize_kernel_path() noexcept { return use_avx512() ? "avx512f" : "portable"; }

void force_portable_quantize(bool portable) noexcept { g_portable.store(portable, std::memory_order_relaxed); }

}  // namespace sw::optim::detail

namespace sw::optim {

const float* blockwise_quantization_map(bool is_signed) noexcept { return detail::quantization_map(is_signed); }

}  // namespace sw::optim
