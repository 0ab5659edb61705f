// DLPack both ways (docs/guide.md, "Carriers", "DLPack"): Tensor.__dlpack__ / __dlpack_device__ export a CPU
// carrier's memory without copying it, and from_dlpack makes a Tensor over a CPU carrier that borrows the
// producer's memory (Note [Borrowed memory] in native.cpp).
//
// The errors follow the Python array API's protocol: what cannot be shared as asked (a carrier without host
// memory, a layout no stride list describes, another device, an immutable tensor for a consumer that cannot be
// told so, a capsule StrideWeave cannot read) is a BufferError; wrong arguments are TypeError or ValueError.
#include <nanobind/stl/shared_ptr.h>

#include <cstdint>
#include <cstring>
#include <iterator>
#include <memory>
#include <string>
#include <vector>

#include "common.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/tensor.hpp"

namespace swpy {

namespace {

using sw::TensorImpl;

// ---------------------------------------------------------------- the C ABI (DLPack 1.0)

struct DLDevice {
  int32_t device_type;
  int32_t device_id;
};
struct DLDataType {
  uint8_t code;
  uint8_t bits;
  uint16_t lanes;
};
struct DLTensor {
  void* data;
  DLDevice device;
  int32_t ndim;
  DLDataType dtype;
  int64_t* shape;
  int64_t* strides;  // in elements; null means compact row-major
  uint64_t byte_offset;
};
struct DLManagedTensor {  // the legacy ("dltensor") capsule
  DLTensor dl_tensor;
  void* manager_ctx;
  void (*deleter)(DLManagedTensor*);
};
struct DLPackVersion {
  uint32_t major;
  uint32_t minor;
};
struct DLManagedTensorVersioned {  // the versioned ("dltensor_versioned") capsule
  DLPackVersion version;
  void* manager_ctx;
  void (*deleter)(DLManagedTensorVersioned*);
  uint64_t flags;
  DLTensor dl_tensor;
};

constexpr uint64_t kFlagReadOnly = 1;
constexpr uint64_t kFlagIsCopied = 2;
constexpr int32_t kDLCPU = 1;
constexpr const char* kLegacyName = "dltensor";
constexpr const char* kVersionedName = "dltensor_versioned";
constexpr const char* kUsedLegacyName = "used_dltensor";
constexpr const char* kUsedVersionedName = "used_dltensor_versioned";

enum DLCode : uint8_t { kDLInt = 0, kDLUInt = 1, kDLFloat = 2, kDLOpaque = 3, kDLBfloat = 4, kDLComplex = 5, kDLBool = 6 };

// The dtypes DLPack carries both ways, one row each, by the name of the StrideWeave dtype: a row whose dtype
// this build does not have is inert (export and import both find nothing for it).
struct DTypeRow {
  const char* name;
  uint8_t code;
  uint8_t bits;
};
constexpr DTypeRow kDTypes[] = {
    {"Float32", kDLFloat, 32}, {"Int32", kDLInt, 32}, {"Bool", kDLBool, 8},
    {"BFloat16", kDLBfloat, 16}, {"Float16", kDLFloat, 16},
};

// The storage dtype of a row, or null.
const sw::DType* dtype_of(const DTypeRow& row) {
  for (const sw::DType* d : sw::DType::registered())
    if (d->is_storage() && d->name() == row.name && static_cast<int>(d->itemsize() * 8) == row.bits) return d;
  return nullptr;
}

// "float64", "uint8", "bfloat16", "int32x4": how the dtype reads in a message.
std::string dl_dtype_name(DLDataType t) {
  static constexpr const char* kCodes[] = {"int", "uint", "float", "opaque handle ", "bfloat", "complex", "bool"};
  std::string s = t.code < std::size(kCodes) ? std::string(kCodes[t.code]) : "code " + std::to_string(t.code) + " ";
  if (t.code != kDLBool || t.bits != 8) s += std::to_string(t.bits);
  if (t.lanes != 1) s += "x" + std::to_string(t.lanes);
  return s;
}

// "CUDA device 0 (DLPack device type 2)".
std::string dl_device_name(int64_t type, int64_t id) {
  static constexpr const char* kTypes[] = {nullptr,    "CPU",      "CUDA",         "CUDAHost", "OpenCL", nullptr,
                                           nullptr,    "Vulkan",   "Metal",        "VPI",      "ROCM",   "ROCMHost",
                                           "ExtDev",   "CUDAManaged", "OneAPI",    "WebGPU",   "Hexagon", "MAIA"};
  const char* name = type >= 0 && type < static_cast<int64_t>(std::size(kTypes)) ? kTypes[type] : nullptr;
  return std::string(name ? name : "unknown") + " device " + std::to_string(id) + " (DLPack device type " +
         std::to_string(type) + ")";
}

[[noreturn]] void buffer_error(const std::string& message) { throw nb::buffer_error(message.c_str()); }

// ---------------------------------------------------------------- export

// What an exported capsule owns: its shape and strides, and a share of the memory (Note [Exports outlive
// release] in carrier.hpp), dropped by the consumer through the deleter.
struct Export {
  DLManagedTensorVersioned versioned{};
  DLManagedTensor legacy{};
  std::shared_ptr<const void> memory;
  std::vector<int64_t> shape, strides;
};

void delete_versioned(DLManagedTensorVersioned* m) { delete static_cast<Export*>(m->manager_ctx); }
void delete_legacy(DLManagedTensor* m) { delete static_cast<Export*>(m->manager_ctx); }

// A capsule dropped before any consumer took it frees its export (a consumer renames it "used_...").
void versioned_capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kVersionedName)) return;
  auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, kVersionedName));
  m->deleter(m);
}
void legacy_capsule_destructor(PyObject* capsule) {
  if (!PyCapsule_IsValid(capsule, kLegacyName)) return;
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, kLegacyName));
  m->deleter(m);
}

