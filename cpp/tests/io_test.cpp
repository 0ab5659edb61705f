// System-call sites and test-only fault injection (strideweave/io.hpp):
// io::inject(op, errno, count, after) fails the next `count` calls of `op`
// after `after` more successful ones (count < 0: until cleared); clear_faults
// disarms everything. Failures raise RuntimeError naming the operation, the
// file, strerror and the errno name. Injected faults never reach the kernel.
#include <fcntl.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cerrno>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/io.hpp"
#include "test_support.hpp"

namespace sw {
namespace {

using namespace testing_support;
using io::Op;

class IoTest : public ::testing::Test {
 protected:
  void SetUp() override {
    io::clear_faults();
    fd_ = io::open_file(tmp_.path(), O_RDWR);
    const char init[16] = "0123456789abcde";
    io::pwrite_full(fd_, init, 16, 0, tmp_.path());
  }
  void TearDown() override {
    io::clear_faults();
    if (fd_ >= 0) ::close(fd_);
  }
  // One pwrite of 4 bytes; returns whether it succeeded.
  bool try_pwrite(const char* data = "WXYZ", int64_t off = 0) {
    try {
      io::pwrite_full(fd_, data, 4, off, tmp_.path());
      return true;
    } catch (const RuntimeError&) {
      return false;
    }
  }
  bool try_pread() {
    char buf[4];
    try {
      io::pread_full(fd_, buf, 4, 0, tmp_.path());
      return true;
    } catch (const RuntimeError&) {
      return false;
    }
  }
  std::string contents() {
    char buf[16];
    EXPECT_EQ(::pread(fd_, buf, 16, 0), 16);
    return std::string(buf, 16);
  }
  TempPath tmp_{"sw-io"};
  int fd_ = -1;
};

TEST_F(IoTest, CountFailsExactlyThatManyCalls) {
  io::inject(Op::Pwrite, EIO, 2);
  EXPECT_FALSE(try_pwrite());
  EXPECT_FALSE(try_pwrite());
  EXPECT_TRUE(try_pwrite());
  EXPECT_TRUE(try_pwrite());
}

TEST_F(IoTest, DefaultCountIsOne) {
  io::inject(Op::Pread, EIO);
  EXPECT_FALSE(try_pread());
  EXPECT_TRUE(try_pread());
}

TEST_F(IoTest, AfterSkipsThatManySuccessfulCalls) {
  io::inject(Op::Pread, EIO, 2, 3);
  std::vector<bool> got;
  for (int k = 0; k < 7; ++k) got.push_back(try_pread());
  EXPECT_EQ(got, (std::vector<bool>{true, true, true, false, false, true, true}));
}

TEST_F(IoTest, NegativeCountFailsUntilCleared) {
  io::inject(Op::Pwrite, ENOSPC, -1);
  for (int k = 0; k < 25; ++k) ASSERT_FALSE(try_pwrite()) << "call " << k;
  io::clear_faults();
  EXPECT_TRUE(try_pwrite());
  EXPECT_EQ(contents().substr(0, 4), "WXYZ");
}

TEST_F(IoTest, ForeverAfterSkipping) {
  io::inject(Op::Pwrite, EIO, -1, 2);
  EXPECT_TRUE(try_pwrite());
  EXPECT_TRUE(try_pwrite());
  for (int k = 0; k < 5; ++k) EXPECT_FALSE(try_pwrite());
}

TEST_F(IoTest, ZeroCountNeverFails) {
  io::inject(Op::Pwrite, EIO, 0);
  EXPECT_TRUE(try_pwrite());
  EXPECT_TRUE(try_pwrite());
}

TEST_F(IoTest, ClearDisarmsEveryOperation) {
  io::inject(Op::Pwrite, EIO, -1);
  io::inject(Op::Pread, EIO, -1);
  io::inject(Op::Fsync, EIO, -1);
  io::inject(Op::Open, EIO, -1);
  io::clear_faults();
  EXPECT_TRUE(try_pwrite());
  EXPECT_TRUE(try_pread());
  io::fsync_file(fd_, tmp_.path());
  int fd = io::open_file(tmp_.path(), O_RDONLY);
  EXPECT_GE(fd, 0);
  ::close(fd);
}

TEST_F(IoTest, ClearDropsPendingSkips) {
  io::inject(Op::Pread, EIO, 1, 2);
  io::clear_faults();
  for (int k = 0; k < 5; ++k) EXPECT_TRUE(try_pread());
}

TEST_F(IoTest, FaultsAreKeptPerOperation) {
  io::inject(Op::Pwrite, EIO, -1);
  EXPECT_TRUE(try_pread()) << "a pwrite fault leaves pread alone";
  io::fsync_file(fd_, tmp_.path());
  EXPECT_FALSE(try_pwrite());
}

TEST_F(IoTest, ReinjectingReplacesTheFault) {
  io::inject(Op::Pwrite, EIO, -1);
  io::inject(Op::Pwrite, ENOSPC, 1);
  EXPECT_SW_THROW(RuntimeError, "(ENOSPC)", io::pwrite_full(fd_, "abcd", 4, 0, tmp_.path()));
  EXPECT_TRUE(try_pwrite());
}

TEST_F(IoTest, InjectedFaultsNeverReachTheKernel) {
  io::inject(Op::Pwrite, EIO, 1);
  EXPECT_FALSE(try_pwrite("ABCD", 4));
  EXPECT_EQ(contents(), std::string("0123456789abcde\0", 16)) << "the failed write changed nothing";
  std::string path = tmp_.path() + ".never";
  io::inject(Op::Open, EACCES, 1);
  EXPECT_SW_THROW(RuntimeError, "EACCES", io::open_file(path, O_RDWR | O_CREAT));
  EXPECT_FALSE(file_exists(path)) << "an injected open creates no file";
}

TEST_F(IoTest, CallsCountSuccessfulAndInjectedCalls) {
  const int64_t w0 = io::calls(Op::Pwrite), r0 = io::calls(Op::Pread), f0 = io::calls(Op::Fsync);
  EXPECT_TRUE(try_pwrite());
  io::inject(Op::Pwrite, EIO, 1);
  EXPECT_FALSE(try_pwrite());
  EXPECT_TRUE(try_pread());
  io::fsync_file(fd_, tmp_.path());
  EXPECT_EQ(io::calls(Op::Pwrite) - w0, 2);
  EXPECT_EQ(io::calls(Op::Pread) - r0, 1);
  EXPECT_EQ(io::calls(Op::Fsync) - f0, 1);
}

// ---------------------------------------------------------------- messages

struct MessageCase {
  Op op;
  const char* op_name;
  int error;
  const char* errno_name;
};

TEST_F(IoTest, MessagesNameTheOperationFileAndErrno) {
  const MessageCase cases[] = {
      {Op::Pwrite, "pwrite of ", EIO, "(EIO)"},        {Op::Pwrite, "pwrite of ", ENOSPC, "(ENOSPC)"},
      {Op::Pread, "pread of ", EIO, "(EIO)"},          {Op::Fsync, "fsync of ", EIO, "(EIO)"},
      {Op::Open, "open of ", EACCES, "(EACCES)"},      {Op::Open, "open of ", ENOENT, "(ENOENT)"},
      {Op::Pwrite, "pwrite of ", EDQUOT, "(EDQUOT)"},  {Op::Pwrite, "pwrite of ", EROFS, "(EROFS)"},
      {Op::Pread, "pread of ", EPERM, "(EPERM)"},      {Op::Pwrite, "pwrite of ", EFBIG, "(EFBIG)"},
      {Op::Open, "open of ", EMFILE, "(EMFILE)"},      {Op::Pread, "pread of ", EAGAIN, "(EAGAIN)"},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(std::string(c.op_name) + c.errno_name);
    io::inject(c.op, c.error, 1);
    std::string message;
    try {
      char buf[4] = {};
      switch (c.op) {
        case Op::Open: ::close(io::open_file(tmp_.path(), O_RDONLY)); break;
        case Op::Pread: io::pread_full(fd_, buf, 4, 0, tmp_.path()); break;
        case Op::Pwrite: io::pwrite_full(fd_, buf, 4, 0, tmp_.path()); break;
        case Op::Fsync: io::fsync_file(fd_, tmp_.path()); break;
      }
      ADD_FAILURE() << "no error";
    } catch (const RuntimeError& e) {
      message = e.what();
    }
    EXPECT_EQ(message.rfind(c.op_name, 0), 0u) << message;
    EXPECT_NE(message.find(tmp_.path()), std::string::npos) << message;
    EXPECT_NE(message.find(std::strerror(c.error)), std::string::npos) << message;
    EXPECT_NE(message.find(c.errno_name), std::string::npos) << message;
    io::clear_faults();
  }
}

TEST_F(IoTest, RealKernelErrorsAreReportedTheSameWay) {
  const std::string missing = temp_dir() + "/sw-io-no-such-dir/file";
  EXPECT_SW_THROW(RuntimeError, "open of " + missing + " failed: No such file or directory (ENOENT)",
                  io::open_file(missing, O_RDONLY));
  int ro = io::open_file(tmp_.path(), O_RDONLY);
  EXPECT_SW_THROW(RuntimeError, "(EBADF)", io::pwrite_full(ro, "x", 1, 0, "the read-only fd"));
  EXPECT_SW_THROW(RuntimeError, "pwrite of the read-only fd failed", io::pwrite_full(ro, "x", 1, 0, "the read-only fd"));
  ::close(ro);
  char buf[4];
  EXPECT_SW_THROW(RuntimeError, "pread of a closed fd failed", io::pread_full(-1, buf, 4, 0, "a closed fd"));
  EXPECT_SW_THROW(RuntimeError, "fsync of a closed fd failed", io::fsync_file(-1, "a closed fd"));
}

// ---------------------------------------------------------------- full transfers

// Note [A short read is an error]: every caller reads bytes its file must hold.
TEST_F(IoTest, ReadsPastTheEndFailNamingTheFileOffsetAndCounts) {
  char buf[24];
  std::memset(buf, 'x', sizeof buf);
  EXPECT_SW_THROW(RuntimeError, "pread of " + tmp_.path() + " at offset 8 expected 24 bytes but got 8",
                  io::pread_full(fd_, buf, 24, 8, tmp_.path()));
  EXPECT_SW_THROW(RuntimeError, "at offset 40 expected 4 bytes but got 0", io::pread_full(fd_, buf, 4, 40, tmp_.path()));
  io::pread_full(fd_, buf, 8, 8, tmp_.path());  // up to the last byte: fine
  EXPECT_EQ(std::string(buf, 8), "89abcde" + std::string(1, '\0'));
}

TEST_F(IoTest, WritesExtendTheFile) {
  io::pwrite_full(fd_, "tail", 4, 100, tmp_.path());
  struct stat st;
  ASSERT_EQ(::fstat(fd_, &st), 0);
  EXPECT_EQ(st.st_size, 104);
  char buf[4];
  io::pread_full(fd_, buf, 4, 100, tmp_.path());
  EXPECT_EQ(std::string(buf, 4), "tail");
}

// ---------------------------------------------------------------- concurrency

TEST_F(IoTest, ConcurrentCallsFailExactlyCountTimes) {
  constexpr int kThreads = 4, kCalls = 100;
  io::inject(Op::Pwrite, EIO, 37, 55);
  std::atomic<int> failed{0}, succeeded{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t)
    threads.emplace_back([&, t] {
      const char data[4] = {static_cast<char>('a' + t), 0, 0, 0};
      for (int k = 0; k < kCalls; ++k) {
        try {
          io::pwrite_full(fd_, data, 1, t, tmp_.path());
          succeeded.fetch_add(1);
        } catch (const RuntimeError&) {
          failed.fetch_add(1);
        }
      }
    });
  for (auto& th : threads) th.join();
  EXPECT_EQ(failed.load(), 37);
  EXPECT_EQ(succeeded.load(), kThreads * kCalls - 37);
}


// ---------------------------------------------------------------- Note [Cold reads bypass the page cache]

namespace cold {

// Pages of [offset, offset + bytes) in the page cache, or -1 where the kernel cannot say (no cachestat).
int64_t cached_pages(int fd, int64_t offset, int64_t bytes) {
  struct {
    uint64_t off, len;
  } range{static_cast<uint64_t>(offset), static_cast<uint64_t>(bytes)};
  uint64_t stat[5] = {};
  if (::syscall(451, fd, &range, stat, 0) != 0) return -1;
  return static_cast<int64_t>(stat[0]);
}

// A file of `floats` Float32 values 0, 1, 2, ... written, synced and dropped from the page cache.
std::vector<float> write_cold(const std::string& path, int64_t floats) {
  std::vector<float> v(static_cast<size_t>(floats));
  for (int64_t i = 0; i < floats; ++i) v[static_cast<size_t>(i)] = static_cast<float>(i);
  int fd = io::open_file(path, O_RDWR | O_CREAT | O_TRUNC);
  io::pwrite_full(fd, v.data(), v.size() * 4, 0, path);
  ::fsync(fd);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
  ::close(fd);
  return v;
}

constexpr int64_t kTile = int64_t{1} << 18;  // 1 MiB of Float32

}  // namespace cold

TEST(ColdReads, AColdTileIsReadRightAndBypassesThePageCache) {
  TempPath tmp("sw-cold");
  auto want = cold::write_cold(tmp.path(), 3 * cold::kTile);
  FileBackedCarrier file(tmp.path(), DType::Float32(), false);
  const bool can_tell = cold::cached_pages(file.fd(), 0, 3 * cold::kTile * 4) == 0;  // cachestat, and dropped
  if (can_tell && file.direct_reads_possible()) {
    EXPECT_TRUE(file.read_waits_on_device(cold::kTile, cold::kTile));  // promoted on Executor::device_reads()
    EXPECT_FALSE(file.read_waits_on_device(cold::kTile, 1000));          // too small to go direct
  }
  CPUCarrier tile(cold::kTile, DType::Float32(), true, true);
  copy_slots(file, cold::kTile, tile, 0, cold::kTile);  // the middle MiB, as a promotion reads it
  std::vector<float> got(static_cast<size_t>(cold::kTile));
  tile.read_slots(0, cold::kTile, got.data());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin() + cold::kTile));
  if (can_tell && file.direct_reads_possible()) {
    // Read with O_DIRECT: the page cache still holds none of it (a buffered read leaves 256 pages there).
    EXPECT_EQ(cold::cached_pages(file.fd(), cold::kTile * 4, cold::kTile * 4), 0);
  } else {
    std::printf("cachestat or O_DIRECT unavailable here: the read went through the page cache\n");
  }
}

