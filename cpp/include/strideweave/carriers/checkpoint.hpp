// strideweave/carriers/checkpoint.hpp — the checkpoint tier: a storage-only
// carrier whose slots are byte ranges of existing files, where they lie.
//
// Note [A checkpoint tier]: a model checkpoint holds each expert's matrix as
// one byte range of one file (safetensors: a data area after a JSON header;
// sharded checkpoints spread the tensors over several files). A checkpoint
// tier is the concatenation, in slot order, of such ranges: range r holds
// slots [start_r, start_r + slots_r) at byte offset offset_r of its file. A
// TiledEvictable over it whose tile t is range t (one tile per tensor) promotes
// a tile with exactly one read of that range, and touches no other byte of the
// file: nothing is copied into a file of our own first.
//
// Writes. A checkpoint is an input, usually shared (a cache of downloaded
// models), so by default its files are opened read-only and never written
// (Writes::Overlay): the first write to a range copies the range's bytes
// into a scratch file (an anonymous file in the checkpoint's folder, or in
// TMPDIR where that folder is not writable; Note [Anonymous files leave no
// name] in storage.cpp) unless the write covers the whole range, and from then
// on that range is read and written there. The scratch file vanishes with the
// carrier. Writes::InPlace opens the files read-write and writes each range
// where it lies (fine-tuning a private copy).
//
// Files. Each file is opened once (CheckpointFile) and shared by every carrier
// over it; a named file that is deleted, replaced or truncated while in use
// fails the next batch of writes with RuntimeError, as FileBacked does (Note
// [Files changed under a carrier] in storage.cpp), and reads past a truncated
// end fail (Note [A short read is an error] in io.cpp).
//
// allocate_like gives scratch space for values that are not the checkpoint's
// (a gradient of a checkpoint-backed weight): an empty anonymous FileBacked.
//
// Thread-safety: reads and writes of distinct slots may run concurrently from
// any thread (the I/O threads of a TiledEvictable do); concurrent writes to
// the same slots race as on plain memory. The first write to a range takes a
// lock while it copies the range into the overlay (once per range).
#pragma once

#include <atomic>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "strideweave/carrier.hpp"
#include "strideweave/carriers/journal.hpp"
#include "strideweave/checkpoint/quantized.hpp"

namespace sw {

const CarrierKind& checkpoint_kind();

// What names one version of a file: its device and inode, and its size and modification time (Note [A checkpoint
// is the file it parsed] in checkpoint/checkpoint.cpp).
struct FileIdentity {
  uint64_t dev = 0, ino = 0, size = 0;
  int64_t mtime_ns = 0;
  bool same_file(const FileIdentity& o) const noexcept { return dev == o.dev && ino == o.ino; }
  bool operator==(const FileIdentity&) const = default;
};
// The identity of the file `path` names now (stat), or nullopt when it names none.
std::optional<FileIdentity> identity_at(const std::string& path);

// One file of a checkpoint, opened once. ValueError for a path with a NUL byte or a directory; RuntimeError when
// it cannot be opened.
class CheckpointFile {
 public:
  CheckpointFile(const std::string& path, bool writable);
  ~CheckpointFile();
  CheckpointFile(const CheckpointFile&) = delete;
  CheckpointFile& operator=(const CheckpointFile&) = delete;

  const std::string& path() const noexcept { return path_; }
  int fd() const noexcept { return fd_; }
  bool writable() const noexcept { return writable_; }
  uint64_t size_at_open() const noexcept { return size_; }
  // The identity of the open file as it was when it was opened (before a journal's replay).
  const FileIdentity& identity_at_open() const noexcept { return identity_; }
  // RuntimeError naming the file and `action` when its name no longer leads to it or it was truncated below
  // `need_bytes`.
  void check_intact(uint64_t need_bytes, const char* action) const;
  // RuntimeError naming the file and `action` when its name no longer leads to the file opened (replaced, removed
  // or renamed).
  void check_still_named(const char* action) const;
  // Bytes read from this file through checkpoint carriers since it was opened (tests, stats).
  uint64_t bytes_read() const noexcept { return bytes_read_.load(std::memory_order_relaxed); }
  void count_read(uint64_t bytes) const noexcept { bytes_read_.fetch_add(bytes, std::memory_order_relaxed); }
  // Crash-safe in-place writes (Note [A crash-safe tier] in journal.cpp): opens the file's journal once; from then
  // on every in-place write to the file goes through it. RuntimeError for a read-only file or a journal in use.
  Journal& enable_journal();
  // The journal, or nullptr when no crash-safe tier was made over the file.
  Journal* journal() const noexcept { return journal_.get(); }

