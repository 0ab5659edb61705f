#include "strideweave/dtype.hpp"

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>

#include "strideweave/errors.hpp"
#include "ops/half.hpp"

namespace sw {

std::string_view Value::kind_name() const {
  switch (kind) {
    case Kind::Float: return "float";
    case Kind::Int:
    case Kind::BigInt: return "int";
    case Kind::Bool: return "bool";
  }
  return "?";
}

const DType& DType::Float32() {
  static const DType d(DTypeId::Float32, "Float32", 32);
  return d;
}
const DType& DType::Int32() {
  static const DType d(DTypeId::Int32, "Int32", 32);
  return d;
}
const DType& DType::Bool() {
  static const DType d(DTypeId::Bool, "Bool", 8);
  return d;
}
const DType& DType::Float64() {
  static const DType d(DTypeId::Float64, "Float64", 64);
  return d;
}

const DType& DType::BFloat16() {
  static const DType d(DTypeId::BFloat16, "BFloat16", 16);
  return d;
}
const DType& DType::Float16() {
  static const DType d(DTypeId::Float16, "Float16", 16);
  return d;
}

const DType& DType::from_id(DTypeId id) {
  switch (id) {
    case DTypeId::Float32: return Float32();
    case DTypeId::Int32: return Int32();
    case DTypeId::Bool: return Bool();
    case DTypeId::Float64: return Float64();
    case DTypeId::BFloat16: return BFloat16();
    case DTypeId::Float16: return Float16();
  }
  SW_ASSERT(false, "unknown dtype id ", static_cast<int>(id));
  return Float32();
}

const std::array<const DType*, 6>& DType::registered() {
  static const std::array<const DType*, 6> all{&Float32(), &Int32(), &Bool(), &Float64(), &BFloat16(), &Float16()};
  return all;
}

namespace detail {

// Note [16-bit floats]: a double rounds to a 16-bit float directly. The double is first rounded to binary32 *to
// odd* (truncate, then set the last bit when anything was dropped): binary32 keeps 24 significant bits, at least
// two more than either 16-bit format (8, 11) even among their subnormals (bf16's lowest bit is 2^-133, binary32's
// 2^-149; fp16's 2^-24 is a binary32 normal), and a round-to-odd intermediate with two extra bits makes the second,
// nearest-even rounding exact (the sticky bit records the dropped part). Beyond binary32's range the result is
// infinite in both formats (both overflow far below FLT_MAX).
namespace {
float round_to_odd_float(double x) noexcept {
  if (!(std::fabs(x) <= static_cast<double>(std::numeric_limits<float>::max())))
    return std::isnan(x) ? static_cast<float>(x) : std::copysign(std::numeric_limits<float>::infinity(), static_cast<float>(x));
  float f = static_cast<float>(x);  // nearest even
  const double back = static_cast<double>(f);
  if (back == x) return f;
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if (u & 1u) return f;  // already odd
  // Even and inexact: step one ulp towards x (the neighbour on x's side is odd, and x lies between the two).
  if (std::fabs(back) > std::fabs(x)) --u;
  else ++u;
  std::memcpy(&f, &u, 4);
  return f;
}
}  // namespace

uint16_t double_to_bf16_bits(double value) noexcept { return float_to_bf16_bits(round_to_odd_float(value)); }
uint16_t double_to_f16_bits(double value) noexcept { return float_to_f16_bits(round_to_odd_float(value)); }

}  // namespace detail

namespace {

// The two rules convert applies to a value it accepts; convert_into applies them in bulk.
double round_to_float32(double x) { return static_cast<double>(static_cast<float>(x)); }
bool in_int32_range(int64_t v) {
  return v >= std::numeric_limits<int32_t>::min() && v <= std::numeric_limits<int32_t>::max();
}

// An element of an array as the Value it stands for (an unsigned 64-bit one beyond int64 is a BigInt).
template <class T>
Value value_of(T x) {
  if constexpr (std::is_floating_point_v<T>) {
    return Value::from_float(static_cast<double>(x));
  } else if constexpr (std::is_unsigned_v<T> && sizeof(T) == sizeof(int64_t)) {
    if (x > static_cast<T>(std::numeric_limits<int64_t>::max())) return Value::from_big_int(static_cast<double>(x));
    return Value::from_int(static_cast<int64_t>(x));
  } else {
    return Value::from_int(static_cast<int64_t>(x));
  }
}

// The Int32 range check of an integer of any width.
template <class T>
bool fits_int32(T x) {
  if constexpr (std::is_unsigned_v<T>)
    return x <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()) && in_int32_range(static_cast<int64_t>(x));
  else
    return in_int32_range(static_cast<int64_t>(x));
}

// fits_int32 without a branch, for a loop that vectorises: zero exactly when x is in Int32's range (x + 2**31, as
// an unsigned 64-bit value, is below 2**32). dtype_convert_into_test checks both around the bounds.
template <class T>
uint64_t int32_excess(T x) {
  if constexpr (std::is_unsigned_v<T>)
    return static_cast<uint64_t>(x) >> 31;
  else
    return (static_cast<uint64_t>(static_cast<int64_t>(x)) + (uint64_t{1} << 31)) >> 32;
}

}  // namespace

