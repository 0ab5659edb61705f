// The write-ahead journal of a crash-safe tier (strideweave/carriers/journal.hpp).
#include "strideweave/carriers/journal.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <array>
#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <stdexcept>
#include <utility>

#include "strideweave/errors.hpp"
#include "strideweave/fork.hpp"
#include "strideweave/io.hpp"

namespace sw {

// Note [A crash-safe tier]: a tier that writes a file in place (FileBacked, a checkpoint tier opened with
// mutable=True) overwrites a tile's previous copy when it evicts it; a process killed during that write (the
// kernel stops a large buffered pwrite partway at a fatal signal, and a tile of many runs is many writes) leaves a
// torn tile, and no good copy of it anywhere. A crash-safe tier writes every unit (an evicted or flushed tile:
// all its runs; any other write: its one run) twice: first appended to the journal beside the file
// ("<file>.swjournal"), as one record holding the unit's offsets, bytes and CRC-32C checksums, and fsynced; only
// then in place. So at any moment of a crash either the record is incomplete (its checksum fails or it runs past
// the journal's end), and the file was not touched, or it is complete, and replaying it rewrites the whole unit.
// The tile holds its previous value or the new one, never a mix. Records are replayed in order, so a range
// written by several records ends with the last. Whoever next opens the file as a crash-safe or plain writable
// tier replays the journal, fsyncs the file and empties the journal; a read-only opener refuses a journal with
// records (it cannot repair the file). flush() fsyncs the file and empties the journal: its records are then in
// the file for good. A journal that grows past 1 GiB between flushes does the same by itself, so it holds at
// most about 1 GiB more than one unit. A cleanly closed crash-safe tier syncs the file and removes the journal.
//
// A record that fails its checksum is the torn tail a crash leaves unless a complete record follows it; then the
// journal itself was damaged (the disk, or someone else), the file may hold a torn tile that cannot be repaired,
// and opening fails naming the journal, the file and the tile. The journal's header holds the file's device and
// inode: a journal left beside a file that was replaced since (a save renames a new file over the name) is stale
// and is emptied, not replayed. Each record is fsynced before the file is written, so the promise holds for
// power loss too (on a device that honours flushes), not only for a killed process. The journal belongs to
// the process that opened it (it holds the flock): a forked child that shares the tier cannot write or flush it
// (RuntimeError) and closing the tier there leaves the parent's journal as it is. The cost is a second write of
// every byte and one fsync per unit (docs/reliability.md, "Crash-safe tiers and atomic saves", has the figures).

// Note [One journal per file]: a file may have many names: a symlink to it (a Hugging Face cache snapshot is a
// symlink to its blob), a path with ".." or "." components, a hard link. Two journals of one file would lose
// data: a killed writer's journal under one name, replayed later through that name, would write its old units
// over whatever was written and flushed through another name since. So:
//  - The journal lies beside the file's canonical path (realpath: every symlink, ".." and "." resolved), not
//    beside the name it was opened by: a writer through a symlink and one through its target share one journal,
//    and what a killed writer left is found (replayed by a writable opener, refused by a read-only one) through
//    any such name.
//  - A crash-safe tier holds an exclusive flock on the file itself (on its open file description, so two opens
//    in one process conflict as two processes do), taken before the journal is opened: a second crash-safe tier
//    over the same inode, through whatever name, hard links included, is refused with RuntimeError naming the
//    file and the other opener (its name when it is in this process, from a registry of the live journals;
//    else its process id, from /proc/locks). A plain writable opener that finds the journal replays it under
//    the same lock, so it is refused while a crash-safe tier is live too.
//  - Not covered: hard links have no canonical name, so a journal a killed writer left beside one hard link is
//    found only through that link (or a symlink to it); a writer through another hard link of the file neither
//    sees nor replays it. Keep one name for a file written crash-safe. A plain writable tier (no journal) takes
//    no lock, as before: it is refused only when it finds a live journal beside its canonical path.
//
// The journal itself must be one: it is opened with O_NOFOLLOW (a symlink planted at its name would make the
// engine create or truncate whatever the link points to) and O_NONBLOCK (a FIFO or a device never blocks the
// open), then checked with fstat: a regular file, with one name (a hard link planted there would be another
// file's bytes), owned by this process's effective user, and not the data file itself. Anything else is refused
// with RuntimeError naming it, and left as it was (nothing is truncated, written or removed).

namespace {

constexpr uint64_t kFileMagic = 0x314c4e524a575353ull;    // "SSWJRNL1"
constexpr uint64_t kRecordMagic = 0x3143455252575353ull;  // "SSWRREC1"
constexpr int64_t kFileHeader = 32;                        // magic, dev, ino, crc + pad
constexpr int64_t kRecordHeader = 48;                      // magic, seq, tile, pieces, data bytes, data crc, crc
constexpr uint64_t kMaxPieces = uint64_t{1} << 24;

struct RecordHeader {
  uint64_t magic, seq;
  int64_t tile;
  uint64_t pieces, data_bytes;
  uint32_t data_crc, header_crc;  // header_crc: the first 40 bytes and the piece table
};
static_assert(sizeof(RecordHeader) == kRecordHeader);

struct PieceEntry {
  int64_t offset;
  uint64_t bytes;
};

std::array<uint32_t, 256> make_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
    t[i] = c;
  }
  return t;
}

