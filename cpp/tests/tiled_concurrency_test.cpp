// TiledEvictable under concurrency: a multi-threaded stress test whose tile table and values are checked against a
// sequential model after every round (TensorStore's TestConcurrent + AssertInvariants idea), release racing with
// requests, fork() with requests in flight, and the references requests hold (Note [Letting go before completing],
// Note [Requests' own references]).
// The random seed is printed; set SW_TEST_SEED=<n> to replay a run.
#include <gtest/gtest.h>

#include <map>
#include <thread>
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

// ================================================================ stress

// Invariants of a quiescent carrier: one location per tile, no pending marks or pins,
// consistent statistics, the version and every value equal to the sequential model.
void check_invariants(TiledEvictable& te, const std::vector<double>& model, uint64_t expected_version,
                      const std::string& when) {
  SCOPED_TRACE(when);
  EXPECT_FALSE(te.has_incomplete_work());
  auto all = states(te);
  int64_t primary = 0, secondary = 0;
  for (size_t i = 0; i < all.size(); ++i) {
    const auto& s = all[i];
    const bool one_location = s.location == TileLocation::Primary || s.location == TileLocation::Secondary;
    EXPECT_TRUE(one_location) << "tile " << i << " is " << location_name(s.location);
    EXPECT_TRUE(s.valid) << "tile " << i;
    if (s.dirty) EXPECT_EQ(s.location, TileLocation::Primary) << "tile " << i;
    primary += s.location == TileLocation::Primary;
    secondary += s.location == TileLocation::Secondary;
  }
  EXPECT_EQ(primary + secondary, te.tile_count());
  // tiles_where partitions the grid the same way.
  EXPECT_EQ(static_cast<int64_t>(te.tiles_where([](const TileState& s) { return s.location == TileLocation::Primary; }).size()),
            primary);
  const TiledStats st = te.stats();
  const int64_t tb = tile_bytes(te);
  EXPECT_EQ(st.primary_tiles, primary);
  EXPECT_EQ(st.primary_bytes, primary * tb);
  EXPECT_EQ(st.promotions - st.evictions, st.primary_tiles) << "every tile started on secondary";
  EXPECT_EQ(st.bytes_promoted, st.promotions * tb);
  EXPECT_EQ(st.bytes_evicted % tb, 0);
  EXPECT_EQ(st.evictions, st.bytes_evicted / tb + st.writes_skipped);
  EXPECT_EQ(te.version(), expected_version);
  auto got = peek_all(te);
  int bad = 0;
  for (size_t s = 0; s < model.size(); ++s)
    if (!(got[s] == F(model[s])) && bad++ < 5)
      ADD_FAILURE() << "slot " << s << " (tile " << te.locate(static_cast<int64_t>(s)).first << ", "
                    << location_name(state(te, te.locate(static_cast<int64_t>(s)).first).location) << ") holds "
                    << got[s].f << ", the model " << model[s];
  EXPECT_EQ(bad, 0);
}

struct StressCounters {
  std::atomic<int64_t> ops{0}, conflicts{0}, promotes{0}, evicts{0}, writes{0}, sets{0}, reads{0}, works{0};
  std::atomic<int64_t> unexpected{0};
};

