// Python type annotations for the signatures that stubgen writes into strideweave/_core.pyi.
//
// Many bindings take an argument as nb::handle to check it themselves and raise the engine's own messages
// (docs/guide.md, "Request values and their messages"); left so, the stub says `object`. Declaring it as
// nb::typed<nb::handle, T> converts exactly as nb::handle does (anything is accepted, the binding checks) and
// only names T in the signature. The names below cover what the bindings accept that no C++ type spells.
//
// An argument declared nb::arg(...).none() only so that None reaches the binding's own check (and its message)
// would read `T | None` (nanobind adds it); those functions spell their signature with nb::sig, from the
// fragments SW_PY_* below, and take plain nb::handle. An argument whose default is None is declared Arg<T>:
// nanobind adds the `| None` itself.
#pragma once

#include <nanobind/nanobind.h>
#include <nanobind/stl/variant.h>

#include <variant>

// Signature fragments for nb::sig (the same annotations as the types below).
#define SW_PY_INDEX "typing.SupportsIndex"
#define SW_PY_KEY "typing.SupportsIndex | collections.abc.Iterable"
#define SW_PY_VALUE "float | int | bool"

namespace swpy::typing {

// Annotation-only types: stubgen reads their name; nothing ever converts a value to one.
struct SupportsIndex {};  // an int, or any object with __index__ (a NumPy integer)
struct StrPath {};        // a file name: a str or an os.PathLike of one

namespace nb = nanobind;

// An argument annotated as `T` (or `T1 | T2 | ...`), converted as nb::handle.
template <class... T>
using Arg = nb::typed<nb::handle, std::conditional_t<sizeof...(T) == 1, std::tuple_element_t<0, std::tuple<T...>>,
                                                     std::variant<T...>>>;
// A result annotated as `T1 | T2 | ...`, built as an nb::object.
template <class... T>
using Result = nb::typed<nb::object, std::variant<T...>>;

using Index = Arg<SupportsIndex>;
// Element values (docs/guide.md, "DTypes": float, int, bool), any iterable of them (Generic(values), new_like).
using Values = nb::typed<nb::handle, nb::typed<nb::iterable, std::variant<float, int, bool>>>;

}  // namespace swpy::typing

namespace nanobind::detail {
template <> struct type_caster<swpy::typing::SupportsIndex> {
  static constexpr auto Name = const_name("typing.SupportsIndex");
};
template <> struct type_caster<swpy::typing::StrPath> {
  static constexpr auto Name = const_name("str | os.PathLike[str]");
};
}  // namespace nanobind::detail