uint32_t crc32c_table(const unsigned char* p, size_t n, uint32_t crc) {
  static const std::array<uint32_t, 256> table = make_table();
  for (size_t i = 0; i < n; ++i) crc = table[(crc ^ p[i]) & 0xFFu] ^ (crc >> 8);
  return crc;
}

#if defined(__x86_64__)
__attribute__((target("sse4.2"))) uint32_t crc32c_hw(const unsigned char* p, size_t n, uint32_t crc) {
  uint64_t c = crc;
  for (; n >= 8; n -= 8, p += 8) {
    uint64_t v;
    std::memcpy(&v, p, 8);
    c = __builtin_ia32_crc32di(c, v);
  }
  uint32_t c32 = static_cast<uint32_t>(c);
  for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
  return c32;
}
#endif

uint32_t header_crc(const RecordHeader& h, const std::vector<PieceEntry>& table) {
  uint32_t c = crc32c(&h, 40);
  return crc32c(table.data(), table.size() * sizeof(PieceEntry), c);
}

void fsync_directory_of(const std::string& path) {
  std::filesystem::path dir = std::filesystem::path(path).parent_path();
  if (dir.empty()) dir = ".";
  int fd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0) return;  // best effort: the name of a new journal survives a power loss once the directory syncs
  ::fsync(fd);
  ::close(fd);
}