TEST_F(TiledTest, StressConcurrentResidencyAccessAndWork) {
  constexpr int kThreads = 8;
  constexpr int kRounds = 10;
  constexpr int kOps = 400;
  const std::vector<int64_t> grid{4, 4}, tile{2, 3};  // 16 tiles of 6 slots (3 runs each), 96 slots
  Tiled te = make_tiled(grid, tile);
  const int64_t n = te->size(), tiles = te->tile_count();
  std::vector<double> model(static_cast<size_t>(n));
  for (int64_t s = 0; s < n; ++s) model[static_cast<size_t>(s)] = value_for(F32(), s).f;
  uint64_t expected_version = te->version();
  StressCounters c;
  const uint64_t seed = test_seed();

  auto record_unexpected = [&](const std::string& what) {
    if (c.unexpected.fetch_add(1) < 10) ADD_FAILURE() << what;
  };
  // Runs `f`; a RuntimeError directing the caller to wait is an expected conflict.
  auto attempt = [&](const char* what, auto&& f) -> bool {
    try {
      f();
      return true;
    } catch (const RuntimeError& e) {
      if (!contains(e.what(), "wait")) record_unexpected(std::string(what) + ": RuntimeError without 'wait': " + e.what());
      c.conflicts++;
      return false;
    } catch (const std::exception& e) {
      record_unexpected(std::string(what) + ": unexpected exception: " + e.what());
      return false;
    }
  };

  for (int round = 0; round < kRounds; ++round) {
    std::atomic<int64_t> round_sets{0};
    std::vector<std::thread> threads;
    for (int t = 0; t < kThreads; ++t) {
      threads.emplace_back([&, t] {
        Rng rng(seed * 1000003 + static_cast<uint64_t>(round * kThreads + t));
        std::vector<int64_t> mine;  // this thread's slots: the model is exact for them
        for (int64_t s = t; s < n; s += kThreads) mine.push_back(s);
        std::vector<Done> pending;
        auto random_tiles = [&] {
          std::vector<int64_t> v;
          const int64_t k = rng.uniform(1, 4);
          for (int64_t j = 0; j < k; ++j) v.push_back(rng.uniform(0, tiles - 1));  // duplicates allowed
          return v;
        };
        auto own_value = [&](int op) { return static_cast<float>(((round * kOps + op) * kThreads + t) % 4000000); };
        for (int op = 0; op < kOps; ++op) {
          c.ops++;
          const int64_t pick = rng.uniform(0, 99);
          if (pick < 16) {  // promote (sometimes waiting at once)
            auto ts = random_tiles();
            attempt("promote_async", [&] {
              Done d = te->promote_async(ts);
              c.promotes++;
              if (rng.uniform(0, 2) == 0) d->wait();
              pending.push_back(std::move(d));
            });
          } else if (pick < 32) {  // evict
            auto ts = random_tiles();
            attempt("evict_async", [&] {
              Done d = te->evict_async(ts);
              c.evicts++;
              if (rng.uniform(0, 2) == 0) d->wait();
              pending.push_back(std::move(d));
            });
          } else if (pick < 54) {  // write one of my slots (engine write or public set)
            const int64_t s = mine[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(mine.size()) - 1))];
            const float v = own_value(op);
            const bool public_set = rng.uniform(0, 1) == 0;
            if (attempt("write", [&] {
                  if (public_set) te->set(s, F(v));
                  else write_one(*te, s, v);
                })) {
              model[static_cast<size_t>(s)] = v;
              c.writes++;
              if (public_set) round_sets++;
            }
          } else if (pick < 70) {  // read one of my slots: exact
            const int64_t s = mine[static_cast<size_t>(rng.uniform(0, static_cast<int64_t>(mine.size()) - 1))];
            Value got;
            if (attempt("read", [&] {
                  if (rng.uniform(0, 1) == 0) {
                    got = te->get(s);
                  } else {
                    float f = 0;
                    te->read_slots(s, 1, &f);
                    got = F(f);
                  }
                })) {
              c.reads++;
              if (!(got == F(model[static_cast<size_t>(s)])))
                record_unexpected("slot " + std::to_string(s) + " read " + std::to_string(got.f) + ", model " +
                                  std::to_string(model[static_cast<size_t>(s)]));
            }
          } else if (pick < 76) {  // read any slot (another thread may be writing it)
            const int64_t s = rng.uniform(0, n - 1);
            attempt("read other", [&] { (void)te->get(s); });
          } else if (pick < 94) {  // tiled work: pin, wait until readable, use, end
            auto ts = random_tiles();
            WorkToken w;
            if (!attempt("begin_work", [&] { w = begin_work(te, ts, "operation"); })) continue;
            c.works++;
            const auto pinned = sorted_unique(ts);
            ready_of(w)->wait();
            if (auto e = ready_of(w)->error()) record_unexpected("work promotion failed: " + message_of(e));
            for (int64_t i : pinned) {
              TileState s = state(*te, i);
              if (s.location != TileLocation::Primary)
                record_unexpected("pinned tile " + std::to_string(i) + " is " + location_name(s.location));
            }
            // Pinned, ready tiles are never pending: my slots in them read without conflict, and
            // writes to them are refused (the work needs their values unchanged).
            for (int64_t s : mine) {
              if (!std::binary_search(pinned.begin(), pinned.end(), te->locate(s).first)) continue;
              try {
                if (!(te->get(s) == F(model[static_cast<size_t>(s)])))
                  record_unexpected("pinned slot " + std::to_string(s) + " differs from the model");
              } catch (const std::exception& e) {
                record_unexpected(std::string("read of a pinned, ready tile failed: ") + e.what());
              }
              if (rng.uniform(0, 2) == 0) {
                try {
                  write_one(*te, s, own_value(op));
                  record_unexpected("a write to a pinned tile succeeded");
                } catch (const RuntimeError& e) {
                  if (!contains(e.what(), "wait")) record_unexpected(std::string("pinned write: ") + e.what());
                }
              }
            }
            // A pinned tile refuses eviction.
            try {
              (void)te->evict_async({pinned.front()});
              record_unexpected("evicting a pinned tile succeeded");
            } catch (const RuntimeError& e) {
              if (!contains(e.what(), "wait")) record_unexpected(std::string("pinned eviction: ") + e.what());
            }
            if (w.end()) record_unexpected("ending work failed");
          } else {  // table queries
            (void)te->stats();
            (void)te->has_incomplete_work();
            (void)state(*te, rng.uniform(0, tiles - 1));
            (void)te->tiles_where([](const TileState& s) { return s.dirty; });
          }
        }
        for (auto& d : pending) {
          d->wait();
          if (auto e = d->error()) record_unexpected("a residency request failed: " + message_of(e));
        }
      });
    }
    for (auto& th : threads) th.join();
    expected_version += static_cast<uint64_t>(round_sets.load());
    check_invariants(*te, model, expected_version, "after round " + std::to_string(round));
    // Quiescent: a random eviction succeeds (nothing is pinned or pending any more).
    Rng rng(seed + static_cast<uint64_t>(round));
    std::vector<int64_t> some;
    for (int64_t i = 0; i < tiles; ++i)
      if (rng.uniform(0, 1)) some.push_back(i);
    EXPECT_NO_THROW(te->evict_async(some)->value());
    check_invariants(*te, model, expected_version, "after the evictions of round " + std::to_string(round));
    if (HasFailure()) break;
  }

  // Final: everything to secondary (proves no pins or pending marks), the file equals the model,
  // then everything back, then release.
  ASSERT_NO_THROW(te->evict_async(all_tiles(*te))->value());
  for (const auto& s : states(*te)) {
    EXPECT_EQ(s.location, TileLocation::Secondary);
    EXPECT_FALSE(s.dirty);
  }
  auto file = secondary_values(*te);
  for (int64_t s = 0; s < n; ++s) EXPECT_EQ(file[static_cast<size_t>(s)], F(model[static_cast<size_t>(s)])) << "slot " << s;
  te->promote_async(all_tiles(*te))->value();
  check_invariants(*te, model, expected_version, "final");
  EXPECT_NO_THROW(te->release());
  EXPECT_TRUE(te->secondary()->is_released());
  std::cout << "[ INFO     ] stress: " << c.ops << " ops, " << c.promotes << " promotions, " << c.evicts
            << " evictions, " << c.writes << " writes, " << c.reads << " checked reads, " << c.works
            << " works, " << c.conflicts << " conflicts" << std::endl;
  EXPECT_EQ(c.unexpected.load(), 0);
  EXPECT_GT(c.conflicts.load(), 0) << "the stress test should provoke conflicts";
  EXPECT_GT(c.works.load(), 0);
}


