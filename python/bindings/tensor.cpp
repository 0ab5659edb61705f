// Tensor: one Python object per TensorImpl; NumPy interop; bulk fill.
#include <nanobind/ndarray.h>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <cstring>
#include <memory>

#include "common.hpp"
#include "cycles.hpp"
#include "typing.hpp"
#include "extension.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/tensor.hpp"

namespace swpy {

namespace {

using sw::TensorImpl;
using sw::TensorPtr;

// Each top-level mode as one (extent, stride) pair, when its leaves coalesce.
bool mode_strides(const sw::Layout& l, std::vector<size_t>& shape, std::vector<int64_t>& strides) {
  for (size_t k = 0; k < l.rank(); ++k) {
    auto leaf = l.mode_as_leaf(k);
    if (!leaf) return false;
    shape.push_back(static_cast<size_t>(leaf->first));
    strides.push_back(leaf->second);
  }
  return true;
}

nb::dlpack::dtype dl_dtype(const sw::DType& d) {
  switch (d.id()) {
    case sw::DTypeId::Int32: return nb::dtype<int32_t>();
    case sw::DTypeId::Bool: return nb::dtype<bool>();
    case sw::DTypeId::BFloat16:
    case sw::DTypeId::Float16: return nb::dtype<uint16_t>();  // the bits, viewed as numpy_half_dtype (as_elements)
    default: return nb::dtype<float>();
  }
}

// A 16-bit float dtype's array (made of its uint16 bits) viewed as its NumPy dtype: the same memory, no copy.
nb::object as_elements(nb::object arr, const sw::DType& d) {
  return d.is_half() ? arr.attr("view")(numpy_half_dtype(d)) : arr;
}

nb::object to_numpy(nb::handle self) {
  const TensorImpl& t = nb::cast<const TensorImpl&>(self);
  t.carrier->check_live("export a tensor to NumPy");
  std::vector<size_t> shape;
  std::vector<int64_t> strides;
  bool representable = mode_strides(t.layout, shape, strides);
  const std::byte* base = t.carrier->native_data();
  const size_t w = sw::slot_bytes(t.dtype());
  nb::object arr;
  if (base && representable) {
    // A writable view may write at any time: memory shared copy-on-write with another carrier is
    // first made private to this one (Note [Shared snapshots]).
    if (t.is_mutable()) base = t.carrier->mutable_native_data();
    // Zero-copy view. The view owns a share of the memory itself (not only the tensor, whose
    // carrier may be released or moved away while the view lives): Note [Exports outlive release].
    nb::handle owner = self;
    nb::object keep;
    if (std::shared_ptr<const void> memory = t.carrier->native_owner()) {
      auto* held = new std::shared_ptr<const void>(std::move(memory));
      keep = nb::capsule(held, [](void* p) noexcept { delete static_cast<std::shared_ptr<const void>*>(p); });
      owner = keep;
    }
    arr = nb::cast(nb::ndarray<nb::numpy>(const_cast<std::byte*>(base) + static_cast<size_t>(t.offset) * w, shape.size(), shape.data(), owner,
                                          strides.data(), dl_dtype(t.dtype())));
    arr = as_elements(arr, t.dtype());
    if (!t.is_mutable()) arr.attr("flags").attr("writeable") = false;
    return arr;
  }
  // A copy in first-mode-fastest order, read in bulk per contiguous run.
  for (size_t k = 0; k < shape.size(); ++k) shape[k] = static_cast<size_t>(t.layout.shape().extents()[k]);
  if (!representable) {
    shape.clear();
    for (int64_t e : t.layout.shape().extents()) shape.push_back(static_cast<size_t>(e));
  }
  const int64_t n = t.size();
  auto* buf = new std::byte[static_cast<size_t>(n) * w];
  nb::capsule owner(buf, [](void* p) noexcept { delete[] static_cast<std::byte*>(p); });
  for (const sw::Run& r : t.physical_runs()) t.carrier->read_slots(r.offset, r.length, buf + r.ordinal * w);
  std::vector<int64_t> dense(shape.size());
  int64_t run = 1;
  for (size_t k = 0; k < shape.size(); ++k) {
    dense[k] = run;
    run *= static_cast<int64_t>(shape[k]);
  }
  arr = as_elements(nb::cast(nb::ndarray<nb::numpy>(buf, shape.size(), shape.data(), owner, dense.data(), dl_dtype(t.dtype()))),
                    t.dtype());
  arr.attr("flags").attr("writeable") = false;
  return arr;
}

void fill_from_array(sw::Carrier& c, nb::ndarray<nb::c_contig, nb::device::cpu> a) {
  const size_t w = sw::slot_bytes(c.dtype());
  if (a.itemsize() != w) sw::raise<sw::TypeError>("array itemsize does not match ", c.dtype().name());
  int64_t n = static_cast<int64_t>(a.size());
  if (n > c.size()) sw::raise<sw::ValueError>("array has ", n, " elements but the carrier ", c.size(), " slots");
  c.write_slots(0, n, a.data());
}

// Note [Tensor reference cycles]. A tensor refers to its carrier through C++ (TensorImpl::carrier), so a
// residency policy that holds a tensor of its own carrier makes a cycle the garbage collector cannot see:
// carrier -> policy (reported by the carrier: Note [Policy reference cycles] in tiled.cpp) -> tensor (the
// policy's attributes) -> carrier. Tensor has tp_traverse / tp_clear slots (tensor_traverse / tensor_clear below)
// that report the last edge. As for the policy edge, a visit must stand for a reference the visiting object owns,
// once, so the edge is reported only when the tensor's object solely owns it:
//  * it owns its TensorImpl: it constructed it (Tensor(...)), or it wraps one made in C++ (an operation's
//    result, a view) whose only shared_ptr is the wrapper's own; and
//  * its TensorImpl's carrier pointer is the only shared_ptr to the carrier (use_count 1). Then either the carrier
//    lives in a Python object (made by TiledEvictable(...) or another carrier constructor: nanobind's shared_ptr
//    to it owns ONE reference to that object, whatever the number of copies, and the copy is the only one), and
//    that object is visited; or the carrier was made in C++ (allocate_like, a move, an operation's result) and
//    the tensor owns it: its policy object is visited when the carrier alone holds it (sole_policy_object).
// Otherwise nothing is visited and a cycle through the edge is kept: a leak, never a wrong collection. Two tensors
// of the same carrier inside one cycle share the carrier's reference and so keep that cycle (a policy holding
// one tensor of its carrier is collected; one holding two is not). tp_clear drops a C++ carrier's policy object
// (as the carrier's own tp_clear does) and never the carrier pointer, which library threads read without the
// GIL: a carrier living in a Python object is in the cycle itself, and its tp_clear or the policy's breaks it.
// The same window as the policy edge's remains (a library thread copying the carrier pointer between the
// collector's two passes; it must hold the carrier to do so, and then the carrier is reachable anyway).
//
// Cost: the type is garbage-collected, so each Tensor object is allocated with the collector's header and
// counted towards its generation-0 threshold. Measured before and after (docs/reliability.md, "Lifetimes", L6's
// cost: bench/op_overhead.py --quick and sw.add with the collector running), the difference is inside the noise,
// so every Tensor is tracked. (Tracking only tensors that can be in such a cycle would need a hook where nanobind
// makes the object of an operation's result; it has none.)

// The carrier pointer that `self` (a Tensor) solely owns, or nullptr. With the GIL held; allocates nothing.
const sw::CarrierPtr* owned_carrier(PyObject* self) {
  if (!nb::inst_ready(self)) return nullptr;
  auto* t = nb::inst_ptr<TensorImpl>(self);
  const bool constructed_here = nb::inst_state(self).second;  // destroys its TensorImpl: owns it
  if (!constructed_here && t->weak_from_this().use_count() != 1) return nullptr;
  if (!t->carrier || t->carrier.use_count() != 1) return nullptr;
  return &t->carrier;
}

int tensor_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));  // instances of heap types own a reference to their type
  if (const sw::CarrierPtr* c = owned_carrier(self)) {
    if (auto* owner = std::get_deleter<nb::detail::py_deleter>(*c)) Py_VISIT(owner->o);  // the carrier's object
    else Py_VISIT(sole_policy_object(**c));  // a carrier made in C++, solely ours: its policy (or nothing)
  }
  return 0;
}

