// 8-bit block-wise optimizer state (cpp/src/optim/quantized_state.hpp): the quantizer's AVX-512 and portable paths
// give the same codes and decoded values, each code the nearest map entry (a tie to the larger), and the packed
// format round-trips.
// The NumPy reference and the optimizer-level checks are in tests/test_optim_state_8bit.py.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "strideweave/optim.hpp"
#include "../src/optim/quantized_state.hpp"

namespace {

using namespace sw::optim::detail;

// The nearest entry of q by exhaustive search in Float64 (a tie to the larger entry).
int nearest(const float* map, double q) {
  int best = 0;
  for (int c = 1; c < 256; ++c) {
    const double d = std::fabs(q - map[c]), b = std::fabs(q - map[best]);
    if (d <= b) best = c;  // ascending map: on a tie the later (larger) entry wins
  }
  return best;
}

struct Packed {
  explicit Packed(int64_t n) : n(n), slots(static_cast<size_t>(quant_tile_slots(n)), 0.0f) {}
  int64_t n;
  std::vector<float> slots;
  const float* absmax() const { return slots.data(); }
  const uint8_t* codes() const { return reinterpret_cast<const uint8_t*>(slots.data() + quant_blocks(n)); }
};

// Values spread over the map's decades, the map's own entries times a scale, its exact midpoints (ties), zeros.
std::vector<float> probe_values(int64_t n, bool is_signed, std::mt19937& gen) {
  const float* map = quantization_map(is_signed);
  std::normal_distribution<float> normal;
  std::uniform_int_distribution<int> decade(-7, 0), kind(0, 4), code(0, 254);
  std::vector<float> x(static_cast<size_t>(n));
  for (auto& v : x) {
    switch (kind(gen)) {
      case 0: v = normal(gen) * std::pow(10.0f, static_cast<float>(decade(gen))); break;
      case 1: v = map[code(gen)]; break;
      case 2: {  // a midpoint when it is a Float32 (a tie)
        const int c = code(gen);
        v = static_cast<float>((static_cast<double>(map[c]) + map[c + 1]) / 2);
        break;
      }
      case 3: v = 0.0f; break;
      default: v = normal(gen);
    }
    if (!is_signed) v = std::fabs(v);
  }
  x[0] = is_signed ? -1.0f : 1.0f;  // the first block's absmax is 1 (q = x exactly) unless a larger value follows
  return x;
}

TEST(OptimQuantized, PacksTilesAsDocumented) {
  EXPECT_EQ(quant_blocks(1), 1);
  EXPECT_EQ(quant_blocks(256), 1);
  EXPECT_EQ(quant_blocks(257), 2);
  EXPECT_EQ(quant_tile_slots(667), 3 + 167);  // ceil((667 + 12) / 4)
  EXPECT_EQ(quant_tile_slots(256), 1 + 64);
  EXPECT_EQ(quant_tile_slots(1), 2);
}

TEST(OptimQuantized, CodesAreTheNearestEntryOnBothPaths) {
  for (const bool is_signed : {true, false}) {
    std::mt19937 gen(is_signed ? 7 : 8);
    const float* map = quantization_map(is_signed);
    for (const int64_t n : {int64_t{1}, int64_t{15}, int64_t{256}, int64_t{667}, int64_t{4099}}) {
      const std::vector<float> x = probe_values(n, is_signed, gen);
      Packed avx(n), portable(n);
      force_portable_quantize(false);
      quantize_blocks(x.data(), avx.slots.data(), n, 0, n, is_signed);
      force_portable_quantize(true);
      quantize_blocks(x.data(), portable.slots.data(), n, 0, n, is_signed);
      force_portable_quantize(false);
      ASSERT_EQ(std::memcmp(avx.slots.data(), portable.slots.data(), avx.slots.size() * 4), 0) << n;
      std::vector<float> back(static_cast<size_t>(n)), back_portable(static_cast<size_t>(n));
      dequantize_blocks(avx.slots.data(), n, 0, n, back.data(), is_signed);
      force_portable_quantize(true);
      dequantize_blocks(avx.slots.data(), n, 0, n, back_portable.data(), is_signed);
      force_portable_quantize(false);
      ASSERT_EQ(std::memcmp(back.data(), back_portable.data(), back.size() * 4), 0) << n;
      for (int64_t b = 0; b < quant_blocks(n); ++b) {
        float a = 0;
        for (int64_t k = 256 * b; k < std::min(n, 256 * (b + 1)); ++k) a = std::max(a, std::fabs(x[k]));
        ASSERT_EQ(avx.absmax()[b], a);
        for (int64_t k = 256 * b; k < std::min(n, 256 * (b + 1)); ++k) {
          if (a == 0) {
            EXPECT_EQ(back[k], 0.0f);
            EXPECT_FALSE(std::signbit(back[k]));
            continue;
          }
          const float q = x[k] / a;
          ASSERT_EQ(avx.codes()[k], nearest(map, q)) << "n " << n << " value " << k << " q " << q;
          EXPECT_EQ(back[k], map[avx.codes()[k]] * a);
        }
      }
      for (int64_t k = n; k < 4 * (quant_tile_slots(n) - quant_blocks(n)); ++k) EXPECT_EQ(avx.codes()[k], 0) << k;
    }
  }
}

TEST(OptimQuantized, ATieGoesToTheLargerEntry) {
  const float* map = quantization_map(true);
  // Every midpoint of two neighbouring entries that is itself a Float32, stored beside a 1 (absmax 1: q exact).
  int ties = 0;
  for (int c = 0; c + 1 < 256; ++c) {
    const double mid = (static_cast<double>(map[c]) + map[c + 1]) / 2;
    const float m = static_cast<float>(mid);
    if (static_cast<double>(m) != mid) continue;
    std::vector<float> x = {1.0f, m};
    Packed p(2);
    quantize_blocks(x.data(), p.slots.data(), 2, 0, 2, true);
    EXPECT_EQ(p.codes()[1], c + 1) << c;
    ++ties;
  }
  EXPECT_GT(ties, 100);
}

TEST(OptimQuantized, TheMapsHoldZeroAndOne) {
  for (const bool is_signed : {true, false}) {
    const float* map = sw::optim::blockwise_quantization_map(is_signed);
    for (int c = 1; c < 256; ++c) EXPECT_LT(map[c - 1], map[c]);
    EXPECT_EQ(map[255], 1.0f);
    EXPECT_EQ(map[is_signed ? 127 : 0], 0.0f);
  }
  EXPECT_EQ(quantization_map(true)[0], -0.99296875f);
}

}  // namespace
