#include "strideweave/io.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <new>
#include <string_view>

#include "strideweave/errors.hpp"
#include "strideweave/fork.hpp"

namespace sw::io {

namespace {
struct Fault {
  std::atomic<int> error{0};
  std::atomic<int> remaining{0};  // < 0: forever
  std::atomic<int> skip{0};
  std::atomic<int64_t> calls{0};
};
std::array<Fault, kOpCount> g_faults;
std::atomic<bool> g_armed{false};

const char* op_name(Op op) {
  switch (op) {
    case Op::Open: return "open";
    case Op::Pread: return "pread";
    case Op::Pwrite: return "pwrite";
    case Op::Fsync: return "fsync";
    case Op::Ftruncate: return "ftruncate";
    case Op::Flock: return "flock";
    case Op::Fstat: return "fstat";
  }
  return "?";
}

const char* errno_name(int e) {
  switch (e) {
    case EIO: return "EIO";
    case ENOSPC: return "ENOSPC";
    case EACCES: return "EACCES";
    case ENOENT: return "ENOENT";
    case EINVAL: return "EINVAL";
    case EBADF: return "EBADF";
    case EROFS: return "EROFS";
    case EDQUOT: return "EDQUOT";
    default: break;
  }
#if defined(__GLIBC__) && (__GLIBC__ > 2 || (__GLIBC__ == 2 && __GLIBC_MINOR__ >= 32))
  if (const char* name = ::strerrorname_np(e)) return name;  // every other errno by its symbolic name
#endif
  return "errno";
}

// Returns an injected errno for this call, or 0.
int injected(Op op) {
  Fault& f = g_faults[static_cast<int>(op)];
  f.calls.fetch_add(1, std::memory_order_relaxed);
  if (!g_armed.load(std::memory_order_acquire)) return 0;
  int e = f.error.load();
  if (!e) return 0;
  int skip = f.skip.load();
  while (skip > 0) {
    if (f.skip.compare_exchange_weak(skip, skip - 1)) return 0;
  }
  int left = f.remaining.load();
  while (true) {
    if (left == 0) return 0;
    if (left < 0) return e;
    if (f.remaining.compare_exchange_weak(left, left - 1)) return e;
  }
}

// The test-only gate (see hold()).
struct Gate {
  std::mutex m;
  std::condition_variable cv;
  std::array<bool, kOpCount> held{};
  std::array<int64_t, kOpCount> waiting{};
};
Gate& gate() {
  static Gate* g = [] {
    auto* made = new Gate();  // never destroyed: library threads may still pass through at exit
    // An I/O thread passing the gate holds its lock for a moment (Note [Fork safety]): the lock is held across
    // fork(); the child forgets the parent's blocked calls and their condition variable.
    on_fork(ForkLevel::TestGate, [] { gate().m.lock(); }, [] { gate().m.unlock(); }, [] {
      Gate& child = gate();
      new (&child.cv) std::condition_variable();
      child.waiting.fill(0);
      child.m.unlock();
    });
    return made;
  }();
  return *g;
}
std::atomic<bool> g_gate_armed{false};

void pass_gate(Op op) {
  if (!g_gate_armed.load(std::memory_order_acquire)) return;
  Gate& g = gate();
  const auto k = static_cast<size_t>(op);
  std::unique_lock lock(g.m);
  if (!g.held[k]) return;
  g.waiting[k]++;
  g.cv.notify_all();
  g.cv.wait_for(lock, std::chrono::seconds(60), [&] { return !g.held[k]; });
  g.waiting[k]--;
}

[[noreturn]] void fail(Op op, const std::string& what, int e) {
  raise<RuntimeError>(op_name(op), " of ", what, " failed: ", std::strerror(e), " (", errno_name(e), ")");
}
}  // namespace

void inject(Op op, int error, int count, int after) {
  Fault& f = g_faults[static_cast<int>(op)];
  f.error.store(error);
  f.skip.store(after);
  f.remaining.store(count);
  g_armed.store(true, std::memory_order_release);
}

void clear_faults() {
  for (auto& f : g_faults) {
    f.error.store(0);
    f.remaining.store(0);
    f.skip.store(0);
  }
  g_armed.store(false, std::memory_order_release);
  unhold();
}

void hold(Op op) {
  Gate& g = gate();
  std::lock_guard lock(g.m);
  g.held[static_cast<size_t>(op)] = true;
  g_gate_armed.store(true, std::memory_order_release);
}

void unhold() {
  Gate& g = gate();
  {
    std::lock_guard lock(g.m);
    g.held.fill(false);
  }
  g.cv.notify_all();
}

int64_t held_waiting(Op op) {
  Gate& g = gate();
  std::lock_guard lock(g.m);
  return g.waiting[static_cast<size_t>(op)];
}

bool wait_held(Op op, int64_t n, double timeout_s) {
  Gate& g = gate();
  const auto k = static_cast<size_t>(op);
  std::unique_lock lock(g.m);
  // pass_gate notifies the gate's condition each time a call starts waiting.
  return g.cv.wait_for(lock, std::chrono::duration<double>(timeout_s), [&] { return g.waiting[k] >= n; });
}

int64_t calls(Op op) { return g_faults[static_cast<int>(op)].calls.load(); }

void raise_failure(Op op, const std::string& what, int error) { fail(op, what, error); }

void check_path(const std::string& path, const char* what) {
  const size_t nul = path.find('\0');
  if (nul == std::string::npos) return;
  // The system call would see only the part before the NUL: another file than the one named.
  raise<ValueError>(what, " ", std::string_view(path).substr(0, nul), "\\0", std::string_view(path).substr(nul + 1),
                    " contains an embedded NUL byte (at position ", nul, ")");
}

namespace {
// What kind of file a FIFO or socket is, for the message below; nullptr for any other kind.
const char* unseekable_kind(mode_t mode) {
  if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
  if (S_ISSOCK(mode)) return "a socket";
  return nullptr;
}

[[noreturn]] void refuse_unseekable(const std::string& path, const char* kind) {
  raise<ValueError>(path, " is ", kind, ", not a regular file: a regular file was expected (StrideWeave reads and "
                    "writes its files at offsets)");
}

int open_retrying(const std::string& path, int flags, int mode) {
  int fd;
  do fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  while (fd < 0 && errno == EINTR);
  return fd < 0 ? -errno : fd;
}
}  // namespace

// Note [Opening never blocks]: open(2) of a FIFO blocks until another process
// opens its other end (forever, for a FIFO planted where a checkpoint or a
// FileBacked file was expected), and a terminal or a serial line may block
// until a carrier appears. Every file this library opens is read and written
// at offsets, which none of those can serve. So every open asks O_NONBLOCK
// (which changes nothing for a regular file or a block device), fstats what it
// got, refuses a FIFO or socket with ValueError naming the path, and clears
// O_NONBLOCK again before the descriptor is used. A write-only open of a FIFO
// with no reader fails with ENXIO instead: the name is stat'ed to say why. A
// lease held on a regular file (EWOULDBLOCK under O_NONBLOCK) is waited for as
// before, with a blocking open once the name is seen to be a regular file.
int try_open_file(const std::string& path, int flags, int mode) {
  check_path(path, "path");
  pass_gate(Op::Open);
  if (int e = injected(Op::Open)) return -e;
  if (flags & O_NONBLOCK) return open_retrying(path, flags, mode);  // the caller asked for it, and handles it
  int fd = open_retrying(path, flags | O_NONBLOCK, mode);
  if (fd == -ENXIO || fd == -EWOULDBLOCK) {
    struct ::stat st {};
    if (::stat(path.c_str(), &st) == 0) {
      if (const char* kind = unseekable_kind(st.st_mode)) refuse_unseekable(path, kind);
      if (fd == -EWOULDBLOCK && S_ISREG(st.st_mode)) fd = open_retrying(path, flags, mode);  // a lease: wait it out
    }
  }
  if (fd < 0) return fd;
  struct ::stat st {};
  if (::fstat(fd, &st) == 0) {
    if (const char* kind = unseekable_kind(st.st_mode)) {
      ::close(fd);
      refuse_unseekable(path, kind);
    }
  }
  const int fl = ::fcntl(fd, F_GETFL);
  if (fl >= 0 && (fl & O_NONBLOCK)) ::fcntl(fd, F_SETFL, fl & ~O_NONBLOCK);
  return fd;
}

int open_file(const std::string& path, int flags, int mode) {
  int fd = try_open_file(path, flags, mode);
  if (fd < 0) fail(Op::Open, path, -fd);
  return fd;
}

namespace {

// Reads with pread until done or the end of the file; returns the bytes read (fewer than asked only at the end).
size_t pread_buffered(int fd, char* p, size_t bytes, int64_t offset, const std::string& what) {
  size_t done = 0;
  while (done < bytes) {
    ssize_t n = ::pread(fd, p + done, bytes - done, offset + static_cast<int64_t>(done));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(Op::Pread, what, errno);
    }
    if (n == 0) break;  // the end of the file
    done += static_cast<size_t>(n);
  }
  return done;
}

// Note [A short read is an error]: every caller reads slots that its file must
// hold (FileBacked sizes itself from the file and grows it with ftruncate; a
// BlockDevice's capacity is within the file), so the end of the file before the
// last byte asked for means the file changed under the carrier: truncated by
// someone else while in use. Zero-filling the rest (as this once did) handed
// out zeros for lost values, let a promotion mark them clean, and a later
// eviction wrote the file out again with a hole where they were. Zeros come
// only from tiles declared implicit; a short read fails before anything is
// published, like any other read error.
[[noreturn]] void short_read(const std::string& what, int64_t offset, size_t expected, size_t got) {
  raise<RuntimeError>("pread of ", what, " at offset ", offset, " expected ", expected, " bytes but got ", got,
                      ": the file ends at ", offset + static_cast<int64_t>(got),
                      " (was it truncated while in use?)");
}

// cachestat(2) (Linux 6.5): how many pages of a range the page cache holds, without reading or prefetching them.
constexpr long kCachestat = 451;  // the same number on every architecture
struct CachestatRange {
  uint64_t off, len;
};
struct Cachestat {
  uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted;
};

}  // namespace

