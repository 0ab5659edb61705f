// Quantized checkpoint formats: every e4m3, e2m1 and e8m0 code point against its value computed in double from the
// format's definition; the dequantizing kernels bit for bit against a scalar reference (the Float32 product, then
// BFloat16 by exact round to nearest even) on every dispatch path, on matrices whose sizes are not multiples of the
// block; the quantizers against references written from their definitions; and round trips within the format's
// bound.
#include "strideweave/checkpoint/quantized.hpp"

#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "test_support.hpp"

using sw::testing_support::Rng;
using sw::testing_support::test_seed;
using sw::testing_support::bits;
using sw::testing_support::from_bits;
namespace q = sw::quant;

namespace {

// ---------------------------------------------------------------- the formats, from their definitions, in double

// e4m3fn: sign, 4 exponent bits (bias 7), 3 mantissa bits; exponent 0 subnormal m * 2^-9; S.1111.111 NaN.
double e4m3_value(uint8_t c) {
  const int sign = c >> 7, e = (c >> 3) & 0xF, m = c & 7;
  if (e == 15 && m == 7) return NAN;
  const double mag = e == 0 ? std::ldexp(static_cast<double>(m), -9) : std::ldexp(1.0 + m / 8.0, e - 7);
  return sign ? -mag : mag;
}

// e2m1: sign, 2 exponent bits (bias 1), 1 mantissa bit; exponent 0 subnormal m * 0.5.
double e2m1_value(uint8_t n) {
  const int sign = (n >> 3) & 1, e = (n >> 1) & 3, m = n & 1;
  const double mag = e == 0 ? 0.5 * m : std::ldexp(1.0 + m / 2.0, e - 1);
  return sign ? -mag : mag;
}

// e8m0: 2^(b - 127); 255 NaN.
double e8m0_value(uint8_t b) { return b == 255 ? NAN : std::ldexp(1.0, b - 127); }

// A double that is exactly representable in Float32 or beyond its range (then +-infinity, as IEEE rounding gives
// for anything at or past 2^128 - 2^103).
float to_float_exact(double v) {
  if (std::isnan(v)) return NAN;
  if (std::fabs(v) >= 0x1.ffffffp127) return v > 0 ? INFINITY : -INFINITY;
  const float f = static_cast<float>(v);
  EXPECT_EQ(static_cast<double>(f), v) << "not exact in Float32";
  return f;
}

// Float32 -> BFloat16, exactly: the two BFloat16 neighbours by truncation, the nearer one (ties to the even
// pattern) decided in double; NaN -> 0x7FC0.
uint16_t ref_bf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t u = bits(x);
  const uint16_t lo = static_cast<uint16_t>(u >> 16);
  if ((u & 0xFFFF) == 0) return lo;
  const uint16_t hi = static_cast<uint16_t>(lo + 1);
  const double a = std::fabs(static_cast<double>(x));
  const double vlo = std::fabs(static_cast<double>(from_bits(uint32_t{lo} << 16)));
  const double vhi = (hi & 0x7FFF) == 0x7F80 ? std::ldexp(1.0, 128) : std::fabs(static_cast<double>(from_bits(uint32_t{hi} << 16)));
  const double dlo = a - vlo, dhi = vhi - a;
  if (dlo < dhi) return lo;
  if (dhi < dlo) return hi;
  return (lo & 1) ? hi : lo;
}

