// TiledEvictable projection data paths: one resident tile shared copy-on-write (Note [Shared snapshots]), waiters
// that gather themselves (Note [Waiters help]), and copies into a destination.
#include <gtest/gtest.h>

#include <future>
#include "strideweave/grad_mode.hpp"
#include "strideweave/tiled/data.hpp"
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

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
  EXPECT_EQ(p->carrier->native_data(), TiledInternals::tile_buffer(*te, tile)->native_data());  // no copy
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
  EXPECT_EQ(q->carrier->native_data(), TiledInternals::tile_buffer(*te, tile)->native_data());
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
  // Every gather on the selection threads (Note [Gathering in the caller]); restored on every exit.
  struct AsyncGathers {
    int64_t before = set_caller_gather_bytes(0);
    ~AsyncGathers() { set_caller_gather_bytes(before); }
  } async_gathers;
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
  EXPECT_NE(into->carrier->native_data(), TiledInternals::tile_buffer(*te, te->tile_index({0, 1}))->native_data());
  TensorPtr two = project(te, full, {{{0}, {1, 2}}}, nullptr)->value();
  EXPECT_EQ(two->size(), 40);
  EXPECT_NE(two->carrier->native_data(), TiledInternals::tile_buffer(*te, te->tile_index({0, 1}))->native_data());
  Tiled zeros = std::static_pointer_cast<TiledEvictable>(te->allocate_like(te->size(), true, F32(), false));
  TensorPtr z = project(zeros, canonical_full(zeros), {{{1}, {1}}}, nullptr)->value();
  for (int64_t w = 0; w < 20; ++w) EXPECT_EQ(z->carrier->read_value(w), F(0.0)) << w;
}

}  // namespace
}  // namespace sw
