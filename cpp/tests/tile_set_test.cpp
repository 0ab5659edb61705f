// Tile coordinates as values (strideweave/tiled/tile_set.hpp): Note [Canonical tile order], the checks of a
// set of tiles and of a selection's axes, and a selection's expansion. No carrier is built.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "strideweave/errors.hpp"
#include "strideweave/tiled/tile_set.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using Coords = std::vector<TileCoord>;

TEST(TileOrder, FirstAxisFastest) {
  EXPECT_TRUE(tile_order_less({1, 0}, {0, 1}));
  EXPECT_FALSE(tile_order_less({0, 1}, {1, 0}));
  EXPECT_TRUE(tile_order_less({0, 0, 1}, {5, 5, 2}));
  EXPECT_FALSE(tile_order_less({2, 3}, {2, 3}));
}

// Over any grid, canonical order is the order of the tiles' indices (first axis fastest).
TEST(TileOrder, MatchesTileIndexOrder) {
  const uint64_t seed = testing_support::test_seed();
  std::mt19937_64 rng(seed);
  const std::vector<int64_t> grid{3, 1, 4};
  Coords all;
  for (int64_t c = 0; c < grid[2]; ++c)
    for (int64_t b = 0; b < grid[1]; ++b)
      for (int64_t a = 0; a < grid[0]; ++a) all.push_back({a, b, c});  // index order
  Coords shuffled = all;
  std::shuffle(shuffled.begin(), shuffled.end(), rng);
  canonicalize_tiles(shuffled);
  EXPECT_EQ(shuffled, all) << "seed " << seed;
}

TEST(CanonicalizeTiles, ChecksInPythonsOrder) {
  Coords mixed{{0, 0}, {0}, {-1, 0}};
  EXPECT_SW_THROW(ValueError, "same rank, got ranks [1, 2]", canonicalize_tiles(mixed));
  Coords negative{{0, 0}, {0, -2}, {0, 0}};
  EXPECT_SW_THROW(ValueError, "TileSet coordinate (0, -2) has a negative component", canonicalize_tiles(negative));
  Coords one{{-3}};
  EXPECT_SW_THROW(ValueError, "coordinate (-3,) has", canonicalize_tiles(one));
  Coords twice{{1, 0}, {0, 1}, {1, 0}};
  EXPECT_SW_THROW(ValueError, "contain a duplicate", canonicalize_tiles(twice));
  Coords named{{0, -1}};
  EXPECT_SW_THROW(ValueError, "coordinate <as written> has",
                  canonicalize_tiles(named, [](size_t) { return std::string("<as written>"); }));
  Coords empty;
  canonicalize_tiles(empty);
  EXPECT_TRUE(empty.empty());
}

TEST(SelectionAxes, Checks) {
  EXPECT_SW_THROW(ValueError, "needs at least one axis", check_selection_axes({}));
  EXPECT_SW_THROW(ValueError, "axis 1 is empty", check_selection_axes({{0}, {}}));
  EXPECT_SW_THROW(ValueError, "axis 0 contains a duplicate: (2, 1, 2)", check_selection_axes({{2, 1, 2}}));
  EXPECT_SW_THROW(ValueError, "axis 1 contains a negative coordinate: (0, -1) (coordinates must be non-negative)",
                  check_selection_axes({{0}, {0, -1}}));
  check_selection_axes({{3, 0}, {1}});
}

TEST(SelectionTiles, CompactAndCanonical) {
  const TileAxes axes{{2, 0}, {1, 3}};
  EXPECT_EQ(selection_tiles(axes, false), (Coords{{2, 1}, {0, 1}, {2, 3}, {0, 3}}));
  EXPECT_EQ(selection_tiles(axes, true), (Coords{{0, 1}, {2, 1}, {0, 3}, {2, 3}}));
  Coords sorted = selection_tiles(axes, false);
  canonicalize_tiles(sorted);
  EXPECT_EQ(sorted, selection_tiles(axes, true));
}

TEST(TileTuple, AsPythonWritesIt) {
  EXPECT_EQ(tile_tuple_str({}), "()");
  EXPECT_EQ(tile_tuple_str({4}), "(4,)");
  EXPECT_EQ(tile_tuple_str({1, -2, 3}), "(1, -2, 3)");
}

}  // namespace
}  // namespace sw
