// TiledEvictable geometry and tile footprints (strideweave/tiled/tiled_evictable.hpp, TileGeometry) against naive
// models over random grids and layouts. TileGeometry alone, with no carrier, is tested in tile_geometry_test.cpp.
// The random seed is printed; set SW_TEST_SEED=<n> to replay a run.
#include <gtest/gtest.h>

#include <set>
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

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

}  // namespace
}  // namespace sw
