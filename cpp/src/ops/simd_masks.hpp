// Internal: AVX-512 lane masks for the tail of a vector loop (the skinny Float32 kernels, the 16-bit kernels).
#pragma once

#include <immintrin.h>

#include <cstdint>

namespace sw::detail {

// The first r of 16 (32) lanes; r <= 0 gives none, r >= 16 (32) all.
inline __mmask16 lanes16(int64_t r) {
  return r >= 16 ? __mmask16(0xFFFF) : r <= 0 ? __mmask16(0) : __mmask16((1u << r) - 1u);
}
inline __mmask32 lanes32(int64_t r) {
  return r >= 32 ? __mmask32(0xFFFFFFFFu) : r <= 0 ? __mmask32(0) : __mmask32((1u << r) - 1u);
}

}  // namespace sw::detail
