// TiledEvictable residency semantics: idempotent promotion and eviction, dirty/clean eviction, pins, conflicts and
// release, the residency policy's plans, and failure atomicity under injected I/O faults.
//
// Pending requests are held deterministically with IoBlock (tiled_support.hpp), never with sleeps.
#include <gtest/gtest.h>

#include <mutex>
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

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

TEST_F(TiledTest, BulkReadsGoRunByRunThroughEveryTileStateAndMoveNothing) {
  // read_slots over any range equals slot-by-slot reads, with tiles resident (one dirty), in the secondary and
  // implicit, footprints of several runs (tiles 2 x 3 of an 8 x 6 grid: 3 runs each); a secondary tile is read
  // with one pread per footprint run in the range (not per slot) and stays where it is.
  Tiled proto = make_tiled({4, 2}, {2, 3});
  auto te = std::static_pointer_cast<TiledEvictable>(proto->allocate_like(proto->size(), true, F32(), false));
  for (int64_t s = 0; s < te->size(); ++s)
    if (te->locate(s).first != 5) te->set(s, F(static_cast<double>(s) * 0.5 - 3.0));  // tile 5 stays implicit
  te->evict_async({0, 1, 2, 3})->value();  // written to the secondary
  te->set(te->footprint_runs(6)[1].offset, F(99.0));  // tile 6: resident and dirty
  ASSERT_EQ(state(*te, 2).location, TileLocation::Secondary);
  ASSERT_EQ(state(*te, 5).location, TileLocation::Implicit);
  ASSERT_EQ(state(*te, 6).location, TileLocation::Primary);
  const auto want = peek_all(*te);
  const auto s0 = te->stats();
  const size_t w = slot_bytes(te->dtype());
  for (auto [start, count] : std::vector<std::pair<int64_t, int64_t>>{{0, te->size()}, {5, 17}, {13, 1}, {20, 28}}) {
    std::vector<std::byte> buf(static_cast<size_t>(count) * w);
    te->read_slots(start, count, buf.data());
    for (int64_t k = 0; k < count; ++k)
      EXPECT_EQ(load_value(te->dtype(), buf.data() + static_cast<size_t>(k) * w), want[static_cast<size_t>(start + k)])
          << "slot " << start + k;
  }
  // Tile 2's footprint is 3 runs of 2 slots: reading all of it is 3 preads.
  const auto reads = io::calls(io::Op::Pread);
  for (const sw::Run r : te->footprint_runs(2)) {
    std::vector<std::byte> buf(static_cast<size_t>(r.length) * w);
    te->read_slots(r.offset, r.length, buf.data());
  }
  EXPECT_EQ(io::calls(io::Op::Pread) - reads, 3);
  for (int64_t i = 0; i < te->tile_count(); ++i)
    EXPECT_EQ(state(*te, i).location, i == 5 ? TileLocation::Implicit
                                      : i >= 4 ? TileLocation::Primary : TileLocation::Secondary) << i;
  expect_stats_eq(te->stats(), s0);
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
  auto work = begin_work(te, {0, 4, 4}, "operation");
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
  auto work2 = begin_work(te, {4, 5}, "projection");
  ready_of(work2)->value();
  EXPECT_SW_THROW(RuntimeError, "wait", te->release());
  EXPECT_FALSE(work.end());
  EXPECT_FALSE(work.end());  // idempotent
  EXPECT_SW_THROW(RuntimeError, "wait", te->evict_async({4}));  // still pinned by work2
  te->evict_async({0})->value();
  EXPECT_FALSE(work2.end());
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
    EXPECT_SW_THROW(RuntimeError, "wait", begin_work(te, {1}, "operation"));
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
  EXPECT_SW_THROW(RuntimeError, "released", begin_work(te, {0}, "operation"));
  EXPECT_SW_THROW(RuntimeError, "released", te->get(0));
}

TEST_F(TiledTest, ReleaseRefusedWhileWorkIsIncomplete) {
  Tiled te = make_tiled({2}, {2}, {.primary_full = true, .secondary_full = false});
  auto work = begin_work(te, {1}, "backward");
  EXPECT_SW_THROW(RuntimeError, "wait", te->release());
  EXPECT_FALSE(te->is_released());
  EXPECT_FALSE(te->primary()->is_released());
  EXPECT_EQ(te->get(2), seeded(F32(), 4, 1000)[2]);
  EXPECT_FALSE(work.end());
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
  auto work = begin_work(te, {0}, "projection");
  ready_of(work)->value();
  ASSERT_EQ(policy->calls.size(), 1u);
  EXPECT_EQ(policy->calls[0].first, (std::vector<TileCoord>{{0}}));
  EXPECT_EQ(policy->calls[0].second, "projection");
  EXPECT_EQ(state(*te, 0).location, TileLocation::Primary);
  EXPECT_EQ(state(*te, 2).location, TileLocation::Primary);  // prefetched by the plan
  EXPECT_FALSE(work.end());  // deferred eviction of 0 (3 is not primary: nothing to do), done on return
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(state(*te, 0).location, TileLocation::Secondary);
  EXPECT_EQ(state(*te, 2).location, TileLocation::Primary);

  // Failures before any pin: a throwing policy and an out-of-grid plan.
  policy->fail = true;
  EXPECT_SW_THROW(RuntimeError, "on purpose", begin_work(te, {1}, "operation"));
  policy->fail = false;
  policy->next = {};
  policy->next.evict = {{4}};
  EXPECT_SW_THROW(ValueError, "out of range", begin_work(te, {1}, "backward"));
  EXPECT_FALSE(te->has_incomplete_work());
  te->evict_async(all_tiles(*te))->value();  // nothing pinned
  EXPECT_EQ(snapshot(*te), seeded(F32(), 8, 0));
}

// A WorkToken (cpp/src/tiled/internal.hpp) ends its work exactly once on every path: dropped without end(), its
// pins go and the policy's deferred evictions run, as end() would do; a moved-from token ends nothing; a token
// assigned another work ends the one it held.
TEST_F(TiledTest, AWorkTokenEndsItsWorkWhenDroppedMovedOrReassigned) {
  auto policy = std::make_shared<FixedPolicy>();
  Tiled te = make_tiled({4}, {2}, {}, policy);
  policy->next.evict = {{0}};
  {
    WorkToken work = begin_work(te, {0}, "projection");
    ready_of(work)->value();
    EXPECT_TRUE(te->has_incomplete_work());
    EXPECT_SW_THROW(RuntimeError, "pinned", te->evict_async({0}));
  }
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(state(*te, 0).location, TileLocation::Secondary);  // the deferred eviction ran
  policy->next = {};
  WorkToken first = begin_work(te, {1}, "operation");
  ready_of(first)->value();
  WorkToken moved = std::move(first);
  EXPECT_FALSE(first);
  EXPECT_FALSE(first.end());
  EXPECT_SW_THROW(RuntimeError, "pinned", te->evict_async({1}));  // still pinned: the work moved, it did not end
  moved = begin_work(te, {2}, "operation");
  ready_of(moved)->value();
  EXPECT_NO_THROW(te->evict_async({1})->value());  // the work on tile 1 ended when `moved` took another
  EXPECT_SW_THROW(RuntimeError, "pinned", te->evict_async({2}));
  EXPECT_FALSE(moved.end());
  EXPECT_FALSE(moved.end());
  EXPECT_FALSE(te->has_incomplete_work());
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

}  // namespace
}  // namespace sw
