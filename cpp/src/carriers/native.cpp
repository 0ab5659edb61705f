#include "strideweave/carriers/native.hpp"

#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <mutex>
#include <optional>
#include <string>
#include <new>
#include <thread>
#include <utility>
#include <vector>

#include "strideweave/errors.hpp"
#include "strideweave/fork.hpp"
#include "strideweave/io.hpp"

namespace sw {

namespace {
constexpr size_t kMapThreshold = size_t{1} << 20;
constexpr size_t kHugePage = size_t{2} << 20;
constexpr size_t kMaxDefaultMappingCacheLimit = size_t{1} << 30;  // Note [Mapping cache]
constexpr std::chrono::milliseconds kDefaultMappingCacheDecay{2000};

void check_slots(const char* kind, int64_t slots) {
  if (slots < 0) raise<ValueError>(kind, " size must be >= 0, got ", slots);
  if (slots > (int64_t{1} << 40)) raise<ValueError>(kind, " size ", slots, " is too large");
}

void check_storage_dtype(const char* kind, const DType& dtype) {
  if (!dtype.is_storage()) raise<TypeError>(kind, ": ", dtype.name(), " is not a storage dtype");
}

class MappingCache;
MappingCache& mapping_cache();

// The number in a cgroup file ("max", a missing file or anything else: none).
std::optional<size_t> cgroup_number(const std::string& path, const std::string& key = {}) {
  std::ifstream f(path);
  std::string word;
  if (key.empty()) {
    if (f >> word && !word.empty() && std::all_of(word.begin(), word.end(), [](char c) { return c >= '0' && c <= '9'; }))
      return static_cast<size_t>(std::stoull(word));
    return std::nullopt;
  }
  for (std::string line; std::getline(f, line);)
    if (line.size() > key.size() && line.compare(0, key.size(), key) == 0 && line[key.size()] == ' ')
      return static_cast<size_t>(std::stoull(line.substr(key.size() + 1)));
  return std::nullopt;
}

}  // namespace

// The memory this process may use: the machine's, or less where a memory cgroup limits it (cgroup v2: the
// smallest memory.max of its cgroup and its ancestors; v1: the memory controller's hierarchical limit).
size_t memory_available_to_process() noexcept {
  const long pages = sysconf(_SC_PHYS_PAGES), page = sysconf(_SC_PAGESIZE);
  size_t total = pages > 0 && page > 0 ? static_cast<size_t>(pages) * static_cast<size_t>(page) : SIZE_MAX;
  try {
    std::ifstream f("/proc/self/cgroup");
    for (std::string line; std::getline(f, line);) {
      const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
      if (b == std::string::npos) continue;
      // (std::string::append throughout: GCC 12 warns falsely (-Wrestrict) on operator+ chains.)
      std::string controllers(",");
      controllers.append(line, a + 1, b - a - 1).append(",");
      const std::string path = line.substr(b + 1);
      if (line.compare(0, a, "0") == 0 && controllers == ",,") {  // cgroup v2
        for (std::string p = path; !p.empty(); p = p == "/" ? "" : p.substr(0, std::max<size_t>(1, p.rfind('/')))) {
          std::string file("/sys/fs/cgroup");
          file.append(p == "/" ? "" : p).append("/memory.max");
          if (auto limit = cgroup_number(file)) total = std::min(total, *limit);
        }
      } else if (controllers.find(",memory,") != std::string::npos) {  // cgroup v1
        std::string file("/sys/fs/cgroup/memory");
        file.append(path == "/" ? "" : path).append("/memory.stat");
        if (auto limit = cgroup_number(file, "hierarchical_memory_limit")) total = std::min(total, *limit);
      }
    }
  } catch (...) {  // unreadable or malformed: the machine's memory
  }
  return total;
}

namespace {

// 1 GiB, or a sixteenth of the memory available to the process where that is less.
size_t default_mapping_cache_limit() {
  const size_t available = memory_available_to_process();
  if (available == SIZE_MAX) return kMaxDefaultMappingCacheLimit;
  return std::min(kMaxDefaultMappingCacheLimit, available / 16);
}

// Note [Mapping cache]: a fresh huge-page mapping pays a page fault on first
// touch, and that fault zeroes the whole 2 MiB page (twice the bytes of a 1 MiB
// tile). Residency churn (promote after evict), projections and op results
// allocate and free same-sized large buffers over and over; measured on
// promoting 1 MiB tiles from a page-cached file, the kernel's zeroing took
// more time than the read itself. Freed mappings are therefore kept, most
// recently freed last. An allocation of the same mapped length takes the most
// recently freed one (already faulted in) and zeroes it only when asked to.
//
// On a virtual machine the cost of giving memory back is larger still. A guest
// kernel with free page reporting (virtio-balloon; Firecracker and many clouds
// turn it on) tells the host about free blocks a moment after they are freed,
// and the host takes them back; the next fault on such a page waits for the
// host to supply and zero it again. Measured on a 2-vCPU AMD EPYC guest:
// touching 512 MiB of fresh huge pages took 23-33 ms when the memory had been
// unmapped just before (and 0.5 s ago), 450-770 ms when it had been free for
// 1 s or more (about 2 ms a 2 MiB page), slower than reading the same bytes
// from disk with O_DIRECT. In bench/overlap.py that showed as one repetition in
// four taking 3-4x as long (0.45 extra CPU-s, the same 224 huge-page faults).
//
// So the cache is as large as one round of residency churn is likely to be
// (1 GiB, or a sixteenth of the machine's memory where that is less;
// set_mapping_cache_limit changes it), and it gives memory back by age, as
// jemalloc's decay does: a mapping freed more than the decay time ago (2 s
// unless set_mapping_cache_decay says otherwise) is unmapped by a small
// trimming thread ("sw-trim", started when the cache first keeps something),
// so a process that stops churning returns the memory within seconds. The
// oldest are also unmapped first whenever a new one would pass the limit.
// Like glibc's heap, the process keeps that much freed memory resident for
// reuse; the kept bytes count toward its resident memory.
//
// Note [Parking the trimmer]: the trimmer sleeps until the oldest kept mapping
// is due. With nothing kept it used to sleep with no deadline, so every
// mapping kept into an empty cache had to wake it, and in steady churn (one
// projection's 1 MiB result taken from the cache and given back, over and
// over) the cache is empty before every give. Each give then paid a futex
// wake-up of the trimmer, which on a virtual machine is an interrupt to
// another CPU: measured on the 2-vCPU AMD EPYC of docs/performance.md,
// pthread_cond_signal took 15% of a loop of two-expert projections, 40% as
// much as their copying. So an empty cache first makes the trimmer look again
// one decay time later; only if it is still empty then (the process stopped
// churning) does it park, and only a give to a parked trimmer wakes it. A
// churning process wakes the trimmer about once per decay time, and no kept
// mapping outlives its decay by more than the trimmer's wake-up.
class MappingCache {
 public:
  using Clock = std::chrono::steady_clock;