// release() racing with requests from other threads: every attempt either refuses with
// RuntimeError (wait) or releases; once released, every request fails; a request that was
// accepted always reaches a terminal state, and after release no tile storage remains.
TEST_F(TiledTest, StressReleaseRacesWithRequests) {
  constexpr int kIterations = 60;
  const uint64_t seed = test_seed();
  std::atomic<int64_t> unexpected{0}, accepted{0}, refused_released{0};
  auto bad = [&](const std::string& what) {
    if (unexpected.fetch_add(1) < 10) ADD_FAILURE() << what;
  };
  for (int iter = 0; iter < kIterations; ++iter) {
    Tiled te = make_tiled({4}, {4});
    te->promote_async({0, 2})->value();
    write_one(*te, 1, 5.0f);
    std::atomic<bool> released{false};
    std::vector<std::thread> threads;
    std::mutex m;
    std::vector<Done> done;
    for (int t = 0; t < 3; ++t)
      threads.emplace_back([&, t] {
        Rng rng(seed * 7919 + static_cast<uint64_t>(iter * 3 + t));
        int after = 0;
        while (after < 20) {
          const bool was_released = released.load();
          try {
            const int64_t pick = rng.uniform(0, 3);
            std::vector<int64_t> ts{rng.uniform(0, 3), rng.uniform(0, 3)};
            if (pick == 0) {
              Done d = te->promote_async(ts);
              std::lock_guard lock(m);
              done.push_back(d);
            } else if (pick == 1) {
              Done d = te->evict_async(ts);
              std::lock_guard lock(m);
              done.push_back(d);
            } else if (pick == 2) {
              auto w = begin_work(te, ts, "operation");
              ready_of(w)->wait();
              (void)w.end();  // a racing release leaves nothing to evict
            } else {
              (void)te->get(rng.uniform(0, 15));
            }
            accepted++;
            if (was_released) bad("a request succeeded after release()");
          } catch (const RuntimeError& e) {
            if (contains(e.what(), "released")) refused_released++;
            else if (!contains(e.what(), "wait") && !contains(e.what(), "invalid"))
              bad(std::string("unexpected RuntimeError: ") + e.what());
          } catch (const std::exception& e) {
            bad(std::string("unexpected exception: ") + e.what());
          }
          if (was_released) ++after;
        }
      });
    const int64_t base = accepted.load();
    while (accepted.load() < base + 30 && unexpected.load() == 0) std::this_thread::yield();  // let requests flow first
    while (true) {
      try {
        te->release();
        break;
      } catch (const RuntimeError& e) {
        if (!contains(e.what(), "wait")) {
          bad(std::string("release: ") + e.what());
          break;
        }
      }
      std::this_thread::yield();
    }
    released = true;
    for (auto& th : threads) th.join();
    for (auto& d : done) d->wait();  // terminal, successfully or not
    EXPECT_TRUE(te->is_released());
    EXPECT_FALSE(te->has_incomplete_work());
    EXPECT_EQ(te->stats().primary_tiles, 0);
    EXPECT_TRUE(te->tiles_where([](const TileState& s) { return s.location != TileLocation::Invalid; }).empty());
    EXPECT_TRUE(te->primary()->is_released());
    EXPECT_TRUE(te->secondary()->is_released());
    if (HasFailure()) break;
  }
  std::cout << "[ INFO     ] release race: " << accepted << " accepted, " << refused_released
            << " refused as released" << std::endl;
  EXPECT_EQ(unexpected.load(), 0);
}

