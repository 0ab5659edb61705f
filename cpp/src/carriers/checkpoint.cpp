// The checkpoint tier (Note [A checkpoint tier] in strideweave/carriers/checkpoint.hpp).
#include "strideweave/carriers/checkpoint.hpp"

#include <fcntl.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <ctime>
#include <cstring>
#include <filesystem>
#include <vector>

#include "files.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/checkpoint/quantized.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"

namespace sw {

const CarrierKind& checkpoint_kind() {
  static const CarrierKind k{"Checkpoint", true, true, false};
  return k;
}

// ---------------------------------------------------------------- files

namespace {
FileIdentity identity_of(const struct stat& st) {
  return {static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino), static_cast<uint64_t>(st.st_size),
          static_cast<int64_t>(st.st_mtim.tv_sec) * 1000000000 + st.st_mtim.tv_nsec};
}
}  // namespace

std::optional<FileIdentity> identity_at(const std::string& path) {
  struct stat st;
  if (::stat(path.c_str(), &st) != 0) return std::nullopt;
  return identity_of(st);
}

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
  identity_ = identity_of(st);
  // Note [A crash-safe tier] (journal.cpp): a writable open replays what a crash left; a read-only one refuses.
  try {
    if (!writable) Journal::check_none_pending(path_, "checkpoint");
    else if (::access(Journal::path_for(path_).c_str(), F_OK) == 0) Journal replay(path_, fd_, "checkpoint");
  } catch (...) {
    ::close(fd_);
    throw;
  }
}

CheckpointFile::~CheckpointFile() {
  journal_.reset();  // syncs the file and removes the journal
  if (fd_ >= 0) ::close(fd_);
}

Journal& CheckpointFile::enable_journal() {
  std::lock_guard lock(journal_mutex_);
  if (!writable_) raise<ValueError>("checkpoint file ", path_, " was opened read-only; it has no crash-safe writes");
  if (!journal_) journal_ = std::make_unique<Journal>(path_, fd_, "checkpoint");
  return *journal_;
}

void CheckpointFile::check_intact(uint64_t need_bytes, const char* action) const {
  detail::check_file_intact(fd_, path_, absolute_, static_cast<int64_t>(need_bytes), "checkpoint", action);
}

void CheckpointFile::check_still_named(const char* action) const {
  struct stat st;
  if (::stat(absolute_.c_str(), &st) == 0 && static_cast<uint64_t>(st.st_dev) == identity_.dev &&
      static_cast<uint64_t>(st.st_ino) == identity_.ino)
    return;
  raise<RuntimeError>("checkpoint file ", path_, " was replaced, removed or renamed while a tier writing it in place "
                      "was in use; cannot ", action, ": its values could never be written back to ", path_);
}

// ---------------------------------------------------------------- quantized ranges

int64_t QuantizedRange::scale_rows() const noexcept {
  return format == Format::FP8 ? (rows + block_rows - 1) / block_rows : rows;
}
int64_t QuantizedRange::scale_cols() const noexcept {
  return format == Format::FP8 ? (cols + block_cols - 1) / block_cols : cols / 32;
}
uint64_t QuantizedRange::data_bytes() const noexcept {
  const uint64_t n = static_cast<uint64_t>(rows) * static_cast<uint64_t>(cols);
  return format == Format::FP8 ? n : n / 2;
}

// ---------------------------------------------------------------- carrier

