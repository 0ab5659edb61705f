#include "strideweave/carriers/storage.hpp"

#include "files.hpp"

#include <fcntl.h>
#include <linux/fs.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>

#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"

namespace sw {

const CarrierKind& file_backed_kind() {
  static const CarrierKind k{"FileBacked", true, true, false};
  return k;
}
const CarrierKind& block_device_carrier_kind() {
  static const CarrierKind k{"BlockDeviceCarrier", true, true, false};
  return k;
}
const CarrierKind& evictable_kind() {
  static const CarrierKind k{"Evictable", true, false, true};
  return k;
}

namespace detail {

bool file_dtype(const DType& d) { return d.id() == DTypeId::Float32 || d.id() == DTypeId::Int32 || d.is_half(); }

std::string temp_dir() {
  const char* t = std::getenv("TMPDIR");
  return (t && *t) ? t : "/tmp";
}

// Note [Anonymous files leave no name]: a file the library makes for itself
// (FileBacked() with no name, so every anonymous tier, per-tile buffer and
// staging file) is never visible in the temporary directory: it is created
// with O_TMPFILE, an inode with no name at all, or, where the file system
// refuses O_TMPFILE (EOPNOTSUPP; EISDIR from kernels before 3.11), created
// with mkostemp and unlinked before anything else happens. Its storage then
// lives exactly as long as its descriptors, and the kernel frees it when the
// process ends however it ends: SIGKILL, os._exit, a crash, or a reference
// cycle nobody collects. (Removing the file on release, as this once did,
// left a tensor-sized file behind each of those.) With the fallback the name
// exists for the microseconds between mkostemp and unlink. Having no name, the
// file is described by what the kernel calls the open file
// (/proc/self/fd/<n>: "/tmp/#1234 (deleted)", as lsof shows it), which is what
// filename() returns and error messages say.
int open_anonymous(const std::string& dir, std::string& name) {
  int fd = io::try_open_file(dir, O_TMPFILE | O_RDWR, 0600);  // counts as one open for faults and the gate
  if (fd == -EOPNOTSUPP || fd == -EISDIR) {
    std::string pattern = dir + "/strideweave-XXXXXX";
    std::vector<char> buf(pattern.begin(), pattern.end());
    buf.push_back('\0');
    fd = ::mkostemp(buf.data(), O_CLOEXEC);
    if (fd < 0) io::raise_failure(io::Op::Open, "an anonymous FileBacked file in " + dir, errno);
    if (::unlink(buf.data()) < 0) {
      const int e = errno;
      ::close(fd);
      raise<RuntimeError>("unlink of the new anonymous FileBacked file ", buf.data(), " failed: ", std::strerror(e));
    }
  } else if (fd < 0) {
    io::raise_failure(io::Op::Open, "an anonymous FileBacked file in " + dir, -fd);
  }
  char link[4096];
  const std::string self = "/proc/self/fd/" + std::to_string(fd);
  const ssize_t n = ::readlink(self.c_str(), link, sizeof link);
  name = n > 0 ? std::string(link, static_cast<size_t>(n)) : dir + "/(anonymous file)";
  return fd;
}

// Note [Files changed under a carrier]: a named file may be removed, renamed,
// replaced (os.replace of a new file over its name) or truncated by someone
// else while a carrier has it open. Reads of a truncated file fail (Note [A
// short read is an error] in io.cpp); writes, though, would "succeed": into the
// orphaned inode, where the values never reach the name, or past the end of a
// truncated file, re-extending it with a hole where other values were. So a
// named file is checked before a batch of writes (an eviction request, a move
// into it, one public slot write): one fstat of the open file (its link count
// and size) and one stat of its name (the same device and inode), never per
// slot or per run. Any change fails the write with RuntimeError naming the file
// before anything is written or marked clean. Anonymous files have no name to
// check.
struct stat stat_open_file(int fd, const std::string& name) {
  struct stat st;
  if (::fstat(fd, &st) < 0) raise<RuntimeError>("fstat of ", name, " failed: ", std::strerror(errno));
  return st;
}

void check_file_intact(int fd, const std::string& name, const std::string& absolute, int64_t need_bytes,
                       const char* what, const char* action) {
  const struct stat open_st = stat_open_file(fd, name);
  struct stat path_st;
  if (::stat(absolute.c_str(), &path_st) < 0) {
    const int e = errno;
    if (open_st.st_nlink == 0)
      raise<RuntimeError>(what, " file ", name, " was deleted while in use; cannot ", action,
                          ": the values would go to the deleted file, not to ", name);
    raise<RuntimeError>(what, " file ", name, " is no longer there (stat failed: ", std::strerror(e),
                        "): it was removed or renamed while in use; cannot ", action,
                        ": the values would not reach ", name);
  }
  if (path_st.st_dev != open_st.st_dev || path_st.st_ino != open_st.st_ino)
    raise<RuntimeError>(what, " file ", name, " was replaced by another file while in use; cannot ", action,
                        ": the values would go to the file it replaced, not to ", name);
  if (S_ISREG(open_st.st_mode) && open_st.st_size < need_bytes)
    raise<RuntimeError>(what, " file ", name, " was truncated while in use: it has ", open_st.st_size,
                        " bytes but must hold ", need_bytes, "; cannot ", action);
}

// The path to stat for the check above: absolute, so that a later chdir does not change what it names.
std::string absolute_path(const std::string& path) {
  std::error_code ec;
  std::filesystem::path p = std::filesystem::absolute(path, ec);
  return ec ? path : p.string();
}
}  // namespace detail

using detail::absolute_path;
using detail::file_dtype;
using detail::check_file_intact;
using detail::open_anonymous;
using detail::stat_open_file;
using detail::temp_dir;

// ---------------------------------------------------------------- FileBacked

FileBackedCarrier::FileBackedCarrier(const std::string& filename, const DType& dtype, bool is_mutable, bool crash_safe)
    : Carrier(&file_backed_kind(), dtype, is_mutable) {
  if (!file_dtype(dtype)) raise<TypeError>("FileBacked stores Float32 and Int32 (and BFloat16, Float16), not ", dtype.name());
  if (crash_safe && filename.empty())
    raise<ValueError>("FileBacked(crash_safe=True) needs a filename: an anonymous file does not outlive a crash");
  if (crash_safe && !is_mutable)
    raise<ValueError>("FileBacked(", filename, ", mutable=False, crash_safe=True): a read-only file is never written");
  if (filename.empty()) {
    anonymous_ = true;
    fd_ = open_anonymous(temp_dir(), path_);  // Note [Anonymous files leave no name]
  } else {
    io::check_path(filename, "FileBacked filename");
    path_ = filename;
    absolute_ = absolute_path(filename);
    if (is_mutable) {
      fd_ = io::open_file(path_, O_RDWR | O_CREAT);
    } else {
      // An immutable FileBacked reads a file that exists; it never creates one (an empty new file would be an
      // allocatable carrier that can never be written).
      fd_ = io::try_open_file(path_, O_RDONLY);
      if (fd_ == -ENOENT)
        raise<RuntimeError>("open of ", path_, " failed: ", std::strerror(ENOENT),
                            " (ENOENT): FileBacked(mutable=False) opens an existing file and creates none");
      if (fd_ < 0) io::raise_failure(io::Op::Open, path_, -fd_);
    }
  }
  struct stat st;
  if (::fstat(fd_, &st) < 0) {
    int e = errno;
    close_file();
    raise<RuntimeError>("fstat of ", path_, " failed: ", std::strerror(e));
  }
  if (S_ISDIR(st.st_mode)) {  // a read-only open of a directory succeeds; its reads would not
    close_file();
    io::raise_failure(io::Op::Open, path_, EISDIR);
  }
  slots_ = static_cast<int64_t>(st.st_size) / static_cast<int64_t>(slot_bytes(dtype));
  // Note [A crash-safe tier] (journal.cpp): a writable open replays what a crash left; a plain one then removes
  // the journal, a crash-safe one keeps it for its own writes. A read-only open cannot repair and refuses.
  if (anonymous_) return;
  try {
    if (!is_mutable) Journal::check_none_pending(path_, "FileBacked");
    else if (crash_safe) journal_ = std::make_unique<Journal>(path_, fd_, "FileBacked");
    else if (::access(Journal::path_for(path_).c_str(), F_OK) == 0) Journal replay(path_, fd_, "FileBacked");
  } catch (...) {
    close_file();
    throw;
  }
}

FileBackedCarrier::~FileBackedCarrier() { close_file(); }

void FileBackedCarrier::close_file() noexcept {
  journal_.reset();  // syncs the file and removes the journal (Note [A crash-safe tier] in journal.cpp)
  // An anonymous file has no name (Note [Anonymous files leave no name]): closing it frees its storage.
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  std::call_once(direct_once_, [] {});  // never opened after this
  if (direct_fd_ >= 0) ::close(direct_fd_);
  direct_fd_ = -1;
}

void FileBackedCarrier::check_storage_intact(const char* action) const {
  if (anonymous_ || fd_ < 0) return;  // nothing else can reach an anonymous file by a name
  check_file_intact(fd_, path_, absolute_, slots_ * static_cast<int64_t>(slot_bytes(dtype())), "FileBacked", action);
}

int FileBackedCarrier::direct_fd() const noexcept {
  std::call_once(direct_once_, [this] {
    // Through /proc, the very inode fd_ refers to (even if the path was replaced since); no fault injection: a
    // failure only means buffered reads.
    const std::string self = "/proc/self/fd/" + std::to_string(fd_);
    direct_fd_ = ::open(self.c_str(), O_RDONLY | O_DIRECT | O_CLOEXEC);
  });
  return direct_fd_;
}

void FileBackedCarrier::read_slots(int64_t start, int64_t count, void* out) const {
  const size_t w = slot_bytes(dtype());
  const size_t bytes = static_cast<size_t>(count) * w;
  io::pread_full(fd_, out, bytes, start * static_cast<int64_t>(w), path_, bytes >= io::kDirectMin ? direct_fd() : -1);
}

bool FileBackedCarrier::read_waits_on_device(int64_t start, int64_t count) const {
  const size_t w = slot_bytes(dtype());
  const size_t bytes = static_cast<size_t>(count) * w;
  return bytes >= io::kDirectMin && direct_fd() >= 0 && io::mostly_uncached(fd_, bytes, start * static_cast<int64_t>(w));
}

void FileBackedCarrier::write_slots(int64_t start, int64_t count, const void* in) {
  const size_t w = slot_bytes(dtype());
  if (journal_) {
    journal_->write(-1, {{start * static_cast<int64_t>(w), static_cast<size_t>(count) * w, in}});
    return;
  }
  io::pwrite_full(fd_, in, static_cast<size_t>(count) * w, start * static_cast<int64_t>(w), path_);
}

void FileBackedCarrier::write_unit(int64_t tile, const std::vector<SlotPiece>& pieces) {
  if (!journal_) {
    for (const SlotPiece& p : pieces) write_slots(p.start, p.count, p.data);
    return;
  }
  const int64_t w = static_cast<int64_t>(slot_bytes(dtype()));
  std::vector<JournalPiece> bytes;
  bytes.reserve(pieces.size());
  for (const SlotPiece& p : pieces) bytes.push_back({p.start * w, static_cast<size_t>(p.count * w), p.data});
  journal_->write(tile, bytes);
}

JournalStats FileBackedCarrier::journal_stats() const { return journal_ ? journal_->stats() : JournalStats{}; }

bool FileBackedCarrier::supports_storage_dtype(const DType& dtype) const { return file_dtype(dtype); }

void FileBackedCarrier::grow(int64_t slots, bool) {
  if (slots < 0) raise<ValueError>("FileBacked size must be >= 0, got ", slots);
  if (slots_ != 0) raise<ValueError>("FileBacked carrier is not allocatable (size ", slots_, " != 0)");
  if (::ftruncate(fd_, slots * static_cast<int64_t>(slot_bytes(dtype()))) < 0)
    raise<RuntimeError>("ftruncate of ", path_, " failed: ", std::strerror(errno));
  slots_ = slots;
}

CarrierPtr FileBackedCarrier::allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool) const {
  // Anonymous files are always opened read-write: public mutability is a permission, not a file mode.
  auto c = std::make_shared<FileBackedCarrier>("", dtype, is_mutable);
  c->grow(slots, true);
  return c;
}

