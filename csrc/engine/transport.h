// The transport: the collectives the engine's negotiation and host data path call.
//
// Two implementations: MPI (mpi.h), bound at run time to the library mpi4py loaded, and Gloo
// (python_transport.h), which calls torch.distributed's Gloo process groups through a Python
// object, taking the GIL for that call only.  Handles are opaque 64-bit values whose meaning
// belongs to the implementation: MPI's communicator/datatype/op handles for MPI, small
// integers the Python side maps to its communicators, element types and reductions for Gloo.
#pragma once

#include <atomic>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace aiak {
namespace engine {

// A communicator, datatype or reduce-op handle of the transport in use.
using TransportHandle = int64_t;

// A transport call failed.  `kind` names the failure in the message every pending operation
// reports, "The background thread failed: <kind>: <what>" ("Exception" for MPI, the Python
// exception's type for Gloo).
class TransportError : public std::runtime_error {
 public:
  TransportError(const std::string& kind, const std::string& what)
      : std::runtime_error(what), kind(kind) {}
  std::string kind;
};

// A reduction MPI cannot do with a built-in op (float16/bfloat16 sums and the like):
// signature of MPI_User_function, the datatype argument left opaque.
using UserFunction = void (*)(void* in, void* inout, int* len, void* datatype);

class Transport {
 public:
  virtual ~Transport() = default;
  // Each is a collective over `comm` and throws TransportError when it fails.
  virtual void allreduce(const void* send, void* recv, int count, TransportHandle dtype,
                         TransportHandle op, TransportHandle comm) = 0;
  virtual void bcast(void* buf, int count, TransportHandle dtype, int root,
                     TransportHandle comm) = 0;
  virtual void gather(const void* send, int scount, TransportHandle sdtype, void* recv,
                      int rcount, TransportHandle rdtype, int root, TransportHandle comm) = 0;
  // `rcounts`/`displs` are read on the root only (other ranks may pass empty arrays).
  virtual void gatherv(const void* send, int scount, TransportHandle sdtype, void* recv,
                       const int* rcounts, const int* displs, TransportHandle rdtype, int root,
                       TransportHandle comm) = 0;
  // The data path's allreduce, in place: the transport's own algorithm where it has one for
  // this size (MPI: the ring of mpi.cpp), otherwise allreduce().  The negotiation's small
  // collectives call allreduce() directly.
  virtual void reduce_in_place(void* buf, int count, TransportHandle dtype, TransportHandle op,
                               TransportHandle comm) {
    allreduce(in_place, buf, count, dtype, op, comm);
  }
  // Every rank of `comm` is on this host (true), or not: the transport may choose its
  // algorithms and its way of waiting by it.
  virtual void set_one_host(TransportHandle comm, bool one_host) {}
  virtual TransportHandle op_create(UserFunction fn, bool commute) = 0;
  virtual void op_free(TransportHandle op) = 0;
  // True when the transport reduces float16/bfloat16 with its built-in ops (no op_create).
  virtual bool reduces_halves() const { return false; }
  // The "in place" sentinel allreduce's `send` may be.
  void* in_place = nullptr;
  // Allreduces run as the transport's own ring (mpi.cpp), for tests and tuning.
  std::atomic<int64_t> ring_allreduces{0};
};

}  // namespace engine
}  // namespace aiak
