// DType singletons and the element conversion rules (docs/guide.md, "DTypes",
// strideweave/dtype.hpp).
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "strideweave/dtype.hpp"
#include "strideweave/errors.hpp"
#include "test_support.hpp"

namespace sw {

namespace {


const DType& F32() { return DType::Float32(); }
const DType& I32() { return DType::Int32(); }
const DType& B() { return DType::Bool(); }
const DType& F64() { return DType::Float64(); }

TEST(DType, Singletons) {
  EXPECT_EQ(&DType::Float32(), &DType::Float32());
  EXPECT_EQ(&DType::Int32(), &DType::Int32());
  EXPECT_EQ(&DType::Bool(), &DType::Bool());
  EXPECT_EQ(&DType::Float64(), &DType::Float64());
  EXPECT_NE(&F32(), &I32());
  EXPECT_NE(&F32(), &F64());
  EXPECT_NE(&I32(), &B());
  EXPECT_TRUE(F32() == DType::Float32());
  EXPECT_FALSE(F32() == F64());
  EXPECT_EQ(&DType::from_id(DTypeId::Float32), &F32());
  EXPECT_EQ(&DType::from_id(DTypeId::Int32), &I32());
  EXPECT_EQ(&DType::from_id(DTypeId::Bool), &B());
  EXPECT_EQ(&DType::from_id(DTypeId::Float64), &F64());
  EXPECT_EQ(F32().id(), DTypeId::Float32);
  EXPECT_EQ(I32().id(), DTypeId::Int32);
  EXPECT_EQ(B().id(), DTypeId::Bool);
  EXPECT_EQ(F64().id(), DTypeId::Float64);
}

TEST(DType, NamesBitsAndFlags) {
  EXPECT_EQ(F32().name(), "Float32");
  EXPECT_EQ(I32().name(), "Int32");
  EXPECT_EQ(B().name(), "Bool");
  EXPECT_EQ(F64().name(), "Float64");
  EXPECT_EQ(F32().bits(), 32);
  EXPECT_EQ(I32().bits(), 32);
  EXPECT_EQ(B().bits(), 8);
  EXPECT_EQ(F64().bits(), 64);
  EXPECT_EQ(F32().itemsize(), 4u);
  EXPECT_EQ(I32().itemsize(), 4u);
  EXPECT_EQ(B().itemsize(), 1u);
  EXPECT_EQ(F64().itemsize(), 8u);
  EXPECT_TRUE(F32().is_storage());
  EXPECT_TRUE(I32().is_storage());
  EXPECT_TRUE(B().is_storage());
  EXPECT_FALSE(F64().is_storage());
  EXPECT_TRUE(F32().is_floating());
  EXPECT_FALSE(I32().is_floating());
  EXPECT_FALSE(B().is_floating());
  EXPECT_TRUE(F64().is_floating());
}

TEST(DType, RegisteredOrder) {
  const auto& all = DType::registered();
  ASSERT_EQ(all.size(), 6u);  // issue 18 added BFloat16 and Float16 after the first four
  EXPECT_EQ(all[0], &F32());
  EXPECT_EQ(all[1], &I32());
  EXPECT_EQ(all[2], &B());
  EXPECT_EQ(all[3], &F64());
  EXPECT_EQ(all[4], &DType::BFloat16());
  EXPECT_EQ(all[5], &DType::Float16());
  EXPECT_EQ(&DType::registered(), &all);  // one table
  for (size_t k = 0; k < all.size(); ++k) EXPECT_EQ(static_cast<size_t>(all[k]->id()), k);
}

TEST(DType, ElementTypes) {
  static_assert(std::is_same_v<ElementOf<DTypeId::Float32>::type, float>);
  static_assert(std::is_same_v<ElementOf<DTypeId::Int32>::type, int32_t>);
  static_assert(std::is_same_v<ElementOf<DTypeId::Bool>::type, bool>);
  static_assert(std::is_same_v<ElementOf<DTypeId::Float64>::type, double>);
  for (const DType* d : DType::registered()) {
    size_t size = visit_dtype(d->id(), [](auto x) { return sizeof(x); });
    EXPECT_EQ(size, d->itemsize()) << d->name();
  }
}

TEST(DType, ValueKindNames) {
  EXPECT_EQ(Value::from_float(1.5).kind_name(), "float");
  EXPECT_EQ(Value::from_int(3).kind_name(), "int");
  EXPECT_EQ(Value::from_big_int(1e30).kind_name(), "int");
  EXPECT_EQ(Value::from_bool(true).kind_name(), "bool");
}

// ---------------------------------------------------------------- Float32

TEST(DTypeConvert, Float32RoundsFloatsToBinary32) {
  const Value v = F32().convert(Value::from_float(0.1));
  EXPECT_EQ(v.kind, Value::Kind::Float);
  EXPECT_EQ(v.f, static_cast<double>(0.1f));
  EXPECT_NE(v.f, 0.1);
  EXPECT_EQ(F32().convert(Value::from_float(1.5)), Value::from_float(1.5));  // exact stays exact
  EXPECT_EQ(F32().convert(Value::from_float(-0.0)).f, 0.0);
  EXPECT_TRUE(std::signbit(F32().convert(Value::from_float(-0.0)).f));
  // 1 + 2**-30 is not representable in binary32: rounds to 1.
  EXPECT_EQ(F32().convert(Value::from_float(1.0 + std::ldexp(1.0, -30))).f, 1.0);
  // Round-to-nearest-even at the halfway point 1 + 2**-24.
  EXPECT_EQ(F32().convert(Value::from_float(1.0 + std::ldexp(1.0, -24))).f, 1.0);
  EXPECT_EQ(F32().convert(Value::from_float(1.0 + 3 * std::ldexp(1.0, -24))).f, 1.0 + std::ldexp(1.0, -22));
  EXPECT_EQ(F32().convert(Value::from_float(3.4028234663852886e38)).f, 3.4028234663852886e38);  // FLT_MAX
  EXPECT_TRUE(std::isinf(F32().convert(Value::from_float(INFINITY)).f));
  EXPECT_TRUE(std::isnan(F32().convert(Value::from_float(NAN)).f));
  // Subnormals round to the binary32 grid.
  const double tiny = std::ldexp(1.0, -149);
  EXPECT_EQ(F32().convert(Value::from_float(tiny)).f, tiny);
  EXPECT_EQ(F32().convert(Value::from_float(tiny / 4)).f, 0.0);
}

TEST(DTypeConvert, Float32AcceptsIntsAndRounds) {
  const Value v = F32().convert(Value::from_int(7));
  EXPECT_EQ(v.kind, Value::Kind::Float);
  EXPECT_EQ(v.f, 7.0);
  EXPECT_EQ(F32().convert(Value::from_int(16777216)).f, 16777216.0);
  EXPECT_EQ(F32().convert(Value::from_int(16777217)).f, 16777216.0);  // 2**24 + 1 is not a binary32
  EXPECT_EQ(F32().convert(Value::from_int(-16777219)).f, -16777220.0);
  EXPECT_EQ(F32().convert(Value::from_int(std::numeric_limits<int64_t>::max())).f, 9223372036854775808.0);
  // Ints beyond int64 also convert (the header: Float32 accepts int).
  const Value big = F32().convert(Value::from_big_int(1e30));
  EXPECT_EQ(big.kind, Value::Kind::Float);
  EXPECT_EQ(big.f, static_cast<double>(1e30f));
}

TEST(DTypeConvert, Float32RejectsBool) {
  EXPECT_SW_THROW(TypeError, "got bool", F32().convert(Value::from_bool(true)));
  EXPECT_SW_THROW(TypeError, "Float32", F32().convert(Value::from_bool(false)));
}

// ---------------------------------------------------------------- Float64 (accumulator)

TEST(DTypeConvert, Float64) {
  EXPECT_EQ(F64().convert(Value::from_float(0.1)), Value::from_float(0.1));
  const Value v = F64().convert(Value::from_int(16777217));
  EXPECT_EQ(v.kind, Value::Kind::Float);
  EXPECT_EQ(v.f, 16777217.0);
  EXPECT_SW_THROW(TypeError, "got bool", F64().convert(Value::from_bool(true)));
}

// ---------------------------------------------------------------- Int32

TEST(DTypeConvert, Int32AcceptsIntsInRange) {
  EXPECT_EQ(I32().convert(Value::from_int(0)), Value::from_int(0));
  EXPECT_EQ(I32().convert(Value::from_int(-5)), Value::from_int(-5));
  EXPECT_EQ(I32().convert(Value::from_int(2147483647)), Value::from_int(2147483647));
  EXPECT_EQ(I32().convert(Value::from_int(-2147483648LL)), Value::from_int(-2147483648LL));
  EXPECT_EQ(I32().convert(Value::from_int(12345)).kind, Value::Kind::Int);
}

TEST(DTypeConvert, Int32OutOfRangeOverflows) {
  EXPECT_SW_THROW(OverflowError, "out of range", I32().convert(Value::from_int(2147483648LL)));
  EXPECT_SW_THROW(OverflowError, "out of range", I32().convert(Value::from_int(-2147483649LL)));
  EXPECT_SW_THROW(OverflowError, "2147483648", I32().convert(Value::from_int(2147483648LL)));
  EXPECT_SW_THROW(OverflowError, "out of range",
                  I32().convert(Value::from_int(std::numeric_limits<int64_t>::max())));
  EXPECT_SW_THROW(OverflowError, "out of range",
                  I32().convert(Value::from_int(std::numeric_limits<int64_t>::min())));
  EXPECT_SW_THROW(OverflowError, "out of range", I32().convert(Value::from_big_int(1e30)));
  EXPECT_SW_THROW(OverflowError, "out of range", I32().convert(Value::from_big_int(-1e30)));
}

TEST(DTypeConvert, Int32RejectsOtherKinds) {
  EXPECT_SW_THROW(TypeError, "got float", I32().convert(Value::from_float(1.0)));
  EXPECT_SW_THROW(TypeError, "got float", I32().convert(Value::from_float(1.5)));
  EXPECT_SW_THROW(TypeError, "got bool", I32().convert(Value::from_bool(true)));
  EXPECT_SW_THROW(TypeError, "Int32", I32().convert(Value::from_bool(false)));
}

// ---------------------------------------------------------------- Bool

TEST(DTypeConvert, BoolAcceptsOnlyBool) {
  EXPECT_EQ(B().convert(Value::from_bool(true)), Value::from_bool(true));
  EXPECT_EQ(B().convert(Value::from_bool(false)), Value::from_bool(false));
  EXPECT_SW_THROW(TypeError, "got int", B().convert(Value::from_int(1)));
  EXPECT_SW_THROW(TypeError, "got int", B().convert(Value::from_int(0)));
  EXPECT_SW_THROW(TypeError, "got int", B().convert(Value::from_big_int(1e30)));
  EXPECT_SW_THROW(TypeError, "got float", B().convert(Value::from_float(1.0)));
  EXPECT_SW_THROW(TypeError, "Bool", B().convert(Value::from_float(0.0)));
}

// Every (dtype, kind) pair: accepted or the documented error type, never another.
TEST(DTypeConvert, KindMatrix) {
  const Value samples[] = {Value::from_float(2.0), Value::from_int(2), Value::from_big_int(1e20),
                           Value::from_bool(true)};
  // expected[d][k]: 0 accepted, 1 TypeError, 2 OverflowError
  const int expected[4][4] = {
      {0, 0, 0, 1},  // Float32
      {1, 0, 2, 1},  // Int32
      {1, 1, 1, 0},  // Bool
      {0, 0, 0, 1},  // Float64
  };
  for (size_t d = 0; d < 4; ++d) {
    const DType& dt = *DType::registered()[d];
    for (size_t k = 0; k < 4; ++k) {
      SCOPED_TRACE(dt.name() + " <- " + std::string(samples[k].kind_name()) + " #" + std::to_string(k));
      switch (expected[d][k]) {
        case 0: EXPECT_NO_THROW(dt.convert(samples[k])); break;
        case 1: EXPECT_THROW(dt.convert(samples[k]), TypeError); break;
        case 2: EXPECT_THROW(dt.convert(samples[k]), OverflowError); break;
      }
    }
  }
}

}  // namespace
}  // namespace sw
