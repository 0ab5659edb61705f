// User-defined carrier kinds: the registry of definitions, and the C++
// interfaces implemented over the user's Python callables. Every callback
// goes through call_into_python: Note [Calling into Python from engine threads] (common.hpp).
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>

#include <map>
#include <mutex>

#include "common.hpp"
#include "completion_py.hpp"
#include "extension.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"
#include "strideweave/io.hpp"
#include "strideweave/move.hpp"
#include "strideweave/tiled/tiled_evictable.hpp"

namespace swpy {

namespace {

std::mutex g_mutex;
// class -> definition. Intentionally leaked: definitions hold Python objects, which must not be
// released by static destructors after the interpreter is gone.
auto& g_definitions = *new std::map<PyObject*, std::unique_ptr<Definition>>();

nb::object self_of(const sw::Carrier& c) {
  void* h = const_cast<sw::Carrier&>(c).binding_slot().load();
  if (!h) sw::raise<sw::InternalError>("a user-defined carrier has no Python object");
  return nb::borrow(static_cast<PyObject*>(h));
}

class PyStorageProvider final : public sw::StorageProvider {
 public:
  PyStorageProvider(nb::object cls, nb::object storage) : cls_(std::move(cls)), storage_(std::move(storage)) {
    elementwise_fallback = nb::cast<bool>(storage_.obj.attr("elementwise_fallback"));
  }
  bool supports_dtype(const sw::Carrier& c, const sw::DType& d) override {
    return call_into_python([&] {
      nb::object r = storage_.obj.attr("supports_dtype")(self_of(c), nb::cast(&d, nb::rv_policy::reference));
      return PyObject_IsTrue(r.ptr()) == 1;
    });
  }
  int64_t physical_size(const sw::Carrier& c) override {
    return call_into_python([&] {
      nb::object r = storage_.obj.attr("physical_size")(self_of(c));
      if (!is_index(r)) sw::raise<sw::TypeError>("StorageProvider.physical_size must return an int");
      const int64_t n = index_value(r, "physical_size");
      if (n < 0) sw::raise<sw::ValueError>("StorageProvider.physical_size must return a size >= 0, got ", n);
      return n;
    });
  }
  void allocate(sw::Carrier& c, int64_t slots) override {
    call_into_python([&] { storage_.obj.attr("allocate")(self_of(c), slots); });
  }
  void release(sw::Carrier& c) override {
    call_into_python([&] { storage_.obj.attr("release")(self_of(c)); });
  }
  sw::Value read(const sw::Carrier& c, int64_t slot) override {
    return call_into_python([&] { return to_value(storage_.obj.attr("read")(self_of(c), slot)); });
  }
  void write(sw::Carrier& c, int64_t slot, const sw::Value& v) override {
    call_into_python([&] { storage_.obj.attr("write")(self_of(c), slot, from_value(v)); });
  }
  sw::CarrierPtr construct(int64_t slots, const sw::DType& d, bool is_mutable) override {
    GilAcquire gil;
    nb::object obj = cls_.obj(slots, nb::arg("dtype") = nb::cast(&d, nb::rv_policy::reference),
                              nb::arg("mutable") = is_mutable);
    return nb::cast<sw::CarrierPtr>(obj);
  }

 private:
  GilObject cls_;
  GilObject storage_;
};

class PyRoute final : public sw::TransferRoute {
 public:
  explicit PyRoute(nb::object provider) : provider_(std::make_shared<GilObject>(std::move(provider))) {}

  Submit prepare(const sw::TransferRequest& r, std::string& unsupported) override {
    return call_into_python([&] { return prepare_locked(r, unsupported); });
  }

