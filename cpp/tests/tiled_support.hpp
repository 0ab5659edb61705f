// Shared helpers of the TiledEvictable suites (tiled_*_test.cpp): naive geometry, carriers over CPU and
// anonymous-file tiers, tile-state checks, the engine hooks of work requests, and IoBlock, which holds pending
// requests deterministically by occupying every thread of the I/O executor with a gated blocker (never sleeps).
// Header-only; not a *_test.cpp, so CMake builds no executable from it.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <functional>
#include <string>
#include <vector>

#include "strideweave/carriers/native.hpp"
#include "strideweave/io.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"
#include "../src/tiled/internal.hpp"
#include "test_support.hpp"

namespace sw {
namespace tiled_testing {

using namespace testing_support;
using Tiled = std::shared_ptr<TiledEvictable>;
using Done = CompletionPtr<std::monostate>;

inline const DType& F32() { return DType::Float32(); }
inline const DType& I32() { return DType::Int32(); }

inline bool contains(const std::string& s, const char* fragment) { return s.find(fragment) != std::string::npos; }

// ---------------------------------------------------------------- naive geometry

inline std::vector<int64_t> colex_decode(int64_t ordinal, const std::vector<int64_t>& extents) {
  std::vector<int64_t> c(extents.size());
  for (size_t k = 0; k < extents.size(); ++k) {
    c[k] = ordinal % extents[k];
    ordinal /= extents[k];
  }
  return c;
}

inline int64_t colex_encode(const std::vector<int64_t>& c, const std::vector<int64_t>& extents) {
  int64_t o = 0, scale = 1;
  for (size_t k = 0; k < extents.size(); ++k) {
    o += c[k] * scale;
    scale *= extents[k];
  }
  return o;
}

inline int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (int64_t x : v) p *= x;
  return p;
}

inline std::string str(const std::vector<int64_t>& v) {
  std::string s = "(";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? "," : "") + std::to_string(v[i]);
  return s + ")";
}

// ---------------------------------------------------------------- carriers

struct TierSpec {
  bool primary_full = false;
  bool secondary_full = true;
  int64_t primary_salt = 1000;   // value_for(dtype, slot + salt) seeds a full tier
  int64_t secondary_salt = 0;
  const DType* dtype = &DType::Float32();
};

// CPU primary, FileBacked (anonymous) secondary.
inline Tiled make_tiled(const std::vector<int64_t>& grid, const std::vector<int64_t>& tile, TierSpec spec = {},
                 std::shared_ptr<ResidencyPolicy> policy = nullptr) {
  const int64_t total = product(grid) * product(tile);
  auto primary = std::make_shared<CPUCarrier>(spec.primary_full ? total : 0, *spec.dtype, true, false);
  if (spec.primary_full) fill_slots(*primary, spec.primary_salt);
  auto secondary = std::make_shared<FileBackedCarrier>("", *spec.dtype, true);
  if (spec.secondary_full) {
    secondary->grow(total, true);
    fill_slots(*secondary, spec.secondary_salt);
  }
  return std::make_shared<TiledEvictable>(primary, secondary, grid, tile, std::move(policy));
}

// Cheap geometry-only carrier: two empty CPU tiers (every tile invalid).
inline Tiled make_geometry(const std::vector<int64_t>& grid, const std::vector<int64_t>& tile) {
  return std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, F32(), true, false),
                                          std::make_shared<CPUCarrier>(0, F32(), true, false), grid, tile, nullptr);
}

