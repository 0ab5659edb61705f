// One checkpoint tensor split along its first axis into `tiles` equal slabs (Checkpoint::split_tier, split_shape and
// tiled_split with a count): DBRX's fused experts (E I, H) as the full tensor (I, H, E), tile e the rows
// [e I, (e + 1) I) where they lie; the same tensor as E per-expert (I, H) tensors; the counts that cannot split.
#include <gtest/gtest.h>

#include "strideweave/carriers/native.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"
#include "test_support.hpp"

using namespace sw;
using namespace sw::testing_support;
namespace st = sw::safetensors;
using Writes = CheckpointCarrier::Writes;

namespace {

constexpr int64_t kE = 3, kI = 2, kH = 5;

// Row r, column h of the fused (E I, H) tensor: expert r / I, its row r % I.
double fused_value(int64_t r, int64_t h) { return 100.0 * (r / kI) + 10.0 * (r % kI) + h; }

// The fused tensor as a dense column-major tensor (save writes it row-major, as PyTorch would).
TensorPtr fused() {
  std::vector<double> v;
  for (int64_t k = 0; k < kE * kI * kH; ++k) v.push_back(fused_value(k % (kE * kI), k / (kE * kI)));
  return dense_tensor(true, Shape::flat({kE * kI, kH}), v);
}

// Expert e's (I, H) rows as one tensor.
TensorPtr expert(int64_t e) {
  std::vector<double> v;
  for (int64_t k = 0; k < kI * kH; ++k) v.push_back(fused_value(e * kI + k % kI, k / kI));
  return dense_tensor(true, Shape::flat({kI, kH}), v);
}

// The expected values of the full (I, H, E) tensor in ordinal (first mode fastest) order.
std::vector<double> full_values() {
  std::vector<double> v;
  for (int64_t k = 0; k < kI * kH * kE; ++k) v.push_back(fused_value((k / (kI * kH)) * kI + k % kI, (k / kI) % kH));
  return v;
}

std::vector<std::string> expert_names() {
  std::vector<std::string> names;
  for (int64_t e = 0; e < kE; ++e) names.push_back("experts." + std::to_string(e) + ".w1");
  return names;
}

std::shared_ptr<st::Checkpoint> write_and_open(const std::string& path) {
  std::vector<std::pair<std::string, TensorPtr>> tensors;
  tensors.emplace_back("norm", dense_tensor(true, Shape::flat({kH}), std::vector<double>(kH, 1.0)));  // offset > 0
  tensors.emplace_back("w1", fused());
  for (int64_t e = 0; e < kE; ++e) tensors.emplace_back(expert_names()[e], expert(e));
  st::save(path, tensors, {});
  return st::Checkpoint::open({path});
}

}  // namespace

TEST(CheckpointSplitTiles, EachRangeIsOneTilesRows) {
  TempPath file("sw-ckpt-split-tiles");
  auto ck = write_and_open(file.path());
  const st::TensorInfo& info = ck->info("w1");
  auto tier = ck->split_tier("w1", Writes::Overlay, kE);
  ASSERT_EQ(tier->ranges().size(), size_t(kE));
  for (int64_t e = 0; e < kE; ++e) {
    EXPECT_EQ(tier->ranges()[e].offset, info.begin + uint64_t(e * kI * kH * 4)) << "tile " << e;
    EXPECT_EQ(tier->ranges()[e].slots, kI * kH) << "tile " << e;
  }
  EXPECT_EQ(ck->split_shape("w1", kE), (std::vector<int64_t>{kI, kH}));
  EXPECT_EQ(ck->split_shape("w1"), (std::vector<int64_t>{kH}));          // one row per slab, the axis dropped
  EXPECT_EQ(ck->split_shape("w1", kE * kI), (std::vector<int64_t>{kH}));  // the same count as the default
  EXPECT_EQ(ck->split_shape("w1", 1), (std::vector<int64_t>{kE * kI, kH}));
  EXPECT_EQ(ck->split_tier("w1", Writes::Overlay)->ranges().size(), size_t(kE * kI));
}

TEST(CheckpointSplitTiles, TheSplitIsThePerExpertTensor) {
  TempPath file("sw-ckpt-split-tiles");
  auto ck = write_and_open(file.path());
  TensorPtr split = ck->tiled_split("w1", nullptr, nullptr, Writes::Overlay, kE);
  TensorPtr per_expert = ck->tiled(expert_names(), nullptr, nullptr, Writes::Overlay);
  EXPECT_EQ(split->layout, Layout(Shape::flat({kI, kH, kE}), Stride::flat({kH, 1, kI * kH})));
  EXPECT_EQ(split->layout, per_expert->layout);
  auto& carrier = dynamic_cast<TiledEvictable&>(*split->carrier);
  carrier.check_footprints(*split);
  const uint64_t before = ck->bytes_read();
  carrier.promote_async({carrier.tile_index({0, 0, 1})})->value();
  EXPECT_EQ(ck->bytes_read() - before, uint64_t(kI * kH * 4));  // one tile: exactly one expert's rows
  EXPECT_EQ(values_of(split), full_values());
  EXPECT_EQ(values_of(per_expert), full_values());
}

TEST(CheckpointSplitTiles, CountsThatCannotSplitAreValueErrors) {
  TempPath file("sw-ckpt-split-tiles");
  auto ck = write_and_open(file.path());
  EXPECT_SW_THROW(ValueError, "tensor 'w1' cannot be split into 0 tiles", ck->split_tier("w1", Writes::Overlay, 0));
  EXPECT_SW_THROW(ValueError, "tiles must be >= 1", ck->split_tier("w1", Writes::InPlace, -1));
  EXPECT_SW_THROW(ValueError, "tensor 'w1' has a first axis of extent 6, which tiles=4 does not divide",
                  ck->split_tier("w1", Writes::InPlace, 4));
  EXPECT_SW_THROW(ValueError, "extent 6, which tiles=12 does not divide",
                  ck->tiled_split("w1", nullptr, nullptr, Writes::Overlay, 12));
  EXPECT_SW_THROW(ValueError, "tiles=4 does not divide", ck->split_shape("w1", 4));
  EXPECT_EQ(ck->bytes_read(), 0u);
  EXPECT_EQ(values_of(ck->tiled_split("w1", nullptr, nullptr, Writes::Overlay, 2)).size(), size_t(kE * kI * kH));
}
