#include "strideweave/carrier.hpp"

#include <algorithm>
#include <cstring>

#include "strideweave/errors.hpp"

namespace sw {

void store_value(const DType& dtype, void* dst, const Value& v) {
  switch (dtype.id()) {
    case DTypeId::Float32: {
      float f = static_cast<float>(v.kind == Value::Kind::Int ? static_cast<double>(v.i) : v.f);
      std::memcpy(dst, &f, sizeof f);
      return;
    }
    case DTypeId::Int32: {
      int32_t i = static_cast<int32_t>(v.i);
      std::memcpy(dst, &i, sizeof i);
      return;
    }
    case DTypeId::Bool: {
      uint8_t b = v.b ? 1 : 0;
      std::memcpy(dst, &b, 1);
      return;
    }
    case DTypeId::Float64: {
      double d = v.kind == Value::Kind::Int ? static_cast<double>(v.i) : v.f;
      std::memcpy(dst, &d, sizeof d);
      return;
    }
    case DTypeId::BFloat16:
    case DTypeId::Float16: {  // rounds the double directly (Note [16-bit floats])
      const double d = v.kind == Value::Kind::Int ? static_cast<double>(v.i) : v.f;
      const uint16_t h = dtype.id() == DTypeId::BFloat16 ? detail::double_to_bf16_bits(d) : detail::double_to_f16_bits(d);
      std::memcpy(dst, &h, sizeof h);
      return;
    }
  }
}

Value load_value(const DType& dtype, const void* src) {
  switch (dtype.id()) {
    case DTypeId::Float32: {
      float f;
      std::memcpy(&f, src, sizeof f);
      return Value::from_float(f);
    }
    case DTypeId::Int32: {
      int32_t i;
      std::memcpy(&i, src, sizeof i);
      return Value::from_int(i);
    }
    case DTypeId::Bool: {
      uint8_t b;
      std::memcpy(&b, src, 1);
      return Value::from_bool(b != 0);
    }
    case DTypeId::Float64: {
      double d;
      std::memcpy(&d, src, sizeof d);
      return Value::from_float(d);
    }
    case DTypeId::BFloat16:
    case DTypeId::Float16: {  // the exact value, as a double
      uint16_t h;
      std::memcpy(&h, src, sizeof h);
      return Value::from_float(dtype.id() == DTypeId::BFloat16 ? double(bfloat16::from_bits(h)) : double(float16::from_bits(h)));
    }
  }
  return {};
}

Carrier::Carrier(const CarrierKind* kind, const DType& dtype, bool is_mutable)
    : kind_(kind), dtype_(&dtype), mutable_(is_mutable) {}

Carrier::Carrier(const CarrierKind* kind, std::shared_ptr<StorageProvider> provider, const DType& dtype,
                 bool is_mutable)
    : kind_(kind), dtype_(&dtype), mutable_(is_mutable), provider_(std::move(provider)) {
  SW_ASSERT(provider_, "a definition carrier needs a provider");
}

void Carrier::allocate_storage(int64_t slots) {
  if (slots < 0) raise<ValueError>(kind_->name, " size must be >= 0, got ", slots);
  if (!dtype().is_storage()) raise<TypeError>(kind_->name, ": ", dtype().name(), " is not a storage dtype");
  if (!provider_->supports_dtype(*this, dtype()))
    raise<TypeError>(kind_->name, " does not store ", dtype().name(), " (its provider's supports_dtype refused it)");
  provider_->allocate(*this, slots);
}

Carrier::~Carrier() = default;

int64_t Carrier::size() const {
  if (provider_) return is_released() ? 0 : provider_->physical_size(*this);
  return 0;
}

void Carrier::release() {
  if (!is_released()) check_releasable();
  {
    std::lock_guard lock(state_mutex_);
    if (released_.load()) return;
    if (claims_.load() > 0)
      raise<RuntimeError>(kind_name(), " carrier is owned by ", owners_.empty() ? "a request" : owners_.back(),
                          "; it cannot be released until that work is terminal (wait for it)");
    released_.store(true, std::memory_order_release);
  }
  free_storage();
}

void Carrier::release_claimed(Claim& claim) {
  SW_ASSERT(claim.carrier_.get() == this, "release_claimed needs a claim on this carrier");
  CarrierPtr keep = std::move(claim.carrier_);  // the claim ends here, under the lock below
  {
    std::lock_guard lock(state_mutex_);
    if (!owners_.empty()) owners_.pop_back();
    claims_.fetch_sub(1, std::memory_order_acq_rel);
    if (released_.load()) return;
    if (claims_.load() > 0)
      raise<RuntimeError>(kind_name(), " carrier is owned by ", owners_.empty() ? "a request" : owners_.back(),
                          "; it cannot be released until that work is terminal (wait for it)");
    released_.store(true, std::memory_order_release);
  }
  free_storage();
}

void Carrier::free_storage() {
  if (provider_ && !provider_released_) {
    provider_released_ = true;
    provider_->release(*this);
  }
  do_release();
}

Carrier::Claim& Carrier::Claim::operator=(Claim&& o) noexcept {
  if (this != &o) {
    end();
    carrier_ = std::move(o.carrier_);
  }
  return *this;
}

void Carrier::Claim::end() noexcept {
  if (!carrier_) return;
  {
    std::lock_guard lock(carrier_->state_mutex_);
    if (!carrier_->owners_.empty()) carrier_->owners_.pop_back();
    carrier_->claims_.fetch_sub(1, std::memory_order_acq_rel);
  }
  carrier_.reset();
}

Carrier::Claim Carrier::claim(std::string owner) {
  std::lock_guard lock(state_mutex_);
  if (released_.load()) raise<RuntimeError>(kind_name(), " carrier is released; it cannot be used by ", owner);
  owners_.push_back(std::move(owner));
  claims_.fetch_add(1, std::memory_order_acq_rel);
  return Claim(shared_from_this());
}

std::string Carrier::owner_description() const {
  std::lock_guard lock(state_mutex_);
  return owners_.empty() ? std::string() : owners_.back();
}

void Carrier::check_live(const char* action) const {
  if (is_released()) raise<RuntimeError>(kind_name(), " carrier is released; cannot ", action);
  check_borrowed_memory(action);
}

namespace {
thread_local const Carrier* t_transfer_destination = nullptr;  // Carrier::TransferWrites
}  // namespace

Carrier::TransferWrites::TransferWrites(const Carrier& c) noexcept : previous_(t_transfer_destination) {
  t_transfer_destination = &c;
}
Carrier::TransferWrites::~TransferWrites() { t_transfer_destination = previous_; }

void Carrier::check_writable(const char* action) const {
  check_live(action);
  if (!mutable_) raise<RuntimeError>(kind_name(), " carrier is not publicly mutable (created immutable); cannot ", action);
  if (is_owned() && t_transfer_destination != this) {
    std::string owner = owner_description();
    raise<RuntimeError>(kind_name(), " carrier is owned by ", owner.empty() ? "a request" : owner,
                        " and is not publicly mutable; cannot ", action, " until that work is terminal");
  }
}

void Carrier::check_index(int64_t slot) const {
  int64_t n = size();
  if (slot < 0 || slot >= n) {
    // A release on another thread between the caller's liveness check and here makes the size 0: that is a
    // released carrier, not a bad index.
    if (is_released()) raise<RuntimeError>(kind_name(), " carrier is released; cannot access slot ", slot);
    raise<IndexError>("slot ", slot, " is out of range for ", kind_name(), " carrier of size ", n);
  }
}

Value Carrier::get(int64_t slot) const {
  check_live("read");
  check_index(slot);
  return read_value(slot);
}

void Carrier::set(int64_t slot, const Value& value) {
  check_writable("write");
  check_index(slot);
  Value v = dtype().convert(value);
  check_storage_intact("write to it");  // a named file still at its name (Note [Files changed under a carrier])
  write_value(slot, v);
  bump_version();
}

void Carrier::read_slots(int64_t start, int64_t count, void* out) const {
  auto* bytes = static_cast<std::byte*>(out);
  const size_t w = slot_bytes(dtype());
  for (int64_t k = 0; k < count; ++k) store_value(dtype(), bytes + k * w, read_value(start + k));
}

void Carrier::write_slots(int64_t start, int64_t count, const void* in) {
  auto* bytes = static_cast<const std::byte*>(in);
  const size_t w = slot_bytes(dtype());
  for (int64_t k = 0; k < count; ++k) write_value(start + k, load_value(dtype(), bytes + k * w));
}

Value Carrier::read_value(int64_t slot) const {
  if (provider_) return dtype().convert(provider_->read(*this, slot));
  alignas(8) std::byte buf[8];
  read_slots(slot, 1, buf);
  return load_value(dtype(), buf);
}

void Carrier::write_value(int64_t slot, const Value& value) {
  if (provider_) {
    provider_->write(*this, slot, value);
    return;
  }
  alignas(8) std::byte buf[8];
  store_value(dtype(), buf, value);
  write_slots(slot, 1, buf);
}

bool Carrier::supports_storage_dtype(const DType& dtype) const {
  if (!dtype.is_storage()) return false;
  if (provider_) return provider_->supports_dtype(*this, dtype);
  return true;
}

void Carrier::check_dtype_supported(const DType& dtype) const {
  if (!supports_storage_dtype(dtype)) raise<TypeError>(kind_name(), " does not store ", dtype.name());
}

void Carrier::grow(int64_t slots, bool zero) {
  if (!provider_) raise<NotImplementedError>(kind_name(), " carriers cannot grow");
  if (size() != 0) raise<ValueError>(kind_name(), " carrier is not allocatable (size ", size(), " != 0)");
  provider_->allocate(*this, slots);
}

CarrierPtr Carrier::allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const {
  if (!provider_) raise<NotImplementedError>(kind_name(), " does not implement allocate_like");
  if (slots < 0) raise<ValueError>("allocate_like size must be >= 0, got ", slots);
  return provider_->construct(slots, dtype, is_mutable);
}

CarrierPtr Carrier::new_like(std::span<const Value> values, bool is_mutable, const DType& dtype) const {
  std::vector<Value> converted;
  converted.reserve(values.size());
  for (const auto& v : values) converted.push_back(dtype.convert(v));  // TypeError/OverflowError before allocating
  CarrierPtr c = allocate_like(static_cast<int64_t>(values.size()), is_mutable, dtype, /*empty=*/true);
  // One bulk write: a kind whose fresh empty storage is not writable slot by slot (a TiledEvictable's
  // invalid tiles) initialises whole tiles from it.
  const size_t w = slot_bytes(dtype);
  std::vector<std::byte> bytes(converted.size() * w);
  for (size_t k = 0; k < converted.size(); ++k) store_value(dtype, bytes.data() + k * w, converted[k]);
  if (!converted.empty()) c->write_slots(0, static_cast<int64_t>(converted.size()), bytes.data());
  return c;
}

}  // namespace sw