// Reads exactly `bytes` at `offset`, or returns false at the end of the file (no fault injection: this is parsing).
bool read_at(int fd, void* out, size_t bytes, int64_t offset) {
  auto* p = static_cast<char*>(out);
  while (bytes > 0) {
    ssize_t n = ::pread(fd, p, bytes, offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    p += n;
    bytes -= static_cast<size_t>(n);
    offset += n;
  }
  return true;
}

// The live journals of this process, by their file's device and inode: the name and kind of the tier that opened
// each (Note [One journal per file]). Never destroyed (a tier may close during exit); its lock is a striped small
// lock, so a fork never copies it held (Note [Fork safety]).
struct Holder {
  std::string name;
  const char* what;
};
using FileId = std::pair<uint64_t, uint64_t>;
std::map<FileId, Holder>& holders() {
  static auto* h = new std::map<FileId, Holder>();
  return *h;
}
std::mutex& holders_lock() { return detail::carrier_state_lock(&holders()); }

// Who holds the flock of the file (device, inode) in another process, from /proc/locks (best effort).
std::string flock_holder(uint64_t dev, uint64_t ino) {
  std::ifstream in("/proc/locks");
  std::string line;
  const unsigned want_major = major(static_cast<dev_t>(dev)), want_minor = minor(static_cast<dev_t>(dev));
  long same_ino = -1;
  int same_ino_count = 0;
  while (std::getline(in, line)) {
    if (line.find("->") != std::string::npos || line.find("FLOCK") == std::string::npos) continue;  // a waiter
    std::istringstream words(line);
    std::string id, kind, mode, access, pid, where;
    if (!(words >> id >> kind >> mode >> access >> pid >> where)) continue;
    unsigned maj = 0, min = 0;
    unsigned long long inode = 0;
    if (std::sscanf(where.c_str(), "%x:%x:%llu", &maj, &min, &inode) != 3 || inode != ino) continue;
    const long p = std::strtol(pid.c_str(), nullptr, 10);
    if (maj == want_major && min == want_minor) {
      same_ino = p;
      same_ino_count = 1;
      break;
    }
    same_ino = p;  // a file system that reports another device to stat (overlayfs): the inode alone, if unique
    same_ino_count++;
  }
  if (same_ino_count != 1 || same_ino <= 0) return "in another process";
  if (same_ino == ::getpid()) return "in this process";
  std::string comm;
  std::ifstream c("/proc/" + std::to_string(same_ino) + "/comm");
  std::getline(c, comm);
  return "by process " + std::to_string(same_ino) + (comm.empty() ? "" : " (" + comm + ")");
}

}  // namespace

uint32_t crc32c(const void* data, size_t bytes, uint32_t crc) {
  const auto* p = static_cast<const unsigned char*>(data);
  crc = ~crc;
#if defined(__x86_64__)
  static const bool hw = __builtin_cpu_supports("sse4.2");
  crc = hw ? crc32c_hw(p, bytes, crc) : crc32c_table(p, bytes, crc);
#else
  crc = crc32c_table(p, bytes, crc);
#endif
  return ~crc;
}

std::string Journal::path_for(const std::string& target) {
  // Beside the file's canonical path (Note [One journal per file]); the name as given when it does not resolve.
  std::string base = target;
  if (char* real = ::realpath(target.c_str(), nullptr)) {
    base = real;
    std::free(real);
  }
  return base + ".swjournal";
}

Journal::Journal(const std::string& target, int target_fd, const char* what)
    : target_(target), path_(path_for(target)), what_(what), target_fd_(target_fd), pid_(::getpid()) {
  struct stat st;
  io::fstat_file(target_fd_, st, target_);
  dev_ = static_cast<uint64_t>(st.st_dev);
  ino_ = static_cast<uint64_t>(st.st_ino);
  // One crash-safe tier per file, whatever its name (Note [One journal per file]): first this process's own
  // tiers (they may share the open file description, where flock would not conflict), then the file's flock.
  const FileId id{dev_, ino_};
  auto refuse_in_use = [&](const std::string& other) {
    raise<RuntimeError>(what_, " file ", target_, " is in use by another crash-safe tier over that file, ", other,
                        "; one writer at a time, whatever name the file is opened by (a symlink, a hard link, a "
                        "path with .. or .): its crash-safe journal is ", path_);
  };
  {
    std::lock_guard lock(holders_lock());
    auto [it, fresh] = holders().try_emplace(id, Holder{target_, what_});
    if (!fresh)
      refuse_in_use(std::string("opened as ") + it->second.what + " file " + it->second.name + " in this process");
  }
  auto forget = [&] {
    std::lock_guard lock(holders_lock());
    holders().erase(id);
  };
  if (const int e = -io::try_flock(target_fd_, LOCK_EX | LOCK_NB)) {
    forget();
    if (e == EWOULDBLOCK) refuse_in_use(flock_holder(dev_, ino_));
    io::raise_failure(io::Op::Flock, target_ + " (to open its crash-safe journal " + path_ + ")", e);
  }
  try {
    open_journal();
    if (const int e = -io::try_flock(fd_, LOCK_EX | LOCK_NB)) {
      if (e == EWOULDBLOCK)
        raise<RuntimeError>("the crash-safe journal ", path_, " of ", what_, " file ", target_,
                            " is in use by another crash-safe tier over that file (in this or another process); "
                            "one writer at a time");
      io::raise_failure(io::Op::Flock, path_, e);
    }
    replay();
  } catch (...) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = -1;
    (void)::flock(target_fd_, LOCK_UN);
    forget();
    throw;
  }
}

