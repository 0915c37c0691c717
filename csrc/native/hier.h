// Hierarchical-allreduce kernels (csrc/native/hier.cpp), registered into aiak_training._native.
#pragma once
#include <pybind11/pybind11.h>

namespace aiak {

// Adds reduce_sources() and the HierNode class (shared-memory intra-node pipeline) to `m`.
void register_hier(pybind11::module_& m);

}  // namespace aiak