std::optional<bool> fully_cached(int fd, size_t bytes, int64_t offset) {
  const uint64_t page = 4096, first = static_cast<uint64_t>(offset) / page * page;
  const uint64_t last = (static_cast<uint64_t>(offset) + bytes + page - 1) / page * page;
  CachestatRange range{first, last - first};
  Cachestat stat{};
  if (::syscall(kCachestat, fd, &range, &stat, 0) != 0) return std::nullopt;
  return stat.nr_cache * page >= last - first;
}

bool mostly_uncached(int fd, size_t bytes, int64_t offset) {
  CachestatRange range{static_cast<uint64_t>(offset), static_cast<uint64_t>(bytes)};
  Cachestat stat{};
  if (::syscall(kCachestat, fd, &range, &stat, 0) != 0) return false;  // ENOSYS before Linux 6.5: stay buffered
  return stat.nr_cache * 4096 * 2 < bytes;
}

// Note [Cold reads bypass the page cache]: a buffered read of data the page
// cache does not hold allocates page-cache pages, has the kernel zero and fill
// them, and copies them into the tile: CPU time on the cores the computation
// needs, and on virtual machines whose host backs guest pages lazily the
// zeroing alone ran at 0.6-3 GB/s, varying several-fold from one read to the
// next (measured on a 2-vCPU AMD EPYC guest: cold 512 MiB through 4 I/O threads
// at 1.7-3.2 GB/s with 0.07-0.17 s of CPU, direct at 1.8-1.9 GB/s with 0.02 s).
// A tile read of at least kDirectMin bytes from a file whose same-inode
// O_DIRECT descriptor the caller passes therefore asks the page cache first
// (cachestat(2), which neither reads nor prefetches): a range it holds at least
// half of is read through it as before (warm reads stay at memory speed); any
// other range is read with O_DIRECT straight into the tile's memory, its 4
// KiB-aligned middle at least. The values are the same either way: before a
// direct read the kernel writes back the range's dirty pages, and clean cached
// pages equal the file. Anything unaligned, short or refused goes through
// pread. Cold data read this way is not cached for the next read: a tiered
// tensor's secondary tier is read when a tile is promoted, and the primary
// tier is its cache.
void pread_full(int fd, void* buf, size_t bytes, int64_t offset, const std::string& what, int direct_fd) {
  pass_gate(Op::Pread);
  if (int e = injected(Op::Pread)) fail(Op::Pread, what, e);
  auto* p = static_cast<char*>(buf);
  constexpr size_t kAlign = 4096;
  if (direct_fd >= 0 && bytes >= kDirectMin &&
      reinterpret_cast<uintptr_t>(p) % kAlign == static_cast<uint64_t>(offset) % kAlign &&
      mostly_uncached(fd, bytes, offset)) {
    const size_t head = (kAlign - static_cast<uint64_t>(offset) % kAlign) % kAlign;
    size_t mid = (bytes - head) / kAlign * kAlign;
    size_t done = pread_buffered(fd, p, head, offset, what);
    if (done < head) short_read(what, offset, bytes, done);
    while (mid > 0) {
      ssize_t n = ::pread(direct_fd, p + done, mid, offset + static_cast<int64_t>(done));
      if (n < 0 && errno == EINTR) continue;
      if (n < 0 && errno != EINVAL) fail(Op::Pread, what, errno);
      if (n <= 0) break;  // EINVAL (alignment the device refuses) or the end of the file: pread does the rest
      done += static_cast<size_t>(n);
      mid -= static_cast<size_t>(n);
      if (static_cast<size_t>(n) % kAlign != 0) break;  // a short read at the end of the file
    }
    // The rest, and whatever the direct read left: the end of the file before `bytes` is an error
    // (Note [A short read is an error]).
    done += pread_buffered(fd, p + done, bytes - done, offset + static_cast<int64_t>(done), what);
    if (done < bytes) short_read(what, offset, bytes, done);
    return;
  }
  const size_t done = pread_buffered(fd, p, bytes, offset, what);
  if (done < bytes) short_read(what, offset, bytes, done);
}

