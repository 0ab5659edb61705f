// TiledEvictable core (strideweave/tiled/tiled_evictable.hpp; spec
// tiled-carrier-composition.md): geometry and tile footprints against naive
// models over random grids, construction and tier seeding, residency
// semantics (idempotence, dirty/clean eviction, pins, conflicts, release),
// failure atomicity under injected I/O faults, and a multi-threaded stress
// test whose tile table and values are checked against a sequential model
// after every round (TensorStore's TestConcurrent + AssertInvariants idea).
//
// Pending requests are held deterministically by occupying every thread of
// the I/O executor with a gated blocker (IoBlock), never with sleeps.
// The random seed is printed; set SW_TEST_SEED=<n> to replay a run.
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <future>
#include <map>
#include <set>
#include <thread>

#include "strideweave/carriers/native.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/io.hpp"
#include "strideweave/tiled/data.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using Tiled = std::shared_ptr<TiledEvictable>;
using Done = CompletionPtr<std::monostate>;

const DType& F32() { return DType::Float32(); }
const DType& I32() { return DType::Int32(); }

bool contains(const std::string& s, const char* fragment) { return s.find(fragment) != std::string::npos; }

// ---------------------------------------------------------------- naive geometry

std::vector<int64_t> colex_decode(int64_t ordinal, const std::vector<int64_t>& extents) {
  std::vector<int64_t> c(extents.size());
  for (size_t k = 0; k < extents.size(); ++k) {
    c[k] = ordinal % extents[k];
    ordinal /= extents[k];
  }
  return c;
}

int64_t colex_encode(const std::vector<int64_t>& c, const std::vector<int64_t>& extents) {
  int64_t o = 0, scale = 1;
  for (size_t k = 0; k < extents.size(); ++k) {
    o += c[k] * scale;
    scale *= extents[k];
  }
  return o;
}

int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

std::string str(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + ")";
}

// ---------------------------------------------------------------- carriers

struct TierSpec {
  bool primary_full = false;
  bool secondary_full = true;
  int64_t primary_salt = 1000;   // value_for(dtype, slot + salt) seeds a full tier
  int64_t secondary_salt = 0;
  const DType* dtype = &DType::Float32();
};

// CPU primary, FileBacked (anonymous) secondary.
Tiled make_tiled(const std::vector<int64_t>& grid, const std::vector<int64_t>& tile, TierSpec spec = {},
                 std::shared_ptr<ResidencyPolicy> policy = nullptr) {
  const int64_t total = product(grid) * product(tile);
  auto primary = std::make_shared<CPUCarrier>(spec.primary_full ? total : 0, *spec.dtype, true, false);
  if (spec.primary_full) fill_slots(*primary, spec.primary_salt);
  auto secondary = std::make_shared<FileBackedCarrier>("", *spec.dtype, true);
  if (spec.secondary_full) {
    secondary->grow(total, true);
    fill_slots(*secondary, spec.secondary_salt);
  }
  return std::make_shared<TiledEvictable>(primary, secondary, grid, tile, std::move(policy));
}

// Cheap geometry-only carrier: two empty CPU tiers (every tile invalid).
Tiled make_geometry(const std::vector<int64_t>& grid, const std::vector<int64_t>& tile) {
  return std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, F32(), true, false),
                                          std::make_shared<CPUCarrier>(0, F32(), true, false), grid, tile, nullptr);
}

std::vector<int64_t> all_tiles(const TiledEvictable& te) {
  std::vector<int64_t> v(static_cast<size_t>(te.tile_count()));
  for (int64_t i = 0; i < te.tile_count(); ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

TileState state(const TiledEvictable& te, int64_t index) { return te.tile_state(te.tile_coord(index)); }

std::vector<TileState> states(const TiledEvictable& te) {
  std::vector<TileState> out;
  for (int64_t i = 0; i < te.tile_count(); ++i) out.push_back(state(te, i));
  return out;
}

bool same(const TileState& a, const TileState& b) {
  return a.location == b.location && a.valid == b.valid && a.dirty == b.dirty;
}

std::string describe(const std::vector<TileState>& s) {
  std::string out;
  for (const auto& t : s) out += std::string(location_name(t.location)) + (t.dirty ? "*" : "") + " ";
  return out;
}

void expect_states(const TiledEvictable& te, const std::vector<TileState>& expected) {
  auto got = states(te);
  ASSERT_EQ(got.size(), expected.size());
  bool ok = true;
  for (size_t i = 0; i < got.size(); ++i) ok = ok && same(got[i], expected[i]);
  EXPECT_TRUE(ok) << "states " << describe(got) << "\nexpected " << describe(expected);
}

void expect_stats_eq(const TiledStats& a, const TiledStats& b) {
  EXPECT_EQ(a.promotions, b.promotions);
  EXPECT_EQ(a.evictions, b.evictions);
  EXPECT_EQ(a.bytes_promoted, b.bytes_promoted);
  EXPECT_EQ(a.bytes_evicted, b.bytes_evicted);
  EXPECT_EQ(a.writes_skipped, b.writes_skipped);
  EXPECT_EQ(a.primary_tiles, b.primary_tiles);
  EXPECT_EQ(a.primary_bytes, b.primary_bytes);
}

int64_t tile_bytes(const TiledEvictable& te) { return te.tile_size() * static_cast<int64_t>(slot_bytes(te.dtype())); }

// Value of every slot without changing residency: primary/implicit tiles through the
// tile table, secondary tiles straight from the secondary tier's file.
std::vector<Value> peek_all(const TiledEvictable& te) {
  std::vector<Value> out;
  const size_t w = slot_bytes(te.dtype());
  std::vector<std::byte> buf(w);
  for (int64_t s = 0; s < te.size(); ++s) {
    auto [tile, within] = te.locate(s);
    if (state(te, tile).location == TileLocation::Secondary) {
      te.secondary()->read_slots(s, 1, buf.data());
      out.push_back(load_value(te.dtype(), buf.data()));
    } else {
      out.push_back(te.read_value(s));
    }
  }
  return out;
}

std::vector<Value> secondary_values(const TiledEvictable& te) { return bulk_snapshot(*te.secondary()); }

std::vector<Value> seeded(const DType& d, int64_t n, int64_t salt) {
  std::vector<Value> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(value_for(d, i + salt));
  return v;
}

void write_one(TiledEvictable& te, int64_t slot, float v) { te.write_slots(slot, 1, &v); }

Done ready_of(const std::shared_ptr<TiledEvictable::Work>& w) { return TiledEvictable::work_ready(w); }

std::vector<int64_t> sorted_unique(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// Blocks every thread of the I/O executor behind a gate, so tiled transfers queue and
// their requests stay pending until open() (deterministic, no sleeps).
class IoBlock {
 public:
  explicit IoBlock(Executor& ex = Executor::io()) : ex_(ex) {
    const size_t n = ex.max_threads();
    for (size_t i = 0; i < n; ++i)
      ex.submit([s = state_] {
        {
          std::lock_guard lock(s->m);
          s->started++;
        }
        s->cv.notify_all();
        s->gate->wait();
      });
    std::unique_lock lock(state_->m);
    if (!state_->cv.wait_for(lock, std::chrono::seconds(30), [&] { return state_->started == n; }))
      ADD_FAILURE() << "the I/O executor did not start " << n << " blockers";
  }
  ~IoBlock() {
    open();
    EXPECT_TRUE(ex_.wait_idle(std::chrono::seconds(60)));
  }
  void open() {
    if (!opened_) state_->gate->set_value(true);
    opened_ = true;
  }

 private:
  struct State {
    std::mutex m;
    std::condition_variable cv;
    size_t started = 0;
    CompletionPtr<bool> gate = std::make_shared<Completion<bool>>();
  };
  Executor& ex_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
  bool opened_ = false;
};

class TiledTest : public ::testing::Test {
 protected:
  void SetUp() override {
    io::clear_faults();
    (void)test_seed();
  }
  void TearDown() override { io::clear_faults(); }
};

// ================================================================ geometry

TEST_F(TiledTest, GeometryMatchesNaiveModelOnRandomGrids) {
  Rng rng(test_seed() ^ 0x6e0);
  for (int iter = 0; iter < 40; ++iter) {
    const int64_t rank = rng.uniform(1, 3);
    std::vector<int64_t> grid, tile, logical;
    for (int64_t k = 0; k < rank; ++k) {
      grid.push_back(rng.uniform(1, 4));
      tile.push_back(rng.uniform(1, 4));
      logical.push_back(grid.back() * tile.back());
    }
    SCOPED_TRACE("grid " + str(grid) + " tile " + str(tile));
    Tiled te = make_geometry(grid, tile);
    ASSERT_EQ(te->grid_shape(), grid);
    ASSERT_EQ(te->tile_shape(), tile);
    ASSERT_EQ(te->logical_shape(), logical);
    ASSERT_EQ(te->tile_count(), product(grid));
    ASSERT_EQ(te->tile_size(), product(tile));
    ASSERT_EQ(te->size(), product(logical));
    ASSERT_EQ(te->rank(), static_cast<size_t>(rank));

    for (int64_t i = 0; i < te->tile_count(); ++i) {
      ASSERT_EQ(te->tile_coord(i), colex_decode(i, grid)) << "tile " << i;
      ASSERT_EQ(te->tile_index(colex_decode(i, grid)), i);
    }
    // locate() against the naive decomposition of every slot.
    for (int64_t s = 0; s < te->size(); ++s) {
      auto c = colex_decode(s, logical);
      std::vector<int64_t> tc(c.size()), wc(c.size());
      for (size_t k = 0; k < c.size(); ++k) {
        tc[k] = c[k] / tile[k];
        wc[k] = c[k] % tile[k];
      }
      auto [t, w] = te->locate(s);
      ASSERT_EQ(t, colex_encode(tc, grid)) << "slot " << s;
      ASSERT_EQ(w, colex_encode(wc, tile)) << "slot " << s;
    }
    // footprint_runs cover exactly each tile's slots, with locate()'s within-tile ordinals.
    std::vector<int> covered(static_cast<size_t>(te->size()), 0);
    for (int64_t i = 0; i < te->tile_count(); ++i) {
      std::set<int64_t> ordinals;
      int64_t length = 0;
      for (const sw::Run& r : te->footprint_runs(i)) {
        ASSERT_GE(r.length, 1);
        length += r.length;
        for (int64_t j = 0; j < r.length; ++j) {
          const int64_t slot = r.offset + j;
          ASSERT_GE(slot, 0);
          ASSERT_LT(slot, te->size());
          covered[static_cast<size_t>(slot)]++;
          auto [t, w] = te->locate(slot);
          ASSERT_EQ(t, i) << "slot " << slot << " in the runs of tile " << i;
          ASSERT_EQ(w, r.ordinal + j) << "slot " << slot;
          ordinals.insert(r.ordinal + j);
        }
      }
      ASSERT_EQ(length, te->tile_size());
      ASSERT_EQ(static_cast<int64_t>(ordinals.size()), te->tile_size());
      ASSERT_EQ(*ordinals.begin(), 0);
      ASSERT_EQ(*ordinals.rbegin(), te->tile_size() - 1);
    }
    for (int64_t s = 0; s < te->size(); ++s) ASSERT_EQ(covered[static_cast<size_t>(s)], 1) << "slot " << s;

    // tile_index refuses wrong ranks and out-of-range coordinates.
    const size_t k = static_cast<size_t>(rng.uniform(0, rank - 1));
    const std::vector<int64_t> zero(grid.size(), 0);
    std::vector<int64_t> bad = zero;
    bad[k] = grid[k];  // one past the end on axis k
    EXPECT_SW_THROW(ValueError, "out of range", te->tile_index(bad));
    bad[k] = -1;
    EXPECT_SW_THROW(ValueError, "out of range", te->tile_index(bad));
    std::vector<int64_t> longer = zero;
    longer.push_back(0);
    EXPECT_SW_THROW(ValueError, "rank", te->tile_index(longer));
    EXPECT_SW_THROW(ValueError, "rank", te->tile_index({}));
  }
}

// ---------------------------------------------------------------- footprints

// The spec's compatibility rule, evaluated naively: every logical tile maps injectively onto
// exactly its own carrier tile's footprint.
bool naive_compatible(const TiledEvictable& te, const Layout& layout, int64_t offset) {
  const auto extents = layout.shape().extents();
  if (extents != te.logical_shape()) return false;
  std::vector<char> seen(static_cast<size_t>(te.size()), 0);
  for (int64_t o = 0; o < layout.size(); ++o) {
    auto c = colex_decode(o, extents);  // top-level mode ordinals
    std::vector<int64_t> tc(c.size());
    for (size_t k = 0; k < c.size(); ++k) tc[k] = c[k] / te.tile_shape()[k];
    const int64_t slot = offset + layout.index(o);
    if (slot < 0 || slot >= te.size()) return false;
    if (te.locate(slot).first != colex_encode(tc, te.grid_shape())) return false;
    if (seen[static_cast<size_t>(slot)]++) return false;
  }
  return true;  // size == extent and no repeat: every footprint is covered exactly
}

Layout layout_of(std::vector<IntTuple> shape_modes, std::vector<IntTuple> stride_modes) {
  return Layout(Shape(IntTuple::tuple(std::move(shape_modes))), Stride(IntTuple::tuple(std::move(stride_modes))));
}

// Random candidate layouts over the full logical shape: canonical, row-major, or mode k as
// ((p_k, q_k), g_k), where within-tile coordinate i + p*j reaches within-tile slot i*q + j (a
// transpose inside the tile when p, q > 1) and tile coordinate b reaches tile b; variants perturb
// one leaf stride, transpose the tile coordinates (a remapping) or swap two axes' within-tile
// strides. The naive rule, not the generator, decides which are compatible.
struct Candidate {
  Layout layout;
  std::string what;
};

Candidate random_candidate(const TiledEvictable& te, Rng& rng) {
  const auto& grid = te.grid_shape();
  const auto& tile = te.tile_shape();
  const auto& logical = te.logical_shape();
  const size_t rank = grid.size();
  std::vector<int64_t> S(rank);
  for (size_t k = 0, run = 1; k < rank; run *= static_cast<size_t>(logical[k]), ++k) S[k] = static_cast<int64_t>(run);
  const int64_t kind = rng.uniform(0, 5);
  if (kind == 0) return {column_major(Shape::flat(logical)), "canonical"};
  if (kind == 1) return {row_major(Shape::flat(logical)), "row-major"};
  // Factorised within-tile permutation, possibly perturbed.
  std::vector<IntTuple> shape, stride;
  std::vector<int64_t> leaves_stride;
  std::string what = "within-tile permutation";
  for (size_t k = 0; k < rank; ++k) {
    std::vector<int64_t> divisors;
    for (int64_t d = 1; d <= tile[k]; ++d)
      if (tile[k] % d == 0) divisors.push_back(d);
    const int64_t p = divisors[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(divisors.size()) - 1))];
    const int64_t q = tile[k] / p;
    int64_t sp = q * S[k], sq = S[k], sg = tile[k] * S[k];
    if (kind == 3 && rng.uniform(0, 1) == 0) {  // perturb one leaf stride of this mode
      const int64_t pick = rng.uniform(0, 2);
      const int64_t choices[] = {0, S[k], sq * p, sg, S[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(rank) - 1))]};
      const int64_t v = choices[rng.uniform(0, 4)];
      (pick == 0 ? sp : pick == 1 ? sq : sg) = v;
      what = "perturbed";
    }
    shape.push_back(IntTuple::tuple({IntTuple::tuple({p, q}), grid[k]}));
    if (kind == 4 && grid[k] % 2 == 0 && grid[k] > 2) {  // transpose the tile coordinates: a remapping
      shape.back() = IntTuple::tuple({IntTuple::tuple({p, q}), IntTuple::tuple({2, grid[k] / 2})});
      stride.push_back(IntTuple::tuple({IntTuple::tuple({sp, sq}), IntTuple::tuple({sg * (grid[k] / 2), sg})}));
      what = "tile remap";
    } else {
      stride.push_back(IntTuple::tuple({IntTuple::tuple({sp, sq}), sg}));
    }
  }
  if (kind == 5 && rank >= 2) {  // swap the within-tile strides of two axes with equal tile extents
    for (size_t a = 0; a < rank; ++a)
      for (size_t b = a + 1; b < rank; ++b)
        if (tile[a] == tile[b]) {
          shape[a] = IntTuple::tuple({tile[a], grid[a]});
          shape[b] = IntTuple::tuple({tile[b], grid[b]});
          stride[a] = IntTuple::tuple({S[b], tile[a] * S[a]});
          stride[b] = IntTuple::tuple({S[a], tile[b] * S[b]});
          what = "within-tile axis swap";
          return {layout_of(shape, stride), what};
        }
  }
  return {layout_of(shape, stride), what};
}

