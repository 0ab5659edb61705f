// Quantized checkpoint tiers (Note [A quantized checkpoint tier] in strideweave/carriers/checkpoint.hpp): ranges of
// FP8 block-scaled and MXFP4 bytes read as BFloat16 or Float32 values, whole or in part, exactly the quantized bytes
// and scales counted as read, writes into the overlay in the values' dtype, never the file.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <fstream>
#include <iterator>
#include <random>

#include "strideweave/carriers/checkpoint.hpp"
#include "strideweave/checkpoint/quantized.hpp"
#include "test_support.hpp"

using namespace sw;
using namespace sw::testing_support;
using Range = CheckpointCarrier::Range;
using Writes = CheckpointCarrier::Writes;
using Q = QuantizedRange;

namespace {

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The value an FP8 byte stands for, from the format's definition (not the kernels' tables): 1 sign, 4 exponent
// bits of bias 7, 3 mantissa bits, exponent 0 subnormal, 0x7F/0xFF NaN.
double e4m3(uint8_t b) {
  const int sign = b >> 7, exp = (b >> 3) & 15, man = b & 7;
  if (exp == 15 && man == 7) return NAN;
  const double mag = exp == 0 ? man / 8.0 * std::ldexp(1.0, -6) : (1 + man / 8.0) * std::ldexp(1.0, exp - 7);
  return sign ? -mag : mag;
}
double e2m1(uint8_t n) {
  static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
  return (n & 8) ? -mag[n & 7] : mag[n & 7];
}
// Float32 -> BFloat16 bits, nearest even, NaN canonical: from the definition.
uint16_t to_bf16(float f) {
  if (std::isnan(f)) return 0x7FC0;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

struct Fp8File {
  int64_t rows, cols, br, bc, sr, sc;
  std::vector<uint8_t> q;
  std::vector<float> scales;
  uint64_t q_at = 16, s_at = 0;  // byte offsets in the file (a 16-byte preamble first)
};

// An FP8 matrix with every byte value present (cycled) and varied block scales, written after a preamble.
Fp8File write_fp8(const std::string& path, int64_t rows, int64_t cols, int64_t br, int64_t bc, uint32_t seed) {
  Fp8File f{rows, cols, br, bc, (rows + br - 1) / br, (cols + bc - 1) / bc, {}, {}};
  std::mt19937 rng(seed);
  f.q.resize(static_cast<size_t>(rows * cols));
  for (size_t i = 0; i < f.q.size(); ++i) f.q[i] = static_cast<uint8_t>((i * 37 + rng()) & 0xFF);
  for (int64_t k = 0; k < f.sr * f.sc; ++k) f.scales.push_back(std::ldexp(1.0f + (rng() % 1000) / 1000.0f, int(rng() % 20) - 10));
  f.s_at = f.q_at + f.q.size();
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << std::string(16, '\xEE');
  out.write(reinterpret_cast<const char*>(f.q.data()), static_cast<std::streamsize>(f.q.size()));
  out.write(reinterpret_cast<const char*>(f.scales.data()), static_cast<std::streamsize>(f.scales.size() * 4));
  return f;
}

Range fp8_range(const std::shared_ptr<CheckpointFile>& file, const Fp8File& f) {
  auto q = std::make_shared<QuantizedRange>();
  q->format = Q::Format::FP8;
  q->scale_type = Q::Scale::F32;
  q->scale_file = file;
  q->scale_offset = f.s_at;
  q->rows = f.rows;
  q->cols = f.cols;
  q->block_rows = f.br;
  q->block_cols = f.bc;
  return Range{file, f.q_at, f.rows * f.cols, std::move(q)};
}

// The reference value (i, j): the e4m3 value times its block's scale, rounded once to Float32.
float fp8_value(const Fp8File& f, int64_t i, int64_t j) {
  const float v = static_cast<float>(e4m3(f.q[static_cast<size_t>(i * f.cols + j)]));
  return v * f.scales[static_cast<size_t>((i / f.br) * f.sc + j / f.bc)];
}

bool same_float(float a, float b) { return (std::isnan(a) && std::isnan(b)) || std::memcmp(&a, &b, 4) == 0; }

}  // namespace

