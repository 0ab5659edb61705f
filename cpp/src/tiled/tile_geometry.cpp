#include "strideweave/tiled/tile_geometry.hpp"

#include <algorithm>
#include <sstream>

#include "strideweave/errors.hpp"
#include "internal.hpp"

namespace sw {

std::string coord_str(const TileCoord& t) {
  std::ostringstream out;
  out << "(";
  for (size_t i = 0; i < t.size(); ++i) out << (i ? ", " : "") << t[i];
  out << (t.size() == 1 ? ",)" : ")");
  return out.str();
}

TileGeometry::TileGeometry(std::vector<int64_t> grid, std::vector<int64_t> tile)
    : grid_(std::move(grid)), tile_(std::move(tile)) {
  if (grid_.empty() || grid_.size() != tile_.size())
    raise<ValueError>("grid_shape and tile_shape must have one non-zero rank, got ", grid_.size(), " and ", tile_.size());
  tile_count_ = 1;
  tile_size_ = 1;
  for (size_t i = 0; i < grid_.size(); ++i) {
    if (grid_[i] < 1 || tile_[i] < 1)
      raise<ValueError>("grid_shape and tile_shape extents must be >= 1 (axis ", i, ")");
  }
  // Every product below is bounded by the extent (Shape's 2**62 limit), so none overflows int64.
  constexpr int64_t kMaxExtent = int64_t{1} << 62;
  auto checked = [](int64_t a, int64_t b) {
    int64_t out;
    if (__builtin_mul_overflow(a, b, &out) || out > kMaxExtent)
      raise<ValueError>("TiledEvictable extent (grid_shape times tile_shape) exceeds the supported range (2**62)");
    return out;
  };
  for (size_t i = 0; i < grid_.size(); ++i) {
    logical_.push_back(checked(grid_[i], tile_[i]));
    tile_count_ = checked(tile_count_, grid_[i]);
    tile_size_ = checked(tile_size_, tile_[i]);
  }
  total_ = checked(tile_count_, tile_size_);
  slot_stride_ = dense_strides(logical_);
  check_table_size();
  runs_ = region_runs(slot_stride_);  // tile 0's footprint; every other tile's is it shifted
}

// Note [Tile table limits]. A TiledEvictable builds its tile table eagerly: one entry per tile, and a residency
// pass over every tile (a flush, a promotion of everything, a release) touches each tile's footprint runs. An
// extent within 2**62 may still ask for 10**14 tiles (grid (10**7, 10**7), tile (1, 1)) or 2**40 runs (tile
// (1, 2**40) under a grid whose first axis is not 1), which would take terabytes or fail deep inside
// std::vector, or make one pass over the table take hours. So the table is bounded up front, before any
// allocation or claim: at most kMaxTiles tiles and kMaxRuns runs in all (every tile has tile_size / run_length
// runs, run_length being the first coalesced leaf of its footprint when that leaf has stride 1, as Layout::runs()
// coalesces). Beyond either, ValueError. The bounds allow realistic tilings (a 65536 x 65536 matrix in 256 x 256
// tiles has 2**16 tiles and 2**24 runs) and keep the largest table to a few GB and seconds. The footprint runs
// themselves are one pattern (TileGeometry::footprint_runs shifts it per tile), at most kMaxRuns of them.
void TileGeometry::check_table_size() const {
  if (tile_count_ > kMaxTiles)
    raise<ValueError>("TiledEvictable grid_shape ", coord_str(grid_), " has ", tile_count_,
                      " tiles; at most 2**24 (", kMaxTiles, ") tiles are supported");
  std::vector<int64_t> ext, str;  // the footprint's leaves, coalesced like Layout::runs()
  for (size_t i = 0; i < rank(); ++i) {
    if (tile_[i] == 1) continue;
    if (!ext.empty() && slot_stride_[i] == ext.back() * str.back()) {
      ext.back() *= tile_[i];
      continue;
    }
    ext.push_back(tile_[i]);
    str.push_back(slot_stride_[i]);
  }
  const int64_t run_length = !ext.empty() && str[0] == 1 ? ext[0] : 1;
  const int64_t runs = total_ / run_length;  // tile_count * (tile_size / run_length)
  if (runs > kMaxRuns)
    raise<ValueError>("TiledEvictable tile footprints of tile_shape ", coord_str(tile_), " in logical_shape ",
                      coord_str(logical_), " need ", runs, " contiguous runs; at most 2**26 (", kMaxRuns,
                      ") are supported");
}

// ---------------------------------------------------------------- tiles and slots

int64_t TileGeometry::tile_index(const TileCoord& t) const {
  if (t.size() != rank())
    raise<ValueError>("tile coordinate ", coord_str(t), " has rank ", t.size(), " but the tile grid has rank ", rank());
  int64_t index = 0, scale = 1;
  for (size_t i = 0; i < rank(); ++i) {
    if (t[i] < 0 || t[i] >= grid_[i])
      raise<ValueError>("tile coordinate ", coord_str(t), " is out of range for the tile grid ", coord_str(grid_));
    index += t[i] * scale;
    scale *= grid_[i];
  }
  return index;
}

TileCoord TileGeometry::tile_coord(int64_t index) const { return compact_coord(index, grid_); }

std::pair<int64_t, int64_t> TileGeometry::locate(int64_t slot) const noexcept {
  int64_t tile = 0, within = 0, tscale = 1, wscale = 1;
  for (size_t i = 0; i < rank(); ++i) {
    int64_t c = slot % logical_[i];
    slot /= logical_[i];
    tile += (c / tile_[i]) * tscale;
    within += (c % tile_[i]) * wscale;
    tscale *= grid_[i];
    wscale *= tile_[i];
  }
  return {tile, within};
}

int64_t TileGeometry::slot(int64_t index, int64_t within) const noexcept {
  return tile_base(index) + region_offset(within, slot_stride_);
}

int64_t TileGeometry::tile_base(int64_t index) const noexcept {
  int64_t base = 0;
  for (size_t i = 0; i < rank(); ++i) {
    base += (index % grid_[i]) * tile_[i] * slot_stride_[i];
    index /= grid_[i];
  }
  return base;
}

// ---------------------------------------------------------------- regions

int64_t TileGeometry::region_base(const TileCoord& c, std::span<const int64_t> strides) const noexcept {
  int64_t base = 0;
  for (size_t i = 0; i < c.size(); ++i) base += c[i] * tile_[i] * strides[i];
  return base;
}

int64_t TileGeometry::region_offset(int64_t within, std::span<const int64_t> strides) const noexcept {
  int64_t off = 0;
  for (size_t i = 0; i < rank(); ++i) {
    off += (within % tile_[i]) * strides[i];
    within /= tile_[i];
  }
  return off;
}

std::vector<Run> TileGeometry::region_runs(std::span<const int64_t> strides) const {
  return Layout(Shape::flat(tile_), Stride::flat(std::vector<int64_t>(strides.begin(), strides.end()))).runs();
}

// ---------------------------------------------------------------- selections

std::vector<int64_t> TileGeometry::select(const std::vector<std::vector<int64_t>>& per_axis) const {
  if (per_axis.size() != rank())
    raise<ValueError>("the TileSelection has rank ", per_axis.size(), " but the tile grid has rank ", rank());
  std::vector<int64_t> counts;
  for (const auto& a : per_axis) counts.push_back(static_cast<int64_t>(a.size()));
  for (size_t i = 0; i < rank(); ++i)
    for (int64_t v : per_axis[i])
      if (v < 0 || v >= grid_[i])
        raise<ValueError>("TileSelection coordinate ", v, " on axis ", i, " is out of range for the tile grid extent ",
                          grid_[i]);
  const int64_t n = product(counts);
  std::vector<int64_t> out;
  out.reserve(static_cast<size_t>(n));
  TileCoord s(rank());
  for (int64_t k = 0; k < n; ++k) {
    TileCoord cc = compact_coord(k, counts);
    for (size_t i = 0; i < rank(); ++i) s[i] = per_axis[i][cc[i]];
    out.push_back(tile_index(s));
  }
  return out;
}

std::vector<int64_t> TileGeometry::compact_shape(const std::vector<std::vector<int64_t>>& per_axis) const {
  std::vector<int64_t> out;
  for (size_t i = 0; i < per_axis.size(); ++i) out.push_back(static_cast<int64_t>(per_axis[i].size()) * tile_[i]);
  return out;
}

TileCoord TileGeometry::compact_coord(int64_t k, std::span<const int64_t> extents) {
  TileCoord c(extents.size());
  for (size_t i = 0; i < extents.size(); ++i) {
    c[i] = k % extents[i];
    k /= extents[i];
  }
  return c;
}

std::vector<int64_t> TileGeometry::dense_strides(std::span<const int64_t> shape) {
  std::vector<int64_t> s;
  int64_t run = 1;
  for (auto e : shape) {
    s.push_back(run);
    run *= e;
  }
  return s;
}

int64_t TileGeometry::product(std::span<const int64_t> shape) noexcept {
  int64_t n = 1;
  for (auto x : shape) n *= x;
  return n;
}

// ---------------------------------------------------------------- footprints

void TileGeometry::check_footprints(const Layout& layout, int64_t offset) const {
  if (offset == 0 && layout.is_column_major() && layout.shape().extents() == logical_) return;  // canonical
  if (offset == 0 && footprints_match_by_structure(layout)) return;  // checks the extents itself
  check_footprints_slot_by_slot(layout, offset);                    // the shape first, then every slot
}

// Note [Footprints by structure]: checking a tensor slot by slot costs a pass over the whole extent (a 2 GiB
// checkpoint's full tensor: 10**9 slots, seconds) for every new full tensor. Most tensors over a TiledEvictable
// decide it from their strides alone: when every top-level mode k is one leaf (extent grid_k * tile_k, stride s_k)
// and the offset is 0, logical coordinate x = t * tile + r (per mode) reaches slot base(t) + W(r), base(t) =
// sum t_k tile_k s_k and W(r) = sum r_k s_k; the carrier's footprint of tile t is cbase(t) + F(r) with the
// canonical strides S_k. Both W and F are 0 at r = 0 and never negative, so the tensor reaches every tile's
// footprint exactly iff base(t) == cbase(t) for every t (s_k == S_k wherever grid_k > 1) and W's image is F's
// (W injective): the within-tile digits (tile_k, s_k) and (tile_k, S_k), sorted by stride and merged where one
// continues the other (stride == previous stride * extent), are the same list. PyTorch's row-major tiles pass
// ((out, in):(in, 1) against (out, in):(1, out): both merge to (out * in):(1)). Anything else goes slot by slot.
bool TileGeometry::footprints_match_by_structure(const Layout& layout) const {
  if (layout.rank() != rank()) return false;
  std::vector<std::pair<int64_t, int64_t>> w, f;  // (stride, extent) of the within-tile digits
  for (size_t k = 0; k < rank(); ++k) {
    const auto leaf = layout.mode_as_leaf(k);
    if (!leaf || leaf->first != logical_[k]) return false;
    const int64_t s = leaf->second;
    if (grid_[k] > 1 && s != slot_stride_[k]) return false;
    if (tile_[k] > 1) {
      w.emplace_back(s, tile_[k]);
      f.emplace_back(slot_stride_[k], tile_[k]);
    }
  }
  auto merged = [](std::vector<std::pair<int64_t, int64_t>> d) {
    std::sort(d.begin(), d.end());
    std::vector<std::pair<int64_t, int64_t>> out;
    for (const auto& [stride, extent] : d) {
      if (!out.empty() && stride == out.back().first * out.back().second) out.back().second *= extent;
      else out.emplace_back(stride, extent);
    }
    return out;
  };
  const auto mw = merged(w), mf = merged(f);
  if (mw != mf) return false;
  for (size_t i = 1; i < mf.size(); ++i)  // F's digits never overlap (a tile's slots are distinct): nor do W's
    if (mf[i].first < mf[i - 1].first * mf[i - 1].second) return false;
  return true;
}

void TileGeometry::check_footprints_slot_by_slot(const Layout& layout, int64_t offset) const {
  std::vector<int64_t> ext = layout.shape().extents();
  if (ext != logical_) {
    std::ostringstream s;
    for (size_t i = 0; i < ext.size(); ++i) s << (i ? ", " : "") << ext[i];
    raise<ValueError>("the tensor's shape (", s.str(), ") is not the TiledEvictable's full logical shape ",
                      coord_str(logical_), ": tile footprints cannot match");
  }
  // One pass over the tensor's slots: each must lie in its own tile's footprint, and no slot twice.
  std::vector<uint8_t> seen(static_cast<size_t>(total_), 0);
  const FlatLayout& flat = layout.flat();
  // Top-level mode boundaries among the flat leaves.
  std::vector<size_t> first_leaf;
  size_t leaf = 0;
  for (size_t k = 0; k < layout.rank(); ++k) {
    first_leaf.push_back(leaf);
    leaf += layout.shape().tree()[k].is_leaf() ? 1 : layout.shape().tree()[k].leaf_count();
  }
  const int64_t n = layout.size();
  std::vector<int64_t> c(flat.extents.size(), 0);
  int64_t off = offset;
  for (int64_t o = 0; o < n; ++o) {
    // Logical tile of ordinal o: per top-level mode, its ordinal / tile extent.
    int64_t tile = 0, tscale = 1;
    for (size_t k = 0; k < rank(); ++k) {
      size_t end = k + 1 < first_leaf.size() ? first_leaf[k + 1] : flat.extents.size();
      int64_t mode_ord = 0, mscale = 1;
      for (size_t j = first_leaf[k]; j < end; ++j) {
        mode_ord += c[j] * mscale;
        mscale *= flat.extents[j];
      }
      tile += (mode_ord / tile_[k]) * tscale;
      tscale *= grid_[k];
    }
    if (off < 0 || off >= total_)
      raise<ValueError>("tensor slot ", off, " lies outside the TiledEvictable extent: tile footprints do not match");
    const int64_t phys_tile = locate(off).first;
    if (phys_tile != tile)
      raise<ValueError>("logical tile ", coord_str(tile_coord(tile)), " reaches slot ", off, " of carrier tile ",
                        coord_str(tile_coord(phys_tile)), ": the tensor's tile footprints do not match the carrier's");
    if (seen[off]) raise<ValueError>("the tensor reaches slot ", off, " twice: its tile footprints alias");
    seen[off] = 1;
    for (size_t j = 0; j < c.size(); ++j) {  // odometer
      off += flat.strides[j];
      if (++c[j] < flat.extents[j]) break;
      off -= flat.strides[j] * flat.extents[j];
      c[j] = 0;
    }
  }
  // n == total_ and no slot repeats, so every footprint is covered exactly.
}

}  // namespace sw