 private:
  std::string path_, absolute_;
  bool writable_;
  int fd_ = -1;
  std::mutex journal_mutex_;
  std::unique_ptr<Journal> journal_;
  uint64_t size_ = 0;
  FileIdentity identity_;
  mutable std::atomic<uint64_t> bytes_read_{0};
};

// How a read-only (Writes::Overlay) checkpoint tier promotes a tile of at least 1 MiB that is one range still in
// its file (Note [Promotion by the cheaper path] in checkpoint.cpp): Auto chooses per promotion; Map always maps
// the file's pages; Read always reads into a buffer of the tile's own (recycled through the mapping cache). The
// setting is process-wide (tests and benchmarks force a path); set_promotion_path returns the previous one.
enum class PromotionPath { Auto, Map, Read };
PromotionPath set_promotion_path(PromotionPath path) noexcept;
PromotionPath promotion_path() noexcept;

// A checkpoint tier's promotions by each path (CheckpointCarrier::promotion_stats).
struct PromotionStats {
  int64_t mapped = 0;       // tiles promoted by mapping the file's pages
  int64_t mapped_huge = 0;  // of those, mappings whose every page came in huge page-table entries (2 MiB folios)
  int64_t read = 0;         // tiles promoted by reading into a buffer of their own
  int64_t read_reused = 0;  // of those, reads into a buffer already faulted in (taken from the mapping cache)
  // What Auto compares (Note [Promotion by the cheaper path]): moving averages of the nanoseconds per MiB a
  // mapping took (mmap and touch), its munmap at eviction took, and a read took (buffer and pread); -1 until
  // measured.
  int64_t map_ns_per_mib = -1, unmap_ns_per_mib = -1, read_ns_per_mib = -1;
  // Bytes of the buffers these promotions made that are still alive (a tile's, or held past its eviction by
  // whatever else holds the buffer), now and at their peak, mapped and read.
  int64_t mapped_live_bytes = 0, mapped_peak_bytes = 0, read_live_bytes = 0, read_peak_bytes = 0;
};

// Note [A quantized checkpoint tier]: a range may hold its values quantized (FP8 block-scaled or MXFP4: Note
// [Quantized element formats] in strideweave/checkpoint/quantized.hpp) rather than in the carrier's dtype. Its
// slots are then the dequantized values (the carrier's dtype is BFloat16 or Float32), and its bytes are the
// quantized elements at `offset` plus the scales at `scale_offset` of `scale_file`. Reading slots of such a range
// takes the quantized bytes (mapped for a request of 1 MiB or more, else read) and the scales that cover them, in
// chunks of about 1 MiB of whole block rows (each chunk dequantized while it is in cache; each scale read once),
// and dequantizes them into the destination in the same pass: promoting a tile reads only the quantized bytes and
// their scales (bytes_read counts exactly those) and writes the tile's memory once, on the promoting thread. A
// quantized tile is never promoted by mapping (map_slots returns nullptr: the engine reads it into the primary
// tile). A read of part of a chunk (a view read element by element) dequantizes the chunk into a per-thread cache
// that serves the next such reads (CheckpointCarrier::read_quantized). Its writes go to the overlay in the carrier's dtype like any read-only tier's (a first partial
// write copies the dequantized range there first); a quantized tier cannot write in place (ValueError).
struct QuantizedRange {
  enum class Format : uint8_t { FP8, MXFP4 };
  using Scale = quant::Scales;
  Format format = Format::FP8;
  Scale scale_type = Scale::F32;
  std::shared_ptr<CheckpointFile> scale_file;
  uint64_t scale_offset = 0;
  // FP8: the matrix (rows, cols) and its block; MXFP4: rows * cols values, cols a multiple of 32 (groups of 32).
  int64_t rows = 0, cols = 0, block_rows = 1, block_cols = 32;
  int64_t scale_rows() const noexcept;
  int64_t scale_cols() const noexcept;
  int64_t scale_count() const noexcept { return scale_rows() * scale_cols(); }
  size_t scale_itemsize() const noexcept { return scale_type == Scale::F32 ? 4 : scale_type == Scale::BF16 ? 2 : 1; }
  uint64_t data_bytes() const noexcept;  // the quantized elements' bytes
  uint64_t scale_bytes() const noexcept { return static_cast<uint64_t>(scale_count()) * scale_itemsize(); }
};

class CheckpointCarrier final : public Carrier, public AtomicSlotWrites {
 public:
  enum class Writes { Overlay, InPlace };
  // One byte range of a file: `slots` slots of the carrier's dtype at byte `offset`; or, with `quant`, `slots`
  // dequantized values whose quantized bytes start at `offset` (Note [A quantized checkpoint tier]).
  struct Range {
    std::shared_ptr<CheckpointFile> file;
    uint64_t offset = 0;
    int64_t slots = 0;
    std::shared_ptr<const QuantizedRange> quant;
  };
  // ValueError when a range (or a quantized range's scales) does not lie inside its file, InPlace is asked of a
  // file opened read-only or of quantized ranges, or a quantized range's sizes do not agree; TypeError for a dtype
  // without a fixed element size, or quantized ranges in a carrier of a dtype other than BFloat16 and Float32.
  CheckpointCarrier(std::vector<Range> ranges, const DType& dtype, Writes writes);
  ~CheckpointCarrier() override;

