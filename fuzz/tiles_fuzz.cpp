// TileGeometry, tile sets and selections (strideweave/tiled/tile_set.hpp, tile_geometry.hpp), their binding to a
// TiledEvictable's grid, and ResidencyPlans a policy returns (tiled_evictable.hpp, data.hpp) under libFuzzer. The
// input decodes into a grid and tile shape, tile coordinates, a selection, and the plans of a scripted policy;
// projections and residency requests then run on a small carrier and are checked against a naive gather
// (docs/reliability.md, "Coverage-guided fuzzing").
#include <algorithm>
#include <chrono>
#include <set>
#include <thread>
#include <vector>

#include "fuzz_input.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/tiled/data.hpp"
#include "strideweave/tiled/tile_set.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

using namespace sw;
using fuzz::Input;

namespace {

std::vector<int64_t> shape(Input& in, size_t rank, int64_t small) {
  std::vector<int64_t> v(rank);
  for (auto& e : v) e = in.extent(small);
  return v;
}

std::vector<int64_t> coords(Input& in, size_t rank, const std::vector<int64_t>& grid) {
  std::vector<int64_t> c(rank);
  for (size_t k = 0; k < rank; ++k)
    c[k] = in.byte() < 230 && k < grid.size() && grid[k] > 0 ? static_cast<int64_t>(in.below(grid[k])) : in.extent(6);
  return c;
}

// Plans drawn from the input, one per call: tiles in or out of the grid, of the wrong rank, repeated; or a throw.
class ScriptedPolicy final : public ResidencyPolicy {
 public:
  ScriptedPolicy(std::string script, std::vector<int64_t> grid) : script_(std::move(script)), grid_(std::move(grid)) {}
  ResidencyPlan plan(const std::vector<TileCoord>& required, const char* purpose) override {
    Input in(reinterpret_cast<const uint8_t*>(script_.data()) + at_, script_.size() - at_);
    const size_t before = in.left();
    ResidencyPlan p;
    const uint8_t how = in.byte();
    if (how % 16 == 15) raise<RuntimeError>("policy refuses (", purpose, ")");
    for (auto* field : {&p.promote, &p.retain, &p.evict}) {
      const size_t n = in.below(4);
      for (size_t k = 0; k < n; ++k) {
        const size_t rank = in.byte() < 240 ? grid_.size() : in.below(4);
        field->push_back(in.flag() && !required.empty() ? required[in.below(required.size())]
                                                          : coords(in, rank, grid_));
      }
    }
    at_ += before - in.left();
    if (at_ >= script_.size()) at_ = 0;
    return p;
  }