// A tuple of two ints (max_version, dl_device).
bool int_pair(nb::handle h) {
  return PyTuple_Check(h.ptr()) && PyTuple_Size(h.ptr()) == 2 && is_index(PyTuple_GET_ITEM(h.ptr(), 0)) &&
         is_index(PyTuple_GET_ITEM(h.ptr(), 1));
}

// Whether a versioned capsule may be returned, from max_version: None, or a tuple of two ints (TypeError otherwise).
bool wants_versioned(nb::handle max_version) {
  if (max_version.is_none()) return false;
  if (!int_pair(max_version))
    sw::raise<sw::TypeError>("Tensor.__dlpack__: max_version must be None or a (major, minor) tuple of ints, got ",
                             nb::cast<std::string>(nb::repr(max_version)));
  return index_value(PyTuple_GET_ITEM(max_version.ptr(), 0), "max_version major") >= 1;
}

// `read_only_view`: the export is marked read-only and shares the memory as it is, even that of a mutable tensor
// whose memory is shared copy-on-write (which a writable export first makes private). For consumers that promise
// not to write (the experts' per-expert arithmetic in strideweave.torch, Note [Experts on transformers'
// interface]); a versioned capsule only, since a legacy one cannot say read-only.
nb::object dlpack(nb::handle self, nb::handle stream, nb::handle max_version, nb::handle dl_device, nb::handle copy,
                  bool read_only_view = false) {
  const TensorImpl& t = nb::cast<const TensorImpl&>(self);
  if (!stream.is_none())
    sw::raise<sw::ValueError>("Tensor.__dlpack__: stream must be None for CPU memory, got ",
                              nb::cast<std::string>(nb::repr(stream)));
  const bool versioned = wants_versioned(max_version);
  if (!dl_device.is_none()) {
    if (!int_pair(dl_device))
      sw::raise<sw::TypeError>("Tensor.__dlpack__: dl_device must be None or a (device_type, device_id) tuple, got ",
                               nb::cast<std::string>(nb::repr(dl_device)));
    const int64_t type = index_value(PyTuple_GET_ITEM(dl_device.ptr(), 0), "dl_device type");
    const int64_t id = index_value(PyTuple_GET_ITEM(dl_device.ptr(), 1), "dl_device id");
    if (type != kDLCPU || id != 0)
      buffer_error("Tensor.__dlpack__: cannot export to " + dl_device_name(type, id) +
                   ": StrideWeave tensors are exported from CPU memory (CPU device 0)");
  }
  if (!copy.is_none() && !PyBool_Check(copy.ptr()))
    sw::raise<sw::TypeError>("Tensor.__dlpack__: copy must be None, True or False, got ",
                             nb::cast<std::string>(nb::repr(copy)));
  const bool copied = copy.is_none() ? false : nb::cast<bool>(copy);
  t.carrier->check_live("export a tensor through DLPack");

  const DTypeRow* row = nullptr;
  for (const DTypeRow& r : kDTypes)
    if (dtype_of(r) == &t.dtype()) row = &r;
  if (!row) buffer_error("Tensor.__dlpack__: " + t.dtype().name() + " has no DLPack dtype");

  auto e = std::make_unique<Export>();
  const size_t w = sw::slot_bytes(t.dtype());
  const sw::Layout& l = t.layout;
  std::byte* data = nullptr;
  bool read_only = false;
  if (!copied) {
    const char* refusal = nullptr;
    for (size_t k = 0; k < l.rank() && !refusal; ++k) {
      auto leaf = l.mode_as_leaf(k);
      if (!leaf) refusal = "its layout has a mode whose leaves no single stride describes";
      else {
        e->shape.push_back(leaf->first);
        e->strides.push_back(leaf->second);
      }
    }
    if (!t.carrier->native_data()) refusal = "its carrier keeps no host memory to share";
    if (refusal)
      buffer_error("Tensor.__dlpack__: cannot export " + t.carrier->kind_name() + " tensor of layout " + l.str() +
                   " without a copy: " + refusal + " (pass copy=True for a copy, or move it to a CPU carrier)");
    read_only = read_only_view || !t.is_mutable();
    if (read_only && !versioned)
      buffer_error("Tensor.__dlpack__: cannot export an immutable tensor as a legacy DLPack capsule, which cannot "
                   "mark it read-only (the consumer must pass max_version=(1, 0) or later)");
    // A writable export may write at any time: memory shared copy-on-write is first made private
    // (Note [Shared snapshots] in native.cpp).
    data = read_only ? const_cast<std::byte*>(t.carrier->native_data()) : t.carrier->mutable_native_data();
    data += static_cast<size_t>(t.offset) * w;
    e->memory = t.carrier->native_owner();
  } else {
    // A copy in first-mode-fastest order, read in bulk per contiguous run of the carrier.
    int64_t run = 1;
    for (int64_t extent : l.shape().extents()) {
      e->shape.push_back(extent);
      e->strides.push_back(run);
      run *= extent;
    }
    auto buffer = std::make_shared<sw::AlignedBuffer>(static_cast<size_t>(t.size()) * w, false, "a DLPack copy");
    for (const sw::Run& r : t.physical_runs())
      t.carrier->read_slots(r.offset, r.length, buffer->data() + r.ordinal * w);
    data = buffer->data();
    e->memory = std::move(buffer);
  }

  DLTensor tensor{data, {kDLCPU, 0}, static_cast<int32_t>(e->shape.size()), {row->code, row->bits, 1},
                  e->shape.empty() ? nullptr : e->shape.data(), e->strides.empty() ? nullptr : e->strides.data(), 0};
  Export* raw = e.get();
  PyObject* capsule;
  if (versioned) {
    raw->versioned = {{1, 0}, raw, delete_versioned, (read_only ? kFlagReadOnly : 0) | (copied ? kFlagIsCopied : 0),
                      tensor};
    capsule = PyCapsule_New(&raw->versioned, kVersionedName, versioned_capsule_destructor);
  } else {
    raw->legacy = {tensor, raw, delete_legacy};
    capsule = PyCapsule_New(&raw->legacy, kLegacyName, legacy_capsule_destructor);
  }
  if (!capsule) throw nb::python_error();
  e.release();  // the capsule owns it now
  return nb::steal(capsule);
}