void Journal::open_journal() {
  struct stat before;
  const bool existed = ::lstat(path_.c_str(), &before) == 0;
  const int fd = io::try_open_file(path_, O_RDWR | O_CREAT | O_NOFOLLOW | O_NONBLOCK, 0644);
  const char* belongs = " lies where the crash-safe journal of ";
  if (fd == -ELOOP)
    raise<RuntimeError>(path_, belongs, what_, " file ", target_,
                        " belongs but is a symbolic link; a journal is never followed to another file: remove the link");
  if (fd < 0) io::raise_failure(io::Op::Open, path_, -fd);
  fd_ = fd;
  struct stat st;
  io::fstat_file(fd_, st, path_);
  if (!S_ISREG(st.st_mode))
    raise<RuntimeError>(path_, belongs, what_, " file ", target_,
                        " belongs but is not a regular file; move it away");
  if (static_cast<uint64_t>(st.st_dev) == dev_ && static_cast<uint64_t>(st.st_ino) == ino_)
    raise<RuntimeError>(path_, belongs, what_, " file ", target_,
                        " belongs but is the file itself (a hard link to it); remove that name");
  if (st.st_nlink != 1)
    raise<RuntimeError>(path_, belongs, what_, " file ", target_, " belongs but has ", st.st_nlink,
                        " names (a hard link to another file); a journal has one name: move it away");
  if (st.st_uid != ::geteuid())
    raise<RuntimeError>(path_, belongs, what_, " file ", target_, " belongs but is owned by user ", st.st_uid,
                        ", not by this process's user ", ::geteuid(), "; move it away");
  if (!existed) fsync_directory_of(path_);
}

Journal::~Journal() {
  if (fd_ < 0) return;
  const bool owner = ::getpid() == pid_;  // a forked child leaves its parent's journal and locks alone
  if (!abandoned_ && owner) {
    bool synced = end_ <= kFileHeader;
    if (!synced) synced = ::fsync(target_fd_) == 0;
    if (synced) ::unlink(path_.c_str());  // else it stays, and the next opener replays it
  }
  ::close(fd_);  // drops the journal's lock
  if (owner) {
    (void)::flock(target_fd_, LOCK_UN);  // and the file's (Note [One journal per file])
    std::lock_guard lock(holders_lock());
    holders().erase({dev_, ino_});
  }
}

void Journal::write_header() {
  std::array<uint64_t, 4> h{kFileMagic, dev_, ino_, 0};
  h[3] = crc32c(h.data(), 24);
  io::pwrite_full(fd_, h.data(), sizeof h, 0, path_);
}

void Journal::reset_locked() {
  io::ftruncate_file(fd_, kFileHeader, "the crash-safe journal " + path_);
  end_ = kFileHeader;
  stats_.resets++;
}

