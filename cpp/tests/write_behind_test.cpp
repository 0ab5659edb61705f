// Write-behind evictions under a residency budget (Note [Write-behind evictions] in cpp/src/tiled/write_behind.cpp):
// dirty tiles are written and evicted on the I/O executor, ahead of need and within a bounded queue; the computing
// thread goes on while those writes are held at the pwrite gate, the budget is never exceeded, a queued tile used
// again is taken back, and a failed write is reported by the next request with nothing lost.
// Deterministic: the writes are held with io::hold(Pwrite) and drained with Executor::io().wait_idle (no sleeps).
#include <gtest/gtest.h>

#include <cerrno>
#include <thread>

#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"
#include "strideweave/tiled/residency_budget.hpp"
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

constexpr int64_t kSlots = 64;            // Float32 slots of a tile
constexpr int64_t kTile = kSlots * 4;     // its bytes
constexpr int64_t kTiles = 16;            // tiles of the carrier (grid {16}, tile {64}: tile i is slots [64 i, 64 i + 64))
constexpr int64_t kMax = 12 * kTile;      // the budget: 12 tiles
constexpr int64_t kQueue = 4 * kTile;     // the write-behind queue's bound: 4 tiles

// The value written into slot s of tile i by the chain (exactly representable: compared bit for bit).
float chain_value(int64_t i, int64_t s) { return static_cast<float>(1000 * i + s) + 0.5f; }

std::vector<float> chain_tile(int64_t i) {
  std::vector<float> v(kSlots);
  for (int64_t s = 0; s < kSlots; ++s) v[static_cast<size_t>(s)] = chain_value(i, s);
  return v;
}

// The tile's values in the secondary tier's file, read straight from it.
std::vector<float> secondary_tile(const TiledEvictable& te, int64_t i) {
  std::vector<float> v(kSlots);
  te.secondary()->read_slots(i * kSlots, kSlots, v.data());
  return v;
}

std::vector<float> resident_tile(const TiledEvictable& te, int64_t i) {
  std::vector<float> v(kSlots);
  te.read_slots(i * kSlots, kSlots, v.data());
  return v;
}

class WriteBehindTest : public TiledTest {
 protected:
  void SetUp() override {
    TiledTest::SetUp();
    te = make_tiled({kTiles}, {kSlots});  // every tile in the secondary tier (a FileBacked anonymous file)
    budget = std::make_shared<ResidencyBudget>(kMax, kQueue);
    te->set_residency_budget(budget);
  }
  void TearDown() override {
    io::unhold();
    EXPECT_TRUE(Executor::io().wait_idle(std::chrono::seconds(60)));
    TiledTest::TearDown();
  }
  // A chain of promotions under the budget: tile i, for i in [0, n), is promoted by a write of its whole value
  // (write_slots promotes it in this thread, making room first), which leaves it dirty.
  void chain(int64_t n) {
    for (int64_t i = 0; i < n; ++i) {
      const std::vector<float> v = chain_tile(i);
      te->write_slots(i * kSlots, kSlots, v.data());
    }
  }
  Tiled te;
  std::shared_ptr<ResidencyBudget> budget;
};

