// Row-major tiles (PyTorch's (out, in) order within each tile): the within-tile layout a full tensor gives every
// tile (Note [Within-tile layouts] in cpp/src/tiled/tile_copies.hpp), compact tensors that keep it, one-tile
// projections that share the tile, and the matmul gradient written into a row-major gradient tile.
#include <gtest/gtest.h>

#include <cstring>

#include "strideweave/autograd.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/ops.hpp"
#include "strideweave/tiled/data.hpp"
#include "../src/tiled/tile_copies.hpp"
#include "tiled_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using namespace tiled_testing;

constexpr int64_t kOut = 6, kIn = 4, kE = 3;

// The expert-last full tensor over grid (1, E), tile (out, in): row-major or column-major within the tile.
TensorPtr expert_full(const Tiled& te, bool row_major) {
  Shape s(IntTuple::tuple({kOut, IntTuple::tuple({kIn, kE})}));
  Stride st = row_major ? Stride(IntTuple::tuple({kIn, IntTuple::tuple({1, kOut * kIn})}))
                        : Stride(IntTuple::tuple({1, IntTuple::tuple({kOut, kOut * kIn})}));
  return make_tensor(te, 0, Layout(s, st));
}

// The value of expert e at (o, i) in the row-major form: slot o * in + i + out * in * e of the secondary.
Value row_major_value(int64_t e, int64_t o, int64_t i) { return value_for(F32(), o * kIn + i + kOut * kIn * e); }

TEST_F(TiledTest, ARowMajorTensorMapsEveryTileThroughOneDensePermutation) {
  Tiled te = make_tiled({1, kE}, {kOut, kIn});
  TensorPtr row = expert_full(te, true);
  te->check_footprints(*row);
  TileAccess a(*te, *row);
  EXPECT_FALSE(a.canonical);
  ASSERT_TRUE(a.uniform);
  ASSERT_TRUE(a.dense_permutation);
  EXPECT_EQ(a.mode_order, (std::vector<size_t>{1, 0}));
  const std::vector<int64_t> cshape{kOut, 2 * kIn};
  EXPECT_EQ(a.compact_strides(cshape), (std::vector<int64_t>{2 * kIn, 1}));
  // Every tile, every within-tile ordinal: the layout agrees with the slot-by-slot answer.
  for (int64_t t = 0; t < kE; ++t)
    for (int64_t w = 0; w < kOut * kIn; ++w) {
      const int64_t slot = row->layout.flat().index(te->geometry().slot(t, w));
      EXPECT_EQ(te->geometry().locate(slot), (std::pair<int64_t, int64_t>{t, a.physical_within(t, w)})) << t << " " << w;
    }
  TileAccess col(*te, *expert_full(te, false));
  EXPECT_TRUE(col.canonical && col.dense_permutation);
  EXPECT_EQ(col.compact_strides(cshape), (std::vector<int64_t>{1, kOut}));
  // A projection's layout (Note [Tile-major projections]): row-major tiles side by side are tile-major, a
  // materialisation keeps the dense row-major order, column-major tiles stay column-major.
  const std::vector<int64_t> two{1, 2};
  EXPECT_EQ(a.compact_layout(cshape, two, true), Layout(Shape(IntTuple::tuple({kOut, IntTuple::tuple({kIn, 2})})),
                                                        Stride(IntTuple::tuple({kIn, IntTuple::tuple({1, kOut * kIn})}))));
  EXPECT_EQ(a.compact_layout(cshape, two, false), Layout(Shape::flat(cshape), Stride::flat({2 * kIn, 1})));
  EXPECT_EQ(col.compact_layout(cshape, two, true), column_major(Shape::flat(cshape)));
  // The three-mode form (out, in, E), one expert per tile: the tiles are already one run each, the layout flat.
  Tiled three = make_tiled({1, 1, kE}, {kOut, kIn, 1});
  TensorPtr t3 = make_tensor(three, 0, Layout(Shape::flat({kOut, kIn, kE}), Stride::flat({kIn, 1, kOut * kIn})));
  TileAccess r(*three, *t3);
  ASSERT_TRUE(r.dense_permutation);
  const std::vector<int64_t> rshape{kOut, kIn, 2}, rcounts{1, 1, 2};
  EXPECT_EQ(r.compact_layout(rshape, rcounts, true), Layout(Shape::flat(rshape), Stride::flat({kIn, 1, kOut * kIn})));
}