CheckpointCarrier::CheckpointCarrier(std::vector<Range> ranges, const DType& dtype, Writes writes)
    : Carrier(&checkpoint_kind(), dtype, true),
      ranges_(std::move(ranges)),
      serial_([] {
        static std::atomic<uint64_t> next{1};
        return next.fetch_add(1, std::memory_order_relaxed);
      }()),
      itemsize_(slot_bytes(dtype)),
      writes_(writes) {
  if (itemsize_ == 0) raise<TypeError>("a checkpoint tier cannot hold ", dtype.name());
  starts_.reserve(ranges_.size() + 1);
  auto need = [&](const std::shared_ptr<CheckpointFile>& file, uint64_t end) {
    auto f = std::find_if(files_.begin(), files_.end(), [&](const auto& e) { return e.first == file; });
    if (f == files_.end()) f = files_.insert(files_.end(), {file, 0});
    f->second = std::max(f->second, end);
  };
  auto inside = [&](size_t r, const CheckpointFile& file, uint64_t offset, uint64_t bytes, const char* what) {
    if (offset > file.size_at_open() || bytes > file.size_at_open() - offset)
      raise<ValueError>("checkpoint range ", r, what, " [", offset, ", ", offset + bytes, ") lies past the end of ",
                        file.path(), " (", file.size_at_open(), " bytes)");
  };
  for (size_t r = 0; r < ranges_.size(); ++r) {
    const Range& g = ranges_[r];
    if (!g.file) raise<ValueError>("checkpoint range ", r, " has no file");
    if (g.slots < 0) raise<ValueError>("checkpoint range ", r, " has a negative size ", g.slots);
    uint64_t bytes = static_cast<uint64_t>(g.slots) * itemsize_;
    if (const QuantizedRange* q = g.quant.get()) {
      // Note [A quantized checkpoint tier].
      if (&dtype != &DType::BFloat16() && &dtype != &DType::Float32())
        raise<TypeError>("a quantized checkpoint tier dequantizes into BFloat16 or Float32, not ", dtype.name());
      if (writes == Writes::InPlace)
        raise<ValueError>("a quantized checkpoint range cannot be written in place (", g.file->path(),
                          "): its values are written to the overlay, in ", dtype.name());
      const bool fp8 = q->format == QuantizedRange::Format::FP8;
      if (!q->scale_file || q->rows < 0 || q->cols < 0 || q->rows * q->cols != g.slots || q->block_rows < 1 ||
          q->block_cols < 1 || (!fp8 && (q->cols % 32 != 0 || q->scale_type == QuantizedRange::Scale::F32 ||
                                         q->scale_type == QuantizedRange::Scale::BF16)))
        raise<ValueError>("checkpoint range ", r, " of ", g.file->path(), ": its quantized sizes do not agree (",
                          q->rows, " x ", q->cols, " values, ", g.slots, " slots)");
      bytes = q->data_bytes();
      inside(r, *q->scale_file, q->scale_offset, q->scale_bytes(), "'s scales");
      need(q->scale_file, q->scale_offset + q->scale_bytes());
    }
    inside(r, *g.file, g.offset, bytes, "");
    if (writes == Writes::InPlace && !g.file->writable())
      raise<ValueError>("checkpoint file ", g.file->path(), " was opened read-only; it cannot be written in place");
    starts_.push_back(total_);
    total_ += g.slots;
    need(g.file, g.offset + bytes);
  }
  starts_.push_back(total_);
  overlay_at_ = std::make_unique<std::atomic<int64_t>[]>(ranges_.size());
  for (size_t r = 0; r < ranges_.size(); ++r) overlay_at_[r].store(-1, std::memory_order_relaxed);
  path_state_ = std::make_unique<std::atomic<uint8_t>[]>(ranges_.size());
  for (size_t r = 0; r < ranges_.size(); ++r) path_state_[r].store(0, std::memory_order_relaxed);
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
  // An in-place tier promotes only from files still at their names (Note [A checkpoint is the file it parsed] in
  // checkpoint/checkpoint.cpp): values promoted from a replaced file could never be written back.
  if (writes_ == Writes::InPlace && count > 0)
    for (const auto& [file, need] : files_) file->check_still_named("read from it");
  auto* dst = static_cast<std::byte*>(out);
  for_pieces(start, count, [&](size_t r, int64_t within, int64_t n) {
    const size_t bytes = static_cast<size_t>(n) * itemsize_;
    const int64_t at = overlay_at_[r].load(std::memory_order_acquire);
    if (at >= 0) io::pread_full(overlay_fd_, dst, bytes, at + within * static_cast<int64_t>(itemsize_), overlay_name_);
    else read_from_file(ranges_[r], within, n, dst);
    dst += bytes;
  });
}

void CheckpointCarrier::read_from_file(const Range& g, int64_t within, int64_t n, std::byte* dst) const {
  if (g.quant) return read_quantized(g, within, n, dst);
  const size_t bytes = static_cast<size_t>(n) * itemsize_;
  io::pread_full(g.file->fd(), dst, bytes, static_cast<int64_t>(g.offset) + within * static_cast<int64_t>(itemsize_),
                 g.file->path());
  g.file->count_read(bytes);
}

namespace {
constexpr int64_t kQuantChunk = int64_t{1} << 20;  // quantized bytes read and dequantized at a time
}  // namespace