TEST_F(TiledTest, CheckFootprintsAgreesWithNaiveRuleOnRandomLayouts) {
  Rng rng(test_seed() ^ 0xf00f);
  int accepted = 0, refused = 0, permuted_accepted = 0;
  for (int iter = 0; iter < 30; ++iter) {
    const int64_t rank = rng.uniform(1, 3);
    std::vector<int64_t> grid, tile;
    for (int64_t k = 0; k < rank; ++k) {
      grid.push_back(rng.uniform(1, 4));
      tile.push_back(rng.uniform(1, 4));
    }
    Tiled te = make_geometry(grid, tile);
    for (int c = 0; c < 12; ++c) {
      Candidate cand = random_candidate(*te, rng);
      if (cand.layout.cosize() > te->size()) continue;  // the Tensor itself would be refused
      SCOPED_TRACE("grid " + str(grid) + " tile " + str(tile) + " " + cand.what + " " + cand.layout.str());
      TensorPtr t = make_tensor(te, 0, cand.layout);
      const bool expect = naive_compatible(*te, cand.layout, 0);
      if (cand.what == "canonical" || cand.what == "within-tile permutation" || cand.what == "within-tile axis swap")
        ASSERT_TRUE(expect) << "test generator: this layout should be compatible";
      if (expect) {
        EXPECT_NO_THROW(te->check_footprints(*t));
        EXPECT_NO_THROW(te->check_footprints(*t));  // the cached verdict
        ++accepted;
        if (!cand.layout.is_column_major()) ++permuted_accepted;
      } else {
        EXPECT_SW_THROW(ValueError, "tile footprints", te->check_footprints(*t));
        ++refused;
      }
    }
  }
  std::cout << "[ INFO     ] footprints: " << accepted << " accepted (" << permuted_accepted
            << " non-canonical), " << refused << " refused" << std::endl;
  EXPECT_GT(permuted_accepted, 0);
  EXPECT_GT(refused, 0);
}

TEST_F(TiledTest, CheckFootprintsNamedCases) {
  // Rank 1: grid 4, tile 4 (slots 0..15, tile b = slots 4b..4b+3).
  Tiled te = make_geometry({4}, {4});
  auto check = [&](const Layout& l) { te->check_footprints(*make_tensor(te, 0, l)); };
  EXPECT_NO_THROW(check(column_major(Shape::flat({16}))));
  // Nested canonical: ((4, 4)) column-major.
  EXPECT_NO_THROW(check(layout_of({IntTuple::tuple({4, 4})}, {IntTuple::tuple({1, 4})})));
  // Within-tile permutation: i + 2j -> 2i + j.
  EXPECT_NO_THROW(check(layout_of({IntTuple::tuple({IntTuple::tuple({2, 2}), 4})},
                                  {IntTuple::tuple({IntTuple::tuple({2, 1}), 4})})));
  // Spanning: ((2, 8)) : ((8, 1)) puts ordinals 0 and 1 in slots 0 and 8 (tiles 0 and 2).
  EXPECT_SW_THROW(ValueError, "tile footprints", check(layout_of({IntTuple::tuple({2, 8})}, {IntTuple::tuple({8, 1})})));
  // Remapping: tile coordinate x + 2y reaches tile 2x + y (logical tile 1 -> carrier tile 2).
  EXPECT_SW_THROW(ValueError, "tile footprints",
                  check(layout_of({IntTuple::tuple({4, IntTuple::tuple({2, 2})})},
                                  {IntTuple::tuple({1, IntTuple::tuple({8, 4})})})));
  // Aliasing and omission inside each tile: within i + 2j -> slot i (slots 2, 3 never reached).
  EXPECT_SW_THROW(ValueError, "alias",
                  check(layout_of({IntTuple::tuple({IntTuple::tuple({2, 2}), 4})},
                                  {IntTuple::tuple({IntTuple::tuple({1, 0}), 4})})));
  // Every tile onto tile 0 (stride 0 across tiles).
  EXPECT_SW_THROW(ValueError, "tile footprints", check(layout_of({IntTuple::tuple({4, 4})}, {IntTuple::tuple({1, 0})})));

  // Rank 2: grid (2, 2), tile (2, 2); logical (4, 4).
  Tiled t2 = make_geometry({2, 2}, {2, 2});
  auto check2 = [&](const Layout& l) { t2->check_footprints(*make_tensor(t2, 0, l)); };
  EXPECT_NO_THROW(check2(column_major(Shape::flat({4, 4}))));
  // Within-tile transpose (axis swap inside each tile).
  EXPECT_NO_THROW(check2(layout_of({IntTuple::tuple({2, 2}), IntTuple::tuple({2, 2})},
                                   {IntTuple::tuple({4, 2}), IntTuple::tuple({1, 8})})));
  // Row-major spans tiles.
  EXPECT_SW_THROW(ValueError, "tile footprints", check2(row_major(Shape::flat({4, 4}))));
  // Tile transpose: logical tile (b0, b1) reaches carrier tile (b1, b0), a remapping.
  EXPECT_SW_THROW(ValueError, "tile footprints",
                  check2(layout_of({IntTuple::tuple({2, 2}), IntTuple::tuple({2, 2})},
                                   {IntTuple::tuple({1, 8}), IntTuple::tuple({4, 2})})));

  // Wrong shapes: flat, transposed extents, wrong rank.
  Tiled t3 = make_geometry({2, 3}, {2, 1});  // logical (4, 3)
  EXPECT_SW_THROW(ValueError, "tile footprints", t3->check_footprints(*make_tensor(t3, 0, column_major(Shape::flat({12})))));
  EXPECT_SW_THROW(ValueError, "tile footprints", t3->check_footprints(*make_tensor(t3, 0, column_major(Shape::flat({3, 4})))));
  EXPECT_SW_THROW(ValueError, "tile footprints",
                  t3->check_footprints(*make_tensor(t3, 0, column_major(Shape::flat({4, 3, 1})))));
  EXPECT_NO_THROW(t3->check_footprints(*make_tensor(t3, 0, column_major(Shape::flat({4, 3})))));
  // A tensor on another carrier.
  EXPECT_SW_THROW(TypeError, "not backed by this", t3->check_footprints(*make_tensor(t2, 0, column_major(Shape::flat({4, 4})))));
  // Refusal changes nothing.
  EXPECT_EQ(t2->version(), 0u);
  EXPECT_FALSE(t2->has_incomplete_work());
}

// ================================================================ construction

