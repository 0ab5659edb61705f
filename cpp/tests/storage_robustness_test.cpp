// File-backed storage under hostile but ordinary use: a file truncated,
// deleted, renamed or replaced while a carrier has it open (Note [A short read
// is an error] in io.cpp, Note [Files changed under a carrier] in
// storage.cpp); anonymous files that never have a name to leave behind (Note
// [Anonymous files leave no name]); paths with an embedded NUL byte; an
// immutable FileBacked over a missing file; allocations that cannot be had.
//
// Every error test checks the exception type, a message fragment naming the
// file (and what was expected), and that nothing changed: values, tile states,
// residency counters, version, and the file itself.
#include <dirent.h>
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <string>
#include <vector>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/io.hpp"
#include "strideweave/move.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using Tiled = std::shared_ptr<TiledEvictable>;

const DType& F32() { return DType::Float32(); }

constexpr int64_t kTiles = 4, kTile = 256;  // 1 KiB tiles
constexpr int64_t kTotal = kTiles * kTile;

int64_t file_size(const std::string& path) {
  struct stat st;
  return ::stat(path.c_str(), &st) == 0 ? static_cast<int64_t>(st.st_size) : -1;
}

float float_at(const std::string& path, int64_t slot) {
  float f = 0;
  std::ifstream in(path, std::ios::binary);
  in.seekg(slot * 4);
  in.read(reinterpret_cast<char*>(&f), 4);
  return f;
}

// A named FileBacked secondary of kTotal slots holding value_for(F32, slot), under a TiledEvictable with an
// empty CPU primary (every tile secondary, clean).
struct NamedTiled {
  TempPath file{"sw-robust"};
  std::shared_ptr<FileBackedCarrier> secondary;
  Tiled te;
  NamedTiled() {
    secondary = std::make_shared<FileBackedCarrier>(file.path(), F32(), true);
    secondary->grow(kTotal, true);
    fill_slots(*secondary);
    te = std::make_shared<TiledEvictable>(std::make_shared<CPUCarrier>(0, F32(), true, false), secondary,
                                          std::vector<int64_t>{kTiles}, std::vector<int64_t>{kTile}, nullptr);
  }
  const std::string& path() const { return file.path(); }
};

struct Observed {
  std::vector<TileState> states;
  TiledStats stats;
  uint64_t version;
};

Observed observe(const TiledEvictable& te) {
  Observed o;
  for (int64_t i = 0; i < te.tile_count(); ++i) o.states.push_back(te.tile_state(te.tile_coord(i)));
  o.stats = te.stats();
  o.version = te.version();
  return o;
}

void expect_unchanged(const Observed& before, const TiledEvictable& te) {
  const Observed now = observe(te);
  for (size_t i = 0; i < before.states.size(); ++i) {
    EXPECT_EQ(now.states[i].location, before.states[i].location) << "tile " << i;
    EXPECT_EQ(now.states[i].dirty, before.states[i].dirty) << "tile " << i;
    EXPECT_EQ(now.states[i].valid, before.states[i].valid) << "tile " << i;
  }
  EXPECT_EQ(now.stats.promotions, before.stats.promotions);
  EXPECT_EQ(now.stats.evictions, before.stats.evictions);
  EXPECT_EQ(now.stats.bytes_promoted, before.stats.bytes_promoted);
  EXPECT_EQ(now.stats.bytes_evicted, before.stats.bytes_evicted);
  EXPECT_EQ(now.stats.writes_skipped, before.stats.writes_skipped);
  EXPECT_EQ(now.stats.primary_tiles, before.stats.primary_tiles);
  EXPECT_EQ(now.stats.primary_bytes, before.stats.primary_bytes);
  EXPECT_EQ(now.version, before.version);
}

