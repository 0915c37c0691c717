// The Gloo transport of the engine: its collectives are calls into a Python object
// (aiak_training/runtime/transport/gloo_calls.py) that runs them on torch.distributed's Gloo
// process groups.  The GIL is taken for each call only, and torch releases it while Gloo
// waits, so the frontend keeps running during a reduction.  No torch C++ symbol is used.
#pragma once

#include <pybind11/pybind11.h>

#include <memory>

#include "engine/transport.h"

namespace aiak {
namespace engine {

// `calls` has allreduce/bcast/gather/gatherv methods (see gloo_calls.py for their contract).
std::unique_ptr<Transport> python_transport(pybind11::object calls);

}  // namespace engine
}  // namespace aiak