// The e4m3 code nearest y (ties to the even code, i.e. the even mantissa), saturating to +-448; NaN -> 0x7F. By
// search over the values of the 127 finite non-negative codes.
uint8_t ref_e4m3(double y) {
  if (std::isnan(y)) return 0x7F;
  const uint8_t sign = std::signbit(y) ? 0x80 : 0;
  const double a = std::fabs(y);
  if (a >= 448.0) return sign | 0x7E;
  int best = 0;
  for (int c = 1; c <= 0x7E; ++c) {
    const double d = std::fabs(e4m3_value(static_cast<uint8_t>(c)) - a), db = std::fabs(e4m3_value(static_cast<uint8_t>(best)) - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return static_cast<uint8_t>(sign | best);
}

// The e2m1 code nearest y (ties to the even code), saturating to +-6, by search over the 8 magnitudes.
uint8_t ref_e2m1(double y) {
  const uint8_t sign = std::signbit(y) ? 8 : 0;
  const double a = std::fabs(y);
  if (a >= 6.0) return sign | 7;
  int best = 0;
  for (int c = 1; c < 8; ++c) {
    const double d = std::fabs(e2m1_value(static_cast<uint8_t>(c)) - a), db = std::fabs(e2m1_value(static_cast<uint8_t>(best)) - a);
    if (d < db || (d == db && (c & 1) == 0)) best = c;
  }
  return static_cast<uint8_t>(sign | best);
}

// ---------------------------------------------------------------- reference kernels

// Float32 output of one element: the Float32 product of the e4m3 value and the scale; NaN canonical.
float ref_fp8_f32(uint8_t c, float scale) {
  const float v = to_float_exact(e4m3_value(c)) * scale;
  return std::isnan(v) ? from_bits(0x7FC00000u) : v;
}

void ref_dequantize_fp8(const std::vector<uint8_t>& qv, int64_t rows, int64_t cols, const std::vector<float>& scales,
                        int64_t br, int64_t bc, std::vector<float>* f32, std::vector<uint16_t>* bf16) {
  const int64_t sc = (cols + bc - 1) / bc;
  f32->resize(static_cast<size_t>(rows * cols));
  bf16->resize(static_cast<size_t>(rows * cols));
  for (int64_t i = 0; i < rows; ++i)
    for (int64_t j = 0; j < cols; ++j) {
      const size_t k = static_cast<size_t>(i * cols + j);
      const float v = ref_fp8_f32(qv[k], scales[static_cast<size_t>((i / br) * sc + j / bc)]);
      (*f32)[k] = v;
      (*bf16)[k] = ref_bf16(v);
    }
}

// Runs f on every dispatch path this machine has: the AVX-512 kernels (when the CPU has them and SW_NO_AVX512 is
// unset) with VBMI where the CPU has it and without, and the portable ones.
void on_every_path(const std::function<void(const char*)>& f) {
  q::force_portable(false);
  q::force_avx512_without_vbmi(false);
  if (q::uses_avx512_vbmi()) {
    f("avx512-vbmi");
    q::force_avx512_without_vbmi(true);
    ASSERT_FALSE(q::uses_avx512_vbmi());
    ASSERT_TRUE(q::uses_avx512());
    f("avx512");
    q::force_avx512_without_vbmi(false);
  } else if (q::uses_avx512()) {
    f("avx512");
  } else {
    static const bool once = [] {
      std::cout << "[ NOTE     ] the AVX-512 kernels do not run here: portable path only" << std::endl;
      return true;
    }();
    (void)once;
  }
  q::force_portable(true);
  ASSERT_FALSE(q::uses_avx512());
  f("portable");
  q::force_portable(false);
}

// n bytes ending at a page boundary followed by an inaccessible page: a kernel that reads past the end faults.
struct GuardedBytes {
  uint8_t* base = nullptr;
  size_t len = 0;
  uint8_t* data = nullptr;
  explicit GuardedBytes(const std::vector<uint8_t>& src) {
    const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    const size_t pages = (src.size() + page - 1) / page + 1;
    len = (pages + 1) * page;
    void* p = mmap(nullptr, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    EXPECT_NE(p, MAP_FAILED);
    base = static_cast<uint8_t*>(p);
    EXPECT_EQ(mprotect(base + pages * page, page, PROT_NONE), 0);
    data = base + pages * page - src.size();
    if (!src.empty()) std::memcpy(data, src.data(), src.size());
  }
  ~GuardedBytes() { munmap(base, len); }
  GuardedBytes(const GuardedBytes&) = delete;
  GuardedBytes& operator=(const GuardedBytes&) = delete;
};

}  // namespace

// ---------------------------------------------------------------- code points

TEST(QuantizedFormats, EveryE4m3CodeIsItsValueFromTheDefinition) {
  int nans = 0;
  for (int c = 0; c < 256; ++c) {
    const double v = e4m3_value(static_cast<uint8_t>(c));
    const float f = q::e4m3_to_float(static_cast<uint8_t>(c));
    if (std::isnan(v)) {
      ++nans;
      ASSERT_TRUE(std::isnan(f)) << c;
      continue;
    }
    ASSERT_EQ(static_cast<double>(f), v) << "code " << c;
    ASSERT_EQ(std::signbit(f), c >= 128) << "code " << c;
  }
  EXPECT_EQ(nans, 2);  // 0x7F and 0xFF
  EXPECT_EQ(q::e4m3_to_float(0x7E), 448.0f);
  EXPECT_EQ(q::e4m3_to_float(0x01), 0x1p-9f);
}

TEST(QuantizedFormats, EveryE2m1NibbleIsItsValueFromTheDefinition) {
  for (int n = 0; n < 16; ++n) {
    const float f = q::e2m1_to_float(static_cast<uint8_t>(n));
    ASSERT_EQ(static_cast<double>(f), e2m1_value(static_cast<uint8_t>(n))) << n;
    ASSERT_EQ(std::signbit(f), n >= 8) << n;
    ASSERT_EQ(bits(q::e2m1_to_float(static_cast<uint8_t>(n | 0xF0))), bits(f)) << "the high bits are ignored";
  }
}

TEST(QuantizedFormats, EveryE8m0ByteIsItsValueFromTheDefinition) {
  for (int b = 0; b < 256; ++b) {
    const double v = e8m0_value(static_cast<uint8_t>(b));
    const float f = q::e8m0_to_float(static_cast<uint8_t>(b));
    if (std::isnan(v)) ASSERT_TRUE(std::isnan(f)) << b;
    else ASSERT_EQ(static_cast<double>(f), v) << b;
  }
  EXPECT_EQ(bits(q::e8m0_to_float(0)), 0x00400000u);  // 2^-127, a Float32 subnormal
}

TEST(QuantizedFormats, FloatToBf16RoundsToNearestEvenAndCanonicalizesNaN) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  std::vector<float> xs = {0.f, -0.f, 1.f, INFINITY, -INFINITY, from_bits(0x3F808000u), from_bits(0x3F818000u),
                           from_bits(0x7F7FFFFFu), from_bits(0x00008000u), from_bits(0x00018000u),
                           from_bits(0xFFC12345u), from_bits(0x7F800001u), from_bits(0xFF800001u)};
  for (int i = 0; i < 100000; ++i) xs.push_back(from_bits(static_cast<uint32_t>(rng.g())));
  for (float x : xs) ASSERT_EQ(q::float_to_bf16(x), ref_bf16(x)) << std::hex << bits(x) << " seed=" << std::dec << seed;
  EXPECT_EQ(q::float_to_bf16(from_bits(0xFFC12345u)), 0x7FC0);  // sign and payload dropped
}

// ---------------------------------------------------------------- FP8 dequantization

namespace {

struct Fp8Case {
  int64_t rows, cols, br, bc;
};

// Codes uniform over all 256 (NaN codes included), scales drawn from ordinary Float32 values, powers of two and
// the extremes of e8m0: 2^-127 (code 0, subnormal products) and 2^127 (code 254, products that overflow to
// infinity); a few BFloat16-valued; and, as the kernels take any Float32 (the tiers refuse them in files),
// negative scales, NaN of either sign and any payload, infinities and signed zeros.
void draw_fp8(Rng& rng, const Fp8Case& c, std::vector<uint8_t>* qv, std::vector<float>* scales) {
  qv->resize(static_cast<size_t>(c.rows * c.cols));
  for (auto& b : *qv) b = static_cast<uint8_t>(rng.uniform(0, 255));
  const int64_t n = ((c.rows + c.br - 1) / c.br) * ((c.cols + c.bc - 1) / c.bc);
  scales->resize(static_cast<size_t>(n));
  for (auto& s : *scales) {
    switch (rng.uniform(0, 9)) {
      case 5: s = -std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng.g), int(rng.uniform(-30, 10))); break;
      case 6: s = from_bits(0x7FC00000u | (rng.chance(0.5) ? 0x80000000u : 0u) | uint32_t(rng.uniform(0, 0x3FFFFF))); break;
      case 7: s = rng.chance(0.5) ? INFINITY : -INFINITY; break;
      case 8: s = rng.chance(0.5) ? 0.0f : -0.0f; break;
      case 0: s = q::e8m0_to_float(0); break;
      case 1: s = q::e8m0_to_float(254); break;
      case 2: s = q::e8m0_to_float(static_cast<uint8_t>(rng.uniform(1, 253))); break;
      case 3: s = from_bits(uint32_t{q::float_to_bf16(std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng.g), int(rng.uniform(-30, 10))))} << 16); break;
      case 4: s = std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng.g), int(rng.uniform(-30, 10))); break;
      default: s = std::ldexp(std::uniform_real_distribution<float>(1, 2)(rng.g), int(rng.uniform(-30, 10)));
    }
  }
}

}  // namespace