 private:
  std::string script_;
  std::vector<int64_t> grid_;
  size_t at_ = 0;
};

int64_t colex(const std::vector<int64_t>& c, const std::vector<int64_t>& ext) {
  int64_t o = 0, scale = 1;
  for (size_t k = 0; k < ext.size(); ++k) o += c[k] * scale, scale *= ext[k];
  return o;
}

void check_geometry(const TileGeometry& g, Input& in) {
  const size_t rank = g.rank();
  if (g.tile_count() > 512 || g.size() > (1 << 14)) return;
  std::vector<int> covered(g.size(), 0);
  for (int64_t i = 0; i < g.tile_count(); ++i) {
    const TileCoord c = g.tile_coord(i);
    FUZZ_CHECK(g.tile_index(c) == i, "tile ", i);
    int64_t within = 0;
    for (const Run r : g.footprint_runs(i)) {
      FUZZ_CHECK(r.ordinal == within && r.offset >= 0 && r.offset + r.length <= g.size(), "run of tile ", i);
      for (int64_t k = 0; k < r.length; ++k) {
        covered[r.offset + k]++;
        FUZZ_CHECK(g.locate(r.offset + k) == std::make_pair(i, within + k), "locate ", r.offset + k);
        FUZZ_CHECK(g.slot(i, within + k) == r.offset + k, "slot ", i);
      }
      within += r.length;
    }
    FUZZ_CHECK(within == g.tile_size(), "tile ", i, " covers ", within);
  }
  FUZZ_CHECK(std::all_of(covered.begin(), covered.end(), [](int n) { return n == 1; }), "footprints overlap");
  for (int t = 0; t < 4; ++t) {
    const TileCoord c = coords(in, in.byte() < 240 ? rank : in.below(4), g.grid_shape());
    int64_t i = -1;
    if (fuzz::attempt("tile_index", {ErrorKind::Value}, [&] { i = g.tile_index(c); }))
      FUZZ_CHECK(i >= 0 && i < g.tile_count() && g.tile_coord(i) == c, "tile_index ", tile_tuple_str(c));
  }
}

void check_tile_set(Input& in, const std::vector<int64_t>& grid) {
  std::vector<TileCoord> tiles(in.below(8));
  const size_t rank = grid.size();
  for (auto& t : tiles) t = coords(in, in.byte() < 245 ? rank : in.below(4), grid);
  const auto input = tiles;
  if (!fuzz::attempt("canonicalize_tiles", {ErrorKind::Value}, [&] { canonicalize_tiles(tiles); })) return;
  FUZZ_CHECK(std::is_permutation(tiles.begin(), tiles.end(), input.begin(), input.end()), "not a permutation");
  for (size_t k = 1; k < tiles.size(); ++k) {
    FUZZ_CHECK(tile_order_less(tiles[k - 1], tiles[k]) && !tile_order_less(tiles[k], tiles[k - 1]), "order at ", k);
    FUZZ_CHECK(tiles[k].size() == tiles[0].size(), "ranks");
  }
  for (const auto& t : tiles) FUZZ_CHECK(std::all_of(t.begin(), t.end(), [](int64_t v) { return v >= 0; }), "neg");
  // Within the grid, canonical order is tile-index order.
  int64_t cells = 1;  // colex() below must not overflow: only grids of at most 2**40 tiles
  for (int64_t g : grid) cells = g > 0 && cells <= (int64_t{1} << 40) / g ? cells * g : int64_t{1} << 41;
  bool inside = !tiles.empty() && tiles[0].size() == rank && cells <= (int64_t{1} << 40);
  for (const auto& t : tiles)
    for (size_t k = 0; inside && k < rank; ++k) inside = t[k] < grid[k];
  if (inside)
    for (size_t k = 1; k < tiles.size(); ++k) FUZZ_CHECK(colex(tiles[k - 1], grid) < colex(tiles[k], grid), "index");
}

TileAxes axes(Input& in, const std::vector<int64_t>& grid) {
  TileAxes per_axis(in.byte() < 240 ? grid.size() : in.below(4));
  for (size_t a = 0; a < per_axis.size(); ++a) {
    per_axis[a].resize(in.below(4) + (in.byte() < 250));
    for (auto& v : per_axis[a])
      v = a < grid.size() && in.byte() < 235 ? static_cast<int64_t>(in.below(grid[a])) : in.extent(6);
  }
  return per_axis;
}

void check_selection(const TileGeometry& g, const TileAxes& per_axis) {
  const bool axes_ok = fuzz::attempt("check_selection_axes", {ErrorKind::Value}, [&] { check_selection_axes(per_axis); });
  std::vector<int64_t> bound;
  const bool bound_ok = fuzz::attempt("select", {ErrorKind::Value}, [&] { bound = g.select(per_axis); });
  if (!axes_ok) return;
  int64_t count = 1;
  for (const auto& a : per_axis) count *= static_cast<int64_t>(a.size());
  const auto compact = selection_tiles(per_axis, false), canonical = selection_tiles(per_axis, true);
  FUZZ_CHECK(static_cast<int64_t>(compact.size()) == count && static_cast<int64_t>(canonical.size()) == count, count);
  FUZZ_CHECK(std::is_permutation(compact.begin(), compact.end(), canonical.begin()), "selection_tiles");
  FUZZ_CHECK(std::is_sorted(canonical.begin(), canonical.end(), tile_order_less), "canonical order");
  if (!bound_ok) return;
  FUZZ_CHECK(static_cast<int64_t>(bound.size()) == count, "bound ", bound.size());
  for (int64_t k = 0; k < count; ++k) FUZZ_CHECK(g.tile_index(compact[k]) == bound[k], "bound tile ", k);
  const auto cs = g.compact_shape(per_axis);
  for (size_t a = 0; a < cs.size(); ++a)
    FUZZ_CHECK(cs[a] == static_cast<int64_t>(per_axis[a].size()) * g.tile_shape()[a], "compact shape");
}

// Projections and residency requests on a real carrier whose secondary holds slot numbers; a scripted policy.
void run_carrier(const TileGeometry& g, const TileAxes& per_axis, Input& in) {
  if (g.tile_count() > 64 || g.size() > 4096) return;
  auto primary = std::make_shared<CPUCarrier>(0, DType::Float32(), true, false);
  auto secondary = std::make_shared<CPUCarrier>(g.size(), DType::Float32(), true, false);
  for (int64_t s = 0; s < g.size(); ++s) secondary->write_value(s, Value::from_float(static_cast<double>(s)));
  auto policy = in.flag() ? std::make_shared<ScriptedPolicy>(in.bytes(in.below(24)), g.grid_shape()) : nullptr;
  auto te = std::make_shared<TiledEvictable>(primary, secondary, g.grid_shape(), g.tile_shape(), policy);
  const TensorPtr full = make_tensor(te, 0, column_major(Shape::flat(te->logical_shape())));
  const std::initializer_list<ErrorKind> refusals = {ErrorKind::Value, ErrorKind::Runtime, ErrorKind::Type};
  for (int step = 0; step < 3 && !in.empty(); ++step) {
    switch (in.below(3)) {
      case 0: {
        TensorPtr compact;
        if (!fuzz::attempt("project", refusals, [&] {
              auto done = project(te, full, TileSelection{per_axis}, nullptr);
              done->wait();
              compact = done->value();
            }))
          break;
        const auto cs = g.compact_shape(per_axis);
        FUZZ_CHECK(compact->layout.shape().extents() == cs, "compact shape ", compact->layout.str());
        std::vector<int64_t> c(cs.size());
        for (int64_t o = 0; o < compact->size(); ++o) {
          int64_t rest = o;
          std::vector<int64_t> logical(cs.size());
          for (size_t a = 0; a < cs.size(); ++a) {
            c[a] = rest % cs[a];
            rest /= cs[a];
            const int64_t t = g.tile_shape()[a];
            logical[a] = per_axis[a][c[a] / t] * t + c[a] % t;
          }
          const double got = compact->carrier->read_value(compact->offset + compact->layout.index(o)).f;
          FUZZ_CHECK(got == static_cast<double>(colex(logical, te->logical_shape())), "projected value at ", o);
        }
        break;
      }
      case 1:
      case 2: {
        std::vector<int64_t> idx(in.below(4));
        // Tile indices already bound to the grid, as tiled_evictable.hpp requires of these calls (they do not
        // check ranges; the bindings and bind_selection do).
        for (auto& i : idx) i = static_cast<int64_t>(in.below(g.tile_count()));
        const bool promote = in.flag();
        if (fuzz::attempt(promote ? "promote" : "evict", refusals, [&] {
              auto done = promote ? te->promote_async(idx) : te->evict_async(idx);
              done->wait();
              done->value();
            })) {
          for (int64_t i : idx) {
            const TileLocation loc = te->tile_state(te->tile_coord(i)).location;
            FUZZ_CHECK(loc == (promote ? TileLocation::Primary : TileLocation::Secondary), "tile ", i, " is ",
                       location_name(loc));
          }
        }
      }
    }
    // A policy's planned promotions (a prefetch) run on after a projection whose own tiles were resident: the
    // work does not wait for them. Each must still end, and soon.
    if (policy) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
      while (te->has_incomplete_work() && std::chrono::steady_clock::now() < until) std::this_thread::yield();
    }
    FUZZ_CHECK(!te->has_incomplete_work(), "work left running");
  }
  // Residency never changes values.
  for (int64_t s = 0; s < g.size(); ++s) FUZZ_CHECK(te->read_value(s).f == static_cast<double>(s), "slot ", s);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  Input in(data, size);
  const size_t rank = in.byte() < 250 ? in.below(3) + 1 : in.below(5);
  const auto grid = shape(in, rank, 4), tile = shape(in, in.byte() < 245 ? rank : in.below(4), 4);
  check_tile_set(in, grid);
  TileGeometry g;
  if (!fuzz::attempt("TileGeometry", {ErrorKind::Value}, [&] { g = TileGeometry(grid, tile); })) return 0;
  check_geometry(g, in);
  const TileAxes per_axis = axes(in, grid);
  check_selection(g, per_axis);
  run_carrier(g, per_axis, in);
  return 0;
}
