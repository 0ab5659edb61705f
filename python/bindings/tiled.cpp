// TiledEvictable and AwaitResidency.
#include <algorithm>
#include <optional>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"
#include "cycles.hpp"
#include "completion_py.hpp"
#include "extension.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/tiled/data.hpp"
#include "strideweave/tiled/tile_set.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace swpy {

namespace {

using sw::TiledEvictable;
using sw::TileCoord;

struct AwaitResidency : AwaitHandle {};
struct AwaitProjection : AwaitHandle {};

nb::module_ tiled_module() { return nb::module_::import_("strideweave.carriers.tiled_evictable"); }

// A class of strideweave.carriers.tiled_evictable, looked up on first use with the GIL held and kept for the
// process (as the definition registry keeps its classes). No C++ static guard: a lookup that let another thread
// take the GIL must not leave that thread waiting on the guard while it holds the GIL; two lookups racing store the
// same class.
nb::handle tiled_class(PyObject*& slot, const char* name) {
  if (!slot) slot = nb::object(tiled_module().attr(name)).release().ptr();
  return slot;
}
PyObject* g_tile_set = nullptr;
PyObject* g_tile_selection = nullptr;
PyObject* g_residency_plan = nullptr;
nb::handle tile_set_class() { return tiled_class(g_tile_set, "TileSet"); }
nb::handle tile_selection_class() { return tiled_class(g_tile_selection, "TileSelection"); }
nb::handle residency_plan_class() { return tiled_class(g_residency_plan, "ResidencyPlan"); }

std::string class_name(nb::handle h) { return nb::cast<std::string>(h.type().attr("__name__")); }

// Note [Dirty tiles are never discarded silently] (cpp/src/tiled/durability.cpp): the engine decides and counts; these
// emit. From a destructor: the Python object's deallocation, with the GIL held, for every carrier made in Python
// (a carrier made in C++ has an anonymous secondary and never reports). A collection may run while an exception
// propagates, so the error indicator is kept; a filter that turns the warning into an error makes it unraisable,
// as for an unclosed file. Nothing is reported during finalization: the exit handler below reported already.
void report_discard(const std::string& warning) noexcept {
  try {
    if (!nb::is_alive() || finalizing_elsewhere()) return;
#if PY_VERSION_HEX >= 0x030D0000
    if (Py_IsFinalizing()) return;
#else
    if (_Py_IsFinalizing()) return;
#endif
    std::optional<GilAcquire> gil;
    if (!PyGILState_Check()) gil.emplace();
#if PY_VERSION_HEX >= 0x030C0000
    PyObject* pending = PyErr_GetRaisedException();
#else
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
#endif
    if (PyErr_WarnEx(PyExc_ResourceWarning, warning.c_str(), 1) < 0) PyErr_WriteUnraisable(nullptr);
#if PY_VERSION_HEX >= 0x030C0000
    PyErr_SetRaisedException(pending);
#else
    PyErr_Restore(type, value, traceback);
#endif
  } catch (...) {  // a destructor's report never throws
  }
}

// The tuple (item(0), ..., item(n - 1)); item returns a new nb::object.
template <class F>
nb::tuple tuple_of_n(size_t n, F&& item) {
  nb::object t = nb::steal(PyTuple_New(static_cast<Py_ssize_t>(n)));
  if (!t.is_valid()) throw nb::python_error();
  for (size_t k = 0; k < n; ++k) PyTuple_SET_ITEM(t.ptr(), static_cast<Py_ssize_t>(k), item(k).release().ptr());
  return nb::borrow<nb::tuple>(t);
}

nb::tuple int_tuple(const std::vector<int64_t>& values) {
  return tuple_of_n(values.size(), [&](size_t k) { return nb::int_(values[k]); });
}

// The TileSet of canonical coordinates (Note [Canonical tile order], tile_set.hpp): valid, of one rank, distinct
// and sorted, so the constructor's checks are skipped.
nb::object canonical_tile_set(nb::handle coordinates) {
  return tile_set_class().attr("_from_canonical")(coordinates);
}

// The core's coordinates are valid, of one rank and distinct: sorted into canonical order.
nb::object tile_set_of(std::vector<TileCoord> coords) {
  std::sort(coords.begin(), coords.end(), sw::tile_order_less);
  return canonical_tile_set(tuple_of_n(coords.size(), [&](size_t k) { return int_tuple(coords[k]); }));
}

// Note [Tile components beyond int64]. TileSet and TileSelection take any non-negative int as Python does; one
// beyond int64 is out of every grid, and using it raises ValueError ("out of range") where the tiles are bound to a
// grid, as for any other coordinate out of the grid. The checks and the canonical order (tile_set.hpp) run over
// int64 keys that compare as the ints do: the values themselves, or, when some component is beyond int64, each
// value's ordinal among the distinct values read (values below zero get negative ordinals); the ints are kept to
// give results and messages their values back.
class TileEntries {
 public:
  // Reads an iterable of iterables of ints with the messages of the Python classes: `what` names the whole
  // ("TileSet coordinates"), `rule` the components ("components").
  TileEntries(nb::handle value, const char* what, const char* rule) {
    nb::tuple entries = finite_tuple(value, what, kWhole);
    const size_t n = nb::len(entries);
    entries_.reserve(n);
    keys_.resize(n);
    bool wide = false;
    for (size_t i = 0; i < n; ++i) {
      entries_.push_back(finite_tuple(PyTuple_GET_ITEM(entries.ptr(), static_cast<Py_ssize_t>(i)), what, i));
      const nb::tuple& entry = entries_.back();
      const size_t rank = nb::len(entry);
      keys_[i].resize(rank);
      for (size_t j = 0; j < rank; ++j) {
        nb::object v = component(PyTuple_GET_ITEM(entry.ptr(), static_cast<Py_ssize_t>(j)), what, i, j, rule);
        int overflow = 0;
        keys_[i][j] = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
        wide = wide || overflow != 0;
      }
    }
    if (wide) rank_wide_values(what, rule);
  }

