// TiledEvictable construction (docs/guide.md, "TiledEvictable"): validation order and rolled-back claims, the tile
// table limits, seeding from full tiers, and allocate_like.
#include <gtest/gtest.h>

#include "strideweave/ops.hpp"
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

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
    EXPECT_SW_THROW(RuntimeError, "invalid", begin_work(te, {2}, "operation"));
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


// A C++ program that only builds a TiledEvictable can run an operation on a whole tiled tensor: the constructor
// registers the tiled operation backend (the Python import is not needed for it).
TEST_F(TiledTest, DirectOperationsNeedNoSetup) {
  Tiled te = make_tiled({2}, {4});  // every tile on the secondary tier
  auto t = make_tensor(te, 0, column_major(Shape::flat({8})));
  std::vector<Operand> operands{Operand::of(t), Operand::of(t)};
  TensorPtr sum = call_op(OpId::Add, operands);
  ASSERT_EQ(&sum->carrier->kind(), &cpu_kind());  // an ordinary dense tensor of the compute tier
  for (int64_t i = 0; i < 8; ++i) EXPECT_EQ(sum->get(IntTuple(i)).f, 2 * t->get(IntTuple(i)).f) << i;
}

}  // namespace
}  // namespace sw