// The message of the error a residency request completed with ("" when it succeeded).
std::string request_error(const CompletionPtr<std::monostate>& done) {
  try {
    done->value();
  } catch (const RuntimeError& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& fragment) { return s.find(fragment) != std::string::npos; }

// ================================================================ a short read is an error

TEST(ShortRead, ReadingPastTheEndOfATruncatedFileFailsNamingFileOffsetAndCounts) {
  TempPath tmp("sw-short");
  auto c = std::make_shared<FileBackedCarrier>(tmp.path(), F32(), true);
  c->grow(1024, true);
  fill_slots(*c);
  ASSERT_EQ(::truncate(tmp.path().c_str(), 1000), 0);  // someone else truncates it to 250 slots
  std::vector<float> out(1024, -1.0f);
  EXPECT_SW_THROW(RuntimeError, "pread of " + tmp.path() + " at offset 0 expected 4096 bytes but got 1000",
                  c->read_slots(0, 1024, out.data()));
  EXPECT_SW_THROW(RuntimeError, "at offset 1200 expected 40 bytes but got 0", c->read_slots(300, 10, out.data()));
  EXPECT_SW_THROW(RuntimeError, "truncated", c->get(500));  // the public, checked read too
  EXPECT_EQ(c->get(10), value_for(F32(), 10));             // what the file still holds reads as before
  EXPECT_EQ(file_size(tmp.path()), 1000) << "a failed read changes nothing";
}

TEST(ShortRead, AColdDirectReadOfATruncatedFileFailsToo) {
  // Note [Cold reads bypass the page cache]: a read of at least 1 MiB that the page cache does not hold goes
  // O_DIRECT; the end of the file inside it (or inside the buffered head or tail) is the same error.
  constexpr int64_t kMiB = int64_t{1} << 18;  // Float32 slots
  TempPath tmp("sw-short-cold");
  {
    FileBackedCarrier w(tmp.path(), F32(), true);
    w.grow(3 * kMiB, true);
    fill_slots(w);
    io::fsync_file(w.fd(), tmp.path());
  }
  FileBackedCarrier c(tmp.path(), F32(), false);
  ASSERT_EQ(::truncate(tmp.path().c_str(), 6 * kMiB + 100), 0);  // 1.5 MiB of slots and 100 bytes are left
  int fd = ::open(tmp.path().c_str(), O_RDONLY);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  // A page-aligned destination, as a tile buffer is: the read may go direct.
  AlignedBuffer out(static_cast<size_t>(kMiB + 8) * 4, false);
  EXPECT_SW_THROW(RuntimeError, "at offset 1048576 expected 1048576 bytes but got 524388",
                  c.read_slots(kMiB, kMiB, out.data()));
  // Unaligned start (the destination shares the offset's alignment): a buffered head, the direct middle, then
  // the end of the file.
  EXPECT_SW_THROW(RuntimeError, "at offset 1048596 expected 1048576 bytes but got 524368",
                  c.read_slots(kMiB + 5, kMiB, out.data() + 20));
  // Entirely past the end.
  EXPECT_SW_THROW(RuntimeError, "at offset 2097152 expected 1048576 bytes but got 0",
                  c.read_slots(2 * kMiB, kMiB, out.data()));
}

TEST(ShortRead, APromotionFromATruncatedSecondaryFailsAndChangesNothing) {
  NamedTiled t;
  ASSERT_EQ(::truncate(t.path().c_str(), (2 * kTile + kTile / 2) * 4), 0);  // tiles 2 (half) and 3 are gone
  const Observed before = observe(*t.te);
  const std::string message = request_error(t.te->promote_async({1, 2, 3}));
  EXPECT_TRUE(has(message, t.path()) && has(message, "expected 1024 bytes but got")) << message;
  expect_unchanged(before, *t.te);  // no tile marked primary or clean from zeros
  EXPECT_SW_THROW(RuntimeError, "truncated", t.te->get(3 * kTile));  // slot access promotes: the same error
  expect_unchanged(before, *t.te);
  // The tiles the file still holds promote with their values.
  t.te->promote_async({0, 1})->value();
  EXPECT_EQ(t.te->get(kTile + 7), value_for(F32(), kTile + 7));
  EXPECT_EQ(t.te->tile_state({1}).location, TileLocation::Primary);
  EXPECT_EQ(t.te->tile_state({2}).location, TileLocation::Secondary);
}

TEST(ShortRead, ADirtyEvictionIntoATruncatedFileFailsAndLeavesNoHole) {
  NamedTiled t;
  t.te->promote_async({0, 3})->value();
  t.te->set(3 * kTile + 1, F(99.5));  // tile 3 dirty
  ASSERT_EQ(::truncate(t.path().c_str(), kTile * 4), 0);  // only tile 0 is left in the file
  const Observed before = observe(*t.te);
  const std::string message = request_error(t.te->evict_async({3}));
  EXPECT_TRUE(has(message, t.path()) && has(message, "truncated") && has(message, "must hold 4096")) << message;
  expect_unchanged(before, *t.te);
  EXPECT_TRUE(t.te->tile_state({3}).dirty) << "the only copy stays dirty and resident";
  EXPECT_EQ(t.te->get(3 * kTile + 1), F(99.5));
  EXPECT_EQ(file_size(t.path()), kTile * 4) << "the file was not re-extended with a hole";
}

// ================================================================ files changed under a carrier

TEST(ChangedFile, EvictingDirtyTilesIntoADeletedFileFailsAndKeepsThemDirtyAndResident) {
  NamedTiled t;
  t.te->promote_async({0, 1, 2})->value();
  t.te->set(5, F(-1.0));
  t.te->set(kTile + 5, F(-2.0));
  ASSERT_EQ(::unlink(t.path().c_str()), 0);
  const Observed before = observe(*t.te);
  const std::string message = request_error(t.te->evict_async({0, 1, 2}));
  EXPECT_TRUE(has(message, t.path()) && has(message, "was deleted while in use")) << message;
  expect_unchanged(before, *t.te);
  EXPECT_TRUE(t.te->tile_state({0}).dirty && t.te->tile_state({1}).dirty);
  EXPECT_EQ(t.te->get(5), F(-1.0));
  EXPECT_FALSE(file_exists(t.path())) << "nothing re-created the name";
}

TEST(ChangedFile, EvictingIntoAReplacedFileFailsAndLeavesTheReplacementAlone) {
  NamedTiled t;
  t.te->promote_async({1})->value();
  t.te->set(kTile + 3, F(42.0));
  const std::string fresh = t.path() + ".new";
  {
    std::ofstream out(fresh, std::ios::binary);
    std::vector<float> ones(kTotal, 1.0f);
    out.write(reinterpret_cast<const char*>(ones.data()), kTotal * 4);
  }
  ASSERT_EQ(::rename(fresh.c_str(), t.path().c_str()), 0);  // os.replace(new, path)
  const Observed before = observe(*t.te);
  const std::string message = request_error(t.te->evict_async({1}));
  EXPECT_TRUE(has(message, t.path()) && has(message, "was replaced by another file")) << message;
  expect_unchanged(before, *t.te);
  EXPECT_EQ(float_at(t.path(), kTile + 3), 1.0f) << "the replacement is untouched";
}

TEST(ChangedFile, EvictingIntoARenamedFileFailsThenSucceedsOnceTheNameIsBack) {
  NamedTiled t;
  t.te->promote_async({2})->value();
  t.te->set(2 * kTile, F(7.25));
  const std::string moved = t.path() + ".moved";
  ASSERT_EQ(::rename(t.path().c_str(), moved.c_str()), 0);
  const Observed before = observe(*t.te);
  const std::string message = request_error(t.te->evict_async({2}));
  EXPECT_TRUE(has(message, t.path()) && has(message, "removed or renamed")) << message;
  expect_unchanged(before, *t.te);
  ASSERT_EQ(::rename(moved.c_str(), t.path().c_str()), 0);
  t.te->evict_async({2})->value();  // the identical request succeeds once the file is back under its name
  EXPECT_EQ(t.te->tile_state({2}).location, TileLocation::Secondary);
  EXPECT_EQ(float_at(t.path(), 2 * kTile), 7.25f);
}

TEST(ChangedFile, EveryWritePathChecksANamedFile) {
  TempPath tmp("sw-changed");
  auto file = std::make_shared<FileBackedCarrier>(tmp.path(), F32(), true);
  file->grow(8, true);
  fill_slots(*file);
  ASSERT_EQ(::unlink(tmp.path().c_str()), 0);
  // A public slot write.
  const uint64_t v = file->version();
  EXPECT_SW_THROW(RuntimeError, "was deleted while in use", file->set(0, F(5.0)));
  EXPECT_EQ(file->get(0), value_for(F32(), 0));
  EXPECT_EQ(file->version(), v);
  // A move into it (consumes nothing: the source keeps its values).
  auto src = std::make_shared<CPUCarrier>(8, F32(), true, false);
  auto tensor = make_tensor(src, 0, column_major(Shape::of({8})));
  EXPECT_SW_THROW(RuntimeError, "was deleted while in use", move_async(tensor, file)->value());
  EXPECT_FALSE(src->is_released());
  EXPECT_EQ(file->get(1), value_for(F32(), 1));
  // An Evictable's evict().
  TempPath tmp2("sw-changed");
  auto secondary = std::make_shared<FileBackedCarrier>(tmp2.path(), F32(), true);
  auto primary = std::make_shared<CPUCarrier>(8, F32(), true, false);
  auto e = std::make_shared<EvictableCarrier>(primary, secondary);
  e->set(3, F(3.5));
  ASSERT_EQ(::unlink(tmp2.path().c_str()), 0);
  EXPECT_SW_THROW(RuntimeError, tmp2.path(), e->evict());
  EXPECT_FALSE(e->is_evicted());
  EXPECT_EQ(e->get(3), F(3.5));
  // A BlockDevice over a preallocated file.
  auto dev_file = make_device_file(1 << 16);
  auto device = std::make_shared<BlockDevice>(dev_file->path());
  auto extent = device->allocate(16, F32(), true, false);
  ASSERT_EQ(::unlink(dev_file->path().c_str()), 0);
  EXPECT_SW_THROW(RuntimeError, "BlockDevice file " + dev_file->path() + " was deleted", extent->set(0, F(1.0)));
  EXPECT_EQ(extent->get(0), F(0.0));
}

TEST(ChangedFile, AnonymousFilesAndIntactNamedFilesPassTheCheck) {
  auto anonymous = std::make_shared<FileBackedCarrier>("", F32(), true);
  anonymous->grow(4, true);
  anonymous->check_storage_intact("write to it");  // no name to check
  anonymous->set(0, F(1.0));
  TempPath tmp("sw-intact");
  auto named = std::make_shared<FileBackedCarrier>(tmp.path(), F32(), true);
  named->grow(4, true);
  named->check_storage_intact("write to it");
  named->set(1, F(2.0));
  EXPECT_EQ(float_at(tmp.path(), 1), 2.0f);
}

// ================================================================ anonymous files leave no name

// A private TMPDIR for one test, restored (and removed) afterwards.
class PrivateTmpdir {
 public:
  PrivateTmpdir() {
    std::string pattern = temp_dir() + "/sw-anon-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    if (!::mkdtemp(buf.data())) throw std::runtime_error("mkdtemp failed");
    dir_ = buf.data();
    const char* old = std::getenv("TMPDIR");
    had_ = old != nullptr;
    if (had_) old_ = old;
    ::setenv("TMPDIR", dir_.c_str(), 1);
  }
  ~PrivateTmpdir() {
    if (had_) ::setenv("TMPDIR", old_.c_str(), 1);
    else ::unsetenv("TMPDIR");
    for (const auto& e : entries()) ::unlink((dir_ + "/" + e).c_str());
    ::rmdir(dir_.c_str());
  }
  const std::string& dir() const { return dir_; }
  std::vector<std::string> entries() const {
    std::vector<std::string> out;
    if (DIR* d = ::opendir(dir_.c_str())) {
      while (dirent* e = ::readdir(d))
        if (std::string(e->d_name) != "." && std::string(e->d_name) != "..") out.emplace_back(e->d_name);
      ::closedir(d);
    }
    return out;
  }

 private:
  std::string dir_, old_;
  bool had_ = false;
};

std::string fd_link(int fd) {
  char buf[4096];
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(self.c_str(), buf, sizeof buf);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

TEST(AnonymousFiles, NeverHaveANameInTheDirectory) {
  PrivateTmpdir tmp;
  auto c = std::make_shared<FileBackedCarrier>("", F32(), true);
  EXPECT_TRUE(c->is_anonymous());
  EXPECT_TRUE(tmp.entries().empty()) << "nothing in TMPDIR from the moment it exists";
  c->grow(1 << 16, true);
  fill_slots(*c);
  EXPECT_EQ(c->get(12345), value_for(F32(), 12345));
  EXPECT_TRUE(tmp.entries().empty());
  // filename() is what the kernel calls the open file: in TMPDIR, deleted.
  EXPECT_EQ(c->filename(), fd_link(c->fd()));
  EXPECT_EQ(c->filename().rfind(tmp.dir() + "/", 0), 0u) << c->filename();
  EXPECT_TRUE(has(c->filename(), " (deleted)")) << c->filename();
  // Copies made by allocate_like (tiles, gradients, staging) are anonymous too.
  auto like = c->allocate_like(64, true, F32(), false);
  EXPECT_TRUE(tmp.entries().empty());
  c->release();
  like->release();
  EXPECT_TRUE(tmp.entries().empty());
}

TEST(AnonymousFiles, WhereTheFileSystemRefusesOTmpfileTheFileIsUnlinkedAtOnce) {
  PrivateTmpdir tmp;
  io::inject(io::Op::Open, EOPNOTSUPP, 1);  // the O_TMPFILE open is refused as a file system without it would
  auto c = std::make_shared<FileBackedCarrier>("", F32(), true);
  io::clear_faults();
  EXPECT_TRUE(tmp.entries().empty()) << "created with mkostemp and unlinked before use";
  EXPECT_TRUE(has(c->filename(), tmp.dir() + "/strideweave-")) << c->filename();
  EXPECT_TRUE(has(c->filename(), " (deleted)")) << c->filename();
  c->grow(100, true);
  c->set(99, F(4.5));
  EXPECT_EQ(c->get(99), F(4.5));
}

TEST(AnonymousFiles, AFailedOpenNamesTheErrnoAndLeavesNothing) {
  PrivateTmpdir tmp;
  io::inject(io::Op::Open, EMFILE, 1);
  EXPECT_SW_THROW(RuntimeError, "open of an anonymous FileBacked file in " + tmp.dir() + " failed",
                  FileBackedCarrier("", F32(), true));
  io::clear_faults();
  EXPECT_TRUE(tmp.entries().empty());
}

// ================================================================ paths and immutable files

TEST(Paths, AnEmbeddedNulIsAValueErrorAndOpensNothing) {
  TempPath tmp("sw-nul");
  const std::string prefix = tmp.path();  // exists: what a truncated path would open
  const std::string bad = prefix + std::string(1, '\0') + "tail";
  EXPECT_SW_THROW(ValueError, "embedded NUL byte", FileBackedCarrier(bad, F32(), true));
  EXPECT_SW_THROW(ValueError, "FileBacked filename", FileBackedCarrier(bad, F32(), false));
  EXPECT_SW_THROW(ValueError, "BlockDevice path", BlockDevice(bad));
  EXPECT_SW_THROW(ValueError, "embedded NUL byte", io::open_file(bad, O_RDONLY));
  const std::string missing = temp_dir() + "/sw-nul-never-" + std::to_string(::getpid());
  EXPECT_SW_THROW(ValueError, "embedded NUL byte",
                  FileBackedCarrier(missing + std::string(1, '\0') + "x", F32(), true));
  EXPECT_FALSE(file_exists(missing)) << "the part before the NUL was not created";
  EXPECT_EQ(file_size(prefix), 0);
}

TEST(Paths, AnImmutableFileBackedNeverCreatesAMissingFile) {
  const std::string missing = temp_dir() + "/sw-immutable-missing-" + std::to_string(::getpid());
  EXPECT_SW_THROW(RuntimeError, "open of " + missing + " failed: No such file or directory (ENOENT)",
                  FileBackedCarrier(missing, F32(), false));
  EXPECT_SW_THROW(RuntimeError, "creates none", FileBackedCarrier(missing, F32(), false));
  EXPECT_FALSE(file_exists(missing));
  // A mutable one still creates it.
  { FileBackedCarrier created(missing, F32(), true); }
  EXPECT_TRUE(file_exists(missing));
  ::unlink(missing.c_str());
}

// ================================================================ allocation failures

// Limits the address space to what the process maps now plus `headroom` bytes, for the scope: an allocation
// larger than the headroom fails whatever the machine's overcommit policy.
class AddressSpaceLimit {
 public:
  explicit AddressSpaceLimit(size_t headroom) {
    ::getrlimit(RLIMIT_AS, &old_);
    size_t pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    rlimit r = old_;
    r.rlim_cur = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE)) + headroom;
    if (old_.rlim_max != RLIM_INFINITY && r.rlim_cur > old_.rlim_max) r.rlim_cur = old_.rlim_max;
    ::setrlimit(RLIMIT_AS, &r);
  }
  ~AddressSpaceLimit() { ::setrlimit(RLIMIT_AS, &old_); }

 private:
  rlimit old_{};
};