// ---------------------------------------------------------------- import

// The consumed DLManagedTensor(Versioned), as one Python capsule whose destructor calls the producer's deleter
// (with the GIL held, as producers that hold Python objects need), held so that it may be dropped from any thread.
void consumed_versioned_destructor(PyObject* capsule) {
  auto* m = static_cast<DLManagedTensorVersioned*>(PyCapsule_GetPointer(capsule, "strideweave_dltensor_versioned"));
  if (m && m->deleter) m->deleter(m);
}
void consumed_legacy_destructor(PyObject* capsule) {
  auto* m = static_cast<DLManagedTensor*>(PyCapsule_GetPointer(capsule, "strideweave_dltensor"));
  if (m && m->deleter) m->deleter(m);
}

// The DLPack capsule of obj: obj itself, or what its __dlpack__ returns. The protocol's answers are checked
// before they are used: __dlpack_device__ must give a (device_type, device_id) tuple of ints and __dlpack__ a
// capsule (TypeError naming the producer's type and what it returned otherwise).
nb::object take_capsule(nb::handle obj) {
  if (PyCapsule_CheckExact(obj.ptr())) return nb::borrow(obj);
  const std::string type_name = nb::type_name(obj.type()).c_str();
  if (!nb::hasattr(obj, "__dlpack__"))
    sw::raise<sw::TypeError>("from_dlpack: expected an object with __dlpack__ (a NumPy array, a torch.Tensor) or a "
                             "DLPack capsule, got ", type_name);
  if (nb::hasattr(obj, "__dlpack_device__")) {
    nb::object device = obj.attr("__dlpack_device__")();
    // The protocol's answer is a tuple; a list of the same two ints is read the same.
    nb::object pair = PyList_Check(device.ptr()) ? nb::steal(PyList_AsTuple(device.ptr())) : device;
    if (!pair.is_valid()) throw nb::python_error();
    if (!int_pair(pair))
      sw::raise<sw::TypeError>("from_dlpack: ", type_name, ".__dlpack_device__() must return a (device_type, "
                               "device_id) tuple of two ints, got ", nb::cast<std::string>(nb::repr(device)));
    const int64_t type =
        index_value(PyTuple_GET_ITEM(pair.ptr(), 0), "from_dlpack: the device_type of __dlpack_device__()");
    const int64_t id = index_value(PyTuple_GET_ITEM(pair.ptr(), 1), "from_dlpack: the device_id of __dlpack_device__()");
    if (type != kDLCPU)
      buffer_error("from_dlpack: the " + type_name + " lives on " + dl_device_name(type, id) +
                   "; StrideWeave imports CPU memory only (copy it to the CPU first)");
  }
  // A producer that predates max_version refuses the keyword with TypeError: ask again without it.
  nb::object capsule;
  try {
    capsule = obj.attr("__dlpack__")(nb::arg("max_version") = nb::make_tuple(1, 0));
  } catch (nb::python_error& e) {
    if (!e.matches(PyExc_TypeError)) throw;
  }
  if (!capsule.is_valid()) capsule = obj.attr("__dlpack__")();
  if (!PyCapsule_CheckExact(capsule.ptr()))
    sw::raise<sw::TypeError>("from_dlpack: ", type_name, ".__dlpack__() must return a DLPack capsule, got ",
                             nb::type_name(capsule.type()).c_str());
  return capsule;
}

