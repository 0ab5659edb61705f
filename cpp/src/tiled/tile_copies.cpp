// Tile copies of the data paths: one tile between its buffer and its region of a dense tensor (gather for a
// projection, scatter for a scatter or a gradient), and a projection's gradient scattered into a fresh carrier.
#include "tile_copies.hpp"

#include <algorithm>
#include <atomic>
#include <cstring>

#include <immintrin.h>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"

namespace sw {

TileAccess::TileAccess(const TiledEvictable& carrier, const TensorImpl& tensor)
    : geometry(carrier.geometry()), t(tensor), canonical(tensor.offset == 0 && tensor.layout.is_column_major()) {
  const std::vector<int64_t>& tile = geometry.tile_shape();
  const std::vector<int64_t> tstride = TileGeometry::dense_strides(tile);
  if (canonical) {
    for (size_t k = 0; k < tile.size(); ++k) {
      mode_order.push_back(k);
      if (tile[k] == 1) continue;
      within.extents.push_back(tile[k]);
      within.strides.push_back(tstride[k]);
      leaf_mode.push_back(k);
      leaf_scale.push_back(1);
    }
    uniform = dense_permutation = true;
    return;
  }
  uniform = derive_within();
  if (!uniform) {
    within = FlatLayout{};
    leaf_mode.clear();
    leaf_scale.clear();
    return;
  }
  // A dense permutation: at most one leaf per mode, dense in the order of their buffer strides (a mode of tile
  // extent 1 keeps its column-major place, so a canonical order stays column-major).
  std::vector<int64_t> key(tile.size()), leaves(tile.size(), 0);
  for (size_t k = 0; k < tile.size(); ++k) key[k] = tstride[k];
  for (size_t l = 0; l < leaf_mode.size(); ++l) {
    key[leaf_mode[l]] = within.strides[l];
    ++leaves[leaf_mode[l]];
  }
  mode_order.resize(tile.size());
  for (size_t k = 0; k < tile.size(); ++k) mode_order[k] = k;
  std::stable_sort(mode_order.begin(), mode_order.end(), [&](size_t a, size_t b) { return key[a] < key[b]; });
  int64_t running = 1;
  dense_permutation = true;
  for (size_t k : mode_order) {
    if (tile[k] == 1) continue;
    if (leaves[k] != 1 || key[k] != running) dense_permutation = false;
    running *= tile[k];
  }
  if (!dense_permutation) mode_order.clear();
}

bool TileAccess::derive_within() {
  const std::vector<int64_t>& tile = geometry.tile_shape();
  const std::vector<int64_t>& logical = geometry.logical_shape();
  const std::vector<int64_t>& sstride = geometry.slot_strides();
  const std::vector<int64_t> tstride = TileGeometry::dense_strides(tile);
  const size_t rank = tile.size();
  if (t.layout.rank() != rank) return false;
  // The slot axes as digits, an axis that a tile spans whole merged with the next (its footprint is contiguous
  // across them): per digit, its slot stride, radix, tile extent and buffer stride.
  struct Digit {
    int64_t slot_stride, radix, extent, buffer_stride, reach = 0;
  };
  std::vector<Digit> digits;
  for (size_t d = 0; d < rank; ++d) {
    if (!digits.empty() && digits.back().extent == digits.back().radix) {
      digits.back().radix *= logical[d];
      digits.back().extent *= tile[d];
    } else {
      digits.push_back({sstride[d], logical[d], tile[d], tstride[d]});
    }
  }
  const FlatLayout& flat = t.layout.flat();
  size_t first = 0;
  for (size_t k = 0; k < rank; ++k) {
    const IntTuple& mode = t.layout.shape().tree()[k];
    const size_t count = mode.is_leaf() ? 1 : mode.leaf_count();
    int64_t need = tile[k], scale = 1;
    for (size_t j = first; j < first + count && need > 1; ++j) {
      const int64_t e = flat.extents[j], s = flat.strides[j];
      if (e == 1) continue;
      int64_t take;
      if (need % e == 0) take = e;
      else if (e % need == 0) take = need;  // the leaf splits at the tile boundary
      else return false;
      // The stride as a step in slot space: exactly one non-zero digit.
      if (s <= 0 || s >= geometry.size()) return false;
      Digit* on = nullptr;
      int64_t step = 0;
      for (Digit& dg : digits) {
        const int64_t v = (s / dg.slot_stride) % dg.radix;
        if (v == 0) continue;
        if (on) return false;
        on = &dg;
        step = v;
      }
      if (!on) return false;
      on->reach += step * (take - 1);
      within.extents.push_back(take);
      within.strides.push_back(step * on->buffer_stride);
      leaf_mode.push_back(k);
      leaf_scale.push_back(scale);
      scale *= take;
      need /= take;
    }
    if (need != 1) return false;
    first += count;
  }
  // No carry from one digit into the next: the buffer ordinal is then the sum of the leaves' steps.
  for (const Digit& dg : digits)
    if (dg.reach > dg.extent - 1) return false;
  return true;
}

std::vector<int64_t> TileAccess::compact_strides(std::span<const int64_t> cshape) const {
  if (!dense_permutation) return TileGeometry::dense_strides(cshape);
  std::vector<int64_t> out(cshape.size(), 0);
  int64_t running = 1;
  for (size_t k : mode_order) {
    out[k] = running;
    running *= cshape[k];
  }
  return out;
}

Layout TileAccess::compact_layout(std::span<const int64_t> cshape, std::span<const int64_t> counts,
                                  bool tile_major) const {
  const std::vector<int64_t>& tile = geometry.tile_shape();
  bool column_order = true;  // the tiles' order is column-major (modes of tile extent 1 aside)
  size_t previous = 0;
  bool first = true;
  for (size_t k : mode_order) {
    if (tile[k] == 1) continue;
    if (!first && k < previous) column_order = false;
    previous = k;
    first = false;
  }
  if (!tile_major || !dense_permutation || column_order) {
    std::vector<int64_t> cs(cshape.begin(), cshape.end());
    return Layout(Shape::flat(cs), Stride::flat(compact_strides(cshape)));
  }
  const std::vector<int64_t> within = compact_strides(tile);
  const int64_t tile_size = geometry.tile_size();
  std::vector<IntTuple> shape, stride;
  int64_t between = tile_size;  // the stride between consecutive tiles along the axis (column-major tile order)
  for (size_t k = 0; k < tile.size(); ++k) {
    const int64_t t = tile[k], n = counts[k];
    if (n == 1 || t == 1 || between == within[k] * t) {
      shape.emplace_back(t * n);
      stride.emplace_back(t == 1 ? (n == 1 ? int64_t{0} : between) : within[k]);
    } else {
      shape.push_back(IntTuple::tuple({IntTuple(t), IntTuple(n)}));
      stride.push_back(IntTuple::tuple({IntTuple(within[k]), IntTuple(between)}));
    }
    between *= n;
  }
  return Layout(Shape(IntTuple::tuple(std::move(shape))), Stride(IntTuple::tuple(std::move(stride))));
}

std::optional<TileRegion> tile_region(const TileGeometry& g, const Layout& layout, const TileCoord& cc) {
  const std::vector<int64_t>& tile = g.tile_shape();
  if (layout.rank() != tile.size()) return std::nullopt;
  TileRegion r;
  r.strides.resize(tile.size(), 0);
  const FlatLayout& flat = layout.flat();
  size_t first = 0;
  for (size_t k = 0; k < tile.size(); ++k) {
    const IntTuple& mode = layout.shape().tree()[k];
    const size_t count = mode.is_leaf() ? 1 : mode.leaf_count();
    // The mode's leaves of extent > 1.
    int64_t e[2] = {1, 1}, s[2] = {0, 0};
    size_t n = 0;
    for (size_t j = first; j < first + count; ++j) {
      if (flat.extents[j] == 1) continue;
      if (n == 2) return std::nullopt;
      e[n] = flat.extents[j];
      s[n] = flat.strides[j];
      ++n;
    }
    first += count;
    if (n <= 1) {  // one leaf: the tile is `tile extent` consecutive coordinates
      r.strides[k] = s[0];
      r.base += cc[k] * tile[k] * s[0];
    } else if (e[0] == tile[k]) {  // (tile extent, count)
      r.strides[k] = s[0];
      r.base += cc[k] * s[1];
    } else {
      return std::nullopt;
    }
  }
  return r;
}

bool TileAccess::buffer_order_is(const Layout& layout) const {
  if (!dense_permutation) return false;
  const std::vector<int64_t>& tile = geometry.tile_shape();
  if (layout.shape().extents() != tile) return false;
  std::optional<std::vector<int64_t>> s = mode_strides(layout);
  if (!s) return false;
  const std::vector<int64_t> want = compact_strides(tile);
  for (size_t k = 0; k < tile.size(); ++k)
    if (tile[k] > 1 && (*s)[k] != want[k]) return false;
  return true;
}

std::optional<std::vector<int64_t>> mode_strides(const Layout& layout) {
  std::vector<int64_t> out;
  for (size_t k = 0; k < layout.rank(); ++k) {
    auto leaf = layout.mode_as_leaf(k);
    if (!leaf) return std::nullopt;
    out.push_back(leaf->second);
  }
  return out;
}

// Note [Copying runs]: a tile whose runs are short next to the tile (a row-major (out, in) expert gathered into,
// or scattered from, a compact tensor that interleaves the experts row by row) is copied run by run, each a few
// KiB at most, 1 KiB for a (512, 256) Float32 expert. glibc's memcpy copies such a run with a loop of 4 vector
// loads then 4 stores; when the destination and the source are a multiple of 4 KiB apart (page-aligned buffers
// and 1 KiB runs meet that every fourth row) a load after a store can look as if it read what the store wrote,
// and the core waits for the store. copy_run loads a whole KiB into registers before storing any of it, so no
// load of a block waits on that block's stores. Measured on the AMD EPYC of docs/performance.md, two threads
// gathering two such experts (2 x 512 runs, a C++ loop alone): memcpy 9.0-11.2 us, and 24-26 us in some
// processes (by where the destination lay), the block kernel 8.1-8.5 us in every process; the column-major
// form's two 512 KiB runs 5.3-6.0 us. A whole projection on a quiet machine gains little from it (0.97-1.00 of
// the memcpy time; most of its 35-40 us is not the copy), 0.84-0.90 with the other core busy. Longer runs keep
// memcpy (its `rep movsb` streams them), as do machines without AVX-512 and the portable path the tests force.
namespace {

std::atomic<bool> g_portable_runs{false};

bool runs_avx512() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok && !g_portable_runs.load(std::memory_order_relaxed);
}

constexpr size_t kBlock = 1024;              // 16 zmm registers
constexpr size_t kBlockedRunMax = 16 * 1024;  // longer runs: memcpy

__attribute__((target("avx512f"))) void copy_blocks_avx512(std::byte* d, const std::byte* s, size_t n) {
  size_t i = 0;
  for (; i + kBlock <= n; i += kBlock) {
    __m512i r[kBlock / 64];
    for (size_t k = 0; k < kBlock / 64; ++k) r[k] = _mm512_loadu_si512(s + i + 64 * k);
    for (size_t k = 0; k < kBlock / 64; ++k) _mm512_storeu_si512(d + i + 64 * k, r[k]);
  }
  if (i < n) std::memcpy(d + i, s + i, n - i);
}

// One run of `n` bytes; `blocked`: runs_avx512(), read once per tile.
inline void copy_run(std::byte* d, const std::byte* s, size_t n, bool blocked) {
  if (blocked && n >= kBlock && n <= kBlockedRunMax) copy_blocks_avx512(d, s, n);
  else std::memcpy(d, s, n);
}

}  // namespace