TEST_F(TiledTest, ConstructionValidatesAndRollsBackClaims) {
  auto cpu = [](int64_t n, const DType& d = DType::Float32()) { return std::make_shared<CPUCarrier>(n, d, true, false); };
  auto file = [](int64_t n, const DType& d = DType::Float32()) {
    auto f = std::make_shared<FileBackedCarrier>("", d, true);
    f->grow(n, true);
    return f;
  };
  const std::vector<int64_t> grid{2, 2}, tile{2, 1};  // 8 slots
  auto expect_untouched = [](const CarrierPtr& c) {
    EXPECT_FALSE(c->is_owned());
    EXPECT_EQ(c->claim_count(), 0);
    EXPECT_FALSE(c->is_released());
  };
  auto build = [&](CarrierPtr p, CarrierPtr s, std::vector<int64_t> g, std::vector<int64_t> t) {
    return std::make_shared<TiledEvictable>(std::move(p), std::move(s), std::move(g), std::move(t), nullptr);
  };

  {  // missing tiers
    auto s = file(8);
    EXPECT_SW_THROW(TypeError, "Carrier", build(nullptr, s, grid, tile));
    EXPECT_SW_THROW(TypeError, "Carrier", build(cpu(0), nullptr, grid, tile));
    expect_untouched(s);
  }
  {  // dependent tiers: Evictable and TiledEvictable
    auto ev = std::make_shared<EvictableCarrier>(cpu(8), std::make_shared<FileBackedCarrier>("", F32(), true));
    auto s = file(8);
    EXPECT_SW_THROW(TypeError, "dependent", build(ev, s, grid, tile));
    expect_untouched(s);
    Tiled inner = make_geometry(grid, tile);
    auto p = cpu(0);
    EXPECT_SW_THROW(TypeError, "dependent", build(p, inner, grid, tile));
    expect_untouched(p);
    EXPECT_FALSE(inner->is_owned());
  }
  {  // the same carrier twice
    auto c = cpu(8);
    EXPECT_SW_THROW(ValueError, "distinct", build(c, c, grid, tile));
    expect_untouched(c);
  }
  {  // released tier
    auto p = cpu(0);
    auto s = cpu(8);
    s->release();
    EXPECT_SW_THROW(RuntimeError, "released", build(p, s, grid, tile));
    expect_untouched(p);
  }
  {  // owned tier: already a tier of a live TiledEvictable
    Tiled first = make_tiled(grid, tile);
    auto p = cpu(0);
    EXPECT_SW_THROW(RuntimeError, "owned", build(p, first->secondary(), grid, tile));
    expect_untouched(p);
    EXPECT_EQ(first->secondary()->claim_count(), 1);
  }
  {  // dtype mismatch
    auto p = cpu(0, I32());
    auto s = file(8);
    EXPECT_SW_THROW(TypeError, "dtype", build(p, s, grid, tile));
    expect_untouched(p);
    expect_untouched(s);
  }
  {  // grid/tile ranks and extents
    auto p = cpu(0);
    auto s = file(8);
    EXPECT_SW_THROW(ValueError, "rank", build(p, s, {}, {}));
    EXPECT_SW_THROW(ValueError, "rank", build(p, s, {2, 2}, {2}));
    EXPECT_SW_THROW(ValueError, ">= 1", build(p, s, {2, 0}, {2, 1}));
    EXPECT_SW_THROW(ValueError, ">= 1", build(p, s, {2, 2}, {-2, 1}));
    expect_untouched(p);
    expect_untouched(s);
  }
  {  // tile table limits (Note [Tile table limits]): refused before anything is allocated or claimed
    auto p = cpu(0);
    auto s = file(0);
    EXPECT_SW_THROW(ValueError, "2**62", build(p, s, {int64_t{1} << 32, int64_t{1} << 32}, {1, 1}));
    EXPECT_SW_THROW(ValueError, "has 100000000000000 tiles; at most 2**24", build(p, s, {10000000, 10000000}, {1, 1}));
    EXPECT_SW_THROW(ValueError, "has 16777217 tiles", build(p, s, {TiledEvictable::kMaxTiles + 1}, {1}));
    EXPECT_SW_THROW(ValueError, "need 2199023255552 contiguous runs; at most 2**26",
                    build(p, s, {2, 1}, {1, int64_t{1} << 40}));
    EXPECT_SW_THROW(ValueError, "need 67108866 contiguous runs", build(p, s, {2, 1}, {3, (int64_t{1} << 25) + 1}));
    expect_untouched(p);
    expect_untouched(s);
    // Runs merge along leading grid axes of extent 1: 4 tiles of 2**57 slots are 4 runs.
    Tiled big = build(p, s, {1, 4}, {int64_t{1} << 30, int64_t{1} << 27});
    EXPECT_EQ(big->tile_count(), 4);
    EXPECT_EQ(big->footprint_runs(3).size(), 1u);
  }
  {  // tier sizes: 0 or the full extent
    auto p = cpu(5);
    auto s = file(8);
    EXPECT_SW_THROW(ValueError, "primary must have 0 or 8", build(p, s, grid, tile));
    auto p0 = cpu(0);
    auto s7 = file(7);
    EXPECT_SW_THROW(ValueError, "secondary must have 0 or 8", build(p0, s7, grid, tile));
    expect_untouched(p);
    expect_untouched(s);
    expect_untouched(p0);
    expect_untouched(s7);
  }
  {  // failure after the claims were taken (seeding a full FileBacked primary hits EIO): rolled back
    auto p = file(8);
    auto s = cpu(0);
    fill_slots(*p, 5);
    io::inject(io::Op::Pread, EIO, 1, 1);  // the second tile's read fails
    EXPECT_SW_THROW(RuntimeError, "Input/output error", build(p, s, grid, tile));
    io::clear_faults();
    expect_untouched(p);
    expect_untouched(s);
    EXPECT_EQ(bulk_snapshot(*p), seeded(F32(), 8, 5));
    // The tiers are usable again.
    Tiled te = build(p, s, grid, tile);
    EXPECT_TRUE(p->is_owned());
    EXPECT_EQ(snapshot(*te), seeded(F32(), 8, 5));
  }
}

TEST_F(TiledTest, TierSeeding) {
  const std::vector<int64_t> grid{3, 2}, tile{2, 2};  // 6 tiles of 4 slots, 24 slots
  const int64_t n = 24;
  {  // full primary, empty secondary: primary tiles (dirty: no secondary copy exists)
    Tiled te = make_tiled(grid, tile, {.primary_full = true, .secondary_full = false});
    for (const auto& s : states(*te)) {
      EXPECT_EQ(s.location, TileLocation::Primary);
      EXPECT_TRUE(s.valid);
      EXPECT_TRUE(s.dirty);
    }
    EXPECT_EQ(te->stats().primary_tiles, 6);
    EXPECT_EQ(te->stats().primary_bytes, 6 * tile_bytes(*te));
    EXPECT_EQ(snapshot(*te), seeded(F32(), n, 1000));
    EXPECT_EQ(te->secondary()->size(), 0);
    te->evict_async(all_tiles(*te))->value();  // grows the secondary and writes every tile
    EXPECT_EQ(te->secondary()->size(), n);
    EXPECT_EQ(secondary_values(*te), seeded(F32(), n, 1000));
    EXPECT_EQ(te->stats().bytes_evicted, 6 * tile_bytes(*te));
    EXPECT_EQ(te->stats().writes_skipped, 0);
  }
  {  // both full: the primary seeds the tiles, and eviction preserves the primary's values
    // The secondary's prior contents are no copy of the tiles, so every tile is dirty: it is
    // written on eviction, and tile_state/dirty_tiles must say so.
    Tiled te = make_tiled(grid, tile, {.primary_full = true, .secondary_full = true});
    for (const auto& s : states(*te)) {
      EXPECT_EQ(s.location, TileLocation::Primary);
      EXPECT_TRUE(s.dirty);
    }
    EXPECT_EQ(snapshot(*te), seeded(F32(), n, 1000));
    te->evict_async(all_tiles(*te))->value();
    EXPECT_EQ(secondary_values(*te), seeded(F32(), n, 1000)) << "the stale secondary must be overwritten";
    EXPECT_EQ(te->stats().bytes_evicted, 6 * tile_bytes(*te));
    EXPECT_EQ(te->stats().writes_skipped, 0);
    EXPECT_EQ(snapshot(*te), seeded(F32(), n, 1000));
  }
  {  // empty primary, full secondary: secondary tiles, clean
    Tiled te = make_tiled(grid, tile, {.primary_full = false, .secondary_full = true});
    for (const auto& s : states(*te)) {
      EXPECT_EQ(s.location, TileLocation::Secondary);
      EXPECT_TRUE(s.valid);
      EXPECT_FALSE(s.dirty);
    }
    EXPECT_EQ(te->stats().primary_tiles, 0);
    EXPECT_EQ(peek_all(*te), seeded(F32(), n, 0));
    EXPECT_EQ(snapshot(*te), seeded(F32(), n, 0));  // read through the secondary: nothing moves
    EXPECT_EQ(te->stats().primary_tiles, 0);
  }
  {  // both empty: invalid tiles
    Tiled te = make_tiled(grid, tile, {.primary_full = false, .secondary_full = false});
    for (const auto& s : states(*te)) {
      EXPECT_EQ(s.location, TileLocation::Invalid);
      EXPECT_FALSE(s.valid);
      EXPECT_FALSE(s.dirty);
    }
    EXPECT_SW_THROW(RuntimeError, "invalid", te->get(0));
    EXPECT_SW_THROW(RuntimeError, "invalid", te->set(5, F(1.0)));
    EXPECT_SW_THROW(RuntimeError, "invalid", te->promote_async({1}));
    EXPECT_SW_THROW(RuntimeError, "invalid", te->begin_work({2}, "operation"));
    EXPECT_FALSE(te->has_incomplete_work());
    te->evict_async({0, 1})->value();  // nothing to evict
    EXPECT_EQ(state(*te, 0).location, TileLocation::Invalid);
    EXPECT_EQ(te->version(), 0u);
  }
  {  // Int32 tiers
    Tiled te = make_tiled({2}, {3}, {.primary_full = false, .secondary_full = true, .dtype = &I32()});
    EXPECT_EQ(&te->dtype(), &I32());
    EXPECT_EQ(snapshot(*te), seeded(I32(), 6, 0));
    EXPECT_TRUE(te->supports_storage_dtype(I32()));
    EXPECT_FALSE(te->supports_storage_dtype(DType::Float64()));  // FileBacked stores Float32/Int32 only
  }
}

TEST_F(TiledTest, AllocateLikeGivesImplicitZeroOrInvalidTiles) {
  Tiled proto = make_tiled({2, 2}, {2, 3});  // 4 tiles of 6 slots
  const int64_t n = proto->size();
  EXPECT_SW_THROW(ValueError, "0 or the full extent", proto->allocate_like(5, true, F32(), false));

  auto zeros = std::static_pointer_cast<TiledEvictable>(proto->allocate_like(n, true, F32(), false));
  EXPECT_EQ(zeros->grid_shape(), proto->grid_shape());
  EXPECT_EQ(zeros->tile_shape(), proto->tile_shape());
  EXPECT_EQ(&zeros->primary()->kind(), &cpu_kind());
  EXPECT_EQ(&zeros->secondary()->kind(), &file_backed_kind());
  EXPECT_NE(zeros->secondary(), proto->secondary());
  for (const auto& s : states(*zeros)) {
    EXPECT_EQ(s.location, TileLocation::Implicit);
    EXPECT_TRUE(s.valid);
    EXPECT_FALSE(s.dirty);
  }
  EXPECT_EQ(zeros->stats().primary_tiles, 0);
  EXPECT_EQ(snapshot(*zeros), std::vector<Value>(static_cast<size_t>(n), F(0.0)));
  // Reading does not materialise; evicting an implicit tile keeps it implicit.
  EXPECT_EQ(state(*zeros, 0).location, TileLocation::Implicit);
  zeros->evict_async({0})->value();
  EXPECT_EQ(state(*zeros, 0).location, TileLocation::Implicit);
  // Promotion materialises a zero buffer (dirty: no secondary copy), without I/O.
  const auto reads = io::calls(io::Op::Pread);
  zeros->promote_async({1})->value();
  EXPECT_EQ(io::calls(io::Op::Pread), reads);
  EXPECT_EQ(state(*zeros, 1).location, TileLocation::Primary);
  EXPECT_TRUE(state(*zeros, 1).dirty);
  EXPECT_EQ(zeros->stats().promotions, 1);
  EXPECT_EQ(zeros->stats().bytes_promoted, 0);
  // A write to an implicit tile materialises it; its neighbours stay zero.
  const int64_t slot = zeros->footprint_runs(2)[0].offset;
  zeros->set(slot, F(7.5));
  EXPECT_EQ(state(*zeros, 2).location, TileLocation::Primary);
  std::vector<Value> expect(static_cast<size_t>(n), F(0.0));
  expect[static_cast<size_t>(slot)] = F(7.5);
  EXPECT_EQ(snapshot(*zeros), expect);
  zeros->evict_async(all_tiles(*zeros))->value();
  EXPECT_EQ(state(*zeros, 2).location, TileLocation::Secondary);
  EXPECT_EQ(state(*zeros, 1).location, TileLocation::Secondary);
  EXPECT_EQ(state(*zeros, 3).location, TileLocation::Implicit);
  EXPECT_EQ(snapshot(*zeros), expect);

  auto invalid = std::static_pointer_cast<TiledEvictable>(proto->allocate_like(n, true, F32(), true));
  for (const auto& s : states(*invalid)) EXPECT_EQ(s.location, TileLocation::Invalid);
  EXPECT_SW_THROW(RuntimeError, "invalid", invalid->get(3));
  auto empty0 = std::static_pointer_cast<TiledEvictable>(proto->allocate_like(0, true, F32(), true));
  EXPECT_EQ(empty0->size(), n);
}

