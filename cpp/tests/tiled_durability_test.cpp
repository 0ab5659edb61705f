// Durability of a TiledEvictable's values (strideweave/tiled/tiled_evictable.hpp): a residency policy's failed
// eviction reaches the work that planned it (Note [A failed deferred eviction reaches the work]; the work is a
// WorkToken of cpp/src/tiled/internal.hpp); flush writes every dirty tile, syncs the tier and keeps the tiles
// resident, all-or-nothing (Note [Flushing tiles]); a read-only secondary tier refuses writes before they happen
// (Note [A read-only secondary tier]); dirty tiles of a named file are counted when discarded
// (Note [Dirty tiles are never discarded silently]).
//
// Faults come from io::inject; nothing sleeps.
#include <gtest/gtest.h>

#include <cerrno>
#include <mutex>
#include <string>
#include <vector>

#include "strideweave/carriers/native.hpp"
#include "strideweave/io.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"
#include "../src/tiled/internal.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using Tiled = std::shared_ptr<TiledEvictable>;

const DType& F32() { return DType::Float32(); }

bool contains(const std::string& s, const char* fragment) { return s.find(fragment) != std::string::npos; }

// A policy that plans the same evictions after every request.
class EvictAfter final : public ResidencyPolicy {
 public:
  explicit EvictAfter(std::vector<TileCoord> evict) { plan_.evict = std::move(evict); }
  ResidencyPlan plan(const std::vector<TileCoord>&, const char*) override { return plan_; }

 private:
  ResidencyPlan plan_;
};

// `tiles` one-run tiles of 4 slots: a full CPU primary (every tile dirty) over an anonymous secondary file, or
// over `secondary` when given.
Tiled make_dirty(int64_t tiles, std::shared_ptr<ResidencyPolicy> policy = nullptr, CarrierPtr secondary = nullptr) {
  auto primary = std::make_shared<CPUCarrier>(tiles * 4, F32(), true, false);
  fill_slots(*primary, 1000);
  if (!secondary) secondary = std::make_shared<FileBackedCarrier>("", F32(), true);
  return std::make_shared<TiledEvictable>(primary, secondary, std::vector<int64_t>{tiles}, std::vector<int64_t>{4},
                                          std::move(policy));
}

std::vector<Value> seeded(int64_t n, int64_t salt) {
  std::vector<Value> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(value_for(F32(), i + salt));
  return v;
}

std::string locations(const TiledEvictable& te) {
  std::string out;
  for (int64_t i = 0; i < te.tile_count(); ++i) {
    TileState s = te.tile_state(te.tile_coord(i));
    out += std::string(location_name(s.location)) + (s.dirty ? "*" : "") + " ";
  }
  return out;
}

class DurabilityTest : public ::testing::Test {
 protected:
  void SetUp() override { io::clear_faults(); }
  void TearDown() override { io::clear_faults(); }
};

// ================================================================ a policy's failed eviction

TEST_F(DurabilityTest, AFailedDeferredEvictionIsReturnedByEndWorkAndChangesNothing) {
  Tiled te = make_dirty(3, std::make_shared<EvictAfter>(std::vector<TileCoord>{{1}, {2}}));
  const std::string before = locations(*te);
  const TiledStats stats = te->stats();
  io::inject(io::Op::Pwrite, ENOSPC, -1);
  auto work = TiledInternals::begin_work(te, {0}, "projection");
  work.ready()->value();
  std::exception_ptr error = work.end();
  ASSERT_TRUE(error);
  const std::string message = message_of(error);
  EXPECT_TRUE(contains(message, "the projection failed")) << message;
  EXPECT_TRUE(contains(message, "eviction of tiles (1,), (2,)")) << message;
  EXPECT_TRUE(contains(message, "No space left on device (ENOSPC)")) << message;
  EXPECT_SW_THROW(RuntimeError, "ENOSPC", std::rethrow_exception(error));
  EXPECT_EQ(locations(*te), before);  // primary* everywhere
  EXPECT_EQ(te->stats().evictions, stats.evictions);
  EXPECT_EQ(te->stats().primary_tiles, 3);
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_FALSE(work.end());  // ended once: nothing again

  // The work failed too: its own error (and kind) is reported, naming the failed eviction.
  auto failed = TiledInternals::begin_work(te, {0}, "operation");
  error = failed.end(std::make_exception_ptr(ValueError("the gather failed")));
  EXPECT_SW_THROW(ValueError, "the gather failed; besides, the residency policy planned the eviction of tiles (1,), (2,)",
                  std::rethrow_exception(error));
  EXPECT_TRUE(contains(message_of(error), "ENOSPC")) << message_of(error);

  io::clear_faults();
  auto again = TiledInternals::begin_work(te, {0}, "projection");
  EXPECT_FALSE(again.end());
  EXPECT_EQ(locations(*te), "primary* secondary secondary ");
  EXPECT_EQ(te->stats().evictions, 2);
  const std::vector<Value> file = bulk_snapshot(*te->secondary()), values = seeded(12, 1000);
  EXPECT_EQ(std::vector<Value>(file.begin() + 4, file.end()), std::vector<Value>(values.begin() + 4, values.end()));
}