TEST_F(TiledTest, ABlockedWithinTileOrderIsUniformButNoPermutation) {
  Tiled te = make_tiled({2, 3}, {4, 6});  // logical (8, 18): footprints not contiguous
  // row r = a + 2 b + 4 t, column q = e + 2 f + 6 u: slot a + 2 e + 8 (b + 2 f) + 4 t + 48 u
  TensorPtr blocked = make_tensor(te, 0, Layout(Shape(IntTuple::tuple({IntTuple::tuple({2, 2, 2}), IntTuple::tuple({2, 3, 3})})),
                                                Stride(IntTuple::tuple({IntTuple::tuple({1, 8, 4}), IntTuple::tuple({2, 16, 48})}))));
  te->check_footprints(*blocked);
  TileAccess b(*te, *blocked);
  EXPECT_TRUE(b.uniform);
  EXPECT_FALSE(b.dense_permutation);
  for (int64_t t = 0; t < te->tile_count(); ++t)
    for (int64_t w = 0; w < 24; ++w) {
      const int64_t slot = blocked->layout.flat().index(te->geometry().slot(t, w));
      EXPECT_EQ(te->geometry().locate(slot), (std::pair<int64_t, int64_t>{t, b.physical_within(t, w)})) << t << " " << w;
    }
  // Leaves (3, 2) over tiles of 2 along that mode: no leaf boundary at the tile boundary, so no uniform map.
  Tiled line = make_tiled({1, 3}, {1, 2});
  TensorPtr unsplit = make_tensor(line, 0, Layout(Shape(IntTuple::tuple({1, IntTuple::tuple({3, 2})})),
                                                  Stride(IntTuple::tuple({1, IntTuple::tuple({2, 1})}))));
  EXPECT_FALSE(TileAccess(*line, *unsplit).uniform);
}

TEST_F(TiledTest, ProjectingRowMajorTilesKeepsTheirOrderAndSharesOneTile) {
  GradModeGuard no_grad(false);
  Tiled te = make_tiled({1, kE}, {kOut, kIn});
  TensorPtr full = expert_full(te, true);
  te->promote_async(all_tiles(*te))->value();
  TensorPtr one = project(te, full, {{{0}, {2}}}, nullptr)->value();
  EXPECT_EQ(one->layout, Layout(Shape::flat({kOut, kIn}), Stride::flat({kIn, 1})));
  EXPECT_EQ(one->carrier->native_data(), TiledInternals::tile_buffer(*te, 2)->native_data());  // no copy
  TensorPtr two = project(te, full, {{{0}, {2, 0}}}, nullptr)->value();
  EXPECT_EQ(two->layout, Layout(Shape::flat({kOut, 2 * kIn}), Stride::flat({2 * kIn, 1})));
  // Tile-major (Note [Tile-major projections]): (out, (in, 2)) : (in, (1, out x in)), each tile in one run.
  TensorPtr tiles = project(te, full, {{{0}, {2, 0}}}, nullptr, /*tile_major=*/true)->value();
  EXPECT_EQ(tiles->layout, Layout(Shape(IntTuple::tuple({kOut, IntTuple::tuple({kIn, 2})})),
                                  Stride(IntTuple::tuple({kIn, IntTuple::tuple({1, kOut * kIn})}))));
  const int64_t chosen[2] = {2, 0};
  for (int64_t o = 0; o < kOut; ++o)
    for (int64_t q = 0; q < 2 * kIn; ++q) {
      const Value want = row_major_value(chosen[q / kIn], o, q % kIn);
      EXPECT_EQ(two->carrier->read_value(two->layout.index(Coord::tuple({o, q}))), want) << o << " " << q;
      EXPECT_EQ(tiles->carrier->read_value((q / kIn) * kOut * kIn + o * kIn + q % kIn), want) << o << " " << q;
      if (q < kIn) EXPECT_EQ(one->carrier->read_value(one->layout.index(Coord::tuple({o, q}))), want);
    }
}