  const std::vector<std::vector<int64_t>>& keys() const { return keys_; }
  // Names entry i in a message as Python writes it; only needed for ordinal keys.
  sw::TileDescriber describer() const {
    if (wide_.empty()) return {};
    return [this](size_t i) {
      const auto& values = objects_[i];
      return std::string(nb::repr(tuple_of_n(values.size(), [&](size_t k) { return values[k]; })).c_str());
    };
  }
  // The ints of keys, as a tuple.
  nb::tuple tuple_of(const std::vector<int64_t>& keys) const {
    if (wide_.empty()) return int_tuple(keys);
    return tuple_of_n(keys.size(), [&](size_t k) { return wide_[static_cast<size_t>(keys[k] + negatives_)]; });
  }
  nb::tuple tuple_of(const std::vector<std::vector<int64_t>>& entries) const {
    return tuple_of_n(entries.size(), [&](size_t k) { return tuple_of(entries[k]); });
  }

 private:
  static constexpr size_t kWhole = static_cast<size_t>(-1);

  // `value` as a tuple when it is a finite iterable (not a str or bytes); TypeError naming `what` (or its entry
  // `index`) otherwise.
  static nb::tuple finite_tuple(nb::handle value, const char* what, size_t index) {
    if (PyTuple_CheckExact(value.ptr())) return nb::borrow<nb::tuple>(value);
    if (!PyList_CheckExact(value.ptr())) {
      static PyObject* iterable = nullptr;  // kept for the process; set with the GIL held, as tiled_class
      if (!iterable) iterable = nb::object(nb::module_::import_("collections.abc").attr("Iterable")).release().ptr();
      const int is_iterable = PyObject_IsInstance(value.ptr(), iterable);
      if (is_iterable < 0) throw nb::python_error();
      if (PyUnicode_Check(value.ptr()) || PyBytes_Check(value.ptr()) || !is_iterable)
        sw::raise<sw::TypeError>(what, index == kWhole ? "" : "[" + std::to_string(index) + "]",
                                 " must be a finite iterable, got ", class_name(value));
    }
    nb::object t = nb::steal(PySequence_Tuple(value.ptr()));
    if (!t.is_valid()) throw nb::python_error();
    return nb::borrow<nb::tuple>(t);
  }
  // One component as an int: anything with __index__ but a bool.
  static nb::object component(nb::handle v, const char* what, size_t i, size_t j, const char* rule) {
    if (PyLong_CheckExact(v.ptr())) return nb::borrow(v);
    if (PyBool_Check(v.ptr()) || !PyObject_HasAttrString(v.ptr(), "__index__"))
      sw::raise<sw::TypeError>(what, "[", i, "][", j, "]: ", rule, " must be integers, got ", class_name(v));
    nb::object index = nb::steal(PyNumber_Index(v.ptr()));
    if (!index.is_valid()) throw nb::python_error();
    if (PyLong_CheckExact(index.ptr())) return index;
    nb::object exact = nb::steal(PyNumber_Long(index.ptr()));
    if (!exact.is_valid()) throw nb::python_error();
    return exact;
  }
  // Note [Tile components beyond int64]: keys become ordinals.
  void rank_wide_values(const char* what, const char* rule) {
    auto less = [](const nb::object& a, const nb::object& b) {
      return PyObject_RichCompareBool(a.ptr(), b.ptr(), Py_LT) == 1;  // ints: never fails
    };
    objects_.resize(entries_.size());
    for (size_t i = 0; i < entries_.size(); ++i)
      for (size_t j = 0; j < nb::len(entries_[i]); ++j)
        objects_[i].push_back(component(entries_[i][j], what, i, j, rule));  // read before: cannot fail
    for (const auto& entry : objects_) wide_.insert(wide_.end(), entry.begin(), entry.end());
    std::sort(wide_.begin(), wide_.end(), less);
    wide_.erase(std::unique(wide_.begin(), wide_.end(), [&](const nb::object& a, const nb::object& b) {
      return !less(a, b) && !less(b, a);
    }), wide_.end());
    nb::int_ zero(0);
    negatives_ = std::lower_bound(wide_.begin(), wide_.end(), zero, less) - wide_.begin();
    for (size_t i = 0; i < objects_.size(); ++i)
      for (size_t j = 0; j < objects_[i].size(); ++j)
        keys_[i][j] = (std::lower_bound(wide_.begin(), wide_.end(), objects_[i][j], less) - wide_.begin()) - negatives_;
  }