void FileBackedCarrier::do_release() { close_file(); }

// ---------------------------------------------------------------- BlockDevice

BlockDevice::BlockDevice(const std::string& path) : path_(path) {
  io::check_path(path, "BlockDevice path");
  absolute_ = absolute_path(path);
  fd_ = io::try_open_file(path, O_RDWR | O_DIRECT);
  direct_ = fd_ >= 0;
  if (fd_ == -EINVAL) {
    // Filesystems without O_DIRECT (tmpfs) refuse it with EINVAL: fall back to buffered I/O.
    fd_ = io::open_file(path, O_RDWR);
  } else if (fd_ < 0) {
    io::raise_failure(io::Op::Open, path, -fd_);  // any other failure is the caller's to see
  }
  struct stat st;
  if (::fstat(fd_, &st) < 0) raise<RuntimeError>("fstat of ", path, " failed: ", std::strerror(errno));
  if (S_ISBLK(st.st_mode)) {
    uint64_t bytes = 0;
    if (::ioctl(fd_, BLKGETSIZE64, &bytes) < 0) raise<RuntimeError>("BLKGETSIZE64 of ", path, " failed");
    capacity_ = static_cast<int64_t>(bytes);
  } else if (S_ISREG(st.st_mode)) {
    capacity_ = st.st_size;
  } else {
    ::close(fd_);
    raise<ValueError>("BlockDevice path ", path, " is neither a block device nor a regular file");
  }
  capacity_ = capacity_ / kBlock * kBlock;
  if (capacity_ > 0) free_.emplace_back(0, capacity_);
}

