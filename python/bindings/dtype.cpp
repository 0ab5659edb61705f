// DType: six singletons compared with `is`.
#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <memory>
#include <type_traits>

#include "common.hpp"
#include "strideweave/carrier.hpp"
#include "strideweave/errors.hpp"

namespace swpy {

namespace {

using Array = nb::ndarray<nb::ro, nb::c_contig, nb::device::cpu, nb::ndim<1>>;

// Calls f(T{}) with the element type of a flat numeric array: the first of Ts that is its dtype.
template <class... Ts, class F>
void visit_array(const Array& a, F&& f) {
  const nb::dlpack::dtype t = a.dtype();
  if (!((t == nb::dtype<Ts>() ? (f(Ts{}), true) : false) || ...))
    sw::raise<sw::TypeError>("_storage_array takes an array of integers, float32 or float64");
}

// A NumPy array owning `buf`'s n elements.
template <class E>
nb::object numpy_array(std::unique_ptr<E[]> buf, size_t n) {
  nb::capsule owner(buf.get(), [](void* p) noexcept { delete[] static_cast<E*>(p); });
  E* data = buf.release();  // the capsule owns it now
  return nb::cast(nb::ndarray<nb::numpy, E, nb::ndim<1>>(data, {n}, owner));
}

// A flat array of `d`'s storage elements holding the values of `array` (flat, contiguous, of integers, float32 or
// float64) as `d` stores them: DType::convert's rules in bulk.
nb::object storage_array(nb::handle array, const sw::DType& d) {
  if (!d.is_storage()) sw::raise<sw::TypeError>(d.name(), " is not a storage dtype");
  Array a;
  if (!nb::try_cast(array, a, false))
    sw::raise<sw::TypeError>("_storage_array takes a flat contiguous NumPy array");
  nb::object out;
  if (d.is_half()) {  // the 16-bit bits, viewed as the dtype's NumPy elements
    const size_t n = a.size();
    std::unique_ptr<uint16_t[]> buf(new uint16_t[n ? n : 1]);
    visit_array<int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, float, double>(
        a, [&](auto in) { d.convert_into(static_cast<const decltype(in)*>(a.data()), n, buf.get()); });
    return numpy_array(std::move(buf), n).attr("view")(numpy_half_dtype(d));
  }
  sw::visit_dtype(d.id(), [&](auto element) {
    using E = decltype(element);
    if constexpr (std::is_same_v<E, sw::bfloat16> || std::is_same_v<E, sw::float16>) return;  // handled above
    else {
    const size_t n = a.size();
    if (a.dtype() == nb::dtype<E>() && (std::is_same_v<E, float> || std::is_same_v<E, int32_t>)) {
      out = nb::borrow(array);  // already stored as `d` stores it: the rules leave every value as it is
      return;
    }
    std::unique_ptr<E[]> buf(new E[n ? n : 1]);
    visit_array<int8_t, int16_t, int32_t, int64_t, uint8_t, uint16_t, uint32_t, uint64_t, float, double>(
        a, [&](auto in) { d.convert_into(static_cast<const decltype(in)*>(a.data()), n, buf.get()); });
    out = numpy_array(std::move(buf), n);
    }
  });
  return out;
}

// The values of an object array (ints beyond 64 bits, floats) as `d` stores them, by DType::convert one by one;
// None when there are none, when one is neither an int nor a float (a bool is neither), when `d` is Int32 and one
// is a float, or when `d` is Bool: friendly.tensor then refuses the array's kind.
nb::object storage_values(nb::handle items, const sw::DType& d) {
  const size_t n = nb::len(items);
  if (n == 0 || !(d == sw::DType::Float32() || d == sw::DType::Int32() || d.is_half())) return nb::none();
  for (nb::handle x : items) {
    const bool is_float = PyFloat_Check(x.ptr());
    if (PyBool_Check(x.ptr()) || !(is_float || PyLong_Check(x.ptr()))) return nb::none();
    if (is_float && d == sw::DType::Int32()) return nb::none();
  }
  if (d.is_half()) {  // convert rounds each value once; the stored bits, viewed as the dtype's NumPy elements
    std::unique_ptr<uint16_t[]> buf(new uint16_t[n]);
    size_t k = 0;
    for (nb::handle x : items) sw::store_value(d, &buf[k++], d.convert(to_value(x)));
    return numpy_array(std::move(buf), n).attr("view")(numpy_half_dtype(d));
  }
  nb::object out;
  sw::visit_dtype(d.id(), [&](auto element) {
    using E = decltype(element);
    if constexpr (std::is_same_v<E, sw::bfloat16> || std::is_same_v<E, sw::float16>) return;  // handled above
    else {
      std::unique_ptr<E[]> buf(new E[n]);
      size_t k = 0;
      for (nb::handle x : items) {
        const sw::Value v = d.convert(to_value(x));
        buf[k++] = v.kind == sw::Value::Kind::Int ? static_cast<E>(v.i) : static_cast<E>(v.f);
      }
      out = numpy_array(std::move(buf), n);
    }
  });
  return out;
}

}  // namespace

void bind_dtype(nb::module_& m) {
  using sw::DType;
  auto cls = nb::class_<DType>(m, "DType",
                               "Element type of a carrier. Singletons: DType.Float32, DType.Int32, DType.Bool, "
                               "DType.BFloat16, DType.Float16 (storage dtypes) and DType.Float64 (accumulator only). "
                               "Compare with `is`.");
  cls.def("__init__", [](DType*, nb::args, nb::kwargs) {
       sw::raise<sw::TypeError>("DType cannot be constructed; use DType.Float32, DType.Int32, DType.Bool, DType.Float64, "
                             "DType.BFloat16 or DType.Float16");
     })
      .def_prop_ro("name", [](const DType& d) { return d.name(); })
      .def_prop_ro("bits", [](const DType& d) { return d.bits(); })
      .def("convert", [](const DType& d, nb::handle v) { return from_value(d.convert(to_value(v))); },
           nb::arg("value").none(),
           "The value as this dtype stores it: Float32 rounds to binary32, BFloat16 and Float16 round to nearest even "
           "(past the largest finite value: inf), Int32 raises OverflowError out of "
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
  }, "All registered dtypes: (Float32, Int32, Bool, Float64, BFloat16, Float16).");
  m.def("_storage_array", &storage_array, nb::arg("array"), nb::arg("dtype"),
        nb::sig("def _storage_array(array: numpy.typing.NDArray[typing.Any], dtype: DType) -> "
                "numpy.typing.NDArray[typing.Any]"),
        "A flat array's values as `dtype` stores them, as a new array of its element type (DType.convert's rules, "
        "the first value refused raises convert's error); internal, used by friendly.tensor.");
  m.def("_storage_values", &storage_values, nb::arg("items"), nb::arg("dtype"),
        nb::sig("def _storage_values(items: list[object], dtype: DType) -> numpy.typing.NDArray[typing.Any] | None"),
        "An object array's values (as a list) as `dtype` stores them, or None when friendly.tensor refuses its kind; "
        "internal.");
}

}  // namespace swpy