Value DType::convert(const Value& v) const {
  using K = Value::Kind;
  switch (id_) {
    case DTypeId::Float32:
    case DTypeId::Float64: {
      double x;
      if (v.kind == K::Float || v.kind == K::BigInt) x = v.f;
      else if (v.kind == K::Int) x = static_cast<double>(v.i);
      else raise<TypeError>(name_, " element must be a float or an int, got ", v.kind_name());
      if (id_ == DTypeId::Float32) x = round_to_float32(x);
      return Value::from_float(x);
    }
    case DTypeId::BFloat16:
    case DTypeId::Float16: {
      double x;
      if (v.kind == K::Float || v.kind == K::BigInt) x = v.f;
      else if (v.kind == K::Int) x = static_cast<double>(v.i);  // exact below 2^53; else the nearest double first
      else raise<TypeError>(name_, " element must be a float or an int, got ", v.kind_name());
      return Value::from_float(id_ == DTypeId::BFloat16 ? static_cast<double>(bfloat16::from_bits(detail::double_to_bf16_bits(x)))
                                                        : static_cast<double>(float16::from_bits(detail::double_to_f16_bits(x))));
    }
    case DTypeId::Int32: {
      if (v.kind == K::BigInt)
        raise<OverflowError>("Int32 element ", v.f, " is out of range [-2147483648, 2147483647]");
      if (v.kind != K::Int) raise<TypeError>("Int32 element must be an int, got ", v.kind_name());
      if (!in_int32_range(v.i))
        raise<OverflowError>("Int32 element ", v.i, " is out of range [-2147483648, 2147483647]");
      return v;
    }
    case DTypeId::Bool:
      if (v.kind != K::Bool) raise<TypeError>("Bool element must be a bool, got ", v.kind_name());
      return v;
  }
  SW_ASSERT(false, "unknown dtype");
  return v;
}

template <class T>
void DType::convert_into(const T* in, size_t n, void* out) const {
  switch (id_) {
    case DTypeId::Float32:
    case DTypeId::Float64: {
      // convert's float path: every T is a Float, an Int or a BigInt, each read as a double first.
      if (id_ == DTypeId::Float32) {
        auto* o = static_cast<float*>(out);
        for (size_t k = 0; k < n; ++k) o[k] = static_cast<float>(round_to_float32(static_cast<double>(in[k])));
      } else {
        auto* o = static_cast<double*>(out);
        for (size_t k = 0; k < n; ++k) o[k] = static_cast<double>(in[k]);
      }
      return;
    }
    case DTypeId::BFloat16: {
      auto* o = static_cast<uint16_t*>(out);
      if constexpr (std::is_same_v<T, float>) {
        detail::f32_to_bf16(in, o, static_cast<int64_t>(n));  // a float needs one rounding only (vectorised)
      } else {
        for (size_t k = 0; k < n; ++k) o[k] = detail::double_to_bf16_bits(static_cast<double>(in[k]));
      }
      return;
    }
    case DTypeId::Float16: {
      auto* o = static_cast<uint16_t*>(out);
      if constexpr (std::is_same_v<T, float>) {
        detail::f32_to_f16(in, o, static_cast<int64_t>(n));  // a float needs one rounding only (vectorised)
      } else {
        for (size_t k = 0; k < n; ++k) o[k] = detail::double_to_f16_bits(static_cast<double>(in[k]));
      }
      return;
    }
    case DTypeId::Int32: {
      if constexpr (std::is_floating_point_v<T>) {
        if (n) convert(value_of(in[0]));  // raises convert's TypeError: a float is not an int
      } else {
        auto* o = static_cast<int32_t*>(out);
        // One pass that vectorises (no branch: int32_excess is in_int32_range as bits), then the refusal if any.
        uint64_t excess = 0;
        for (size_t k = 0; k < n; ++k) {
          excess |= int32_excess(in[k]);
          o[k] = static_cast<int32_t>(in[k]);
        }
        if (excess)
          for (size_t k = 0; k < n; ++k)
            if (!fits_int32(in[k])) convert(value_of(in[k]));  // raises convert's OverflowError
      }
      return;
    }
    case DTypeId::Bool:
      if (n) convert(value_of(in[0]));  // no T is a bool: raises convert's TypeError
      return;
  }
  SW_ASSERT(false, "unknown dtype");
}

#define SW_CONVERT_INTO(T) template void DType::convert_into<T>(const T*, size_t, void*) const;
SW_CONVERT_INTO(int8_t)
SW_CONVERT_INTO(int16_t)
SW_CONVERT_INTO(int32_t)
SW_CONVERT_INTO(int64_t)
SW_CONVERT_INTO(uint8_t)
SW_CONVERT_INTO(uint16_t)
SW_CONVERT_INTO(uint32_t)
SW_CONVERT_INTO(uint64_t)
SW_CONVERT_INTO(float)
SW_CONVERT_INTO(double)
#undef SW_CONVERT_INTO

}  // namespace sw
