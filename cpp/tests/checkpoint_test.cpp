// The checkpoint tier (Note [A checkpoint tier]): slots read where they lie in
// existing files, writes into a copy-on-write overlay that never changes the
// files (or in place when asked), and a TiledEvictable over it that reads
// exactly the bytes of the tiles it promotes.
#include "strideweave/carriers/checkpoint.hpp"

#include <gtest/gtest.h>

#include <fcntl.h>

#include <filesystem>
#include <fstream>
#include <iterator>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"
#include "test_support.hpp"

using namespace sw;
using namespace sw::testing_support;
using Range = CheckpointCarrier::Range;
using Writes = CheckpointCarrier::Writes;

namespace {

// A file of `floats` Float32 values 0, 1, 2, ... after a `skip`-byte preamble of 0xEE bytes.
void write_floats(const std::string& path, int64_t skip, int64_t floats) {
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << std::string(static_cast<size_t>(skip), '\xEE');
  for (int64_t i = 0; i < floats; ++i) {
    const float f = static_cast<float>(i);
    out.write(reinterpret_cast<const char*>(&f), 4);
  }
}

std::string contents(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<float> read_all(const Carrier& c) {
  std::vector<float> out(static_cast<size_t>(c.size()));
  c.read_slots(0, c.size(), out.data());
  return out;
}

// Ranges of 4 floats at float offsets 8, 0 and 4 of `file` (out of file order), after its 12-byte preamble.
std::vector<Range> three_ranges(const std::shared_ptr<CheckpointFile>& file) {
  return {{file, 12 + 8 * 4, 4}, {file, 12, 4}, {file, 12 + 4 * 4, 4}};
}

}  // namespace

TEST(CheckpointTier, ReadsRangesWhereTheyLieInSlotOrder) {
  TempPath path("sw-ckpt");
  write_floats(path.path(), 12, 12);
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  CheckpointCarrier c(three_ranges(file), DType::Float32(), Writes::Overlay);
  EXPECT_EQ(c.size(), 12);
  EXPECT_EQ(read_all(c), (std::vector<float>{8, 9, 10, 11, 0, 1, 2, 3, 4, 5, 6, 7}));
  std::vector<float> piece(6);
  c.read_slots(3, 6, piece.data());  // across two range boundaries
  EXPECT_EQ(piece, (std::vector<float>{11, 0, 1, 2, 3, 4}));
  EXPECT_EQ(file->bytes_read(), (12 + 6) * 4u);
}

TEST(CheckpointTier, OverlayWritesNeverChangeTheFile) {
  TempPath path("sw-ckpt");
  write_floats(path.path(), 12, 12);
  const std::string before = contents(path.path());
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  CheckpointCarrier c(three_ranges(file), DType::Float32(), Writes::Overlay);
  const float two[2] = {-1.f, -2.f};
  c.write_slots(5, 2, two);  // part of range 1: its other values are copied to the overlay first
  EXPECT_EQ(c.overlaid_ranges(), 1);
  const uint64_t read_before_whole = file->bytes_read();
  const float four[4] = {-4.f, -5.f, -6.f, -7.f};
  c.write_slots(8, 4, four);  // all of range 2: nothing to copy
  EXPECT_EQ(file->bytes_read(), read_before_whole);
  EXPECT_EQ(c.overlaid_ranges(), 2);
  EXPECT_EQ(read_all(c), (std::vector<float>{8, 9, 10, 11, 0, -1, -2, 3, -4, -5, -6, -7}));
  EXPECT_EQ(contents(path.path()), before);
  c.flush();  // nothing to make durable: the overlay is scratch
  EXPECT_EQ(contents(path.path()), before);
}

TEST(CheckpointTier, InPlaceWritesReachTheFile) {
  TempPath path("sw-ckpt");
  write_floats(path.path(), 12, 12);
  auto file = std::make_shared<CheckpointFile>(path.path(), true);
  CheckpointCarrier c(three_ranges(file), DType::Float32(), Writes::InPlace);
  const float v[3] = {-1.f, -2.f, -3.f};
  c.write_slots(3, 3, v);  // the last slot of range 0 (file float 11), the first two of range 1 (floats 0, 1)
  c.flush();
  EXPECT_EQ(c.overlaid_ranges(), 0);
  CheckpointCarrier whole({{std::make_shared<CheckpointFile>(path.path(), false), 12, 12}}, DType::Float32(),
                          Writes::Overlay);
  EXPECT_EQ(read_all(whole), (std::vector<float>{-2, -3, 2, 3, 4, 5, 6, 7, 8, 9, 10, -1}));
}

TEST(CheckpointTier, RefusesRangesPastTheEndAndInPlaceWritesToAReadOnlyFile) {
  TempPath path("sw-ckpt");
  write_floats(path.path(), 0, 4);
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  EXPECT_SW_THROW(ValueError, "checkpoint range 1 [8, 24) lies past the end of",
                  CheckpointCarrier({{file, 0, 2}, {file, 8, 4}}, DType::Float32(), Writes::Overlay));
  EXPECT_SW_THROW(ValueError, "was opened read-only; it cannot be written in place",
                  CheckpointCarrier({{file, 0, 2}}, DType::Float32(), Writes::InPlace));
  EXPECT_SW_THROW(RuntimeError, "/nonexistent/ckpt", CheckpointFile("/nonexistent/ckpt", false));
  EXPECT_SW_THROW(ValueError, "is not a regular file", CheckpointFile(temp_dir(), false));
}

TEST(CheckpointTier, InPlaceWritesRefuseAReplacedFile) {
  TempPath path("sw-ckpt");
  write_floats(path.path(), 0, 8);
  CheckpointCarrier c({{std::make_shared<CheckpointFile>(path.path(), true), 0, 8}}, DType::Float32(),
                      Writes::InPlace);
  c.check_storage_intact("evict tiles");
  TempPath other("sw-ckpt-new");
  write_floats(other.path(), 0, 8);
  ASSERT_EQ(::rename(other.path().c_str(), path.path().c_str()), 0);
  EXPECT_SW_THROW(RuntimeError, "was replaced by another file while in use; cannot evict tiles",
                  c.check_storage_intact("evict tiles"));
}

TEST(CheckpointTier, TiledEvictablePromotesExactlyTheBytesOfItsTilesAndEvictsIntoTheOverlay) {
  TempPath path("sw-ckpt");
  const int64_t tiles = 6, tile = 256;
  write_floats(path.path(), 100, tiles * tile);
  const std::string before = contents(path.path());
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  std::vector<Range> ranges;
  for (int64_t t = tiles - 1; t >= 0; --t) ranges.push_back({file, static_cast<uint64_t>(100 + t * tile * 4), tile});
  auto secondary = std::make_shared<CheckpointCarrier>(ranges, DType::Float32(), Writes::Overlay);
  auto te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, DType::Float32(), true, false),
                                             secondary, std::vector<int64_t>{tiles}, std::vector<int64_t>{tile},
                                             nullptr);
  te->promote_async({1, 4})->value();
  EXPECT_EQ(file->bytes_read(), 2u * tile * 4);  // one read of each promoted tile, nothing else
  // Tile 1 is file tile 4 (ranges were listed last tile first).
  EXPECT_EQ(te->read_value(1 * tile + 7).f, static_cast<double>(4 * tile + 7));
  te->write_value(1 * tile + 7, Value::from_float(-3.0));
  te->evict_async({1, 4})->value();  // tile 1 is dirty: written to the overlay; tile 4 is clean: dropped
  EXPECT_EQ(secondary->overlaid_ranges(), 1);
  EXPECT_EQ(contents(path.path()), before);
  te->promote_async({1})->value();
  EXPECT_EQ(te->read_value(1 * tile + 7).f, -3.0);
  EXPECT_EQ(te->read_value(1 * tile + 8).f, static_cast<double>(4 * tile + 8));
  EXPECT_EQ(file->bytes_read(), 2u * tile * 4);  // the dirty tile came back from the overlay
}

