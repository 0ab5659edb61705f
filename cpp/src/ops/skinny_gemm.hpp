// Internal: direct Float32 kernels for skinny matrix products.
//
// Note [Skinny products]: a Mixture-of-Experts step multiplies a few dozen
// token rows by a 1024 x 1024 expert (forward and input gradient), and forms
// the expert's weight gradient as a product over those few rows. A general
// BLAS packs the large operand into its own buffer before each call (an extra
// pass over 4 MiB), zeroes the output before accumulating into it, and splits
// such shapes poorly over threads; these shapes are bound by streaming the
// large operand (or writing the large output) once. The kernels here read the
// large operand in its own layout exactly once, pack only the small operand
// (a few hundred KiB at most) and write each output element once. They cover:
//
//   small m : n, k >= kWide and the large operand B either contiguous along j
//             (m <= kRowsAlongJ; B's rows streamed in order, vectorised
//             along j) or along p (m <= kRowsAlongP; dot products vectorised
//             along p);
//   small k : k <= kInner, m, n >= kWide (an outer-product-like update,
//             vectorised along i of the column-major output).
//
// The limits are where these kernels stop beating OpenBLAS on this kind of
// machine (measured side by side in one process: 0.5x its time at 4 rows,
// 0.8x at 16, even at about 24 rows along j, 36 along p and an inner
// dimension of 36; slower beyond). Everything else goes to BLAS. The kernels need AVX-512F (checked once at run
// time); without it skinny_sgemm returns false.
#pragma once

#include <cstdint>

namespace sw::detail {

inline constexpr int64_t kRowsAlongJ = 20;
inline constexpr int64_t kRowsAlongP = 32;
inline constexpr int64_t kInner = 32;
inline constexpr int64_t kWide = 256;

// C (m x n, column-major, ld m) = sum over p of A(i, p) * B(j, p), where
// A(i, p) = A[i * a_si + p * a_sp] and B(j, p) = B[j * b_sj + p * b_sp]; with
// `accumulate`, C += that sum instead. Returns false, leaving C untouched,
// when no kernel here covers the case.
bool skinny_sgemm(int64_t m, int64_t n, int64_t k, const float* A, int64_t a_si, int64_t a_sp, const float* B,
                  int64_t b_sj, int64_t b_sp, float* C, bool accumulate = false);

// The kernel skinny_sgemm would use: "small-m/j", "small-m/p", "small-k", or "" for none (tests, benchmarks).
const char* skinny_sgemm_path(int64_t m, int64_t n, int64_t k, int64_t b_sj, int64_t b_sp);

}  // namespace sw::detail
