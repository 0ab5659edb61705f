// strideweave/carriers/storage.hpp — storage-only carriers (they execute no
// operations): FileBacked, BlockDevice + BlockDeviceCarrier, and the
// whole-extent dependent carrier Evictable.
//
// FileBacked   slots live in a file, read and written with pread/pwrite (one
//              call per contiguous run). An empty filename makes an anonymous
//              temporary file that never has a name in the directory (Note
//              [Anonymous files leave no name] in storage.cpp). Starts at the
//              file's size, grows (zero-filled, by ftruncate) when allocated.
//              An immutable one opens an existing file and creates none.
//              Float32/Int32/BFloat16/Float16.
// BlockDevice  an arena over a block device or a preallocated file, read and
//              written with direct (O_DIRECT), 4096-byte-aligned I/O when the
//              filesystem allows it; `allocate` hands out 4096-aligned extents
//              as BlockDeviceCarriers, which return their extent on release.
// Evictable    a dependent carrier whose whole extent is either on `primary`
//              or on `secondary`; it claims both tiers for its lifetime.
//
// Thread-safety: concurrent bulk reads are safe; writes to distinct slots of a
// BlockDeviceCarrier are serialised where they share a device block.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "strideweave/carrier.hpp"
#include "strideweave/carriers/journal.hpp"

namespace sw {

const CarrierKind& file_backed_kind();
const CarrierKind& block_device_carrier_kind();
const CarrierKind& evictable_kind();

class FileBackedCarrier final : public Carrier, public AtomicSlotWrites {
 public:
  // Opens (or, when mutable, creates) `filename`; an empty name makes an anonymous temporary file.
  // ValueError for a name with an embedded NUL byte. crash_safe: every write goes through the file's journal
  // (Note [A crash-safe tier] in journal.cpp); ValueError for an anonymous or read-only one. A writable open
  // replays a journal a crash left; a read-only one refuses it (RuntimeError).
  FileBackedCarrier(const std::string& filename, const DType& dtype, bool is_mutable, bool crash_safe = false);
  ~FileBackedCarrier() override;

  int64_t size() const override { return is_released() ? 0 : slots_; }
  void read_slots(int64_t start, int64_t count, void* out) const override;
  bool read_waits_on_device(int64_t start, int64_t count) const override;
  void write_slots(int64_t start, int64_t count, const void* in) override;
  bool supports_storage_dtype(const DType& dtype) const override;
  bool can_grow() const override { return true; }
  void grow(int64_t slots, bool zero) override;
  CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const override;
  bool allows_elementwise_fallback() const override { return true; }
  // A named file: RuntimeError when it was deleted, renamed, replaced or truncated since it was opened
  // (Note [Files changed under a carrier] in storage.cpp). An anonymous one: nothing to check.
  void check_storage_intact(const char* action) const override;

  // fsync of the file: every completed write is durable (crash-safe: then the journal is emptied). RuntimeError
  // when released.
  void flush() override;

  bool crash_safe() const noexcept override { return journal_ != nullptr; }
  // Crash-safe: the pieces as one journal record (one unit). Otherwise one write_slots per piece.
  void write_unit(int64_t tile, const std::vector<SlotPiece>& pieces) override;
  // The journal's counters (all zero when not crash-safe).
  JournalStats journal_stats() const;

  // The name given; for an anonymous file, which has none, what the kernel calls the open file
  // ("/tmp/#1234 (deleted)", as /proc/<pid>/fd and lsof show it): a description, never a path to open.
  const std::string& filename() const noexcept { return path_; }
  bool is_anonymous() const noexcept { return anonymous_; }
  int fd() const noexcept { return fd_; }
  // Whether cold tile reads can bypass the page cache (the file system takes O_DIRECT; Note [Cold reads bypass
  // the page cache] in io.cpp).
  bool direct_reads_possible() const noexcept { return direct_fd() >= 0; }

 protected:
  void do_release() override;