namespace {
// Whether this process maps `path` now (/proc/self/maps names each file mapping's file).
bool maps_file(const std::string& path) {
  std::ifstream maps("/proc/self/maps");
  for (std::string line; std::getline(maps, line);)
    if (line.size() >= path.size() && line.compare(line.size() - path.size(), path.size(), path) == 0) return true;
  return false;
}
}  // namespace

// Note [Promotion by mapping]: tiles of 1 MiB and more of a read-only checkpoint are mapped copy-on-write, not read;
// writes never reach the file, a dirty tile goes to the overlay, and eviction gives the mapping back.
TEST(CheckpointTier, LargeTilesOfAReadOnlyCheckpointAreMappedCopyOnWrite) {
  TempPath path("sw-ckpt");
  const int64_t tiles = 3, tile = int64_t{1} << 18;  // 1 MiB of Float32 each, at offsets that are not page-aligned
  write_floats(path.path(), 100, tiles * tile);
  const std::string before = contents(path.path());
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  std::vector<Range> ranges;
  for (int64_t t = 0; t < tiles; ++t) ranges.push_back({file, static_cast<uint64_t>(100 + t * tile * 4), tile});
  auto secondary = std::make_shared<CheckpointCarrier>(ranges, DType::Float32(), Writes::Overlay);
  auto te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, DType::Float32(), true, false),
                                             secondary, std::vector<int64_t>{tiles}, std::vector<int64_t>{tile},
                                             nullptr);
  const std::string absolute = std::filesystem::canonical(path.path()).string();
  EXPECT_FALSE(maps_file(absolute));
  te->promote_async({0, 2})->value();
  EXPECT_TRUE(maps_file(absolute));
  EXPECT_EQ(file->bytes_read(), 2u * tile * 4);  // a mapping counts as the read it replaces
  EXPECT_EQ(te->read_value(2 * tile + 5).f, static_cast<double>(2 * tile + 5));
  EXPECT_EQ(te->read_value(tile - 1).f, static_cast<double>(tile - 1));
  te->write_value(2 * tile + 5, Value::from_float(-7.0));  // copies one page, privately
  EXPECT_EQ(te->read_value(2 * tile + 5).f, -7.0);
  EXPECT_EQ(contents(path.path()), before);
  te->evict_async({0, 2})->value();  // tile 2 is dirty: into the overlay; both mappings are given back
  EXPECT_FALSE(maps_file(absolute));
  EXPECT_EQ(secondary->overlaid_ranges(), 1);
  EXPECT_EQ(contents(path.path()), before);
  te->promote_async({2})->value();  // from the overlay: read, not mapped
  EXPECT_FALSE(maps_file(absolute));
  EXPECT_EQ(te->read_value(2 * tile + 5).f, -7.0);
  EXPECT_EQ(te->read_value(2 * tile + 6).f, static_cast<double>(2 * tile + 6));
  te->release();
}

