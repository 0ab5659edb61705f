// TileGeometry (strideweave/tiled/tile_geometry.hpp) on its own, with no carrier: tile index <-> coordinate round
// trips, locate and its inverse, footprint runs and regions against naive models over random geometries, selections,
// footprint checks, and the construction errors (Note [Tile table limits]) with their messages.
// The random seed is printed; set SW_TEST_SEED=<n> to replay a run.
#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>

#include <set>
#include <string>
#include <vector>

#include "strideweave/tiled/tile_geometry.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;

std::vector<int64_t> colex(int64_t ordinal, const std::vector<int64_t>& extents) {
  std::vector<int64_t> c(extents.size());
  for (size_t k = 0; k < extents.size(); ++k) {
    c[k] = ordinal % extents[k];
    ordinal /= extents[k];
  }
  return c;
}

int64_t uncolex(const std::vector<int64_t>& c, const std::vector<int64_t>& extents) {
  int64_t o = 0, scale = 1;
  for (size_t k = 0; k < extents.size(); ++k) {
    o += c[k] * scale;
    scale *= extents[k];
  }
  return o;
}

std::string str(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + ")";
}

TileGeometry random_geometry(Rng& rng) {
  const int64_t rank = rng.uniform(1, 3);
  std::vector<int64_t> grid, tile;
  for (int64_t k = 0; k < rank; ++k) {
    grid.push_back(rng.uniform(1, 4));
    tile.push_back(rng.uniform(1, 4));
  }
  return TileGeometry(grid, tile);
}

TEST(TileGeometry, ShapesAndCounts) {
  const TileGeometry g({3, 2}, {4, 5});
  EXPECT_EQ(g.grid_shape(), (std::vector<int64_t>{3, 2}));
  EXPECT_EQ(g.tile_shape(), (std::vector<int64_t>{4, 5}));
  EXPECT_EQ(g.logical_shape(), (std::vector<int64_t>{12, 10}));
  EXPECT_EQ(g.slot_strides(), (std::vector<int64_t>{1, 12}));
  EXPECT_EQ(g.rank(), 2u);
  EXPECT_EQ(g.tile_count(), 6);
  EXPECT_EQ(g.tile_size(), 20);
  EXPECT_EQ(g.size(), 120);
  EXPECT_TRUE(g == TileGeometry({3, 2}, {4, 5}));
  EXPECT_FALSE(g == TileGeometry({2, 3}, {4, 5}));
  EXPECT_FALSE(g == TileGeometry({3, 2}, {5, 4}));
}

TEST(TileGeometry, IndexCoordLocateAndSlotRoundTripOnRandomGeometries) {
  Rng rng(test_seed() ^ 0x7e0);
  for (int iter = 0; iter < 50; ++iter) {
    const TileGeometry g = random_geometry(rng);
    SCOPED_TRACE("grid " + str(g.grid_shape()) + " tile " + str(g.tile_shape()));
    for (int64_t i = 0; i < g.tile_count(); ++i) {
      ASSERT_EQ(g.tile_coord(i), colex(i, g.grid_shape())) << "tile " << i;
      ASSERT_EQ(g.tile_index(g.tile_coord(i)), i);
    }
    std::vector<int> seen(static_cast<size_t>(g.size()), 0);
    for (int64_t s = 0; s < g.size(); ++s) {
      const auto c = colex(s, g.logical_shape());
      std::vector<int64_t> tc(c.size()), wc(c.size());
      for (size_t k = 0; k < c.size(); ++k) {
        tc[k] = c[k] / g.tile_shape()[k];
        wc[k] = c[k] % g.tile_shape()[k];
      }
      const auto [t, w] = g.locate(s);
      ASSERT_EQ(t, uncolex(tc, g.grid_shape())) << "slot " << s;
      ASSERT_EQ(w, uncolex(wc, g.tile_shape())) << "slot " << s;
      ASSERT_EQ(g.slot(t, w), s) << "slot " << s;  // slot() inverts locate()
    }
    for (int64_t t = 0; t < g.tile_count(); ++t)
      for (int64_t w = 0; w < g.tile_size(); ++w) {
        const int64_t s = g.slot(t, w);
        ASSERT_GE(s, 0);
        ASSERT_LT(s, g.size());
        ASSERT_EQ(seen[static_cast<size_t>(s)]++, 0) << "slot " << s << " named twice";
        ASSERT_EQ(g.locate(s), std::make_pair(t, w));
      }
  }
}