void Journal::replay() {
  struct stat st;
  io::fstat_file(fd_, st, path_);
  const int64_t size = st.st_size;
  std::array<uint64_t, 4> h{};
  const bool has_header = size >= kFileHeader && read_at(fd_, h.data(), sizeof h, 0);
  if (has_header && h[0] != kFileMagic)
    raise<RuntimeError>(path_, " lies where the crash-safe journal of ", what_, " file ", target_,
                        " belongs but is not a StrideWeave journal; move it away");
  const bool same_file = has_header && h[3] == crc32c(h.data(), 24) && h[1] == dev_ && h[2] == ino_;
  end_ = kFileHeader;
  if (same_file) {
    // Records in order; the first that fails ends them (Note [A crash-safe tier]).
    int64_t at = kFileHeader;
    std::vector<std::byte> data;
    while (at + kRecordHeader <= size) {
      RecordHeader r;
      if (!read_at(fd_, &r, sizeof r, at) || r.magic != kRecordMagic || r.pieces > kMaxPieces) break;
      std::vector<PieceEntry> table(r.pieces);
      const int64_t table_bytes = static_cast<int64_t>(r.pieces * sizeof(PieceEntry));
      if (at + kRecordHeader + table_bytes > size ||
          !read_at(fd_, table.data(), static_cast<size_t>(table_bytes), at + kRecordHeader) ||
          header_crc(r, table) != r.header_crc)
        break;  // a torn header: the tail
      const int64_t next = at + kRecordHeader + table_bytes + static_cast<int64_t>(r.data_bytes);
      bool good = r.data_bytes <= static_cast<uint64_t>(size) && next <= size;
      if (good) {
        data.resize(r.data_bytes);
        good = read_at(fd_, data.data(), data.size(), at + kRecordHeader + table_bytes) &&
               crc32c(data.data(), data.size()) == r.data_crc;
      }
      if (!good) {
        RecordHeader after;
        if (next > at && next + kRecordHeader <= size && read_at(fd_, &after, sizeof after, next) &&
            after.magic == kRecordMagic && after.seq > r.seq)
          raise<RuntimeError>("the crash-safe journal ", path_, " of ", what_, " file ", target_,
                              " is damaged: the record of tile ", r.tile, " at byte ", at,
                              " fails its checksum and later records follow, so that tile of ", target_,
                              " may be torn and cannot be repaired from the journal; restore the file from a saved "
                              "copy and remove the journal");
        break;  // the torn tail: the file was never touched by it
      }
      uint64_t sum = 0;
      for (const PieceEntry& p : table) sum += p.bytes;
      if (sum != r.data_bytes) break;
      const int64_t target_size = ::lseek(target_fd_, 0, SEEK_END);
      for (const PieceEntry& p : table)  // every piece checked before any is written
        if (p.offset < 0 || p.offset + static_cast<int64_t>(p.bytes) > target_size)
          raise<RuntimeError>("the crash-safe journal ", path_, " holds tile ", r.tile, " at bytes [", p.offset, ", ",
                              p.offset + static_cast<int64_t>(p.bytes), ") but ", what_, " file ", target_,
                              " is shorter: it was truncated since; restore it from a saved copy");
      const std::byte* src = data.data();
      for (const PieceEntry& p : table) {
        io::pwrite_full(target_fd_, src, p.bytes, p.offset, target_);
        src += p.bytes;
      }
      stats_.replayed++;
      stats_.replayed_bytes += static_cast<int64_t>(r.data_bytes);
      seq_ = r.seq + 1;
      at = next;
    }
    if (stats_.replayed > 0) io::fsync_file(target_fd_, target_);
  }
  // Empty, with this file's header (a stale journal of a replaced file is emptied unread).
  if (!same_file || size > kFileHeader) {
    io::ftruncate_file(fd_, 0, "the crash-safe journal " + path_);
    write_header();
    io::fsync_file(fd_, path_);
  }
}

void Journal::cut_back() noexcept {
  // A record that never became durable is cut off, so the next one follows the last complete record.
  (void)::ftruncate(fd_, end_);
}

void Journal::simulated_crash() {
  abandoned_ = true;
  throw std::runtime_error("simulated crash");
}

void Journal::check_owner() const {
  if (::getpid() != pid_)
    raise<RuntimeError>("the crash-safe journal ", path_, " of ", what_, " file ", target_,
                        " belongs to the process that opened it (pid ", pid_, "); a forked child cannot write or "
                        "flush that tier: open the file again in the child");
}