inline std::vector<int64_t> all_tiles(const TiledEvictable& te) {
  std::vector<int64_t> v(static_cast<size_t>(te.tile_count()));
  for (int64_t i = 0; i < te.tile_count(); ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

inline TileState state(const TiledEvictable& te, int64_t index) { return te.tile_state(te.tile_coord(index)); }

inline std::vector<TileState> states(const TiledEvictable& te) {
  std::vector<TileState> out;
  for (int64_t i = 0; i < te.tile_count(); ++i) out.push_back(state(te, i));
  return out;
}

inline bool same(const TileState& a, const TileState& b) {
  return a.location == b.location && a.valid == b.valid && a.dirty == b.dirty;
}

inline std::string describe(const std::vector<TileState>& s) {
  std::string out;
  for (const auto& t : s) out += std::string(location_name(t.location)) + (t.dirty ? "*" : "") + " ";
  return out;
}

inline void expect_states(const TiledEvictable& te, const std::vector<TileState>& expected) {
  auto got = states(te);
  ASSERT_EQ(got.size(), expected.size());
  bool ok = true;
  for (size_t i = 0; i < got.size(); ++i) ok = ok && same(got[i], expected[i]);
  EXPECT_TRUE(ok) << "states " << describe(got) << "\nexpected " << describe(expected);
}

inline void expect_stats_eq(const TiledStats& a, const TiledStats& b) {
  EXPECT_EQ(a.promotions, b.promotions);
  EXPECT_EQ(a.evictions, b.evictions);
  EXPECT_EQ(a.bytes_promoted, b.bytes_promoted);
  EXPECT_EQ(a.bytes_evicted, b.bytes_evicted);
  EXPECT_EQ(a.writes_skipped, b.writes_skipped);
  EXPECT_EQ(a.primary_tiles, b.primary_tiles);
  EXPECT_EQ(a.primary_bytes, b.primary_bytes);
}

inline int64_t tile_bytes(const TiledEvictable& te) { return te.tile_size() * static_cast<int64_t>(slot_bytes(te.dtype())); }

// Value of every slot without changing residency: primary/implicit tiles through the
// tile table, secondary tiles straight from the secondary tier's file.
inline std::vector<Value> peek_all(const TiledEvictable& te) {
  std::vector<Value> out;
  const size_t w = slot_bytes(te.dtype());
  std::vector<std::byte> buf(w);
  for (int64_t s = 0; s < te.size(); ++s) {
    auto [tile, within] = te.locate(s);
    if (state(te, tile).location == TileLocation::Secondary) {
      te.secondary()->read_slots(s, 1, buf.data());
      out.push_back(load_value(te.dtype(), buf.data()));
    } else {
      out.push_back(te.read_value(s));
    }
  }
  return out;
}

inline std::vector<Value> secondary_values(const TiledEvictable& te) { return bulk_snapshot(*te.secondary()); }

inline std::vector<Value> seeded(const DType& d, int64_t n, int64_t salt) {
  std::vector<Value> v;
  for (int64_t i = 0; i < n; ++i) v.push_back(value_for(d, i + salt));
  return v;
}

inline void write_one(TiledEvictable& te, int64_t slot, float v) { te.write_slots(slot, 1, &v); }

inline Done ready_of(const WorkToken& w) { return w.ready(); }

// The engine hooks of a work request and a reading pin (cpp/src/tiled/internal.hpp).
inline WorkToken begin_work(const Tiled& te, const std::vector<int64_t>& tiles, const char* purpose) {
  return TiledInternals::begin_work(te, tiles, purpose);
}
inline WorkToken pin_for_reading(const Tiled& te) { return TiledInternals::pin_for_reading(te); }

inline std::vector<int64_t> sorted_unique(std::vector<int64_t> v) {
  std::sort(v.begin(), v.end());
  v.erase(std::unique(v.begin(), v.end()), v.end());
  return v;
}

// Blocks every thread of the I/O executor behind a gate, so tiled transfers queue and
// their requests stay pending until open() (deterministic, no sleeps).
class IoBlock {
 public:
  explicit IoBlock(Executor& ex = Executor::io()) : ex_(ex) {
    const size_t n = ex.max_threads();
    for (size_t i = 0; i < n; ++i)
      ex.submit([s = state_] {
        {
          std::lock_guard lock(s->m);
          s->started++;
        }
        s->cv.notify_all();
        s->gate->wait();
      });
    std::unique_lock lock(state_->m);
    if (!state_->cv.wait_for(lock, std::chrono::seconds(30), [&] { return state_->started == n; }))
      ADD_FAILURE() << "the I/O executor did not start " << n << " blockers";
  }
  ~IoBlock() {
    open();
    EXPECT_TRUE(ex_.wait_idle(std::chrono::seconds(60)));
  }
  void open() {
    if (!opened_) state_->gate->set_value(true);
    opened_ = true;
  }

 private:
  struct State {
    std::mutex m;
    std::condition_variable cv;
    size_t started = 0;
    CompletionPtr<bool> gate = std::make_shared<Completion<bool>>();
  };
  Executor& ex_;
  std::shared_ptr<State> state_ = std::make_shared<State>();
  bool opened_ = false;
};

class TiledTest : public ::testing::Test {
 protected:
  void SetUp() override {
    io::clear_faults();
    (void)test_seed();
  }
  void TearDown() override { io::clear_faults(); }
};

// A tiled Float32 gradient over the geometry of `weight` (a carrier under `full`), whose tiles `routed` hold
// values[tile] (`n` slots each, within-tile order), the others implicit zeros.
inline TensorPtr tiled_gradient(const Tiled& weight, const TensorPtr& full, const std::vector<int64_t>& routed,
                                const std::vector<std::vector<float>>& values, int64_t n) {
  auto g = std::static_pointer_cast<TiledEvictable>(weight->allocate_like(weight->size(), true, F32(), false));
  std::vector<std::pair<int64_t, CarrierPtr>> tiles;
  for (int64_t e : routed) {
    CarrierPtr buf = g->primary()->allocate_like(n, true, F32(), true);
    buf->write_slots(0, n, values[static_cast<size_t>(e)].data());
    tiles.emplace_back(e, buf);
  }
  TiledInternals::install_tiles(*g, tiles);
  return make_tensor(g, 0, full->layout);
}

}  // namespace tiled_testing
}  // namespace sw