TEST(ColdReads, ADirtyPageIsReadAsWrittenAndWarmRangesStayInThePageCache) {
  TempPath tmp("sw-cold");
  auto want = cold::write_cold(tmp.path(), 2 * cold::kTile);
  FileBackedCarrier file(tmp.path(), DType::Float32(), true);
  // Dirty one page in the middle of the first MiB (not yet written back): the range is partly cached.
  std::vector<float> page(1024, -7.0f);
  file.write_slots(4096, 1024, page.data());
  std::copy(page.begin(), page.end(), want.begin() + 4096);
  CPUCarrier tile(cold::kTile, DType::Float32(), true, true);
  copy_slots(file, 0, tile, 0, cold::kTile);  // mostly uncached: direct, after the kernel writes the page back
  std::vector<float> got(static_cast<size_t>(cold::kTile));
  tile.read_slots(0, cold::kTile, got.data());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin()));
  // A warm range (read through the page cache by someone else) is read through it too, with the same values.
  std::vector<float> warm(static_cast<size_t>(cold::kTile));
  ASSERT_EQ(::pread(file.fd(), warm.data(), cold::kTile * 4, 0), cold::kTile * 4);
  EXPECT_FALSE(file.read_waits_on_device(0, cold::kTile));
  copy_slots(file, 0, tile, 0, cold::kTile);
  tile.read_slots(0, cold::kTile, got.data());
  EXPECT_TRUE(std::equal(got.begin(), got.end(), want.begin()));
}

