#include "strideweave/dtype.hpp"

#include <cmath>
#include <limits>
#include <type_traits>

#include "strideweave/errors.hpp"

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

const DType& DType::from_id(DTypeId id) {
  switch (id) {
    case DTypeId::Float32: return Float32();
    case DTypeId::Int32: return Int32();
    case DTypeId::Bool: return Bool();
    case DTypeId::Float64: return Float64();
  }
  SW_ASSERT(false, "unknown dtype id ", static_cast<int>(id));
  return Float32();
}

const std::array<const DType*, 4>& DType::registered() {
  static const std::array<const DType*, 4> all{&Float32(), &Int32(), &Bool(), &Float64()};
  return all;
}

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
    case DTypeId::Int32: {
      auto* o = static_cast<int32_t*>(out);
      for (size_t k = 0; k < n; ++k) {
        const Value v = value_of(in[k]);
        if (v.kind != Value::Kind::Int || !in_int32_range(v.i)) convert(v);  // raises convert's error
        o[k] = static_cast<int32_t>(v.i);
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
