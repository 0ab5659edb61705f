// strideweave/carrier.hpp — the Carrier base: a flat, fixed-size array of
// physical slots of one storage dtype. Tensors never own data; they reference
// a carrier.
//
// Ownership and lifetime. Carriers are always held by std::shared_ptr (the
// Python face shares the same object). A carrier may be *claimed* by a
// composite carrier or by an in-flight request (a move, a projection); while
// any claim is held the carrier is "owned": others may read it, but public
// writes, release() and moves raise RuntimeError. A Claim is a move-only token
// whose end is recorded exactly once, on success and failure alike.
//
// Versions. `version()` only grows. Every successful public write (slot write,
// tensor write, a move or scatter into the carrier) increments it; allocation,
// release and residency movement never do. The counter lives on the carrier so
// every view of it sees one counter (see Note [Version on the carrier]).
//
// Data access. Public element access (`get`, `set`) checks state and converts
// values; engine code uses the bulk, unchecked `read_slots`/`write_slots`
// (a run of slots in one call) and, for native memory, `native_data()` /
// `mutable_native_data()`, so no
// hot path pays a per-slot virtual call.
//
// Thread-safety. State queries and claims are atomic / internally locked.
// Concurrent bulk reads are safe; concurrent writes to the same slots race as
// they would on plain memory. release() is serialised with claims.
//
// Note [Exports outlive release]: a NumPy/DLPack view of native memory may live
// longer than the carrier's storage (release(), or a move that consumes the
// source). The view holds native_owner(), so the memory stays valid until the
// view is dropped; the carrier itself reports released and refuses access.
//
// Note [Version on the carrier]: PyTorch keeps its version counter on the
// storage for the same reason: a tensor saved for backward and a view that
// writes must observe one counter.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "strideweave/dtype.hpp"
#include "strideweave/fork.hpp"

namespace sw {

class Carrier;
using CarrierPtr = std::shared_ptr<Carrier>;

// The storage behaviour of a user-defined carrier kind (implemented by the
// Python bindings over the user's StorageProvider callables).
class StorageProvider {
 public:
  virtual ~StorageProvider() = default;
  virtual bool supports_dtype(const Carrier& c, const DType& dtype) = 0;
  virtual int64_t physical_size(const Carrier& c) = 0;
  virtual void allocate(Carrier& c, int64_t slots) = 0;
  virtual void release(Carrier& c) = 0;
  virtual Value read(const Carrier& c, int64_t slot) = 0;
  virtual void write(Carrier& c, int64_t slot, const Value& value) = 0;
  // A fresh carrier of the same user kind (constructed through its class).
  virtual CarrierPtr construct(int64_t slots, const DType& dtype, bool is_mutable) = 0;
  bool elementwise_fallback = false;
};

// The identity of a carrier kind (its exact class): shipped kinds use a static
// tag, user kinds their registered definition.
struct CarrierKind {
  std::string name;  // class name for messages
  bool shipped = false;
  bool storage_only = false;  // executes no operations
  bool dependent = false;     // composes other carriers
};

class Carrier : public std::enable_shared_from_this<Carrier> {
 public:
  // A user-defined kind: storage through `provider`. The binding constructs
  // the object, then calls allocate_storage(slots) (the provider's allocate).
  Carrier(const CarrierKind* kind, std::shared_ptr<StorageProvider> provider, const DType& dtype,
          bool is_mutable);
  void allocate_storage(int64_t slots);
  virtual ~Carrier();
  Carrier(const Carrier&) = delete;
  Carrier& operator=(const Carrier&) = delete;

  const CarrierKind& kind() const noexcept { return *kind_; }
  const std::string& kind_name() const noexcept { return kind_->name; }
  const DType& dtype() const noexcept { return *dtype_; }
  virtual int64_t size() const;

  uint64_t version() const noexcept { return version_.load(std::memory_order_acquire); }
  void bump_version() noexcept { version_.fetch_add(1, std::memory_order_acq_rel); }

