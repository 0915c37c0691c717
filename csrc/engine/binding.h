// Registers the engine's C++ core (EngineCore) into aiak_training._native.
#pragma once
#include <pybind11/pybind11.h>

namespace aiak {

void register_engine(pybind11::module_& m);

}  // namespace aiak