// ================================================================ residency semantics

TEST_F(TiledTest, PromoteAndEvictAreIdempotentAndKeepTheVersion) {
  Tiled te = make_tiled({4, 2}, {2, 3});  // 8 tiles of 6 slots, secondary seeded
  const uint64_t v0 = te->version();
  const auto values = seeded(F32(), te->size(), 0);
  te->promote_async({1, 3, 3, 6})->value();  // duplicates collapse
  auto s1 = te->stats();
  EXPECT_EQ(s1.promotions, 3);
  EXPECT_EQ(s1.bytes_promoted, 3 * tile_bytes(*te));
  EXPECT_EQ(s1.primary_tiles, 3);
  for (int64_t i : {1, 3, 6}) {
    EXPECT_EQ(state(*te, i).location, TileLocation::Primary);
    EXPECT_FALSE(state(*te, i).dirty);
  }
  // Repeating is a no-op, already terminal on return.
  Done again = te->promote_async({1, 3, 6});
  EXPECT_TRUE(again->done());
  again->value();
  expect_stats_eq(te->stats(), s1);
  EXPECT_FALSE(te->has_incomplete_work());

  te->evict_async({3, 6})->value();
  auto s2 = te->stats();
  EXPECT_EQ(s2.evictions, 2);
  EXPECT_EQ(s2.writes_skipped, 2);  // clean
  EXPECT_EQ(s2.bytes_evicted, 0);
  Done e2 = te->evict_async({3, 6, 0});  // tile 0 was never promoted
  EXPECT_TRUE(e2->done());
  e2->value();
  expect_stats_eq(te->stats(), s2);
  EXPECT_EQ(te->version(), v0);
  EXPECT_EQ(peek_all(*te), values);
  EXPECT_EQ(snapshot(*te), values);
  EXPECT_EQ(te->version(), v0);
}

TEST_F(TiledTest, AUserStorageKindIsATier) {
  // A user kind (its storage through a provider) as the secondary tier: seeded from it, promoted from it,
  // evicted into it, released with the carrier.
  auto secondary = make_test_carrier(12);
  fill_slots(*secondary, 0);
  auto te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, F32(), true, false), secondary,
                                             std::vector<int64_t>{4}, std::vector<int64_t>{3}, nullptr);
  EXPECT_TRUE(secondary->is_owned());
  for (int64_t i = 0; i < 4; ++i) EXPECT_EQ(state(*te, i).location, TileLocation::Secondary);
  te->promote_async({1, 2})->value();
  EXPECT_EQ(state(*te, 1).location, TileLocation::Primary);
  EXPECT_EQ(te->get(4), value_for(F32(), 4));
  te->set(5, F(-2.0));
  te->evict_async({1, 2})->value();
  EXPECT_EQ(state(*te, 1).location, TileLocation::Secondary);
  EXPECT_EQ(secondary->get(5), F(-2.0));  // written through the provider
  EXPECT_EQ(te->stats().bytes_evicted, tile_bytes(*te));  // only the dirty tile
  te->release();
  EXPECT_TRUE(secondary->is_released());
  EXPECT_EQ(secondary->release_calls.load(), 1);
}

TEST_F(TiledTest, ReadingASlotNeverMovesATile) {
  // Note [Reading a slot never moves a tile].
  Tiled te = make_tiled({4}, {3});  // 4 tiles of 3 slots, all in the secondary
  const auto values = seeded(F32(), te->size(), 0);
  const auto s0 = te->stats();
  for (int64_t slot = 0; slot < te->size(); ++slot) EXPECT_EQ(te->get(slot), values[static_cast<size_t>(slot)]);
  for (int64_t i = 0; i < te->tile_count(); ++i) EXPECT_EQ(state(*te, i).location, TileLocation::Secondary) << i;
  expect_stats_eq(te->stats(), s0);
  EXPECT_FALSE(te->has_incomplete_work());
  // A write still promotes its tile first.
  te->set(4, F(-1.0));
  EXPECT_EQ(state(*te, 1).location, TileLocation::Primary);
  EXPECT_TRUE(state(*te, 1).dirty);
  EXPECT_EQ(te->get(4), F(-1.0));
  EXPECT_EQ(te->get(7), values[7]);  // tile 2, still in the secondary
  EXPECT_EQ(state(*te, 2).location, TileLocation::Secondary);
}

TEST_F(TiledTest, EvictionWritesDirtyTilesAndSkipsCleanOnes) {
  Tiled te = make_tiled({4}, {3});  // 4 tiles of 3 slots
  auto values = seeded(F32(), 12, 0);
  te->promote_async(all_tiles(*te))->value();
  const uint64_t v0 = te->version();
  write_one(*te, 4, 41.0f);  // tile 1, engine write: no version change
  values[4] = F(41.0);
  te->set(10, F(-2.0));  // tile 3, public write: one version step
  values[10] = F(-2.0);
  EXPECT_EQ(te->version(), v0 + 1);
  EXPECT_TRUE(state(*te, 1).dirty);
  EXPECT_TRUE(state(*te, 3).dirty);
  EXPECT_FALSE(state(*te, 0).dirty);

  const auto before = te->stats();
  const auto writes = io::calls(io::Op::Pwrite);
  te->evict_async(all_tiles(*te))->value();
  const auto after = te->stats();
  EXPECT_EQ(io::calls(io::Op::Pwrite) - writes, 2) << "one pwrite per dirty tile (one run each)";
  EXPECT_EQ(after.evictions - before.evictions, 4);
  EXPECT_EQ(after.writes_skipped - before.writes_skipped, 2);
  EXPECT_EQ(after.bytes_evicted - before.bytes_evicted, 2 * tile_bytes(*te));
  EXPECT_EQ(after.primary_tiles, 0);
  EXPECT_EQ(after.primary_bytes, 0);
  for (const auto& s : states(*te)) {
    EXPECT_EQ(s.location, TileLocation::Secondary);
    EXPECT_FALSE(s.dirty);
  }
  EXPECT_EQ(secondary_values(*te), values);
  EXPECT_EQ(te->version(), v0 + 1);
  // Round trip: promote again, nothing written when evicted clean.
  te->promote_async({1, 3})->value();
  EXPECT_EQ(snapshot(*te), values);
  const auto w2 = io::calls(io::Op::Pwrite);
  te->evict_async({1, 3})->value();
  EXPECT_EQ(io::calls(io::Op::Pwrite), w2);
  EXPECT_EQ(te->version(), v0 + 1);
}

TEST_F(TiledTest, PinnedTilesRefuseEvictionUntilEndWork) {
  Tiled te = make_tiled({3, 2}, {2, 2});
  const auto values = seeded(F32(), te->size(), 0);
  auto work = te->begin_work({0, 4, 4}, "operation");
  ASSERT_TRUE(ready_of(work));
  ready_of(work)->value();  // the pinned secondary tiles were promoted as part of this work
  EXPECT_EQ(state(*te, 0).location, TileLocation::Primary);
  EXPECT_EQ(state(*te, 4).location, TileLocation::Primary);
  EXPECT_TRUE(te->has_incomplete_work());

  EXPECT_SW_THROW(RuntimeError, "wait", te->evict_async({4}));
  EXPECT_SW_THROW(RuntimeError, "pinned", te->evict_async({1, 0}));
  EXPECT_EQ(state(*te, 0).location, TileLocation::Primary);
  // Unpinned tiles evict and write normally; pinned ones are readable but refuse writes
  // (running work needs their values unchanged).
  te->promote_async({1})->value();
  te->evict_async({1})->value();
  EXPECT_EQ(state(*te, 1).location, TileLocation::Secondary);
  EXPECT_SW_THROW(RuntimeError, "wait", te->set(0, F(3.0)));
  EXPECT_EQ(te->get(0), values[0]);
  te->set(2, F(3.0));  // tile 1 (slots 2, 3, 14, 15) is not pinned
  EXPECT_EQ(te->get(2), F(3.0));
  EXPECT_EQ(state(*te, 1).location, TileLocation::Primary);
  // Overlapping work pins twice; both must end.
  auto work2 = te->begin_work({4, 5}, "projection");
  ready_of(work2)->value();
  EXPECT_SW_THROW(RuntimeError, "wait", te->release());
  EXPECT_FALSE(te->end_work(work));
  EXPECT_FALSE(te->end_work(work));  // idempotent
  EXPECT_SW_THROW(RuntimeError, "wait", te->evict_async({4}));  // still pinned by work2
  te->evict_async({0})->value();
  EXPECT_FALSE(te->end_work(work2));
  EXPECT_FALSE(te->has_incomplete_work());
  te->set(0, F(4.0));  // unpinned now
  te->evict_async(all_tiles(*te))->value();
  for (const auto& s : states(*te)) EXPECT_EQ(s.location, TileLocation::Secondary);
  EXPECT_EQ(te->get(0), F(4.0));
  EXPECT_EQ(te->get(2), F(3.0));
}