// Note [Borrowed memory] (native.cpp): PyTorch can free the memory of a storage it lent, in place
// (x.resize_ past the storage's size reallocates it, x.untyped_storage().resize_ too). A CPU carrier over a
// torch.Tensor's memory therefore holds the tensor's storage object (so x.set_(other) leaves the imported bytes
// alive and unchanged) and, before each use, checks that the storage still has the data pointer and at least the
// size it had at the import: a storage that moved fails the use with RuntimeError, never a read of freed memory.
class TorchStorageCheck final : public sw::BorrowedMemoryCheck {
 public:
  TorchStorageCheck(nb::object storage, uintptr_t base, uint64_t need, std::string what)
      : storage_(std::make_unique<GilObject>(std::move(storage))), base_(base), need_(need), what_(std::move(what)) {}

  void check(const char* action) const override {
    call_into_python([&] {
      uintptr_t now = 0;
      uint64_t bytes = 0;
      std::string failure;
      try {
        now = nb::cast<uintptr_t>(storage_->obj.attr("data_ptr")());
        bytes = nb::cast<uint64_t>(storage_->obj.attr("nbytes")());
      } catch (const std::exception& e) {
        failure = e.what();
      }
      if (!failure.empty())
        sw::raise<sw::RuntimeError>("cannot ", action, ": the storage of ", what_,
                                    " that this CPU tensor borrows could not be checked (", failure, ")");
      if (now == base_ && bytes >= need_) return;
      sw::raise<sw::RuntimeError>(
          "cannot ", action, ": the storage of ", what_, " that this CPU tensor borrows was resized or freed by "
          "PyTorch after the import (its memory moved from ", reinterpret_cast<const void*>(base_), ", ", need_,
          " bytes used, to ", reinterpret_cast<const void*>(now), ", ", bytes, " bytes), so the borrowed memory is "
          "gone; import the tensor again after resizing it (docs/guide.md, \"PyTorch\")");
    });
  }

