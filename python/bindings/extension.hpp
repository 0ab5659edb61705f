// The registry of user-defined carrier kinds (bindings side).
#pragma once

#include "common.hpp"
#include "strideweave/carrier.hpp"

namespace swpy {

struct Definition {
  sw::CarrierKind kind;
  std::shared_ptr<sw::StorageProvider> provider;
  nb::object facets;      // tuple of CarrierFacet instances
  nb::object definition;  // the Python CarrierDefinition
};

// The definition registered for exactly `cls`, or nullptr.
Definition* find_definition(nb::handle cls);
// The CarrierDefinition object of `cls` (registered or shipped), or None.
nb::object definition_object(nb::handle cls);
// The CarrierKind of a carrier class (shipped or registered), or nullptr.
const sw::CarrierKind* kind_of_class(nb::handle cls);
// The Python class of a carrier kind.
nb::object class_of_kind(const sw::CarrierKind* kind);
// The Python object of a carrier (existing one when alive).
nb::object py_carrier(const sw::Carrier& c);

}  // namespace swpy