const char* run_copy_path() noexcept { return runs_avx512() ? "avx512f" : "portable"; }
bool force_portable_run_copies(bool portable) noexcept {
  return g_portable_runs.exchange(portable, std::memory_order_relaxed);
}

RunWalk run_walk(const TileAccess& a, std::span<const int64_t> rstride) {
  const size_t n = a.within.extents.size();
  std::vector<size_t> order(n);
  for (size_t l = 0; l < n; ++l) order[l] = l;
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t x, size_t y) { return a.within.strides[x] < a.within.strides[y]; });
  RunWalk w;
  w.total = 1;
  for (size_t i = 0; i < n; ++i) {
    const size_t l = order[i];
    w.ext.push_back(a.within.extents[l]);
    w.bs.push_back(a.within.strides[l]);
    w.rs.push_back(rstride[a.leaf_mode[l]] * a.leaf_scale[l]);
    w.total *= w.ext.back();
  }
  // The leading leaves contiguous on both sides make one run; only the others are walked.
  size_t first = 0;
  while (first < n && w.bs[first] == w.len && w.rs[first] == w.len) w.len *= w.ext[first++];
  for (auto* v : {&w.ext, &w.bs, &w.rs}) v->erase(v->begin(), v->begin() + static_cast<std::ptrdiff_t>(first));
  return w;
}