TEST(QuantizedFp8, DequantizeMatchesTheScalarReferenceBitForBitOnEveryPathAndBlockShape) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  for (const Fp8Case& c : std::vector<Fp8Case>{{130, 200, 128, 128}, {130, 200, 1, 32}, {130, 200, 64, 48},
                                               {67, 45, 16, 16}, {5, 3, 128, 128}, {33, 129, 7, 5},
                                               {9, 70, 2, 1}, {1, 1, 128, 128}, {40, 257, 3, 300}}) {
    std::vector<uint8_t> qv;
    std::vector<float> scales, want_f32;
    std::vector<uint16_t> want_bf16;
    draw_fp8(rng, c, &qv, &scales);
    ref_dequantize_fp8(qv, c.rows, c.cols, scales, c.br, c.bc, &want_f32, &want_bf16);
    const int64_t sc = (c.cols + c.bc - 1) / c.bc;
    const GuardedBytes guarded(qv);  // the last byte of the matrix is the last readable byte
    on_every_path([&](const char* path) {
      SCOPED_TRACE(std::string(path) + " " + std::to_string(c.rows) + "x" + std::to_string(c.cols) + " block " +
                   std::to_string(c.br) + "x" + std::to_string(c.bc) + " seed=" + std::to_string(seed));
      // The whole matrix, then in partial-row calls (row0 != 0, starting inside a block row and crossing block
      // rows): a third of the way, and at random cuts.
      std::vector<std::vector<int64_t>> splits = {{0, c.rows}};
      if (c.rows >= 3) splits.push_back({0, c.rows / 3, c.rows});
      std::vector<int64_t> cuts = {0};
      while (cuts.back() < c.rows) cuts.push_back(std::min(c.rows, cuts.back() + rng.uniform(1, 50)));
      splits.push_back(cuts);
      for (const auto& cut : splits) {
        const size_t n = static_cast<size_t>(c.rows * c.cols);
        std::vector<float> f32(n + 17, 7.0f);
        std::vector<uint16_t> bf16(n + 33, 0xABCD);
        for (size_t k = 0; k + 1 < cut.size(); ++k) {
          const int64_t r0 = cut[k], r = cut[k + 1] - r0;
          const uint8_t* src = guarded.data + r0 * c.cols;
          const float* s = scales.data() + (r0 / c.br) * sc;
          q::dequantize_fp8(src, r, c.cols, r0, s, sc, c.br, c.bc, f32.data() + r0 * c.cols, q::Out::Float32);
          q::dequantize_fp8(src, r, c.cols, r0, s, sc, c.br, c.bc, bf16.data() + r0 * c.cols, q::Out::BFloat16);
        }
        for (size_t k = 0; k < n; ++k) {
          ASSERT_EQ(bits(f32[k]), bits(want_f32[k])) << "F32 element " << k << " code " << int(qv[k]) << " parts " << cut.size() - 1;
          ASSERT_EQ(bf16[k], want_bf16[k]) << "BF16 element " << k << " code " << int(qv[k]) << " parts " << cut.size() - 1;
        }
        for (size_t k = n; k < f32.size(); ++k) ASSERT_EQ(f32[k], 7.0f) << "wrote past the end";
        for (size_t k = n; k < bf16.size(); ++k) ASSERT_EQ(bf16[k], 0xABCD) << "wrote past the end";
      }
    });
  }
}