// The chain fills the budget (12 dirty tiles, 12 tiles of room). From the 9th tile on, less than the queue's 4 tiles
// would be free, so the least recently used dirty tiles 0..3 are handed to write-behind; their writes are held at
// the pwrite gate the whole time. The chain completes without waiting for any of them (eviction_waits stays 0, and a
// write in this thread would block at the gate), within the budget; once the gate opens the four tiles are evicted
// and their files hold their values bit for bit, and a flush writes the rest.
TEST_F(WriteBehindTest, AChainOfPromotionsCompletesWhileItsWritesAreHeldAtTheGate) {
  io::hold(io::Op::Pwrite);
  chain(12);
  ASSERT_TRUE(io::wait_held(io::Op::Pwrite, 1, 30)) << "the first write-behind never reached the gate";
  BudgetStats s = budget->stats();
  EXPECT_EQ(s.eviction_waits, 0) << "the computing thread waited on an eviction";
  EXPECT_EQ(s.eviction_wait_ns, 0);
  EXPECT_EQ(s.write_behind_waits, 0);
  EXPECT_EQ(s.evictions, 0);
  EXPECT_EQ(s.write_behind_tiles, 4);
  EXPECT_EQ(s.write_behind_bytes, kQueue);
  EXPECT_EQ(s.resident_bytes, kMax);  // the tiles being written still count
  EXPECT_LE(s.peak_bytes, kMax);
  EXPECT_EQ(io::held_waiting(io::Op::Pwrite), 1);  // one writer per file: the others wait in the queue
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(state(*te, i).location, TileLocation::Primary) << "tile " << i;

  io::unhold();
  ASSERT_TRUE(Executor::io().wait_idle(std::chrono::seconds(60)));
  s = budget->stats();
  EXPECT_EQ(s.write_behind_evictions, 4);
  EXPECT_EQ(s.evictions, 4);
  EXPECT_EQ(s.write_behind_tiles, 0);
  EXPECT_EQ(s.write_behind_bytes, 0);
  EXPECT_EQ(s.resident_bytes, 8 * kTile);
  EXPECT_LE(s.peak_bytes, kMax);
  EXPECT_EQ(s.eviction_waits, 0);
  for (int64_t i = 0; i < 4; ++i) {
    EXPECT_TRUE(same(state(*te, i), {TileLocation::Secondary, true, false})) << "tile " << i;
    EXPECT_EQ(secondary_tile(*te, i), chain_tile(i)) << "tile " << i << " did not reach its file bit for bit";
  }
  for (int64_t i = 4; i < 12; ++i) EXPECT_TRUE(same(state(*te, i), {TileLocation::Primary, true, true}));
  te->flush();
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(secondary_tile(*te, i), chain_tile(i)) << "tile " << i;
  EXPECT_EQ(te->stats().bytes_evicted, 4 * kTile);
}

// A long chain over every tile, three times round (48 admissions into a budget of 12 tiles, each round rewriting
// tiles that earlier rounds evicted): whatever the interleaving with the I/O threads, admissions that need the
// bytes still being written wait for them (the queued tiles count as resident), so the budget's high-water mark
// never passes max_bytes, and after a flush the file holds every tile's last value bit for bit.
TEST_F(WriteBehindTest, TheBudgetIsNeverExceededAndEveryValueReachesTheFile) {
  for (int round = 0; round < 3; ++round)
    for (int64_t i = 0; i < kTiles; ++i) {
      std::vector<float> v = chain_tile(i);
      for (float& x : v) x += static_cast<float>(round);  // exact: small integers plus 0.5
      te->write_slots(i * kSlots, kSlots, v.data());
    }
  BudgetStats s = budget->stats();
  EXPECT_LE(s.peak_bytes, kMax) << "the budget was exceeded";
  EXPECT_GT(s.write_behind_evictions + s.evictions, 0);
  te->flush();
  ASSERT_TRUE(Executor::io().wait_idle(std::chrono::seconds(60)));
  s = budget->stats();
  EXPECT_LE(s.peak_bytes, kMax);
  EXPECT_EQ(s.write_behind_tiles, 0);
  for (int64_t i = 0; i < kTiles; ++i) {
    std::vector<float> want = chain_tile(i);
    for (float& x : want) x += 2.0f;
    const std::vector<float> got = state(*te, i).location == TileLocation::Secondary ? secondary_tile(*te, i)
                                                                                    : resident_tile(*te, i);
    EXPECT_EQ(got, want) << "tile " << i;
    EXPECT_FALSE(state(*te, i).dirty) << "tile " << i;
  }
}

// With the queue off (write_behind_bytes 0) nothing is written ahead: the same chain evicts nothing, and a 13th
// tile evicts the least recently used one inline, a wait the budget counts.
TEST_F(WriteBehindTest, WithTheQueueOffEvictionsAreInlineAndCounted) {
  budget->set_write_behind_bytes(0);
  chain(12);
  EXPECT_EQ(budget->stats().write_behind_tiles, 0);
  EXPECT_EQ(budget->stats().evictions, 0);
  chain(13);  // tiles 0..11 are resident already (rewritten in place); tile 12 needs room
  const BudgetStats s = budget->stats();
  EXPECT_EQ(s.evictions, 1);
  EXPECT_EQ(s.write_behind_evictions, 0);
  EXPECT_EQ(s.eviction_waits, 1);
  EXPECT_GT(s.eviction_wait_ns, 0);
  EXPECT_EQ(s.write_behind_waits, 0);  // an inline eviction, not a wait for a queued write
  EXPECT_EQ(s.write_behind_wait_ns, 0);
  EXPECT_LE(s.peak_bytes, kMax);
  EXPECT_THROW(budget->set_write_behind_bytes(-1), ValueError);
  EXPECT_EQ(budget->write_behind_bytes(), 0);
}