TEST(CheckpointTier, InPlaceCheckpointsAndSmallTilesAreRead) {
  TempPath path("sw-ckpt");
  const int64_t tile = int64_t{1} << 18;
  write_floats(path.path(), 0, 2 * tile);
  auto file = std::make_shared<CheckpointFile>(path.path(), true);
  const std::string absolute = std::filesystem::canonical(path.path()).string();
  CheckpointCarrier in_place({{file, 0, tile}}, DType::Float32(), Writes::InPlace);
  EXPECT_EQ(in_place.map_slots(0, tile), nullptr);
  CheckpointCarrier overlay({{file, 0, tile}, {file, static_cast<uint64_t>(tile) * 4, tile}}, DType::Float32(),
                            Writes::Overlay);
  EXPECT_EQ(overlay.map_slots(0, tile / 2), nullptr);    // half a MiB: read
  EXPECT_EQ(overlay.map_slots(1, tile), nullptr);        // across two ranges
  CarrierPtr mapped = overlay.map_slots(tile, tile);     // the second range, whole
  ASSERT_NE(mapped, nullptr);
  EXPECT_TRUE(maps_file(absolute));
  EXPECT_EQ(mapped->read_value(3).f, static_cast<double>(tile + 3));
  mapped.reset();
  EXPECT_FALSE(maps_file(absolute));
}

TEST(CheckpointTier, ATruncatedCheckpointIsReadNotMappedAndTheReadFails) {
  TempPath path("sw-ckpt");
  const int64_t tile = int64_t{1} << 18;
  write_floats(path.path(), 0, 2 * tile);
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  auto secondary = std::make_shared<CheckpointCarrier>(
      std::vector<Range>{{file, 0, tile}, {file, static_cast<uint64_t>(tile) * 4, tile}}, DType::Float32(),
      Writes::Overlay);
  ASSERT_EQ(::truncate(path.path().c_str(), tile * 4 + 16), 0);
  EXPECT_EQ(secondary->map_slots(tile, tile), nullptr);
  auto te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, DType::Float32(), true, false),
                                             secondary, std::vector<int64_t>{2}, std::vector<int64_t>{tile}, nullptr);
  EXPECT_SW_THROW(RuntimeError, "bytes but got", te->promote_async({1})->value());
  EXPECT_EQ(te->tile_state({1}).location, TileLocation::Secondary);  // nothing changed
  te->promote_async({0})->value();                       // the range the file still holds is mapped
  EXPECT_EQ(te->read_value(9).f, 9.0);
  te->release();
}

// A tile whose pages left the page cache is read ahead whole, then mapped: the same values.
TEST(CheckpointTier, AMappedTileOutOfThePageCacheHoldsTheFilesValues) {
  TempPath path("sw-ckpt");
  const int64_t tile = int64_t{1} << 18;
  write_floats(path.path(), 4100, 2 * tile);
  {
    const int fd = ::open(path.path().c_str(), O_RDONLY);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fdatasync(fd), 0);
    ASSERT_EQ(::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED), 0);  // clean pages leave the cache
    ::close(fd);
  }
  auto file = std::make_shared<CheckpointFile>(path.path(), false);
  CheckpointCarrier c({{file, 4100, tile}, {file, 4100 + static_cast<uint64_t>(tile) * 4, tile}}, DType::Float32(),
                      Writes::Overlay);
  CarrierPtr mapped = c.map_slots(tile, tile);
  ASSERT_NE(mapped, nullptr);
  std::vector<float> got(static_cast<size_t>(tile));
  mapped->read_slots(0, tile, got.data());
  for (int64_t i = 0; i < tile; i += 4099) EXPECT_EQ(got[static_cast<size_t>(i)], static_cast<float>(tile + i));
  EXPECT_EQ(got.back(), static_cast<float>(2 * tile - 1));
}