  std::vector<nb::tuple> entries_;                // each entry as read
  std::vector<std::vector<int64_t>> keys_;
  std::vector<std::vector<nb::object>> objects_;  // each component as an int, when one is beyond int64
  std::vector<nb::object> wide_;  // the distinct values, ascending, when one is beyond int64
  int64_t negatives_ = 0;         // how many of wide_ are below zero
};

// TileSet(coordinates): the coordinates checked and in canonical order.
nb::tuple tile_set_coordinates(nb::handle coordinates) {
  TileEntries entries(coordinates, "TileSet coordinates", "components");
  std::vector<TileCoord> tiles = entries.keys();
  sw::canonicalize_tiles(tiles, entries.describer());
  return entries.tuple_of(tiles);
}

// TileSelection(per_axis): the axes checked, as a tuple of tuples of ints.
nb::tuple selection_axes(nb::handle per_axis) {
  TileEntries axes(per_axis, "TileSelection per_axis", "tile coordinates");
  sw::check_selection_axes(axes.keys(), axes.describer());
  return axes.tuple_of(axes.keys());
}

// A TileSelection's coordinates (compact order) or tile set (canonical order), from its checked axes.
nb::tuple selection_coordinates(nb::handle per_axis, bool canonical) {
  TileEntries axes(per_axis, "TileSelection per_axis", "tile coordinates");
  return axes.tuple_of(sw::selection_tiles(axes.keys(), canonical));
}

// Components beyond int64 are out of every grid: ValueError, as for any out-of-range coordinate.
TileCoord coord_of(nb::handle coord, const char* what) {
  TileCoord out;
  for (nb::handle v : coord) out.push_back(index_value(v, what));
  return out;
}

std::vector<TileCoord> coords_of(nb::handle tile_set) {
  std::vector<TileCoord> out;
  for (nb::handle c : tile_set.attr("coordinates")) out.push_back(coord_of(c, "tile coordinate"));
  return out;
}

// Note [Policy reference cycles]. A policy that refers back to its carrier (policy.carrier = c) makes
// a cycle whose C++ edge, carrier -> PyPolicy -> policy object, the garbage collector cannot see
// without help: TiledEvictable has tp_traverse / tp_clear slots (tiled_traverse / tiled_clear below)
// that report and break that edge. A visit must stand for a reference the visiting object owns, once
// per reference, or the collector frees (clears) objects that are still reachable. So the edge is
// reported only when the Python object is the policy reference's sole owner:
//  * it owns its C++ carrier: it constructed it (an object of TiledEvictable(...): the carrier lives
//    inside it, and every C++ shared_ptr to it holds a reference to the Python object, visible to the
//    collector as an outside reference), or it wraps a carrier made in C++ (allocate_like, scatter)
//    whose only shared_ptr is the wrapper's own; and
//  * no other carrier shares the PyPolicy: allocate_like (new_like, gradients, scatter results) hands
//    the same one to the carriers it makes, and while one of them lives the policy stays reachable
//    through it, so a cycle through a shared policy is collected once the sharers are gone.
// Otherwise the edge is left out and the cycle is kept: a leak, never a wrong collection. The conditions
// change with the GIL held, or by a library thread that holds the carrier (so its Python object is
// reachable anyway) and runs allocate_like on it. One window remains: should that copy land between the
// collector's two passes over a collection, the policy object can be judged unreachable, its weak
// references cleared and its finalizer run; CPython (3.9+) then finds it resurrected and neither clears
// nor frees it. tp_clear drops the policy object but not the PyPolicy: the carrier's shared_ptr is read
// without the GIL by library threads (begin_work, allocate_like), while the object inside is only read
// and dropped with the GIL. A carrier whose policy was cleared (seen only by code that runs while the
// collector breaks a cycle) plans like a carrier without a policy, and its residency_policy is None;
// a plan() call in flight holds its own reference to the policy object and finishes normally.
class PyPolicy final : public sw::ResidencyPolicy {
 public:
  explicit PyPolicy(nb::object policy) : policy_(std::move(policy)) {}
  sw::ResidencyPlan plan(const std::vector<TileCoord>& required, const char* purpose) override {
    return call_into_python([&]() -> sw::ResidencyPlan {
      nb::object policy = policy_.obj;  // our own reference for the call: Note [Policy reference cycles]
      if (!policy.is_valid()) return {};  // cleared by the garbage collector: no policy
      nb::object result = policy.attr("plan")(tile_set_of(required), purpose);
      if (!nb::isinstance(result, residency_plan_class()))
        sw::raise<sw::TypeError>("ResidencyPolicy.plan must return a ResidencyPlan, got ", class_name(result));
      sw::ResidencyPlan plan;
      plan.promote = coords_of(result.attr("promote"));
      plan.retain = coords_of(result.attr("retain"));
      plan.evict = coords_of(result.attr("evict"));
      return plan;
    });
  }
  // With the GIL held. Null once cleared.
  nb::handle object() const { return policy_.obj; }
  // With the GIL held: the slot is emptied before the reference is dropped (that may run any code).
  void clear() { nb::object dropped = std::move(policy_.obj); }