BlockDevice::~BlockDevice() {
  if (fd_ >= 0) ::close(fd_);
}

void BlockDevice::check_intact(const char* action) const {
  // Note [Files changed under a carrier]: a preallocated file may be deleted, replaced or truncated too.
  check_file_intact(fd_, path_, absolute_, capacity_, "BlockDevice", action);
}

int64_t BlockDevice::free_bytes() const {
  std::lock_guard lock(mutex_);
  int64_t n = 0;
  for (auto [s, l] : free_) n += l;
  return n;
}

int64_t BlockDevice::reserve(int64_t bytes) {
  int64_t need = std::max<int64_t>(kBlock, (bytes + kBlock - 1) / kBlock * kBlock);
  std::lock_guard lock(mutex_);
  for (auto it = free_.begin(); it != free_.end(); ++it) {
    if (it->second < need) continue;
    int64_t start = it->first;
    it->first += need;
    it->second -= need;
    if (it->second == 0) free_.erase(it);
    return start;
  }
  raise<ValueError>("BlockDevice ", path_, " has no free extent of ", need, " bytes (capacity ", capacity_, ")");
}

void BlockDevice::give_back(int64_t start, int64_t bytes) noexcept {
  int64_t len = std::max<int64_t>(kBlock, (bytes + kBlock - 1) / kBlock * kBlock);
  std::lock_guard lock(mutex_);
  auto it = std::lower_bound(free_.begin(), free_.end(), std::make_pair(start, int64_t{0}));
  it = free_.insert(it, {start, len});
  if (it + 1 != free_.end() && it->first + it->second == (it + 1)->first) {
    it->second += (it + 1)->second;
    free_.erase(it + 1);
  }
  if (it != free_.begin() && (it - 1)->first + (it - 1)->second == it->first) {
    (it - 1)->second += it->second;
    free_.erase(it);
  }
}

