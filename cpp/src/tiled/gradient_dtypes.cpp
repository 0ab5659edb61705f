// Tiled gradients of 16-bit parameters (Note [Tiled gradients of 16-bit parameters]): the dtype a fresh tiled
// gradient takes, tile values widened to and narrowed from Float32, and a tiled gradient converted tile by tile.
#include <cstring>

#include "strideweave/errors.hpp"
#include "internal.hpp"
#include "../ops/half.hpp"

namespace sw {

// Note [Tiled gradients of 16-bit parameters]: a dense 16-bit leaf keeps its
// gradient in its own dtype, rounded once per accumulation (Note [Gradients of
// 16-bit parameters] in cpp/src/autograd.cpp). A tiled one does the same, tile
// by tile, and never through a dense full-size temporary:
//  * the VJPs compute in Float32, so the cotangent of a projection of a 16-bit
//    TiledEvictable is Float32; its fresh tiled gradient (scatter_add_gradient)
//    keeps Float32 tiles (tiled_gradient_dtype), the untouched ones implicit;
//  * two such gradients meeting inside one backward (two projections of one
//    leaf) add in Float32 (add_tiled_gradients): every contribution of one
//    backward is summed in Float32, however many projections there are;
//  * at the leaf, the Float32 sum is added to the held 16-bit .grad in Float32
//    and rounded once per tile slot (accumulate_tiles in place, or a fresh sum
//    converted tile by tile: convert_tiled_gradient); a first gradient is
//    rounded once.
// So after backward calls contributing g_1..g_k (each g_j the exact Float32
// sum of that call's VJP products, themselves within the Float32 bounds of the
// kernels), the held gradient G_k satisfies, slot by slot,
//   |G_k - sum g_j| <= sum_{j<=k} u16 |G_{j-1} + g_j| + sum_{j<=k} u |G_{j-1} + g_j|,
// u16 = 2^-8 for BFloat16, 2^-11 for Float16, u = 2^-24: one 16-bit rounding
// (and one Float32 rounding) of each partial sum, as for a dense leaf; a sum of
// many tokens or many projections inside one call never rounds to 16 bits.

const DType& tiled_gradient_dtype(const DType& param, const DType& cotangent) {
  if (param.is_half() && cotangent.id() == DTypeId::Float32) return DType::Float32();
  return param;
}

void load_floats(const Carrier& buf, int64_t n, float* out) {
  const DType& d = buf.dtype();
  if (d.id() == DTypeId::Float32) {
    if (const std::byte* p = buf.native_data()) std::memcpy(out, p, static_cast<size_t>(n) * sizeof(float));
    else buf.read_slots(0, n, out);
    return;
  }
  SW_ASSERT(d.is_half(), "load_floats of a ", d.name(), " tile");
  std::vector<uint16_t> raw;
  const auto* bits = reinterpret_cast<const uint16_t*>(buf.native_data());
  if (!bits) {
    raw.resize(static_cast<size_t>(n));
    buf.read_slots(0, n, raw.data());
    bits = raw.data();
  }
  if (d.id() == DTypeId::BFloat16) detail::bf16_to_f32(bits, out, n);
  else detail::f16_to_f32(bits, out, n);
}

void store_floats(Carrier& buf, int64_t n, const float* in) {
  const DType& d = buf.dtype();
  if (d.id() == DTypeId::Float32) {
    if (std::byte* p = buf.mutable_native_data()) std::memcpy(p, in, static_cast<size_t>(n) * sizeof(float));
    else buf.write_slots(0, n, in);
    return;
  }
  SW_ASSERT(d.is_half(), "store_floats into a ", d.name(), " tile");
  std::vector<uint16_t> raw;
  auto* bits = reinterpret_cast<uint16_t*>(buf.mutable_native_data());
  uint16_t* dst = bits;
  if (!dst) {
    raw.resize(static_cast<size_t>(n));
    dst = raw.data();
  }
  if (d.id() == DTypeId::BFloat16) detail::f32_to_bf16(in, dst, n);
  else detail::f32_to_f16(in, dst, n);
  if (!bits) buf.write_slots(0, n, raw.data());
}

TensorPtr convert_tiled_gradient(const TensorPtr& g, const DType& dtype) {
  auto src = std::static_pointer_cast<TiledEvictable>(g->carrier);
  if (src->dtype() == dtype) return g;
  const WorkToken pin = TiledInternals::pin_for_reading(src);
  auto fresh = std::static_pointer_cast<TiledEvictable>(src->allocate_like(src->size(), true, dtype, false));
  const int64_t n = src->tile_size();
  std::vector<float> values(static_cast<size_t>(n));
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  for (int64_t i = 0; i < src->tile_count(); ++i) {
    CarrierPtr v = TiledInternals::tile_value(*src, i);
    if (!v) continue;  // an implicit zero stays implicit
    load_floats(*v, n, values.data());
    CarrierPtr out = fresh->primary()->allocate_like(n, true, dtype, /*empty=*/true);
    store_floats(*out, n, values.data());  // rounded once (nearest even)
    tiles.emplace_back(i, std::move(out));
  }
  if (!tiles.empty()) TiledInternals::install_tiles(*fresh, tiles);
  return make_tensor(fresh, g->offset, g->layout);
}

}  // namespace sw