 private:
  void close_file() noexcept;
  int direct_fd() const noexcept;
  std::string path_;
  std::string absolute_;  // a named file's path made absolute, for check_storage_intact
  bool anonymous_ = false;
  int fd_ = -1;
  int64_t slots_ = 0;
  std::unique_ptr<Journal> journal_;  // crash-safe only
  // The same file opened with O_DIRECT for cold tile reads (Note [Cold reads bypass the page cache] in io.cpp),
  // on the first large read; -1 where the file system refuses O_DIRECT.
  mutable std::once_flag direct_once_;
  mutable int direct_fd_ = -1;
};

class BlockDeviceCarrier;

class BlockDevice : public std::enable_shared_from_this<BlockDevice> {
 public:
  static constexpr int64_t kBlock = 4096;
  // ValueError for a path with an embedded NUL byte.
  explicit BlockDevice(const std::string& path);
  ~BlockDevice();
  BlockDevice(const BlockDevice&) = delete;
  BlockDevice& operator=(const BlockDevice&) = delete;

  std::shared_ptr<BlockDeviceCarrier> allocate(int64_t slots, const DType& dtype, bool is_mutable, bool empty);
  const std::string& path() const noexcept { return path_; }
  int64_t capacity_bytes() const noexcept { return capacity_; }
  int64_t free_bytes() const;
  bool is_direct() const noexcept { return direct_; }
  // RuntimeError when the device file was deleted, renamed, replaced or truncated since it was opened.
  void check_intact(const char* action) const;

  // Byte-addressed I/O; unaligned ranges go through aligned bounce buffers.
  void read(int64_t offset, size_t bytes, void* out) const;
  void write(int64_t offset, size_t bytes, const void* in);
  // fsync of the device (or preallocated file): every completed write is durable.
  void sync();

 private:
  friend class BlockDeviceCarrier;
  int64_t reserve(int64_t bytes);     // returns an aligned extent start
  void give_back(int64_t start, int64_t bytes) noexcept;
  std::string path_;
  std::string absolute_;
  int fd_ = -1;
  bool direct_ = false;
  int64_t capacity_ = 0;
  mutable std::mutex mutex_;  // extent table and read-modify-write of partial blocks
  std::vector<std::pair<int64_t, int64_t>> free_;  // (start, length), sorted
};

class BlockDeviceCarrier final : public Carrier {
 public:
  BlockDeviceCarrier(std::shared_ptr<BlockDevice> device, int64_t start, int64_t slots, const DType& dtype,
                     bool is_mutable);
  ~BlockDeviceCarrier() override;
  int64_t size() const override { return is_released() ? 0 : slots_; }
  void read_slots(int64_t start, int64_t count, void* out) const override;
  void write_slots(int64_t start, int64_t count, const void* in) override;
  bool supports_storage_dtype(const DType& dtype) const override;
  bool can_grow() const override { return true; }
  void grow(int64_t slots, bool zero) override;
  CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const override;
  bool allows_elementwise_fallback() const override { return true; }
  // fsync of the device: every completed write to the extent is durable. RuntimeError when released.
  void flush() override;
  void check_storage_intact(const char* action) const override;
  const std::shared_ptr<BlockDevice>& device() const noexcept { return device_; }
  int64_t device_offset() const noexcept { return start_; }

 protected:
  void do_release() override;

 private:
  void free_extent() noexcept;
  std::shared_ptr<BlockDevice> device_;
  int64_t start_ = 0;
  int64_t bytes_ = 0;
  int64_t slots_ = 0;
};

class EvictableCarrier final : public DependentCarrier {
 public:
  // `is_mutable` is the public mutability of the Evictable itself (allocate_like and
  // new_like pass theirs through); the Python constructor always creates it mutable.
  EvictableCarrier(CarrierPtr primary, CarrierPtr secondary, bool is_mutable = true);
  ~EvictableCarrier() override;
  int64_t size() const override { return is_released() ? 0 : slots_; }
  void read_slots(int64_t start, int64_t count, void* out) const override;
  void write_slots(int64_t start, int64_t count, const void* in) override;
  // No native_data(): the primary's buffer is freed by evict(), so a raw pointer
  // (a NumPy view, a bulk copy in flight) could outlive it. Bulk access goes through
  // read_slots/write_slots, which check residency under the lock.
  bool supports_storage_dtype(const DType& dtype) const override;
  bool can_grow() const override { return false; }
  CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const override;

  void evict();
  void promote();
  bool is_evicted() const;
  CarrierPtr primary() const;
  CarrierPtr secondary() const;

 protected:
  void do_release() override;

 private:
  void check_resident(const char* action) const;
  mutable std::mutex mutex_;
  CarrierPtr primary_, secondary_;
  Claim primary_claim_, secondary_claim_;
  bool evicted_ = false;
  int64_t slots_ = 0;
};

}  // namespace sw