  MappingCache() {
    // fork() copies the cache with its lock in whatever state another thread left it; holding the lock across
    // fork() gives the child an unlocked, consistent cache (and no trimmer: start_trimmer starts its own).
    // Taken last (Note [Fork safety]): a thread holding a tile table may be allocating from the cache.
    // The trimmer waits on wake_ in the parent: the child makes it afresh.
    on_fork(
        ForkLevel::MappingCache, [] { mapping_cache().mutex_.lock(); }, [] { mapping_cache().mutex_.unlock(); },
        [] {
          new (&mapping_cache().wake_) std::condition_variable();
          mapping_cache().parked_ = false;
          mapping_cache().mutex_.unlock();
        });
  }

  // A cached mapping of exactly `len` bytes, or null.
  std::byte* take(size_t len) noexcept {
    std::lock_guard lock(mutex_);
    for (size_t i = free_.size(); i-- > 0;) {
      if (free_[i].len != len) continue;
      std::byte* p = free_[i].p;
      free_.erase(free_.begin() + static_cast<std::ptrdiff_t>(i));
      bytes_ -= len;
      return p;
    }
    return nullptr;
  }
  // Keeps a freed mapping (or unmaps it when it alone exceeds the limit).
  void give(std::byte* p, size_t len) noexcept {
    std::vector<Entry> drop;
    bool kept = false;
    {
      std::lock_guard lock(mutex_);
      if (len <= limit_) {
        trim(limit_ - len, drop);
        try {
          free_.push_back(Entry{p, len, Clock::now()});
          bytes_ += len;
          kept = true;
        } catch (...) {  // no memory for the list: unmap it below
        }
      }
      if (kept) {
        if (!start_trimmer()) expire(Clock::now() + decay_, drop);  // no thread: keep nothing
        else if (parked_) {  // the trimmer sleeps with no deadline: woken once, not by every give until it runs
          parked_ = false;
          ++signals_;
          wake_.notify_one();
        }
      }
    }
    if (!kept) munmap(p, len);
    unmap(drop);
  }
  size_t set_limit(size_t limit) {
    std::vector<Entry> drop;
    size_t old;
    {
      std::lock_guard lock(mutex_);
      old = limit_;
      limit_ = limit;
      trim(limit, drop);
    }
    unmap(drop);
    return old;
  }
  Clock::duration set_decay(Clock::duration decay) {
    std::lock_guard lock(mutex_);
    Clock::duration old = decay_;
    decay_ = decay;
    if (!free_.empty()) start_trimmer();  // a forked child's inherited mappings get a trimmer too
    wake_.notify_one();                   // the trimmer recomputes its deadline
    return old;
  }
  size_t trim_freed_before(Clock::time_point now) {
    std::vector<Entry> drop;
    {
      std::lock_guard lock(mutex_);
      expire(now, drop);
    }
    unmap(drop);
    size_t n = 0;
    for (const Entry& e : drop) n += e.len;
    return n;
  }
  size_t bytes() {
    std::lock_guard lock(mutex_);
    return bytes_;
  }
  uint64_t signals() {
    std::lock_guard lock(mutex_);
    return signals_;
  }