// Note [A quantized checkpoint tier]: the request is cut into chunks of whole units (rows for FP8, groups of 32 for
// MXFP4) of about kQuantChunk quantized bytes; each chunk reads its quantized bytes and the scales that cover them
// and is dequantized straight into `dst`. A chunk the request covers only in part (a read that begins or ends
// inside a unit, as reading a view element by element does) is dequantized whole into a per-thread cache and the
// requested part copied; the next such read of the same chunk (the next element of a transposed view) is served
// from the cache without reading the file again. The cache is keyed by the carrier's serial number and the range;
// a range once written lives in the overlay and is never read here again, so the cache never goes stale.
void CheckpointCarrier::read_quantized(const Range& g, int64_t within, int64_t n, std::byte* dst) const {
  if (n <= 0) return;
  const QuantizedRange& q = *g.quant;
  const quant::Out out = itemsize_ == 2 ? quant::Out::BFloat16 : quant::Out::Float32;
  const int64_t item = static_cast<int64_t>(itemsize_);
  const bool fp8 = q.format == QuantizedRange::Format::FP8;
  // Units: rows (FP8) or groups of 32 (MXFP4); each has `per` values and `unit_bytes` quantized bytes.
  const int64_t per = fp8 ? q.cols : 32, unit_bytes = fp8 ? q.cols : 16, units_total = g.slots / per;
  // Units per chunk; FP8 chunks are whole block rows, and start at multiples of `chunk`, so no block row (its scales
  // read once per chunk) is ever cut between two chunks: a tile's promotion reads each scale once.
  int64_t chunk = std::max<int64_t>(1, kQuantChunk / std::max<int64_t>(1, unit_bytes));
  if (fp8) chunk = std::max<int64_t>(1, chunk / q.block_rows) * q.block_rows;
  struct Cache {
    uint64_t serial = 0;
    const Range* range = nullptr;
    int64_t e0 = 0, e1 = 0;  // the values it holds
    std::vector<std::byte> values;
  };
  thread_local Cache cache;
  thread_local std::vector<uint8_t> data;
  thread_local std::vector<std::byte> raw_scales;
  thread_local std::vector<float> scales;
  const uint64_t serial = serial_;
  if (cache.serial == serial && cache.range == &g && within >= cache.e0 && within + n <= cache.e1) {
    std::memcpy(dst, cache.values.data() + (within - cache.e0) * item, static_cast<size_t>(n * item));
    return;
  }
  // The request's quantized bytes, mapped (below), unmapped on every way out.
  struct Mapped {
    std::shared_ptr<AlignedBuffer> buffer;
    const uint8_t* data = nullptr;
    int64_t u0 = 0, u1 = 0;
  } mapped;
  // Units [u, u + units) dequantized into `to`.
  auto dequantize_units = [&](int64_t u, int64_t units, std::byte* to) {
    const int64_t sc = q.scale_cols();
    const int64_t s0 = fp8 ? (u / q.block_rows) * sc : u;
    const int64_t s1 = fp8 ? ((u + units - 1) / q.block_rows + 1) * sc : u + units;
    const size_t sitem = q.scale_itemsize();
    raw_scales.resize(static_cast<size_t>(s1 - s0) * sitem);
    io::pread_full(q.scale_file->fd(), raw_scales.data(), raw_scales.size(),
                   static_cast<int64_t>(q.scale_offset + static_cast<uint64_t>(s0) * sitem), q.scale_file->path());
    q.scale_file->count_read(raw_scales.size());
    const int64_t bytes = units * unit_bytes;
    const uint8_t* src = nullptr;
    if (mapped.buffer && u >= mapped.u0 && u + units <= mapped.u1) {
      src = mapped.data + (u - mapped.u0) * unit_bytes;
    } else {
      data.resize(static_cast<size_t>(bytes));
      io::pread_full(g.file->fd(), data.data(), static_cast<size_t>(bytes),
                     static_cast<int64_t>(g.offset) + u * unit_bytes, g.file->path());
      src = data.data();
    }
    g.file->count_read(static_cast<uint64_t>(bytes));
    if (fp8) {
      scales.resize(static_cast<size_t>(s1 - s0));
      quant::scales_to_float(raw_scales.data(), q.scale_type, s1 - s0, scales.data());
      quant::dequantize_fp8(src, units, q.cols, u, scales.data(), sc, q.block_rows, q.block_cols, to, out);
    } else {
      quant::dequantize_mxfp4(src, reinterpret_cast<const uint8_t*>(raw_scales.data()), units, to, out);
    }
  };
  const int64_t u0 = within / per, u1 = (within + n + per - 1) / per;
  // A promotion-sized request (at least kQuantChunk quantized bytes) dequantizes from a mapping of its quantized
  // bytes (AlignedBuffer::map_file: private, aligned so the page cache's large folios map whole, faulted in as the
  // mapped promotion path does) rather than reading them into a buffer first: the page cache's pages are the
  // kernel's input, and the copy a read makes (about a third of an FP8 promotion's time: docs/performance.md,
  // "Quantized checkpoints") is saved. The mapping lives for this call only and is never written. Where the file
  // no longer holds the range (truncated: checked first, so the mapping never reaches past its end) or the system
  // refuses the mapping, the bytes are read.
  if ((u1 - u0) * unit_bytes >= kQuantChunk) {
    const uint64_t begin = g.offset + static_cast<uint64_t>(u0 * unit_bytes);
    const uint64_t end = g.offset + static_cast<uint64_t>(u1 * unit_bytes);
    struct stat st;
    if (::fstat(g.file->fd(), &st) == 0 && static_cast<uint64_t>(st.st_size) >= end) {
      if (auto m = AlignedBuffer::map_file(g.file->fd(), begin, end - begin, static_cast<uint64_t>(st.st_size))) {
        mapped.data = reinterpret_cast<const uint8_t*>(m->data());
        mapped.buffer = std::move(m);
        mapped.u0 = u0;
        mapped.u1 = u1;
      }
    }
  }
  for (int64_t u = u0, units = 0; u < u1; u += units) {
    units = std::min((u / chunk + 1) * chunk, u1) - u;
    const int64_t e0 = u * per, e1 = (u + units) * per;  // the values these units hold
    const int64_t lo = std::max(e0, within), hi = std::min(e1, within + n);
    if (lo == e0 && hi == e1) {
      dequantize_units(u, units, dst + (lo - within) * item);
      continue;
    }
    // A chunk read in part: a whole chunk from u into the cache (beyond the request: the next reads are likely
    // its neighbours), then the part requested.
    const int64_t cached = std::min(chunk, units_total - u);
    cache.serial = 0;  // invalid while it is filled (a failed read leaves it so)
    cache.values.resize(static_cast<size_t>(cached * per * item));
    dequantize_units(u, cached, cache.values.data());
    cache = Cache{serial, &g, e0, (u + cached) * per, std::move(cache.values)};
    std::memcpy(dst + (lo - within) * item, cache.values.data() + (lo - e0) * item, static_cast<size_t>((hi - lo) * item));
  }
}