// While tile 0's write is held at the gate, tiles 1..3 wait in the queue. Work on tile 1 takes it back (cancelled:
// it stays resident and dirty, and is never written), then the other queued tiles are evicted when the gate opens.
TEST_F(WriteBehindTest, AQueuedTileUsedAgainIsTakenBackAndStaysResident) {
  io::hold(io::Op::Pwrite);
  chain(12);
  ASSERT_TRUE(io::wait_held(io::Op::Pwrite, 1, 30));
  {
    WorkToken work = begin_work(te, {1}, "projection");
    work.ready()->value();
    EXPECT_EQ(TiledInternals::tile_buffer(*te, 1)->read_value(5).f, chain_value(1, 5));
    EXPECT_FALSE(work.end());
  }
  BudgetStats s = budget->stats();
  EXPECT_EQ(s.write_behind_cancelled, 1);
  EXPECT_EQ(s.write_behind_tiles, 3);
  EXPECT_EQ(s.eviction_waits, 0);
  io::unhold();
  ASSERT_TRUE(Executor::io().wait_idle(std::chrono::seconds(60)));
  s = budget->stats();
  EXPECT_EQ(s.write_behind_evictions, 3);
  EXPECT_TRUE(same(state(*te, 1), {TileLocation::Primary, true, true}));
  for (int64_t i : {0, 2, 3}) EXPECT_TRUE(same(state(*te, i), {TileLocation::Secondary, true, false})) << i;
  EXPECT_EQ(resident_tile(*te, 1), chain_tile(1));
}

// A tile whose write has started is pending; a caller that uses it (another thread here) waits for the write instead
// of being refused with "wait", and then finds it in the secondary tier with its value. The write is held until the
// main thread opens the gate; whichever comes first, the work succeeds and reads the written value.
TEST_F(WriteBehindTest, ATileBeingWrittenIsWaitedForNotRefused) {
  io::hold(io::Op::Pwrite);
  chain(12);
  ASSERT_TRUE(io::wait_held(io::Op::Pwrite, 1, 30));  // tile 0 is being written
  std::exception_ptr error;
  double value = 0;
  std::thread user([&] {
    try {
      WorkToken work = begin_work(te, {0}, "projection");
      work.ready()->value();
      value = TiledInternals::tile_buffer(*te, 0)->read_value(7).f;
      if (auto e = work.end()) std::rethrow_exception(e);
    } catch (...) {
      error = std::current_exception();
    }
  });
  io::unhold();
  user.join();
  EXPECT_FALSE(error) << message_of(error);
  EXPECT_EQ(value, chain_value(0, 7));
  EXPECT_EQ(secondary_tile(*te, 0), chain_tile(0));
}