void pwrite_full(int fd, const void* buf, size_t bytes, int64_t offset, const std::string& what) {
  pass_gate(Op::Pwrite);
  if (int e = injected(Op::Pwrite)) fail(Op::Pwrite, what, e);
  auto* p = static_cast<const char*>(buf);
  while (bytes > 0) {
    ssize_t n = ::pwrite(fd, p, bytes, offset);
    if (n < 0) {
      if (errno == EINTR) continue;
      fail(Op::Pwrite, what, errno);
    }
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += n;
  }
}

void fsync_file(int fd, const std::string& what) {
  pass_gate(Op::Fsync);
  if (int e = injected(Op::Fsync)) fail(Op::Fsync, what, e);
  if (::fsync(fd) < 0) fail(Op::Fsync, what, errno);
}

void ftruncate_file(int fd, int64_t length, const std::string& what) {
  pass_gate(Op::Ftruncate);
  if (int e = injected(Op::Ftruncate)) fail(Op::Ftruncate, what, e);
  int r;
  do r = ::ftruncate(fd, length);
  while (r < 0 && errno == EINTR);
  if (r < 0) fail(Op::Ftruncate, what, errno);
}

void fstat_file(int fd, struct ::stat& st, const std::string& what) {
  pass_gate(Op::Fstat);
  if (int e = injected(Op::Fstat)) fail(Op::Fstat, what, e);
  if (::fstat(fd, &st) < 0) fail(Op::Fstat, what, errno);
}

int try_flock(int fd, int operation) {
  pass_gate(Op::Flock);
  if (int e = injected(Op::Flock)) return -e;
  int r;
  do r = ::flock(fd, operation);
  while (r < 0 && errno == EINTR);
  return r < 0 ? -errno : 0;
}

}  // namespace sw::io
