// The MPI transport of the engine (transport.h), bound at run time to the library mpi4py loaded.
//
// Why not #include <mpi.h>: MPICH and Open MPI have different ABIs (MPICH handles are 32-bit
// ints, Open MPI's are pointers to library objects), and the MPI in use is only known when
// mpi4py has loaded it.  So nothing here is compiled against either: the engine resolves the
// MPI_* symbols with dlsym, calls them through function pointers typed for the running
// library's handle width, and takes every handle value (communicators, datatypes, ops,
// MPI_IN_PLACE) from mpi4py.  One build serves both libraries, and the engine shares
// mpi4py's communicators rather than opening its own.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/quiet_wait.h"
#include "engine/transport.h"

namespace aiak {
namespace engine {

// How the MPI transport waits and reduces, on communicators that span hosts: allreduces
// of at least `ring_min_bytes` (0: none) run as the engine's own segmented ring over
// point-to-point messages; smaller ones, and the negotiation's collectives, are MPI's
// nonblocking collectives; every wait is quiet (quiet_wait.h).  On one host the transport
// calls MPI's blocking collectives (the ring too if `ring_on_one_host`).
struct MpiTuning {
  int64_t ring_min_bytes = 0;
  int64_t segment_bytes = 256 << 10;
  int window = 4;  // segments in flight each way
  bool ring_on_one_host = false;  // also for sets whose ranks share one host
  QuietWaitConfig wait;
};

// Binds to the MPI library already loaded in this process.  `handle_bytes` is the size of
// its handles (4 for MPICH's ABI, 8 for Open MPI's), `in_place` its MPI_IN_PLACE value.
std::unique_ptr<Transport> bind_mpi(int handle_bytes, int64_t in_place, const MpiTuning& tuning);

}  // namespace engine
}  // namespace aiak
