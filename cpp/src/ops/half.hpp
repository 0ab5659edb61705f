// Internal: 16-bit floating-point elements (BFloat16, Float16): conversions
// and the products whose operands are stored in them.
//
// Note [Half-precision conversions]: widening (bf16 or fp16 to Float32) is
// exact. Narrowing rounds to nearest, ties to even, in software on every
// machine (AVX-512F integer lanes where present, scalar otherwise), so a
// value narrows to the same bits on every machine: the AVX-512 BF16
// instruction VCVTNEPS2BF16 flushes subnormal inputs to zero, and F16C's
// VCVTPS2PH is exact RNE but absent on some machines; neither is used for
// narrowing. A NaN narrows to a quiet NaN of the same sign. As in IEEE
// rounding, a finite value at or past the largest finite value plus half an
// ulp narrows to infinity: about 3.39e38 for bf16 (Float32's exponent range,
// a shorter significand), 65520 for fp16.
//
// Note [Products of half-precision operands]: a product reads both operands
// with the inner index p contiguous (a row-major x times a row-major
// PyTorch weight W(out, in) read as W^T: both are "inner-contiguous", so the
// checkpoint's bytes are read where they lie, without a transposed copy) and
// accumulates in Float32. On a machine with AVX-512 BF16 a bf16 product uses
// VDPBF16PS (two bf16 products summed into a Float32 lane per instruction:
// each product of two bf16 values is exact in Float32; the instruction
// treats subnormal inputs and results as zero); elsewhere each operand is
// widened to Float32 in registers (exact) and multiplied with FMA. Either way
// the error is that of a Float32 sum of k exact products, |e| <= gamma_k
// sum |a||b| with gamma_k = k u / (1 - k u), u = 2^-24 (plus the subnormal
// flush on the BF16 path, below 2^-126 per product). With 16 rows or more, the bf16 path forms outer products
// instead of dot products (Note [Outer products for many rows] in half.cpp); the bound is the same.
#pragma once

#include <cstdint>

#include "strideweave/dtype.hpp"

namespace sw::detail {

float bf16_to_float(uint16_t bits) noexcept;
uint16_t float_to_bf16(float value) noexcept;
float f16_to_float(uint16_t bits) noexcept;
uint16_t float_to_f16(float value) noexcept;

void bf16_to_f32(const uint16_t* src, float* dst, int64_t n) noexcept;
void f32_to_bf16(const float* src, uint16_t* dst, int64_t n) noexcept;
void f16_to_f32(const uint16_t* src, float* dst, int64_t n) noexcept;
void f32_to_f16(const float* src, uint16_t* dst, int64_t n) noexcept;

enum class HalfKind : uint8_t { BFloat16, Float16 };

// C(i, j) = sum over p < k of A(i, p) * B(j, p) for i < m, j < n, where
// A(i, p) = A[i * lda + p] and B(j, p) = B[j * ldb + p] hold `kind` elements
// and C(i, j) = C[i * c_si + j * c_sj] is Float32; with `accumulate`,
// C += that sum. Large work is split over the compute pool by rows of B.
void half_gemm(HalfKind kind, int64_t m, int64_t n, int64_t k, const uint16_t* A, int64_t lda, const uint16_t* B,
               int64_t ldb, float* C, int64_t c_si, int64_t c_sj, bool accumulate);

// C[q + n * c] = sum over r < k, in order, of L[q + n * r] * W[r * ldw + c] for q < n, c < cols: a few Float32
// rows (column-major (n, k)) times a 16-bit matrix whose columns are contiguous, contracted over its rows (a
// PyTorch (out, in) weight applied from the output side), without widening W into memory (Note [Few rows times a
// row-major 16-bit matrix] in half.cpp). Each partial sum is one Float32 FMA; where L holds values of `kind`, each
// product is exact and the error is that of a Float32 sum of k terms, |e| <= gamma_k sum |L||W|. Returns false,
// writing nothing, with more than kRowsTimesHalfMax rows or without AVX-512F (the caller widens W and uses BLAS).
inline constexpr int64_t kRowsTimesHalfMax = 16;
bool rows_times_half(HalfKind kind, int64_t n, int64_t cols, int64_t k, const float* L, const uint16_t* W,
                     int64_t ldw, float* C);

// The kernel half_gemm uses for `kind` on this machine: "avx512-bf16", "avx512f" or "scalar".
const char* half_gemm_path(HalfKind kind);
// Forces the portable kernels (true) or restores run-time dispatch (false), so tests can compare every path on a
// machine that has the fast one. Returns the previous setting.
bool force_portable_half_kernels(bool on) noexcept;

}  // namespace sw::detail