// A write-behind whose pwrite fails (ENOSPC) commits nothing: the tile stays resident and dirty with its value. The
// next request on the carrier raises the failure (its type and cause) before changing anything; a retry proceeds,
// and a flush then writes every tile.
TEST_F(WriteBehindTest, AFailedWriteIsReportedByTheNextRequestAndTheTileIsNotLost) {
  io::hold(io::Op::Pwrite);  // the chain ends before any write-behind runs (so it is not the request that reports)
  chain(12);
  ASSERT_TRUE(io::wait_held(io::Op::Pwrite, 1, 30));
  io::inject(io::Op::Pwrite, ENOSPC, 1);  // the held write of tile 0 fails once the gate opens
  io::unhold();
  ASSERT_TRUE(Executor::io().wait_idle(std::chrono::seconds(60)));
  BudgetStats s = budget->stats();
  EXPECT_EQ(s.write_behind_failures, 1);
  EXPECT_EQ(s.write_behind_evictions, 3);
  EXPECT_EQ(s.write_behind_tiles, 0);
  EXPECT_LE(s.peak_bytes, kMax);
  EXPECT_TRUE(same(state(*te, 0), {TileLocation::Primary, true, true}));
  const TiledStats before = te->stats();
  const auto states_before = states(*te);
  try {
    te->promote_async({14})->value();
    FAIL() << "the failed write-behind was not reported";
  } catch (const RuntimeError& e) {
    EXPECT_TRUE(contains(e.what(), "a write-behind eviction of tile (0,)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "No space left on device")) << e.what();
    EXPECT_TRUE(contains(e.what(), "resident and dirty (nothing is lost)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "this request changed nothing")) << e.what();
  }
  expect_states(*te, states_before);
  expect_stats_eq(te->stats(), before);
  EXPECT_EQ(resident_tile(*te, 0), chain_tile(0));
  te->promote_async({14})->value();  // reported once: the retry proceeds
  EXPECT_EQ(state(*te, 14).location, TileLocation::Primary);
  te->flush();
  for (int64_t i = 0; i < 12; ++i) EXPECT_EQ(secondary_tile(*te, i), chain_tile(i)) << "tile " << i;
}

// flush() takes back the queued tiles (it writes them itself, they stay resident) and waits for the running write:
// after it, every value is in the file and no tile is dirty. Run on another thread while the gate holds tile 0.
TEST_F(WriteBehindTest, FlushCoversTheQueuedAndRunningWrites) {
  io::hold(io::Op::Pwrite);
  chain(12);
  ASSERT_TRUE(io::wait_held(io::Op::Pwrite, 1, 30));
  std::exception_ptr error;
  std::thread flusher([&] {
    try {
      te->flush();
    } catch (...) {
      error = std::current_exception();
    }
  });
  io::unhold();
  flusher.join();
  EXPECT_FALSE(error) << message_of(error);
  ASSERT_TRUE(Executor::io().wait_idle(std::chrono::seconds(60)));
  for (int64_t i = 0; i < 12; ++i) {
    EXPECT_FALSE(state(*te, i).dirty) << "tile " << i;
    EXPECT_EQ(secondary_tile(*te, i), chain_tile(i)) << "tile " << i;
  }
  EXPECT_EQ(budget->stats().write_behind_tiles, 0);
  EXPECT_LE(budget->stats().peak_bytes, kMax);
}

// release() is not refused because of a write-behind (it is not the caller's work) and lets the queued writes reach
// the file first: after it, a named file holds every tile the budget handed to write-behind.
TEST_F(WriteBehindTest, ReleaseLetsTheQueuedWritesReachTheFile) {
  const std::string path = ::testing::TempDir() + "write_behind_release_" + std::to_string(test_seed()) + ".bin";
  auto secondary = std::make_shared<FileBackedCarrier>(path, F32(), true);
  secondary->grow(kTiles * kSlots, true);
  auto named = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, F32(), true, false), secondary,
                                                std::vector<int64_t>{kTiles}, std::vector<int64_t>{kSlots}, nullptr);
  auto b = std::make_shared<ResidencyBudget>(kMax, kQueue);
  named->set_residency_budget(b);
  secondary.reset();
  io::hold(io::Op::Pwrite);
  for (int64_t i = 0; i < 12; ++i) {
    const std::vector<float> v = chain_tile(i);
    named->write_slots(i * kSlots, kSlots, v.data());
  }
  ASSERT_TRUE(io::wait_held(io::Op::Pwrite, 1, 30));
  ASSERT_EQ(b->stats().write_behind_tiles, 4);
  std::exception_ptr error;
  std::thread releaser([&] {
    try {
      named->release();
    } catch (...) {
      error = std::current_exception();
    }
  });
  io::unhold();
  releaser.join();
  EXPECT_FALSE(error) << message_of(error);
  auto reread = std::make_shared<FileBackedCarrier>(path, F32(), false);
  for (int64_t i = 0; i < 4; ++i) {
    std::vector<float> v(kSlots);
    reread->read_slots(i * kSlots, kSlots, v.data());
    EXPECT_EQ(v, chain_tile(i)) << "tile " << i;
  }
  const std::string warning = named->take_release_discard_warning();
  EXPECT_TRUE(contains(warning, "discards 8 dirty tiles")) << "only the 8 tiles never handed to write-behind: " << warning;
  std::remove(path.c_str());
}

}  // namespace
}  // namespace sw
