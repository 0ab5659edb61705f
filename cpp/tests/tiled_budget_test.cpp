// One residency budget over several TiledEvictables (Note [One residency budget]) and tiled gradients of 16-bit
// parameters (Note [Tiled gradients of 16-bit parameters]): admission evicts the least recently used tiles of any
// member, a working set that can never fit changes nothing, a Float32 gradient adds into a 16-bit one with one
// rounding per slot.
#include <gtest/gtest.h>

#include "strideweave/errors.hpp"
#include "strideweave/tiled/residency_budget.hpp"
#include "../src/ops/half.hpp"
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

// ---------------------------------------------------------------- Note [One residency budget]

TEST(ResidencyBudget, AdmissionEvictsTheLeastRecentlyUsedTilesOfAnyMember) {
  Tiled a = make_tiled({4}, {4}), b = make_tiled({4}, {4});
  const int64_t tile = 4 * 4;  // bytes of a Float32 tile of 4 slots
  auto budget = std::make_shared<ResidencyBudget>(3 * tile);
  a->set_residency_budget(budget);
  b->set_residency_budget(budget);
  a->promote_async({0, 1})->value();
  b->promote_async({2})->value();
  EXPECT_EQ(budget->stats().resident_bytes, 3 * tile);
  b->promote_async({3})->value();  // a's tile 0 is the least recently used: evicted first
  EXPECT_EQ(a->tile_state({0}).location, TileLocation::Secondary);
  EXPECT_EQ(a->tile_state({1}).location, TileLocation::Primary);
  a->promote_async({0})->value();  // now a's tile 1 is the least recent
  EXPECT_EQ(a->tile_state({1}).location, TileLocation::Secondary);
  const BudgetStats s = budget->stats();
  EXPECT_EQ(s.resident_bytes, 3 * tile);
  EXPECT_EQ(s.peak_bytes, 3 * tile);
  EXPECT_EQ(s.evictions, 2);
  EXPECT_EQ(s.members, 2);
  a.reset();  // a member that goes leaves the budget
  EXPECT_EQ(budget->stats().members, 1);
  EXPECT_EQ(budget->stats().resident_bytes, 2 * tile);
}

TEST(ResidencyBudget, DerivedCarriersDrawFromTheBudget) {
  Tiled a = make_tiled({4}, {4});
  auto budget = std::make_shared<ResidencyBudget>(2 * 16);
  a->set_residency_budget(budget);
  auto g = std::static_pointer_cast<TiledEvictable>(a->allocate_like(a->size(), true, F32(), false));
  EXPECT_EQ(g->residency_budget(), budget);
  a->promote_async({0, 1})->value();
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  tiles.emplace_back(3, a->primary()->allocate_like(4, true, F32(), false));
  TiledInternals::install_tiles(*g, tiles);  // room for the gradient tile: a's tile 0 goes
  EXPECT_EQ(a->tile_state({0}).location, TileLocation::Secondary);
  EXPECT_EQ(g->tile_state({3}).location, TileLocation::Primary);
  EXPECT_EQ(budget->stats().peak_bytes, 2 * 16);
}

TEST(ResidencyBudget, AWorkingSetThatCanNeverFitChangesNothing) {
  Tiled a = make_tiled({4}, {4});
  auto budget = std::make_shared<ResidencyBudget>(2 * 16);
  a->set_residency_budget(budget);
  a->promote_async({0})->value();
  const TiledStats before = a->stats();
  try {
    WorkToken token = TiledInternals::begin_work(a, {1, 2, 3}, "projection");
    FAIL() << "a working set of 3 tiles under a budget of 2 was accepted";
  } catch (const ValueError& e) {
    EXPECT_TRUE(contains(e.what(), "this projection needs 3 tiles (48 bytes)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "nothing was changed")) << e.what();
  }
  EXPECT_EQ(a->stats().promotions, before.promotions);
  EXPECT_EQ(a->stats().evictions, before.evictions);
  EXPECT_EQ(a->tile_state({0}).location, TileLocation::Primary);
  EXPECT_FALSE(a->has_incomplete_work());
  EXPECT_THROW(ResidencyBudget(0), ValueError);
  auto other = std::make_shared<ResidencyBudget>(64);
  EXPECT_THROW(a->set_residency_budget(other), RuntimeError);
  EXPECT_EQ(a->residency_budget(), budget);
  EXPECT_EQ(other->stats().members, 0);
}

// ---------------------------------------------------------------- Note [Tiled gradients of 16-bit parameters]

TEST(TiledGradients16, AFloat32GradientAddsIntoABFloat16OneWithOneRounding) {
  TierSpec spec;
  spec.dtype = &DType::BFloat16();
  Tiled base = make_tiled({4}, {4}, spec);
  auto acc = std::static_pointer_cast<TiledEvictable>(base->allocate_like(base->size(), true, DType::BFloat16(), false));
  // acc: tile 0 resident, tile 1 evicted, tiles 2 and 3 implicit; all hold 1 + 2^-7 where not implicit.
  const float held = 1.0f + 1.0f / 128;
  std::vector<uint16_t> bits(4, detail::float_to_bf16(held));
  acc->write_slots(0, 4, bits.data());
  acc->write_slots(4, 4, bits.data());
  acc->evict_async({1})->value();
  // g: Float32 tiles 0, 1, 2 hold 2^-9 (below half a bf16 ulp of 1 + 2^-7: the sum rounds back), tile 3 implicit.
  auto g = std::static_pointer_cast<TiledEvictable>(base->allocate_like(base->size(), true, F32(), false));
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  const float add = 1.0f / 512 * 3;  // 3 * 2^-9: 1 + 2^-7 + 3 * 2^-9 rounds to 1 + 2 * 2^-7 (nearest)
  for (int64_t t : {0, 1, 2}) {
    CarrierPtr b = g->primary()->allocate_like(4, true, F32(), true);
    std::vector<float> v(4, add);
    b->write_slots(0, 4, v.data());
    tiles.emplace_back(t, std::move(b));
  }
  TiledInternals::install_tiles(*g, tiles);
  const uint64_t version = acc->version();
  ASSERT_TRUE(TiledInternals::accumulate_tiles(*acc, *g, /*share_other=*/false));
  EXPECT_EQ(acc->version(), version + 1);  // one sum, one version
  const float want_held = detail::bf16_to_float(detail::float_to_bf16(held + add));
  const float want_fresh = detail::bf16_to_float(detail::float_to_bf16(add));
  EXPECT_EQ(want_held, 1.0f + 2.0f / 128);
  for (int64_t t = 0; t < 4; ++t) {
    std::vector<uint16_t> out(4);
    acc->read_slots(t * 4, 4, out.data());
    const float want = t < 2 ? want_held : t == 2 ? want_fresh : 0.0f;
    for (uint16_t o : out) EXPECT_EQ(detail::bf16_to_float(o), want) << "tile " << t;
  }
  EXPECT_EQ(acc->dtype(), DType::BFloat16());
  EXPECT_EQ(acc->tile_state({3}).location, TileLocation::Implicit);
}

}  // namespace
}  // namespace sw