 private:
  GilObject policy_;
};

// The PyPolicy that carrier `c` alone holds (a TiledEvictable whose policy no other carrier shares), or nullptr.
PyPolicy* sole_py_policy(const sw::Carrier& carrier) {
  auto* c = dynamic_cast<const TiledEvictable*>(&carrier);
  if (c == nullptr) return nullptr;
  const std::shared_ptr<sw::ResidencyPolicy>& p = c->policy();
  if (!p || p.use_count() != 1) return nullptr;
  return dynamic_cast<PyPolicy*>(p.get());
}

// The PyPolicy whose object reference `self` (a ready TiledEvictable) solely owns, or nullptr:
// Note [Policy reference cycles]. Called by the collector with the GIL held; allocates nothing.
PyPolicy* owned_policy(PyObject* self) {
  if (!nb::inst_ready(self)) return nullptr;
  auto* c = nb::inst_ptr<TiledEvictable>(self);
  const bool constructed_here = nb::inst_state(self).second;  // destroys its carrier: owns it
  if (!constructed_here && c->weak_from_this().use_count() != 1) return nullptr;
  return sole_py_policy(*c);
}

int tiled_traverse(PyObject* self, visitproc visit, void* arg) {
  Py_VISIT(Py_TYPE(self));  // instances of heap types own a reference to their type
  if (PyPolicy* p = owned_policy(self)) Py_VISIT(p->object().ptr());
  return 0;
}

int tiled_clear(PyObject* self) {
  if (PyPolicy* p = owned_policy(self)) p->clear();
  return 0;
}

PyType_Slot tiled_slots[] = {{Py_tp_traverse, (void*)tiled_traverse}, {Py_tp_clear, (void*)tiled_clear}, {0, nullptr}};

std::vector<int64_t> shape_arg(nb::handle h, const char* what) {
  if (nb::isinstance<sw::Shape>(h)) return nb::cast<const sw::Shape&>(h).extents();
  if (PyUnicode_Check(h.ptr()) || is_index(h))
    sw::raise<sw::TypeError>(what, " must be an iterable of ints");
  std::vector<int64_t> out;
  nb::object it;
  try {
    it = nb::iter(h);
  } catch (nb::python_error&) {
    sw::raise<sw::TypeError>(what, " must be an iterable of ints, got ", nb::cast<std::string>(h.type().attr("__name__")));
  }
  for (nb::handle v : h) out.push_back(index_value(v, what));
  return out;
}

sw::TileSelection selection_of(nb::handle sel, const char* what) {
  if (!nb::isinstance(sel, tile_selection_class()))
    sw::raise<sw::TypeError>(what, ": selection must be a TileSelection, got ", class_name(sel));
  sw::TileSelection out;
  for (nb::handle axis : sel.attr("per_axis")) out.per_axis.push_back(coord_of(axis, "TileSelection coordinate"));
  return out;
}

// Binds a TileSet / TileSelection argument to the carrier's grid (tile indices). A TileSelection is bound per axis
// by the core, as project binds it: its ranges are checked before its Cartesian product is enumerated (a
// 10**4 x 10**4 selection of a 2 x 2 grid is refused at once, with project's words, instead of building 10**8
// coordinates). A TileSet's coordinates are checked as they are read: the first out of range stops the binding.
std::vector<int64_t> bind_tiles(const TiledEvictable& c, nb::handle tiles, const char* what) {
  const bool is_set = nb::isinstance(tiles, tile_set_class());
  if (!is_set && !nb::isinstance(tiles, tile_selection_class()))
    sw::raise<sw::TypeError>(what, ": tiles must be a TileSet or a TileSelection, got ", class_name(tiles));
  c.check_live(what);
  if (!is_set) return sw::bind_selection(c, selection_of(tiles, what));
  std::vector<int64_t> out;
  for (nb::handle t : tiles.attr("coordinates")) out.push_back(c.tile_index(coord_of(t, "tile coordinate")));
  return out;
}

sw::TensorPtr tensor_of(nb::handle h, const char* what) {
  if (nb::isinstance<AwaitHandle>(h))
    sw::raise<sw::TypeError>(what, " is a pending ", nb::cast<std::string>(h.type().attr("__name__")),
                             ", not a Tensor; call wait() first");
  if (!nb::isinstance<sw::TensorImpl>(h))
    sw::raise<sw::TypeError>(what, " must be a Tensor, got ", nb::cast<std::string>(h.type().attr("__name__")));
  return nb::cast<sw::TensorPtr>(h);
}

template <class H>
nb::object tensor_handle(sw::CompletionPtr<sw::TensorPtr> c) {
  auto* h = new H();
  h->state = c;
  h->result = [c]() { return nb::cast(c->value()); };
  return nb::cast(h, nb::rv_policy::take_ownership);
}

// Stub types of the signatures below (nanobind's stubgen writes them into the package's .pyi).
#define TILED "strideweave.carriers.tiled_evictable"
#define INTS "collections.abc.Iterable[int]"
#define TILES TILED ".TileSet | " TILED ".TileSelection"
#define COORDS "tuple[tuple[int, ...], ...]"
using IntsTuple = nb::typed<nb::tuple, int, nb::ellipsis>;

// handle.wait() of a fresh handle (the blocking forms of the residency requests).
void wait_for(nb::object handle) { nb::cast<AwaitHandle&>(handle).wait_py(); }

nb::object residency_handle(sw::CompletionPtr<std::monostate> c) {
  auto* h = new AwaitResidency();
  h->state = c;
  h->result = [c]() {
    c->value();
    return nb::none();
  };
  return nb::cast(h, nb::rv_policy::take_ownership);
}

}  // namespace

// cycles.hpp: the policy object of a carrier that a Tensor solely owns (Note [Tensor reference cycles]).
PyObject* sole_policy_object(const sw::Carrier& carrier) {
  PyPolicy* p = sole_py_policy(carrier);
  return p ? p->object().ptr() : nullptr;
}

void clear_sole_policy(const sw::Carrier& carrier) {
  if (PyPolicy* p = sole_py_policy(carrier)) p->clear();
}

