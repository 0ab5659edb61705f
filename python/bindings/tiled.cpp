// TiledEvictable and AwaitResidency.
#include <algorithm>
#include <optional>
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include "common.hpp"
#include "completion_py.hpp"
#include "extension.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/grad_mode.hpp"
#include "strideweave/tiled/data.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace swpy {

namespace {

using sw::TiledEvictable;
using sw::TileCoord;

struct AwaitResidency : AwaitHandle {};
struct AwaitProjection : AwaitHandle {};

nb::module_ tiled_module() { return nb::module_::import_("strideweave.carriers.tiled_evictable"); }

// Note [Dirty tiles are never discarded silently] (tiled_evictable.cpp): the engine decides and counts; these
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

// The core's coordinates are valid, of one rank and distinct: sorted into TileSet's order (first axis fastest)
// they skip the constructor's per-coordinate checks.
nb::object tile_set_of(const std::vector<TileCoord>& coords) {
  std::vector<const TileCoord*> order;
  order.reserve(coords.size());
  for (const auto& c : coords) order.push_back(&c);
  std::sort(order.begin(), order.end(), [](const TileCoord* a, const TileCoord* b) {
    return std::lexicographical_compare(a->rbegin(), a->rend(), b->rbegin(), b->rend());
  });
  nb::list items;
  for (const TileCoord* c : order) items.append(nb::tuple(nb::cast(*c)));
  return tiled_module().attr("TileSet").attr("_from_canonical")(nb::tuple(items));
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
    GilAcquire gil;
    sw::GradModeGuard off(false);
    nb::object policy = policy_.obj;  // our own reference for the call: Note [Policy reference cycles]
    if (!policy.is_valid()) return {};  // cleared by the garbage collector: no policy
    nb::module_ mod = tiled_module();
    nb::object result = policy.attr("plan")(tile_set_of(required), purpose);
    if (!nb::isinstance(result, mod.attr("ResidencyPlan")))
      sw::raise<sw::TypeError>("ResidencyPolicy.plan must return a ResidencyPlan, got ",
                               nb::cast<std::string>(result.type().attr("__name__")));
    sw::ResidencyPlan plan;
    plan.promote = coords_of(result.attr("promote"));
    plan.retain = coords_of(result.attr("retain"));
    plan.evict = coords_of(result.attr("evict"));
    return plan;
  }
  // With the GIL held. Null once cleared.
  nb::handle object() const { return policy_.obj; }
  // With the GIL held: the slot is emptied before the reference is dropped (that may run any code).
  void clear() { nb::object dropped = std::move(policy_.obj); }

 private:
  GilObject policy_;
};

// The PyPolicy whose object reference `self` (a ready TiledEvictable) solely owns, or nullptr:
// Note [Policy reference cycles]. Called by the collector with the GIL held; allocates nothing.
PyPolicy* owned_policy(PyObject* self) {
  if (!nb::inst_ready(self)) return nullptr;
  auto* c = nb::inst_ptr<TiledEvictable>(self);
  const bool constructed_here = nb::inst_state(self).second;  // destroys its carrier: owns it
  if (!constructed_here && c->weak_from_this().use_count() != 1) return nullptr;
  const std::shared_ptr<sw::ResidencyPolicy>& p = c->policy();
  if (!p || p.use_count() != 1) return nullptr;
  return dynamic_cast<PyPolicy*>(p.get());
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
  if (!nb::isinstance(sel, tiled_module().attr("TileSelection")))
    sw::raise<sw::TypeError>(what, ": selection must be a TileSelection, got ",
                             nb::cast<std::string>(sel.type().attr("__name__")));
  sw::TileSelection out;
  for (nb::handle axis : sel.attr("per_axis")) out.per_axis.push_back(coord_of(axis, "TileSelection coordinate"));
  return out;
}

