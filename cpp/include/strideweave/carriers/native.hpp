// strideweave/carriers/native.hpp — the shipped in-memory carriers.
//
// Generic  the reference carrier: a plain vector of elements and the simplest
//          obviously-correct loops; the oracle fast carriers are tested against.
// CPU      aligned native host memory (64-byte aligned; 2 MiB aligned and
//          huge-page advised from 1 MiB up, so first touch is cheap; freed
//          large mappings are recycled, see Note [Mapping cache] in
//          native.cpp); the fast kernels run here; native_data() exposes the
//          pointer. A CPU carrier may also borrow memory it does not own
//          (a DLPack import: Note [Borrowed memory] in native.cpp).
// Both are allocatable when empty and are final.
#pragma once

#include <atomic>
#include <chrono>
#include <cstddef>
#include <memory>

#include "strideweave/carrier.hpp"

namespace sw {

// Owning aligned host buffer. Zero-filled on request; otherwise its contents are
// unspecified (a recycled large mapping keeps its previous bytes). When the
// memory cannot be had it throws MemoryError "allocating <bytes> bytes for
// <what> failed: ..." (`what` names the buffer's use: "a CPU carrier").
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  AlignedBuffer(size_t bytes, bool zero, const char* what = "a host buffer");
  ~AlignedBuffer();
  AlignedBuffer(AlignedBuffer&& o) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& o) noexcept;
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  std::byte* data() const noexcept { return data_; }
  size_t bytes() const noexcept { return bytes_; }
  void reset() noexcept;

  // A buffer over memory it does not own (Note [Borrowed memory] in native.cpp):
  // `data` stays valid while `owner` (never null) lives; the buffer frees
  // nothing, it holds `owner` until it is reset or destroyed.
  static std::shared_ptr<AlignedBuffer> borrow(std::byte* data, size_t bytes, std::shared_ptr<const void> owner);
  bool is_borrowed() const noexcept { return owner_ != nullptr; }

  // A buffer over `bytes` bytes at `offset` of a file of `file_bytes` bytes, mapped private and populated (Note
  // [Promotion by mapping] in carriers/checkpoint.cpp): it reads the page cache's pages without copying them,
  // and a write copies the page it lands in, so the file never changes. The mapping covers the whole huge pages
  // around the bytes (within the file); the buffer owns it (unmapped when reset). nullptr when the range is not
  // inside the file or the system refuses the mapping.
  static std::shared_ptr<AlignedBuffer> map_file(int fd, uint64_t offset, size_t bytes, uint64_t file_bytes);

  // How many carriers use this buffer as their storage (Note [Shared snapshots]
  // in native.cpp): more than one means it is shared copy-on-write.
  std::atomic<int> holders{1};

 private:
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  bool mapped_ = false;
  std::shared_ptr<const void> owner_;  // borrowed memory's owner, else null
  void* file_map_ = nullptr;           // map_file: the mapping's start and length, unmapped by reset()
  size_t file_map_bytes_ = 0;
};

// Freed AlignedBuffer mappings (the 1 MiB-and-up, huge-page path) are kept for
// reuse by later allocations of the same mapped length, up to a process-wide
// limit of cached bytes (1 GiB, or a sixteenth of memory_available_to_process()
// where that is less: a memory cgroup's limit counts), and each for at most the decay time after it was freed (2 s
// by default): a trimming thread unmaps older ones. See Note [Mapping cache]
// in native.cpp. set_mapping_cache_limit returns the previous limit; lowering
// it unmaps the oldest cached mappings at once (0 turns the cache off).
// set_mapping_cache_decay returns the previous decay time; the trimmer applies
// a new one at once. mapping_cache_bytes is what the cache holds now.
// trim_mapping_cache(now) unmaps what would be due by `now` (what the trimming
// thread does when the time comes) and returns the bytes it unmapped.
// Thread-safe.
size_t set_mapping_cache_limit(size_t bytes);
std::chrono::steady_clock::duration set_mapping_cache_decay(std::chrono::steady_clock::duration decay);
size_t mapping_cache_bytes();
// The memory this process may use: the machine's, or a memory cgroup's limit where that is less (the mapping
// cache's default limit is a sixteenth of it, at most 1 GiB).
size_t memory_available_to_process() noexcept;
size_t trim_mapping_cache(std::chrono::steady_clock::time_point now);
// How many freed mappings have woken the trimming thread (Note [Parking the trimmer]; for tests).
uint64_t mapping_cache_trimmer_signals();

// Copies `count` slots between two carriers of one dtype in bulk (memcpy for
// native memory, one read or write call per run otherwise): any two carriers,
// whatever their kinds.
void copy_slots(const Carrier& src, int64_t src_start, Carrier& dst, int64_t dst_start, int64_t count);