TEST(QuantizedFp8, EveryCodeTimesEveryE8m0AndSpecialScaleMatchesTheReference) {
  // Block row b (br rows) holds all 256 codes twice per row (a row of 512: two column blocks of 256) with scale
  // 2^(b - 127) for b = 0..254: subnormal, ordinary and overflowing products, and NaN codes -> 0x7FC0; then the
  // scales the kernels take though no file may hold them: negative, NaN with a sign and payload, infinities (zero
  // times infinity is NaN) and signed zeros. One-row blocks take the per-element kernels, 8 x 256 blocks the
  // per-block product tables (Note [Per-block product tables]).
  const std::vector<float> special = {-1.5f, -0x1p-127f, from_bits(0xFFC12345u), from_bits(0x7F812345u), INFINITY,
                                      -INFINITY, 0.0f, -0.0f};
  const int64_t blocks = 255 + static_cast<int64_t>(special.size());
  for (const int64_t br : {1, 8}) {
    const int64_t rows = blocks * br, cols = 512, bc = 256;
    std::vector<uint8_t> qv(static_cast<size_t>(rows * cols));
    for (size_t k = 0; k < qv.size(); ++k) qv[k] = static_cast<uint8_t>(k % 256);
    std::vector<float> scales(static_cast<size_t>(blocks * 2));
    for (int64_t b = 0; b < blocks; ++b)
      scales[2 * b] = scales[2 * b + 1] =
          b < 255 ? to_float_exact(e8m0_value(static_cast<uint8_t>(b))) : special[static_cast<size_t>(b - 255)];
    std::vector<float> want_f32;
    std::vector<uint16_t> want_bf16;
    ref_dequantize_fp8(qv, rows, cols, scales, br, bc, &want_f32, &want_bf16);
    on_every_path([&](const char* path) {
      SCOPED_TRACE(std::string(path) + " block rows " + std::to_string(br));
      std::vector<float> f32(qv.size());
      std::vector<uint16_t> bf16(qv.size());
      q::dequantize_fp8(qv.data(), rows, cols, 0, scales.data(), 2, br, bc, f32.data(), q::Out::Float32);
      q::dequantize_fp8(qv.data(), rows, cols, 0, scales.data(), 2, br, bc, bf16.data(), q::Out::BFloat16);
      for (size_t k = 0; k < qv.size(); ++k) {
        ASSERT_EQ(bits(f32[k]), bits(want_f32[k])) << "code " << int(qv[k]) << " block row " << k / cols / br;
        ASSERT_EQ(bf16[k], want_bf16[k]) << "code " << int(qv[k]) << " block row " << k / cols / br;
      }
      EXPECT_EQ(bf16[0x7F], 0x7FC0);
      EXPECT_EQ(bf16[0xFF], 0x7FC0);
      EXPECT_EQ(bits(f32[0xFF]), 0x7FC00000u);
    });
  }
}

// ---------------------------------------------------------------- MXFP4 dequantization

TEST(QuantizedMxfp4, EveryNibbleTimesEveryScaleMatchesTheDefinitionOnEveryPath) {
  // Group s has scale byte s (0..255, 255 NaN); its byte j holds nibble j low and 15 - j high, so every nibble
  // appears at both positions of a byte.
  const int64_t groups = 256;
  std::vector<uint8_t> blocks(static_cast<size_t>(16 * groups)), scales(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) {
    scales[static_cast<size_t>(g)] = static_cast<uint8_t>(g);
    for (int j = 0; j < 16; ++j) blocks[static_cast<size_t>(16 * g + j)] = static_cast<uint8_t>(j | ((15 - j) << 4));
  }
  std::vector<float> want_f32(static_cast<size_t>(32 * groups));
  std::vector<uint16_t> want_bf16(want_f32.size());
  for (int64_t g = 0; g < groups; ++g)
    for (int k = 0; k < 32; ++k) {
      const uint8_t byte = blocks[static_cast<size_t>(16 * g + k / 2)];
      const uint8_t nib = k % 2 == 0 ? byte & 0xF : byte >> 4;
      // The exact product in double (a power of two times a 2-bit significand), beyond Float32's range infinite.
      const float v = to_float_exact(e2m1_value(nib) * e8m0_value(static_cast<uint8_t>(g)));
      want_f32[static_cast<size_t>(32 * g + k)] = std::isnan(v) ? from_bits(0x7FC00000u) : v;
      want_bf16[static_cast<size_t>(32 * g + k)] = ref_bf16(v);
    }
  on_every_path([&](const char* path) {
    SCOPED_TRACE(path);
    // All groups at once, then one group per call from an odd offset.
    std::vector<float> f32(want_f32.size() + 16, 7.0f);
    std::vector<uint16_t> bf16(want_f32.size() + 32, 0xABCD);
    q::dequantize_mxfp4(blocks.data(), scales.data(), groups, f32.data(), q::Out::Float32);
    q::dequantize_mxfp4(blocks.data(), scales.data(), groups, bf16.data(), q::Out::BFloat16);
    for (size_t k = 0; k < want_f32.size(); ++k) {
      ASSERT_EQ(bits(f32[k]), bits(want_f32[k])) << "value " << k % 32 << " scale byte " << k / 32;
      ASSERT_EQ(bf16[k], want_bf16[k]) << "value " << k % 32 << " scale byte " << k / 32;
    }
    for (size_t k = want_f32.size(); k < f32.size(); ++k) ASSERT_EQ(f32[k], 7.0f) << "wrote past the end";
    for (size_t k = want_f32.size(); k < bf16.size(); ++k) ASSERT_EQ(bf16[k], 0xABCD) << "wrote past the end";
    const GuardedBytes last(std::vector<uint8_t>(blocks.end() - 16, blocks.end()));
    float one[32];
    q::dequantize_mxfp4(last.data, &scales.back(), 1, one, q::Out::Float32);
    for (int k = 0; k < 32; ++k) ASSERT_TRUE(std::isnan(one[k])) << "scale 255 is NaN for every value, 0 included";
  });
  EXPECT_EQ(want_bf16[0 * 32 + 2], 0x0020);             // nibble 1 (0.5) * 2^-127 = 2^-128, a BFloat16 subnormal
  EXPECT_EQ(want_f32[254 * 32 + 14], INFINITY);         // nibble 7 (6) * 2^127 overflows
}