// Note [Promotion by mapping]: a read-only checkpoint in the page cache (the common case: a model just
// downloaded or just read) already holds every tile's bytes in memory. Reading a tile copies them into memory
// of the tier's own; mapping the range instead (MAP_PRIVATE, populated) makes the page cache's pages the tile's
// memory without a copy, which is what mapped loaders (safetensors' safe_open, torch.load(mmap=True)) do. The
// mapping is private: a write to the tile copies the page it lands in, so the checkpoint file never changes,
// and an evicted dirty tile goes to the overlay as before (from then on that range is read there). So a
// TiledEvictable with a CPU primary tier may promote a tile of a Writes::Overlay checkpoint by mapping (where that
// is the cheaper path: Note [Promotion by the cheaper path] below) when the tile is one range, still in its file, of
// at least 1 MiB (below that, a read is as cheap as a mapping and
// leaves no mapping to count against the process's limit), its file still holds the range (checked with
// fstat: a range past a truncated end is read, and the read reports the error), and its bytes are aligned to
// the dtype. The mapping counts in bytes_read() like a read. It is given back when the tile is evicted.
//
// Huge pages. Recent kernels keep a file in the page cache in large folios (2 MiB where they can). A mapping
// whose addresses are congruent to the file offsets modulo 2 MiB maps each such folio with one page-table entry;
// any other mapping takes 512 entries per folio (measured on the bench machine, 16 tiles of 2 MiB in the page
// cache: read 1.4 ms; mapped and touched 0.9 ms in 4 KiB folios, 0.3 ms in 2 MiB folios mapped whole). So
// AlignedBuffer::map_file maps the whole 2 MiB pages around the tile, at such an address.
// The neighbours' bytes in those pages are mapped too, never copied: the memory is the page cache's, shared and
// reclaimable, though the process's resident set (RssFile) counts every mapped page, up to 2 MiB more at
// each end of a tile.
//
// What mapping gives up: a tile read into memory of its own does not change if some other program rewrites the
// checkpoint file in place, and survives the file being truncated; a mapped tile sees the rewrite, and touching
// it after a truncation raises SIGBUS, as for every mapped loader. A checkpoint file is an input nobody
// rewrites in place (tools write a new file and rename it, which a mapping does not see); Writes::InPlace
// (fine-tuning a private copy, written by this process) always reads.
// Note [Promotion by the cheaper path]: a tile of a read-only checkpoint can reach memory two ways, and which is
// cheaper depends on the kernel, on how the page cache holds the file and on what happens to the tile afterwards.
//
// (a) Mapping (Note [Promotion by mapping]) copies nothing; it pays per page-table entry: faults to map the page
//     cache's folios (one per folio with fault-around), and at eviction munmap, whose zap and TLB shootdown
//     interrupt the process's other threads. Where the page cache holds the range in 2 MiB folios, the aligned
//     mapping takes one entry per folio and costs almost nothing either way.
// (b) Reading copies the bytes (pread out of the page cache) into a buffer of the tile's own. A fresh buffer
//     first pays its page faults (the kernel zeroes each page; on this virtual machine a huge page the host took
//     back costs about 2 ms, Note [Mapping cache] in native.cpp), but the buffer of an evicted tile goes to the
//     mapping cache already faulted in, huge-page advised from 2 MiB up, and the next allocation of its length
//     takes it: no fault, and no munmap at eviction (the buffer goes back to the cache). The mapping cache is
//     this pool: bounded (1 GiB, or a sixteenth of the memory available where less; sw.set_mapping_cache_limit),
//     it gives back a buffer unused for 2 s (sw.set_mapping_cache_decay) and reports its bytes
//     (sw.mapping_cache_bytes). A pooled buffer holding no tile is not counted by any ResidencyBudget, as
//     before: a budget counts the bytes of resident tiles, whichever path brought them.
//
// Measured on the bench machine (AMD EPYC, 2 vCPU, KVM; Linux 6.18, ext4; transparent huge pages "madvise"),
// per tile of 5.5 MiB (one BFloat16 expert of bench/moe_block.py, 2816 x 1024) in the page cache, one thread:
// in 4 KiB folios (a file written 8 KiB at a time) map and touch 390-410 us, munmap 110-260 us, pread into a
// faulted buffer 510-520 us, into a fresh one 990-1,460 us (a first touch of reclaimed huge pages up to 15 ms);
// in 2 MiB folios (written whole) map and touch 37 us, munmap 3-5 us, pread 350-1,040 us. In the MoE block
// itself (BFloat16 inference, 96 tiles promoted a call, save_pretrained's file; Linux 6.18 caches it in large
// folios that are not PMD-mapped), CPU time per MiB: map 35-46 us and munmap 13-21 us against 92-118 us for a
// read into a recycled buffer, and forcing reads cost 0.04-0.05 CPU-s more a call. An earlier kernel and
// build had measured the opposite (docs/performance.md: reads into recycled buffers 94-103 ms a call against
// 130-145 ms mapped). So the choice is measured where it runs, per carrier (Auto):
//   1. the range's last mapping was wholly in huge page-table entries (asked of the kernel with PAGEMAP_SCAN on
//      /proc/self/pagemap, Linux 6.7 and later; where that fails, the range counts as small folios): map;
//   2. nothing measured yet: map (a first promotion; from nothing a mapping costs less than a fresh buffer's
//      faults, and a tile that stays resident never pays the munmap);
//   3. otherwise the path with the lower moving average of CPU time per MiB (the calling thread's CPU clock, so
//      a thread's waits and the compute threads' load count for neither): a mapping's mmap and touch plus its
//      munmap (timed when the tile lets go of the buffer), against a read's pread into a buffer already faulted
//      in (a fresh buffer is populated before the read is timed: once reads are the path, their buffers are
//      recycled). Reads must be cheaper by a fifth: within that the estimates' noise decides nothing, and a
//      mapping holds no memory of its own. The tier's path is decided once in 64 choices and kept in between (a
//      first version chose per promotion: on the loaded machine the estimates of the two paths came within noise
//      of each other, the tiers alternated, and bench/moe_block.py's peak RSS rose from 487 to 582 MiB, BFloat16
//      inference, with read buffers idle in the cache while mappings were in use). The other path is measured
//      again once in 64 times the cost ratio choices (about 1/64 of the promotions' time whatever the ratio); a
//      read by a probe (a read of up to 1 MiB of the range into a per-thread buffer, beside the mapping), so no
//      read buffer is left behind.
// A read tile's buffer goes back to the mapping cache faulted in only while reads are the tier's path; otherwise
// its pages are given back first (MADV_DONTNEED; the cache keeps the address range), so a pooled buffer holds
// memory only where the next read will take it.
// set_promotion_path forces either path (tests, benchmarks). Both paths leave the same bytes in the tile, and
// neither writes the file: a read tile is memory of its own, a mapped one a private mapping; an evicted dirty
// tile goes to the overlay either way. A range past a truncated end is left to the engine's read, which reports
// the error as before; tiers written in place always read (Note [Promotion by mapping]).
namespace {
std::atomic<PromotionPath> g_promotion_path{PromotionPath::Auto};

constexpr uint8_t kPromoted = 1;  // the range was promoted before (by either path)
constexpr uint8_t kHuge = 2;      // the range's last mapping was wholly in huge page-table entries

// PAGEMAP_SCAN (linux/fs.h since 6.7; older headers lack it).
struct PageRegion {
  uint64_t start, end, categories;
};
struct PmScanArg {
  uint64_t size, flags, start, end, walk_end, vec, vec_len, max_pages, category_inverted, category_mask,
      category_anyof_mask, return_mask;
};
constexpr uint64_t kPageIsHuge = uint64_t{1} << 6;
constexpr unsigned long kPagemapScan = _IOWR('f', 16, PmScanArg);

// Whether every page of [p, p + bytes) is mapped by a huge page-table entry; false where the kernel cannot say.
bool huge_mapped(const std::byte* p, size_t bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  const int fd = ::open("/proc/self/pagemap", O_RDONLY | O_CLOEXEC);  // per call: /proc/self is this process's
  if (fd < 0) return false;
  PageRegion region{};
  PmScanArg arg{};
  arg.size = sizeof(arg);
  arg.start = lo;
  arg.end = hi;
  arg.vec = reinterpret_cast<uint64_t>(&region);
  arg.vec_len = 1;
  arg.category_inverted = kPageIsHuge;  // the pages that are NOT huge-mapped
  arg.category_mask = kPageIsHuge;
  arg.return_mask = kPageIsHuge;
  const int found = ::ioctl(fd, kPagemapScan, &arg);
  ::close(fd);
  return found == 0;  // no page outside a huge entry (-1: no PAGEMAP_SCAN here)
}

// Whether every page of [p, p + bytes) is resident: a buffer taken from the mapping cache, already faulted in.
bool resident(const std::byte* p, size_t bytes) {
  const auto page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  thread_local std::vector<unsigned char> in_core;
  in_core.resize((hi - lo) / page);
  return ::mincore(reinterpret_cast<void*>(lo), hi - lo, in_core.data()) == 0 &&
         std::all_of(in_core.begin(), in_core.end(), [](unsigned char c) { return (c & 1) != 0; });
}
}  // namespace