void Journal::write(int64_t tile, const std::vector<JournalPiece>& pieces) {
  std::lock_guard lock(mutex_);
  if (fd_ < 0) raise<RuntimeError>("the crash-safe journal of ", target_, " is closed");
  check_owner();
  if (end_ > limit_) {  // bounded: the file is synced, so its records are needed no longer
    io::fsync_file(target_fd_, target_);
    reset_locked();
  }
  RecordHeader h{kRecordMagic, seq_, tile, pieces.size(), 0, 0, 0};
  std::vector<PieceEntry> table;
  table.reserve(pieces.size());
  uint32_t data_crc = 0;
  for (const JournalPiece& p : pieces) {
    table.push_back({p.offset, p.bytes});
    h.data_bytes += p.bytes;
    data_crc = crc32c(p.data, p.bytes, data_crc);
  }
  h.data_crc = data_crc;
  h.header_crc = header_crc(h, table);
  std::vector<std::byte> head(sizeof h + table.size() * sizeof(PieceEntry));
  std::memcpy(head.data(), &h, sizeof h);
  std::memcpy(head.data() + sizeof h, table.data(), table.size() * sizeof(PieceEntry));
  int64_t at = end_;
  try {
    io::pwrite_full(fd_, head.data(), head.size(), at, path_);
    at += static_cast<int64_t>(head.size());
    for (size_t k = 0; k < pieces.size(); ++k) {
      size_t bytes = pieces[k].bytes;
      if (crash_ == Crash::MidRecord && k + 1 == pieces.size()) bytes /= 2;
      io::pwrite_full(fd_, pieces[k].data, bytes, at, path_);
      if (bytes != pieces[k].bytes) simulated_crash();
      at += static_cast<int64_t>(bytes);
    }
    io::fsync_file(fd_, path_);
  } catch (...) {
    if (!abandoned_) cut_back();
    throw;
  }
  stats_.records++;
  stats_.bytes += at - end_;
  stats_.syncs++;
  end_ = at;
  seq_++;
  if (crash_ == Crash::AfterRecord) simulated_crash();
  for (const JournalPiece& p : pieces) {
    size_t bytes = p.bytes;
    if (crash_ == Crash::MidInPlace) bytes /= 2;
    io::pwrite_full(target_fd_, p.data, bytes, p.offset, target_);
    if (bytes != p.bytes) simulated_crash();
  }
}

void Journal::sync_target() {
  std::lock_guard lock(mutex_);
  check_owner();
  io::fsync_file(target_fd_, target_);
  if (fd_ >= 0 && end_ > kFileHeader) reset_locked();
}

JournalStats Journal::stats() const {
  std::lock_guard lock(mutex_);
  return stats_;
}

void Journal::check_none_pending(const std::string& target, const char* what) {
  const std::string path = path_for(target);
  struct stat st;
  // Never through a symlink (Note [One journal per file]): a writable opener refuses one; nothing to replay here.
  if (::lstat(path.c_str(), &st) < 0 || !S_ISREG(st.st_mode) || st.st_size <= kFileHeader) return;
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
  if (fd < 0) return;
  std::array<uint64_t, 4> h{};
  struct stat target_st;
  if (!read_at(fd, h.data(), sizeof h, 0) || ::stat(target.c_str(), &target_st) < 0 ||
      h[1] != static_cast<uint64_t>(target_st.st_dev) || h[2] != static_cast<uint64_t>(target_st.st_ino)) {
    ::close(fd);  // not this file's (a stale journal of a file replaced since): nothing to replay into it
    return;
  }
  const bool live = ::flock(fd, LOCK_SH | LOCK_NB) < 0;  // a crash-safe tier holds it now: its records are live
  ::close(fd);
  if (live) return;
  raise<RuntimeError>(what, " file ", target, " has a crash-safe journal ", path,
                      " with writes a crash left unfinished; a read-only open cannot replay them: open the file "
                      "writable once (FileBacked(path, crash_safe=True), or a checkpoint's tiled(..., mutable=True)) "
                      "to repair it");
}

}  // namespace sw
