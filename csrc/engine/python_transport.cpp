// The Gloo transport: collectives run by a Python object (see python_transport.h).
#include "engine/python_transport.h"

#include <cstring>

#include "common/dtypes.h"

namespace py = pybind11;

namespace aiak {
namespace engine {
namespace {

// Element-type handles of this transport are DataType codes; negotiation's bit vector uses
// one more, for uint64 (see gloo_calls.py).
constexpr TransportHandle kUint64 = 100;

int64_t item_bytes(TransportHandle dtype) {
  if (dtype == kUint64) return 8;
  int size = itemsize(static_cast<int32_t>(dtype));
  if (size == 0) throw std::invalid_argument("Gloo transport: unknown datatype " + std::to_string(dtype));
  return size;
}

py::memoryview view(void* p, int64_t nbytes) {
  return py::memoryview::from_memory(p, static_cast<py::ssize_t>(nbytes), false);
}

class PythonTransport final : public Transport {
 public:
  explicit PythonTransport(py::object calls)
      : allreduce_(calls.attr("allreduce")), bcast_(calls.attr("bcast")),
        gather_(calls.attr("gather")), gatherv_(calls.attr("gatherv")) {
    in_place = &in_place_tag_;
  }

  ~PythonTransport() override {
    // The methods are Python objects: drop them with the GIL (not at all once Python ended).
    if (!Py_IsInitialized()) {
      for (auto* f : {&allreduce_, &bcast_, &gather_, &gatherv_}) f->release();
      return;
    }
    py::gil_scoped_acquire gil;
    allreduce_ = bcast_ = gather_ = gatherv_ = py::object();
  }

  void allreduce(const void* send, void* recv, int count, TransportHandle dtype,
                 TransportHandle op, TransportHandle comm) override {
    int64_t nbytes = count * item_bytes(dtype);
    if (send != in_place && send != recv && nbytes) std::memcpy(recv, send, nbytes);
    if (nbytes == 0) return;
    call([&] { return allreduce_(view(recv, nbytes), dtype, op, comm); });
  }

  void bcast(void* buf, int count, TransportHandle dtype, int root, TransportHandle comm) override {
    int64_t nbytes = count * item_bytes(dtype);
    if (nbytes == 0) return;
    call([&] { return bcast_(view(buf, nbytes), root, comm); });
  }

  void gather(const void* send, int scount, TransportHandle sdtype, void* recv, int,
              TransportHandle, int root, TransportHandle comm) override {
    int64_t nbytes = scount * item_bytes(sdtype);
    call([&] {
      return gather_(view(const_cast<void*>(send), nbytes), reinterpret_cast<uintptr_t>(recv),
                     root, comm);
    });
  }

  void gatherv(const void* send, int scount, TransportHandle sdtype, void* recv,
               const int* rcounts, const int* displs, TransportHandle rdtype, int root,
               TransportHandle comm) override {
    int64_t item = item_bytes(rdtype);
    int64_t nbytes = scount * item_bytes(sdtype);
    // Counts and offsets are elements of rdtype, read on the root only (the other ranks
    // may pass null): the Python side scales them by `item` and learns widths itself.
    call([&] {
      return gatherv_(view(const_cast<void*>(send), nbytes), reinterpret_cast<uintptr_t>(recv),
                      reinterpret_cast<uintptr_t>(rcounts), reinterpret_cast<uintptr_t>(displs),
                      item, root, comm);
    });
  }

  TransportHandle op_create(UserFunction, bool) override {
    throw std::logic_error("Gloo transport: user reduce ops are not used (reduces_halves)");
  }
  void op_free(TransportHandle) override {}
  bool reduces_halves() const override { return true; }

 private:
  template <typename F>
  void call(F&& f) {
    py::gil_scoped_acquire gil;
    try {
      f();
    } catch (py::error_already_set& exc) {
      // The exception's type and text, for the message of the failed collective.
      std::string kind = py::str(exc.type().attr("__name__"));
      std::string text = py::str(exc.value());
      throw TransportError(kind, text);
    }
  }

  py::object allreduce_, bcast_, gather_, gatherv_;
  char in_place_tag_ = 0;
};

}  // namespace

std::unique_ptr<Transport> python_transport(py::object calls) {
  return std::make_unique<PythonTransport>(std::move(calls));
}

}  // namespace engine
}  // namespace aiak