void bind_tiled(nb::module_& m) {
  sw::install_tiled_backend();
  // Note [Dirty tiles are never discarded silently] (cpp/src/tiled/durability.cpp). Registered before the module's exit
  // drain (module.cpp), so it runs after it (atexit calls last-registered first): held transfers have landed, and a
  // dirty tile evicted just before exit is clean and not counted.
  sw::TiledEvictable::set_discard_reporter(&report_discard);
  nb::module_::import_("atexit").attr("register")(nb::cpp_function([] {
    for (const std::string& warning : sw::TiledEvictable::exit_discard_warnings())
      if (PyErr_WarnEx(PyExc_ResourceWarning, warning.c_str(), 1) < 0) PyErr_WriteUnraisable(nullptr);
  }));
  nb::class_<AwaitResidency, AwaitHandle>(m, "AwaitResidency", nb::type_slots(await_slots),
                                          "AwaitResult[None] of a residency request.")
      .def("__init__", [](AwaitResidency*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("AwaitResidency handles are created by the framework, not constructed directly");
      })
      // The same wait, declared again only so that its signature names the result (None).
      .def("wait", &AwaitHandle::wait_py, nb::sig("def wait(self) -> None"),
           "Blocks until terminal (interruptibly, without the GIL); returns None or raises the failure.");
  nb::class_<AwaitProjection, AwaitHandle>(m, "AwaitProjection", nb::type_slots(await_slots),
                                           "AwaitResult[Tensor] of TiledEvictable.project.")
      .def("__init__", [](AwaitProjection*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("AwaitProjection handles are created by the framework, not constructed directly");
      })
      // The same wait, declared again only so that its signature names the result (the compact Tensor).
      .def("wait", &AwaitHandle::wait_py, nb::sig("def wait(self) -> Tensor"),
           "Blocks until terminal (interruptibly, without the GIL); returns the compact Tensor or raises the failure.");

  // Note [One residency budget] (strideweave/tiled/residency_budget.hpp).
  nb::class_<sw::ResidencyBudget>(m, "ResidencyBudget", nb::is_final(),
                                  "ResidencyBudget(max_bytes): one bound on the resident tile bytes of every "
                                  "TiledEvictable drawing from it (weights and their gradients together).")
      .def("__init__", [](sw::ResidencyBudget* self, nb::handle max_bytes) {
        if (PyBool_Check(max_bytes.ptr()) || !PyLong_Check(max_bytes.ptr()))
          sw::raise<sw::TypeError>("ResidencyBudget: max_bytes must be an int, got ", class_name(max_bytes));
        // An int beyond int64 is refused by its sign, with the accepted range, before any conversion.
        int overflow = 0;
        const long long n = PyLong_AsLongLongAndOverflow(max_bytes.ptr(), &overflow);
        if (overflow) {
          const size_t bits = _PyLong_NumBits(max_bytes.ptr());  // a long int is not printed whole
          const std::string got = bits <= 256 ? std::string(nb::str(max_bytes).c_str())
                                              : (overflow < 0 ? "a negative int of " : "an int of ") +
                                                    std::to_string(bits) + " bits";
          if (overflow > 0)
            sw::raise<sw::OverflowError>("ResidencyBudget: max_bytes must be a byte count from 1 to ", INT64_MAX,
                                         ", got ", got);
          sw::raise<sw::ValueError>("ResidencyBudget: max_bytes must be >= 1 (a byte count from 1 to ", INT64_MAX,
                                    "), got ", got);
        }
        new (self) sw::ResidencyBudget(n);
      }, nb::arg("max_bytes"), nb::sig("def __init__(self, max_bytes: int) -> None"))
      .def_prop_ro("max_bytes", &sw::ResidencyBudget::max_bytes)
      .def("stats", [](const sw::ResidencyBudget& b) {
        sw::BudgetStats s = b.stats();
        nb::typed<nb::dict, std::string, int64_t> d;
        d["max_bytes"] = s.max_bytes;
        d["resident_tiles"] = s.resident_tiles;
        d["resident_bytes"] = s.resident_bytes;
        d["peak_tiles"] = s.peak_tiles;
        d["peak_bytes"] = s.peak_bytes;
        d["evictions"] = s.evictions;
        d["members"] = s.members;
        d["write_behind_limit"] = s.write_behind_limit;
        d["write_behind_tiles"] = s.write_behind_tiles;
        d["write_behind_bytes"] = s.write_behind_bytes;
        d["write_behind_evictions"] = s.write_behind_evictions;
        d["write_behind_cancelled"] = s.write_behind_cancelled;
        d["write_behind_failures"] = s.write_behind_failures;
        d["eviction_waits"] = s.eviction_waits;
        d["eviction_wait_ns"] = s.eviction_wait_ns;
        d["write_behind_waits"] = s.write_behind_waits;
        d["write_behind_wait_ns"] = s.write_behind_wait_ns;
        return d;
      }, "Resident tiles and bytes under the budget now and at their peak (since construction or reset_peak()), "
         "tiles the budget evicted to make room, and live member carriers; write-behind (Note [Write-behind "
         "evictions]): the queue's bound, the tiles and bytes queued or being written now, tiles evicted that way, "
         "queued tiles taken back, failed writes; and the waits on evictions (count, nanoseconds), of which those "
         "for queued writes.")
      .def_prop_rw("write_behind_bytes", &sw::ResidencyBudget::write_behind_bytes,
                   [](sw::ResidencyBudget& b, int64_t bytes) { b.set_write_behind_bytes(bytes); },
                   "Bound in bytes on the dirty tiles written ahead on the I/O threads at once (default max_bytes // 8; "
                   "0 turns write-behind off and evictions are written in the thread that needs the room).")
      .def("reset_peak", &sw::ResidencyBudget::reset_peak, "Restarts the peaks from what is resident now.")
      .def("__repr__", [](const sw::ResidencyBudget& b) {
        return "ResidencyBudget(max_bytes=" + std::to_string(b.max_bytes()) + ")";
      });

  nb::class_<TiledEvictable, sw::DependentCarrier>(m, "TiledEvictable", nb::is_final(), nb::type_slots(tiled_slots),
                                                   "TiledEvictable(primary, secondary, grid_shape, tile_shape, *, "
                                                   "residency_policy=None, residency_budget=None): one logical "
                                                   "extent, tiled and tiered.")
      .def("__init__", [](TiledEvictable* self, nb::handle primary, nb::handle secondary, nb::handle grid,
                          nb::handle tile, nb::handle policy, nb::handle budget) {
        if (!nb::isinstance<sw::Carrier>(primary) || !nb::isinstance<sw::Carrier>(secondary))
          sw::raise<sw::TypeError>("TiledEvictable primary and secondary must be Carrier instances");
        std::vector<int64_t> g = shape_arg(grid, "grid_shape"), t = shape_arg(tile, "tile_shape");
        std::shared_ptr<PyPolicy> p;
        if (!policy.is_none()) {
          nb::object protocol = tiled_module().attr("ResidencyPolicy");
          if (!nb::isinstance(policy, protocol) || !PyCallable_Check(nb::getattr(policy, "plan", nb::none()).ptr()))
            sw::raise<sw::TypeError>("residency_policy must satisfy the ResidencyPolicy protocol: its plan(required, "
                                     "purpose) must be callable");
          p = std::make_shared<PyPolicy>(nb::borrow(policy));
        }
        std::shared_ptr<sw::ResidencyBudget> b;
        if (!budget.is_none()) {
          if (!nb::isinstance<sw::ResidencyBudget>(budget))
            sw::raise<sw::TypeError>("residency_budget must be a ResidencyBudget or None, got ",
                                     nb::type_name(budget.type()).c_str());
          b = nb::cast<std::shared_ptr<sw::ResidencyBudget>>(budget);
        }
        new (self) TiledEvictable(nb::cast<sw::CarrierPtr>(primary), nb::cast<sw::CarrierPtr>(secondary), g, t, p);
        if (b) {
          try {
            self->set_residency_budget(std::move(b));
          } catch (...) {
            self->~TiledEvictable();  // not constructed as far as Python knows: undone here (it leaves the budget)
            throw;
          }
        }
      }, nb::arg("primary"), nb::arg("secondary"), nb::arg("grid_shape"), nb::arg("tile_shape"), nb::kw_only(),
         nb::arg("residency_policy") = nb::none(), nb::arg("residency_budget") = nb::none(),
         nb::sig("def __init__(self, primary: Carrier, secondary: Carrier, grid_shape: " INTS ", tile_shape: " INTS
                 ", *, residency_policy: " TILED ".ResidencyPolicy | None = None, residency_budget: ResidencyBudget "
                 "| None = None) -> None"))
      .def_prop_ro("residency_budget", [](const TiledEvictable& c) { return c.residency_budget(); },
                   nb::sig("def residency_budget(self) -> ResidencyBudget | None"))
      .def("set_residency_budget", [](std::shared_ptr<TiledEvictable> c, std::shared_ptr<sw::ResidencyBudget> b) {
        nb::gil_scoped_release unlocked;  // may evict (I/O)
        c->set_residency_budget(std::move(b));
      }, nb::arg("budget"), nb::sig("def set_residency_budget(self, budget: ResidencyBudget) -> None"),
         "Draws from `budget` from now on (with every carrier derived from this one: its gradients); evicts down to "
         "the bound when the resident tiles exceed it. RuntimeError when it already draws from another budget.")
      .def_prop_ro("primary", [](const TiledEvictable& c) { return c.primary(); })
      .def_prop_ro("secondary", [](const TiledEvictable& c) { return c.secondary(); })
      .def_prop_ro("grid_shape", [](const TiledEvictable& c) { return nb::borrow<IntsTuple>(int_tuple(c.grid_shape())); })
      .def_prop_ro("tile_shape", [](const TiledEvictable& c) { return nb::borrow<IntsTuple>(int_tuple(c.tile_shape())); })
      .def_prop_ro("logical_shape", [](const TiledEvictable& c) { return nb::borrow<IntsTuple>(int_tuple(c.logical_shape())); })
      .def_prop_ro("residency_policy", [](const TiledEvictable& c) -> nb::object {
        auto p = std::dynamic_pointer_cast<PyPolicy>(c.policy());
        return p && p->object().is_valid() ? nb::borrow(p->object()) : nb::none();
      }, nb::sig("def residency_policy(self) -> " TILED ".ResidencyPolicy | None"))
      .def_prop_ro("primary_tiles", [](const TiledEvictable& c) {
        return tile_set_of(c.tiles_where([](const sw::TileState& s) { return s.location == sw::TileLocation::Primary; }));
      }, nb::sig("def primary_tiles(self) -> " TILED ".TileSet"))
      .def_prop_ro("secondary_tiles", [](const TiledEvictable& c) {
        return tile_set_of(c.tiles_where([](const sw::TileState& s) { return s.location == sw::TileLocation::Secondary; }));
      }, nb::sig("def secondary_tiles(self) -> " TILED ".TileSet"))
      .def_prop_ro("valid_tiles", [](const TiledEvictable& c) {
        return tile_set_of(c.tiles_where([](const sw::TileState& s) { return s.valid; }));
      }, nb::sig("def valid_tiles(self) -> " TILED ".TileSet"))
      .def_prop_ro("dirty_tiles", [](const TiledEvictable& c) {
        return tile_set_of(c.tiles_where([](const sw::TileState& s) { return s.dirty; }));
      }, nb::sig("def dirty_tiles(self) -> " TILED ".TileSet"))
      .def("tile_state", [](const TiledEvictable& c, nb::handle coord) {
        if (PyUnicode_Check(coord.ptr()) || is_index(coord)) sw::raise<sw::TypeError>("tile_state takes a tile coordinate tuple");
        TileCoord t;
        for (nb::handle v : coord) t.push_back(index_value(v, "tile coordinate"));
        c.check_live("read tile states");
        sw::TileState s = c.tile_state(t);
        return tiled_module().attr("TileState")(sw::location_name(s.location), s.valid, s.dirty);
      }, nb::arg("coord"), nb::sig("def tile_state(self, coord: " INTS ") -> " TILED ".TileState"))
      .def("stats", [](const TiledEvictable& c) {
        sw::TiledStats s = c.stats();
        nb::typed<nb::dict, std::string, int64_t> d;
        d["promotions"] = s.promotions;
        d["evictions"] = s.evictions;
        d["bytes_promoted"] = s.bytes_promoted;
        d["bytes_evicted"] = s.bytes_evicted;
        d["writes_skipped"] = s.writes_skipped;
        d["primary_tiles"] = s.primary_tiles;
        d["primary_bytes"] = s.primary_bytes;
        d["flushes"] = s.flushes;
        d["bytes_flushed"] = s.bytes_flushed;
        return d;
      }, "Residency counters: promotions, evictions, bytes promoted/evicted, writes skipped, resident tiles/bytes, "
         "tiles and bytes written clean by flushes. Only transitions that happened count.")
      // The receiver is taken as a shared_ptr: queued transfers keep the carrier alive.
      .def("promote_async", [](std::shared_ptr<TiledEvictable> c, nb::handle tiles) {
        return residency_handle(c->promote_async(bind_tiles(*c, tiles, "promote_async")));
      }, nb::arg("tiles"), nb::sig("def promote_async(self, tiles: " TILES ") -> AwaitResidency"))
      .def("evict_async", [](std::shared_ptr<TiledEvictable> c, nb::handle tiles) {
        return residency_handle(c->evict_async(bind_tiles(*c, tiles, "evict_async")));
      }, nb::arg("tiles"), nb::sig("def evict_async(self, tiles: " TILES ") -> AwaitResidency"))
      // Note [Taking turns] (cpp/src/tiled/residency.cpp): the blocking forms wait in line for tiles other work
      // holds, without the GIL, instead of refusing.
      .def("promote", [](std::shared_ptr<TiledEvictable> c, nb::handle tiles) {
        std::vector<int64_t> idx = bind_tiles(*c, tiles, "promote_async");
        sw::CompletionPtr<std::monostate> done;
        {
          nb::gil_scoped_release nogil;
          done = c->promote_in_turn(idx);
        }
        wait_for(residency_handle(std::move(done)));
      }, nb::arg("tiles"), nb::sig("def promote(self, tiles: " TILES ") -> None"),
         "``promote_async(tiles).wait()``, except that tiles under another caller's incomplete request, or held by "
         "a gradient sum or an optimizer step, are waited for in turn (first come, first served among the callers "
         "that wait; at most ``strideweave.turn_wait_limit()`` seconds, then RuntimeError) instead of refused.")
      .def("evict", [](std::shared_ptr<TiledEvictable> c, nb::handle tiles) {
        std::vector<int64_t> idx = bind_tiles(*c, tiles, "evict_async");
        sw::CompletionPtr<std::monostate> done;
        {
          nb::gil_scoped_release nogil;
          done = c->evict_in_turn(idx);
        }
        wait_for(residency_handle(std::move(done)));
      }, nb::arg("tiles"), nb::sig("def evict(self, tiles: " TILES ") -> None"),
         "``evict_async(tiles).wait()``, except that tiles another caller's request, a sum, a step or running "
         "tiled work holds are waited for in turn (at most ``strideweave.turn_wait_limit()`` seconds, then "
         "RuntimeError) instead of refused.")
      .def("flush", [](std::shared_ptr<TiledEvictable> c) {
        sw::CompletionPtr<std::monostate> done;
        {
          nb::gil_scoped_release nogil;
          done = c->flush_in_turn();
        }
        wait_for(residency_handle(std::move(done)));
      }, "``flush_async().wait()``, waiting in turn for tiles under other requests, sums or steps (at most "
         "``strideweave.turn_wait_limit()`` seconds) instead of refusing: every dirty tile is in the secondary tier, "
         "durably, and clean (still resident).")
      .def("flush_async", [](std::shared_ptr<TiledEvictable> c) { return residency_handle(c->flush_async()); },
           nb::sig("def flush_async(self) -> AwaitResidency"),
           "Writes every dirty tile to the secondary tier, makes that tier durable (fsync of its file or device) and "
           "marks the tiles clean; they stay resident. Returns an AwaitResidency; flush() is flush_async().wait(). "
           "Refused with RuntimeError ('wait') while any tile has an incomplete residency request, and before anything "
           "changes when dirty tiles meet a read-only secondary tier (created with mutable=False). A failed write or "
           "fsync fails the handle with RuntimeError naming the call, the file and the errno, and leaves every tile "
           "dirty and resident.")
      .def("release", [](TiledEvictable& c) {
        c.release();
        // Note [Dirty tiles are never discarded silently]: after the release, so an error filter raises from here.
        std::string warning = c.take_release_discard_warning();
        if (!warning.empty() && PyErr_WarnEx(PyExc_ResourceWarning, warning.c_str(), 1) < 0) throw nb::python_error();
      }, "Frees every tile and both tiers; idempotent. RuntimeError while work on the carrier is incomplete. "
         "Dirty tiles are discarded: when the secondary tier is a file you named, that emits a ResourceWarning "
         "with their count; flush() first to keep them.")
      .def("project", [](std::shared_ptr<TiledEvictable> c, nb::handle tensor, nb::handle selection,
                         nb::handle destination, bool tile_major) {
        sw::TensorPtr t = tensor_of(tensor, "project: tensor");
        sw::TileSelection sel = selection_of(selection, "project");
        sw::CarrierPtr dest;
        if (!destination.is_none()) {
          if (!nb::isinstance<sw::Carrier>(destination))
            sw::raise<sw::TypeError>("project: destination must be a Carrier instance or None, got ",
                                     nb::cast<std::string>(destination.type().attr("__name__")));
          dest = nb::cast<sw::CarrierPtr>(destination);
        }
        return tensor_handle<AwaitProjection>(sw::project(c, t, sel, dest, tile_major));
      }, nb::arg("tensor").none(), nb::arg("selection").none(), nb::arg("destination").none() = nb::none(),
         nb::kw_only(), nb::arg("tile_major") = false,
         nb::sig("def project(self, tensor: Tensor, selection: " TILED ".TileSelection, destination: Carrier | None "
                 "= None, *, tile_major: bool = False) -> AwaitProjection"),
         "Gathers the selected tiles of the full `tensor` into a compact dense tensor; returns an AwaitProjection. "
         "tile_major=True keeps each tile's values together where the tiles are not column-major (a nested mode "
         "(tile extent, count)): one copy per tile.")
      .def("scatter", [](std::shared_ptr<TiledEvictable> c, nb::handle compact, nb::handle templ, nb::handle selection,
                         nb::handle reduction) {
        sw::TensorPtr ct = tensor_of(compact, "scatter: compact");
        sw::TensorPtr tt = tensor_of(templ, "scatter: template");
        sw::TileSelection sel = selection_of(selection, "scatter");
        if (!PyUnicode_Check(reduction.ptr())) sw::raise<sw::ValueError>("scatter: reduction must be 'replace' or 'add'");
        std::string r = nb::cast<std::string>(reduction);
        if (r != "replace" && r != "add")
          sw::raise<sw::ValueError>("scatter: reduction must be 'replace' or 'add', got '", r, "'");
        return tensor_handle<AwaitMove>(sw::scatter(c, ct, tt, sel, r == "add"));
      }, nb::arg("compact").none(), nb::arg("template").none(), nb::arg("selection").none(),
         nb::arg("reduction").none() = "replace",
         nb::sig("def scatter(self, compact: Tensor, template: Tensor, selection: " TILED ".TileSelection, "
                 "reduction: typing.Literal['replace', 'add'] = 'replace') -> AwaitMove"),
         "Writes `compact` into the selected tiles of a fresh full-shaped TiledEvictable; returns an AwaitMove. "
         "reduction='add' adds the template's selected values as `add` does; where add's result dtype is not "
         "the carrier's (Bool + Bool is Float32) it raises TypeError before any work.")
      .def("_check_footprints", [](const TiledEvictable& c, const sw::TensorImpl& t) { c.check_footprints(t); });
  // The most tiles a TiledEvictable has (Note [Tile table limits]): a selection naming more is out of every grid.
  m.attr("_TILED_MAX_TILES") = TiledEvictable::kMaxTiles;

  // The request values' C++ half (strideweave.carriers.tiled_evictable): each call crosses into C++ once.
  m.def("_run_copy_path", [] { return std::string(sw::run_copy_path()); },
        "The kernel that copies tiles' runs: 'avx512f' or 'portable' (internal: tests and benchmarks).");
  m.def("_force_portable_run_copies", [](bool portable) { return sw::force_portable_run_copies(portable); },
        nb::arg("portable"), "Makes every tile run copy a memcpy; returns the previous setting (internal).");
  m.def("set_turn_wait_limit", [](double seconds) { TiledEvictable::set_turn_wait_limit(seconds); },
        nb::arg("seconds"),
        "The longest one blocking residency call (TiledEvictable promote / evict / flush) or an optimizer step waits "
        "in turn for tiles that other work holds, in seconds (default 60), process-wide; then RuntimeError, nothing "
        "changed. ValueError unless positive and finite.");
  m.def("turn_wait_limit", [] { return TiledEvictable::turn_wait_limit(); },
        "The bound, in seconds, set by set_turn_wait_limit.");
  m.def("_set_caller_gather_bytes", [](int64_t bytes) { return sw::set_caller_gather_bytes(bytes); }, nb::arg("bytes"),
        "The largest projection copy gathered before project returns (0: every gather on the selection threads); "
        "returns the previous (internal: tests and benchmarks).");
  m.def("_tile_set_coordinates", &tile_set_coordinates, nb::arg("coordinates").none(),
        nb::sig("def _tile_set_coordinates(coordinates: collections.abc.Iterable[" INTS "]) -> " COORDS),
        "TileSet's coordinates: checked (TypeError / ValueError with TileSet's messages) and in canonical order.");
  m.def("_selection_axes", &selection_axes, nb::arg("per_axis").none(),
        nb::sig("def _selection_axes(per_axis: collections.abc.Iterable[" INTS "]) -> " COORDS),
        "TileSelection's axes, checked (TypeError / ValueError with TileSelection's messages).");
  m.def("_selection_coordinates", [](nb::handle per_axis) { return selection_coordinates(per_axis, false); },
        nb::arg("per_axis"), nb::sig("def _selection_coordinates(per_axis: " COORDS ") -> " COORDS),
        "A TileSelection's coordinates (checked axes) in compact order: first axis fastest.");
  m.def("_selection_tile_set", [](nb::handle per_axis) {
    return canonical_tile_set(selection_coordinates(per_axis, true));
  }, nb::arg("per_axis"), nb::sig("def _selection_tile_set(per_axis: " COORDS ") -> " TILED ".TileSet"),
        "The TileSet of a TileSelection (checked axes), enumerated in canonical order.");
}

#undef TILED
#undef INTS
#undef TILES
#undef COORDS

// sparse MoE block: its prefetch returns a residency request's handle
nb::object residency_await(sw::CompletionPtr<std::monostate> c) { return residency_handle(std::move(c)); }

}  // namespace swpy
