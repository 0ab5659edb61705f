// DType::convert_into: DType::convert's rules over a buffer (friendly.tensor's arrays, strideweave/dtype.hpp).
// Every element must come out exactly as convert makes it, and the first refused one raises convert's error.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "strideweave/dtype.hpp"
#include "strideweave/errors.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

TEST(ConvertInto, Float32RoundsAsConvert) {
  const uint64_t seed = testing_support::test_seed();
  std::mt19937_64 rng(seed);
  std::vector<double> in{0.1, 1e300, -1e300, 3.5e38, std::numeric_limits<double>::infinity(), -0.0, 16777217.0};
  std::uniform_real_distribution<double> real(-1e39, 1e39);
  for (int k = 0; k < 200; ++k) in.push_back(real(rng));
  std::vector<float> out(in.size());
  DType::Float32().convert_into(in.data(), in.size(), out.data());
  for (size_t k = 0; k < in.size(); ++k)
    EXPECT_EQ(static_cast<double>(out[k]), DType::Float32().convert(Value::from_float(in[k])).f)
        << in[k] << " seed " << seed;
}

TEST(ConvertInto, IntegersIntoFloat32ThroughADouble) {
  const std::vector<int64_t> in{(int64_t{1} << 53) + 1, std::numeric_limits<int64_t>::max(), -7};
  std::vector<float> out(in.size());
  DType::Float32().convert_into(in.data(), in.size(), out.data());
  for (size_t k = 0; k < in.size(); ++k)
    EXPECT_EQ(static_cast<double>(out[k]), DType::Float32().convert(Value::from_int(in[k])).f) << in[k];
  const std::vector<uint64_t> big{std::numeric_limits<uint64_t>::max()};
  DType::Float32().convert_into(big.data(), 1, out.data());
  EXPECT_EQ(out[0], static_cast<float>(18446744073709551615.0));
}

TEST(ConvertInto, Int32RangeAsConvert) {
  const std::vector<int64_t> ok{std::numeric_limits<int32_t>::min(), 0, std::numeric_limits<int32_t>::max()};
  std::vector<int32_t> out(3);
  DType::Int32().convert_into(ok.data(), ok.size(), out.data());
  EXPECT_EQ(out, (std::vector<int32_t>{std::numeric_limits<int32_t>::min(), 0, std::numeric_limits<int32_t>::max()}));
  const std::vector<int64_t> high{1, int64_t{1} << 31, -(int64_t{1} << 40)};
  EXPECT_SW_THROW(OverflowError, "Int32 element 2147483648 is out of range",
                  DType::Int32().convert_into(high.data(), high.size(), out.data()));
  const std::vector<int64_t> low{-(int64_t{1} << 31) - 1};
  EXPECT_SW_THROW(OverflowError, "out of range [-2147483648, 2147483647]",
                  DType::Int32().convert_into(low.data(), low.size(), out.data()));
  const std::vector<uint64_t> huge{std::numeric_limits<uint64_t>::max()};
  EXPECT_SW_THROW(OverflowError, "out of range", DType::Int32().convert_into(huge.data(), 1, out.data()));
  const std::vector<uint32_t> wide{std::numeric_limits<uint32_t>::max()};
  EXPECT_SW_THROW(OverflowError, "4294967295 is out of range", DType::Int32().convert_into(wide.data(), 1, out.data()));
  const std::vector<double> real{1.0};
  EXPECT_SW_THROW(TypeError, "Int32 element must be an int, got float",
                  DType::Int32().convert_into(real.data(), 1, out.data()));
}

// Each value alone: convert_into accepts exactly what convert accepts (the bulk range check is convert's rule).
TEST(ConvertInto, Int32AcceptsExactlyWhatConvertAccepts) {
  const uint64_t seed = testing_support::test_seed();
  std::mt19937_64 rng(seed);
  std::vector<int64_t> values{std::numeric_limits<int64_t>::min(), std::numeric_limits<int64_t>::max()};
  for (int64_t bound : {int64_t{std::numeric_limits<int32_t>::min()}, int64_t{std::numeric_limits<int32_t>::max()}})
    for (int64_t d = -3; d <= 3; ++d) values.push_back(bound + d);
  for (int k = 0; k < 200; ++k) values.push_back(static_cast<int64_t>(rng()) >> (rng() % 40));
  for (int64_t v : values) {
    bool converts = true, bulk = true;
    try { DType::Int32().convert(Value::from_int(v)); } catch (const OverflowError&) { converts = false; }
    int32_t out;
    try { DType::Int32().convert_into(&v, 1, &out); } catch (const OverflowError&) { bulk = false; }
    EXPECT_EQ(bulk, converts) << v << " seed " << seed;
    if (bulk) EXPECT_EQ(out, v);
    const uint64_t u = static_cast<uint64_t>(v);
    bool unsigned_bulk = true;
    try { DType::Int32().convert_into(&u, 1, &out); } catch (const OverflowError&) { unsigned_bulk = false; }
    EXPECT_EQ(unsigned_bulk, u <= uint64_t{std::numeric_limits<int32_t>::max()}) << u << " seed " << seed;
  }
}

TEST(ConvertInto, BoolTakesNoNumbers) {
  const std::vector<int8_t> in{1};
  bool out[1];
  EXPECT_SW_THROW(TypeError, "Bool element must be a bool, got int", DType::Bool().convert_into(in.data(), 1, out));
  DType::Bool().convert_into(in.data(), 0, out);  // nothing to refuse
}

}  // namespace
}  // namespace sw