TEST_F(DurabilityTest, ADeferredEvictionLeavesOutTilesOtherWorkPinsOrAnotherRequestHas) {
  Tiled te = make_dirty(3, std::make_shared<EvictAfter>(std::vector<TileCoord>{{1}}));
  auto holder = TiledInternals::begin_work(te, {1}, "projection");  // pins tile 1
  auto work = TiledInternals::begin_work(te, {0}, "projection");
  EXPECT_FALSE(work.end());  // tile 1 is pinned: left out, not a failure
  EXPECT_EQ(locations(*te), "primary* primary* primary* ");
  EXPECT_FALSE(holder.end());  // its own plan evicts tile 1 now that no work pins it
  EXPECT_EQ(locations(*te), "primary* secondary primary* ");
}

// ================================================================ flush

TEST_F(DurabilityTest, FlushWritesEveryDirtyTileSyncsOnceAndKeepsThemResident) {
  Tiled te = make_dirty(4);
  const int64_t writes = io::calls(io::Op::Pwrite), syncs = io::calls(io::Op::Fsync);
  const uint64_t version = te->version();
  te->flush_async()->value();
  EXPECT_EQ(io::calls(io::Op::Pwrite) - writes, 4);
  EXPECT_EQ(io::calls(io::Op::Fsync) - syncs, 1);
  EXPECT_EQ(locations(*te), "primary primary primary primary ");
  EXPECT_EQ(bulk_snapshot(*te->secondary()), seeded(16, 1000));
  EXPECT_EQ(te->stats().flushes, 4);
  EXPECT_EQ(te->stats().bytes_flushed, 4 * 4 * 4);
  EXPECT_EQ(te->stats().primary_tiles, 4);
  EXPECT_EQ(te->stats().evictions, 0);
  EXPECT_EQ(te->version(), version);
  // Nothing dirty: no write, one sync; the blocking form runs in this thread.
  te->flush();
  EXPECT_EQ(io::calls(io::Op::Pwrite) - writes, 4);
  EXPECT_EQ(io::calls(io::Op::Fsync) - syncs, 2);
}

TEST_F(DurabilityTest, AFailedSyncLeavesEveryTileDirtyAndARetryWritesThemAgain) {
  Tiled te = make_dirty(3);
  const std::string before = locations(*te);
  io::inject(io::Op::Fsync, EIO, 1);
  auto done = te->flush_async();
  done->wait();
  EXPECT_TRUE(contains(message_of(done->error()), "fsync of")) << message_of(done->error());
  EXPECT_EQ(locations(*te), before);
  EXPECT_EQ(te->stats().flushes, 0);
  EXPECT_FALSE(te->has_incomplete_work());
  const int64_t writes = io::calls(io::Op::Pwrite);
  te->flush();
  EXPECT_EQ(io::calls(io::Op::Pwrite) - writes, 3);  // written again, not only synced again
  EXPECT_EQ(locations(*te), "primary primary primary ");
}

TEST_F(DurabilityTest, FlushRefusesWhileATileHasAnIncompleteRequest) {
  Tiled te = make_dirty(2);
  io::hold(io::Op::Pwrite);
  auto eviction = te->evict_async({0});
  EXPECT_SW_THROW(RuntimeError, "wait for it before flushing", te->flush_async());
  io::unhold();
  eviction->value();
  te->flush();
  EXPECT_EQ(locations(*te), "secondary primary ");
}