namespace {

// Calls fn(buffer ordinal, region offset, length) for the runs of one tile (RunWalk). With `pieces` > 1, only
// piece `piece` of the tile: its slots in run order, from piece * n / pieces to (piece + 1) * n / pieces (n: the
// tile's slots), cut into runs, so the pieces together make the tile's runs (Note [Gathering in the caller]).
template <class F>
void walk_runs(const RunWalk& w, F&& fn, int64_t piece = 0, int64_t pieces = 1) {
  const size_t n = w.ext.size();
  const int64_t len = w.len, total = w.total;
  if (total == 0) return;
  std::vector<int64_t> c(n, 0);
  // The piece's slots [at, end) in run order; the odometer starts at the run holding `at`.
  int64_t at = pieces > 1 ? total / pieces * piece + std::min(piece, total % pieces) : 0;
  const int64_t end = pieces > 1 ? at + total / pieces + (piece < total % pieces ? 1 : 0) : total;
  int64_t bo = 0, ro = 0, within = at % len;
  for (int64_t r = at / len, j = 0; r > 0 && j < static_cast<int64_t>(n); ++j) {
    c[j] = r % w.ext[j];
    r /= w.ext[j];
    bo += c[j] * w.bs[j];
    ro += c[j] * w.rs[j];
  }
  while (at < end) {
    const int64_t take = std::min(len - within, end - at);
    fn(bo + within, ro + within, take);
    at += take;
    within = 0;
    size_t j = 0;
    for (; j < n; ++j) {
      bo += w.bs[j];
      ro += w.rs[j];
      if (++c[j] < w.ext[j]) break;
      bo -= w.bs[j] * w.ext[j];
      ro -= w.rs[j] * w.ext[j];
      c[j] = 0;
    }
    if (j == n) return;
  }
}

}  // namespace