// Note [Copying runs]: runs of 1 KiB and more (here 300 Float32 values: one KiB block and a 176-byte tail) are
// copied by the AVX-512 block kernel where the machine has it, by memcpy on the portable path. Both paths gather
// the same values into an interleaved compact tensor, and scatter them back into the same tile buffers.
TEST_F(TiledTest, LongRowRunsCopyTheSameOnBothKernelPaths) {
  GradModeGuard no_grad(false);
  constexpr int64_t out = 5, in = 300, experts = 3;
  for (bool portable : {false, true}) {
    SCOPED_TRACE(portable ? "portable" : run_copy_path());
    const bool was = force_portable_run_copies(portable);
    Tiled te = make_tiled({1, experts}, {out, in});
    TensorPtr full = make_tensor(te, 0, Layout(Shape(IntTuple::tuple({out, IntTuple::tuple({in, experts})})),
                                               Stride(IntTuple::tuple({in, IntTuple::tuple({1, out * in})}))));
    te->promote_async(all_tiles(*te))->value();
    TensorPtr two = project(te, full, {{{0}, {2, 0}}}, nullptr)->value();
    ASSERT_EQ(two->layout, Layout(Shape::flat({out, 2 * in}), Stride::flat({2 * in, 1})));
    const int64_t chosen[2] = {2, 0};
    int64_t wrong = 0;
    for (int64_t o = 0; o < out; ++o)
      for (int64_t q = 0; q < 2 * in; ++q)
        wrong += !(two->carrier->read_value(o * 2 * in + q) ==
                   value_for(F32(), o * in + q % in + out * in * chosen[q / in]));
    EXPECT_EQ(wrong, 0);
    // Back into fresh tiles: each selected tile's buffer holds its expert's values in row-major order.
    TensorPtr back = scatter(te, two, full, {{{0}, {2, 0}}}, /*add=*/false)->value();
    auto& bt = static_cast<TiledEvictable&>(*back->carrier);
    for (int64_t e : chosen) {
      CarrierPtr buf = TiledInternals::tile_buffer(bt, bt.tile_index({0, e}));
      ASSERT_TRUE(buf);
      for (int64_t k = 0; k < out * in; ++k) wrong += !(buf->read_value(k) == value_for(F32(), k + out * in * e));
    }
    EXPECT_EQ(wrong, 0);
    force_portable_run_copies(was);
  }
}

// Note [Gathering in the caller]: a projection of readable tiles is copied before project returns, each tile in
// pieces split over the compute pool. The tiles here are large enough for several pieces each, and of odd sizes,
// so pieces end inside runs and do not all hold the same number of slots. Every value must be where the
// selection puts it, on both run-copy kernels, for row-major tiles side by side (one run per row and tile),
// tile-major, and column-major tiles (one run per tile, split between pieces); and the selection threads' path
// (set_caller_gather_bytes(0)) must give the same bytes.
TEST_F(TiledTest, ProjectionsGatheredInPiecesPutEveryValueWhereTheSelectionSays) {
  GradModeGuard no_grad(false);
  constexpr int64_t out = 203, in = 331, experts = 3;  // 67,193 slots a tile: 4 pieces of Float32, 2 of BFloat16
  const int64_t chosen[2] = {2, 0};
  for (const DType* dt : {&DType::Float32(), &DType::BFloat16()}) {
    for (bool portable : {false, true}) {
      const bool was = force_portable_run_copies(portable);
      // Every slot's bytes are its number (mod 2^16 for BFloat16), compared as bytes: no two slots a misplaced
      // copy could confuse hold the same bits, whatever value the bits are.
      const size_t w = slot_bytes(*dt);
      const int64_t total = out * in * experts;
      std::vector<std::byte> bits(static_cast<size_t>(total) * w);
      for (int64_t k = 0; k < total; ++k) std::memcpy(bits.data() + static_cast<size_t>(k) * w, &k, w);
      auto secondary = std::make_shared<FileBackedCarrier>("", *dt, true);
      secondary->grow(total, true);
      secondary->write_slots(0, total, bits.data());
      auto te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, *dt, true, false), secondary,
                                                 std::vector<int64_t>{1, experts}, std::vector<int64_t>{out, in},
                                                 nullptr);
      te->promote_async(all_tiles(*te))->value();
      for (int form = 0; form < 3; ++form) {  // row-major side by side, row-major tile-major, column-major
        SCOPED_TRACE(std::string(dt->name()) + (portable ? " portable " : " blocked ") + std::to_string(form));
        const bool row = form < 2;
        const Shape shape(IntTuple::tuple({out, IntTuple::tuple({in, experts})}));
        const Stride stride = row ? Stride(IntTuple::tuple({in, IntTuple::tuple({1, out * in})}))
                                  : Stride(IntTuple::tuple({1, IntTuple::tuple({out, out * in})}));
        TensorPtr full = make_tensor(te, 0, Layout(shape, stride));
        auto handle = project(te, full, {{{0}, {2, 0}}}, nullptr, /*tile_major=*/form == 1);
        EXPECT_TRUE(handle->done());  // gathered before project returned
        TensorPtr two = handle->value();
        // The compact value at (o, q), q < 2 in, against the secondary slot the full tensor maps it to.
        int64_t wrong = 0;
        for (int64_t o = 0; o < out; ++o)
          for (int64_t q = 0; q < 2 * in; ++q) {
            const int64_t e = chosen[q / in], i = q % in;
            const int64_t slot = (row ? o * in + i : o + out * i) + out * in * e;
            const int64_t at = form == 0 ? o * 2 * in + q : form == 1 ? o * in + i + out * in * (q / in) : o + out * q;
            wrong += std::memcmp(two->carrier->native_data() + static_cast<size_t>(at) * w,
                                 bits.data() + static_cast<size_t>(slot) * w, w) != 0;
          }
        EXPECT_EQ(wrong, 0);
        const int64_t before = set_caller_gather_bytes(0);
        TensorPtr async = project(te, full, {{{0}, {2, 0}}}, nullptr, form == 1)->value();
        set_caller_gather_bytes(before);
        ASSERT_EQ(async->layout, two->layout);
        EXPECT_EQ(std::memcmp(async->carrier->native_data(), two->carrier->native_data(),
                              static_cast<size_t>(2 * out * in) * w), 0);
      }
      force_portable_run_copies(was);
    }
  }
}

