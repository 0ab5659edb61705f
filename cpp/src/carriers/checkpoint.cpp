// The checkpoint tier (Note [A checkpoint tier] in strideweave/carriers/checkpoint.hpp).
#include "strideweave/carriers/checkpoint.hpp"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <vector>

#include "files.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"

namespace sw {

const CarrierKind& checkpoint_kind() {
  static const CarrierKind k{"Checkpoint", true, true, false};
  return k;
}

// ---------------------------------------------------------------- files

CheckpointFile::CheckpointFile(const std::string& path, bool writable) : path_(path), writable_(writable) {
  io::check_path(path, "checkpoint path");
  absolute_ = detail::absolute_path(path);
  fd_ = io::open_file(path_, writable ? O_RDWR : O_RDONLY);
  struct stat st;
  if (::fstat(fd_, &st) < 0) {
    const int e = errno;
    ::close(fd_);
    raise<RuntimeError>("fstat of ", path_, " failed: ", std::strerror(e));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd_);
    raise<ValueError>("checkpoint file ", path_, " is not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
}

CheckpointFile::~CheckpointFile() {
  if (fd_ >= 0) ::close(fd_);
}

void CheckpointFile::check_intact(uint64_t need_bytes, const char* action) const {
  detail::check_file_intact(fd_, path_, absolute_, static_cast<int64_t>(need_bytes), "checkpoint", action);
}

// ---------------------------------------------------------------- carrier

CheckpointCarrier::CheckpointCarrier(std::vector<Range> ranges, const DType& dtype, Writes writes)
    : Carrier(&checkpoint_kind(), dtype, true),
      ranges_(std::move(ranges)),
      itemsize_(slot_bytes(dtype)),
      writes_(writes) {
  if (itemsize_ == 0) raise<TypeError>("a checkpoint tier cannot hold ", dtype.name());
  starts_.reserve(ranges_.size() + 1);
  for (size_t r = 0; r < ranges_.size(); ++r) {
    const Range& g = ranges_[r];
    if (!g.file) raise<ValueError>("checkpoint range ", r, " has no file");
    if (g.slots < 0) raise<ValueError>("checkpoint range ", r, " has a negative size ", g.slots);
    const uint64_t bytes = static_cast<uint64_t>(g.slots) * itemsize_;
    if (g.offset > g.file->size_at_open() || bytes > g.file->size_at_open() - g.offset)
      raise<ValueError>("checkpoint range ", r, " [", g.offset, ", ", g.offset + bytes, ") lies past the end of ",
                        g.file->path(), " (", g.file->size_at_open(), " bytes)");
    if (writes == Writes::InPlace && !g.file->writable())
      raise<ValueError>("checkpoint file ", g.file->path(), " was opened read-only; it cannot be written in place");
    starts_.push_back(total_);
    total_ += g.slots;
    auto f = std::find_if(files_.begin(), files_.end(), [&](const auto& e) { return e.first == g.file; });
    if (f == files_.end()) f = files_.insert(files_.end(), {g.file, 0});
    f->second = std::max(f->second, g.offset + bytes);
  }
  starts_.push_back(total_);
  overlay_at_ = std::make_unique<std::atomic<int64_t>[]>(ranges_.size());
  for (size_t r = 0; r < ranges_.size(); ++r) overlay_at_[r].store(-1, std::memory_order_relaxed);
}

CheckpointCarrier::~CheckpointCarrier() { do_release(); }

void CheckpointCarrier::do_release() {
  std::lock_guard lock(overlay_mutex_);
  if (overlay_fd_ >= 0) ::close(overlay_fd_);  // an anonymous file: closing it frees it
  overlay_fd_ = -1;
}

size_t CheckpointCarrier::range_of(int64_t slot) const {
  // The last range starting at or before `slot` that is not empty.
  auto it = std::upper_bound(starts_.begin(), starts_.end() - 1, slot);
  size_t r = static_cast<size_t>(it - starts_.begin()) - 1;
  while (ranges_[r].slots == 0) ++r;
  return r;
}

// Calls f(range index, first slot within the range, slots) for each piece of [start, start + count).
template <class F>
void CheckpointCarrier::for_pieces(int64_t start, int64_t count, F&& f) const {
  if (count <= 0) return;
  size_t r = range_of(start);
  int64_t within = start - starts_[r];
  while (count > 0) {
    const int64_t n = std::min(count, ranges_[r].slots - within);
    f(r, within, n);
    count -= n;
    within = 0;
    while (count > 0 && ranges_[++r].slots == 0) {
    }
  }
}

void CheckpointCarrier::read_slots(int64_t start, int64_t count, void* out) const {
  auto* dst = static_cast<std::byte*>(out);
  for_pieces(start, count, [&](size_t r, int64_t within, int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * itemsize_;
    const int64_t at = overlay_at_[r].load(std::memory_order_acquire);
    if (at >= 0) {
      io::pread_full(overlay_fd_, dst, bytes, at + within * static_cast<int64_t>(itemsize_), overlay_name_);
    } else {
      const Range& g = ranges_[r];
      io::pread_full(g.file->fd(), dst, bytes, static_cast<int64_t>(g.offset) + within * static_cast<int64_t>(itemsize_),
                     g.file->path());
      g.file->count_read(bytes);
    }
    dst += bytes;
  });
}

int64_t CheckpointCarrier::overlay_for(size_t r, bool whole) {
  std::lock_guard lock(overlay_mutex_);
  int64_t at = overlay_at_[r].load(std::memory_order_acquire);
  if (at >= 0) return at;
  if (overlay_fd_ < 0) {
    // Beside the checkpoint when its folder takes new files, else in TMPDIR.
    std::filesystem::path dir = std::filesystem::path(ranges_[r].file->path()).parent_path();
    if (dir.empty()) dir = std::filesystem::path(".");
    if (::access(dir.c_str(), W_OK) != 0) dir = std::filesystem::path(detail::temp_dir());
    overlay_fd_ = detail::open_anonymous(dir.string(), overlay_name_);
  }
  const Range& g = ranges_[r];
  const int64_t bytes = g.slots * static_cast<int64_t>(itemsize_);
  at = overlay_end_;
  if (!whole && bytes > 0) {  // copy-on-write: the range's current values first
    std::vector<std::byte> buf(static_cast<size_t>(bytes));
    io::pread_full(g.file->fd(), buf.data(), buf.size(), static_cast<int64_t>(g.offset), g.file->path());
    g.file->count_read(buf.size());
    io::pwrite_full(overlay_fd_, buf.data(), buf.size(), at, overlay_name_);
  }
  overlay_end_ += bytes;
  overlay_at_[r].store(at, std::memory_order_release);
  return at;
}

void CheckpointCarrier::write_slots(int64_t start, int64_t count, const void* in) {
  auto* src = static_cast<const std::byte*>(in);
  for_pieces(start, count, [&](size_t r, int64_t within, int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * itemsize_;
    const int64_t off = within * static_cast<int64_t>(itemsize_);
    const Range& g = ranges_[r];
    if (writes_ == Writes::InPlace) {
      io::pwrite_full(g.file->fd(), src, bytes, static_cast<int64_t>(g.offset) + off, g.file->path());
    } else {
      const int64_t at = overlay_for(r, /*whole=*/n == g.slots);
      io::pwrite_full(overlay_fd_, src, bytes, at + off, overlay_name_);
    }
    src += bytes;
  });
}

bool CheckpointCarrier::supports_storage_dtype(const DType& d) const {
  // Its own dtype; other dtypes only as scratch (allocate_like gives a FileBacked).
  return &d == &dtype() || detail::file_dtype(d);
}

void CheckpointCarrier::check_storage_intact(const char* action) const {
  if (writes_ != Writes::InPlace) return;  // the files are never written: nothing could go astray
  for (const auto& [file, need] : files_) file->check_intact(need, action);
}

void CheckpointCarrier::flush() {
  check_live("flush");
  if (writes_ != Writes::InPlace) return;
  for (const auto& [file, need] : files_) io::fsync_file(file->fd(), file->path());
}

CarrierPtr CheckpointCarrier::allocate_like(int64_t slots, bool is_mutable, const DType& d, bool empty) const {
  auto c = std::make_shared<FileBackedCarrier>("", d, is_mutable);
  c->grow(slots, true);
  return c;
}

int64_t CheckpointCarrier::overlaid_ranges() const {
  int64_t n = 0;
  for (size_t r = 0; r < ranges_.size(); ++r) n += overlay_at_[r].load(std::memory_order_acquire) >= 0;
  return n;
}

}  // namespace sw
