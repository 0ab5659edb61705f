#include "strideweave/carriers/native.hpp"

#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <new>

#include "strideweave/errors.hpp"

namespace sw {

namespace {
constexpr size_t kMapThreshold = size_t{1} << 20;
constexpr size_t kHugePage = size_t{2} << 20;

void check_slots(const char* kind, int64_t slots) {
  if (slots < 0) raise<ValueError>(kind, " size must be >= 0, got ", slots);
  if (slots > (int64_t{1} << 40)) raise<ValueError>(kind, " size ", slots, " is too large");
}

void check_storage_dtype(const char* kind, const DType& dtype) {
  if (!dtype.is_storage()) raise<TypeError>(kind, ": ", dtype.name(), " is not a storage dtype");
}
}  // namespace

// ---------------------------------------------------------------- AlignedBuffer

AlignedBuffer::AlignedBuffer(size_t bytes, bool zero) : bytes_(bytes) {
  if (bytes == 0) return;
  if (bytes >= kMapThreshold) {
    // Anonymous mappings are zero-filled by the kernel; huge pages make first touch cheap.
    size_t len = (bytes + kHugePage - 1) / kHugePage * kHugePage;
    void* p = mmap(nullptr, len + kHugePage, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) throw std::bad_alloc();
    auto base = reinterpret_cast<uintptr_t>(p);
    uintptr_t aligned = (base + kHugePage - 1) & ~(kHugePage - 1);
    if (aligned > base) munmap(p, aligned - base);
    size_t tail = (base + len + kHugePage) - (aligned + len);
    if (tail) munmap(reinterpret_cast<void*>(aligned + len), tail);
    madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);
    data_ = reinterpret_cast<std::byte*>(aligned);
    bytes_ = len;
    mapped_ = true;
    return;
  }
  size_t len = (bytes + 63) / 64 * 64;
  data_ = static_cast<std::byte*>(std::aligned_alloc(64, len));
  if (!data_) throw std::bad_alloc();
  if (zero) std::memset(data_, 0, len);
}

AlignedBuffer::~AlignedBuffer() { reset(); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept : data_(o.data_), bytes_(o.bytes_), mapped_(o.mapped_) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = o.data_;
    bytes_ = o.bytes_;
    mapped_ = o.mapped_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void AlignedBuffer::reset() noexcept {
  if (!data_) return;
  if (mapped_) munmap(data_, bytes_);
  else std::free(data_);
  data_ = nullptr;
  bytes_ = 0;
}

// ---------------------------------------------------------------- kinds

const CarrierKind& generic_kind() {
  static const CarrierKind k{"Generic", true, false, false};
  return k;
}
const CarrierKind& cpu_kind() {
  static const CarrierKind k{"CPU", true, false, false};
  return k;
}

// ---------------------------------------------------------------- Generic

GenericCarrier::GenericCarrier(int64_t slots, const DType& dtype, bool is_mutable)
    : Carrier(&generic_kind(), dtype, is_mutable), slots_(slots) {
  check_slots("Generic", slots);
  check_storage_dtype("Generic", dtype);
  values_.assign(static_cast<size_t>(slots), zero());
}

Value GenericCarrier::zero() const {
  switch (dtype().id()) {
    case DTypeId::Int32: return Value::from_int(0);
    case DTypeId::Bool: return Value::from_bool(false);
    default: return Value::from_float(0.0);
  }
}

void GenericCarrier::read_slots(int64_t start, int64_t count, void* out) const {
  auto* bytes = static_cast<std::byte*>(out);
  const size_t w = slot_bytes(dtype());
  for (int64_t k = 0; k < count; ++k) store_value(dtype(), bytes + k * w, values_[static_cast<size_t>(start + k)]);
}

void GenericCarrier::write_slots(int64_t start, int64_t count, const void* in) {
  auto* bytes = static_cast<const std::byte*>(in);
  const size_t w = slot_bytes(dtype());
  for (int64_t k = 0; k < count; ++k) values_[static_cast<size_t>(start + k)] = load_value(dtype(), bytes + k * w);
}

void GenericCarrier::grow(int64_t slots, bool) {
  check_slots("Generic", slots);
  if (slots_ != 0) raise<ValueError>("Generic carrier is not allocatable (size ", slots_, " != 0)");
  values_.assign(static_cast<size_t>(slots), zero());
  slots_ = slots;
}

CarrierPtr GenericCarrier::allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool) const {
  return std::make_shared<GenericCarrier>(slots, dtype, is_mutable);
}

void GenericCarrier::do_release() {
  values_.clear();
  values_.shrink_to_fit();
}

// ---------------------------------------------------------------- CPU

CPUCarrier::CPUCarrier(int64_t slots, const DType& dtype, bool is_mutable, bool empty)
    : Carrier(&cpu_kind(), dtype, is_mutable), slots_(slots) {
  check_slots("CPU", slots);
  check_storage_dtype("CPU", dtype);
  buffer_ = std::make_shared<AlignedBuffer>(static_cast<size_t>(slots) * slot_bytes(dtype), !empty);
}

void CPUCarrier::read_slots(int64_t start, int64_t count, void* out) const {
  if (count <= 0) return;  // an empty carrier's buffer is null: memcpy must not see it
  std::memcpy(out, buffer_->data() + static_cast<size_t>(start) * slot_bytes(dtype()),
              static_cast<size_t>(count) * slot_bytes(dtype()));
}

void CPUCarrier::write_slots(int64_t start, int64_t count, const void* in) {
  if (count <= 0) return;
  std::memcpy(buffer_->data() + static_cast<size_t>(start) * slot_bytes(dtype()), in,
              static_cast<size_t>(count) * slot_bytes(dtype()));
}

Value CPUCarrier::read_value(int64_t slot) const {
  return load_value(dtype(), buffer_->data() + static_cast<size_t>(slot) * slot_bytes(dtype()));
}

void CPUCarrier::write_value(int64_t slot, const Value& v) {
  store_value(dtype(), buffer_->data() + static_cast<size_t>(slot) * slot_bytes(dtype()), v);
}

void CPUCarrier::grow(int64_t slots, bool zero) {
  check_slots("CPU", slots);
  if (slots_ != 0) raise<ValueError>("CPU carrier is not allocatable (size ", slots_, " != 0)");
  buffer_ = std::make_shared<AlignedBuffer>(static_cast<size_t>(slots) * slot_bytes(dtype()), zero);
  slots_ = slots;
}

CarrierPtr CPUCarrier::allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const {
  return std::make_shared<CPUCarrier>(slots, dtype, is_mutable, empty);
}

// Drops the carrier's share of the memory; an export still holding native_owner() keeps it
// until the export is gone (see Note [Exports outlive release]).
void CPUCarrier::do_release() { buffer_ = std::make_shared<AlignedBuffer>(); }

}  // namespace sw