TEST(TileGeometry, FootprintRunsCoverEachTileOnceInWithinTileOrder) {
  Rng rng(test_seed() ^ 0x7e1);
  for (int iter = 0; iter < 50; ++iter) {
    const TileGeometry g = random_geometry(rng);
    SCOPED_TRACE("grid " + str(g.grid_shape()) + " tile " + str(g.tile_shape()));
    std::vector<int> covered(static_cast<size_t>(g.size()), 0);
    for (int64_t i = 0; i < g.tile_count(); ++i) {
      const FootprintRuns runs = g.footprint_runs(i);
      ASSERT_GE(runs.size(), 1u);
      EXPECT_EQ(runs.front().offset, g.tile_base(i));
      EXPECT_EQ(runs.front().ordinal, 0);
      std::set<int64_t> ordinals;
      int64_t length = 0;
      size_t k = 0;
      for (const sw::Run& r : runs) {
        const sw::Run indexed = runs[k++];
        ASSERT_EQ(indexed.offset, r.offset);
        ASSERT_EQ(indexed.ordinal, r.ordinal);
        ASSERT_GE(r.length, 1);
        length += r.length;
        for (int64_t j = 0; j < r.length; ++j) {
          covered[static_cast<size_t>(r.offset + j)]++;
          ASSERT_EQ(g.locate(r.offset + j), std::make_pair(i, r.ordinal + j));
          ordinals.insert(r.ordinal + j);
        }
      }
      ASSERT_EQ(k, runs.size());
      ASSERT_EQ(length, g.tile_size());
      ASSERT_EQ(static_cast<int64_t>(ordinals.size()), g.tile_size());
    }
    for (int64_t s = 0; s < g.size(); ++s) ASSERT_EQ(covered[static_cast<size_t>(s)], 1) << "slot " << s;
  }
  // Contiguous tiles have one run each; tiles split along the first axis have one run per column.
  EXPECT_EQ(TileGeometry({1, 4}, {8, 2}).footprint_runs(3).size(), 1u);
  EXPECT_EQ(TileGeometry({2, 4}, {8, 2}).footprint_runs(3).size(), 2u);
}

TEST(TileGeometry, RegionsOfACompactSelection) {
  // Tiles (2, 3) of a selection with 3 x 2 tiles per axis: the compact tensor is 6 x 6, column-major.
  const TileGeometry g({4, 4}, {2, 3});
  const std::vector<std::vector<int64_t>> per_axis{{3, 0, 2}, {1, 3}};
  EXPECT_EQ(g.compact_shape(per_axis), (std::vector<int64_t>{6, 6}));
  const std::vector<int64_t> counts{3, 2};
  const std::vector<int64_t> strides = TileGeometry::dense_strides(g.compact_shape(per_axis));
  EXPECT_EQ(strides, (std::vector<int64_t>{1, 6}));
  EXPECT_EQ(TileGeometry::product(g.compact_shape(per_axis)), 36);
  const std::vector<int64_t> selected = g.select(per_axis);
  ASSERT_EQ(selected.size(), 6u);
  for (int64_t k = 0; k < 6; ++k) {
    const TileCoord cc = TileGeometry::compact_coord(k, counts);
    EXPECT_EQ(cc, colex(k, counts));
    EXPECT_EQ(g.tile_coord(selected[static_cast<size_t>(k)]),
              (TileCoord{per_axis[0][static_cast<size_t>(cc[0])], per_axis[1][static_cast<size_t>(cc[1])]}));
    const int64_t base = g.region_base(cc, strides);
    EXPECT_EQ(base, cc[0] * 2 + cc[1] * 3 * 6);
    // Every within-tile ordinal lands at its compact coordinate.
    for (int64_t w = 0; w < g.tile_size(); ++w)
      EXPECT_EQ(base + g.region_offset(w, strides), (cc[0] * 2 + w % 2) + (cc[1] * 3 + w / 2) * 6);
  }
  const std::vector<sw::Run> region = g.region_runs(strides);
  ASSERT_EQ(region.size(), 3u);  // one run of 2 per column of the tile
  for (size_t j = 0; j < region.size(); ++j) {
    EXPECT_EQ(region[j].ordinal, static_cast<int64_t>(2 * j));
    EXPECT_EQ(region[j].offset, static_cast<int64_t>(6 * j));
    EXPECT_EQ(region[j].length, 2);
  }
  EXPECT_SW_THROW(ValueError, "the TileSelection has rank 1 but the tile grid has rank 2", g.select({{0}}));
  EXPECT_SW_THROW(ValueError, "TileSelection coordinate 4 on axis 1 is out of range for the tile grid extent 4",
                  g.select({{0}, {4}}));
  EXPECT_TRUE(g.select({{}, {1}}).empty());
}

