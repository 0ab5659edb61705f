// Inputs `make fuzz` found (fuzz/, docs/reliability.md, "Coverage-guided fuzzing"), kept as plain tests: each
// failed before its fix (the fuzz target's input is in the test's comment, decoded into the call it made).
#include <gtest/gtest.h>

#include <cstdint>
#include <string>

#include "strideweave/carriers/native.hpp"
#include "strideweave/checkpoint/safetensors.hpp"
#include "strideweave/tiled/data.hpp"
#include "strideweave/views.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

std::string with_length(const std::string& json) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>((json.size() >> (8 * i)) & 0xff);
  return out + json;
}

// safetensors_fuzz: a number beyond double in the header made nlohmann::json throw its out_of_range (not a
// parse_error), which escaped parse_header as a foreign exception (Python: RuntimeError) instead of ValueError.
TEST(FuzzRegressions, AHeaderNumberBeyondDoubleIsAValueError) {
  for (const char* json : {"{\"a\": 1E400}", "{\"__metadata__\": {\"k\": -11.1111111111E11111111}}",
                           "{\"w\": {\"dtype\": \"F32\", \"shape\": [1e999], \"data_offsets\": [0, 4]}}"}) {
    const std::string file = with_length(json) + std::string(4, '\0');
    EXPECT_SW_THROW(ValueError, "ckpt.safetensors: the header is not well-formed JSON",
                    safetensors::parse_header(file, file.size(), "ckpt.safetensors"));
  }
}

// layout_fuzz: narrow with a length near INT64_MAX computed start + length for its IndexError message, a signed
// overflow (UBSan: "1 + 9223372036854775807 cannot be represented"; the message showed a negative end).
TEST(FuzzRegressions, NarrowWithAHugeLengthSaysTheRangeWithoutOverflow) {
  TensorPtr t = testing_support::dense_tensor(true, Shape::flat({3}), {1.0, 2.0, 3.0});
  EXPECT_SW_THROW(IndexError, "narrow: ordinals [1, 9223372036854775807) are out of range for mode 0 of extent 3",
                  narrow(t, 0, 1, INT64_MAX));
  EXPECT_SW_THROW(IndexError, "narrow: ordinals [2, 9223372036854775807) are out of range",
                  narrow(t, 0, 2, INT64_MAX - 1));
  EXPECT_EQ(t->carrier->read_value(1).f, 2.0);
}

// layout_fuzz: chunk computed ceil(extent / n) as (extent + n - 1) / n, a signed overflow for n near INT64_MAX.
TEST(FuzzRegressions, ChunkIntoHugelyManyPiecesGivesOnePiecePerOrdinal) {
  TensorPtr t = testing_support::dense_tensor(true, Shape::flat({3}), {1.0, 2.0, 3.0});
  for (int64_t n : {INT64_MAX, INT64_MAX - 1, int64_t{1} << 62}) {
    const std::vector<TensorPtr> pieces = chunk(t, n, 0);
    ASSERT_EQ(pieces.size(), 3u);
    for (int64_t k = 0; k < 3; ++k) EXPECT_EQ(pieces[k]->carrier->read_value(pieces[k]->offset).f, 1.0 + k);
  }
}

// layout_fuzz: reshape's -1 multiplied the other extents without an overflow check (UBSan: "4611686018427387904 *
// 1000003 cannot be represented"); a product beyond int64 divides no size.
TEST(FuzzRegressions, ReshapeWhoseOtherExtentsOverflowIsAValueError) {
  TensorPtr t = testing_support::dense_tensor(true, Shape::flat({3}), {1.0, 2.0, 3.0});
  EXPECT_SW_THROW(ValueError,
                  "reshape: shape (4611686018427387904, 1000003, -1) cannot hold 3 elements (the other extents' "
                  "product exceeds int64)",
                  reshape(t, std::vector<int64_t>{int64_t{1} << 62, 1000003, -1}));
  EXPECT_SW_THROW(ValueError, "cannot hold 3 elements", reshape(t, std::vector<int64_t>{-1, INT64_MAX, INT64_MAX}));
  EXPECT_EQ(reshape(t, std::vector<int64_t>{1, -1})->layout.shape(), Shape::flat({1, 3}));
}

// tiles_fuzz: project() (C++) bound a selection with an empty or repeated axis without the checks Python's
// TileSelection makes, and its completion never came (the fuzz target timed out in wait()). Now ValueError before
// any work, as from Python.
TEST(FuzzRegressions, AProjectionOfAnEmptyOrRepeatedAxisIsRefusedBeforeWork) {
  auto secondary = std::make_shared<CPUCarrier>(8, DType::Float32(), true, false);
  auto te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, DType::Float32(), true, false), secondary,
                                             std::vector<int64_t>{4}, std::vector<int64_t>{2}, nullptr);
  TensorPtr full = make_tensor(te, 0, column_major(Shape::flat({8})));
  EXPECT_SW_THROW(ValueError, "TileSelection axis 0 is empty", project(te, full, TileSelection{{{}}}, nullptr));
  EXPECT_SW_THROW(ValueError, "TileSelection axis 0 contains a duplicate",
                  project(te, full, TileSelection{{{1, 1}}}, nullptr));
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(te->tile_state({1}).location, TileLocation::Secondary);
  EXPECT_EQ(te->stats().promotions, 0);
  auto done = project(te, full, TileSelection{{{1}}}, nullptr);
  done->wait();
  EXPECT_EQ(done->value()->size(), 2);
}

// tiles_fuzz: promote_async / evict_async took tile indices unchecked (the bindings check theirs): one outside the
// grid read past the tile table (ASan: heap-buffer-overflow in prepare_eviction).
TEST(FuzzRegressions, AResidencyRequestForATileOutsideTheGridIsAnIndexError) {
  auto secondary = std::make_shared<CPUCarrier>(8, DType::Float32(), true, false);
  auto te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, DType::Float32(), true, false), secondary,
                                             std::vector<int64_t>{4}, std::vector<int64_t>{2}, nullptr);
  EXPECT_SW_THROW(IndexError, "evict: tile index 5 is outside the grid of 4 tiles", te->evict_async({5}));
  EXPECT_SW_THROW(IndexError, "promote: tile index -1 is outside the grid of 4 tiles", te->promote_async({1, -1}));
  EXPECT_FALSE(te->has_incomplete_work());
  EXPECT_EQ(te->tile_state({1}).location, TileLocation::Secondary);
  EXPECT_EQ(te->stats().promotions, 0);
  te->promote_async({1})->wait();
  EXPECT_EQ(te->tile_state({1}).location, TileLocation::Primary);
}

}  // namespace
}  // namespace sw