TEST_F(TiledTest, IncompleteRequestsConflictAndBlockRelease) {
  Tiled te = make_tiled({4}, {4});
  te->promote_async({3})->value();
  const auto values = seeded(F32(), 16, 0);
  const auto prior = states(*te);
  Done p, e;
  {
    IoBlock block;
    p = te->promote_async({0, 1});
    e = te->evict_async({3});
    EXPECT_FALSE(p->done());
    EXPECT_FALSE(e->done());
    EXPECT_TRUE(te->has_incomplete_work());
    // Overlapping requests, slot access and work on pending tiles: RuntimeError directing to wait.
    EXPECT_SW_THROW(RuntimeError, "wait", te->promote_async({1, 2}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->evict_async({0}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->promote_async({3}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->get(0));
    EXPECT_SW_THROW(RuntimeError, "wait", te->set(13, F(1.0)));
    EXPECT_SW_THROW(RuntimeError, "wait", te->begin_work({1}, "operation"));
    EXPECT_SW_THROW(RuntimeError, "wait", te->release());
    EXPECT_FALSE(te->is_released());
    // Disjoint tiles stay usable: tile 2 is read through the secondary, a write to it promotes it inline.
    EXPECT_EQ(te->get(8), values[8]);
    EXPECT_EQ(state(*te, 2).location, TileLocation::Secondary);
    te->set(9, values[9]);
    EXPECT_EQ(state(*te, 2).location, TileLocation::Primary);
    // Nothing committed while the transfers are held.
    EXPECT_EQ(state(*te, 0).location, prior[0].location);
    EXPECT_EQ(state(*te, 3).location, TileLocation::Primary);
    block.open();
    p->value();
    e->value();
  }
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(state(*te, 0).location, TileLocation::Primary);
  EXPECT_EQ(state(*te, 1).location, TileLocation::Primary);
  EXPECT_EQ(state(*te, 3).location, TileLocation::Secondary);
  EXPECT_EQ(snapshot(*te), values);

  // Release ends everything; it is idempotent and later requests fail.
  auto secondary = std::static_pointer_cast<FileBackedCarrier>(te->secondary());
  EXPECT_GE(secondary->fd(), 0);  // anonymous: open, with no name in the directory
  te->release();
  te->release();
  EXPECT_TRUE(te->is_released());
  EXPECT_TRUE(te->primary()->is_released());
  EXPECT_TRUE(secondary->is_released());
  EXPECT_EQ(secondary->fd(), -1);  // closed: its storage is freed
  EXPECT_EQ(te->stats().primary_tiles, 0);
  EXPECT_SW_THROW(RuntimeError, "released", te->promote_async({0}));
  EXPECT_SW_THROW(RuntimeError, "released", te->evict_async({0}));
  EXPECT_SW_THROW(RuntimeError, "released", te->begin_work({0}, "operation"));
  EXPECT_SW_THROW(RuntimeError, "released", te->get(0));
}

TEST_F(TiledTest, ReleaseRefusedWhileWorkIsIncomplete) {
  Tiled te = make_tiled({2}, {2}, {.primary_full = true, .secondary_full = false});
  auto work = te->begin_work({1}, "backward");
  EXPECT_SW_THROW(RuntimeError, "wait", te->release());
  EXPECT_FALSE(te->is_released());
  EXPECT_FALSE(te->primary()->is_released());
  EXPECT_EQ(te->get(2), seeded(F32(), 4, 1000)[2]);
  EXPECT_FALSE(te->end_work(work));
  te->release();
  EXPECT_TRUE(te->is_released());
}

// A policy that records its calls and returns a fixed plan (or throws).
class FixedPolicy final : public ResidencyPolicy {
 public:
  ResidencyPlan plan(const std::vector<TileCoord>& required, const char* purpose) override {
    std::lock_guard lock(m);
    calls.push_back({required, purpose});
    if (fail) raise<RuntimeError>("policy failed on purpose");
    return next;
  }
  std::mutex m;
  std::vector<std::pair<std::vector<TileCoord>, std::string>> calls;
  ResidencyPlan next;
  bool fail = false;
};

TEST_F(TiledTest, PolicyPlansPrefetchAndDeferredEviction) {
  auto policy = std::make_shared<FixedPolicy>();
  Tiled te = make_tiled({4}, {2}, {}, policy);
  EXPECT_EQ(te->policy(), policy);
  policy->next.promote = {{2}};
  policy->next.evict = {{0}, {3}};
  auto work = te->begin_work({0}, "projection");
  ready_of(work)->value();
  ASSERT_EQ(policy->calls.size(), 1u);
  EXPECT_EQ(policy->calls[0].first, (std::vector<TileCoord>{{0}}));
  EXPECT_EQ(policy->calls[0].second, "projection");
  EXPECT_EQ(state(*te, 0).location, TileLocation::Primary);
  EXPECT_EQ(state(*te, 2).location, TileLocation::Primary);  // prefetched by the plan
  EXPECT_FALSE(te->end_work(work));  // deferred eviction of 0 (3 is not primary: nothing to do), done on return
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(state(*te, 0).location, TileLocation::Secondary);
  EXPECT_EQ(state(*te, 2).location, TileLocation::Primary);

  // Failures before any pin: a throwing policy and an out-of-grid plan.
  policy->fail = true;
  EXPECT_SW_THROW(RuntimeError, "on purpose", te->begin_work({1}, "operation"));
  policy->fail = false;
  policy->next = {};
  policy->next.evict = {{4}};
  EXPECT_SW_THROW(ValueError, "out of range", te->begin_work({1}, "backward"));
  EXPECT_FALSE(te->has_incomplete_work());
  te->evict_async(all_tiles(*te))->value();  // nothing pinned
  EXPECT_EQ(snapshot(*te), seeded(F32(), 8, 0));
}

// ================================================================ failure atomicity

TEST_F(TiledTest, PromotionFailureRestoresThePriorSet) {
  Tiled te = make_tiled({5}, {4});  // one run (one pread) per tile
  auto values = seeded(F32(), 20, 0);
  te->promote_async({4})->value();
  write_one(*te, 17, 99.0f);  // tile 4 primary and dirty
  values[17] = F(99.0);
  const auto prior = states(*te);
  const auto stats0 = te->stats();
  const uint64_t v0 = te->version();

  io::inject(io::Op::Pread, EIO, 1, 2);  // the third pread of the request fails
  Done d = te->promote_async({0, 1, 2, 3, 4});
  d->wait();
  ASSERT_TRUE(d->error());
  EXPECT_TRUE(contains(message_of(d->error()), "Input/output error")) << message_of(d->error());
  EXPECT_SW_THROW(RuntimeError, "pread", d->value());
  EXPECT_FALSE(te->has_incomplete_work());
  expect_states(*te, prior);
  expect_stats_eq(te->stats(), stats0);
  EXPECT_EQ(te->version(), v0);
  EXPECT_EQ(peek_all(*te), values);

  io::clear_faults();
  te->promote_async({0, 1, 2, 3, 4})->value();
  for (const auto& s : states(*te)) EXPECT_EQ(s.location, TileLocation::Primary);
  EXPECT_TRUE(state(*te, 4).dirty);
  EXPECT_FALSE(state(*te, 0).dirty);
  EXPECT_EQ(snapshot(*te), values);
  EXPECT_EQ(te->version(), v0);
}

TEST_F(TiledTest, InlinePromotionFailureLeavesTheTileSecondary) {
  Tiled te = make_tiled({3}, {4});
  io::inject(io::Op::Pread, EIO, 1);
  EXPECT_SW_THROW(RuntimeError, "Input/output error", te->set(5, F(2.0)));  // a write promotes inline
  EXPECT_EQ(state(*te, 1).location, TileLocation::Secondary);
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(te->stats().promotions, 0);
  EXPECT_EQ(te->version(), 0u);
  io::inject(io::Op::Pread, EIO, 1);
  EXPECT_SW_THROW(RuntimeError, "Input/output error", te->get(5));  // a read goes through the secondary
  EXPECT_FALSE(te->has_incomplete_work());
  io::clear_faults();
  EXPECT_EQ(te->get(5), value_for(F32(), 5));
  EXPECT_EQ(state(*te, 1).location, TileLocation::Secondary);
  te->set(5, F(2.0));
  EXPECT_EQ(state(*te, 1).location, TileLocation::Primary);
  EXPECT_EQ(te->get(5), F(2.0));
}

TEST_F(TiledTest, EvictionFailureRestoresThePriorSet) {
  Tiled te = make_tiled({5}, {4});
  auto values = seeded(F32(), 20, 0);
  te->promote_async({0, 1, 2, 3, 4})->value();
  for (int64_t t : {0, 1, 3, 4}) {  // tile 2 stays clean (no write needed)
    write_one(*te, 4 * t + 1, static_cast<float>(100 + t));
    values[static_cast<size_t>(4 * t + 1)] = F(100.0 + t);
  }
  const auto prior = states(*te);
  const auto stats0 = te->stats();

  io::inject(io::Op::Pwrite, EIO, 1, 2);  // the third pwrite of the request fails
  Done d = te->evict_async(all_tiles(*te));
  d->wait();
  ASSERT_TRUE(d->error());
  EXPECT_TRUE(contains(message_of(d->error()), "Input/output error")) << message_of(d->error());
  EXPECT_FALSE(te->has_incomplete_work());
  expect_states(*te, prior);  // all primary, the same tiles dirty
  expect_stats_eq(te->stats(), stats0);
  EXPECT_EQ(peek_all(*te), values);

  io::clear_faults();
  te->evict_async(all_tiles(*te))->value();
  for (const auto& s : states(*te)) {
    EXPECT_EQ(s.location, TileLocation::Secondary);
    EXPECT_FALSE(s.dirty);
  }
  EXPECT_EQ(secondary_values(*te), values);
  EXPECT_EQ(te->stats().writes_skipped, stats0.writes_skipped + 1);
}

TEST_F(TiledTest, EnospcOnEvictionKeepsTilesDirtyAndResident) {
  Tiled te = make_tiled({2, 2}, {2, 3}, {.primary_full = true, .secondary_full = false});  // all dirty
  const auto values = seeded(F32(), te->size(), 1000);
  io::inject(io::Op::Pwrite, ENOSPC, -1);
  Done d = te->evict_async({0, 2, 3});
  d->wait();
  EXPECT_TRUE(contains(message_of(d->error()), "No space left on device")) << message_of(d->error());
  for (const auto& s : states(*te)) {
    EXPECT_EQ(s.location, TileLocation::Primary);
    EXPECT_TRUE(s.dirty);
  }
  EXPECT_EQ(te->stats().primary_tiles, 4);
  EXPECT_EQ(te->stats().evictions, 0);
  EXPECT_EQ(snapshot(*te), values);
  // Still refused while the fault persists; then succeeds.
  EXPECT_SW_THROW(RuntimeError, "No space left", te->evict_async({1})->value());
  io::clear_faults();
  te->evict_async(all_tiles(*te))->value();
  EXPECT_EQ(secondary_values(*te), values);
  EXPECT_EQ(te->stats().primary_tiles, 0);
  EXPECT_EQ(snapshot(*te), values);
}

// ================================================================ stress

// Invariants of a quiescent carrier: one location per tile, no pending marks or pins,
// consistent statistics, the version and every value equal to the sequential model.
void check_invariants(TiledEvictable& te, const std::vector<double>& model, uint64_t expected_version,
                      const std::string& when) {
  SCOPED_TRACE(when);
  EXPECT_FALSE(te.has_incomplete_work());
  auto all = states(te);
  int64_t primary = 0, secondary = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& s = all[i];
    const bool one_location = s.location == TileLocation::Primary || s.location == TileLocation::Secondary;
    EXPECT_TRUE(one_location) << "tile " << i << " is " << location_name(s.location);
    EXPECT_TRUE(s.valid) << "tile " << i;
    if (s.dirty) EXPECT_EQ(s.location, TileLocation::Primary) << "tile " << i;
    primary += s.location == TileLocation::Primary;
    secondary += s.location == TileLocation::Secondary;
  }
  EXPECT_EQ(primary + secondary, te.tile_count());
  // tiles_where partitions the grid the same way.
  EXPECT_EQ(static_cast<int64_t>(te.tiles_where([](const TileState& s) { return s.location == TileLocation::Primary; }).size()),
            primary);
  const TiledStats st = te.stats();
  const int64_t tb = tile_bytes(te);
  EXPECT_EQ(st.primary_tiles, primary);
  EXPECT_EQ(st.primary_bytes, primary * tb);
  EXPECT_EQ(st.promotions - st.evictions, st.primary_tiles) << "every tile started on secondary";
  EXPECT_EQ(st.bytes_promoted, st.promotions * tb);
  EXPECT_EQ(st.bytes_evicted % tb, 0);
  EXPECT_EQ(st.evictions, st.bytes_evicted / tb + st.writes_skipped);
  EXPECT_EQ(te.version(), expected_version);
  auto got = peek_all(te);
  int bad = 0;
  for (size_t s = 0; s < model.size(); ++s)
    if (!(got[s] == F(model[s])) && bad++ < 5)
      ADD_FAILURE() << "slot " << s << " (tile " << te.locate(static_cast<int64_t>(s)).first << ", "
                    << location_name(state(te, te.locate(static_cast<int64_t>(s)).first).location) << ") holds "
                    << got[s].f << ", the model " << model[s];
  EXPECT_EQ(bad, 0);
}

struct StressCounters {
  std::atomic<int64_t> ops{0}, conflicts{0}, promotes{0}, evicts{0}, writes{0}, sets{0}, reads{0}, works{0};
  std::atomic<int64_t> unexpected{0};
};

TEST_F(TiledTest, StressConcurrentResidencyAccessAndWork) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 10;
  constexpr int kOps = 400;
  const std::vector<int64_t> grid{4, 4}, tile{2, 3};  // 16 tiles of 6 slots (3 runs each), 96 slots
  Tiled te = make_tiled(grid, tile);
  const int64_t n = te->size(), tiles = te->tile_count();
  std::vector<double> model(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) model[static_cast<size_t>(s)] = value_for(F32(), s).f;
  uint64_t expected_version = te->version();
  StressCounters c;
  const uint64_t seed = test_seed();

  auto record_unexpected = [&](const std::string& what) {
    if (c.unexpected.fetch_add(1) < 10) ADD_FAILURE() << what;
  };
  // Runs `f`; a RuntimeError directing the caller to wait is an expected conflict.
  auto attempt = [&](const char* what, auto&& f) -> bool {
    try {
      f();
      return true;
    } catch (const RuntimeError& e) {
      if (!contains(e.what(), "wait")) record_unexpected(std::string(what) + ": RuntimeError without 'wait': " + e.what());
      c.conflicts++;
      return false;
    } catch (const std::exception& e) {
      record_unexpected(std::string(what) + ": unexpected exception: " + e.what());
      return false;
    }
  };

  for (int round = 0; round < kRounds; ++round) {
    std::atomic<int64_t> round_sets{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        Rng rng(seed * 1000003 + static_cast<uint64_t>(round * kThreads + t));
        std::vector<int64_t> mine;  // this thread's slots: the model is exact for them
        for (int64_t s = t; s < n; s += kThreads) mine.push_back(s);
        std::vector<Done> pending;
        auto random_tiles = [&] {
          std::vector<int64_t> v;
          const int64_t k = rng.uniform(1, 4);
          for (int64_t j = 0; j < k; ++j) v.push_back(rng.uniform(0, tiles - 1));  // duplicates allowed
          return v;
        };
        auto own_value = [&](int op) { return static_cast<float>(((round * kOps + op) * kThreads + t) % 4000000); };
        for (int op = 0; op < kOps; ++op) {
          c.ops++;
          const int64_t pick = rng.uniform(0, 99);
          if (pick < 16) {  // promote (sometimes waiting at once)
            auto ts = random_tiles();
            attempt("promote_async", [&] {
              Done d = te->promote_async(ts);
              c.promotes++;
              if (rng.uniform(0, 2) == 0) d->wait();
              pending.push_back(std::move(d));
            });
          } else if (pick < 32) {  // evict
            auto ts = random_tiles();
            attempt("evict_async", [&] {
              Done d = te->evict_async(ts);
              c.evicts++;
              if (rng.uniform(0, 2) == 0) d->wait();
              pending.push_back(std::move(d));
            });
          } else if (pick < 54) {  // write one of my slots (engine write or public set)
            const int64_t s = mine[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(mine.size()) - 1))];
            const float v = own_value(op);
            const bool public_set = rng.uniform(0, 1) == 0;
            if (attempt("write", [&] {
                  if (public_set) te->set(s, F(v));
                  else write_one(*te, s, v);
                })) {
              model[static_cast<size_t>(s)] = v;
              c.writes++;
              if (public_set) round_sets++;
            }
          } else if (pick < 70) {  // read one of my slots: exact
            const int64_t s = mine[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(mine.size()) - 1))];
            Value got;
            if (attempt("read", [&] {
                  if (rng.uniform(0, 1) == 0) {
                    got = te->get(s);
                  } else {
                    float f = 0;
                    te->read_slots(s, 1, &f);
                    got = F(f);
                  }
                })) {
              c.reads++;
              if (!(got == F(model[static_cast<size_t>(s)])))
                record_unexpected("slot " + std::to_string(s) + " read " + std::to_string(got.f) + ", model " +
                                  std::to_string(model[static_cast<size_t>(s)]));
            }
          } else if (pick < 76) {  // read any slot (another thread may be writing it)
            const int64_t s = rng.uniform(0, n - 1);
            attempt("read other", [&] { (void)te->get(s); });
          } else if (pick < 94) {  // tiled work: pin, wait until readable, use, end
            auto ts = random_tiles();
            std::shared_ptr<TiledEvictable::Work> w;
            if (!attempt("begin_work", [&] { w = te->begin_work(ts, "operation"); })) continue;
            c.works++;
            const auto pinned = sorted_unique(ts);
            ready_of(w)->wait();
            if (auto e = ready_of(w)->error()) record_unexpected("work promotion failed: " + message_of(e));
            for (int64_t i : pinned) {
              TileState s = state(*te, i);
              if (s.location != TileLocation::Primary)
                record_unexpected("pinned tile " + std::to_string(i) + " is " + location_name(s.location));
            }
            // Pinned, ready tiles are never pending: my slots in them read without conflict, and
            // writes to them are refused (the work needs their values unchanged).
            for (int64_t s : mine) {
              if (!std::binary_search(pinned.begin(), pinned.end(), te->locate(s).first)) continue;
              try {
                if (!(te->get(s) == F(model[static_cast<size_t>(s)])))
                  record_unexpected("pinned slot " + std::to_string(s) + " differs from the model");
              } catch (const std::exception& e) {
                record_unexpected(std::string("read of a pinned, ready tile failed: ") + e.what());
              }
              if (rng.uniform(0, 2) == 0) {
                try {
                  write_one(*te, s, own_value(op));
                  record_unexpected("a write to a pinned tile succeeded");
                } catch (const RuntimeError& e) {
                  if (!contains(e.what(), "wait")) record_unexpected(std::string("pinned write: ") + e.what());
                }
              }
            }
            // A pinned tile refuses eviction.
            try {
              (void)te->evict_async({pinned.front()});
              record_unexpected("evicting a pinned tile succeeded");
            } catch (const RuntimeError& e) {
              if (!contains(e.what(), "wait")) record_unexpected(std::string("pinned eviction: ") + e.what());
            }
            if (te->end_work(w)) record_unexpected("ending work failed");
          } else {  // table queries
            (void)te->stats();
            (void)te->has_incomplete_work();
            (void)state(*te, rng.uniform(0, tiles - 1));
            (void)te->tiles_where([](const TileState& s) { return s.dirty; });
          }
        }
        for (auto& d : pending) {
          d->wait();
          if (auto e = d->error()) record_unexpected("a residency request failed: " + message_of(e));
        }
      });
    }
    for (auto& th : threads) th.join();
    expected_version += static_cast<uint64_t>(round_sets.load());
    check_invariants(*te, model, expected_version, "after round " + std::to_string(round));
    // Quiescent: a random eviction succeeds (nothing is pinned or pending any more).
    Rng rng(seed + static_cast<uint64_t>(round));
    std::vector<int64_t> some;
    for (int64_t i = 0; i < tiles; ++i)
      if (rng.uniform(0, 1)) some.push_back(i);
    EXPECT_NO_THROW(te->evict_async(some)->value());
    check_invariants(*te, model, expected_version, "after the evictions of round " + std::to_string(round));
    if (HasFailure()) break;
  }

  // Final: everything to secondary (proves no pins or pending marks), the file equals the model,
  // then everything back, then release.
  ASSERT_NO_THROW(te->evict_async(all_tiles(*te))->value());
  for (const auto& s : states(*te)) {
    EXPECT_EQ(s.location, TileLocation::Secondary);
    EXPECT_FALSE(s.dirty);
  }
  auto file = secondary_values(*te);
  for (int64_t s = 0; s < n; ++s) EXPECT_EQ(file[static_cast<size_t>(s)], F(model[static_cast<size_t>(s)])) << "slot " << s;
  te->promote_async(all_tiles(*te))->value();
  check_invariants(*te, model, expected_version, "final");
  EXPECT_NO_THROW(te->release());
  EXPECT_TRUE(te->secondary()->is_released());
  std::cout << "[ INFO     ] stress: " << c.ops << " ops, " << c.promotes << " promotions, " << c.evicts
            << " evictions, " << c.writes << " writes, " << c.reads << " checked reads, " << c.works
            << " works, " << c.conflicts << " conflicts" << std::endl;
  EXPECT_EQ(c.unexpected.load(), 0);
  EXPECT_GT(c.conflicts.load(), 0) << "the stress test should provoke conflicts";
  EXPECT_GT(c.works.load(), 0);
}