 private:
  std::unique_ptr<GilObject> storage_;  // the UntypedStorage: dropped with the GIL taken, from any thread
  uintptr_t base_;                      // its data pointer at the import
  uint64_t need_;                       // the bytes of it the carrier reaches (from the storage's start)
  std::string what_;                    // "a torch.Tensor (torch.float32, shape (2, 3))"
};

// The check of a torch.Tensor's storage when obj is one (torch already imported: nothing imports it here), else
// null. `data` and `bytes` are the memory the carrier borrows, which lies inside the storage; `extents` its shape.
std::shared_ptr<const sw::BorrowedMemoryCheck> torch_storage_check(nb::handle obj, const std::byte* data,
                                                                   size_t bytes, const std::vector<int64_t>& extents) {
  PyObject* torch = PyDict_GetItemString(PyImport_GetModuleDict(), "torch");  // borrowed
  if (!torch || PyCapsule_CheckExact(obj.ptr())) return nullptr;
  nb::object tensor_type = nb::borrow(torch).attr("Tensor");
  const int is = PyObject_IsInstance(obj.ptr(), tensor_type.ptr());
  if (is < 0) throw nb::python_error();
  if (!is) return nullptr;
  nb::object storage = obj.attr("untyped_storage")();
  const auto base = nb::cast<uintptr_t>(storage.attr("data_ptr")());
  const auto size = nb::cast<uint64_t>(storage.attr("nbytes")());
  const auto at = reinterpret_cast<uintptr_t>(data);
  if (at < base || at - base + bytes > size)  // not the storage's memory after all: nothing to compare it with
    buffer_error("from_dlpack: the memory the " + std::string(nb::type_name(obj.type()).c_str()) +
                 " exports is not inside its untyped_storage()");
  std::string what = "a torch.Tensor (" + nb::cast<std::string>(nb::repr(obj.attr("dtype"))) + ", shape (";
  const size_t rank = extents.size();
  for (size_t k = 0; k < rank; ++k) what += std::to_string(extents[k]) + (k + 1 < rank ? ", " : rank == 1 ? "," : "");
  what += "))";
  return std::make_shared<TorchStorageCheck>(std::move(storage), base, at - base + bytes, std::move(what));
}