  bool created_mutable() const noexcept { return mutable_; }
  bool is_owned() const noexcept { return claims_.load(std::memory_order_acquire) > 0; }
  bool is_mutable() const noexcept { return mutable_ && !is_owned(); }
  bool is_released() const noexcept { return released_.load(std::memory_order_acquire); }
  // Frees storage; idempotent. RuntimeError while owned.
  void release();

  // -------- ownership
  class Claim {
   public:
    Claim() = default;
    Claim(Claim&& o) noexcept : carrier_(std::move(o.carrier_)) {}
    Claim& operator=(Claim&& o) noexcept;
    ~Claim() { end(); }
    void end() noexcept;  // idempotent
    bool active() const noexcept { return carrier_ != nullptr; }
    const CarrierPtr& carrier() const noexcept { return carrier_; }

   private:
    friend class Carrier;
    explicit Claim(CarrierPtr c) : carrier_(std::move(c)) {}
    CarrierPtr carrier_;
  };
  // Claims this carrier for `owner` (a description for messages). RuntimeError
  // when released. Several claims may be held at once.
  [[nodiscard]] Claim claim(std::string owner);
  // Ends `claim` (a claim on this carrier) and releases the carrier in one
  // step, so no other request can claim it in between (a move consuming its
  // source). RuntimeError, with the claim ended, when another claim remains.
  void release_claimed(Claim& claim);
  std::string owner_description() const;
  int claim_count() const noexcept { return claims_.load(); }
  // While one is alive, the thread that made it may write `c` through the
  // public API although a move owns it: a transfer provider filling its
  // in-flight destination (Note [Moves own before they prepare] in move.cpp).
  class TransferWrites {
   public:
    explicit TransferWrites(const Carrier& c) noexcept;
    ~TransferWrites();
    TransferWrites(const TransferWrites&) = delete;
    TransferWrites& operator=(const TransferWrites&) = delete;

   private:
    const Carrier* previous_;
  };

  // -------- checked public element access
  Value get(int64_t slot) const;                 // live, in range
  void set(int64_t slot, const Value& value);    // live, publicly mutable, in range; bumps version
  // State checks shared by entry points: RuntimeError with `action` in the message.
  void check_live(const char* action) const;
  void check_writable(const char* action) const;
  void check_index(int64_t slot) const;

  // -------- unchecked bulk access (engine code; caller validated state and range)
  virtual void read_slots(int64_t start, int64_t count, void* out) const;
  // Whether reading these slots now would mostly wait on a device rather than use the CPU (a cold read that
  // bypasses the page cache); the engine then reads them on Executor::device_reads().
  virtual bool read_waits_on_device(int64_t, int64_t) const { return false; }
  virtual void write_slots(int64_t start, int64_t count, const void* in);
  // A mutable CPU carrier over slots [start, start + count) that reads their stored bytes without copying them
  // (a private, copy-on-write mapping of a file: writes to it never reach this carrier), or nullptr where this
  // carrier has none to give; the engine then reads the slots into memory of its own. A TiledEvictable promotes a
  // tile this way when its primary tier is the CPU kind (Note [Promotion by mapping] in carriers/checkpoint.cpp).
  virtual CarrierPtr map_slots(int64_t /*start*/, int64_t /*count*/) const { return nullptr; }
  // Storage that lives under a name in the file system checks that the name still leads to it and that it still
  // holds its slots, and raises RuntimeError naming the file and `action` otherwise; other carriers have nothing
  // to check. One check (a system call or two) covers a batch of writes: callers check once per eviction
  // request, move or public slot write, never per slot (Note [Files changed under a carrier] in storage.cpp).
  virtual void check_storage_intact(const char* /*action*/) const {}
  // Memory another library owns (a DLPack import: Note [Borrowed memory] in native.cpp) checks that its owner
  // still keeps it where it was imported, and raises RuntimeError naming the owner and `action` otherwise; other
  // carriers have nothing to check. check_live() calls it, so every entry point that reads or writes a carrier
  // checks it first.
  virtual void check_borrowed_memory(const char* /*action*/) const {}
  // Raw pointer to slot 0 for native host memory, else nullptr: for reading.
  virtual const std::byte* native_data() const noexcept { return nullptr; }
  // The same memory for writing. A carrier that shares its memory copy-on-write
  // with another (Note [Shared snapshots] in native.cpp) first takes a private
  // copy, so engine code writes only through this pointer, never through
  // native_data(). Obtain it before reading for an in-place update.
  virtual std::byte* mutable_native_data() { return nullptr; }
  // Shares ownership of the memory behind native_data(): a zero-copy export holds it so that
  // release() (or a move consuming the carrier) cannot free memory under the export.
  // See Note [Exports outlive release].
  virtual std::shared_ptr<const void> native_owner() const noexcept { return nullptr; }
  // One element without conversion checks (already-converted value).
  virtual Value read_value(int64_t slot) const;
  virtual void write_value(int64_t slot, const Value& value);
  // Makes every completed write durable: fsync of a file or device (RuntimeError naming the call, the file and the
  // errno on failure). Memory has nothing to make durable.
  virtual void flush() {}