void gather_tile(const TiledEvictable& c, const TileAccess& access, int64_t index, const CarrierPtr& buffer,
                 Carrier& dest, const TileRegion& region, int64_t piece, int64_t pieces, const RunWalk* walk) {
  const TileGeometry& g = c.geometry();
  const int64_t base = region.base;
  const std::vector<int64_t>& dstride = region.strides;
  const size_t w = slot_bytes(c.dtype());
  if (access.uniform) {
    std::byte* d = dest.mutable_native_data();
    const std::byte* s = buffer ? buffer->native_data() : nullptr;
    std::vector<std::byte> zero;
    const bool blocked = runs_avx512();
    const RunWalk own = walk ? RunWalk{} : run_walk(access, dstride);
    walk_runs(walk ? *walk : own, [&](int64_t bo, int64_t ro, int64_t len) {
      const size_t bytes = static_cast<size_t>(len) * w;
      if (buffer && s && d) {
        copy_run(d + static_cast<size_t>(base + ro) * w, s + static_cast<size_t>(bo) * w, bytes, blocked);
      } else if (buffer) {
        copy_slots(*buffer, bo, dest, base + ro, len);
      } else if (d) {
        std::memset(d + static_cast<size_t>(base + ro) * w, 0, bytes);
      } else {
        if (zero.size() < bytes) zero.resize(bytes, std::byte{0});
        dest.write_slots(base + ro, len, zero.data());
      }
    }, piece, pieces);
    return;
  }
  SW_ASSERT(pieces == 1, "gather_tile: a tile without a uniform access is gathered whole");
  const int64_t n = g.tile_size();
  std::vector<std::byte> zero(w, std::byte{0});
  for (int64_t wo = 0; wo < n; ++wo) {
    const int64_t off = base + g.region_offset(wo, dstride);
    if (buffer) copy_slots(*buffer, access.physical_within(index, wo), dest, off, 1);
    else dest.write_slots(off, 1, zero.data());
  }
}

