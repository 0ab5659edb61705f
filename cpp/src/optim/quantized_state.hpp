// optim/quantized_state.hpp — 8-bit block-wise optimizer state (StateDType::Int8Blockwise; Note [Compact optimizer
// state] in strideweave/optim.hpp): the packed tile format, block-wise quantization to a dynamic map and back.
//
// A state tile of n values is packed into quant_tile_slots(n) Float32 slots of its carrier, as raw bytes:
//   bytes [0, 4 * blocks)                : one Float32 absmax per block of 256 consecutive values (the last block of
//                                          the tile holds n - 256 * (blocks - 1) values), blocks = ceil(n / 256);
//   bytes [4 * blocks, 4 * blocks + n)   : one 8-bit code per value, in within-tile order;
//   the rest (0 to 3 bytes)               : zero padding.
// A tile of zeros (an implicit tile made resident, a fresh dense state) has absmax 0 everywhere: it reads as zeros.
#pragma once

#include <cstdint>
#include <memory>

#include "strideweave/tensor.hpp"

namespace sw {
class TiledEvictable;
}

namespace sw::optim::detail {

constexpr int64_t kQuantBlock = 256;
inline int64_t quant_blocks(int64_t n) noexcept { return (n + kQuantBlock - 1) / kQuantBlock; }
// Float32 slots of one packed tile of n values: ceil((n + 4 * blocks) / 4).
inline int64_t quant_tile_slots(int64_t n) noexcept { return quant_blocks(n) + (n + 3) / 4; }

// The 256 entries of the dynamic map, ascending (sw::optim::blockwise_quantization_map).
const float* quantization_map(bool is_signed) noexcept;

// Values [first, first + count) of a packed tile of n values (`first` a multiple of 256; count reaches a block
// boundary or n) decoded into out[0, count): map[code] * absmax (one Float32 rounding); a block whose absmax is 0
// reads as +0.
void dequantize_blocks(const void* packed, int64_t n, int64_t first, int64_t count, float* out,
                       bool is_signed) noexcept;
// in[0, count) stored as values [first, first + count) of the packed tile: per block absmax = max |x| (NaN when the
// block holds one), each value the code of the map entry nearest x / absmax (a tie between two entries goes to the
// larger one); a block whose absmax is 0 stores the code of the entry 0.
void quantize_blocks(const float* in, void* packed, int64_t n, int64_t first, int64_t count, bool is_signed) noexcept;

// The decoded values of the packed state `state` of parameter `param` (its TiledEvictable `tiled`, or null for a
// dense parameter): a fresh dense CPU Float32 tensor of param's layout, each value at its parameter slot. Tiles are
// read where they lie (pinned for reading, residency unchanged); an implicit tile reads as zeros.
TensorPtr decoded_state(const TensorPtr& param, const std::shared_ptr<TiledEvictable>& tiled, const TensorPtr& state,
                        bool is_signed);

// "avx512f" or "portable": the path quantize_blocks and dequantize_blocks take; tests force the portable one (same
// results).
const char* quantize_kernel_path() noexcept;
void force_portable_quantize(bool portable) noexcept;

}  // namespace sw::optim::detail
