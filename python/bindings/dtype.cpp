// DType: four singletons compared with `is`.
#include <nanobind/stl/string.h>

#include "common.hpp"
#include "strideweave/errors.hpp"

namespace swpy {

void bind_dtype(nb::module_& m) {
  using sw::DType;
  auto cls = nb::class_<DType>(m, "DType",
                               "Element type of a carrier. Singletons: DType.Float32, DType.Int32, DType.Bool "
                               "(storage dtypes) and DType.Float64 (accumulator only). Compare with `is`.");
  cls.def("__init__", [](DType*, nb::args, nb::kwargs) {
       sw::raise<sw::TypeError>("DType cannot be constructed; use DType.Float32, DType.Int32, DType.Bool or DType.Float64");
     })
      .def_prop_ro("name", [](const DType& d) { return d.name(); })
      .def_prop_ro("bits", [](const DType& d) { return d.bits(); })
      .def("convert", [](const DType& d, nb::handle v) { return from_value(d.convert(to_value(v))); },
           nb::arg("value").none(),
           "The value as this dtype stores it: Float32 rounds to binary32, Int32 raises OverflowError out of "
           "range, Bool accepts only bool; other types raise TypeError.")
      .def("__repr__", [](const DType& d) { return "DType." + d.name(); })
      .def("__reduce__", [](const DType& d) { return nb::make_tuple(nb::module_::import_("builtins").attr("getattr"),
                                                                    nb::make_tuple(nb::type<DType>(), d.name())); })
      .def("__copy__", [](nb::handle self) { return nb::borrow(self); })
      .def("__deepcopy__", [](nb::handle self, nb::handle) { return nb::borrow(self); });
  for (const DType* d : DType::registered())
    cls.attr(d->name().c_str()) = nb::cast(d, nb::rv_policy::reference);
  cls.def_static("registered", []() {
    nb::handle type = nb::type<DType>();
    nb::list out;
    for (const DType* d : DType::registered()) out.append(type.attr(d->name().c_str()));
    return nb::tuple(out);
  }, "All registered dtypes: (Float32, Int32, Bool, Float64).");
}

}  // namespace swpy
