// Carrier base and the shipped carrier classes.
#include <nanobind/stl/shared_ptr.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <chrono>

#include "common.hpp"
#include "typing.hpp"
#include "extension.hpp"
#include "strideweave/carriers/native.hpp"
#include "strideweave/carriers/storage.hpp"
#include "strideweave/errors.hpp"

namespace swpy {

namespace {

int64_t slot_index(nb::handle key) {
  if (PyBool_Check(key.ptr()) || !is_index(key))
    sw::raise<sw::TypeError>("carrier slot index must be an int, got ", nb::type_name(key.type()).c_str());
  int overflow = 0;
  nb::object v = nb::steal(PyNumber_Index(key.ptr()));
  long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (overflow) sw::raise<sw::IndexError>("carrier slot index is out of range");
  return x;
}

const sw::DType& dtype_or(nb::handle h, const sw::DType& fallback) {
  return h.is_none() ? fallback : to_dtype(h);
}

std::vector<sw::Value> values_of(nb::handle values, const sw::DType& dtype) {
  if (PyUnicode_Check(values.ptr()) || PyBytes_Check(values.ptr()))
    sw::raise<sw::TypeError>("values must be an iterable of elements, got str");
  std::vector<sw::Value> out;
  nb::object it;
  try {
    it = nb::iter(values);
  } catch (nb::python_error&) {
    sw::raise<sw::TypeError>("values must be an iterable of elements, got ", nb::type_name(values.type()).c_str());
  }
  for (nb::handle v : values) out.push_back(dtype.convert(to_value(v)));
  return out;
}

std::string path_of(nb::handle h) {
  nb::object fs = nb::module_::import_("os").attr("fspath");
  nb::object p;
  try {
    p = fs(h);
  } catch (nb::python_error&) {
    sw::raise<sw::TypeError>("filename must be a str or os.PathLike, got ", nb::type_name(h.type()).c_str());
  }
  if (!PyUnicode_Check(p.ptr())) sw::raise<sw::TypeError>("filename must be a str path");
  return nb::cast<std::string>(p);
}

}  // namespace

const sw::DType& to_dtype(nb::handle h, const char* what) {
  if (!nb::isinstance<sw::DType>(h)) sw::raise<sw::TypeError>(what, ", got ", nb::type_name(h.type()).c_str());
  return nb::cast<const sw::DType&>(h);
}

nb::object py_carrier(const sw::Carrier& c) {
  auto sp = const_cast<sw::Carrier&>(c).shared_from_this();
  return nb::cast(sp);
}

namespace {
nb::typed<nb::dict, nb::str, int> journal_stats_dict(const sw::JournalStats& s) {
  nb::dict d;
  d["records"] = s.records;
  d["bytes"] = s.bytes;
  d["syncs"] = s.syncs;
  d["resets"] = s.resets;
  d["replayed"] = s.replayed;
  d["replayed_bytes"] = s.replayed_bytes;
  return nb::borrow<nb::typed<nb::dict, nb::str, int>>(d);
}
}  // namespace

void bind_carriers(nb::module_& m) {
  using sw::Carrier;

  m.def(
      "set_mapping_cache_limit",
      [](nb::typed<nb::handle, int> nbytes) {
        if (!PyLong_Check(nbytes.ptr()) || PyBool_Check(nbytes.ptr()))
          sw::raise<sw::TypeError>("set_mapping_cache_limit takes an int (bytes)");
        long long n = PyLong_AsLongLong(nbytes.ptr());
        if (n == -1 && PyErr_Occurred()) {
          PyErr_Clear();
          sw::raise<sw::ValueError>("set_mapping_cache_limit: the byte count is out of range");
        }
        if (n < 0) sw::raise<sw::ValueError>("set_mapping_cache_limit: the byte count must be >= 0, got ", n);
        return static_cast<int64_t>(sw::set_mapping_cache_limit(static_cast<size_t>(n)));
      },
      nb::arg("nbytes"),
      "Sets how many bytes of freed large CPU buffers (1 MiB and up) the process keeps mapped for reuse, and "
      "returns the previous limit (1 GiB by default, or a sixteenth of the machine's memory where that is less). "
      "Reusing a mapping spares the page faults that zero a fresh one; the cached bytes count toward the process's "
      "resident memory. Lowering the limit unmaps the oldest cached buffers at once; 0 turns the cache off.");
  m.def(
      "set_mapping_cache_decay",
      [](nb::typed<nb::handle, float> seconds) {
        if (!(PyFloat_Check(seconds.ptr()) || PyLong_Check(seconds.ptr())) || PyBool_Check(seconds.ptr()))
          sw::raise<sw::TypeError>("set_mapping_cache_decay takes a number of seconds (int or float)");
        const double s = PyFloat_AsDouble(seconds.ptr());
        if (s == -1.0 && PyErr_Occurred()) {
          PyErr_Clear();
          sw::raise<sw::ValueError>("set_mapping_cache_decay: the number of seconds is out of range");
        }
        constexpr double kMaxSeconds = 365.0 * 24 * 3600;
        if (!(s > 0.0) || s > kMaxSeconds)
          sw::raise<sw::ValueError>("set_mapping_cache_decay: the decay must be > 0 and at most one year (",
                                    kMaxSeconds, " s), got ", s, " s");
        using D = std::chrono::steady_clock::duration;
        const D old = sw::set_mapping_cache_decay(std::chrono::duration_cast<D>(std::chrono::duration<double>(s)));
        return std::chrono::duration<double>(old).count();
      },
      nb::arg("seconds"),
      "Sets how long a freed large CPU buffer stays in the mapping cache before it is unmapped (2 s by default), "
      "and returns the previous time in seconds. A small thread gives back what has been free longer; the limit "
      "still applies (see set_mapping_cache_limit).");
  m.def(
      "mapping_cache_bytes", [] { return static_cast<int64_t>(sw::mapping_cache_bytes()); },
      "Bytes of freed large CPU buffers currently kept for reuse (see set_mapping_cache_limit and "
      "set_mapping_cache_decay).");

  nb::class_<Carrier>(m, "Carrier",
                      "A flat, fixed-size array of physical slots of one storage dtype. Subclass it and register a "
                      "CarrierDefinition to add a carrier kind.")
      .def("__init__", [](nb::handle self, typing::Index slots, typing::Arg<sw::DType> dtype, bool is_mutable) {
        // Constructed by hand so that the provider's allocate(c, slots) can see the Python object.
        if (nb::inst_ready(self)) sw::raise<sw::RuntimeError>("Carrier.__init__ called twice");
        nb::handle cls = self.type();
        Definition* def = find_definition(cls);
        if (!def)
          sw::raise<sw::TypeError>(nb::cast<std::string>(cls.attr("__name__")),
                                   " has no carrier definition: subclass Carrier and call register_carrier_definition first");
        int64_t n = index_value(slots, "carrier size");
        const sw::DType& dt = to_dtype(dtype);
        Carrier* p = nb::inst_ptr<Carrier>(self);
        new (p) Carrier(&def->kind, def->provider, dt, is_mutable);
        p->binding_slot().store(self.ptr());  // borrowed: the C++ object lives inside this Python object
        nb::inst_mark_ready(self);
        p->allocate_storage(n);
      }, nb::arg("slots"), nb::kw_only(), nb::arg("dtype"), nb::arg("mutable") = true)
      .def("size", &Carrier::size, "Number of physical slots.")
      .def("dtype", [](const Carrier& c) -> const sw::DType& { return c.dtype(); }, nb::rv_policy::reference)
      .def_prop_ro("version", &Carrier::version)
      .def("is_mutable", &Carrier::is_mutable)
      .def("is_owned", &Carrier::is_owned)
      .def("is_released", &Carrier::is_released)
      .def("release", [](Carrier& c) { c.release(); }, "Frees storage; idempotent. RuntimeError while owned.")
      .def("supports_storage_dtype", [](const Carrier& c, nb::handle d) {
        return c.supports_storage_dtype(to_dtype(d, "dtype must be a DType"));
      }, nb::arg("dtype").none(),  // .none(): None reaches the check and gets its message
         nb::sig("def supports_storage_dtype(self, dtype: DType) -> bool"))
      .def("__getitem__", [](const Carrier& c, nb::handle key) { return from_value(c.get(slot_index(key))); },
           nb::arg("index").none(), nb::sig("def __getitem__(self, index: " SW_PY_INDEX ") -> " SW_PY_VALUE))
      .def("__setitem__", [](Carrier& c, nb::handle key, nb::handle value) {
        int64_t i = slot_index(key);
        c.check_writable("write");
        c.check_index(i);
        c.set(i, to_value(value));
      }, nb::arg("index").none(), nb::arg("value").none(),
         nb::sig("def __setitem__(self, index: " SW_PY_INDEX ", value: " SW_PY_VALUE ") -> None"))
      .def("new_like", [](const Carrier& c, typing::Values values, bool is_mutable, typing::Arg<sw::DType> dtype) {
        const sw::DType& dt = dtype_or(dtype, c.dtype());
        std::vector<sw::Value> vals = values_of(values, dt);
        return c.new_like(vals, is_mutable, dt);
      }, nb::arg("values"), nb::kw_only(), nb::arg("mutable") = true, nb::arg("dtype") = nb::none())
      .def("allocate_like", [](const Carrier& c, typing::Index size, bool is_mutable, typing::Arg<sw::DType> dtype, bool empty) {
        int64_t n = index_value(size, "allocate_like size");
        if (n < 0) sw::raise<sw::ValueError>("allocate_like size must be >= 0, got ", n);
        const sw::DType& dt = dtype_or(dtype, c.dtype());
        if (!c.supports_storage_dtype(dt)) sw::raise<sw::TypeError>(c.kind_name(), " does not store ", dt.name());
        return c.allocate_like(n, is_mutable, dt, empty);
      }, nb::arg("size"), nb::kw_only(), nb::arg("mutable") = true, nb::arg("dtype") = nb::none(),
         nb::arg("empty") = false)
      .def("facet", [](nb::handle self, nb::typed<nb::handle, nb::type_object> t) -> nb::object {
        if (!PyType_Check(t.ptr())) sw::raise<sw::TypeError>("facet type must be a class");
        nb::object def = definition_object(self.type());
        if (def.is_none()) return nb::none();
        for (nb::handle f : def.attr("facets"))
          if (PyObject_IsInstance(f.ptr(), t.ptr()) == 1)
            return nb::hasattr(f, "_bind") ? f.attr("_bind")(self) : nb::borrow(f);  // per-carrier facets
        return nb::none();
      }, nb::arg("facet_type"))
      .def("require_facet", [](nb::handle self, nb::typed<nb::handle, nb::type_object> t) -> nb::object {
        nb::object f = self.attr("facet")(t);
        if (f.is_none())
          sw::raise<sw::NotImplementedError>(nb::type_name(self.type()).c_str(), " has no facet of type ",
                                             nb::type_name(t).c_str());
        return f;
      }, nb::arg("facet_type"))
      .def("__repr__", [](nb::handle self) {
        const Carrier& c = nb::cast<const Carrier&>(self);
        std::string s = nb::cast<std::string>(self.type().attr("__name__")) + "(size=" + std::to_string(c.size()) +
                        ", dtype=DType." + c.dtype().name();
        if (c.is_released()) s += ", released";
        else if (c.is_owned()) s += ", owned";
        else if (!c.created_mutable()) s += ", immutable";
        return s + ")";
      });

  nb::class_<sw::DependentCarrier, Carrier>(m, "DependentCarrier",
                                            "Base of carriers that compose other carriers and own their tiers.")
      .def("__init__", [](sw::DependentCarrier*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("DependentCarrier cannot be constructed directly");
      });

  nb::class_<sw::GenericCarrier, Carrier>(m, "Generic", nb::is_final(),
                                          "Generic(values, *, mutable=True, dtype=DType.Float32): the reference carrier.")
      .def("__init__", [](sw::GenericCarrier* self, typing::Values values, bool is_mutable, typing::Arg<sw::DType> dtype) {
        const sw::DType& dt = dtype_or(dtype, sw::DType::Float32());
        if (!dt.is_storage()) sw::raise<sw::TypeError>("Generic: ", dt.name(), " is not a storage dtype");
        std::vector<sw::Value> vals = values_of(values, dt);
        new (self) sw::GenericCarrier(static_cast<int64_t>(vals.size()), dt, is_mutable);
        for (size_t k = 0; k < vals.size(); ++k) self->write_value(static_cast<int64_t>(k), vals[k]);
      }, nb::arg("values"), nb::kw_only(), nb::arg("mutable") = true, nb::arg("dtype") = nb::none());

  nb::class_<sw::CPUCarrier, Carrier>(m, "CPU", nb::is_final(),
                                      "CPU(size, *, mutable=True, dtype=DType.Float32, empty=False): aligned host memory.")
      .def("__init__", [](sw::CPUCarrier* self, typing::Index size, bool is_mutable, typing::Arg<sw::DType> dtype, bool empty) {
        const sw::DType& dt = dtype_or(dtype, sw::DType::Float32());
        int64_t n = index_value(size, "CPU size");
        new (self) sw::CPUCarrier(n, dt, is_mutable, empty);
      }, nb::arg("size"), nb::kw_only(), nb::arg("mutable") = true, nb::arg("dtype") = nb::none(),
         nb::arg("empty") = false);

  nb::class_<sw::FileBackedCarrier, Carrier>(m, "FileBacked", nb::is_final(),
                                             "FileBacked(filename=None, *, mutable=True, dtype=DType.Float32): slots in a "
                                             "file. A mutable one opens or creates `filename`; mutable=False opens an "
                                             "existing file and creates none; no filename makes an anonymous file.")
      .def("__init__", [](sw::FileBackedCarrier* self, typing::Arg<typing::StrPath> filename, bool is_mutable, typing::Arg<sw::DType> dtype,
                          bool crash_safe) {
        const sw::DType& dt = dtype_or(dtype, sw::DType::Float32());
        std::string path = filename.is_none() ? std::string() : path_of(filename);
        if (!filename.is_none() && path.empty()) sw::raise<sw::ValueError>("FileBacked filename must not be empty");
        new (self) sw::FileBackedCarrier(path, dt, is_mutable, crash_safe);
      }, nb::arg("filename") = nb::none(), nb::kw_only(), nb::arg("mutable") = true, nb::arg("dtype") = nb::none(),
         nb::arg("crash_safe") = false)
      .def_prop_ro("crash_safe", [](const sw::FileBackedCarrier& c) { return c.crash_safe(); },
                   "Whether every write goes through the file's journal (FileBacked(path, crash_safe=True)): a crash "
                   "never leaves a torn tile (docs/reliability.md, \"Crash-safe tiers and atomic saves\").")
      .def("journal_stats", [](const sw::FileBackedCarrier& c) { return journal_stats_dict(c.journal_stats()); },
           "The crash-safe journal's counters: records, bytes, syncs, resets, replayed, replayed_bytes (all 0 when "
           "not crash-safe).")
      .def_prop_ro("filename", [](const sw::FileBackedCarrier& c) { return c.filename(); },
                   "The file's name. An anonymous file (FileBacked() without a name) never has a name in the "
                   "directory (removed as it is created, so nothing is left behind however the process ends); its "
                   "filename is what the kernel calls the open file, as /proc/<pid>/fd and lsof show it "
                   "('/tmp/#1234 (deleted)'): a description, not a path to open.")
      .def("is_anonymous", &sw::FileBackedCarrier::is_anonymous)
      .def("flush", [](sw::FileBackedCarrier& c) {
        swpy::GilRelease nogil;
        c.flush();
      }, "Makes every completed write to the file durable (fsync); returns None. RuntimeError naming the file and "
         "the errno when the system call fails, or when the carrier is released.");

  nb::class_<sw::BlockDevice>(m, "BlockDevice",
                              "BlockDevice(path): an arena over a block device or a preallocated file (direct I/O).")
      .def("__init__", [](sw::BlockDevice* self, typing::Arg<typing::StrPath> path) { new (self) sw::BlockDevice(path_of(path)); },
           nb::arg("path"))
      .def("allocate", [](std::shared_ptr<sw::BlockDevice> d, typing::Index size, bool is_mutable, typing::Arg<sw::DType> dtype,
                          bool empty) {
        // Taken as a shared_ptr, not a reference: the conversion links the Python-created
        // arena's enable_shared_from_this, which allocate() needs (bad_weak_ptr otherwise).
        int64_t n = index_value(size, "allocation size");
        return d->allocate(n, dtype_or(dtype, sw::DType::Float32()), is_mutable, empty);
      }, nb::arg("size"), nb::kw_only(), nb::arg("mutable") = true, nb::arg("dtype") = nb::none(),
         nb::arg("empty") = false)
      .def_prop_ro("path", &sw::BlockDevice::path)
      .def_prop_ro("capacity", [](const sw::BlockDevice& d) { return d.capacity_bytes(); })
      .def_prop_ro("free_bytes", &sw::BlockDevice::free_bytes)
      .def_prop_ro("is_direct", &sw::BlockDevice::is_direct);

  nb::class_<sw::BlockDeviceCarrier, Carrier>(m, "BlockDeviceCarrier", nb::is_final(),
                                              "A carrier on a BlockDevice extent; made by BlockDevice.allocate.")
      .def("__init__", [](sw::BlockDeviceCarrier*, nb::args, nb::kwargs) {
        sw::raise<sw::TypeError>("BlockDeviceCarrier is not constructible directly; use BlockDevice.allocate");
      })
      .def_prop_ro("device", [](const sw::BlockDeviceCarrier& c) { return c.device(); })
      .def("flush", [](sw::BlockDeviceCarrier& c) {
        swpy::GilRelease nogil;
        c.flush();
      }, "Makes every completed write to the extent durable (fsync of the device); returns None. RuntimeError "
         "naming the device and the errno when the system call fails, or when the carrier is released.");

  nb::class_<sw::EvictableCarrier, sw::DependentCarrier>(m, "Evictable", nb::is_final(),
                                                         "Evictable(primary, secondary): whole-extent residency over two tiers.")
      .def("__init__", [](sw::EvictableCarrier* self, typing::Arg<Carrier> primary, typing::Arg<Carrier> secondary) {
        if (!nb::isinstance<Carrier>(primary) || !nb::isinstance<Carrier>(secondary))
          sw::raise<sw::TypeError>("Evictable tiers must be Carrier instances");
        new (self) sw::EvictableCarrier(nb::cast<std::shared_ptr<Carrier>>(primary),
                                        nb::cast<std::shared_ptr<Carrier>>(secondary));
      }, nb::arg("primary"), nb::arg("secondary"))
      .def("evict", [](sw::EvictableCarrier& c) {
        swpy::GilRelease nogil;
        c.evict();
      })
      .def("promote", [](sw::EvictableCarrier& c) {
        swpy::GilRelease nogil;
        c.promote();
      })
      .def("is_evicted", &sw::EvictableCarrier::is_evicted)
      .def_prop_ro("primary", &sw::EvictableCarrier::primary)
      .def_prop_ro("secondary", &sw::EvictableCarrier::secondary);
}

}  // namespace swpy