PromotionPath set_promotion_path(PromotionPath path) noexcept { return g_promotion_path.exchange(path); }
PromotionPath promotion_path() noexcept { return g_promotion_path.load(std::memory_order_relaxed); }

PromotionStats CheckpointCarrier::promotion_stats() const noexcept {
  return {mapped_.load(std::memory_order_relaxed),      mapped_huge_.load(std::memory_order_relaxed),
          read_.load(std::memory_order_relaxed),        read_reused_.load(std::memory_order_relaxed),
          costs_->map.load(std::memory_order_relaxed),  costs_->unmap.load(std::memory_order_relaxed),
          costs_->read.load(std::memory_order_relaxed), costs_->mapped_live.load(std::memory_order_relaxed),
          costs_->mapped_peak.load(std::memory_order_relaxed), costs_->read_live.load(std::memory_order_relaxed),
          costs_->read_peak.load(std::memory_order_relaxed)};
}

namespace {
// The calling thread's CPU time: what a path costs, without the time the thread waited (a lock, the scheduler
// running the compute threads on this machine's two cores), which would credit one path with the other's load.
int64_t now_ns() noexcept {
  struct timespec t;
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<int64_t>(t.tv_sec) * 1000000000 + t.tv_nsec;
}
// Folds one measurement (ns for `bytes`) into a moving average of ns per MiB (weight 1/8; the first sets it).
// Concurrent updates may lose one another's sample: an estimate, never a count.
void fold(std::atomic<int64_t>& average, int64_t ns, size_t bytes) noexcept {
  const int64_t sample = static_cast<int64_t>(static_cast<double>(ns) * double(1 << 20) / static_cast<double>(bytes));
  const int64_t old = average.load(std::memory_order_relaxed);
  average.store(old < 0 ? sample : old + (sample - old) / 8, std::memory_order_relaxed);
}
// Counts `bytes` more alive in `live`, raising `peak` to match.
void count_live(std::atomic<int64_t>& live, std::atomic<int64_t>& peak, int64_t bytes) noexcept {
  const int64_t now = live.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  int64_t p = peak.load(std::memory_order_relaxed);
  while (now > p && !peak.compare_exchange_weak(p, now, std::memory_order_relaxed)) {
  }
}
constexpr int64_t kExploreEvery = 64;  // Auto re-measures the dearer path (Note [Promotion by the cheaper path])
}  // namespace

