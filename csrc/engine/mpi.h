// The MPI calls the native engine makes, bound at run time to the library mpi4py loaded.
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
#include <stdexcept>
#include <string>

namespace aiak {
namespace engine {

// An MPI handle value as mpi4py reports it (MPI._handleof): an int or a pointer, widened.
using MpiHandle = int64_t;

// An MPI call returned an error code; what() is the library's MPI_Error_string.
class MpiError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A reduction MPI cannot do with a built-in op (float16/bfloat16 sums and the like):
// signature of MPI_User_function, the datatype argument left opaque.
using UserFunction = void (*)(void* in, void* inout, int* len, void* datatype);

class Mpi {
 public:
  virtual ~Mpi() = default;
  // Each throws MpiError on a failed call (communicators use MPI_ERRORS_RETURN).
  virtual void allreduce(const void* send, void* recv, int count, MpiHandle dtype, MpiHandle op,
                         MpiHandle comm) = 0;
  virtual void bcast(void* buf, int count, MpiHandle dtype, int root, MpiHandle comm) = 0;
  virtual void gather(const void* send, int scount, MpiHandle sdtype, void* recv, int rcount,
                      MpiHandle rdtype, int root, MpiHandle comm) = 0;
  virtual void gatherv(const void* send, int scount, MpiHandle sdtype, void* recv,
                       const int* rcounts, const int* displs, MpiHandle rdtype, int root,
                       MpiHandle comm) = 0;
  virtual MpiHandle op_create(UserFunction fn, bool commute) = 0;
  virtual void op_free(MpiHandle op) = 0;
  // The MPI_IN_PLACE sentinel of this library.
  void* in_place = nullptr;
};

// Binds to the MPI library already loaded in this process.  `handle_bytes` is the size of
// its handles (4 for MPICH's ABI, 8 for Open MPI's), `in_place` its MPI_IN_PLACE value.
std::unique_ptr<Mpi> bind_mpi(int handle_bytes, int64_t in_place);

}  // namespace engine
}  // namespace aiak