TEST(QuantizedMxfp4, RandomGroupsMatchTheReferenceOnEveryPath) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  for (int64_t groups : {1, 2, 3, 7, 100}) {
    std::vector<uint8_t> blocks(static_cast<size_t>(16 * groups)), scales(static_cast<size_t>(groups));
    for (auto& b : blocks) b = static_cast<uint8_t>(rng.uniform(0, 255));
    for (auto& s : scales) s = static_cast<uint8_t>(rng.uniform(0, 255));
    on_every_path([&](const char* path) {
      SCOPED_TRACE(std::string(path) + " groups=" + std::to_string(groups) + " seed=" + std::to_string(seed));
      std::vector<float> f32(static_cast<size_t>(32 * groups));
      std::vector<uint16_t> bf16(f32.size());
      q::dequantize_mxfp4(blocks.data(), scales.data(), groups, f32.data(), q::Out::Float32);
      q::dequantize_mxfp4(blocks.data(), scales.data(), groups, bf16.data(), q::Out::BFloat16);
      for (size_t k = 0; k < f32.size(); ++k) {
        const uint8_t byte = blocks[k / 2];
        const float v = to_float_exact(e2m1_value(k % 2 == 0 ? byte & 0xF : byte >> 4) * e8m0_value(scales[k / 32]));
        ASSERT_EQ(bits(f32[k]), bits(std::isnan(v) ? from_bits(0x7FC00000u) : v)) << k;
        ASSERT_EQ(bf16[k], ref_bf16(v)) << k;
      }
    });
  }
}

// ---------------------------------------------------------------- quantizing

TEST(QuantizedFp8, FloatToE4m3RoundsToNearestEvenAndSaturates) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  std::vector<float> xs = {0.f, -0.f, 448.f, -448.f, 449.f, 464.f, 480.f, 1e30f, -1e30f, INFINITY, -INFINITY,
                           0x1p-9f, 0x1p-10f, 0x1.0p-11f, 0x1.8p-10f, 0x1p-6f, 0x1.ep-7f, 1e-40f, -1e-40f};
  // Every finite code, the midpoints between neighbours (ties: to the even code) and a Float32 ulp either side.
  for (int c = 0; c < 0x7E; ++c) {
    const double lo = e4m3_value(static_cast<uint8_t>(c)), hi = e4m3_value(static_cast<uint8_t>(c + 1));
    const float mid = static_cast<float>((lo + hi) / 2);  // exact: 5 significant bits
    for (float x : {static_cast<float>(lo), mid, std::nextafter(mid, 0.f), std::nextafter(mid, 1e3f)}) {
      xs.push_back(x);
      xs.push_back(-x);
    }
  }
  for (int i = 0; i < 20000; ++i) xs.push_back(std::ldexp(std::uniform_real_distribution<float>(-2, 2)(rng.g), int(rng.uniform(-14, 10))));
  for (float x : xs) ASSERT_EQ(int(q::float_to_e4m3(x)), int(ref_e4m3(x))) << "x=" << x << " seed=" << seed;
  EXPECT_EQ(q::float_to_e4m3(NAN), 0x7F);
  EXPECT_EQ(q::float_to_e4m3(-NAN), 0x7F);
  EXPECT_EQ(q::float_to_e4m3(0x1.4p-9f), 0x01);  // 1.25 * 2^-9: a subnormal result, down
  EXPECT_EQ(q::float_to_e4m3(0x1.8p-9f), 0x02);  // 1.5 * 2^-9: a tie, to the even code
  EXPECT_EQ(q::float_to_e4m3(-1000.f), 0xFE);
}