const CarrierKind& generic_kind();
const CarrierKind& cpu_kind();

class GenericCarrier final : public Carrier {
 public:
  GenericCarrier(int64_t slots, const DType& dtype, bool is_mutable);
  int64_t size() const override { return is_released() ? 0 : slots_; }
  void read_slots(int64_t start, int64_t count, void* out) const override;
  void write_slots(int64_t start, int64_t count, const void* in) override;
  Value read_value(int64_t slot) const override { return values_[static_cast<size_t>(slot)]; }
  void write_value(int64_t slot, const Value& v) override { values_[static_cast<size_t>(slot)] = v; }
  bool can_grow() const override { return true; }
  void grow(int64_t slots, bool zero) override;
  CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const override;
  bool allows_elementwise_fallback() const override { return true; }

 protected:
  void do_release() override;

 private:
  Value zero() const;
  void assign_zeros(int64_t slots);  // MemoryError naming the bytes when the vector cannot be had
  int64_t slots_;
  std::vector<Value> values_;  // one converted Value per slot: obviously correct, deliberately simple
};

// What the owner of borrowed memory can tell about it (Note [Borrowed memory] in native.cpp): a producer that
// can move or free the memory it lent (PyTorch's resize_) checks, before each use, that the memory is still the
// one imported.
class BorrowedMemoryCheck {
 public:
  virtual ~BorrowedMemoryCheck() = default;
  // RuntimeError naming the owner and `action` when the memory is no longer where it was imported.
  virtual void check(const char* action) const = 0;
};

class CPUCarrier final : public Carrier {
 public:
  CPUCarrier(int64_t slots, const DType& dtype, bool is_mutable, bool empty);
  // A carrier over `slots` elements of `dtype` at `data`, memory it does not
  // own and never frees: valid while `owner` (never null) lives, which this
  // carrier and every export of it hold (Note [Borrowed memory] in native.cpp).
  // ValueError when `data` is not aligned to the dtype's itemsize. `moved`, when given, is asked before each
  // use whether the owner still keeps the memory in place (check_borrowed_memory).
  CPUCarrier(std::byte* data, int64_t slots, const DType& dtype, bool is_mutable, std::shared_ptr<const void> owner,
             std::shared_ptr<const BorrowedMemoryCheck> moved = nullptr);
  // A carrier owning `buffer` (AlignedBuffer::map_file), which holds at least `slots` elements of `dtype`
  // aligned to the itemsize.
  CPUCarrier(std::shared_ptr<AlignedBuffer> buffer, int64_t slots, const DType& dtype, bool is_mutable);
  ~CPUCarrier() override;
  // A new mutable carrier holding this one's current values without copying
  // them: both share the memory until either writes, and the writer first takes
  // a private copy (Note [Shared snapshots] in native.cpp). nullptr when this
  // carrier's memory is exported (a NumPy or DLPack view could write it
  // behind the carriers' backs), borrowed or released.
  std::shared_ptr<CPUCarrier> share_snapshot() const;
  // Whether the memory is currently shared with another carrier.
  bool shares_memory() const noexcept { return buffer_->holders.load(std::memory_order_acquire) > 1; }
  int64_t size() const override { return is_released() ? 0 : slots_; }
  void read_slots(int64_t start, int64_t count, void* out) const override;
  void write_slots(int64_t start, int64_t count, const void* in) override;
  const std::byte* native_data() const noexcept override { return buffer_->data(); }
  std::byte* mutable_native_data() override;
  std::shared_ptr<const void> native_owner() const noexcept override { return buffer_; }
  void check_borrowed_memory(const char* action) const override {
    if (moved_) moved_->check(action);
  }
  Value read_value(int64_t slot) const override;
  void write_value(int64_t slot, const Value& v) override;
  bool can_grow() const override { return true; }
  void grow(int64_t slots, bool zero) override;
  CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const override;
  bool allows_elementwise_fallback() const override { return true; }

 protected:
  void do_release() override;

 private:
  struct ShareTag {};
  CPUCarrier(ShareTag, const CPUCarrier& source, std::shared_ptr<AlignedBuffer> buffer);
  // Takes a private copy of shared memory (a no-op when nothing shares it).
  void unshare();
  // Replaces the storage, giving up this carrier's hold on the old buffer.
  void set_buffer(std::shared_ptr<AlignedBuffer> buffer) noexcept;

  int64_t slots_;
  std::shared_ptr<AlignedBuffer> buffer_ = std::make_shared<AlignedBuffer>();  // never null
  const std::shared_ptr<const BorrowedMemoryCheck> moved_;  // borrowed memory whose owner can move it, else null
};

}  // namespace sw