// y = x w^T for a one-expert projection w, backward(g) twice: the first gradient is adopted as the tile, the
// second added into the resident row-major tile through a transposed sink. Both equal g^T x (times the count of
// steps), within the Float32 bound of a sum of n products: n u / (1 - n u) times the sum of magnitudes.
TEST_F(TiledTest, MatmulGradientsLandInRowMajorTilesInTheirOrder) {
  Tiled te = make_tiled({1, kE}, {kOut, kIn});
  TensorPtr full = expert_full(te, true);
  constexpr int64_t kTokens = 3;
  std::vector<float> x(kTokens * kIn), g(kTokens * kOut);  // column-major (tokens, in) and (tokens, out)
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 7) * 0.25f - 0.5f;
  for (size_t i = 0; i < g.size(); ++i) g[i] = static_cast<float>(i % 5) * 0.5f - 1.0f;
  auto cpu = [](const std::vector<float>& v, int64_t r, int64_t c) {
    auto car = std::make_shared<CPUCarrier>(r * c, F32(), true, false);
    car->write_slots(0, r * c, v.data());
    return make_tensor(car, 0, column_major(Shape::flat({r, c})));
  };
  TensorPtr xt = cpu(x, kTokens, kIn), gt = cpu(g, kTokens, kOut);
  for (int step = 1; step <= 3; ++step) {
    TensorPtr w = project(te, full, {{{0}, {1}}}, nullptr)->value();
    const Operand ops[] = {Operand::of(xt), Operand::of(w)};
    TensorPtr y = call_op(OpId::Matmul, ops);
    backward(y, gt, false);
    ASSERT_TRUE(full->grad);
    EXPECT_EQ(full->grad->layout, full->layout);
    for (int64_t o = 0; o < kOut; ++o)
      for (int64_t i = 0; i < kIn; ++i) {
        double want = 0, mag = 0;
        for (int64_t t = 0; t < kTokens; ++t) {
          want += double(g[t + kTokens * o]) * double(x[t + kTokens * i]);
          mag += std::abs(double(g[t + kTokens * o]) * double(x[t + kTokens * i]));
        }
        const double n = step * kTokens, u = std::ldexp(1.0, -24);
        const Value got = full->grad->carrier->read_value(o * kIn + i + kOut * kIn * 1);
        EXPECT_NEAR(got.f, step * want, n * u / (1 - n * u) * step * mag) << step << " " << o << " " << i;
        EXPECT_EQ(full->grad->carrier->read_value(o * kIn + i).f, 0.0);  // expert 0 untouched
      }
  }
}

}  // namespace
}  // namespace sw