TEST(ColdReads, UnalignedAndPastTheEndColdReadsAreRightToo) {
  TempPath tmp("sw-cold");
  auto want = cold::write_cold(tmp.path(), 2 * cold::kTile + 3);  // not a whole number of pages
  FileBackedCarrier file(tmp.path(), DType::Float32(), false);
  std::vector<float> got(static_cast<size_t>(cold::kTile + 1000));
  // Starts 5 floats into a page (a buffered head, then the aligned middle) and ends at the file's last float.
  const int64_t start = cold::kTile + 5;
  const int64_t inside = 2 * cold::kTile + 3 - start;
  file.read_slots(start, inside, got.data());
  EXPECT_TRUE(std::equal(got.begin(), got.begin() + inside, want.begin() + start));
  // 997 floats past the end: an error, never zeros (Note [A short read is an error]).
  cold::write_cold(tmp.path(), 2 * cold::kTile + 3);
  EXPECT_SW_THROW(RuntimeError, "expected " + std::to_string((cold::kTile + 1000) * 4) + " bytes but got " +
                                    std::to_string(inside * 4),
                  file.read_slots(start, cold::kTile + 1000, got.data()));
  // A destination whose alignment differs from the file offset's: read through pread, right all the same.
  cold::write_cold(tmp.path(), 2 * cold::kTile + 3);
  std::vector<float> odd(static_cast<size_t>(cold::kTile + 1));
  file.read_slots(0, cold::kTile, odd.data() + 1);
  EXPECT_TRUE(std::equal(odd.begin() + 1, odd.end(), want.begin()));
}