namespace {

// quantize_fp8 from its definition: per block amax over the finite values, scale = amax / 448 in Float32 (1 where
// amax is 0), each code the e4m3 nearest the Float32 quotient.
void ref_quantize_fp8(const std::vector<float>& x, int64_t rows, int64_t cols, int64_t br, int64_t bc,
                      std::vector<uint8_t>* qv, std::vector<float>* scales) {
  const int64_t sr = (rows + br - 1) / br, sc = (cols + bc - 1) / bc;
  qv->assign(x.size(), 0);
  scales->assign(static_cast<size_t>(sr * sc), 0.f);
  for (int64_t bi = 0; bi < sr; ++bi)
    for (int64_t bj = 0; bj < sc; ++bj) {
      float amax = 0;
      for (int64_t i = bi * br; i < std::min(rows, (bi + 1) * br); ++i)
        for (int64_t j = bj * bc; j < std::min(cols, (bj + 1) * bc); ++j)
          if (std::isfinite(x[static_cast<size_t>(i * cols + j)])) amax = std::max(amax, std::fabs(x[static_cast<size_t>(i * cols + j)]));
      const float s = amax == 0 ? 1.0f : amax / 448.0f;
      (*scales)[static_cast<size_t>(bi * sc + bj)] = s;
      for (int64_t i = bi * br; i < std::min(rows, (bi + 1) * br); ++i)
        for (int64_t j = bj * bc; j < std::min(cols, (bj + 1) * bc); ++j)
          (*qv)[static_cast<size_t>(i * cols + j)] = ref_e4m3(x[static_cast<size_t>(i * cols + j)] / s);
    }
}

std::vector<uint16_t> to_bf16(const std::vector<float>& x) {
  std::vector<uint16_t> h(x.size());
  for (size_t k = 0; k < x.size(); ++k) h[k] = ref_bf16(x[k]);
  return h;
}
std::vector<float> widen(const std::vector<uint16_t>& h) {
  std::vector<float> x(h.size());
  for (size_t k = 0; k < h.size(); ++k) x[k] = from_bits(uint32_t{h[k]} << 16);
  return x;
}

}  // namespace

TEST(QuantizedFp8, QuantizeMatchesItsDefinitionWithTiesSaturationZeroBlocksAndSubnormals) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  for (const Fp8Case& c : std::vector<Fp8Case>{{130, 200, 128, 128}, {130, 200, 64, 48}, {7, 70, 1, 32}, {3, 5, 2, 2}}) {
    SCOPED_TRACE(std::to_string(c.rows) + "x" + std::to_string(c.cols) + " block " + std::to_string(c.br) + "x" +
                 std::to_string(c.bc) + " seed=" + std::to_string(seed));
    const int64_t sc = (c.cols + c.bc - 1) / c.bc;
    std::vector<float> x(static_cast<size_t>(c.rows * c.cols));
    for (int64_t i = 0; i < c.rows; ++i)
      for (int64_t j = 0; j < c.cols; ++j) {
        const int64_t block = (i / c.br) * sc + j / c.bc;
        float& v = x[static_cast<size_t>(i * c.cols + j)];
        switch (block % 5) {
          case 0: v = 0.0f; break;  // amax 0: scale 1 (a -0 and a NaN below keep their codes)
          case 1: {  // amax 448 (scale 1): exact e4m3 midpoints, ties to even
            const int code = int(rng.uniform(0, 0x7D));
            v = static_cast<float>((e4m3_value(uint8_t(code)) + e4m3_value(uint8_t(code + 1))) / 2) * (rng.chance(0.5) ? 1 : -1);
            if (i % c.br == 0 && j % c.bc == 0) v = 448.0f;
            break;
          }
          case 2:  // a wide range in one block: small values land on e4m3 subnormals
            v = std::ldexp(std::uniform_real_distribution<float>(-2, 2)(rng.g), int(rng.uniform(-20, 3)));
            break;
          default: v = std::uniform_real_distribution<float>(-3, 3)(rng.g);
        }
        if (rng.chance(0.01)) v = rng.chance(0.5) ? NAN : (rng.chance(0.5) ? INFINITY : -INFINITY);
        if (rng.chance(0.01)) v = -0.0f;
      }
    for (bool in_bf16 : {false, true}) {
      const std::vector<uint16_t> xh = to_bf16(x);
      const std::vector<float> xin = in_bf16 ? widen(xh) : x;
      std::vector<uint8_t> want_q, got_q(x.size(), 0xAA);
      std::vector<float> want_s, got_s(static_cast<size_t>(((c.rows + c.br - 1) / c.br) * sc), -1.f);
      ref_quantize_fp8(xin, c.rows, c.cols, c.br, c.bc, &want_q, &want_s);
      q::quantize_fp8(in_bf16 ? static_cast<const void*>(xh.data()) : x.data(), in_bf16, c.rows, c.cols, c.br, c.bc,
                      got_q.data(), got_s.data());
      for (size_t k = 0; k < want_s.size(); ++k) ASSERT_EQ(bits(got_s[k]), bits(want_s[k])) << "scale " << k << " bf16 " << in_bf16;
      for (size_t k = 0; k < want_q.size(); ++k)
        ASSERT_EQ(int(got_q[k]), int(want_q[k])) << "element " << k << " x=" << xin[k] << " bf16 " << in_bf16;
    }
  }
}