void BlockDevice::read(int64_t offset, size_t bytes, void* out) const {
  if (bytes == 0) return;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % kBlock == 0; };
  if (!direct_ || (offset % kBlock == 0 && bytes % kBlock == 0 && aligned(out))) {
    io::pread_full(fd_, out, bytes, offset, path_);
    return;
  }
  constexpr int64_t kChunk = int64_t{4} << 20;
  AlignedBuffer bounce(static_cast<size_t>(kChunk + 2 * kBlock), false);
  auto* dst = static_cast<char*>(out);
  int64_t pos = offset, end = offset + static_cast<int64_t>(bytes);
  while (pos < end) {
    int64_t a0 = pos / kBlock * kBlock;
    int64_t a1 = std::min<int64_t>(a0 + kChunk, (end + kBlock - 1) / kBlock * kBlock);
    io::pread_full(fd_, bounce.data(), static_cast<size_t>(a1 - a0), a0, path_);
    int64_t take = std::min(end, a1) - pos;
    std::memcpy(dst, bounce.data() + (pos - a0), static_cast<size_t>(take));
    dst += take;
    pos += take;
  }
}

void BlockDevice::write(int64_t offset, size_t bytes, const void* in) {
  if (bytes == 0) return;
  auto aligned = [](const void* p) { return reinterpret_cast<uintptr_t>(p) % kBlock == 0; };
  if (!direct_ || (offset % kBlock == 0 && bytes % kBlock == 0 && aligned(in))) {
    io::pwrite_full(fd_, in, bytes, offset, path_);
    return;
  }
  constexpr int64_t kChunk = int64_t{4} << 20;
  AlignedBuffer bounce(static_cast<size_t>(kChunk + 2 * kBlock), false);
  auto* src = static_cast<const char*>(in);
  int64_t pos = offset, end = offset + static_cast<int64_t>(bytes);
  std::lock_guard lock(mutex_);  // read-modify-write of partial blocks
  while (pos < end) {
    int64_t a0 = pos / kBlock * kBlock;
    int64_t a1 = std::min<int64_t>(a0 + kChunk, (end + kBlock - 1) / kBlock * kBlock);
    int64_t take = std::min(end, a1) - pos;
    if (pos != a0 || pos + take != a1) io::pread_full(fd_, bounce.data(), static_cast<size_t>(a1 - a0), a0, path_);
    std::memcpy(bounce.data() + (pos - a0), src, static_cast<size_t>(take));
    io::pwrite_full(fd_, bounce.data(), static_cast<size_t>(a1 - a0), a0, path_);
    src += take;
    pos += take;
  }
}