  // -------- allocation
  virtual bool supports_storage_dtype(const DType& dtype) const;
  // Whether an empty carrier of this kind can grow to a requested size.
  virtual bool can_grow() const { return provider_ != nullptr; }
  // A released carrier is never allocatable (growing it would revive its storage).
  bool is_allocatable() const { return !is_released() && size() == 0 && can_grow(); }
  // Grows an allocatable carrier to `slots` zero-filled slots (content
  // unspecified when `zero` is false).
  virtual void grow(int64_t slots, bool zero);
  // A fresh carrier of the same kind.
  virtual CarrierPtr allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const;
  CarrierPtr new_like(std::span<const Value> values, bool is_mutable, const DType& dtype) const;

  StorageProvider* provider() const noexcept { return provider_.get(); }
  // Whether element-by-element transfer through read_value/write_value is allowed.
  virtual bool allows_elementwise_fallback() const { return provider_ ? provider_->elementwise_fallback : true; }

  // Opaque per-carrier slot for the language binding (never dereferenced here).
  std::atomic<void*>& binding_slot() noexcept { return binding_slot_; }

 protected:
  // For shipped kinds.
  Carrier(const CarrierKind* kind, const DType& dtype, bool is_mutable);
  virtual void do_release() {}
  // Called by release() before anything changes; throws to refuse (incomplete work).
  virtual void check_releasable() const {}
  void check_dtype_supported(const DType& dtype) const;

 private:
  const CarrierKind* kind_;
  const DType* dtype_;
  bool mutable_;
  std::atomic<uint64_t> version_{0};
  std::atomic<int> claims_{0};
  std::atomic<bool> released_{false};
  // Serialises release with claims; guards owners_. A striped lock, held across fork() (Note [Fork safety]).
  std::mutex& state_mutex_ = detail::carrier_state_lock(this);
  std::vector<std::string> owners_;
  std::shared_ptr<StorageProvider> provider_;
  bool provider_released_ = false;
  std::atomic<void*> binding_slot_{nullptr};
  void free_storage();  // provider release + do_release, after released_ is set
};

// Base of carriers that compose other carriers (Evictable, TiledEvictable):
// they claim their tiers for their lifetime and release them with themselves.
class DependentCarrier : public Carrier {
 protected:
  using Carrier::Carrier;
};

// Element size in bytes of a storage dtype (Bool is one byte).
inline size_t slot_bytes(const DType& d) { return d.itemsize(); }

// Writes `value` (already converted for `dtype`) into raw element memory.
void store_value(const DType& dtype, void* dst, const Value& value);
Value load_value(const DType& dtype, const void* src);

}  // namespace sw