nb::object from_dlpack(nb::handle obj) {
  nb::object capsule = take_capsule(obj);
  const char* name = PyCapsule_GetName(capsule.ptr());
  if (!name) throw nb::python_error();
  const bool versioned = std::strcmp(name, kVersionedName) == 0;
  if (!versioned && std::strcmp(name, kLegacyName) != 0) {
    if (std::strcmp(name, kUsedVersionedName) == 0 || std::strcmp(name, kUsedLegacyName) == 0)
      buffer_error("from_dlpack: this DLPack capsule was already consumed (each capsule can be imported once)");
    sw::raise<sw::TypeError>("from_dlpack: a capsule named '", name, "' is not a DLPack capsule");
  }
  void* managed = PyCapsule_GetPointer(capsule.ptr(), name);
  if (!managed) throw nb::python_error();
  const DLTensor* dl;
  bool read_only = false;
  if (versioned) {
    auto* m = static_cast<DLManagedTensorVersioned*>(managed);
    if (m->version.major != 1)
      buffer_error("from_dlpack: DLPack version " + std::to_string(m->version.major) + "." +
                   std::to_string(m->version.minor) + " is not one StrideWeave reads (1.x)");
    read_only = (m->flags & kFlagReadOnly) != 0;
    dl = &m->dl_tensor;
  } else {
    dl = &static_cast<DLManagedTensor*>(managed)->dl_tensor;
  }

  // Everything is checked before the capsule is consumed: a refused one stays the producer's.
  if (dl->device.device_type != kDLCPU)
    buffer_error("from_dlpack: the tensor lives on " + dl_device_name(dl->device.device_type, dl->device.device_id) +
                 "; StrideWeave imports CPU memory only (copy it to the CPU first)");
  const sw::DType* dtype = nullptr;
  for (const DTypeRow& r : kDTypes)
    if (r.code == dl->dtype.code && r.bits == dl->dtype.bits && dl->dtype.lanes == 1 && !dtype) dtype = dtype_of(r);
  if (!dtype) {
    std::string known;
    for (const DTypeRow& r : kDTypes)
      if (dtype_of(r)) known += (known.empty() ? "" : ", ") + dl_dtype_name({r.code, r.bits, 1});
    buffer_error("from_dlpack: dtype " + dl_dtype_name(dl->dtype) + " has no StrideWeave dtype (it imports " +
                 known + ")");
  }
  if (dl->ndim < 0) buffer_error("from_dlpack: ndim " + std::to_string(dl->ndim) + " is negative");
  const size_t rank = static_cast<size_t>(dl->ndim);
  std::vector<sw::IntTuple> shape, strides;
  int64_t row_major = 1;  // the stride of a compact row-major tensor's mode k, when strides is null
  std::vector<int64_t> compact(rank);
  for (size_t k = rank; k-- > 0;) {
    compact[k] = row_major;
    row_major *= dl->shape[k] > 0 ? dl->shape[k] : 1;
  }
  for (size_t k = 0; k < rank; ++k) {
    const int64_t extent = dl->shape[k];
    int64_t stride = dl->strides ? dl->strides[k] : compact[k];
    if (extent < 1)
      buffer_error("from_dlpack: mode " + std::to_string(k) + " has extent " + std::to_string(extent) +
                   "; StrideWeave shapes have extents >= 1 (an empty tensor has no StrideWeave form)");
    if (stride < 0 && extent > 1)
      buffer_error("from_dlpack: mode " + std::to_string(k) + " has the negative stride " + std::to_string(stride) +
                   " (a reversed view); StrideWeave strides are >= 0 (import a copy, e.g. x.copy())");
    if (extent == 1) stride = 0;  // never stepped: any stride describes it
    shape.emplace_back(extent);
    strides.emplace_back(stride);
  }
  auto* data = static_cast<std::byte*>(dl->data) + dl->byte_offset;
  const size_t w = dtype->itemsize();
  if (reinterpret_cast<uintptr_t>(data) % w != 0)
    buffer_error("from_dlpack: the data address is not aligned to the " + std::to_string(w) + "-byte elements of " +
                 dtype->name() + " (import an aligned copy)");
  sw::Layout layout(sw::Shape(sw::IntTuple::tuple(std::move(shape))), sw::Stride(sw::IntTuple::tuple(std::move(strides))));
  std::shared_ptr<const sw::BorrowedMemoryCheck> moved = torch_storage_check(
      obj, data, static_cast<size_t>(layout.cosize()) * w, std::vector<int64_t>(dl->shape, dl->shape + rank));

  // Consume: the capsule is renamed (its destructor then leaves the tensor alone) and its contents move into a
  // capsule of ours that calls the producer's deleter when the last holder of the memory lets go.
  nb::object keeper = nb::steal(PyCapsule_New(managed, versioned ? "strideweave_dltensor_versioned" : "strideweave_dltensor", nullptr));
  if (!keeper.is_valid()) throw nb::python_error();
  if (PyCapsule_SetName(capsule.ptr(), versioned ? kUsedVersionedName : kUsedLegacyName) != 0) throw nb::python_error();
  PyCapsule_SetDestructor(keeper.ptr(), versioned ? consumed_versioned_destructor : consumed_legacy_destructor);
  auto owner = std::make_shared<GilObject>(std::move(keeper));
  auto carrier =
      std::make_shared<sw::CPUCarrier>(data, layout.cosize(), *dtype, !read_only, std::move(owner), std::move(moved));
  return nb::cast(std::make_shared<TensorImpl>(std::move(carrier), 0, std::move(layout)));
}

}  // namespace