TEST(QuantizedTier, Fp8ReadsWholeAndPartialBitExactAndCountsOnlyItsBytes) {
  TempPath path("sw-q8");
  const Fp8File f = write_fp8(path.path(), 130, 200, 128, 128, static_cast<uint32_t>(test_seed()));
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  for (const DType* d : {&DType::BFloat16(), &DType::Float32()}) {
    CheckpointCarrier c({fp8_range(file, f)}, *d, Writes::Overlay);
    ASSERT_EQ(c.size(), f.rows * f.cols);
    EXPECT_EQ(c.map_slots(0, c.size()), nullptr);  // never mapped: read, dequantized
    const uint64_t before = file->bytes_read();
    std::vector<std::byte> all(static_cast<size_t>(c.size()) * slot_bytes(*d));
    c.read_slots(0, c.size(), all.data());
    EXPECT_EQ(file->bytes_read() - before, f.q.size() + f.scales.size() * 4);
    auto check = [&](const std::byte* got, int64_t slot) {
      const float want = fp8_value(f, slot / f.cols, slot % f.cols);
      if (d == &DType::BFloat16()) {
        uint16_t h;
        std::memcpy(&h, got, 2);
        ASSERT_EQ(h, to_bf16(want)) << "slot " << slot;
      } else {
        float v;
        std::memcpy(&v, got, 4);
        ASSERT_TRUE(same_float(v, want)) << "slot " << slot << ": " << v << " vs " << want;
      }
    };
    for (int64_t s = 0; s < c.size(); ++s) check(all.data() + s * slot_bytes(*d), s);
    // Pieces that begin and end inside rows and blocks, and single values of a transposed walk.
    for (auto [start, count] : std::vector<std::pair<int64_t, int64_t>>{{5, 3}, {190, 30}, {127 * 200 + 7, 590}, {25999, 1}}) {
      std::vector<std::byte> part(static_cast<size_t>(count) * slot_bytes(*d));
      c.read_slots(start, count, part.data());
      for (int64_t k = 0; k < count; ++k) check(part.data() + k * slot_bytes(*d), start + k);
    }
    {  // a fresh tier's first read, in the second block row (no chunk cached yet)
      CheckpointCarrier fresh({fp8_range(file, f)}, *d, Writes::Overlay);
      std::vector<std::byte> part(5 * slot_bytes(*d));
      fresh.read_slots(129 * 200 + 3, 5, part.data());
      for (int64_t k = 0; k < 5; ++k) check(part.data() + k * slot_bytes(*d), 129 * 200 + 3 + k);
    }
    const uint64_t walk = file->bytes_read();
    for (int64_t j = 0; j < f.cols; j += 13)
      for (int64_t i = 0; i < f.rows; ++i) {
        std::byte one[4];
        c.read_slots(i * f.cols + j, 1, one);
        check(one, i * f.cols + j);
      }
    // The walk reads the matrix's bytes once per column visited at most (here all of it fits one cached chunk).
    EXPECT_LE(file->bytes_read() - walk, 2 * (f.q.size() + f.scales.size() * 4));
  }
}

TEST(QuantizedTier, WritesGoToTheOverlayInTheValuesDtypeAndNeverToTheFile) {
  TempPath path("sw-q8w");
  const Fp8File f = write_fp8(path.path(), 40, 64, 16, 32, 7);
  const std::string original = contents(path.path());
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  CheckpointCarrier c({fp8_range(file, f)}, DType::Float32(), Writes::Overlay);
  const float w[3] = {1.25f, -3.5f, 1e30f};  // 1e30 has no e4m3 form: the overlay holds Float32 values
  c.write_slots(100, 3, w);
  EXPECT_EQ(c.overlaid_ranges(), 1);
  std::vector<float> back(static_cast<size_t>(c.size()));
  c.read_slots(0, c.size(), back.data());
  for (int64_t s = 0; s < c.size(); ++s) {
    const float want = s >= 100 && s < 103 ? w[s - 100] : fp8_value(f, s / f.cols, s % f.cols);
    ASSERT_TRUE(same_float(back[static_cast<size_t>(s)], want)) << s;
  }
  EXPECT_EQ(contents(path.path()), original);
}