// ---------------------------------------------------------------- Note [Letting go before completing]

// Note [Fork safety]: a child of fork() made while a promotion is queued on the (blocked) I/O threads and a work
// request pins a tile forgets both: the inherited handle fails at once with "created before fork", no tile is
// pending or pinned there, and the child's own promotions and evictions run on its own pools with exact values.
// The parent's requests complete normally.
TEST_F(TiledTest, AForkedChildForgetsRequestsInFlightAndRunsItsOwn) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer does not run threads in a child of a threaded fork()";
#endif
  Tiled te = make_tiled({4}, {4});
  const auto values = seeded(F32(), 16, 0);
  te->promote_async({3})->value();  // tile I/O: the I/O pool has threads
  auto work = begin_work(te, {2}, "operation");
  ready_of(work)->value();  // tile 2 resident and pinned
  Done held;
  int code = -1;
  {
    IoBlock block;
    held = te->promote_async({0, 1});
    ASSERT_FALSE(held->done());
    code = run_in_forked_child([&] {
      if (!held->done() || !held->error()) return 2;
      try {
        std::rethrow_exception(held->error());
      } catch (const RuntimeError& e) {
        if (!contains(e.what(), "created before fork")) return 3;
      }
      if (te->has_incomplete_work()) return 4;  // no pending mark, no pin, no count left
      te->promote_async({0, 1})->value();
      for (int64_t t = 0; t < 4; ++t)
        if (state(*te, t).location != TileLocation::Primary) return 5;
      te->evict_async({0, 1, 2, 3})->value();  // tile 2 is no longer pinned here
      for (int64_t t = 0; t < 4; ++t)
        if (state(*te, t).location != TileLocation::Secondary) return 6;
      te->promote_async({1, 2})->value();
      if (snapshot(*te) != values) return 7;
      return 0;
    });
    block.open();
    held->value();
  }
  EXPECT_EQ(code, 0) << "the forked child failed check " << code << " (142: it hung)";
  EXPECT_EQ(state(*te, 0).location, TileLocation::Primary);
  EXPECT_SW_THROW(RuntimeError, "pinned", te->evict_async({2}));  // the parent's work still pins it
  EXPECT_EQ(work.end(), nullptr);
  te->evict_async({0, 1, 2, 3})->value();
  EXPECT_EQ(snapshot(*te), values);
}