TEST(QuantizedFp8, RoundTripIsWithinTheE4m3Bound) {
  // y = x / s (Float32 quotient, |y| <= 448 up to its rounding) rounds to an e4m3 value q with |q - y| <= 2^-4 |y|
  // (half an ulp, relative) when |y| >= 2^-6 and <= 2^-10 (half the subnormal step 2^-9) below; the kernel's
  // q * s adds one Float32 rounding and the quotient had one: |q s - x| <= max(2^-4 |x|, 2^-10 s) + 2^-22 (|x| + s).
  const uint64_t seed = test_seed();
  Rng rng(seed);
  const int64_t rows = 130, cols = 200, br = 128, bc = 128, sc = 2;
  std::vector<float> x(static_cast<size_t>(rows * cols));
  for (auto& v : x) v = std::ldexp(std::uniform_real_distribution<float>(-2, 2)(rng.g), int(rng.uniform(-16, 4)));
  std::vector<uint8_t> qv(x.size());
  std::vector<float> s(4), back(x.size());
  q::quantize_fp8(x.data(), false, rows, cols, br, bc, qv.data(), s.data());
  on_every_path([&](const char* path) {
    SCOPED_TRACE(std::string(path) + " seed=" + std::to_string(seed));
    q::dequantize_fp8(qv.data(), rows, cols, 0, s.data(), sc, br, bc, back.data(), q::Out::Float32);
    double worst = 0;
    for (int64_t i = 0; i < rows; ++i)
      for (int64_t j = 0; j < cols; ++j) {
        const size_t k = static_cast<size_t>(i * cols + j);
        const double scale = s[static_cast<size_t>((i / br) * sc + j / bc)], xv = x[k];
        const double bound = std::max(0x1p-4 * std::fabs(xv), 0x1p-10 * scale) + 0x1p-22 * (std::fabs(xv) + scale);
        const double err = std::fabs(static_cast<double>(back[k]) - xv);
        ASSERT_LE(err, bound) << "x=" << xv << " scale=" << scale;
        worst = std::max(worst, err / bound);
      }
    EXPECT_GT(worst, 0.5);  // the bound is not loose by orders of magnitude
  });
}

namespace {

// quantize_mxfp4 from the OCP definition: e = floor(log2(amax)) - 2 over the finite values (frexp: exact), clamped
// to [-127, 127] (-127 for amax 0); each x / 2^e (exact in double) to the nearest e2m1, ties to even, saturating.
void ref_quantize_mxfp4(const std::vector<float>& x, std::vector<uint8_t>* blocks, std::vector<uint8_t>* scales) {
  const size_t groups = x.size() / 32;
  blocks->assign(16 * groups, 0);
  scales->assign(groups, 0);
  for (size_t g = 0; g < groups; ++g) {
    double amax = 0;
    for (int k = 0; k < 32; ++k)
      if (std::isfinite(x[32 * g + k])) amax = std::max(amax, std::fabs(double(x[32 * g + k])));
    int e = -127;
    if (amax > 0) {
      int ex;
      std::frexp(amax, &ex);  // amax = f 2^ex, f in [0.5, 1): floor(log2 amax) = ex - 1
      e = std::clamp(ex - 1 - 2, -127, 127);
    }
    (*scales)[g] = static_cast<uint8_t>(e + 127);
    for (int k = 0; k < 32; ++k) {
      const uint8_t n = ref_e2m1(std::ldexp(double(x[32 * g + k]), -e));
      (*blocks)[16 * g + k / 2] |= static_cast<uint8_t>(k % 2 == 0 ? n : n << 4);
    }
  }
}

}  // namespace

TEST(QuantizedMxfp4, QuantizeMatchesTheOcpDefinitionWithTiesSaturationAndScaleClamps) {
  const uint64_t seed = test_seed();
  Rng rng(seed);
  std::vector<float> x;
  auto group = [&](const std::function<float(int)>& f) {
    for (int k = 0; k < 32; ++k) x.push_back(f(k));
  };
  // amax 6 (e = 0): every midpoint of the e2m1 values (ties to even) and a Float32 ulp either side, both signs.
  const float mids[] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
  group([&](int k) {
    if (k == 0) return 6.0f;
    const float m = mids[(k - 1) % 7];
    const float v = k < 8 ? m : k < 15 ? std::nextafter(m, 0.f) : k < 22 ? std::nextafter(m, 9.f) : -m;
    return v;
  });
  group([](int k) { return 0.0f * (k % 2 ? -1.0f : 1.0f); });                    // amax 0: scale byte 0, signed zeros
  group([](int k) { return k == 3 ? 0x1p-140f : 0.0f; });                        // subnormal amax: e clamped to -127
  group([](int k) { return k == 5 ? 3e38f : -1e38f * (k % 3); });                // amax near FLT_MAX: e = 125
  group([](int k) { return k == 0 ? INFINITY : k == 1 ? -INFINITY : 1.0f + k; });  // infinities saturate, not amax
  group([](int k) { return 7.9f - 0.25f * k; });                                // y in (6, 8): saturates to 6
  for (int g = 0; g < 200; ++g) {
    const int ex = int(rng.uniform(-140, 120));
    group([&](int) { return std::ldexp(std::uniform_real_distribution<float>(-2, 2)(rng.g), ex - int(rng.uniform(0, 6))); });
  }
  const int64_t groups = static_cast<int64_t>(x.size() / 32);
  for (bool in_bf16 : {false, true}) {
    SCOPED_TRACE(std::string(in_bf16 ? "bf16" : "f32") + " seed=" + std::to_string(seed));
    const std::vector<uint16_t> xh = to_bf16(x);
    const std::vector<float> xin = in_bf16 ? widen(xh) : x;
    std::vector<uint8_t> want_b, want_s, got_b(16 * x.size() / 32, 0xAA), got_s(x.size() / 32, 0xAA);
    ref_quantize_mxfp4(xin, &want_b, &want_s);
    ASSERT_TRUE(q::quantize_mxfp4(in_bf16 ? static_cast<const void*>(xh.data()) : x.data(), in_bf16, groups,
                                  got_b.data(), got_s.data()));
    for (size_t g = 0; g < want_s.size(); ++g) ASSERT_EQ(int(got_s[g]), int(want_s[g])) << "group " << g;
    for (size_t k = 0; k < want_b.size(); ++k)
      ASSERT_EQ(int(got_b[k]), int(want_b[k])) << "byte " << k << " of group " << k / 16 << ": x=" << xin[2 * k] << ", " << xin[2 * k + 1];
  }
  // The hand-checked cases: group 0's ties (to even codes 0, 2, 2, 4, 4, 6, 6), the clamps and saturation.
  std::vector<uint8_t> b(16 * x.size() / 32), s(x.size() / 32);
  ASSERT_TRUE(q::quantize_mxfp4(x.data(), false, groups, b.data(), s.data()));
  const uint8_t tie_codes[] = {0, 2, 2, 4, 4, 6, 6};
  for (int k = 1; k < 8; ++k) EXPECT_EQ((k % 2 == 0 ? b[k / 2] & 0xF : b[k / 2] >> 4), tie_codes[k - 1]) << mids[k - 1];
  EXPECT_EQ(int(s[0]), 127);
  EXPECT_EQ(int(s[1]), 0);
  EXPECT_EQ(int(b[16]), 0x80);  // +0 low, -0 high
  EXPECT_EQ(int(s[2]), 0);
  EXPECT_EQ(int(s[3]), 127 + 125);
  EXPECT_EQ(int(b[4 * 16]), 0xF7);  // +inf -> 6, -inf -> -6
}