 private:
  struct Entry {
    std::byte* p;
    size_t len;
    Clock::time_point freed;
  };

  // Under the lock: moves the oldest mappings to `drop` until at most `keep` bytes stay cached.
  void trim(size_t keep, std::vector<Entry>& drop) noexcept {
    size_t n = 0;
    while (bytes_ > keep) bytes_ -= free_[n++].len;
    drop_front(n, drop);
  }
  // Under the lock: when `e` is due to be unmapped (saturating: a decay of years never overflows).
  Clock::time_point expiry(const Entry& e) const noexcept {
    return decay_ > Clock::time_point::max() - e.freed ? Clock::time_point::max() : e.freed + decay_;
  }
  // Under the lock: moves the mappings freed more than the decay time before `now` to `drop`.
  void expire(Clock::time_point now, std::vector<Entry>& drop) noexcept {
    size_t n = 0;
    while (n < free_.size() && expiry(free_[n]) <= now) bytes_ -= free_[n++].len;
    drop_front(n, drop);
  }
  void drop_front(size_t n, std::vector<Entry>& drop) noexcept {
    if (n == 0) return;
    try {
      drop.insert(drop.end(), free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(n));
    } catch (...) {  // no memory for the list: unmap them here
      for (size_t i = 0; i < n; ++i) munmap(free_[i].p, free_[i].len);
    }
    free_.erase(free_.begin(), free_.begin() + static_cast<std::ptrdiff_t>(n));
  }
  static void unmap(const std::vector<Entry>& drop) noexcept {
    for (const Entry& e : drop) munmap(e.p, e.len);
  }