// A residency budget's lock is held across fork() like the other small locks: a thread that holds it when another
// forks (an I/O thread admitting a tile, say) delays the fork instead of leaving the child a budget locked forever.
// Here a thread holds the budget's lock until the forking thread is about to fork; the child then uses the budget.
TEST_F(TiledTest, AForkedChildCanUseAResidencyBudgetLockedAtTheFork) {
#if defined(__SANITIZE_THREAD__)
  GTEST_SKIP() << "ThreadSanitizer does not run threads in a child of a threaded fork()";
#endif
  Tiled te = make_tiled({4}, {4});
  auto budget = std::make_shared<ResidencyBudget>(2 * tile_bytes(*te));
  te->set_residency_budget(budget);
  // The holder lets go once fork() has started (this test's prepare handler ran: handlers run in reverse order of
  // registration, so before the engine's) and either fork() has returned in the parent (without the budget's
  // lock among the engine's: the child was made with the lock held) or 200 ms passed (with it: fork() waits
  // for the holder, so this wait only delays the fork).
  static std::atomic<bool> armed{false}, preparing{false}, returned{false};
  static const bool registered = (pthread_atfork([] { if (armed) preparing = true; },
                                                 [] { if (armed) returned = true; }, nullptr), true);
  (void)registered;
  preparing = returned = false;
  armed = true;
  std::atomic<bool> locked{false};
  std::thread holder([&] {
    std::lock_guard lock(detail::budget_lock(budget.get()));
    locked = true;
    while (!preparing) std::this_thread::yield();
    const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(200);
    while (!returned && std::chrono::steady_clock::now() < until) std::this_thread::yield();
  });
  while (!locked) std::this_thread::yield();
  const int code = run_in_forked_child([&] {
    te->promote_async({0, 1})->value();
    te->promote_async({2})->value();  // admission evicts the least recent tile
    if (budget->stats().resident_tiles != 2 || budget->stats().evictions != 1) return 2;
    return 0;
  }, 20);
  armed = false;
  holder.join();
  EXPECT_EQ(code, 0) << "the forked child failed check " << code << " (142: it hung)";
  EXPECT_EQ(budget->stats().resident_tiles, 0);  // the parent's budget is untouched
}

TEST_F(TiledTest, AWaitedRequestHoldsNoReferenceToTheCarrier) {
  // A tiled gradient adds in place only when its holder owns the carrier alone; so once a residency request's
  // handle reports completion, the request's transfers must no longer hold the carrier. Each round waits and
  // checks at once, with the I/O threads as close behind as they get.
  Tiled te = make_tiled({8}, {16});
  int extra_after_promote = 0, extra_after_evict = 0;
  for (int round = 0; round < 2000; ++round) {
    const std::vector<int64_t> tiles{round % 8, (round + 3) % 8};
    te->promote_async(tiles)->value();
    extra_after_promote += te.use_count() != 1;
    te->evict_async(tiles)->value();
    extra_after_evict += te.use_count() != 1;
  }
  EXPECT_EQ(extra_after_promote, 0);
  EXPECT_EQ(extra_after_evict, 0);
}

// Note [Requests' own references]: while requests are under way, the caller's reference still counts as the
// only one, at every moment (the requests take, drop and uncount theirs on the I/O threads meanwhile), and a
// second reference never does.
TEST_F(TiledTest, RequestsUnderWayAreNotOtherReferences) {
  CarrierPtr c = make_tiled({8}, {64});
  auto* te = static_cast<TiledEvictable*>(c.get());
  int64_t wrong = 0, checks = 0;
  auto check_while = [&](std::vector<CompletionPtr<std::monostate>>& pending) {
    for (bool busy = true; busy;) {
      busy = false;
      for (auto& p : pending) busy |= !p->done();
      wrong += !TiledInternals::only_reference_is(*te, c);
      ++checks;
    }
    for (auto& p : pending) p->value();
    wrong += !TiledInternals::only_reference_is(*te, c);
    CarrierPtr second = c;
    wrong += TiledInternals::only_reference_is(*te, c);
  };
  for (int round = 0; round < 300; ++round) {
    std::vector<CompletionPtr<std::monostate>> pending;
    for (int64_t t = 0; t < 8; ++t) pending.push_back(te->promote_async({t}));  // one request per tile
    check_while(pending);
    te->write_value(round % 8 * 64, F(float(round)));  // dirty: the eviction writes
    pending.clear();
    for (int64_t t = 0; t < 8; ++t) pending.push_back(te->evict_async({t}));
    check_while(pending);
  }
  EXPECT_EQ(wrong, 0) << "of " << checks << " checks";
  EXPECT_EQ(c.use_count(), 1);
}

}  // namespace
}  // namespace sw