// release() racing with requests from other threads: every attempt either refuses with
// RuntimeError (wait) or releases; once released, every request fails; a request that was
// accepted always reaches a terminal state, and after release no tile storage remains.
TEST_F(TiledTest, StressReleaseRacesWithRequests) {
  constexpr int kIterations = 60;
  const uint64_t seed = test_seed();
  std::atomic<int64_t> unexpected{0}, accepted{0}, refused_released{0};
  auto bad = [&](const std::string& what) {
    if (unexpected.fetch_add(1) < 10) ADD_FAILURE() << what;
  };
  for (int iter = 0; iter < kIterations; ++iter) {
    Tiled te = make_tiled({4}, {4});
    te->promote_async({0, 2})->value();
    write_one(*te, 1, 5.0f);
    std::atomic<bool> released{false};
    std::vector<std::thread> threads;
    std::mutex m;
    std::vector<Done> done;
    for (int t = 0; t < 3; ++t)
      threads.emplace_back([&, t] {
        Rng rng(seed * 7919 + static_cast<uint64_t>(iter * 3 + t));
        int after = 0;
        while (after < 20) {
          const bool was_released = released.load();
          try {
            const int64_t pick = rng.uniform(0, 3);
            std::vector<int64_t> ts{rng.uniform(0, 3), rng.uniform(0, 3)};
            if (pick == 0) {
              Done d = te->promote_async(ts);
              std::lock_guard lock(m);
              done.push_back(d);
            } else if (pick == 1) {
              Done d = te->evict_async(ts);
              std::lock_guard lock(m);
              done.push_back(d);
            } else if (pick == 2) {
              auto w = te->begin_work(ts, "operation");
              ready_of(w)->wait();
              (void)te->end_work(w);  // a racing release leaves nothing to evict
            } else {
              (void)te->get(rng.uniform(0, 15));
            }
            accepted++;
            if (was_released) bad("a request succeeded after release()");
          } catch (const RuntimeError& e) {
            if (contains(e.what(), "released")) refused_released++;
            else if (!contains(e.what(), "wait") && !contains(e.what(), "invalid"))
              bad(std::string("unexpected RuntimeError: ") + e.what());
          } catch (const std::exception& e) {
            bad(std::string("unexpected exception: ") + e.what());
          }
          if (was_released) ++after;
        }
      });
    const int64_t base = accepted.load();
    while (accepted.load() < base + 30 && unexpected.load() == 0) std::this_thread::yield();  // let requests flow first
    while (true) {
      try {
        te->release();
        break;
      } catch (const RuntimeError& e) {
        if (!contains(e.what(), "wait")) {
          bad(std::string("release: ") + e.what());
          break;
        }
      }
      std::this_thread::yield();
    }
    released = true;
    for (auto& th : threads) th.join();
    for (auto& d : done) d->wait();  // terminal, successfully or not
    EXPECT_TRUE(te->is_released());
    EXPECT_FALSE(te->has_incomplete_work());
    EXPECT_EQ(te->stats().primary_tiles, 0);
    EXPECT_TRUE(te->tiles_where([](const TileState& s) { return s.location != TileLocation::Invalid; }).empty());
    EXPECT_TRUE(te->primary()->is_released());
    EXPECT_TRUE(te->secondary()->is_released());
    if (HasFailure()) break;
  }
  std::cout << "[ INFO     ] release race: " << accepted << " accepted, " << refused_released
            << " refused as released" << std::endl;
  EXPECT_EQ(unexpected.load(), 0);
}

// ---------------------------------------------------------------- Note [Letting go before completing]