int tensor_clear(PyObject* self) {
  if (const sw::CarrierPtr* c = owned_carrier(self); c && !std::get_deleter<nb::detail::py_deleter>(*c))
    clear_sole_policy(**c);
  return 0;
}

PyType_Slot tensor_slots[] = {{Py_tp_traverse, (void*)tensor_traverse}, {Py_tp_clear, (void*)tensor_clear}, {0, nullptr}};

}  // namespace

void bind_tensor(nb::module_& m) {
  nb::class_<TensorImpl>(m, "Tensor", nb::type_slots(tensor_slots),
                         "Tensor(carrier, offset, layout): a view of a carrier placed by a layout.")
      .def("__init__", [](TensorImpl* self, nb::handle carrier, nb::handle offset, nb::handle layout) {
        if (!nb::isinstance<sw::Carrier>(carrier))
          sw::raise<sw::TypeError>("Tensor carrier must be a Carrier instance, got ", nb::type_name(carrier.type()).c_str());
        if (PyBool_Check(offset.ptr()) || !is_index(offset))
          sw::raise<sw::TypeError>("Tensor offset must be an int, got ", nb::type_name(offset.type()).c_str());
        if (!nb::isinstance<sw::Layout>(layout))
          sw::raise<sw::TypeError>("Tensor layout must be a Layout, got ", nb::type_name(layout.type()).c_str());
        int64_t off = index_value(offset, "Tensor offset");
        new (self) TensorImpl(nb::cast<std::shared_ptr<sw::Carrier>>(carrier), off, nb::cast<sw::Layout>(layout));
      }, nb::arg("carrier").none(), nb::arg("offset").none(), nb::arg("layout").none(),
         nb::sig("def __init__(self, carrier: Carrier, offset: " SW_PY_INDEX ", layout: Layout) -> None"))
      .def_prop_ro("carrier", [](const TensorImpl& t) { return t.carrier; })
      .def_prop_ro("offset", [](const TensorImpl& t) { return t.offset; })
      .def_prop_ro("layout", [](const TensorImpl& t) { return t.layout; })
      .def_prop_ro("shape", [](const TensorImpl& t) { return t.layout.shape(); })
      .def_prop_ro("version", &TensorImpl::version)
      .def("dtype", [](const TensorImpl& t) -> const sw::DType& { return t.dtype(); }, nb::rv_policy::reference)
      .def("size", &TensorImpl::size)
      .def("is_mutable", &TensorImpl::is_mutable)
      .def("is_differentiable", &TensorImpl::is_differentiable)
      .def_prop_rw("grad",
                   [](const TensorImpl& t) -> typing::Result<TensorImpl, std::nullptr_t> {
                     if (!t.is_differentiable())
                       sw::raise<sw::RuntimeError>(t.dtype().name(), " tensor is not differentiable; it has no grad");
                     TensorPtr grad;
                     {
                       std::lock_guard lock(t.mutex);
                       grad = t.grad;
                     }
                     return nb::cast(grad);  // None when there is none
                   },
                   [](TensorImpl& t, typing::Arg<TensorImpl> g) {
                     if (!t.is_differentiable())
                       sw::raise<sw::RuntimeError>(t.dtype().name(), " tensor is not differentiable; it has no grad");
                     TensorPtr value;
                     if (!g.is_none()) {
                       if (!nb::isinstance<TensorImpl>(g)) sw::raise<sw::TypeError>("grad must be a Tensor or None");
                       value = nb::cast<TensorPtr>(g);
                       if (!(value->layout.shape() == t.layout.shape()))
                         sw::raise<sw::ValueError>("grad shape ", value->layout.shape().str(),
                                                   " does not match the tensor's ", t.layout.shape().str());
                     }
                     std::lock_guard lock(t.mutex);
                     t.grad = std::move(value);
                   },
                   nb::arg("value").none())
      .def("__getitem__", [](const TensorImpl& t, nb::handle key) { return from_value(t.get(parse_coord(key))); },
           nb::arg("key").none(), nb::sig("def __getitem__(self, key: " SW_PY_KEY ") -> " SW_PY_VALUE))
      .def("__setitem__", [](TensorImpl& t, nb::handle key, nb::handle value) {
        t.carrier->check_writable("write a tensor element");
        t.set(parse_coord(key), to_value(value));
      }, nb::arg("key").none(), nb::arg("value").none(),
         nb::sig("def __setitem__(self, key: " SW_PY_KEY ", value: " SW_PY_VALUE ") -> None"))
      .def("__array__", [](nb::handle self, nb::handle dtype, nb::handle copy) {
        // NumPy's protocol: copy=False asks for a view or an error, never a silent copy.
        if (!copy.is_none() && !nb::cast<bool>(copy)) {
          const TensorImpl& t = nb::cast<const TensorImpl&>(self);
          std::vector<size_t> shape;
          std::vector<int64_t> strides;
          if (!t.carrier->native_data() || !mode_strides(t.layout, shape, strides))
            sw::raise<sw::ValueError>("np.asarray(copy=False): a tensor with layout ", t.layout.str(), " over ",
                                      t.carrier->kind_name(),
                                      " is not a NumPy view (a nested mode, or no memory of its own); "
                                      "use np.asarray(t) for a copy");
        }
        nb::object arr = to_numpy(self);
        if (!dtype.is_none()) arr = arr.attr("astype")(dtype);
        else if (!copy.is_none() && nb::cast<bool>(copy)) arr = arr.attr("copy")();
        return arr;
      }, nb::arg("dtype") = nb::none(), nb::kw_only(), nb::arg("copy") = nb::none())
      .def("__repr__", [](const TensorImpl& t) {
        return "Tensor(" + t.carrier->kind_name() + ", offset=" + std::to_string(t.offset) + ", layout=" +
               t.layout.str() + ", dtype=DType." + t.dtype().name() + ")";
      });

  m.def("_fill_from_array", [](sw::Carrier& c, nb::ndarray<nb::c_contig, nb::device::cpu> a) {
    fill_from_array(c, a);
  }, "Bulk-writes a C-contiguous array into slots [0, a.size) (internal; used by friendly.tensor).");
}

}  // namespace swpy