TEST(QuantizedMxfp4, QuantizeRefusesNaN) {
  std::vector<float> x(64, 1.0f);
  x[40] = NAN;
  std::vector<uint8_t> b(32), s(2);
  EXPECT_FALSE(q::quantize_mxfp4(x.data(), false, 2, b.data(), s.data()));
  std::vector<uint16_t> h(32, 0x3F80);
  h[31] = 0xFFC1;
  EXPECT_FALSE(q::quantize_mxfp4(h.data(), true, 1, b.data(), s.data()));
  h[31] = 0x3F80;
  EXPECT_TRUE(q::quantize_mxfp4(h.data(), true, 1, b.data(), s.data()));
}

TEST(QuantizedMxfp4, RoundTripIsWithinHalfAnE2m1Step) {
  // y = x / 2^e is exact; e2m1 spacing is 0.5 below 2, 1 in [2, 4), 2 in [4, 6]: |q - y| <= half of it for |y| <= 6,
  // and |y| - 6 (< 2, since |y| < 2^(floor(log2 amax) + 1 - e) = 8) where it saturates. Dequantizing multiplies by
  // 2^e exactly, so the error in x is that times 2^e.
  const uint64_t seed = test_seed();
  Rng rng(seed);
  const int64_t groups = 300;
  std::vector<float> x(static_cast<size_t>(32 * groups));
  for (int64_t g = 0; g < groups; ++g) {
    const int ex = int(rng.uniform(-100, 100));
    for (int k = 0; k < 32; ++k) x[static_cast<size_t>(32 * g + k)] = std::ldexp(std::uniform_real_distribution<float>(-2, 2)(rng.g), ex - int(rng.uniform(0, 4)));
  }
  std::vector<uint8_t> b(static_cast<size_t>(16 * groups)), s(static_cast<size_t>(groups));
  ASSERT_TRUE(q::quantize_mxfp4(x.data(), false, groups, b.data(), s.data()));
  on_every_path([&](const char* path) {
    SCOPED_TRACE(std::string(path) + " seed=" + std::to_string(seed));
    std::vector<float> back(x.size());
    q::dequantize_mxfp4(b.data(), s.data(), groups, back.data(), q::Out::Float32);
    for (size_t k = 0; k < x.size(); ++k) {
      const double p = std::ldexp(1.0, s[k / 32] - 127), y = std::fabs(double(x[k])) / p;
      const double half_step = y > 6 ? y - 6 : y >= 4 ? 1.0 : y >= 2 ? 0.5 : 0.25;
      ASSERT_LE(std::fabs(double(back[k]) - double(x[k])), half_step * p) << "x=" << x[k] << " group " << k / 32;
    }
  });
}

TEST(QuantizedDispatch, ForcePortableSwitchesThePathAndBack) {
  q::force_portable(true);
  EXPECT_FALSE(q::uses_avx512());
  EXPECT_FALSE(q::uses_avx512_vbmi());
  q::force_portable(false);
  q::force_avx512_without_vbmi(true);
  EXPECT_FALSE(q::uses_avx512_vbmi());
  q::force_avx512_without_vbmi(false);
  const bool cpu = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl");
  const char* env = std::getenv("SW_NO_AVX512");
  const bool disabled = env && *env && std::string(env) != "0";
  EXPECT_EQ(q::uses_avx512(), cpu && !disabled);
  EXPECT_EQ(q::uses_avx512_vbmi(), cpu && !disabled && __builtin_cpu_supports("avx512vbmi"));
}