// ================================================================ a read-only secondary tier

TEST_F(DurabilityTest, AReadOnlySecondaryRefusesDirtyEvictionsAndFlushesBeforeWriting) {
  TempPath file("sw-readonly");
  {
    auto seed = std::make_shared<FileBackedCarrier>(file.path(), F32(), true);
    seed->grow(12, true);
    fill_slots(*seed, 0);
  }
  auto secondary = std::make_shared<FileBackedCarrier>(file.path(), F32(), false);
  auto primary = std::make_shared<CPUCarrier>(0, F32(), true, false);
  Tiled te = std::make_shared<TiledEvictable>(primary, secondary, std::vector<int64_t>{3}, std::vector<int64_t>{4},
                                              nullptr);
  te->promote_async({0, 1})->value();
  te->set(5, F(99.0));  // tile 1 dirty
  const int64_t writes = io::calls(io::Op::Pwrite);
  EXPECT_SW_THROW(RuntimeError, "cannot evict dirty tile (1,) of TiledEvictable: its secondary tier FileBacked '",
                  te->evict_async({0, 1}));
  EXPECT_SW_THROW(RuntimeError, "is read-only (created with mutable=False)", te->flush_async());
  EXPECT_EQ(io::calls(io::Op::Pwrite), writes);
  EXPECT_EQ(locations(*te), "primary primary* secondary ");
  EXPECT_EQ(bulk_snapshot(*secondary), seeded(12, 0));
  te->evict_async({0})->value();  // clean: no write
  EXPECT_EQ(locations(*te), "secondary primary* secondary ");
  EXPECT_EQ(io::calls(io::Op::Pwrite), writes);
}

// ================================================================ dirty tiles discarded

std::mutex g_reports_mutex;
std::vector<std::string> g_reports;
void record_report(const std::string& warning) noexcept {
  std::lock_guard lock(g_reports_mutex);
  g_reports.push_back(warning);
}

TEST_F(DurabilityTest, DirtyTilesOfANamedFileAreCountedWhenDiscarded) {
  TiledEvictable::set_discard_reporter(&record_report);
  TempPath a("sw-named"), b("sw-named"), c("sw-named");
  auto named = [](const TempPath& p) { return std::make_shared<FileBackedCarrier>(p.path(), F32(), true); };
  // Release: counted once.
  Tiled released = make_dirty(3, nullptr, named(a));
  EXPECT_TRUE(released->secondary_is_named_file());
  released->release();
  const std::string warning = released->take_release_discard_warning();
  EXPECT_TRUE(contains(warning, "discards 3 dirty tiles on release()")) << warning;
  EXPECT_TRUE(contains(warning, a.path().c_str())) << warning;
  EXPECT_EQ(released->take_release_discard_warning(), "");
  // Exit: every live carrier of a named file with dirty tiles, once; flushed and anonymous ones are silent.
  Tiled alive = make_dirty(2, nullptr, named(b));
  Tiled flushed = make_dirty(2, nullptr, named(c));
  flushed->flush();
  Tiled anonymous = make_dirty(2);
  std::vector<std::string> at_exit = TiledEvictable::exit_discard_warnings();
  ASSERT_EQ(at_exit.size(), 1u);
  EXPECT_TRUE(contains(at_exit[0], "discards 2 dirty tiles at interpreter exit")) << at_exit[0];
  EXPECT_TRUE(TiledEvictable::exit_discard_warnings().empty());
  // Destruction: a carrier reported at exit stays silent; an unreported one reports through the reporter.
  alive.reset();
  flushed.reset();
  anonymous.reset();
  EXPECT_TRUE(g_reports.empty());
  TempPath d("sw-named");
  make_dirty(1, nullptr, named(d)).reset();
  ASSERT_EQ(g_reports.size(), 1u);
  EXPECT_TRUE(contains(g_reports[0], "discards 1 dirty tile as it is destroyed")) << g_reports[0];
  TiledEvictable::set_discard_reporter(nullptr);
}

}  // namespace
}  // namespace sw
