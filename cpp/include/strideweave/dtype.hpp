// strideweave/dtype.hpp — element types and value conversion.
//
// Six singletons compared by address: Float32, Int32, Bool, BFloat16, Float16
// (storage dtypes) and Float64 (accumulator only; no carrier stores it).
// Element values cross the Python boundary as float, int or bool; `Value` is
// their C++ form, and `DType::convert` applies the storage rules:
//   Float32  accepts float and int (not bool); rounds to binary32.
//   BFloat16, Float16  accept float and int (not bool); round the value (as a
//            double, directly: never through binary32) to nearest, ties to
//            even; past the largest finite value (plus half an ulp) -> inf, as
//            IEEE rounds (no OverflowError, as for Float32). Note [16-bit
//            floats].
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
#include <type_traits>

namespace sw {

enum class DTypeId : uint8_t { Float32 = 0, Int32 = 1, Bool = 2, Float64 = 3, BFloat16 = 4, Float16 = 5 };

// Note [16-bit floats]: BFloat16 (1 sign, 8 exponent, 7 fraction bits: Float32's
// range, 8 significant bits) and Float16 (IEEE binary16: 5 exponent, 10
// fraction bits, largest finite 65504) are storage dtypes of itemsize 2. Their
// C++ element types below hold the bits; reading one as a float is exact, and
// making one from a float rounds to nearest, ties to even (the conversions of
// cpp/src/ops/half.hpp, identical on every machine); a double converts to a
// float first (a kernel's Float32 result), while DType::convert and slot
// writes round a double directly (double_to_*_bits: rounding through binary32
// first could differ, e.g. 1 + 2^-8 + 2^-30 is bf16 1 + 2^-7, not 1). Arithmetic widens to
// Float32, computes there and rounds once to the 16-bit result
// (docs/guide.md, "DTypes").
namespace detail {
float bf16_bits_to_float(uint16_t bits) noexcept;
uint16_t float_to_bf16_bits(float value) noexcept;
float f16_bits_to_float(uint16_t bits) noexcept;
uint16_t float_to_f16_bits(float value) noexcept;
// Exact round-to-nearest-even of a double (no intermediate binary32 rounding).
uint16_t double_to_bf16_bits(double value) noexcept;
uint16_t double_to_f16_bits(double value) noexcept;
}  // namespace detail

struct bfloat16 {
  uint16_t bits = 0;
  bfloat16() = default;
  explicit bfloat16(float v) noexcept : bits(detail::float_to_bf16_bits(v)) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  explicit bfloat16(I v) noexcept : bfloat16(static_cast<float>(v)) {}
  static bfloat16 from_bits(uint16_t b) noexcept {
    bfloat16 r;
    r.bits = b;
    return r;
  }
  operator float() const noexcept { return detail::bf16_bits_to_float(bits); }
};

struct float16 {
  uint16_t bits = 0;
  float16() = default;
  explicit float16(float v) noexcept : bits(detail::float_to_f16_bits(v)) {}
  template <class I, std::enable_if_t<std::is_integral_v<I>, int> = 0>
  explicit float16(I v) noexcept : float16(static_cast<float>(v)) {}
  static float16 from_bits(uint16_t b) noexcept {
    float16 r;
    r.bits = b;
    return r;
  }
  operator float() const noexcept { return detail::f16_bits_to_float(bits); }
};
static_assert(sizeof(bfloat16) == 2 && sizeof(float16) == 2);

inline float detail::bf16_bits_to_float(uint16_t bits) noexcept {
  const uint32_t u = uint32_t{bits} << 16;
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline float detail::f16_bits_to_float(uint16_t h) noexcept {  // exact (inline: kernels widen per element)
  const uint32_t sign = uint32_t{h & 0x8000u} << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu, man = h & 0x3FFu;
  uint32_t u;
  if (exp == 0x1F) u = sign | 0x7F800000u | (man << 13);  // inf, NaN (payload kept)
  else if (exp != 0) u = sign | ((exp + 112) << 23) | (man << 13);
  else {  // zero or subnormal: man * 2^-24, exact in Float32
    const float mag = static_cast<float>(man) * 0x1p-24f;
    return sign ? -mag : mag;
  }
  float f;
  __builtin_memcpy(&f, &u, 4);
  return f;
}
inline uint16_t detail::float_to_bf16_bits(float value) noexcept {
  uint32_t u;
  __builtin_memcpy(&u, &value, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x0040u);  // quiet NaN, same sign
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}


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
  static const DType& BFloat16();
  static const DType& Float16();
  static const DType& from_id(DTypeId id);
  // All six, in the order Float32, Int32, Bool, Float64, BFloat16, Float16.
  static const std::array<const DType*, 6>& registered();

  DTypeId id() const noexcept { return id_; }
  const std::string& name() const noexcept { return name_; }
  int bits() const noexcept { return bits_; }
  size_t itemsize() const noexcept { return static_cast<size_t>(bits_ / 8); }
  bool is_storage() const noexcept { return id_ != DTypeId::Float64; }
  bool is_floating() const noexcept { return id_ != DTypeId::Int32 && id_ != DTypeId::Bool; }
  // BFloat16 or Float16: stored in 16 bits, computed in Float32 (Note [16-bit floats]).
  bool is_half() const noexcept { return id_ == DTypeId::BFloat16 || id_ == DTypeId::Float16; }

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
template <> struct ElementOf<DTypeId::BFloat16> { using type = bfloat16; };
template <> struct ElementOf<DTypeId::Float16> { using type = float16; };

// Calls f(T{}) with the element type of `id`.
template <class F>
decltype(auto) visit_dtype(DTypeId id, F&& f) {
  switch (id) {
    case DTypeId::Float32: return f(float{});
    case DTypeId::Int32: return f(int32_t{});
    case DTypeId::Bool: return f(bool{});
    case DTypeId::BFloat16: return f(bfloat16{});
    case DTypeId::Float16: return f(float16{});
    case DTypeId::Float64: break;
  }
  return f(double{});
}

}  // namespace sw
