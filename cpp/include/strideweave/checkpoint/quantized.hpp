// strideweave/checkpoint/quantized.hpp — the element formats of quantized
// checkpoints, and the kernels that turn their bytes into BFloat16 or Float32
// values (on promotion) and back (re-quantizing on save).
//
// Note [Quantized element formats] (the OCP 8-bit floating point and
// microscaling specifications; DeepSeek-V3's and GPT-OSS's checkpoints):
//  * FP8 e4m3fn: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
//    infinities; 0x7F and 0xFF are NaN; the largest finite magnitude is 448;
//    exponent field 0 encodes subnormals m * 2^-9.
//  * FP4 e2m1: 1 sign, 2 exponent (bias 1), 1 mantissa: the 16 values
//    +-{0, 0.5, 1, 1.5, 2, 3, 4, 6}; nibble 8 is -0.
//  * e8m0 (a scale): 8 exponent bits, no sign or mantissa: 2^(b - 127), so
//    b = 0 is 2^-127 (a Float32 subnormal); b = 255 is NaN.
// FP8 block-scaled (DeepSeek-V3/R1, Kimi K2, GLM-4.5 FP8, Qwen3 FP8): a matrix
// (R, C) of e4m3 bytes, row-major, and a scale matrix (ceil(R / br),
// ceil(C / bc)) (Float32, BFloat16 or e8m0; the checkpoint's
// "weight_scale_inv"): value (i, j) = fp8(i, j) * scale(i / br, j / bc), the
// product rounded to Float32, then (BFloat16 output) rounded to nearest even,
// as transformers' dequantizer computes it (Float32 product, then a cast).
// MXFP4 (GPT-OSS): groups of 32 values along the last axis; a group is 16
// bytes (value 2j the low nibble of byte j, 2j + 1 the high nibble) and one
// e8m0 scale byte: value = fp4 * 2^(scale - 127) (exact in Float32 and
// BFloat16 for every finite scale).
//
// BFloat16 results are rounded to nearest even; a NaN becomes 0x7FC0 (the
// canonical quiet NaN, as c10::BFloat16 converts one).
//
// Thread-safety: pure functions of their arguments; any thread. The kernels
// dispatch at run time: AVX-512 (F, BW, VL) where the CPU has it, a portable
// path elsewhere (SW_NO_AVX512=1 in the environment forces the portable path);
// both give the same bits.
#pragma once

#include <cstdint>

namespace sw::quant {

enum class Out : uint8_t { Float32, BFloat16 };

// The exact Float32 value of one element or scale (Note [Quantized element formats]).
float e4m3_to_float(uint8_t byte) noexcept;
float e2m1_to_float(uint8_t nibble) noexcept;  // the low 4 bits
float e8m0_to_float(uint8_t byte) noexcept;
// Float32 -> BFloat16 bits, round to nearest even; NaN -> 0x7FC0.
uint16_t float_to_bf16(float value) noexcept;

// How block scales are stored: Float32, BFloat16, or e8m0 exponents (F8_E8M0, or U8 holding them).
enum class Scales : uint8_t { F32, BF16, E8M0 };
// `count` stored scales at `raw` as their exact Float32 values (the FP8 kernel's form).
void scales_to_float(const void* raw, Scales type, int64_t count, float* out) noexcept;

// FP8 block-scaled: `rows` consecutive rows (each `cols` bytes, row-major) of a matrix whose first row here is row
// `row0` of the whole matrix, into `out` (rows x cols values of `out_type`, row-major). `scales` points at the
// scale row of block row row0 / block_rows (Float32, `scale_cols` = ceil(cols / block_cols) per row, row-major):
// row i uses scale row (row0 + i) / block_rows - row0 / block_rows. block_rows, block_cols >= 1.
void dequantize_fp8(const uint8_t* q, int64_t rows, int64_t cols, int64_t row0, const float* scales,
                    int64_t scale_cols, int64_t block_rows, int64_t block_cols, void* out, Out out_type) noexcept;

// MXFP4: `groups` consecutive groups (16 bytes of `blocks` and one byte of `scales` each) into 32 * groups values
// of `out_type` at `out`.
void dequantize_mxfp4(const uint8_t* blocks, const uint8_t* scales, int64_t groups, void* out, Out out_type) noexcept;

// Re-quantizing (save_pretrained(quantize=True)).
//
// FP8 block-scaled, as DeepSeek-V3's reference quantizer defines it: per block, amax = max |x| over its finite
// values; scale = amax / 448 (Float32; 1 where amax is 0); q = e4m3(x / scale), the quotient rounded to nearest
// even in e4m3 and saturated to +-448 (a NaN input gives 0x7F). `in` holds rows x cols values (Float32 when
// `in_bf16` is false, BFloat16 bits otherwise), row-major, a whole matrix (row 0 is block row 0); `q` receives
// rows x cols bytes, `scales` ceil(rows / block_rows) x ceil(cols / block_cols) Float32 values.
void quantize_fp8(const void* in, bool in_bf16, int64_t rows, int64_t cols, int64_t block_rows, int64_t block_cols,
                  uint8_t* q, float* scales) noexcept;
// The e4m3 byte nearest `value` (round to nearest even, saturating at +-448; NaN -> 0x7F).
uint8_t float_to_e4m3(float value) noexcept;

// MXFP4, as the OCP microscaling specification defines it: per group of 32, amax = max |x| over its finite values;
// the shared exponent e = floor(log2(amax)) - 2 (2: the largest e2m1 exponent), clamped to [-127, 127] (amax 0:
// e = -127); scale byte e + 127; each value x / 2^e rounded to the nearest e2m1 value (ties to even mantissa),
// saturated to +-6. `in`: 32 * groups values (Float32, or BFloat16 bits when `in_bf16`); `blocks` receives
// 16 * groups bytes, `scales` `groups` bytes. Returns false when an input is NaN (e2m1 has no NaN; the caller
// refuses: the outputs are then unspecified).
bool quantize_mxfp4(const void* in, bool in_bf16, int64_t groups, uint8_t* blocks, uint8_t* scales) noexcept;

// Whether the AVX-512 kernels run here (tests and benchmarks report it).
bool uses_avx512() noexcept;

// Tests: makes this process take the portable path (true) or the one the CPU and SW_NO_AVX512 select (false), so
// one process can compare both.
void force_portable(bool portable) noexcept;
// Tests: where the CPU has AVX-512 VBMI (byte permutes), its FP8 kernel is used for BFloat16 output; true makes the
// process take the AVX-512 F/BW kernels instead (as a CPU without VBMI would), false undoes it.
void force_avx512_without_vbmi(bool without) noexcept;
bool uses_avx512_vbmi() noexcept;

}  // namespace sw::quant
