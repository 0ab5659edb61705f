// Tile copies of the data paths: one tile between its buffer and its region of a dense tensor (gather for a
// projection, scatter for a scatter or a gradient), and a projection's gradient scattered into a fresh carrier.
#include "tile_copies.hpp"

#include <algorithm>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"

namespace sw {

void gather_tile(const TiledEvictable& c, const TileAccess& access, int64_t index, const CarrierPtr& buffer,
                 Carrier& dest, int64_t base, std::span<const int64_t> dstride, std::span<const Run> region) {
  if (access.canonical && buffer) {
    for (const Run& r : region) copy_slots(*buffer, r.ordinal, dest, base + r.offset, r.length);
    return;
  }
  const TileGeometry& g = c.geometry();
  const int64_t n = g.tile_size();
  std::vector<std::byte> zero(slot_bytes(c.dtype()), std::byte{0});
  for (int64_t wo = 0; wo < n; ++wo) {
    const int64_t off = base + g.region_offset(wo, dstride);
    if (buffer) copy_slots(*buffer, access.physical_within(index, wo), dest, off, 1);
    else dest.write_slots(off, 1, zero.data());
  }
}

CarrierPtr scatter_tile(const TiledEvictable& c, const TileAccess& access, int64_t index, const TensorImpl& compact,
                        int64_t base, std::span<const int64_t> cstride, std::span<const Run> region,
                        const CarrierPtr& existing, bool add) {
  const TileGeometry& g = c.geometry();
  const int64_t n = g.tile_size();
  // Fast path: canonical tile order and a dense compact tensor: one bulk copy
  // per contiguous run of the compact region, then (add) one vectorisable pass.
  const bool float_add_native = c.dtype().id() == DTypeId::Float32 &&
                                (!existing || existing->native_data() != nullptr);
  if (access.canonical && compact.layout.is_column_major() && (!add || float_add_native)) {
    CarrierPtr buf = c.primary()->allocate_like(n, true, c.dtype(), /*empty=*/true);
    for (const Run& r : region)
      copy_slots(*compact.carrier, compact.offset + base + r.offset, *buf, r.ordinal, r.length);
    if (add && existing) {
      float* d = reinterpret_cast<float*>(buf->mutable_native_data());
      const float* e = reinterpret_cast<const float*>(existing->native_data());
      if (d) {
        for (int64_t k = 0; k < n; ++k) d[k] = e[k] + d[k];
      } else {
        std::vector<float> v(static_cast<size_t>(n));
        buf->read_slots(0, n, v.data());
        for (int64_t k = 0; k < n; ++k) v[k] = e[k] + v[k];
        buf->write_slots(0, n, v.data());
      }
    }
    return buf;
  }
  CarrierPtr buf = c.primary()->allocate_like(n, true, c.dtype(), /*empty=*/false);
  for (int64_t wo = 0; wo < n; ++wo) {
    const int64_t ord = base + g.region_offset(wo, cstride);
    const int64_t pw = access.physical_within(index, wo);
    Value v = compact.carrier->read_value(compact.offset + compact.layout.flat().index(ord));
    if (add) {
      Value e = existing ? existing->read_value(pw) : Value::from_float(0.0);
      if (c.dtype().id() == DTypeId::Int32) {
        int64_t sum = (existing ? e.i : 0) + v.i;
        v = c.dtype().convert(Value::from_int(sum));
      } else {
        v = Value::from_float(double(float(e.f + v.f)));
      }
    }
    buf->write_value(pw, v);
  }
  return buf;
}

std::vector<int64_t> counts_of(const TileSelection& sel) {
  std::vector<int64_t> n;
  for (const auto& a : sel.per_axis) n.push_back(static_cast<int64_t>(a.size()));
  return n;
}

bool all_zero_bytes(const Carrier& buf, int64_t slots, std::vector<std::byte>& scratch) {
  const size_t bytes = static_cast<size_t>(slots) * slot_bytes(buf.dtype());
  const std::byte* p = buf.native_data();
  if (!p) {
    scratch.resize(bytes);
    buf.read_slots(0, slots, scratch.data());
    p = scratch.data();
  }
  return std::all_of(p, p + bytes, [](std::byte b) { return b == std::byte{0}; });
}

namespace {

// Note [Adopting a compact gradient]: the cotangent of a one-tile projection is
// usually a fresh dense tensor that only the backward engine holds (a matmul's
// VJP result, say). When its storage is exactly what the tile's buffer would
// hold — the primary's kind and dtype, one tile's slots, canonical order on
// both sides — the buffer becomes the gradient tile as is: no allocation, no
// copy. In the MoE workload this saves two passes over every expert's
// gradient (4 MiB each) per projection. Anything shared (the caller's seed, a
// gradient also handed to another input, a retained .grad) is copied as before.
CarrierPtr adoptable_gradient(const TiledEvictable& fresh, const TileAccess& access, const TensorPtr& g) {
  if (!access.canonical || g.use_count() != 1 || g->offset != 0 || !g->layout.is_column_major()) return nullptr;
  const CarrierPtr& buf = g->carrier;
  if (buf.use_count() != 1 || &buf->kind() != &fresh.primary()->kind() || !(buf->dtype() == fresh.dtype()) ||
      buf->size() != fresh.tile_size() || !buf->is_mutable() || buf->is_released() || !buf->native_data())
    return nullptr;
  return buf;
}

}  // namespace

TensorPtr scatter_add_gradient(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& primal,
                               const TileSelection& sel, const TensorPtr& compact_grad) {
  auto fresh = std::static_pointer_cast<TiledEvictable>(c->allocate_like(c->size(), true, c->dtype(), false));
  TileAccess access(*fresh, *primal);
  const TileGeometry& g = c->geometry();
  std::vector<int64_t> src = g.select(sel.per_axis);
  std::vector<int64_t> counts = counts_of(sel);
  Layout cl = column_major(Shape::flat(g.compact_shape(sel.per_axis)));
  const std::vector<int64_t>& cstride = cl.flat().strides;
  std::vector<Run> region;  // the compact region's runs, made when a tile is first copied
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  std::vector<std::byte> raw;
  for (size_t k = 0; k < src.size(); ++k) {
    CarrierPtr buf = src.size() == 1 ? adoptable_gradient(*fresh, access, compact_grad) : nullptr;
    if (!buf) {
      if (region.empty()) region = g.region_runs(cstride);
      buf = scatter_tile(*fresh, access, src[k], *compact_grad,
                         g.region_base(TileGeometry::compact_coord(static_cast<int64_t>(k), counts), cstride), cstride,
                         region, nullptr, false);
    }
    // A tile whose gradient is all (+0) zero stays a valid implicit zero: summed
    // gradients keep untouched tiles implicit.
    if (all_zero_bytes(*buf, fresh->tile_size(), raw)) {
      buf->release();
      continue;
    }
    tiles.emplace_back(src[k], std::move(buf));
  }
  if (!tiles.empty()) TiledInternals::install_tiles(*fresh, tiles);
  return make_tensor(fresh, primal->offset, primal->layout);
}

}  // namespace sw