 private:
  // prepare, inside call_into_python.
  Submit prepare_locked(const sw::TransferRequest& r, std::string& unsupported) {
    nb::module_ ext = nb::module_::import_("strideweave.carriers.extension");
    nb::object tensor = nb::cast(r.tensor);
    nb::object dest = nb::cast(r.destination);
    nb::object request = ext.attr("TransferRequest")(
        nb::arg("tensor") = tensor, nb::arg("destination") = dest,
        nb::arg("source_class") = nb::borrow(r.tensor->carrier ? self_type(*r.tensor->carrier) : nb::none()),
        nb::arg("destination_class") = self_type(*r.destination),
        nb::arg("dtype") = nb::cast(r.dtype, nb::rv_policy::reference), nb::arg("layout") = nb::cast(r.layout),
        nb::arg("physical_span") = r.physical_span);
    nb::object prepared = provider_->obj.attr("prepare")(request);
    if (nb::isinstance(prepared, ext.attr("Unsupported"))) {
      unsupported = nb::cast<std::string>(prepared.attr("reason"));
      return {};
    }
    if (!nb::isinstance(prepared, ext.attr("PreparedTransfer")))
      sw::raise<sw::TypeError>("TransferProvider.prepare must return a PreparedTransfer or Unsupported, got ",
                               nb::type_name(prepared.type()).c_str());
    // The engine keeps the returned function (and so the PreparedTransfer) until the move is terminal.
    auto held_prepared = std::make_shared<GilObject>(std::move(prepared));
    return [held_prepared]() -> Waiter {
      return call_into_python([&]() -> Waiter {
        nb::object pending = held_prepared->obj.attr("submit")();
        if (pending.is_none()) return {};
        if (!nb::hasattr(pending, "wait") || !nb::hasattr(pending, "done"))
          sw::raise<sw::TypeError>("PreparedTransfer.submit must return None or an object with done and wait()");
        auto held = std::make_shared<GilObject>(std::move(pending));
        return [held]() {
          call_into_python([&] {
            nb::object r = held->obj.attr("wait")();
            if (!r.is_none())
              sw::raise<sw::TypeError>("a transfer completion's wait() must return None, got ",
                                       nb::type_name(r.type()).c_str(), " (the move fails; its carriers are as before)");
          });
        };
      });
    };
  }