// Note [Fork safety]: a child of fork() made while a promotion is queued on the (blocked) I/O threads and a work
// request pins a tile forgets both: the inherited handle fails at once with "created before fork", no tile is
// pending or pinned there, and the child's own promotions and evictions run on its own pools with exact values.
// The parent's requests complete normally.
TEST_F(TiledTest, AForkedChildForgetsRequestsInFlightAndRunsItsOwn) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer does not run threads in a child of a threaded fork()";
#endif
  Tiled te = make_tiled({4}, {4});
  const auto values = seeded(F32(), 16, 0);
  te->promote_async({3})->value();  // tile I/O: the I/O pool has threads
  auto work = te->begin_work({2}, "operation");
  ready_of(work)->value();  // tile 2 resident and pinned
  Done held;
  int code = -1;
  {
    IoBlock block;
    held = te->promote_async({0, 1});
    ASSERT_FALSE(held->done());
    code = run_in_forked_child([&] {
      if (!held->done() || !held->error()) return 2;
      try {
        std::rethrow_exception(held->error());
      } catch (const RuntimeError& e) {
        if (!contains(e.what(), "created before fork")) return 3;
      }
      if (te->has_incomplete_work()) return 4;  // no pending mark, no pin, no count left
      te->promote_async({0, 1})->value();
      for (int64_t t = 0; t < 4; ++t)
        if (state(*te, t).location != TileLocation::Primary) return 5;
      te->evict_async({0, 1, 2, 3})->value();  // tile 2 is no longer pinned here
      for (int64_t t = 0; t < 4; ++t)
        if (state(*te, t).location != TileLocation::Secondary) return 6;
      te->promote_async({1, 2})->value();
      if (snapshot(*te) != values) return 7;
      return 0;
    });
    block.open();
    held->value();
  }
  EXPECT_EQ(code, 0) << "the forked child failed check " << code << " (142: it hung)";
  EXPECT_EQ(state(*te, 0).location, TileLocation::Primary);
  EXPECT_SW_THROW(RuntimeError, "pinned", te->evict_async({2}));  // the parent's work still pins it
  EXPECT_EQ(te->end_work(work), nullptr);
  te->evict_async({0, 1, 2, 3})->value();
  EXPECT_EQ(snapshot(*te), values);
}

TEST_F(TiledTest, AWaitedRequestHoldsNoReferenceToTheCarrier) {
  // A tiled gradient adds in place only when its holder owns the carrier alone; so once a residency request's
  // handle reports completion, the request's transfers must no longer hold the carrier. Each round waits and
  // checks at once, with the I/O threads as close behind as they get.
  Tiled te = make_tiled({8}, {16});
  int extra_after_promote = 0, extra_after_evict = 0;
  for (int round = 0; round < 2000; ++round) {
    const std::vector<int64_t> tiles{round % 8, (round + 3) % 8};
    te->promote_async(tiles)->value();
    extra_after_promote += te.use_count() != 1;
    te->evict_async(tiles)->value();
    extra_after_evict += te.use_count() != 1;
  }
  EXPECT_EQ(extra_after_promote, 0);
  EXPECT_EQ(extra_after_evict, 0);
}

// Note [Requests' own references]: while requests are under way, the caller's reference still counts as the
// only one, at every moment (the requests take, drop and uncount theirs on the I/O threads meanwhile), and a
// second reference never does.
TEST_F(TiledTest, RequestsUnderWayAreNotOtherReferences) {
  CarrierPtr c = make_tiled({8}, {64});
  auto* te = static_cast<TiledEvictable*>(c.get());
  int64_t wrong = 0, checks = 0;
  auto check_while = [&](std::vector<CompletionPtr<std::monostate>>& pending) {
    for (bool busy = true; busy;) {
      busy = false;
      for (auto& p : pending) busy |= !p->done();
      wrong += !te->only_reference_is(c);
      ++checks;
    }
    for (auto& p : pending) p->value();
    wrong += !te->only_reference_is(c);
    CarrierPtr second = c;
    wrong += te->only_reference_is(c);
  };
  for (int round = 0; round < 300; ++round) {
    std::vector<CompletionPtr<std::monostate>> pending;
    for (int64_t t = 0; t < 8; ++t) pending.push_back(te->promote_async({t}));  // one request per tile
    check_while(pending);
    te->write_value(round % 8 * 64, F(float(round)));  // dirty: the eviction writes
    pending.clear();
    for (int64_t t = 0; t < 8; ++t) pending.push_back(te->evict_async({t}));
    check_while(pending);
  }
  EXPECT_EQ(wrong, 0) << "of " << checks << " checks";
  EXPECT_EQ(c.use_count(), 1);
}

// ---------------------------------------------------------------- Note [Gradient sums hold their tiles]

// A fresh gradient over `like`'s geometry: every tile implicit except `tiles`, whose slots all hold `value`.
Tiled gradient_of(const Tiled& like, const std::vector<int64_t>& tiles, float value) {
  auto g = std::static_pointer_cast<TiledEvictable>(like->allocate_like(like->size(), true, F32(), false));
  std::vector<std::pair<int64_t, CarrierPtr>> buffers;
  std::vector<float> v(static_cast<size_t>(like->tile_size()), value);
  for (int64_t t : tiles) {
    CarrierPtr b = like->primary()->allocate_like(like->tile_size(), true, F32(), true);
    b->write_slots(0, like->tile_size(), v.data());
    buffers.emplace_back(t, std::move(b));
  }
  if (!buffers.empty()) g->install_tiles(buffers);
  return g;
}

// Every slot of tile `t` (read through the tile table, with the tile promoted if it must be).
std::vector<float> tile_values(TiledEvictable& te, int64_t t) {
  std::vector<float> out;
  for (const Run& r : te.footprint_runs(t))
    for (int64_t k = 0; k < r.length; ++k) out.push_back(static_cast<float>(te.read_value(r.offset + k).f));
  return out;
}

// Waits (bounded) until a call of `op` blocks at the test gate.
bool await_held(io::Op op) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(30);
  while (io::held_waiting(op) == 0) {
    if (std::chrono::steady_clock::now() > deadline) return false;
    std::this_thread::yield();
  }
  return true;
}

