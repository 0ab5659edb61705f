// The compute pool behind parallel_for (cpp/src/ops/compute_pool.cpp): every
// part runs exactly once, regions from several threads at once and regions
// nested inside a part complete (inline) without deadlock, and a region's
// writes are visible to its caller when it returns. Run under TSan by
// `make sanitize`. Regions back to back, with workers that spin and with
// workers that sleep between regions, run every part exactly once and never a
// part of another region.
#include <atomic>
#include <thread>
#include <vector>

#include "../src/ops/strided.hpp"
#include "test_support.hpp"

namespace {

using sw::detail::compute_threads;
using sw::detail::parallel_for;
using sw::detail::run_parts;
using sw::detail::set_compute_spin_us;

TEST(ComputePool, EveryIndexOnceAndWritesVisible) {
  ASSERT_GE(compute_threads(), 1);
  for (int64_t n : {0, 1, 5, 1000, 1 << 20}) {
    std::vector<int> hits(static_cast<size_t>(n), 0);
    parallel_for(n, 64, [&](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) hits[static_cast<size_t>(i)] += 1;  // disjoint ranges: plain writes
    });
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << "n=" << n << " i=" << i;
  }
}

TEST(ComputePool, NestedRegionsRunInline) {
  std::atomic<int64_t> total{0};
  parallel_for(1 << 12, 1 << 8, [&](int64_t b, int64_t e) {
    parallel_for(e - b, 1, [&](int64_t ib, int64_t ie) { total += ie - ib; });
  });
  EXPECT_EQ(total.load(), 1 << 12);
}

TEST(ComputePool, RegionsFromManyThreadsAtOnce) {
  constexpr int kThreads = 8, kRounds = 200;
  std::vector<std::thread> threads;
  std::vector<int64_t> sums(kThreads, 0);
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      for (int r = 0; r < kRounds; ++r) {
        std::vector<int64_t> part(1 << 12, 0);
        parallel_for(static_cast<int64_t>(part.size()), 256, [&](int64_t b, int64_t e) {
          for (int64_t i = b; i < e; ++i) part[static_cast<size_t>(i)] = i;
        });
        int64_t s = 0;
        for (int64_t v : part) s += v;
        sums[t] += s;
      }
    });
  for (auto& th : threads) th.join();
  const int64_t n = 1 << 12;
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(sums[t], kRounds * (n * (n - 1) / 2)) << "thread " << t;
}

// Regions of 1 to 7 parts, back to back: each part of each region runs exactly
// once, with the index it was given, whatever the workers' spin (0: they sleep
// after every region and are woken for the next; long: they never sleep).
TEST(ComputePool, BackToBackRegionsRunEachPartOnce) {
  struct Ctx {
    std::vector<std::atomic<int>>* hits;
    int64_t region, parts;
    std::atomic<int64_t>* strays;
  };
  constexpr int64_t kRegions = 4000, kMaxParts = 7;
  const int64_t saved = set_compute_spin_us(0);
  for (int64_t spin : {int64_t{0}, int64_t{200}, int64_t{100000}}) {
    set_compute_spin_us(spin);
    std::vector<std::atomic<int>> hits(static_cast<size_t>(kRegions * kMaxParts));
    std::atomic<int64_t> strays{0};
    for (int64_t r = 0; r < kRegions; ++r) {
      Ctx ctx{&hits, r, 1 + r % kMaxParts, &strays};
      run_parts(ctx.parts, [](void* c, int64_t i) {
        auto* x = static_cast<Ctx*>(c);
        if (i < 0 || i >= x->parts) ++*x->strays;
        else (*x->hits)[static_cast<size_t>(x->region * kMaxParts + i)].fetch_add(1);
      }, &ctx);
    }
    EXPECT_EQ(strays.load(), 0) << "spin " << spin;
    for (int64_t r = 0; r < kRegions; ++r)
      for (int64_t i = 0; i < kMaxParts; ++i)
        ASSERT_EQ(hits[static_cast<size_t>(r * kMaxParts + i)].load(), i < 1 + r % kMaxParts ? 1 : 0)
            << "spin " << spin << " region " << r << " part " << i;
  }
  EXPECT_EQ(set_compute_spin_us(saved), 100000);
}

TEST(ComputePool, SpinSettingRoundTripsAndClampsAtZero) {
  const int64_t saved = set_compute_spin_us(-5);
  EXPECT_EQ(set_compute_spin_us(7), 0);
  EXPECT_EQ(set_compute_spin_us(saved), 7);
}

}  // namespace