CarrierPtr CheckpointCarrier::map_slots(int64_t start, int64_t count) const {
  constexpr size_t kMapMin = size_t{1} << 20;
  if (writes_ != Writes::Overlay || is_released() || count <= 0 || static_cast<size_t>(count) * itemsize_ < kMapMin)
    return nullptr;
  const size_t r = range_of(start);
  const Range& g = ranges_[r];
  const int64_t within = start - starts_[r];
  if (g.quant) return nullptr;  // read, dequantized, into the primary tile (Note [A quantized checkpoint tier])
  if (within + count > g.slots || overlay_at_[r].load(std::memory_order_acquire) >= 0) return nullptr;
  const uint64_t offset = g.offset + static_cast<uint64_t>(within) * itemsize_;
  const size_t bytes = static_cast<size_t>(count) * itemsize_;
  if (offset % itemsize_ != 0) return nullptr;
  struct stat st;
  if (::fstat(g.file->fd(), &st) != 0 || static_cast<uint64_t>(st.st_size) < offset + bytes) return nullptr;
  const uint8_t state = path_state_[r].fetch_or(kPromoted, std::memory_order_acq_rel);
  PromotionPath path = promotion_path();
  if (path == PromotionPath::Auto) {
    const Choice c = choose(state);
    if (c.probe_read) probe_read(g.file->fd(), offset, bytes);
    path = c.path;
  }
  if (path == PromotionPath::Map) {
    const int64_t t0 = now_ns();
    if (auto mapping = AlignedBuffer::map_file(g.file->fd(), offset, bytes, static_cast<uint64_t>(st.st_size))) {
      const bool huge = huge_mapped(mapping->data(), bytes);
      fold(costs_->map, now_ns() - t0, bytes);
      g.file->count_read(bytes);
      if (huge) path_state_[r].fetch_or(kHuge, std::memory_order_acq_rel);
      else path_state_[r].fetch_and(static_cast<uint8_t>(~kHuge), std::memory_order_acq_rel);
      mapped_.fetch_add(1, std::memory_order_relaxed);
      mapped_huge_.fetch_add(huge, std::memory_order_relaxed);
      // The munmap at eviction is part of the mapping's cost: timed when the last holder lets go.
      auto owned = std::make_unique<AlignedBuffer>(std::move(*mapping));
      mapping.reset();
      count_live(costs_->mapped_live, costs_->mapped_peak, static_cast<int64_t>(bytes));  // the deleter uncounts it
      std::shared_ptr<AlignedBuffer> buffer(owned.release(), [costs = costs_, bytes](AlignedBuffer* b) {
        const int64_t t = now_ns();
        delete b;
        fold(costs->unmap, now_ns() - t, bytes);
        costs->mapped_live.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
      });
      return std::make_shared<CPUCarrier>(std::move(buffer), count, dtype(), true);
    }
    // The system refused the mapping: read instead.
  }
  // A read tile's buffer goes back to the mapping cache at eviction, faulted in, for the next read; unless reads
  // are not this tier's path (forced, or Auto's), where it would sit there holding memory nothing reuses: then
  // its pages are given back first (the cache keeps only the address range).
  auto owned = std::make_unique<AlignedBuffer>(bytes, false, "a promoted checkpoint tile");
  count_live(costs_->read_live, costs_->read_peak, static_cast<int64_t>(bytes));  // the deleter uncounts it
  std::shared_ptr<AlignedBuffer> buffer(owned.release(), [costs = costs_, bytes](AlignedBuffer* b) {
    costs->read_live.fetch_sub(static_cast<int64_t>(bytes), std::memory_order_relaxed);
    const PromotionPath p = promotion_path();
    const bool reading =
        p == PromotionPath::Read || (p == PromotionPath::Auto && costs->reading.load(std::memory_order_relaxed));
    if (!reading && b->bytes() >= (size_t{1} << 20)) ::madvise(b->data(), b->bytes(), MADV_DONTNEED);
    delete b;
  });
  const bool reused = resident(buffer->data(), bytes);
#ifdef MADV_POPULATE_WRITE
  // A fresh buffer is faulted in before the read is timed: the estimate is a read into a recycled buffer, what
  // every read costs once reads are the path taken (their buffers come back through the mapping cache).
  if (!reused) ::madvise(buffer->data(), buffer->bytes(), MADV_POPULATE_WRITE);
#endif
  const int64_t t0 = now_ns();
  io::pread_full(g.file->fd(), buffer->data(), bytes, static_cast<int64_t>(offset), g.file->path());
  fold(costs_->read, now_ns() - t0, bytes);
  g.file->count_read(bytes);
  read_.fetch_add(1, std::memory_order_relaxed);
  read_reused_.fetch_add(reused, std::memory_order_relaxed);
  return std::make_shared<CPUCarrier>(std::move(buffer), count, dtype(), true);
}