  static nb::object self_type(const sw::Carrier& c) { return nb::borrow(py_carrier(c).type()); }
  std::shared_ptr<GilObject> provider_;
};

}  // namespace

namespace {
// Definitions of shipped classes installed by the library itself (TiledEvictable's).
auto& g_shipped = *new std::map<PyObject*, nb::object>();
}  // namespace

nb::object definition_object(nb::handle cls) {
  if (Definition* d = find_definition(cls)) return d->definition;
  std::lock_guard lock(g_mutex);
  auto it = g_shipped.find(cls.ptr());
  return it == g_shipped.end() ? nb::none() : it->second;
}

Definition* find_definition(nb::handle cls) {
  std::lock_guard lock(g_mutex);
  auto it = g_definitions.find(cls.ptr());
  return it == g_definitions.end() ? nullptr : it->second.get();
}

namespace {
// Note [Routes by exact class, resolved late]: a kind is an exact class, so a
// registered subclass of a registered class is a kind of its own with its own
// routes; nothing is inherited (a move looks routes up by the exact pair of
// kinds). A route may name a destination class that has no definition yet: it
// waits here and is registered with the engine the moment that class is
// registered. No carrier of an unregistered class can exist (construction
// needs the definition), so no move can be requested before its route is
// known: resolving at registration is resolving when a move is requested.
struct PendingRoute {
  const sw::CarrierKind* source;
  nb::object destination_class;
  const sw::CarrierKind* destination;
  nb::object provider;
};
// Intentionally leaked, as g_definitions.
auto& g_pending = *new std::vector<PendingRoute>();

// kind_of_class with g_mutex held.
const sw::CarrierKind* kind_of_class_locked(nb::handle cls) {
  if (cls.is(nb::type<sw::GenericCarrier>())) return &sw::generic_kind();
  if (cls.is(nb::type<sw::CPUCarrier>())) return &sw::cpu_kind();
  if (cls.is(nb::type<sw::FileBackedCarrier>())) return &sw::file_backed_kind();
  if (cls.is(nb::type<sw::BlockDeviceCarrier>())) return &sw::block_device_carrier_kind();
  if (cls.is(nb::type<sw::EvictableCarrier>())) return &sw::evictable_kind();
  if (cls.is(nb::type<sw::TiledEvictable>())) return &sw::tiled_evictable_kind();
  auto it = g_definitions.find(cls.ptr());
  return it == g_definitions.end() ? nullptr : &it->second->kind;
}
}  // namespace

const sw::CarrierKind* kind_of_class(nb::handle cls) {
  std::lock_guard lock(g_mutex);
  return kind_of_class_locked(cls);
}

nb::object class_of_kind(const sw::CarrierKind* kind) {
  if (!kind) return nb::none();
  if (kind == &sw::generic_kind()) return nb::borrow(nb::type<sw::GenericCarrier>());
  if (kind == &sw::cpu_kind()) return nb::borrow(nb::type<sw::CPUCarrier>());
  if (kind == &sw::file_backed_kind()) return nb::borrow(nb::type<sw::FileBackedCarrier>());
  if (kind == &sw::block_device_carrier_kind()) return nb::borrow(nb::type<sw::BlockDeviceCarrier>());
  if (kind == &sw::evictable_kind()) return nb::borrow(nb::type<sw::EvictableCarrier>());
  if (kind == &sw::tiled_evictable_kind()) return nb::borrow(nb::type<sw::TiledEvictable>());
  std::lock_guard lock(g_mutex);
  for (auto& [cls, def] : g_definitions)
    if (&def->kind == kind) return nb::borrow(cls);
  return nb::none();
}

// The module of the definition values, for the stub signatures below.
#define EXT "strideweave.carriers.extension"

void bind_extension(nb::module_& m) {
  m.def("_register_definition", [](nb::handle cls, nb::handle definition) {
    nb::handle carrier_type = nb::type<sw::Carrier>();
    if (!PyType_Check(cls.ptr()) || !PyType_IsSubtype((PyTypeObject*)cls.ptr(), (PyTypeObject*)carrier_type.ptr()) ||
        cls.is(carrier_type))
      sw::raise<sw::TypeError>("register_carrier_definition: cls must be a subclass of Carrier");
    if ((kind_of_class(cls) && !find_definition(cls)) || cls.is(nb::type<sw::DependentCarrier>()))
      sw::raise<sw::TypeError>("register_carrier_definition: shipped carrier classes cannot be given a definition");
    {
      // A subclass of Carrier, or of another user class (registered or not): never of a shipped class (those are
      // final, so this only guards against a class built around that rule).
      nb::object mro = cls.attr("__mro__");
      for (nb::handle base : mro) {
        if (base.is(cls) || base.is(carrier_type)) continue;
        if ((kind_of_class(base) && !find_definition(base)) || base.is(nb::type<sw::DependentCarrier>()))
          sw::raise<sw::TypeError>("register_carrier_definition: ", nb::type_name(cls).c_str(),
                                   " derives from the shipped class ", nb::type_name(base).c_str());
      }
    }
    if (find_definition(cls))
      sw::raise<sw::ValueError>("register_carrier_definition: ", nb::type_name(cls).c_str(), " is already registered");
    auto def = std::make_unique<Definition>();
    def->kind = sw::CarrierKind{nb::cast<std::string>(cls.attr("__name__")), false, false, false};
    def->provider = std::make_shared<PyStorageProvider>(nb::borrow(cls), definition.attr("storage"));
    def->facets = nb::borrow(definition.attr("facets"));
    def->definition = nb::borrow(definition);
    // Validate routes before registering anything (Note [Routes by exact class, resolved late]).
    std::vector<std::pair<nb::object, nb::object>> routes;  // (destination class, provider)
    for (nb::handle route : definition.attr("transfers")) {
      if (!route.attr("source_class").is(cls))
        sw::raise<sw::ValueError>("TransferRoute source_class must be the registering class ", nb::type_name(cls).c_str());
      routes.emplace_back(nb::borrow(route.attr("destination_class")), nb::borrow(route.attr("provider")));
    }
    Definition* raw = def.get();
    std::vector<PendingRoute> now;  // routes whose both ends are known once this class is registered
    {
      std::lock_guard lock(g_mutex);
      cls.inc_ref();  // registered classes live for the process
      g_definitions.emplace(cls.ptr(), std::move(def));
      for (auto& [dst, provider] : routes) {
        const sw::CarrierKind* dk = dst.is(cls) ? &raw->kind : kind_of_class_locked(dst);
        if (dk) now.push_back(PendingRoute{&raw->kind, std::move(dst), dk, std::move(provider)});
        else g_pending.push_back(PendingRoute{&raw->kind, std::move(dst), nullptr, std::move(provider)});
      }
      // Routes registered earlier by other classes whose destination is this class.
      for (auto it = g_pending.begin(); it != g_pending.end();) {
        if (it->destination_class.is(cls)) {
          it->destination = &raw->kind;
          now.push_back(std::move(*it));
          it = g_pending.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (PendingRoute& r : now)
      sw::register_route(r.source, r.destination, std::make_shared<PyRoute>(std::move(r.provider)));
  }, nb::arg("cls").none(), nb::arg("definition").none(),
     nb::sig("def _register_definition(cls: type[Carrier], definition: " EXT ".CarrierDefinition) -> None"));

  // Test-only fault injection at the system-call sites of file-backed storage.
  m.def("_io_inject", [](const std::string& op, int error, int count, int after) {
    sw::io::Op o;
    if (op == "open") o = sw::io::Op::Open;
    else if (op == "pread") o = sw::io::Op::Pread;
    else if (op == "pwrite") o = sw::io::Op::Pwrite;
    else if (op == "fsync") o = sw::io::Op::Fsync;
    else if (op == "ftruncate") o = sw::io::Op::Ftruncate;
    else if (op == "flock") o = sw::io::Op::Flock;
    else if (op == "fstat") o = sw::io::Op::Fstat;
    else sw::raise<sw::ValueError>("unknown I/O operation ", op, " (open, pread, pwrite, fsync, ftruncate, flock, fstat)");
    sw::io::inject(o, error, count, after);
  }, nb::arg("op"), nb::arg("error"), nb::arg("count") = 1, nb::arg("after") = 0);
  m.def("_io_clear", &sw::io::clear_faults);
  // Test-only gate: while held, calls of `op` block until _io_unhold() or _io_clear(), so a test
  // can keep an asynchronous request pending without sleeping. _io_held_waiting(op) counts blocked calls.
  auto op_of = [](const std::string& op) {
    if (op == "open") return sw::io::Op::Open;
    if (op == "pread") return sw::io::Op::Pread;
    if (op == "pwrite") return sw::io::Op::Pwrite;
    if (op == "fsync") return sw::io::Op::Fsync;
    if (op == "ftruncate") return sw::io::Op::Ftruncate;
    if (op == "flock") return sw::io::Op::Flock;
    if (op == "fstat") return sw::io::Op::Fstat;
    sw::raise<sw::ValueError>("unknown I/O operation ", op, " (open, pread, pwrite, fsync, ftruncate, flock, fstat)");
  };
  m.def("_io_hold", [op_of](const std::string& op) { sw::io::hold(op_of(op)); }, nb::arg("op"));
  m.def("_io_unhold", [] {
    swpy::GilRelease nogil;
    sw::io::unhold();
  });
  m.def("_io_held_waiting", [op_of](const std::string& op) { return sw::io::held_waiting(op_of(op)); }, nb::arg("op"));
  // Test-only: blocks (without the GIL) until `n` calls of `op` wait at the gate; False after `timeout` seconds.
  m.def("_io_wait_held", [op_of](const std::string& op, int64_t n, double timeout) {
    const sw::io::Op o = op_of(op);
    swpy::GilRelease nogil;
    return sw::io::wait_held(o, n, timeout);
  }, nb::arg("op"), nb::arg("n"), nb::arg("timeout"));
  // Test-only: calls of `op` so far (successful or injected), so a test can count the writes and syncs a request made.
  m.def("_io_calls", [op_of](const std::string& op) { return sw::io::calls(op_of(op)); }, nb::arg("op"));

  // Test-only: what the garbage collector does to an object of a cycle it breaks (its tp_clear), so a
  // test can observe a cleared TiledEvictable or handle deterministically, even while its work runs.
  m.def("_gc_clear", [](nb::handle obj) {
    if (!nb::isinstance<sw::TiledEvictable>(obj) && !nb::isinstance<AwaitHandle>(obj))
      sw::raise<sw::TypeError>("_gc_clear takes a TiledEvictable or an AwaitResult, got ", nb::type_name(obj.type()).c_str());
    auto clear = reinterpret_cast<inquiry>(PyType_GetSlot(reinterpret_cast<PyTypeObject*>(obj.type().ptr()), Py_tp_clear));
    if (clear) clear(obj.ptr());
  }, nb::arg("obj"), nb::sig("def _gc_clear(obj: TiledEvictable | AwaitResult) -> None"));

  m.def("_definition_of", [](nb::handle cls) -> nb::object { return definition_object(cls); }, nb::arg("cls"),
        nb::sig("def _definition_of(cls: type) -> " EXT ".CarrierDefinition | None"));
  m.def("_install_shipped_definition", [](nb::handle cls, nb::handle definition) {
    if (!kind_of_class(cls) || find_definition(cls))
      sw::raise<sw::TypeError>("_install_shipped_definition takes a shipped carrier class");
    std::lock_guard lock(g_mutex);
    if (g_shipped.count(cls.ptr())) sw::raise<sw::ValueError>("a definition is already installed for this class");
    cls.inc_ref();
    g_shipped.emplace(cls.ptr(), nb::borrow(definition));
  }, nb::arg("cls"), nb::arg("definition"),
     nb::sig("def _install_shipped_definition(cls: type[Carrier], definition: " EXT ".CarrierDefinition) -> None"));
}

#undef EXT

}  // namespace swpy