TEST(TileGeometry, TileIndexRefusesOtherRanksAndOutOfGridCoordinates) {
  const TileGeometry g({3, 2}, {1, 1});
  EXPECT_EQ(g.tile_index({2, 1}), 5);
  EXPECT_SW_THROW(ValueError, "tile coordinate (3, 0) is out of range for the tile grid (3, 2)", g.tile_index({3, 0}));
  EXPECT_SW_THROW(ValueError, "out of range", g.tile_index({0, -1}));
  EXPECT_SW_THROW(ValueError, "tile coordinate (0,) has rank 1 but the tile grid has rank 2", g.tile_index({0}));
}

TEST(TileGeometry, ConstructionErrorsAndTileTableLimits) {
  EXPECT_SW_THROW(ValueError, "must have one non-zero rank, got 0 and 0", TileGeometry({}, {}));
  EXPECT_SW_THROW(ValueError, "must have one non-zero rank, got 2 and 1", TileGeometry({2, 2}, {2}));
  EXPECT_SW_THROW(ValueError, "extents must be >= 1 (axis 1)", TileGeometry({2, 0}, {2, 2}));
  EXPECT_SW_THROW(ValueError, "extents must be >= 1 (axis 0)", TileGeometry({2}, {-1}));
  EXPECT_SW_THROW(ValueError, "exceeds the supported range (2**62)", TileGeometry({int64_t{1} << 32}, {int64_t{1} << 31}));
  // Note [Tile table limits]: refused before anything is allocated.
  EXPECT_SW_THROW(ValueError, "has 100000000000000 tiles; at most 2**24 (16777216) tiles are supported",
                  TileGeometry({10000000, 10000000}, {1, 1}));
  EXPECT_SW_THROW(ValueError, "has 16777217 tiles", TileGeometry({TileGeometry::kMaxTiles + 1}, {1}));
  EXPECT_NO_THROW(TileGeometry({TileGeometry::kMaxTiles}, {1}));
  EXPECT_SW_THROW(ValueError, "need 2199023255552 contiguous runs; at most 2**26 (67108864) are supported",
                  TileGeometry({2, 1}, {1, int64_t{1} << 40}));
  // One tile row of 2**40 slots is one run: allowed, and its footprint is that one run.
  const TileGeometry row({1, 1}, {1, int64_t{1} << 40});
  EXPECT_EQ(row.footprint_runs(0).size(), 1u);
  EXPECT_EQ(row.footprint_runs(0).front().length, int64_t{1} << 40);
}

TEST(TileGeometry, CheckFootprintsAcceptsTilePermutationsAndRefusesTheRest) {
  const TileGeometry g({2, 2}, {2, 2});  // logical 4 x 4
  EXPECT_NO_THROW(g.check_footprints(column_major(Shape::flat({4, 4})), 0));
  // Within-tile transpose: mode k is (2, 2) with strides (stride of the other within-tile axis, tile stride).
  const Layout transposed(Shape(IntTuple::tuple({IntTuple::tuple({2, 2}), IntTuple::tuple({2, 2})})),
                          Stride(IntTuple::tuple({IntTuple::tuple({4, 2}), IntTuple::tuple({1, 8})})));
  EXPECT_NO_THROW(g.check_footprints(transposed, 0));
  EXPECT_SW_THROW(ValueError, "is not the TiledEvictable's full logical shape (4, 4): tile footprints cannot match",
                  g.check_footprints(column_major(Shape::flat({4, 2})), 0));
  EXPECT_SW_THROW(ValueError, "tensor slot 4 lies outside the TiledEvictable extent",
                  TileGeometry({1}, {4}).check_footprints(column_major(Shape::flat({4})), 1));
  // Row-major crosses tiles: logical tile (1, 0) reaches a slot of carrier tile (0, 1).
  EXPECT_SW_THROW(ValueError, "the tensor's tile footprints do not match the carrier's",
                  g.check_footprints(row_major(Shape::flat({4, 4})), 0));
  const Layout aliasing(Shape::flat({4, 4}), Stride::flat({1, 0}));
  EXPECT_SW_THROW(ValueError, "twice: its tile footprints alias", g.check_footprints(aliasing, 0));
}


