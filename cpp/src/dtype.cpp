#include "strideweave/dtype.hpp"

#include <cmath>
#include <limits>

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

Value DType::convert(const Value& v) const {
  using K = Value::Kind;
  switch (id_) {
    case DTypeId::Float32:
    case DTypeId::Float64: {
      double x;
      if (v.kind == K::Float || v.kind == K::BigInt) x = v.f;
      else if (v.kind == K::Int) x = static_cast<double>(v.i);
      else raise<TypeError>(name_, " element must be a float or an int, got ", v.kind_name());
      if (id_ == DTypeId::Float32) x = static_cast<double>(static_cast<float>(x));
      return Value::from_float(x);
    }
    case DTypeId::Int32: {
      if (v.kind == K::BigInt)
        raise<OverflowError>("Int32 element ", v.f, " is out of range [-2147483648, 2147483647]");
      if (v.kind != K::Int) raise<TypeError>("Int32 element must be an int, got ", v.kind_name());
      if (v.i < std::numeric_limits<int32_t>::min() || v.i > std::numeric_limits<int32_t>::max())
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

}  // namespace sw
