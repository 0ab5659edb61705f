// Tiled gradient sums hold their tiles (Note [Gradient sums hold their tiles]): gradient sinks, in-place sums,
// failed read-backs, and a stress test of sums while other threads move and read the tiles.
// The random seed is printed; set SW_TEST_SEED=<n> to replay a run.
#include <gtest/gtest.h>

#include <future>
#include <thread>
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

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
  if (!buffers.empty()) TiledInternals::install_tiles(*g, buffers);
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

// A gradient over 4 tiles of 4 slots whose tiles `ones` hold 1 (tile 1 evicted: a sum reads it back), the others
// implicit, and a fresh gradient of 2 in tiles 0, 1 and 2 to add into it.
std::pair<Tiled, Tiled> sum_of_twos_into_ones(const std::vector<int64_t>& ones) {
  Tiled base = make_tiled({4}, {4});
  Tiled acc = std::static_pointer_cast<TiledEvictable>(base->allocate_like(base->size(), true, F32(), false));
  const std::vector<float> one(4, 1.0f);
  for (int64_t t : ones) acc->write_slots(t * 4, 4, one.data());
  acc->evict_async({1})->value();
  return {acc, gradient_of(acc, {0, 1, 2}, 2.0f)};
}

TEST_F(TiledTest, AGradientSinkHoldsItsTileUntilCommittedOrDropped) {
  Tiled te = make_tiled({4}, {4});
  te->promote_async({0, 1})->value();
  const auto values = seeded(F32(), 16, 0);
  const uint64_t v0 = te->version();
  const TiledStats stats0 = te->stats();
  {
    auto write = TiledInternals::hold_tile_for_update(*te, 0);
    ASSERT_TRUE(write);
    EXPECT_TRUE(te->has_incomplete_work());
    EXPECT_FALSE(TiledInternals::hold_tile_for_update(*te, 0));  // one writer at a time
    // Everything else that would move, read, share or release the tile refuses and asks to wait.
    EXPECT_SW_THROW(RuntimeError, "being added into by a gradient sum", te->evict_async({0}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->evict_async({1, 0}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->promote_async({0}));
    EXPECT_SW_THROW(RuntimeError, "wait", te->get(0));
    EXPECT_SW_THROW(RuntimeError, "wait", te->set(1, F(2.0)));
    EXPECT_SW_THROW(RuntimeError, "wait", begin_work(te, {0}, "projection"));
    EXPECT_SW_THROW(RuntimeError, "wait", pin_for_reading(te));
    EXPECT_SW_THROW(RuntimeError, "wait", te->release());
    EXPECT_FALSE(te->is_released());
    Tiled g = gradient_of(te, {0, 2}, 1.0f);
    EXPECT_FALSE(TiledInternals::accumulate_tiles(*te, *g, false));  // another sum refuses, changing nothing
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
  ASSERT_TRUE(TiledInternals::hold_tile_for_update(*te, 0));
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(te->version(), v0 + 1);
  EXPECT_FALSE(state(*te, 0).dirty);
  // Only resident, native tiles can be held: secondary and implicit ones cannot.
  EXPECT_FALSE(TiledInternals::hold_tile_for_update(*te, 2));
  Tiled zeros = std::static_pointer_cast<TiledEvictable>(te->allocate_like(te->size(), true, F32(), false));
  EXPECT_FALSE(TiledInternals::hold_tile_for_update(*zeros, 0));
  te->evict_async(all_tiles(*te))->value();
  EXPECT_NO_THROW(te->release());
}

// The sum is paused in the middle (the read-back of its secondary tile waits at the pread gate): every tile it
// adds into is held meanwhile, the gradient it adds is pinned, and the sum then lands whole.
TEST_F(TiledTest, AGradientSumHoldsEveryTileItAddsIntoUntilItLands) {
  auto [acc, g] = sum_of_twos_into_ones({0, 1, 3});  // tile 1 is read back by the sum
  const uint64_t v0 = acc->version();
  io::hold(io::Op::Pread);
  auto sum = std::async(std::launch::async, [&] { return TiledInternals::accumulate_tiles(*acc, *g, /*share_other=*/false); });
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
  auto [acc, g] = sum_of_twos_into_ones({0, 1});
  const uint64_t v0 = acc->version();
  const TiledStats stats0 = acc->stats();
  const auto states0 = states(*acc);
  io::inject(io::Op::Pread, EIO, -1);
  EXPECT_SW_THROW(RuntimeError, "EIO", TiledInternals::accumulate_tiles(*acc, *g, false));
  io::clear_faults();
  EXPECT_EQ(acc->version(), v0);
  expect_stats_eq(acc->stats(), stats0);
  expect_states(*acc, states0);
  EXPECT_FALSE(acc->has_incomplete_work());
  EXPECT_FALSE(g->has_incomplete_work());
  EXPECT_EQ(tile_values(*acc, 0), std::vector<float>(4, 1.0f));
  // The same sum succeeds once the fault is gone.
  EXPECT_TRUE(TiledInternals::accumulate_tiles(*acc, *g, false));
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
        if (TiledInternals::accumulate_tiles(*acc, *g, rng.uniform(0, 1) == 1)) {
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
      auto write = TiledInternals::hold_tile_for_update(*acc, t);
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
          auto w = begin_work(acc, {t}, "projection");
          ready_of(w)->wait();
          std::vector<float> v(static_cast<size_t>(kTile), 0.0f);
          if (CarrierPtr b = TiledInternals::tile_buffer(*acc, t)) b->read_slots(0, kTile, v.data());
          (void)w.end();  // no plan: nothing to report
          uniform(v, "work");
        } else if (pick == 1) {
          auto w = pin_for_reading(acc);
          std::vector<float> v(static_cast<size_t>(kTile), 0.0f);
          CarrierPtr b;
          try {
            b = TiledInternals::tile_value(*acc, t);
          } catch (...) {
            (void)w.end();  // no plan: nothing to report
            throw;
          }
          if (b) b->read_slots(0, kTile, v.data());
          (void)w.end();  // no plan: nothing to report
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

}  // namespace
}  // namespace sw
