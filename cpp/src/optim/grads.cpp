// grad_norm and scale_grads (Note [Gradients of tiled parameters together] in strideweave/optim.hpp): every
// gradient checked first, then each present tile resident and held in turn, read (the norm, in Float64) or scaled
// in place and committed.
#include <algorithm>
#include <cmath>
#include <limits>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/optim.hpp"
#include "../ops/half.hpp"
#include "../tiled/internal.hpp"
#include "optim_internal.hpp"

namespace sw::optim {

namespace {

struct Gradient {
  size_t index;  // of the parameter
  TensorPtr grad;
  std::shared_ptr<TiledEvictable> tiled;  // null: dense
};

bool compact(const TensorImpl& t) { return t.layout.size() == t.layout.cosize() && t.layout.is_injective(); }

// The gradients of `params`, every one checked before anything is read or written.
std::vector<Gradient> gradients_of(const std::vector<TensorPtr>& params, const char* fn, bool write) {
  std::vector<Gradient> out;
  for (size_t i = 0; i < params.size(); ++i) {
    const TensorPtr& p = params[i];
    if (!p) raise<TypeError>(fn, ": params[", i, "] is None, not a Tensor");
    // Note [Stepping in backward]: such a parameter's tiles are stepped before its other gradients exist.
    if (auto pt = std::dynamic_pointer_cast<TiledEvictable>(p->carrier); pt && pt->gradient_hook())
      raise<ValueError>(fn, ": params[", i, "] belongs to an optimizer with step_in_backward, which steps each tile "
                        "in backward before the other gradients exist; clipping by the total norm needs them all "
                        "first (build the optimizer without step_in_backward to clip)");
    TensorPtr g;
    {
      std::lock_guard lock(p->mutex);
      g = p->grad;
    }
    if (!g) continue;
    if (!detail::float_dtype(g->dtype()))
      raise<TypeError>(fn, ": the gradient of params[", i, "] has dtype ", g->dtype().name(),
                       "; gradients are Float32, BFloat16 or Float16");
    if (g->carrier->is_released())
      raise<ValueError>(fn, ": the gradient of params[", i, "] is over a released ", g->carrier->kind_name(),
                        " carrier");
    auto t = std::dynamic_pointer_cast<TiledEvictable>(g->carrier);
    if (t) {
      if (g->offset != 0 || g->size() != t->size() || !compact(*g))
        raise<ValueError>(fn, ": the gradient of params[", i, "] must view the whole extent of its TiledEvictable (",
                          t->size(), " slots, each once, from offset 0), got ", g->size(), " elements from offset ",
                          g->offset);
    } else if (write) {
      if (&g->carrier->kind() != &cpu_kind() || !g->carrier->native_data() || !compact(*g) || !g->is_mutable())
        raise<ValueError>(fn, ": the gradient of params[", i, "] is a ", g->carrier->kind().name,
                          " tensor; a dense gradient is scaled in place in CPU memory, compact and mutable");
    }
    out.push_back({i, std::move(g), std::move(t)});
  }
  return out;
}

// The tiles of `c` that hold values (not implicit zeros), in tile order.
std::vector<int64_t> present_tiles(const TiledEvictable& c) {
  std::vector<int64_t> tiles;
  for (const TileCoord& t : c.tiles_where([](const TileState& st) { return st.location != TileLocation::Implicit; }))
    tiles.push_back(c.tile_index(t));
  std::sort(tiles.begin(), tiles.end());
  return tiles;
}

std::unique_ptr<TiledInternals::TileWrite> hold(TiledEvictable& c, int64_t i, const char* fn) {
  const std::string label = std::string(fn) + " (a gradient tile)";
  if (auto h = TiledInternals::hold_in_turn(c, i, label.c_str())) return h;
  raise<RuntimeError>(fn, ": gradient tile ", coord_str(c.tile_coord(i)),
                      " could not be held: its primary tier has no host memory");
}

// The Float64 accumulation of the norm.
struct NormSum {
  double p;
  double acc = 0.0;
  void add(const float* x, int64_t n) {
    if (std::isinf(p)) {
      for (int64_t k = 0; k < n; ++k) {
        const double a = std::fabs(static_cast<double>(x[k]));
        if (a > acc || std::isnan(a)) acc = std::isnan(acc) ? acc : a;
      }
    } else if (p == 2.0) {
      for (int64_t k = 0; k < n; ++k) acc += static_cast<double>(x[k]) * static_cast<double>(x[k]);
    } else if (p == 1.0) {
      for (int64_t k = 0; k < n; ++k) acc += std::fabs(static_cast<double>(x[k]));
    } else {
      for (int64_t k = 0; k < n; ++k) acc += std::pow(std::fabs(static_cast<double>(x[k])), p);
    }
  }
  double result() const {
    if (std::isinf(p) || p == 1.0) return acc;
    if (p == 2.0) return std::sqrt(acc);
    return std::pow(acc, 1.0 / p);
  }
};

constexpr int64_t kChunk = 4096;

// n values of dtype d at `src` widened to Float32 in pieces, each handed to f(values, count).
template <class F>
void for_floats(const void* src, DTypeId d, int64_t n, F&& f) {
  if (d == DTypeId::Float32) return f(static_cast<const float*>(src), n);
  float buf[kChunk];
  const auto* s = static_cast<const uint16_t*>(src);
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t len = std::min(kChunk, n - at);
    if (d == DTypeId::BFloat16) sw::detail::bf16_to_f32(s + at, buf, len);
    else sw::detail::f16_to_f32(s + at, buf, len);
    f(buf, len);
  }
}

// n values of dtype d at `data` times f (Float32), rounded once to Float32 and once more to a 16-bit dtype.
void scale_values(void* data, DTypeId d, int64_t n, float f) {
  if (d == DTypeId::Float32) {
    float* x = static_cast<float*>(data);
    for (int64_t k = 0; k < n; ++k) x[k] = x[k] * f;
    return;
  }
  float buf[kChunk];
  auto* s = static_cast<uint16_t*>(data);
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t len = std::min(kChunk, n - at);
    if (d == DTypeId::BFloat16) sw::detail::bf16_to_f32(s + at, buf, len);
    else sw::detail::f16_to_f32(s + at, buf, len);
    for (int64_t k = 0; k < len; ++k) buf[k] = buf[k] * f;
    if (d == DTypeId::BFloat16) sw::detail::f32_to_bf16(buf, s + at, len);
    else sw::detail::f32_to_f16(buf, s + at, len);
  }
}

}  // namespace