std::shared_ptr<BlockDeviceCarrier> BlockDevice::allocate(int64_t slots, const DType& dtype, bool is_mutable,
                                                          bool empty) {
  if (slots < 0) raise<ValueError>("BlockDevice allocation size must be >= 0, got ", slots);
  if (!file_dtype(dtype)) raise<TypeError>("BlockDeviceCarrier stores Float32 and Int32 (and BFloat16, Float16), not ", dtype.name());
  int64_t bytes = slots * static_cast<int64_t>(slot_bytes(dtype));
  int64_t start = slots > 0 ? reserve(bytes) : 0;
  std::shared_ptr<BlockDeviceCarrier> c;
  try {
    c = std::make_shared<BlockDeviceCarrier>(shared_from_this(), start, slots, dtype, is_mutable);
    if (!empty && bytes > 0) {
      int64_t len = (bytes + kBlock - 1) / kBlock * kBlock;
      constexpr int64_t kChunk = int64_t{4} << 20;
      AlignedBuffer zeros(static_cast<size_t>(std::min(len, kChunk)), true);
      for (int64_t done = 0; done < len; done += kChunk)
        write(start + done, static_cast<size_t>(std::min(kChunk, len - done)), zeros.data());
    }
  } catch (...) {
    if (!c && slots > 0) give_back(start, bytes);
    throw;
  }
  return c;
}