TEST(ColdReads, FaultsAndTheGateCountOneCallPerRead) {
  TempPath tmp("sw-cold");
  cold::write_cold(tmp.path(), cold::kTile);
  FileBackedCarrier file(tmp.path(), DType::Float32(), false);
  std::vector<float> got(static_cast<size_t>(cold::kTile));
  const int64_t before = io::calls(Op::Pread);
  io::inject(Op::Pread, EIO);
  EXPECT_SW_THROW(RuntimeError, "pread of " + tmp.path(), file.read_slots(0, cold::kTile, got.data()));
  file.read_slots(0, cold::kTile, got.data());  // the fault is spent
  EXPECT_EQ(got[12345], 12345.0f);
  EXPECT_EQ(io::calls(Op::Pread) - before, 2);
  io::clear_faults();
}

// io::fully_cached (how a mapped promotion decides whether to ask the kernel to read its range ahead): false for a
// range dropped from the page cache and for one partly read, true once every page of it is read; where the kernel
// lacks cachestat(2) it says it cannot tell.
TEST(ColdReads, FullyCachedTellsWhetherEveryPageOfARangeIsCached) {
  TempPath tmp("sw-cold");
  cold::write_cold(tmp.path(), 4 * cold::kTile);
  const int fd = io::open_file(tmp.path(), O_RDONLY);
  const size_t bytes = static_cast<size_t>(cold::kTile) * 4;  // 1 MiB at offset 1 MiB + 100 bytes
  const int64_t offset = cold::kTile * 4 + 100;
  const std::optional<bool> dropped = io::fully_cached(fd, bytes, offset);
  if (!dropped) {
    ::close(fd);
    GTEST_SKIP() << "cachestat(2) is unavailable here";
  }
  EXPECT_FALSE(*dropped);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_RANDOM);  // no read-ahead: a read caches what it reads
  std::vector<std::byte> buf(bytes + 8192);
  io::pread_full(fd, buf.data(), bytes / 4, offset, tmp.path());  // the first quarter of the range
  EXPECT_EQ(io::fully_cached(fd, bytes, offset), std::optional<bool>(false));
  io::pread_full(fd, buf.data(), bytes + 8192, offset - 4096, tmp.path());  // every page of the range
  EXPECT_EQ(io::fully_cached(fd, bytes, offset), std::optional<bool>(true));
  EXPECT_EQ(io::fully_cached(fd, 4096, 0), std::optional<bool>(false));  // never read after the drop
  ::close(fd);
}

}  // namespace
}  // namespace sw