TEST_F(TiledTest, AGradientSinkHoldsItsTileUntilCommittedOrDropped) {
  Tiled te = make_tiled({4}, {4});
  te->promote_async({0, 1})->value();
  const auto values = seeded(F32(), 16, 0);
  const uint64_t v0 = te->version();
  const TiledStats stats0 = te->stats();
  {
    auto write = te->hold_tile_for_update(0);
    ASSERT_TRUE(write);
    EXPECT_TRUE(te->has_incomplete_work());
    EXPECT_FALSE(te->hold_tile_for_update(0));  // one writer at a time
    // Everything else that would move, read, share or release the tile refuses and asks to wait.
    EXPECT_SW_THROW(RuntimeError, "being added into by a gradient sum", te->evict_async({0}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->evict_async({1, 0}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->promote_async({0}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->get(0));
    EXPECT_SW_THROW(RuntimeError, "wait", te->set(1, F(2.0)));
    EXPECT_SW_THROW(RuntimeError, "wait", te->begin_work({0}, "projection"));
    EXPECT_SW_THROW(RuntimeError, "wait", te->pin_for_reading());
    EXPECT_SW_THROW(RuntimeError, "wait", te->release());
    EXPECT_FALSE(te->is_released());
    Tiled g = gradient_of(te, {0, 2}, 1.0f);
    EXPECT_FALSE(te->accumulate_tiles(*g, false));  // another sum refuses, changing nothing
    EXPECT_EQ(state(*te, 0).location, TileLocation::Primary);
    EXPECT_EQ(te->version(), v0);
    expect_stats_eq(te->stats(), stats0);
    // Other tiles stay usable.
    te->evict_async({1})->value();
    for (int k = 0; k < 4; ++k) write->data()[k] += 1.0f;
    write->commit();
    EXPECT_FALSE(te->has_incomplete_work());
  }
  EXPECT_EQ(te->version(), v0 + 1);
  EXPECT_TRUE(state(*te, 0).dirty);
  for (int k = 0; k < 4; ++k) EXPECT_EQ(te->get(k), F(values[k].f + 1.0)) << k;
  te->evict_async({0})->value();  // dirty: written
  EXPECT_EQ(secondary_values(*te)[0], F(values[0].f + 1.0));
  // A hold dropped without commit leaves the tile as it was.
  te->promote_async({0})->value();
  ASSERT_TRUE(te->hold_tile_for_update(0));
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(te->version(), v0 + 1);
  EXPECT_FALSE(state(*te, 0).dirty);
  // Only resident, native tiles can be held: secondary and implicit ones cannot.
  EXPECT_FALSE(te->hold_tile_for_update(2));
  Tiled zeros = std::static_pointer_cast<TiledEvictable>(te->allocate_like(te->size(), true, F32(), false));
  EXPECT_FALSE(zeros->hold_tile_for_update(0));
  te->evict_async(all_tiles(*te))->value();
  EXPECT_NO_THROW(te->release());
}

// The sum is paused in the middle (the read-back of its secondary tile waits at the pread gate): every tile it
// adds into is held meanwhile, the gradient it adds is pinned, and the sum then lands whole.
TEST_F(TiledTest, AGradientSumHoldsEveryTileItAddsIntoUntilItLands) {
  Tiled base = make_tiled({4}, {4});
  Tiled acc = std::static_pointer_cast<TiledEvictable>(base->allocate_like(base->size(), true, F32(), false));
  const std::vector<float> ones(16, 1.0f);
  acc->write_slots(0, 8, ones.data());   // tiles 0 and 1
  acc->write_slots(12, 4, ones.data());  // tile 3
  acc->evict_async({1})->value();        // tile 1 is read back by the sum
  Tiled g = gradient_of(acc, {0, 1, 2}, 2.0f);
  const uint64_t v0 = acc->version();
  io::hold(io::Op::Pread);
  auto sum = std::async(std::launch::async, [&] { return acc->accumulate_tiles(*g, /*share_other=*/false); });
  const bool paused = await_held(io::Op::Pread);
  EXPECT_TRUE(paused) << "the sum never read its secondary tile";
  if (paused) {
    EXPECT_SW_THROW(RuntimeError, "wait", acc->evict_async({0}));    // resident, being added into
    EXPECT_SW_THROW(RuntimeError, "wait", acc->promote_async({1}));  // being read back by the sum
    EXPECT_SW_THROW(RuntimeError, "wait", acc->promote_async({2}));  // implicit, taking the contribution
    EXPECT_SW_THROW(RuntimeError, "wait", acc->get(0));
    EXPECT_SW_THROW(RuntimeError, "wait", acc->release());
    EXPECT_SW_THROW(RuntimeError, "wait", g->evict_async({0}));  // the gradient being added is pinned
    EXPECT_SW_THROW(RuntimeError, "wait", g->release());
    EXPECT_EQ(acc->version(), v0);
    acc->evict_async({3})->value();  // a tile the sum does not touch
  }
  io::unhold();
  ASSERT_TRUE(sum.get());
  EXPECT_EQ(acc->version(), v0 + 1);
  EXPECT_FALSE(acc->has_incomplete_work());
  EXPECT_FALSE(g->has_incomplete_work());
  for (int64_t t : {0, 1, 2}) {
    EXPECT_EQ(state(*acc, t).location, TileLocation::Primary) << t;
    EXPECT_TRUE(state(*acc, t).dirty) << t;
  }
  EXPECT_EQ(tile_values(*acc, 0), std::vector<float>(4, 3.0f));
  EXPECT_EQ(tile_values(*acc, 1), std::vector<float>(4, 3.0f));
  EXPECT_EQ(tile_values(*acc, 2), std::vector<float>(4, 2.0f));
  EXPECT_EQ(tile_values(*acc, 3), std::vector<float>(4, 1.0f));
  acc->evict_async(all_tiles(*acc))->value();
  EXPECT_NO_THROW(acc->release());
}

// A read-back fails (EIO): nothing the sum was adding is published, and the tile it had already prepared to add
// into in place is unchanged.
TEST_F(TiledTest, AGradientSumThatFailsToReadBackChangesNothing) {
  Tiled base = make_tiled({4}, {4});
  Tiled acc = std::static_pointer_cast<TiledEvictable>(base->allocate_like(base->size(), true, F32(), false));
  const std::vector<float> ones(16, 1.0f);
  acc->write_slots(0, 8, ones.data());
  acc->evict_async({1})->value();
  Tiled g = gradient_of(acc, {0, 1, 2}, 2.0f);
  const uint64_t v0 = acc->version();
  const TiledStats stats0 = acc->stats();
  const auto states0 = states(*acc);
  io::inject(io::Op::Pread, EIO, -1);
  EXPECT_SW_THROW(RuntimeError, "EIO", acc->accumulate_tiles(*g, false));
  io::clear_faults();
  EXPECT_EQ(acc->version(), v0);
  expect_stats_eq(acc->stats(), stats0);
  expect_states(*acc, states0);
  EXPECT_FALSE(acc->has_incomplete_work());
  EXPECT_FALSE(g->has_incomplete_work());
  EXPECT_EQ(tile_values(*acc, 0), std::vector<float>(4, 1.0f));
  // The same sum succeeds once the fault is gone.
  EXPECT_TRUE(acc->accumulate_tiles(*g, false));
  EXPECT_EQ(tile_values(*acc, 0), std::vector<float>(4, 3.0f));
  EXPECT_EQ(tile_values(*acc, 1), std::vector<float>(4, 3.0f));
  EXPECT_EQ(tile_values(*acc, 2), std::vector<float>(4, 2.0f));
}

// Gradient sums and sinks add into one gradient while other threads promote, evict, project and read its tiles
// (a .grad another thread took a reference to). Every contribution adds 1.0 to every slot of its tiles, so each
// tile holds exactly the number of contributions that landed on it (exact in Float32), a reader never sees a tile
// half-added (its slots differ), and the version counts the contributions that landed.
TEST_F(TiledTest, StressGradientSumsWhileOtherThreadsMoveAndReadTheirTiles) {
  constexpr int64_t kTiles = 6, kTile = 96;
  constexpr int kSums = 1500, kSinks = 1500;
  const uint64_t seed = test_seed();
  Tiled base = make_tiled({kTiles}, {kTile});
  Tiled acc = std::static_pointer_cast<TiledEvictable>(base->allocate_like(base->size(), true, F32(), false));
  const uint64_t v0 = acc->version();
  std::vector<std::atomic<int64_t>> landed(kTiles);
  std::atomic<int64_t> unexpected{0}, refused{0}, sums{0}, sinks{0}, moves{0}, reads{0};
  std::atomic<int> producers{2};
  auto bad = [&](const std::string& what) {
    if (unexpected.fetch_add(1) < 10) ADD_FAILURE() << what;
  };
  auto expect_wait = [&](const RuntimeError& e, const char* what) {
    if (!contains(e.what(), "wait")) bad(std::string(what) + ": RuntimeError without 'wait': " + e.what());
    refused++;
  };
  auto uniform = [&](const std::vector<float>& v, const char* what) {
    for (float x : v)
      if (x != v.front()) return bad(std::string(what) + " saw a tile half-added");
    reads++;
  };
  std::vector<std::thread> threads;
  threads.emplace_back([&] {  // sums: a fresh gradient over a random set of tiles, landed whole or refused
    Rng rng(seed ^ 0x51);
    for (int k = 0; k < kSums; ++k) {
      std::vector<int64_t> tiles;
      for (int64_t t = 0; t < kTiles; ++t)
        if (rng.uniform(0, 2) == 0) tiles.push_back(t);
      Tiled g = gradient_of(acc, tiles, 1.0f);
      try {
        if (acc->accumulate_tiles(*g, rng.uniform(0, 1) == 1)) {
          for (int64_t t : tiles) landed[t]++;
          if (!tiles.empty()) sums++;
        } else {
          refused++;
        }
      } catch (const RuntimeError& e) {
        expect_wait(e, "accumulate_tiles");
      }
    }
    producers--;
  });
  threads.emplace_back([&] {  // sinks: one resident tile added into in place
    Rng rng(seed ^ 0x52);
    for (int k = 0; k < kSinks; ++k) {
      const int64_t t = rng.uniform(0, kTiles - 1);
      auto write = acc->hold_tile_for_update(t);
      if (!write) {
        refused++;
        continue;
      }
      for (int64_t s = 0; s < kTile; ++s) write->data()[s] += 1.0f;
      write->commit();
      landed[t]++;
      sinks++;
    }
    producers--;
  });
  for (int m = 0; m < 2; ++m)
    threads.emplace_back([&, m] {  // promotions and evictions of random tiles
      Rng rng(seed ^ (0x60 + m));
      std::vector<Done> pending;
      while (producers.load() > 0) {
        std::vector<int64_t> tiles{rng.uniform(0, kTiles - 1), rng.uniform(0, kTiles - 1)};
        try {
          Done d = rng.uniform(0, 1) ? acc->promote_async(tiles) : acc->evict_async(tiles);
          moves++;
          if (rng.uniform(0, 1)) d->wait();
          else pending.push_back(std::move(d));
        } catch (const RuntimeError& e) {
          expect_wait(e, "promote/evict");
        }
      }
      for (auto& d : pending) {
        d->wait();
        if (auto e = d->error()) bad("a residency request failed: " + message_of(e));
      }
    });
  threads.emplace_back([&] {  // readers: projection-like work, reading pins and slot reads
    Rng rng(seed ^ 0x70);
    while (producers.load() > 0) {
      const int64_t t = rng.uniform(0, kTiles - 1);
      const int64_t pick = rng.uniform(0, 2);
      try {
        if (pick == 0) {
          auto w = acc->begin_work({t}, "projection");
          ready_of(w)->wait();
          std::vector<float> v(static_cast<size_t>(kTile), 0.0f);
          if (CarrierPtr b = acc->tile_buffer(t)) b->read_slots(0, kTile, v.data());
          (void)acc->end_work(w);  // no plan: nothing to report
          uniform(v, "work");
        } else if (pick == 1) {
          auto w = acc->pin_for_reading();
          std::vector<float> v(static_cast<size_t>(kTile), 0.0f);
          CarrierPtr b;
          try {
            b = acc->tile_value(t);
          } catch (...) {
            (void)acc->end_work(w);  // no plan: nothing to report
            throw;
          }
          if (b) b->read_slots(0, kTile, v.data());
          (void)acc->end_work(w);  // no plan: nothing to report
          uniform(v, "a reading pin");
        } else {
          (void)acc->get(acc->footprint_runs(t).front().offset);
        }
      } catch (const RuntimeError& e) {
        expect_wait(e, "read");
      }
    }
  });
  for (auto& th : threads) th.join();
  EXPECT_EQ(unexpected.load(), 0);
  EXPECT_FALSE(acc->has_incomplete_work());
  // No hold or pin is left: every tile moves out and back without a conflict.
  ASSERT_NO_THROW(acc->evict_async(all_tiles(*acc))->value());
  ASSERT_NO_THROW(acc->promote_async(all_tiles(*acc))->value());
  EXPECT_EQ(acc->stats().primary_tiles, kTiles);
  for (int64_t t = 0; t < kTiles; ++t)
    EXPECT_EQ(tile_values(*acc, t), std::vector<float>(kTile, static_cast<float>(landed[t].load()))) << "tile " << t;
  EXPECT_EQ(acc->version(), v0 + static_cast<uint64_t>(sums.load() + sinks.load()));
  EXPECT_NO_THROW(acc->release());
  std::cout << "[ INFO     ] gradient sums: " << sums << " sums and " << sinks << " sinks landed, " << refused
            << " refusals, " << moves << " residency requests, " << reads << " checked reads" << std::endl;
  EXPECT_GT(sums.load() + sinks.load(), 0);
}

// ---------------------------------------------------------------- projection shares one tile (Note [Shared snapshots])

// A canonical full tensor over `te`: column-major over its logical shape, offset 0.
TensorPtr canonical_full(const Tiled& te) { return make_tensor(te, 0, column_major(Shape::flat(te->logical_shape()))); }

TEST_F(TiledTest, ProjectingOneResidentTileSharesItsBufferCopyOnWrite) {
  GradModeGuard no_grad(false);
  Tiled te = make_tiled({2, 3}, {4, 5});
  TensorPtr full = canonical_full(te);
  const int64_t tile = te->tile_index({1, 2});
  te->promote_async({tile})->value();
  TensorPtr p = project(te, full, {{{1}, {2}}}, nullptr)->value();
  ASSERT_EQ(p->size(), 20);
  EXPECT_EQ(p->carrier->native_data(), te->tile_buffer(tile)->native_data());  // no copy
  auto value_at = [&](int64_t w) {  // the full tensor's value at within-tile ordinal w of tile (1, 2)
    const int64_t r = 4 + w % 4, col = 10 + w / 4;
    return te->read_value(r + 8 * col);
  };
  for (int64_t w = 0; w < 20; ++w) EXPECT_EQ(p->carrier->read_value(w), value_at(w)) << w;
  // The tile is written: the projection keeps the values it was given.
  const Value before = p->carrier->read_value(0);
  te->write_value(4 + 8 * 10, F(-7.0));
  EXPECT_EQ(p->carrier->read_value(0), before);
  EXPECT_EQ(value_at(0), F(-7.0));
  // The projection is written: the tile keeps its values.
  TensorPtr q = project(te, full, {{{1}, {2}}}, nullptr)->value();
  EXPECT_EQ(q->carrier->native_data(), te->tile_buffer(tile)->native_data());
  q->carrier->set(1, F(99.0));
  EXPECT_NE(value_at(1), F(99.0));
  EXPECT_EQ(q->carrier->read_value(1), F(99.0));
  // The tile is evicted (written back: it is dirty): the projection lives on.
  te->evict_async({tile})->value();
  EXPECT_EQ(state(*te, tile).location, TileLocation::Secondary);
  EXPECT_EQ(p->carrier->read_value(0), before);
  EXPECT_EQ(value_at(0), F(-7.0));
}

// Note [Waiters help]: a projection of resident tiles completes in its waiter's own thread when no
// selection thread is free to gather them (every one is blocked here): the waiter gathers every tile.
TEST_F(TiledTest, AWaiterGathersResidentTilesItselfWhenNoSelectionThreadIsFree) {
  GradModeGuard no_grad(false);
  Tiled te = make_tiled({2, 3}, {4, 5});
  TensorPtr full = make_tensor(te, 0, column_major(Shape::flat(te->logical_shape())));
  te->promote_async({0, 1, 2, 3, 4, 5})->value();
  IoBlock blocked(Executor::select());
  auto handle = project(te, full, {{{1, 0}, {2, 0}}}, nullptr);
  EXPECT_FALSE(handle->done());  // queued: no selection thread has taken a tile
  auto waited = std::async(std::launch::async, [&] { return handle->value(); });
  const bool finished = waited.wait_for(std::chrono::seconds(60)) == std::future_status::ready;
  EXPECT_TRUE(finished) << "the waiter did not gather the tiles itself";
  blocked.open();
  TensorPtr p = waited.get();
  ASSERT_EQ(p->size(), 80);
  // Compact (8, 10): rows from grid rows 1 then 0, columns from grid columns 2 then 0.
  for (int64_t j = 0; j < 10; ++j)
    for (int64_t i = 0; i < 8; ++i) {
      const int64_t r = (i < 4 ? 4 : 0) + i % 4, col = (j < 5 ? 10 : 0) + j % 5;
      ASSERT_EQ(p->carrier->read_value(i + 8 * j), te->read_value(r + 8 * col)) << i << "," << j;
    }
}

TEST_F(TiledTest, ProjectionCopiesIntoADestinationSeveralTilesOrAnImplicitZero) {
  GradModeGuard no_grad(false);
  Tiled te = make_tiled({2, 3}, {4, 5});
  TensorPtr full = canonical_full(te);
  te->promote_async(all_tiles(*te))->value();
  auto dest = std::make_shared<CPUCarrier>(20, F32(), true, true);
  TensorPtr into = project(te, full, {{{0}, {1}}}, dest)->value();
  EXPECT_EQ(into->carrier.get(), dest.get());  // the destination given, written
  EXPECT_NE(into->carrier->native_data(), te->tile_buffer(te->tile_index({0, 1}))->native_data());
  TensorPtr two = project(te, full, {{{0}, {1, 2}}}, nullptr)->value();
  EXPECT_EQ(two->size(), 40);
  EXPECT_NE(two->carrier->native_data(), te->tile_buffer(te->tile_index({0, 1}))->native_data());
  Tiled zeros = std::static_pointer_cast<TiledEvictable>(te->allocate_like(te->size(), true, F32(), false));
  TensorPtr z = project(zeros, canonical_full(zeros), {{{1}, {1}}}, nullptr)->value();
  for (int64_t w = 0; w < 20; ++w) EXPECT_EQ(z->carrier->read_value(w), F(0.0)) << w;
}

}  // namespace
}  // namespace sw