CheckpointCarrier::Choice CheckpointCarrier::choose(uint8_t state) const noexcept {
  if (state & kHuge) return {PromotionPath::Map, false};
  const int64_t map = costs_->map.load(std::memory_order_relaxed), read = costs_->read.load(std::memory_order_relaxed);
  if (map < 0) return {PromotionPath::Map, false};  // nothing measured yet: map, and so measure a mapping
  if (read < 0) return {PromotionPath::Map, true};  // and a read
  const int64_t map_total = map + std::max<int64_t>(0, costs_->unmap.load(std::memory_order_relaxed));
  const int64_t cheap = std::max<int64_t>(1, std::min(read, map_total)), dear = std::max(read, map_total);
  const int64_t n = costs_->choices.fetch_add(1, std::memory_order_relaxed);
  // The tier's path is decided again once in kExploreEvery choices, and kept in between: a tier that switched
  // path on every noisy estimate would keep both kinds of memory at once. Reads must be cheaper by a fifth:
  // within that the estimates' noise decides nothing, and a mapping holds no memory of its own.
  if (n % kExploreEvery == 0) costs_->reading.store(read * 5 < map_total * 4, std::memory_order_relaxed);
  const PromotionPath path = costs_->reading.load(std::memory_order_relaxed) ? PromotionPath::Read : PromotionPath::Map;
  // The other path is measured again once in kExploreEvery times the cost ratio choices (the ratio at most 16):
  // its estimate stays current, and doing so costs about 1/kExploreEvery of the promotions' time whatever the
  // ratio. Reads are measured by a probe (a read of up to 1 MiB beside the mapping), so a tile mapped as usual
  // leaves no read buffer behind; mappings by mapping the tile.
  const int64_t every = kExploreEvery * std::clamp<int64_t>(dear / cheap, 1, 16);
  if (n % every != every - 1) return {path, false};
  return path == PromotionPath::Map ? Choice{PromotionPath::Map, true} : Choice{PromotionPath::Map, false};
}

