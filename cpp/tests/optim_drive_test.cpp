// Driving an optimizer from outside (strideweave/optim.hpp): hyperparameters replaced between steps (validated,
// nothing changed on error; SGD momentum switched on later starts each tile's buffer from its gradient),
// grad_norm/scale_grads (Note [Gradients of tiled parameters together]) and the state file (Note [Optimizer state
// files]) over a geometry whose tiles are several runs of slots (grid (2, 3), tile (4, 5)). The comparisons with
// torch are tests/test_optim_drive.py.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <random>

#include "strideweave/carriers/storage.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/optim.hpp"
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

const std::vector<int64_t> kGrid{2, 3}, kTile{4, 5};
constexpr int64_t kTiles = 6, kN = 20, kSize = kTiles * kN;

struct Weight {
  Tiled carrier;
  TensorPtr full;
};

Weight make_weight(std::shared_ptr<ResidencyBudget> budget = nullptr) {
  Weight w;
  w.carrier = make_tiled(kGrid, kTile);
  if (budget) w.carrier->set_residency_budget(budget);
  // The logical (8, 15) extent, colex: slot = c0 + 8 c1, the carrier's own slot order.
  w.full = make_tensor(w.carrier, 0, column_major(Shape::flat({8, 15})));
  return w;
}

std::vector<float> randoms(std::mt19937& rng, int64_t n) {
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// A tiled gradient of `w` whose tiles `routed` hold values[tile] (within-tile order), the others implicit zeros.
TensorPtr gradient(const Weight& w, const std::vector<int64_t>& routed, const std::vector<std::vector<float>>& values) {
  return tiled_gradient(w.carrier, w.full, routed, values, kN);
}

// Tile `t` of `c` in within-tile order (read through the geometry: the tile is several runs of slots).
std::vector<float> tile_values(const TiledEvictable& c, int64_t t) {
  std::vector<float> all(static_cast<size_t>(kSize)), out(static_cast<size_t>(kN));
  c.read_slots(0, kSize, all.data());
  for (int64_t k = 0; k < kN; ++k) out[static_cast<size_t>(k)] = all[static_cast<size_t>(c.geometry().slot(t, k))];
  return out;
}

TiledEvictable& carrier_of(const TensorPtr& t) { return static_cast<TiledEvictable&>(*t->carrier); }

TEST(OptimizerDrive, SetHyperparametersValidatesAndChangesNothingOnError) {
  Weight w = make_weight();
  optim::Hyperparameters h;
  h.lr = 0.1;
  h.momentum = 0.9;
  h.nesterov = true;
  optim::Optimizer opt(optim::Algorithm::SGD, {w.full}, h);
  optim::Hyperparameters bad = h;
  bad.dampening = 0.1;  // nesterov needs dampening 0
  EXPECT_SW_THROW(ValueError, "nesterov momentum requires", opt.set_hyperparameters(bad));
  bad = h;
  bad.lr = std::nan("");
  EXPECT_SW_THROW(ValueError, "invalid learning rate lr", opt.set_hyperparameters(bad));
  EXPECT_EQ(opt.hyperparameters().lr, 0.1);
  EXPECT_EQ(opt.hyperparameters().dampening, 0.0);
  optim::Hyperparameters good = h;
  good.lr = 0.25;
  good.nesterov = false;
  good.dampening = 0.5;
  opt.set_hyperparameters(good);
  EXPECT_EQ(opt.hyperparameters().lr, 0.25);
  EXPECT_EQ(opt.hyperparameters().dampening, 0.5);
}

TEST(OptimizerDrive, MomentumSwitchedOnStartsEachBufferFromItsGradient) {
  std::mt19937 rng(static_cast<uint32_t>(test_seed()));
  Weight w = make_weight();
  optim::Hyperparameters h;
  h.lr = 0.1;
  optim::Optimizer opt(optim::Algorithm::SGD, {w.full}, h);
  EXPECT_EQ(opt.state(w.full).momentum_buffer, nullptr);
  std::vector<std::vector<float>> g(kTiles);
  for (auto& v : g) v = randoms(rng, kN);
  w.full->grad = gradient(w, {2}, g);
  opt.step();  // without momentum
  h.momentum = 0.9;
  h.dampening = 0.5;
  opt.set_hyperparameters(h);
  const TensorPtr buf = opt.state(w.full).momentum_buffer;
  ASSERT_NE(buf, nullptr);
  EXPECT_EQ(carrier_of(buf).tile_state({1, 0}).location, TileLocation::Implicit);  // tile 2 = (0, 1)
  w.full->grad = gradient(w, {2}, g);
  opt.step();  // tile 2's first step with momentum: buf = g exactly (torch's clone), not (1 - dampening) g
  EXPECT_EQ(tile_values(carrier_of(buf), 2), g[2]);
  opt.step();  // then buf = 0.9 buf + 0.5 g, rounded as torch rounds (the product, then a fused add)
  const auto b = tile_values(carrier_of(buf), 2);
  for (int64_t k = 0; k < kN; ++k)
    EXPECT_EQ(b[static_cast<size_t>(k)], std::fma(g[2][static_cast<size_t>(k)], 0.5f, g[2][static_cast<size_t>(k)] * 0.9f));
  EXPECT_EQ(opt.state(w.full).steps, (std::vector<int64_t>{0, 0, 3, 0, 0, 0}));
}

TEST(OptimizerDrive, GradNormAndScaleOverTilesOfSeveralRuns) {
  std::mt19937 rng(static_cast<uint32_t>(test_seed()));
  const int64_t tile_bytes = kN * 4;
  auto budget = std::make_shared<ResidencyBudget>(2 * tile_bytes);
  Weight w = make_weight();
  std::vector<std::vector<float>> g(kTiles);
  for (auto& v : g) v = randoms(rng, kN);
  TensorPtr grad = gradient(w, {0, 3, 5}, g);
  carrier_of(grad).evict_async({0, 3, 5})->wait();  // every present tile in the secondary tier
  carrier_of(grad).set_residency_budget(budget);     // room for two of the three
  w.full->grad = grad;
  double sq = 0, l1 = 0, mx = 0;
  for (int64_t e : {0, 3, 5})
    for (float x : g[static_cast<size_t>(e)]) sq += double(x) * x, l1 += std::fabs(double(x)), mx = std::max(mx, std::fabs(double(x)));
  // The same Float64 sums over the same values in the same order (tile order, within-tile order): equal.
  EXPECT_EQ(optim::grad_norm({w.full}, 2.0), std::sqrt(sq));
  EXPECT_EQ(optim::grad_norm({w.full}, 1.0), l1);
  EXPECT_EQ(optim::grad_norm({w.full}, INFINITY), mx);
  EXPECT_LE(budget->stats().peak_bytes, budget->max_bytes());
  EXPECT_GE(carrier_of(grad).stats().promotions, 3);  // read back
  EXPECT_SW_THROW(ValueError, "norm_type must be > 0", optim::grad_norm({w.full}, 0.0));
  EXPECT_SW_THROW(TypeError, "params[1] is None", optim::grad_norm({w.full, nullptr}, 2.0));
  EXPECT_SW_THROW(TypeError, "params[1] is None", optim::scale_grads({w.full, nullptr}, 0.5));
  EXPECT_EQ(tile_values(carrier_of(grad), 3), g[3]);  // nothing scaled by the refused call
  optim::scale_grads({w.full}, 0.375);
  for (int64_t e = 0; e < kTiles; ++e) {
    const bool present = e == 0 || e == 3 || e == 5;
    EXPECT_EQ(carrier_of(grad).tile_state(carrier_of(grad).tile_coord(e)).location == TileLocation::Implicit, !present);
    const auto got = tile_values(carrier_of(grad), e);
    for (int64_t k = 0; k < kN; ++k)
      EXPECT_EQ(got[static_cast<size_t>(k)], present ? g[static_cast<size_t>(e)][static_cast<size_t>(k)] * 0.375f : 0.0f);
  }
}

TEST(OptimizerDrive, StateFileRoundTripsTileByTile) {
  std::mt19937 rng(static_cast<uint32_t>(test_seed()));
  const auto path = (std::filesystem::temp_directory_path() / ("sw_optim_drive_" + std::to_string(::getpid()) +
                                                              ".safetensors")).string();
  Weight wa = make_weight();
  optim::Hyperparameters h;
  h.lr = 0.01;
  h.beta1 = 0.8;
  optim::Optimizer a(optim::Algorithm::Adam, {wa.full}, h);
  std::vector<std::vector<float>> g(kTiles);
  for (auto& v : g) v = randoms(rng, kN);
  wa.full->grad = gradient(wa, {1, 4}, g);
  a.step();
  wa.full->grad = gradient(wa, {4}, g);
  a.step();
  a.save_state(path);
  // The file: (tiles, tile size), row t tile t in within-tile order.
  const safetensors::Header header = safetensors::read_header(path);
  const safetensors::TensorInfo& info = header.tensor("param0.exp_avg_sq");
  EXPECT_EQ(info.shape, (std::vector<int64_t>{kTiles, kN}));
  std::vector<float> row(static_cast<size_t>(kN));
  const int fd = ::open(path.c_str(), O_RDONLY);
  ASSERT_GE(fd, 0);
  ASSERT_EQ(::pread(fd, row.data(), kN * 4, static_cast<off_t>(info.begin + 4 * kN * 4)), kN * 4);
  ::close(fd);
  EXPECT_EQ(row, tile_values(carrier_of(a.state(wa.full).exp_avg_sq), 4));

  auto budget = std::make_shared<ResidencyBudget>(4 * kN * 4);
  Weight wb = make_weight(budget);
  optim::Optimizer b(optim::Algorithm::Adam, {wb.full}, optim::Hyperparameters{});
  b.load_state(path);
  EXPECT_EQ(b.hyperparameters().lr, 0.01);
  EXPECT_EQ(b.hyperparameters().beta1, 0.8);
  EXPECT_EQ(b.state(wb.full).steps, (std::vector<int64_t>{0, 1, 0, 0, 2, 0}));
  for (auto pick : {&optim::ParameterState::exp_avg, &optim::ParameterState::exp_avg_sq}) {
    TiledEvictable& sa = carrier_of(a.state(wa.full).*pick);
    TiledEvictable& sb = carrier_of(b.state(wb.full).*pick);
    for (int64_t e = 0; e < kTiles; ++e) {
      EXPECT_EQ(sb.tile_state(sb.tile_coord(e)).location == TileLocation::Implicit, e != 1 && e != 4) << e;
      EXPECT_EQ(tile_values(sb, e), tile_values(sa, e)) << e;
    }
  }
  EXPECT_LE(budget->stats().peak_bytes, budget->max_bytes());
  // Another algorithm is refused before anything changes.
  Weight wc = make_weight();
  optim::Optimizer c(optim::Algorithm::AdamW, {wc.full}, optim::Hyperparameters{});
  EXPECT_SW_THROW(ValueError, "holds the state of \"Adam\", not of AdamW", c.load_state(path));
  EXPECT_EQ(c.hyperparameters().lr, 1e-3);
  EXPECT_EQ(c.state(wc.full).steps, (std::vector<int64_t>(kTiles, 0)));
  std::filesystem::remove(path);
}

}  // namespace
}  // namespace sw