// Binds a TileSet / TileSelection argument to the carrier's grid (tile indices). A TileSelection is bound per axis
// by the core, as project binds it: its ranges are checked before its Cartesian product is enumerated (a
// 10**4 x 10**4 selection of a 2 x 2 grid is refused at once, with project's words, instead of building 10**8
// coordinates). A TileSet's coordinates are checked as they are read: the first out of range stops the binding.
std::vector<int64_t> bind_tiles(const TiledEvictable& c, nb::handle tiles, const char* what) {
  nb::module_ mod = tiled_module();
  const bool is_set = nb::isinstance(tiles, mod.attr("TileSet"));
  if (!is_set && !nb::isinstance(tiles, mod.attr("TileSelection")))
    sw::raise<sw::TypeError>(what, ": tiles must be a TileSet or a TileSelection, got ",
                             nb::cast<std::string>(tiles.type().attr("__name__")));
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

void bind_tiled(nb::module_& m) {
  sw::install_tiled_backend();
  // Note [Dirty tiles are never discarded silently] (tiled_evictable.cpp). Registered before the module's exit
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
      });
  nb::class_<AwaitProjection, AwaitHandle>(m, "AwaitProjection", nb::type_slots(await_slots),
                                           "AwaitResult[Tensor] of TiledEvictable.project.")
      .def("__init__", [](AwaitProjection*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("AwaitProjection handles are created by the framework, not constructed directly");
      });

  nb::class_<TiledEvictable, sw::DependentCarrier>(m, "TiledEvictable", nb::is_final(), nb::type_slots(tiled_slots),
                                                   "TiledEvictable(primary, secondary, grid_shape, tile_shape, *, "
                                                   "residency_policy=None): one logical extent, tiled and tiered.")
      .def("__init__", [](TiledEvictable* self, nb::handle primary, nb::handle secondary, nb::handle grid,
                          nb::handle tile, nb::handle policy) {
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
        new (self) TiledEvictable(nb::cast<sw::CarrierPtr>(primary), nb::cast<sw::CarrierPtr>(secondary), g, t, p);
      }, nb::arg("primary"), nb::arg("secondary"), nb::arg("grid_shape"), nb::arg("tile_shape"), nb::kw_only(),
         nb::arg("residency_policy") = nb::none())
      .def_prop_ro("primary", [](const TiledEvictable& c) { return c.primary(); })
      .def_prop_ro("secondary", [](const TiledEvictable& c) { return c.secondary(); })
      .def_prop_ro("grid_shape", [](const TiledEvictable& c) { return nb::tuple(nb::cast(c.grid_shape())); })
      .def_prop_ro("tile_shape", [](const TiledEvictable& c) { return nb::tuple(nb::cast(c.tile_shape())); })
      .def_prop_ro("logical_shape", [](const TiledEvictable& c) { return nb::tuple(nb::cast(c.logical_shape())); })
      .def_prop_ro("residency_policy", [](const TiledEvictable& c) -> nb::object {
        auto p = std::dynamic_pointer_cast<PyPolicy>(c.policy());
        return p && p->object().is_valid() ? nb::borrow(p->object()) : nb::none();
      })
      .def_prop_ro("primary_tiles", [](const TiledEvictable& c) {
        return tile_set_of(c.tiles_where([](const sw::TileState& s) { return s.location == sw::TileLocation::Primary; }));
      })
      .def_prop_ro("secondary_tiles", [](const TiledEvictable& c) {
        return tile_set_of(c.tiles_where([](const sw::TileState& s) { return s.location == sw::TileLocation::Secondary; }));
      })
      .def_prop_ro("valid_tiles", [](const TiledEvictable& c) {
        return tile_set_of(c.tiles_where([](const sw::TileState& s) { return s.valid; }));
      })
      .def_prop_ro("dirty_tiles", [](const TiledEvictable& c) {
        return tile_set_of(c.tiles_where([](const sw::TileState& s) { return s.dirty; }));
      })
      .def("tile_state", [](const TiledEvictable& c, nb::handle coord) {
        if (PyUnicode_Check(coord.ptr()) || is_index(coord)) sw::raise<sw::TypeError>("tile_state takes a tile coordinate tuple");
        TileCoord t;
        for (nb::handle v : coord) t.push_back(index_value(v, "tile coordinate"));
        c.check_live("read tile states");
        sw::TileState s = c.tile_state(t);
        return tiled_module().attr("TileState")(sw::location_name(s.location), s.valid, s.dirty);
      }, nb::arg("coord"))
      .def("stats", [](const TiledEvictable& c) {
        sw::TiledStats s = c.stats();
        nb::dict d;
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
      }, nb::arg("tiles"))
      .def("evict_async", [](std::shared_ptr<TiledEvictable> c, nb::handle tiles) {
        return residency_handle(c->evict_async(bind_tiles(*c, tiles, "evict_async")));
      }, nb::arg("tiles"))
      .def("flush_async", [](std::shared_ptr<TiledEvictable> c) { return residency_handle(c->flush_async()); },
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
                         nb::handle destination) {
        sw::TensorPtr t = tensor_of(tensor, "project: tensor");
        sw::TileSelection sel = selection_of(selection, "project");
        sw::CarrierPtr dest;
        if (!destination.is_none()) {
          if (!nb::isinstance<sw::Carrier>(destination))
            sw::raise<sw::TypeError>("project: destination must be a Carrier instance or None, got ",
                                     nb::cast<std::string>(destination.type().attr("__name__")));
          dest = nb::cast<sw::CarrierPtr>(destination);
        }
        return tensor_handle<AwaitProjection>(sw::project(c, t, sel, dest));
      }, nb::arg("tensor").none(), nb::arg("selection").none(), nb::arg("destination").none() = nb::none(),
         "Gathers the selected tiles of the full `tensor` into a compact dense tensor; returns an AwaitProjection.")
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
         "Writes `compact` into the selected tiles of a fresh full-shaped TiledEvictable; returns an AwaitMove. "
         "reduction='add' adds the template's selected values as `add` does; where add's result dtype is not "
         "the carrier's (Bool + Bool is Float32) it raises TypeError before any work.")
      .def("_check_footprints", [](const TiledEvictable& c, const sw::TensorImpl& t) { c.check_footprints(t); });
  // The most tiles a TiledEvictable has (Note [Tile table limits]): a selection naming more is out of every grid.
  m.attr("_TILED_MAX_TILES") = TiledEvictable::kMaxTiles;
}

}  // namespace swpy
