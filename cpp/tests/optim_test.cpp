// Optimizers on tiled parameters (Note [Optimizers on tiled parameters] in strideweave/optim.hpp): the two kernel
// paths agree bit for bit, a step skips tiles whose gradient is an implicit zero and keeps per-tile step counts, the
// state is Float32 TiledEvictables of the weight's geometry (implicit until a tile's first step, their own scratch
// file, the weight's budget), a tight budget gives the unbounded run's values, and bad arguments change nothing.
// The comparison against torch.optim is tests/test_optim.py.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <thread>
#include <future>

#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/optim.hpp"
#include "../src/optim/update_kernels.hpp"
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;
namespace od = optim::detail;

constexpr int64_t kE = 5, kN = 37;  // 37 slots per tile: two 16-lane vectors and a 5-element tail

std::vector<float> randoms(std::mt19937& rng, int64_t n, float scale = 1.0f) {
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

bool bitwise_equal(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct PortableKernels {
  PortableKernels() { od::force_portable_update_kernels(true); }
  ~PortableKernels() { od::force_portable_update_kernels(false); }
};

TEST(OptimKernels, BothPathsAgreeBitForBit) {
  const uint64_t seed = test_seed();
  std::mt19937 rng(static_cast<uint32_t>(seed));
  const int64_t n = 1000 + 13;
  const auto w0 = randoms(rng, n), g = randoms(rng, n), m0 = randoms(rng, n, 0.1f);
  auto v0 = randoms(rng, n, 0.1f);
  for (auto& x : v0) x = std::abs(x);
  for (int variant = 0; variant < 4; ++variant) {
    od::AdamCoefficients a;
    a.decoupled = variant & 1;
    a.decay = 0.999f;
    a.weight_decay = variant & 2 ? 0.01f : 0.0f;
    a.lerp_weight = variant == 3 ? 0.7f : 0.1f;  // both lerp branches
    a.bias_correction2_sqrt = 0.0447f;
    a.neg_step_size = -0.01f;
    od::SgdCoefficients s;
    s.weight_decay = variant & 2 ? 0.01f : 0.0f;
    s.momentum = 0.9f;
    s.one_minus_dampening = 0.7f;
    s.neg_lr = -0.05f;
    s.nesterov = variant & 1;
    s.first = variant == 0;
    std::vector<std::vector<float>> results[2];
    for (int portable = 0; portable < 2; ++portable) {
      std::unique_ptr<PortableKernels> force;
      if (portable) force = std::make_unique<PortableKernels>();
      auto w = w0, m = m0, v = v0;
      od::adam_update(w.data(), g.data(), m.data(), v.data(), n, a);
      auto ws = w0, b = m0;
      od::sgd_update(ws.data(), g.data(), b.data(), n, s);
      results[portable] = {w, m, v, ws, b};
      EXPECT_STREQ(od::update_kernel_path(), portable ? "portable" : od::update_kernel_path());
    }
    for (size_t k = 0; k < results[0].size(); ++k)
      EXPECT_TRUE(bitwise_equal(results[0][k], results[1][k])) << "variant " << variant << " array " << k
                                                               << " (seed " << seed << ")";
  }
}

TEST(OptimKernels, OneAdamElementByHand) {
  // m = fma(0.1, g - 0, 0); v = fma(0.001 * g, g, 0 * 0.999); w += (-step_size * m) / (sqrt(v) / bc2 + eps).
  od::AdamCoefficients a;
  a.lerp_weight = 0.1f;
  a.beta2 = 0.999f;
  a.one_minus_beta2 = 0.001f;
  a.bias_correction2_sqrt = std::sqrt(0.001f);
  a.eps = 0.0f;
  a.neg_step_size = -10.0f;  // -lr / (1 - beta1), lr = 1, beta1 = 0.9: the first step
  float w = 1.0f, g = 2.0f, m = 0.0f, v = 0.0f;
  od::adam_update(&w, &g, &m, &v, 1, a);
  EXPECT_EQ(m, std::fma(0.1f, 2.0f, 0.0f));
  EXPECT_EQ(v, std::fma(0.001f * 2.0f, 2.0f, 0.0f));
  EXPECT_EQ(w, 1.0f + (a.neg_step_size * m) / (std::sqrt(v) / a.bias_correction2_sqrt + a.eps));
  EXPECT_NEAR(w, 0.0f, 1e-5f);  // Adam's first step moves by lr (here 1) in the gradient's sign
}

// A weight of kE tiles of kN slots over a CPU primary and an anonymous file, values value_for(F32, slot).
struct Weight {
  Tiled carrier;
  TensorPtr full;
};

Weight make_weight(std::shared_ptr<ResidencyBudget> budget = nullptr) {
  Weight w;
  w.carrier = make_tiled({kE}, {kN});
  if (budget) w.carrier->set_residency_budget(budget);
  w.full = make_tensor(w.carrier, 0, column_major(Shape::flat({kE * kN})));
  return w;
}

// A tiled gradient of `w` whose tiles `routed` hold `values[tile]`, the others implicit zeros.
TensorPtr gradient(const Weight& w, const std::vector<int64_t>& routed, const std::vector<std::vector<float>>& values) {
  return tiled_gradient(w.carrier, w.full, routed, values, kN);
}

std::vector<float> tile_values(const TiledEvictable& c, int64_t tile) {
  std::vector<float> out(static_cast<size_t>(kN));
  c.read_slots(tile * kN, kN, out.data());
  return out;
}

TEST(Optimizer, StepsOnlyRoutedTilesWithTheirOwnCounts) {
  std::mt19937 rng(static_cast<uint32_t>(test_seed()));
  Weight w = make_weight();
  optim::Hyperparameters h;
  h.lr = 0.01;
  optim::Optimizer opt(optim::Algorithm::Adam, {w.full}, h);
  auto st = opt.state(w.full);
  auto m = std::static_pointer_cast<TiledEvictable>(st.exp_avg->carrier);
  EXPECT_EQ(m->dtype(), F32());
  EXPECT_EQ(m->geometry(), w.carrier->geometry());
  EXPECT_TRUE(std::dynamic_pointer_cast<FileBackedCarrier>(m->secondary())->is_anonymous());
  for (int64_t e = 0; e < kE; ++e) EXPECT_EQ(state(*m, e).location, TileLocation::Implicit);
  std::vector<std::vector<float>> g(kE);
  for (auto& t : g) t = randoms(rng, kN);
  const auto untouched = tile_values(*w.carrier, 0);
  w.full->grad = gradient(w, {1, 3}, g);
  opt.step();
  w.full->grad = gradient(w, {3}, g);
  opt.step();
  EXPECT_EQ(opt.state(w.full).steps, (std::vector<int64_t>{0, 1, 0, 2, 0}));
  EXPECT_EQ(state(*m, 0).location, TileLocation::Implicit);  // never stepped: no storage
  EXPECT_EQ(state(*m, 1).location, TileLocation::Primary);
  EXPECT_TRUE(bitwise_equal(tile_values(*w.carrier, 0), untouched));
  const optim::OptimizerStats s = opt.stats();
  EXPECT_EQ(s.steps, 2);
  EXPECT_EQ(s.tiles_stepped, 3);
  EXPECT_EQ(s.tiles_skipped, 2 * kE - 3);
  opt.zero_grad();
  EXPECT_EQ(w.full->grad, nullptr);
}

TEST(Optimizer, ATightBudgetGivesTheUnboundedValues) {
  std::mt19937 rng(static_cast<uint32_t>(test_seed()));
  std::vector<std::vector<std::vector<float>>> grads(4, std::vector<std::vector<float>>(kE));
  for (auto& step : grads)
    for (auto& t : step) t = randoms(rng, kN);
  const std::vector<std::vector<int64_t>> routes = {{0, 1, 2, 3, 4}, {1, 4}, {0, 2, 3}, {4, 0}};
  std::vector<std::vector<float>> results[3];
  const int64_t tile = kN * 4;
  auto budget = std::make_shared<ResidencyBudget>(6 * tile);  // 4 tiles per expert step, 20 in all
  for (int run = 0; run < 3; ++run) {  // unbounded; bounded; bounded with prefetch
    const bool bounded = run > 0;
    Weight w = make_weight(bounded ? budget : nullptr);
    optim::Hyperparameters h;
    h.lr = 0.02;
    h.weight_decay = 0.1;
    optim::Optimizer opt(optim::Algorithm::AdamW, {w.full}, h);
    opt.set_prefetch(run == 2);
    for (size_t k = 0; k < routes.size(); ++k) {
      w.full->grad = gradient(w, routes[k], grads[k]);
      opt.step();
    }
    auto st = opt.state(w.full);
    for (int64_t e = 0; e < kE; ++e) {
      results[run].push_back(tile_values(*w.carrier, e));
      results[run].push_back(tile_values(static_cast<TiledEvictable&>(*st.exp_avg_sq->carrier), e));
    }
    if (bounded) {
      EXPECT_EQ(static_cast<TiledEvictable&>(*st.exp_avg->carrier).residency_budget(), budget);
      EXPECT_GT(opt.stats().state.bytes_evicted, 0);
      EXPECT_GT(opt.stats().state.bytes_promoted, 0);
    }
    EXPECT_EQ(opt.stats().prefetches > 0, run == 2);
  }
  for (int run = 1; run < 3; ++run)
    for (size_t k = 0; k < results[0].size(); ++k)
      EXPECT_TRUE(bitwise_equal(results[0][k], results[run][k])) << "run " << run << " array " << k;
  EXPECT_LE(budget->stats().peak_bytes, budget->max_bytes());
  EXPECT_GT(budget->stats().evictions, 0);
}

// A weight whose tiles 1 and 2 have random gradients, for the contention tests below.
Weight weight_with_gradients_on_tiles_1_and_2() {
  std::mt19937 rng(static_cast<uint32_t>(test_seed()));
  Weight w = make_weight();
  std::vector<std::vector<float>> g(kE);
  for (auto& t : g) t = randoms(rng, kN);
  w.full->grad = gradient(w, {1, 2}, g);
  return w;
}

// Note [Taking turns]: the step waits for other work on its tiles, for at most the wait limit.
TEST(Optimizer, ATileThatOtherWorkPinsPastTheWaitLimitIsRefusedWithNothingChanged) {
  Weight w = weight_with_gradients_on_tiles_1_and_2();
  optim::Optimizer opt(optim::Algorithm::SGD, {w.full}, {});
  const auto before = tile_values(*w.carrier, 1);
  WorkToken pin = TiledInternals::begin_work(w.carrier, {1}, "projection");  // another caller's running work
  pin.ready()->value();
  const double limit = TiledEvictable::turn_wait_limit();
  TiledEvictable::set_turn_wait_limit(0.05);
  try {
    opt.step();
    ADD_FAILURE() << "no error";
  } catch (const RuntimeError& e) {
    EXPECT_TRUE(contains(e.what(), "SGD.step (the weight): waited 0.05 s for tile (1,)")) << e.what();
    EXPECT_TRUE(contains(e.what(), "pins (running tiled work)")) << e.what();
  }
  TiledEvictable::set_turn_wait_limit(limit);
  EXPECT_TRUE(bitwise_equal(tile_values(*w.carrier, 1), before));
  EXPECT_EQ(opt.state(w.full).steps, (std::vector<int64_t>(kE, 0)));
  EXPECT_EQ(opt.stats().tiles_stepped, 0);
  ASSERT_EQ(pin.end(), nullptr);
  opt.step();  // the work ended: now it steps
  EXPECT_EQ(opt.state(w.full).steps, (std::vector<int64_t>{0, 1, 1, 0, 0}));
}

TEST(Optimizer, AStepWaitsForOtherWorkOnItsTilesToEnd) {
  Weight w = weight_with_gradients_on_tiles_1_and_2();
  optim::Optimizer opt(optim::Algorithm::SGD, {w.full}, {});
  auto pin = std::make_unique<WorkToken>(TiledInternals::begin_work(w.carrier, {1}, "projection"));
  pin->ready()->value();
  std::promise<void> started;
  std::exception_ptr error;
  std::thread stepper([&] {
    started.set_value();
    try {
      opt.step();
    } catch (...) {
      error = std::current_exception();
    }
  });
  started.get_future().wait();
  // The step cannot finish while the pin lives; the pin's end lets it through (it waited rather than refused).
  ASSERT_EQ(pin->end(), nullptr);
  stepper.join();
  EXPECT_EQ(error, nullptr);
  EXPECT_EQ(opt.state(w.full).steps, (std::vector<int64_t>{0, 1, 1, 0, 0}));
}

TEST(Optimizer, ConstructionErrorsChangeNothing) {
  Weight w = make_weight();
  auto expect_error = [&](optim::Algorithm a, std::vector<TensorPtr> ps, optim::Hyperparameters h, ErrorKind kind,
                          const char* fragment) {
    try {
      optim::Optimizer opt(a, std::move(ps), h);
      ADD_FAILURE() << "no error for " << fragment;
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), kind) << e.what();
      EXPECT_TRUE(contains(e.what(), fragment)) << e.what();
    }
    EXPECT_EQ(w.carrier->stats().primary_tiles, 0);
  };
  optim::Hyperparameters h;
  h.lr = -1;
  expect_error(optim::Algorithm::SGD, {w.full}, h, ErrorKind::Value, "invalid learning rate");
  h = {};
  h.beta2 = 1.0;
  expect_error(optim::Algorithm::Adam, {w.full}, h, ErrorKind::Value, "beta at index 1");
  h = {};
  expect_error(optim::Algorithm::AdamW, {w.full, w.full}, h, ErrorKind::Value, "listed twice");
  auto ints = make_tensor(std::make_shared<CPUCarrier>(4, I32(), true, false), 0, column_major(Shape::flat({4})));
  expect_error(optim::Algorithm::AdamW, {ints}, h, ErrorKind::Type, "has dtype Int32");
  auto part = make_tensor(w.carrier, 0, column_major(Shape::flat({kN})));
  expect_error(optim::Algorithm::SGD, {part}, h, ErrorKind::Value, "must view the whole extent");
}

}  // namespace
}  // namespace sw