  int64_t size() const override { return is_released() ? 0 : total_; }
  void read_slots(int64_t start, int64_t count, void* out) const override;
  void write_slots(int64_t start, int64_t count, const void* in) override;
  // Writes::Overlay: slots of at least 1 MiB within one range still in its file, either mapped copy-on-write
  // (Note [Promotion by mapping] in checkpoint.cpp) or read into a buffer of their own, whichever is cheaper
  // (Note [Promotion by the cheaper path]); nullptr otherwise (the engine then reads them).
  CarrierPtr map_slots(int64_t start, int64_t count) const override;
  // Counters of the promotions map_slots made, by path.
  PromotionStats promotion_stats() const noexcept;
  bool supports_storage_dtype(const DType& dtype) const override;
  bool can_grow() const override { return false; }
  void check_storage_intact(const char* action) const override;
  // InPlace: fsync of every file written. Overlay: nothing (the overlay is scratch, gone with the carrier).
  void flush() override;
  CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const override;

  Writes writes() const noexcept { return writes_; }
  // Writes::InPlace only: journal every write to the files (crash_safe=True; Note [A crash-safe tier] in
  // journal.cpp). ValueError for an overlay tier (it never writes its files).
  void make_crash_safe();
  bool crash_safe() const noexcept override { return crash_safe_; }
  // Crash-safe: the pieces as one record per file they land in. Otherwise one write_slots per piece.
  void write_unit(int64_t tile, const std::vector<SlotPiece>& pieces) override;
  const std::vector<Range>& ranges() const noexcept { return ranges_; }
  // Ranges whose values now live in the overlay (Writes::Overlay).
  int64_t overlaid_ranges() const;

 protected:
  void do_release() override;

 private:
  // Auto's choice for a range in `state`, and whether to measure a read first (Note [Promotion by the cheaper
  // path]); probe_read times a read of up to 1 MiB of the range into memory already faulted in.
  struct Choice {
    PromotionPath path;
    bool probe_read;
  };
  Choice choose(uint8_t state) const noexcept;
  void probe_read(int fd, uint64_t offset, size_t bytes) const noexcept;
  // Index of the range holding `slot`.
  size_t range_of(int64_t slot) const;
  // Slots [within, within + n) of range `g` as they are in its file: a read, or the dequantized values of a
  // quantized range (Note [A quantized checkpoint tier]).
  void read_from_file(const Range& g, int64_t within, int64_t n, std::byte* dst) const;
  void read_quantized(const Range& g, int64_t within, int64_t n, std::byte* dst) const;
  // The overlay offset of range r, copying the range there first unless `whole` (Writes::Overlay).
  int64_t overlay_for(size_t r, bool whole);
  template <class F>
  void for_pieces(int64_t start, int64_t count, F&& f) const;

  std::vector<Range> ranges_;
  uint64_t serial_;  // distinct per carrier for the life of the process (read_quantized's cache key)
  std::vector<std::pair<std::shared_ptr<CheckpointFile>, uint64_t>> files_;  // each file once, with the bytes it must hold
  std::vector<int64_t> starts_;  // starts_[r]: first slot of range r; starts_.back() == total_
  int64_t total_ = 0;
  size_t itemsize_;
  Writes writes_;
  bool crash_safe_ = false;
  // Overlay: byte offset of each range in the scratch file, -1 while it lives in the checkpoint.
  std::unique_ptr<std::atomic<int64_t>[]> overlay_at_;
  // Per range, what promotions have learnt (Note [Promotion by the cheaper path]): kPromoted, kHuge bits.
  std::unique_ptr<std::atomic<uint8_t>[]> path_state_;
  mutable std::atomic<int64_t> mapped_{0}, mapped_huge_{0}, read_{0}, read_reused_{0};
  // Moving averages of each path's cost in ns per MiB (-1: not measured yet), shared with the mapped buffers
  // (their munmap is timed when the tile lets go of them, possibly after this carrier is gone).
  struct PathCosts {
    std::atomic<int64_t> map{-1}, unmap{-1}, read{-1}, choices{0};
    std::atomic<bool> reading{false};  // Auto's current path for this tier: reads (true) or mappings
    std::atomic<int64_t> mapped_live{0}, mapped_peak{0}, read_live{0}, read_peak{0};
  };
  std::shared_ptr<PathCosts> costs_ = std::make_shared<PathCosts>();
  mutable std::mutex overlay_mutex_;  // guards overlay_fd_/overlay_end_ and first writes
  int overlay_fd_ = -1;
  std::string overlay_name_;
  int64_t overlay_end_ = 0;
};

}  // namespace sw
