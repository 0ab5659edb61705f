// strideweave/dtype.hpp — element types and value conversion.
//
// Four singletons compared by address: Float32, Int32, Bool (storage dtypes)
// and Float64 (accumulator only; no carrier stores it). Element values cross
// the Python boundary as float, int or bool; `Value` is their C++ form, and
// `DType::convert` applies the storage rules:
//   Float32  accepts float and int (not bool); rounds to binary32.
//   Int32    accepts int (not bool); out of range -> OverflowError.
//   Bool     accepts bool only.
//   Float64  accepts float and int (not bool).
// Any other kind raises TypeError. Everything here is immutable and thread-safe.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace sw {

enum class DTypeId : uint8_t { Float32 = 0, Int32 = 1, Bool = 2, Float64 = 3 };

// A scalar as it crosses the API boundary.
struct Value {
  enum class Kind : uint8_t { Float, Int, BigInt, Bool };
  Kind kind = Kind::Float;
  double f = 0.0;     // Float, and BigInt (an int outside int64, as a double)
  int64_t i = 0;      // Int
  bool b = false;     // Bool

  static Value from_float(double v) { return {Kind::Float, v, 0, false}; }
  static Value from_int(int64_t v) { return {Kind::Int, 0.0, v, false}; }
  static Value from_big_int(double approx) { return {Kind::BigInt, approx, 0, false}; }
  static Value from_bool(bool v) { return {Kind::Bool, 0.0, 0, v}; }
  std::string_view kind_name() const;
  bool operator==(const Value&) const = default;
};

class DType {
 public:
  static const DType& Float32();
  static const DType& Int32();
  static const DType& Bool();
  static const DType& Float64();
  static const DType& from_id(DTypeId id);
  // All four, in the order Float32, Int32, Bool, Float64.
  static const std::array<const DType*, 4>& registered();

  DTypeId id() const noexcept { return id_; }
  const std::string& name() const noexcept { return name_; }
  int bits() const noexcept { return bits_; }
  size_t itemsize() const noexcept { return static_cast<size_t>(bits_ / 8); }
  bool is_storage() const noexcept { return id_ != DTypeId::Float64; }
  bool is_floating() const noexcept { return id_ == DTypeId::Float32 || id_ == DTypeId::Float64; }

  // The value as this dtype stores it (TypeError / OverflowError per the rules above).
  Value convert(const Value& v) const;
  // `convert` over a buffer (friendly.tensor's arrays): n values of the arithmetic type T, each converted by the
  // rules above (the first one refused raises convert's error), written to `out` as this storage dtype's elements
  // (ElementOf below). Instantiated for the fixed-width integer types, float and double.
  template <class T>
  void convert_into(const T* in, size_t n, void* out) const;

  DType(const DType&) = delete;
  DType& operator=(const DType&) = delete;

 private:
  DType(DTypeId id, std::string name, int bits) : id_(id), name_(std::move(name)), bits_(bits) {}
  DTypeId id_;
  std::string name_;
  int bits_;
};

inline bool operator==(const DType& a, const DType& b) { return &a == &b; }

// C++ element type per storage dtype.
template <DTypeId>
struct ElementOf;
template <> struct ElementOf<DTypeId::Float32> { using type = float; };
template <> struct ElementOf<DTypeId::Int32> { using type = int32_t; };
template <> struct ElementOf<DTypeId::Bool> { using type = bool; };
template <> struct ElementOf<DTypeId::Float64> { using type = double; };

// Calls f(T{}) with the element type of `id`.
template <class F>
decltype(auto) visit_dtype(DTypeId id, F&& f) {
  switch (id) {
    case DTypeId::Float32: return f(float{});
    case DTypeId::Int32: return f(int32_t{});
    case DTypeId::Bool: return f(bool{});
    case DTypeId::Float64: break;
  }
  return f(double{});
}

}  // namespace sw