TEST(Allocation, AFailedAllocationIsAMemoryErrorSayingWhatAndHowMuch) {
  constexpr int64_t kSlots = int64_t{1} << 40;  // 4 TiB of Float32
  {
    AddressSpaceLimit limit(size_t{1} << 30);
    EXPECT_SW_THROW(MemoryError, "allocating 4398046511104 bytes for a CPU carrier failed",
                    CPUCarrier(kSlots, F32(), true, false));
    auto empty = std::make_shared<CPUCarrier>(0, F32(), true, false);
    EXPECT_SW_THROW(MemoryError, "allocating 4398046511104 bytes for a CPU carrier", empty->grow(kSlots, true));
    EXPECT_EQ(empty->size(), 0) << "a failed grow changes nothing";
    EXPECT_SW_THROW(MemoryError, "bytes for a bounce buffer", AlignedBuffer(size_t{1} << 42, false, "a bounce buffer"));
    try {
      CPUCarrier c(kSlots, F32(), true, false);
      ADD_FAILURE() << "4 TiB were mapped under a 1 GiB headroom";
    } catch (const Error& e) {
      EXPECT_EQ(e.kind(), ErrorKind::Memory);  // the kind the bindings map to Python's MemoryError
    }
  }
}

}  // namespace
}  // namespace sw
