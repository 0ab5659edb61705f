// A checkpoint's tensors where they lie (Note [A checkpoint's tensors], Note [A checkpoint's tiled tensor]): one
// tensor over its byte range, per-expert tensors and the slabs of a fused tensor as the tiles of one full tensor,
// values by coordinate and the bytes each read touches.
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

constexpr int64_t kE = 3, kOut = 2, kIn = 4;

double expert_value(int64_t e, int64_t o, int64_t i) { return 100.0 * e + 10.0 * o + i; }

// Expert e's (out, in) matrix as a dense column-major tensor (save writes it row-major, as PyTorch would).
TensorPtr expert(int64_t e) {
  std::vector<double> v;
  for (int64_t k = 0; k < kOut * kIn; ++k) v.push_back(expert_value(e, k % kOut, k / kOut));
  return dense_tensor(true, Shape::flat({kOut, kIn}), v);
}

// All experts as one (E, out, in) tensor.
TensorPtr fused() {
  std::vector<double> v;
  for (int64_t k = 0; k < kE * kOut * kIn; ++k) v.push_back(expert_value(k % kE, (k / kE) % kOut, k / (kE * kOut)));
  return dense_tensor(true, Shape::flat({kE, kOut, kIn}), v);
}

// The expected values of a full (out, in, E) tensor in ordinal (first mode fastest) order.
std::vector<double> full_values() {
  std::vector<double> v;
  for (int64_t k = 0; k < kOut * kIn * kE; ++k) v.push_back(expert_value(k / (kOut * kIn), k % kOut, (k / kOut) % kIn));
  return v;
}

std::shared_ptr<st::Checkpoint> write_and_open(const std::string& path) {
  std::vector<std::pair<std::string, TensorPtr>> tensors;
  for (int64_t e = 0; e < kE; ++e) tensors.emplace_back("experts." + std::to_string(e) + ".w1.weight", expert(e));
  tensors.emplace_back("fused", fused());
  tensors.emplace_back("scalar", dense_tensor(true, Shape(), {7.0}));
  st::save(path, tensors, {});
  return st::Checkpoint::open({path});
}

}  // namespace

TEST(CheckpointTensors, ATensorIsItsByteRangeWithRowMajorStrides) {
  TempPath file("sw-ckpt-tensors");
  auto ck = write_and_open(file.path());
  TensorPtr w = ck->tensor("experts.1.w1.weight");
  EXPECT_EQ(w->layout, row_major(Shape::flat({kOut, kIn})));
  EXPECT_EQ(w->carrier->kind().name, checkpoint_kind().name);
  std::vector<double> want;
  for (int64_t k = 0; k < kOut * kIn; ++k) want.push_back(expert_value(1, k % kOut, k / kOut));
  EXPECT_EQ(values_of(w), want);
  EXPECT_EQ(ck->bytes_read(), uint64_t(kOut * kIn * 4));
  EXPECT_EQ(values_of(ck->tensor("scalar")), std::vector<double>{7.0});
}

TEST(CheckpointTensors, PerExpertTensorsAndFusedSlabsGiveTheSameFullTensor) {
  TempPath file("sw-ckpt-tensors");
  auto ck = write_and_open(file.path());
  std::vector<std::string> names;
  for (int64_t e = 0; e < kE; ++e) names.push_back("experts." + std::to_string(e) + ".w1.weight");
  TensorPtr a = ck->tiled(names, nullptr, nullptr, Writes::Overlay);
  TensorPtr b = ck->tiled_split("fused", nullptr, nullptr, Writes::Overlay);
  const st::TiledView v = st::tiled_view({kOut, kIn}, kE);
  EXPECT_EQ(v.grid, (std::vector<int64_t>{1, 1, kE}));
  EXPECT_EQ(v.tile, (std::vector<int64_t>{kOut, kIn, 1}));
  EXPECT_EQ(a->layout, v.layout);
  EXPECT_EQ(b->layout, v.layout);
  EXPECT_EQ(v.layout, Layout(Shape::flat({kOut, kIn, kE}), Stride::flat({kIn, 1, kOut * kIn})));
  auto& carrier = dynamic_cast<TiledEvictable&>(*a->carrier);
  carrier.check_footprints(*a);  // the permuted view is tile-footprint compatible
  const uint64_t before = ck->bytes_read();
  carrier.promote_async({carrier.tile_index({0, 0, 2})})->value();
  EXPECT_EQ(ck->bytes_read() - before, uint64_t(kOut * kIn * 4));  // one tile: exactly one expert's bytes
  EXPECT_EQ(values_of(a), full_values());
  EXPECT_EQ(values_of(b), full_values());
}

TEST(CheckpointTensors, ViewsThatCannotExistAreValueErrors) {
  TempPath file("sw-ckpt-tensors");
  auto ck = write_and_open(file.path());
  EXPECT_SW_THROW(ValueError, "tensor 'scalar' has rank 0", ck->tiled_split("scalar", nullptr, nullptr, Writes::Overlay));
  EXPECT_SW_THROW(ValueError, "at least one tile", st::tiled_view({2}, 0));
  EXPECT_SW_THROW(ValueError, "has an extent 0", st::tiled_view({2, 0}, 1));
  EXPECT_EQ(ck->bytes_read(), 0u);
}