  // Under the lock: makes sure this process has a trimming thread (a forked
  // child has none: it starts its own). False when no thread can be started.
  bool start_trimmer() noexcept {
    const pid_t pid = getpid();
    if (trimmer_pid_ == pid) return true;
    try {
      std::thread([this] { run_trimmer(); }).detach();
    } catch (...) {
      return false;
    }
    trimmer_pid_ = pid;
    return true;
  }
  void run_trimmer() noexcept {
    pthread_setname_np(pthread_self(), "sw-trim");
    std::unique_lock lock(mutex_);
    bool emptied = false;  // the cache was empty at the previous look
    for (;;) {
      if (free_.empty()) {
        // Note [Parking the trimmer]
        if (emptied) {
          parked_ = true;
          wake_.wait(lock);  // until a give (which unparks it), set_decay, or spuriously
          parked_ = false;
          emptied = false;
        } else {
          emptied = true;
          const Clock::time_point now = Clock::now();
          wake_.wait_until(lock, decay_ > Clock::time_point::max() - now ? Clock::time_point::max() : now + decay_);
        }
        continue;
      }
      emptied = false;
      const Clock::time_point due = expiry(free_.front());
      if (Clock::now() < due) {
        wake_.wait_until(lock, due);
        continue;
      }
      std::vector<Entry> drop;
      expire(Clock::now(), drop);
      lock.unlock();
      unmap(drop);
      lock.lock();
    }
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  std::vector<Entry> free_;  // in the order they were freed: the oldest first
  size_t bytes_ = 0;
  size_t limit_ = default_mapping_cache_limit();
  Clock::duration decay_ = kDefaultMappingCacheDecay;
  pid_t trimmer_pid_ = 0;
  bool parked_ = false;  // the trimmer waits with no deadline: the next kept mapping must wake it
  uint64_t signals_ = 0;  // gives that woke the trimmer
};

MappingCache& mapping_cache() {
  static MappingCache* c = new MappingCache();  // never destroyed: buffers may be freed during static destruction
  return *c;
}

}  // namespace

size_t set_mapping_cache_limit(size_t bytes) { return mapping_cache().set_limit(bytes); }
size_t mapping_cache_bytes() { return mapping_cache().bytes(); }
uint64_t mapping_cache_trimmer_signals() { return mapping_cache().signals(); }
std::chrono::steady_clock::duration set_mapping_cache_decay(std::chrono::steady_clock::duration decay) {
  return mapping_cache().set_decay(decay);
}
size_t trim_mapping_cache(std::chrono::steady_clock::time_point now) { return mapping_cache().trim_freed_before(now); }

// ---------------------------------------------------------------- AlignedBuffer

namespace {
[[noreturn]] void allocation_failed(size_t bytes, const char* what, int error) {
  raise<MemoryError>("allocating ", bytes, " bytes for ", what, " failed: ", std::strerror(error));
}
}  // namespace

AlignedBuffer::AlignedBuffer(size_t bytes, bool zero, const char* what) : bytes_(bytes) {
  if (bytes == 0) return;
  if (bytes >= kMapThreshold) {
    // Anonymous mappings are zero-filled by the kernel; huge pages make first touch cheap.
    // Only buffers of at least one huge page use them: rounding a 1 MiB tile up to a
    // 2 MiB page would double the memory a resident tile holds.
    const bool huge = bytes >= kHugePage;
    const size_t page = huge ? kHugePage : size_t{4096};
    size_t len = (bytes + page - 1) / page * page;
    if (std::byte* cached = mapping_cache().take(len)) {  // Note [Mapping cache]
      if (zero) std::memset(cached, 0, len);
      data_ = cached;
      bytes_ = len;
      mapped_ = true;
      return;
    }
    const size_t slack = huge ? kHugePage : 0;
    void* p = mmap(nullptr, len + slack, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p == MAP_FAILED) allocation_failed(bytes, what, errno);
    auto base = reinterpret_cast<uintptr_t>(p);
    uintptr_t aligned = huge ? (base + kHugePage - 1) & ~(kHugePage - 1) : base;
    if (aligned > base) munmap(p, aligned - base);
    size_t tail = (base + len + slack) - (aligned + len);
    if (tail) munmap(reinterpret_cast<void*>(aligned + len), tail);
    if (huge) madvise(reinterpret_cast<void*>(aligned), len, MADV_HUGEPAGE);
    data_ = reinterpret_cast<std::byte*>(aligned);
    bytes_ = len;
    mapped_ = true;
    return;
  }
  size_t len = (bytes + 63) / 64 * 64;
  data_ = static_cast<std::byte*>(std::aligned_alloc(64, len));
  if (!data_) allocation_failed(bytes, what, ENOMEM);
  if (zero) std::memset(data_, 0, len);
}

AlignedBuffer::~AlignedBuffer() { reset(); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& o) noexcept
    : data_(o.data_),
      bytes_(o.bytes_),
      mapped_(o.mapped_),
      owner_(std::move(o.owner_)),
      file_map_(std::exchange(o.file_map_, nullptr)),
      file_map_bytes_(std::exchange(o.file_map_bytes_, 0)) {
  o.data_ = nullptr;
  o.bytes_ = 0;
}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& o) noexcept {
  if (this != &o) {
    reset();
    data_ = o.data_;
    bytes_ = o.bytes_;
    mapped_ = o.mapped_;
    owner_ = std::move(o.owner_);
    file_map_ = std::exchange(o.file_map_, nullptr);
    file_map_bytes_ = std::exchange(o.file_map_bytes_, 0);
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void AlignedBuffer::reset() noexcept {
  if (!data_) return;
  if (owner_) owner_.reset();  // borrowed: Note [Borrowed memory]
  else if (file_map_) ::munmap(std::exchange(file_map_, nullptr), std::exchange(file_map_bytes_, 0));
  else if (mapped_) mapping_cache().give(data_, bytes_);
  else std::free(data_);
  data_ = nullptr;
  bytes_ = 0;
}

// ---------------------------------------------------------------- copy_slots

void copy_slots(const Carrier& src, int64_t src_start, Carrier& dst, int64_t dst_start, int64_t count) {
  if (count <= 0) return;
  const size_t w = slot_bytes(src.dtype());
  if (const std::byte* s = src.native_data()) {
    dst.write_slots(dst_start, count, s + static_cast<size_t>(src_start) * w);
    return;
  }
  if (std::byte* d = dst.mutable_native_data()) {
    src.read_slots(src_start, count, d + static_cast<size_t>(dst_start) * w);
    return;
  }
  constexpr int64_t kChunkBytes = int64_t{8} << 20;
  const int64_t chunk = std::max<int64_t>(1, kChunkBytes / static_cast<int64_t>(w));
  AlignedBuffer bounce(static_cast<size_t>(std::min(chunk, count)) * w, false);
  for (int64_t done = 0; done < count; done += chunk) {
    int64_t n = std::min(chunk, count - done);
    src.read_slots(src_start + done, n, bounce.data());
    dst.write_slots(dst_start + done, n, bounce.data());
  }
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
  assign_zeros(slots);
}

void GenericCarrier::assign_zeros(int64_t slots) {
  try {
    values_.assign(static_cast<size_t>(slots), zero());
  } catch (const std::bad_alloc&) {
    allocation_failed(static_cast<size_t>(slots) * sizeof(Value), "a Generic carrier", ENOMEM);
  }
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
  assign_zeros(slots);
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
  buffer_ = std::make_shared<AlignedBuffer>(static_cast<size_t>(slots) * slot_bytes(dtype), !empty, "a CPU carrier");
}

CPUCarrier::CPUCarrier(ShareTag, const CPUCarrier& source, std::shared_ptr<AlignedBuffer> buffer)
    : Carrier(&cpu_kind(), source.dtype(), /*is_mutable=*/true), slots_(source.slots_), buffer_(std::move(buffer)) {}

CPUCarrier::~CPUCarrier() { buffer_->holders.fetch_sub(1, std::memory_order_acq_rel); }

// Note [Shared snapshots]: a projection of one resident tile whose buffer
// already holds the compact tensor's values in its dense order (one expert of
// an expert-last MoE weight) need not copy them: share_snapshot() returns a new
// CPU carrier over the same AlignedBuffer, and the buffer counts the carriers
// holding it (`holders`). Reads go through native_data() and read_slots as
// usual. Every write goes through write_slots, write_value or
// mutable_native_data(), and each first calls unshare(): while another carrier
// holds the buffer, the writer copies it into a private one and gives up its
// hold, so the other side never sees the write. Whichever side writes first
// pays the copy the projection saved; a side that is alone again writes in
// place. The tile may be evicted meanwhile: the buffer then lives on in the
// snapshot alone, as a copy would have.
//
// Exports break the bookkeeping: a NumPy view holds native_owner() and writes
// without asking. So share_snapshot() refuses a buffer that anything but
// carriers holds (its shared_ptr use count exceeds `holders`), and exporting a
// shared carrier as a writable view unshares it first (mutable_native_data()).
// A writer unshares before it reads the values it will overwrite, so the old
// buffer is never read after its last other holder has let go of it.
std::shared_ptr<CPUCarrier> CPUCarrier::share_snapshot() const {
  if (is_released() || slots_ == 0 || buffer_->is_borrowed()) return nullptr;
  std::shared_ptr<AlignedBuffer> b = buffer_;  // one more use: ours
  if (b.use_count() != static_cast<long>(b->holders.load(std::memory_order_acquire)) + 1) return nullptr;
  b->holders.fetch_add(1, std::memory_order_acq_rel);
  return std::shared_ptr<CPUCarrier>(new CPUCarrier(ShareTag{}, *this, std::move(b)));
}

void CPUCarrier::set_buffer(std::shared_ptr<AlignedBuffer> buffer) noexcept {
  std::shared_ptr<AlignedBuffer> old = std::exchange(buffer_, std::move(buffer));
  old->holders.fetch_sub(1, std::memory_order_acq_rel);
}

void CPUCarrier::unshare() {
  if (buffer_->holders.load(std::memory_order_acquire) <= 1) return;
  auto fresh = std::make_shared<AlignedBuffer>(buffer_->bytes(), false, "a private copy of shared CPU memory");
  if (buffer_->bytes()) std::memcpy(fresh->data(), buffer_->data(), buffer_->bytes());
  set_buffer(std::move(fresh));
}

std::byte* CPUCarrier::mutable_native_data() {
  unshare();
  return buffer_->data();
}

void CPUCarrier::read_slots(int64_t start, int64_t count, void* out) const {
  if (count <= 0) return;  // an empty carrier's buffer is null: memcpy must not see it
  std::memcpy(out, buffer_->data() + static_cast<size_t>(start) * slot_bytes(dtype()),
              static_cast<size_t>(count) * slot_bytes(dtype()));
}

void CPUCarrier::write_slots(int64_t start, int64_t count, const void* in) {
  if (count <= 0) return;
  std::memcpy(mutable_native_data() + static_cast<size_t>(start) * slot_bytes(dtype()), in,
              static_cast<size_t>(count) * slot_bytes(dtype()));
}

Value CPUCarrier::read_value(int64_t slot) const {
  return load_value(dtype(), buffer_->data() + static_cast<size_t>(slot) * slot_bytes(dtype()));
}

void CPUCarrier::write_value(int64_t slot, const Value& v) {
  store_value(dtype(), mutable_native_data() + static_cast<size_t>(slot) * slot_bytes(dtype()), v);
}

void CPUCarrier::grow(int64_t slots, bool zero) {
  check_slots("CPU", slots);
  if (slots_ != 0) raise<ValueError>("CPU carrier is not allocatable (size ", slots_, " != 0)");
  set_buffer(std::make_shared<AlignedBuffer>(static_cast<size_t>(slots) * slot_bytes(dtype()), zero, "a CPU carrier"));
  slots_ = slots;
}

CarrierPtr CPUCarrier::allocate_like(int64_t slots, bool is_mutable, const DType& dtype, bool empty) const {
  return std::make_shared<CPUCarrier>(slots, dtype, is_mutable, empty);
}

// Drops the carrier's share of the memory; an export still holding native_owner() keeps it
// until the export is gone (see Note [Exports outlive release]).
void CPUCarrier::do_release() { set_buffer(std::make_shared<AlignedBuffer>()); }

// ---------------------------------------------------------------- borrowed memory

// Note [Borrowed memory]: a DLPack import (sw.from_dlpack, docs/guide.md "Carriers") makes a CPU carrier over
// memory another library owns, without copying it. The AlignedBuffer then holds the memory's owner (for the
// bindings, the consumed capsule, which keeps the producer alive) instead of owning the bytes: dropping the last
// hold on the buffer drops the owner, and nothing is freed here. The carrier and its own exports hold that buffer
// like any other (Note [Exports outlive release] in carrier.hpp), so the owner outlives them all. The producer
// may write the memory at any time, as an export may, so a borrowed buffer is never shared copy-on-write
// (share_snapshot() refuses it). Writes and grow() behave as for owned memory; a released carrier drops its hold.
//
// Holding the owner keeps the memory alive only while the owner does not move it. A PyTorch tensor's storage is
// held by the capsule, yet torch frees its bytes in place when it is resized (x.resize_ past its size,
// x.untyped_storage().resize_): the storage object lives on over new memory, and the borrowed pointer dangles.
// DLPack has no way to forbid that, so such an import carries a BorrowedMemoryCheck (the bindings': the storage's
// data pointer and size against those imported), which check_live() runs through check_borrowed_memory() before
// every use (an operation, an element read or write, an export, a save): a moved storage fails the use with
// RuntimeError naming it, and nothing reads the freed bytes. What the check cannot see is a move while a use is
// under way on another thread, or through an export (a NumPy or torch view of the carrier) taken before the
// move: docs/guide.md ("PyTorch") says what is safe.
std::shared_ptr<AlignedBuffer> AlignedBuffer::borrow(std::byte* data, size_t bytes, std::shared_ptr<const void> owner) {
  SW_ASSERT(owner != nullptr, "borrowed memory needs an owner");
  auto b = std::make_shared<AlignedBuffer>();
  b->data_ = data;
  b->bytes_ = bytes;
  b->owner_ = std::move(owner);
  return b;
}

std::shared_ptr<AlignedBuffer> AlignedBuffer::map_file(int fd, uint64_t offset, size_t bytes, uint64_t file_bytes) {
  // The span of whole huge pages around the bytes (within the file's pages), at an address congruent to its file
  // offset modulo a huge page: where the page cache holds the file in huge folios, each one is then mapped with a
  // single page-table entry instead of 512. Note [Promotion by mapping] in carriers/checkpoint.cpp.
  const uint64_t page = static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  const uint64_t file_end = (file_bytes + page - 1) / page * page;
  const uint64_t start = offset / kHugePage * kHugePage;
  const uint64_t end = std::min<uint64_t>((offset + bytes + kHugePage - 1) / kHugePage * kHugePage, file_end);
  if (offset + bytes > end) return nullptr;
  const size_t len = static_cast<size_t>(end - start);
  void* area = ::mmap(nullptr, len + kHugePage, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (area == MAP_FAILED) return nullptr;
  const auto base = reinterpret_cast<uintptr_t>(area);
  const uintptr_t at = (base + kHugePage - 1) & ~(kHugePage - 1);  // start is a multiple of a huge page
  if (at > base) ::munmap(area, at - base);
  if (const uintptr_t tail = base + len + kHugePage - (at + len)) ::munmap(reinterpret_cast<void*>(at + len), tail);
  void* p = ::mmap(reinterpret_cast<void*>(at), len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_FIXED, fd,
                   static_cast<off_t>(start));
  if (p == MAP_FAILED) {
    ::munmap(reinterpret_cast<void*>(at), len);
    return nullptr;
  }
  // Populated by reading one byte of each page: a read fault maps the page cache's pages around it (the
  // kernel's fault-around, or a whole huge folio) without copying. MAP_POPULATE would take the slow path one
  // page at a time, and on a writable private mapping copy every page (measured: 3.3 ms for 16 tiles of 2 MiB
  // against 0.9 ms touched, and 1.4 ms read).
  // Pages not in the page cache would be read a fault's read-around window at a time; asked for at once, the
  // kernel reads the whole range ahead, as one read would. A cached tile skips this: cachestat(2) says so in one
  // walk of the file's cache (by folio); where the kernel lacks it, mincore(2) (one lookup per page: measured,
  // those lookups were about a sixth of a cached 16-tile promotion's time).
  {
    auto* lo = static_cast<std::byte*>(p) + (offset - start) / page * page;
    const size_t span = static_cast<size_t>(static_cast<std::byte*>(p) + (offset - start) + bytes - lo);
    std::optional<bool> cached = io::fully_cached(fd, bytes, static_cast<int64_t>(offset));
    if (!cached) {
      thread_local std::vector<unsigned char> in_core;
      in_core.resize((span + page - 1) / page);
      cached = ::mincore(lo, span, in_core.data()) == 0 &&
               std::all_of(in_core.begin(), in_core.end(), [](unsigned char c) { return (c & 1) != 0; });
    }
    if (!*cached) ::madvise(lo, span, MADV_WILLNEED);
  }
  const auto* first = static_cast<const volatile std::byte*>(p) + (offset - start);
  for (size_t at_byte = 0; at_byte < bytes; at_byte += static_cast<size_t>(page)) (void)first[at_byte];
  if (bytes) (void)first[bytes - 1];
  auto b = std::make_shared<AlignedBuffer>();
  b->file_map_ = p;
  b->file_map_bytes_ = len;
  b->data_ = static_cast<std::byte*>(p) + (offset - start);
  b->bytes_ = bytes;
  return b;
}

CPUCarrier::CPUCarrier(std::shared_ptr<AlignedBuffer> buffer, int64_t slots, const DType& dtype, bool is_mutable)
    : Carrier(&cpu_kind(), dtype, is_mutable), slots_(slots) {
  check_slots("CPU", slots);
  check_storage_dtype("CPU", dtype);
  SW_ASSERT(buffer && buffer->bytes() >= static_cast<size_t>(slots) * slot_bytes(dtype) &&
                reinterpret_cast<uintptr_t>(buffer->data()) % slot_bytes(dtype) == 0,
            "a CPU carrier's buffer holds its slots, aligned");
  set_buffer(std::move(buffer));
}

CPUCarrier::CPUCarrier(std::byte* data, int64_t slots, const DType& dtype, bool is_mutable,
                       std::shared_ptr<const void> owner, std::shared_ptr<const BorrowedMemoryCheck> moved)
    : Carrier(&cpu_kind(), dtype, is_mutable), slots_(slots), moved_(std::move(moved)) {
  check_slots("CPU", slots);
  check_storage_dtype("CPU", dtype);
  const size_t w = slot_bytes(dtype);
  if (reinterpret_cast<uintptr_t>(data) % w != 0)
    raise<ValueError>("CPU carrier over borrowed memory: address ", static_cast<const void*>(data),
                      " is not aligned to the ", w, "-byte elements of ", dtype.name());
  set_buffer(AlignedBuffer::borrow(data, static_cast<size_t>(slots) * w, std::move(owner)));
}

}  // namespace sw