// Note [Footprints by structure]: the verdict from strides alone is the slot-by-slot verdict, for every layout of
// one leaf per mode over random small geometries (within-tile strides permuted, tile strides right or wrong).
TEST(TileGeometry, FootprintsByStructureAgreeWithTheSlotBySlotCheck) {
  const uint64_t seed = testing_support::test_seed();
  testing_support::Rng rng(seed);
  int agreed_valid = 0, agreed_invalid = 0;
  for (int round = 0; round < 400; ++round) {
    const size_t rank = static_cast<size_t>(rng.uniform(1, 3));
    std::vector<int64_t> grid, tile, logical;
    for (size_t k = 0; k < rank; ++k) {
      grid.push_back(rng.uniform(1, 3));
      tile.push_back(rng.uniform(1, 4));
      logical.push_back(grid.back() * tile.back());
    }
    const TileGeometry g(grid, tile);
    // Candidate strides: the canonical ones with the within-tile digits of a random order of the modes, or
    // random small strides.
    std::vector<int64_t> canonical = TileGeometry::dense_strides(logical), strides(rank);
    if (rng.chance(0.6)) {
      std::vector<size_t> order(rank);
      for (size_t k = 0; k < rank; ++k) order[k] = k;
      std::shuffle(order.begin(), order.end(), rng.g);
      int64_t run = 1;  // a dense within-tile order, valid when no tile axis spans a mode that a later one needs
      for (size_t k : order) {
        strides[k] = grid[k] > 1 ? canonical[k] : run;
        run *= tile[k];
      }
    } else {
      for (size_t k = 0; k < rank; ++k) strides[k] = rng.uniform(0, 12);
    }
    const Layout layout(Shape::flat(logical), Stride::flat(strides));
    bool fast_ok = true, slow_ok = true;
    try {
      g.check_footprints(layout, 0);
    } catch (const ValueError&) {
      fast_ok = false;
    }
    try {
      g.check_footprints_slot_by_slot(layout, 0);
    } catch (const ValueError&) {
      slow_ok = false;
    }
    ASSERT_EQ(fast_ok, slow_ok) << layout.str() << " over grid " << grid.size() << "-d, seed " << seed;
    (fast_ok ? agreed_valid : agreed_invalid)++;
  }
  EXPECT_GT(agreed_valid, 20);  // both verdicts occur
  EXPECT_GT(agreed_invalid, 20);
}

// A PyTorch row-major expert stack (out, in, E):(in, 1, out * in) is decided from its strides: checking it costs
// nothing like a pass over a 2**31-slot extent.
TEST(TileGeometry, ARowMajorExpertStackIsCheckedFromItsStrides) {
  const int64_t out = 1 << 12, in = 1 << 12, experts = 1 << 7;  // 2**31 slots
  const TileGeometry g({1, 1, experts}, {out, in, 1});
  const Layout rows(Shape::flat({out, in, experts}), Stride::flat({in, 1, out * in}));
  const auto start = std::chrono::steady_clock::now();
  EXPECT_NO_THROW(g.check_footprints(rows, 0));
  EXPECT_LT(std::chrono::steady_clock::now() - start, std::chrono::milliseconds(100));
  EXPECT_SW_THROW(ValueError, "tile footprints",
                  TileGeometry({1, 1, 2}, {4, 4, 1}).check_footprints(
                      Layout(Shape::flat({4, 4, 2}), Stride::flat({4, 1, 17})), 0));
}

}  // namespace
}  // namespace sw
