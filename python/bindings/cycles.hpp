// Reference cycles through C++ that the garbage collector is told about: a carrier's residency policy
// (Note [Policy reference cycles], tiled.cpp) and a tensor's carrier (Note [Tensor reference cycles], tensor.cpp).
#pragma once

#include <nanobind/nanobind.h>

#include "strideweave/carrier.hpp"

namespace swpy {

// With the GIL held; allocate nothing. The Python policy object that `carrier` alone holds (a TiledEvictable
// whose PyPolicy no other carrier shares), or nullptr; clear_sole_policy drops it (as the carrier's tp_clear does).
PyObject* sole_policy_object(const sw::Carrier& carrier);
void clear_sole_policy(const sw::Carrier& carrier);

}  // namespace swpy