void CheckpointCarrier::probe_read(int fd, uint64_t offset, size_t bytes) const noexcept {
  constexpr size_t kProbe = size_t{1} << 20;
  thread_local std::vector<std::byte> scratch;  // faulted in once per thread, as a recycled buffer is
  try {
    if (scratch.empty()) scratch.assign(kProbe, std::byte{1});
  } catch (...) {
    return;
  }
  const size_t n = std::min(bytes, kProbe);
  const int64_t t0 = now_ns();
  if (::pread(fd, scratch.data(), n, static_cast<off_t>(offset)) == static_cast<ssize_t>(n))
    fold(costs_->read, now_ns() - t0, n);
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
  if (!whole && bytes > 0) {  // copy-on-write: the range's current values first (dequantized, for a quantized one)
    std::vector<std::byte> buf(static_cast<size_t>(bytes));
    read_from_file(g, 0, g.slots, buf.data());
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
      if (Journal* j = g.file->journal()) j->write(-1, {{static_cast<int64_t>(g.offset) + off, bytes, src}});
      else io::pwrite_full(g.file->fd(), src, bytes, static_cast<int64_t>(g.offset) + off, g.file->path());
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
  if (writes_ != Writes::InPlace) {
    // The files are never written, but a tile promoted by mapping (Note [Promotion by mapping]) is the file's
    // pages: once the file is truncated below them they are gone, and writing such a tile to the overlay fails
    // on the overlay's write (EFAULT). The request is refused before anything is written, naming the checkpoint.
    for (const auto& [file, need] : files_) {
      const struct stat st = detail::stat_open_file(file->fd(), file->path());
      if (static_cast<uint64_t>(st.st_size) < need)
        raise<RuntimeError>("checkpoint file ", file->path(), " was truncated while in use: it has ", st.st_size,
                            " bytes but must hold ", need, "; cannot ", action,
                            ": tiles read or mapped from it have lost their bytes");
    }
    return;
  }
  for (const auto& [file, need] : files_) file->check_intact(need, action);
}

void CheckpointCarrier::flush() {
  check_live("flush");
  if (writes_ != Writes::InPlace) return;
  for (const auto& [file, need] : files_) {
    if (Journal* j = file->journal()) j->sync_target();  // fsync, then its records are needed no longer
    else io::fsync_file(file->fd(), file->path());
  }
}

void CheckpointCarrier::make_crash_safe() {
  if (writes_ != Writes::InPlace)
    raise<ValueError>("crash_safe=True needs a checkpoint tier that writes in place (mutable=True); an overlay tier "
                      "never writes its files");
  for (const auto& [file, need] : files_) file->enable_journal();
  crash_safe_ = true;
}

// One record per file the tile lands in: a tile within one file (every tile but one stacked from tensors of
// several shards) is one unit.
void CheckpointCarrier::write_unit(int64_t tile, const std::vector<SlotPiece>& pieces) {
  if (!crash_safe_) {
    for (const SlotPiece& p : pieces) write_slots(p.start, p.count, p.data);
    return;
  }
  std::vector<std::pair<CheckpointFile*, std::vector<JournalPiece>>> by_file;
  for (const SlotPiece& p : pieces) {
    const auto* src = static_cast<const std::byte*>(p.data);
    for_pieces(p.start, p.count, [&](size_t r, int64_t within, int64_t n) {
      const Range& g = ranges_[r];
      auto f = std::find_if(by_file.begin(), by_file.end(), [&](const auto& e) { return e.first == g.file.get(); });
      if (f == by_file.end()) f = by_file.insert(by_file.end(), {g.file.get(), {}});
      const size_t bytes = static_cast<size_t>(n) * itemsize_;
      f->second.push_back({static_cast<int64_t>(g.offset) + within * static_cast<int64_t>(itemsize_), bytes, src});
      src += bytes;
    });
  }
  for (auto& [file, list] : by_file) file->journal()->write(tile, list);
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