TEST(QuantizedTier, Mxfp4ReadsEveryNibbleUnderEveryFiniteScale) {
  TempPath path("sw-q4");
  // 255 groups (e8m0 codes 0..254, one per group), each holding the 16 nibbles twice in a rotating order.
  const int64_t groups = 255;
  std::vector<uint8_t> blocks(static_cast<size_t>(groups * 16)), scales(static_cast<size_t>(groups));
  for (int64_t g = 0; g < groups; ++g) {
    scales[static_cast<size_t>(g)] = static_cast<uint8_t>(g);
    for (int j = 0; j < 16; ++j)
      blocks[static_cast<size_t>(g * 16 + j)] = static_cast<uint8_t>(((j + g) & 15) | (((15 - j + g) & 15) << 4));
  }
  {
    std::ofstream out(path.path(), std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char*>(blocks.data()), static_cast<std::streamsize>(blocks.size()));
    out.write(reinterpret_cast<const char*>(scales.data()), static_cast<std::streamsize>(scales.size()));
  }
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  auto q = std::make_shared<QuantizedRange>();
  q->format = Q::Format::MXFP4;
  q->scale_type = Q::Scale::E8M0;
  q->scale_file = file;
  q->scale_offset = blocks.size();
  q->rows = 3;  // 3 rows of 85 groups (2720 values)
  q->cols = 85 * 32;
  CheckpointCarrier c({Range{file, 0, groups * 32, q}}, DType::BFloat16(), Writes::Overlay);
  std::vector<uint16_t> got(static_cast<size_t>(c.size()));
  c.read_slots(0, c.size(), got.data());
  EXPECT_EQ(file->bytes_read(), blocks.size() + scales.size());
  for (int64_t i = 0; i < c.size(); ++i) {
    const int64_t g = i / 32, j = (i % 32) / 2;
    const uint8_t byte = blocks[static_cast<size_t>(g * 16 + j)];
    const uint8_t nibble = (i % 2) ? byte >> 4 : byte & 15;
    const float want = static_cast<float>(e2m1(nibble) * std::ldexp(1.0, static_cast<int>(g) - 127));
    ASSERT_EQ(got[static_cast<size_t>(i)], to_bf16(want)) << "value " << i;
  }
}

TEST(QuantizedTier, RefusesInPlaceWritesOtherDtypesAndSizesThatDisagree) {
  TempPath path("sw-q8e");
  const Fp8File f = write_fp8(path.path(), 8, 8, 4, 4, 3);
  auto file = std::make_shared<CheckpointFile>(path.path(), true);
  EXPECT_SW_THROW(ValueError, "cannot be written in place", CheckpointCarrier({fp8_range(file, f)}, DType::BFloat16(), Writes::InPlace));
  EXPECT_SW_THROW(TypeError, "BFloat16 or Float32", CheckpointCarrier({fp8_range(file, f)}, DType::Float16(), Writes::Overlay));
  Range bad = fp8_range(file, f);
  bad.slots = 63;
  EXPECT_SW_THROW(ValueError, "do not agree", CheckpointCarrier({bad}, DType::BFloat16(), Writes::Overlay));
  Range past = fp8_range(file, f);
  auto q = std::make_shared<QuantizedRange>(*past.quant);
  q->scale_offset = f.s_at + 8;  // the last scales would lie past the end
  past.quant = q;
  EXPECT_SW_THROW(ValueError, "lies past the end", CheckpointCarrier({past}, DType::BFloat16(), Writes::Overlay));
  EXPECT_EQ(file->bytes_read(), 0u);
}