CarrierPtr scatter_tile(const TiledEvictable& c, const TileAccess& access, int64_t index, const TensorImpl& compact,
                        const TileCoord& cc, const CarrierPtr& existing, bool add) {
  const TileGeometry& g = c.geometry();
  const int64_t n = g.tile_size();
  // Fast path: a uniform access (Note [Within-tile layouts]) and a compact tensor whose modes are single leaves:
  // one bulk copy per run, then (add) one vectorisable pass in buffer order.
  const bool float_add_native = c.dtype().id() == DTypeId::Float32 &&
                                (!existing || existing->native_data() != nullptr);
  // The bulk copies move bytes: only between one dtype (a Float32 cotangent of a 16-bit tile converts slot by slot).
  std::optional<TileRegion> region =
      access.uniform && compact.dtype() == c.dtype() ? tile_region(g, compact.layout, cc) : std::nullopt;
  if (region && (!add || float_add_native)) {
    CarrierPtr buf = c.primary()->allocate_like(n, true, c.dtype(), /*empty=*/true);
    const int64_t base = compact.offset + region->base;
    const std::vector<int64_t>& cs = region->strides;
    const size_t w = slot_bytes(c.dtype());
    const std::byte* s = compact.carrier->native_data();
    std::byte* d = buf->mutable_native_data();
    const bool blocked = runs_avx512();
    walk_runs(run_walk(access, cs), [&](int64_t bo, int64_t ro, int64_t len) {
      if (s && d) copy_run(d + static_cast<size_t>(bo) * w, s + static_cast<size_t>(base + ro) * w,
                           static_cast<size_t>(len) * w, blocked);
      else copy_slots(*compact.carrier, base + ro, *buf, bo, len);
    });
    if (add && existing) {
      const float* e = reinterpret_cast<const float*>(existing->native_data());
      if (d) {
        float* f = reinterpret_cast<float*>(d);
        for (int64_t k = 0; k < n; ++k) f[k] = e[k] + f[k];
      } else {
        std::vector<float> v(static_cast<size_t>(n));
        buf->read_slots(0, n, v.data());
        for (int64_t k = 0; k < n; ++k) v[k] = e[k] + v[k];
        buf->write_slots(0, n, v.data());
      }
    }
    return buf;
  }
  // Slot by slot: the compact tensor's logical ordinal of each within-tile ordinal.
  const std::vector<int64_t> ostride = TileGeometry::dense_strides(compact.layout.shape().extents());
  const int64_t obase = g.region_base(cc, ostride);
  CarrierPtr buf = c.primary()->allocate_like(n, true, c.dtype(), /*empty=*/false);
  for (int64_t wo = 0; wo < n; ++wo) {
    const int64_t ord = obase + g.region_offset(wo, ostride);
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
    if (compact.dtype() != c.dtype() || add) v = c.dtype().convert(v);  // rounded once into the tile's dtype
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
// hold — the primary's kind and dtype, one tile's slots, the buffer's own order
// on both sides (Note [Within-tile layouts]) — the buffer becomes the gradient tile as is: no allocation, no
// copy. In the MoE workload this saves two passes over every expert's
// gradient (4 MiB each) per projection. Anything shared (the caller's seed, a
// gradient also handed to another input, a retained .grad) is copied as before.
CarrierPtr adoptable_gradient(const TiledEvictable& fresh, const TileAccess& access, const TensorPtr& g) {
  if (g.use_count() != 1 || g->offset != 0 || !access.buffer_order_is(g->layout)) return nullptr;
  const CarrierPtr& buf = g->carrier;
  if (buf.use_count() != 1 || &buf->kind() != &fresh.primary()->kind() || !(buf->dtype() == fresh.dtype()) ||
      buf->size() != fresh.tile_size() || !buf->is_mutable() || buf->is_released() || !buf->native_data())
    return nullptr;
  return buf;
}

}  // namespace

TensorPtr scatter_add_gradient(const std::shared_ptr<TiledEvictable>& c, const TensorPtr& primal,
                               const TileSelection& sel, const TensorPtr& compact_grad) {
  // A 16-bit parameter's gradient stays Float32 until it reaches the leaf (Note [Tiled gradients of 16-bit
  // parameters]).
  const DType& dtype = tiled_gradient_dtype(c->dtype(), compact_grad->dtype());
  auto fresh = std::static_pointer_cast<TiledEvictable>(c->allocate_like(c->size(), true, dtype, false));
  TileAccess access(*fresh, *primal);
  const TileGeometry& g = c->geometry();
  std::vector<int64_t> src = g.select(sel.per_axis);
  std::vector<int64_t> counts = counts_of(sel);
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  std::vector<std::byte> raw;
  for (size_t k = 0; k < src.size(); ++k) {
    CarrierPtr buf = src.size() == 1 ? adoptable_gradient(*fresh, access, compact_grad) : nullptr;
    if (!buf)
      buf = scatter_tile(*fresh, access, src[k], *compact_grad, TileGeometry::compact_coord(static_cast<int64_t>(k), counts),
                         nullptr, false);
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