BlockDeviceCarrier::BlockDeviceCarrier(std::shared_ptr<BlockDevice> device, int64_t start, int64_t slots,
                                       const DType& dtype, bool is_mutable)
    : Carrier(&block_device_carrier_kind(), dtype, is_mutable),
      device_(std::move(device)),
      start_(start),
      bytes_(slots * static_cast<int64_t>(slot_bytes(dtype))),
      slots_(slots) {}

BlockDeviceCarrier::~BlockDeviceCarrier() { free_extent(); }

void BlockDeviceCarrier::free_extent() noexcept {
  if (slots_ > 0 && bytes_ > 0) device_->give_back(start_, bytes_);
  bytes_ = 0;
}

void BlockDeviceCarrier::read_slots(int64_t start, int64_t count, void* out) const {
  const int64_t w = static_cast<int64_t>(slot_bytes(dtype()));
  device_->read(start_ + start * w, static_cast<size_t>(count * w), out);
}

void BlockDeviceCarrier::write_slots(int64_t start, int64_t count, const void* in) {
  const int64_t w = static_cast<int64_t>(slot_bytes(dtype()));
  device_->write(start_ + start * w, static_cast<size_t>(count * w), in);
}

bool BlockDeviceCarrier::supports_storage_dtype(const DType& dtype) const { return file_dtype(dtype); }

void BlockDeviceCarrier::check_storage_intact(const char* action) const { device_->check_intact(action); }

void BlockDeviceCarrier::grow(int64_t slots, bool zero) {
  if (slots_ != 0) raise<ValueError>("BlockDeviceCarrier is not allocatable (size ", slots_, " != 0)");
  auto fresh = device_->allocate(slots, dtype(), true, !zero);
  // Take over the fresh extent.
  start_ = fresh->start_;
  bytes_ = fresh->bytes_;
  slots_ = slots;
  fresh->bytes_ = 0;
  fresh->slots_ = 0;
}

CarrierPtr BlockDeviceCarrier::allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const {
  return device_->allocate(slots, dtype, is_mutable, empty);
}

void BlockDeviceCarrier::do_release() { free_extent(); }

// ---------------------------------------------------------------- Evictable

EvictableCarrier::EvictableCarrier(CarrierPtr primary, CarrierPtr secondary, bool is_mutable)
    : DependentCarrier(&evictable_kind(), primary ? primary->dtype() : DType::Float32(), is_mutable) {
  if (!primary || !secondary) raise<TypeError>("Evictable tiers must be Carrier instances");
  if (primary == secondary) raise<ValueError>("Evictable primary and secondary must be distinct carriers");
  for (const auto* c : {primary.get(), secondary.get()}) {
    if (c->kind().dependent) raise<TypeError>("Evictable tiers must not be dependent carriers, got ", c->kind_name());
    c->check_live("become an Evictable tier");
    if (c->is_owned()) raise<RuntimeError>(c->kind_name(), " carrier is owned; it cannot become an Evictable tier");
  }
  if (primary->dtype() != secondary->dtype())
    raise<TypeError>("Evictable tiers must share one dtype, got ", primary->dtype().name(), " and ",
                     secondary->dtype().name());
  int64_t p = primary->size(), s = secondary->size();
  if (p > 0) {
    if (s != 0 && s != p) raise<ValueError>("Evictable secondary must have 0 or ", p, " slots, got ", s);
    if (s == 0 && !secondary->can_grow()) raise<ValueError>("Evictable secondary is empty and not allocatable");
    slots_ = p;
    evicted_ = false;
  } else {
    if (s == 0) raise<ValueError>("Evictable needs a non-empty primary or secondary tier");
    if (!primary->can_grow()) raise<ValueError>("Evictable primary is empty and not allocatable");
    slots_ = s;
    evicted_ = true;
  }
  primary_claim_ = primary->claim("an Evictable carrier");
  secondary_claim_ = secondary->claim("an Evictable carrier");
  primary_ = std::move(primary);
  secondary_ = std::move(secondary);
}

EvictableCarrier::~EvictableCarrier() = default;