void bind_dlpack(nb::module_& m) {
  nb::handle tensor = nb::type<TensorImpl>();
  nb::cpp_function_def(
      [](nb::handle self, nb::handle stream, nb::handle max_version, nb::handle dl_device, nb::handle copy) {
        return dlpack(self, stream, max_version, dl_device, copy);
      },
      nb::scope(tensor), nb::name("__dlpack__"), nb::is_method(), nb::kw_only(), nb::arg("stream").none() = nb::none(),
      nb::arg("max_version").none() = nb::none(), nb::arg("dl_device").none() = nb::none(),
      nb::arg("copy").none() = nb::none(),
      nb::sig("def __dlpack__(self, *, stream: None = None, max_version: tuple[int, int] | None = None, "
              "dl_device: tuple[int, int] | None = None, copy: bool | None = None) -> typing_extensions.CapsuleType"),
      "A DLPack capsule of this tensor's memory, no copy (copy=True: of a copy). BufferError when the memory cannot "
      "be shared as asked: a carrier without host memory, a layout without strides, another device, or an "
      "immutable tensor for a consumer of legacy capsules.");
  nb::cpp_function_def([](nb::handle) { return nb::make_tuple(kDLCPU, 0); }, nb::scope(tensor),
                       nb::name("__dlpack_device__"), nb::is_method(),
                       nb::sig("def __dlpack_device__(self) -> tuple[int, int]"),
                       "(1, 0): DLPack's CPU device 0, where every export lives.");
  m.def("_dlpack_read_only", [](nb::handle t) {
          if (!nb::isinstance<TensorImpl>(t))
            sw::raise<sw::TypeError>("_dlpack_read_only: expected a Tensor, got ", nb::type_name(t.type()).c_str());
          return dlpack(t, nb::none(), nb::make_tuple(1, 0), nb::none(), nb::none(), true);
        }, nb::arg("t"), nb::sig("def _dlpack_read_only(t: Tensor) -> typing_extensions.CapsuleType"),
        "Internal: a versioned DLPack capsule of t's memory marked read-only, shared as it is (no private copy of "
        "copy-on-write memory); for consumers that never write it.");
  m.def("from_dlpack", &from_dlpack, nb::arg("obj"),
        nb::sig("def from_dlpack(obj: object, /) -> Tensor"),
        "A Tensor over obj's memory, no copy: obj is an object with __dlpack__ (a NumPy array, a torch.Tensor) or a "
        "DLPack capsule on the CPU. The tensor has obj's shape and strides and keeps obj alive; a read-only "
        "producer gives an immutable tensor. BufferError for what StrideWeave cannot import without a copy "
        "(another device, a dtype it does not store, negative strides, an empty tensor, a misaligned address).");
}

}  // namespace swpy