double grad_norm(const std::vector<TensorPtr>& params, double norm_type) {
  const char* fn = "grad_norm";
  if (!(norm_type > 0))
    raise<ValueError>(fn, ": norm_type must be > 0 (or inf), got ", norm_type);
  const std::vector<Gradient> grads = gradients_of(params, fn, false);
  NormSum sum{norm_type};
  for (const Gradient& g : grads) {
    const DTypeId d = g.grad->dtype().id();
    if (g.tiled) {
      const int64_t n = g.tiled->tile_size();
      for (int64_t i : present_tiles(*g.tiled)) {
        auto h = hold(*g.tiled, i, fn);
        for_floats(h->data(), d, n, [&](const float* x, int64_t len) { sum.add(x, len); });
      }  // read only: each hold ends without a commit, the tile unchanged
      continue;
    }
    // Dense: read through the layout in pieces (any carrier).
    const Carrier::Claim claim = g.grad->carrier->claim(fn);
    const int64_t w = static_cast<int64_t>(slot_bytes(g.grad->dtype()));
    std::vector<std::byte> buf(static_cast<size_t>(kChunk * w));
    for (const Run& run : g.grad->layout.runs()) {
      for (int64_t at = 0; at < run.length; at += kChunk) {
        const int64_t len = std::min(kChunk, run.length - at);
        g.grad->carrier->read_slots(g.grad->offset + run.offset + at, len, buf.data());
        for_floats(buf.data(), d, len, [&](const float* x, int64_t m) { sum.add(x, m); });
      }
    }
  }
  return sum.result();
}

void scale_grads(const std::vector<TensorPtr>& params, double factor) {
  const char* fn = "scale_grads";
  const std::vector<Gradient> grads = gradients_of(params, fn, true);
  const float f = static_cast<float>(factor);
  for (const Gradient& g : grads) {
    const DTypeId d = g.grad->dtype().id();
    if (g.tiled) {
      const int64_t n = g.tiled->tile_size();
      for (int64_t i : present_tiles(*g.tiled)) {
        auto h = hold(*g.tiled, i, fn);
        scale_values(h->data(), d, n, f);
        h->commit();
      }
      continue;
    }
    const Carrier::Claim claim = g.grad->carrier->claim(fn);
    auto* data = g.grad->carrier->mutable_native_data() + g.grad->offset * static_cast<int64_t>(slot_bytes(g.grad->dtype()));
    scale_values(data, d, g.grad->layout.cosize(), f);
    g.grad->carrier->bump_version();
  }
}

}  // namespace sw::optim