void EvictableCarrier::check_resident(const char* action) const {
  if (evicted_) raise<RuntimeError>("Evictable carrier is evicted; promote() it before you ", action);
}

void EvictableCarrier::read_slots(int64_t start, int64_t count, void* out) const {
  std::lock_guard lock(mutex_);
  check_resident("read it");
  primary_->read_slots(start, count, out);
}

void EvictableCarrier::write_slots(int64_t start, int64_t count, const void* in) {
  std::lock_guard lock(mutex_);
  check_resident("write it");
  primary_->write_slots(start, count, in);
}

bool EvictableCarrier::supports_storage_dtype(const DType& dtype) const {
  return primary_->supports_storage_dtype(dtype) && secondary_->supports_storage_dtype(dtype);
}

CarrierPtr EvictableCarrier::allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const {
  std::lock_guard lock(mutex_);
  auto p = primary_->allocate_like(slots, true, dtype, empty);
  auto s = secondary_->allocate_like(0, true, dtype, true);
  return std::make_shared<EvictableCarrier>(std::move(p), std::move(s), is_mutable);
}

void EvictableCarrier::evict() {
  check_live("evict");
  std::lock_guard lock(mutex_);
  if (evicted_) return;
  secondary_->check_storage_intact("evict to it");  // Note [Files changed under a carrier]
  if (secondary_->size() == 0) secondary_->grow(slots_, false);
  copy_slots(*primary_, 0, *secondary_, 0, slots_);
  // Replace the resident primary storage by an empty carrier of its kind.
  CarrierPtr empty = primary_->allocate_like(0, true, dtype(), true);
  Claim fresh = empty->claim("an Evictable carrier");
  primary_claim_.end();
  primary_->release();
  primary_ = std::move(empty);
  primary_claim_ = std::move(fresh);
  evicted_ = true;
}

void EvictableCarrier::promote() {
  check_live("promote");
  std::lock_guard lock(mutex_);
  if (!evicted_) return;
  CarrierPtr fresh = primary_->allocate_like(slots_, true, dtype(), true);
  copy_slots(*secondary_, 0, *fresh, 0, slots_);
  Claim c = fresh->claim("an Evictable carrier");
  primary_claim_.end();
  primary_->release();
  primary_ = std::move(fresh);
  primary_claim_ = std::move(c);
  evicted_ = false;
}

bool EvictableCarrier::is_evicted() const {
  std::lock_guard lock(mutex_);
  return evicted_;
}

CarrierPtr EvictableCarrier::primary() const {
  std::lock_guard lock(mutex_);
  return primary_;
}

CarrierPtr EvictableCarrier::secondary() const {
  std::lock_guard lock(mutex_);
  return secondary_;
}

void EvictableCarrier::do_release() {
  std::lock_guard lock(mutex_);
  primary_claim_.end();
  secondary_claim_.end();
  primary_->release();
  secondary_->release();
}

// ---------------------------------------------------------------- durability

// A write that returned is in the page cache (or, for direct I/O, possibly in the device's volatile cache):
// fsync makes it survive a crash. Kept apart from the I/O paths above: only an explicit flush pays for it.
void FileBackedCarrier::flush() {
  check_live("flush");
  // Claimed while it syncs (the caller may have released the GIL): another thread's release() raises "... owned
  // by FileBacked.flush (wait for it)" instead of closing the file or dropping the journal under the fsync.
  // (A carrier no shared_ptr owns, as on a C++ caller's stack, has no other thread to race with.)
  Claim hold;
  if (!weak_from_this().expired()) hold = claim("FileBacked.flush of '" + path_ + "'");
  if (journal_) journal_->sync_target();  // fsync, then the journal's records are needed no longer
  else io::fsync_file(fd_, path_);
}

void BlockDevice::sync() { io::fsync_file(fd_, path_); }

void BlockDeviceCarrier::flush() {
  check_live("flush");
  Claim hold;  // as FileBackedCarrier::flush
  if (!weak_from_this().expired()) hold = claim("BlockDeviceCarrier.flush");
  device_->sync();
}

}  // namespace sw
