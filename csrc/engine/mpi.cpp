// Run-time binding of the MPI library (see mpi.h for why).
#include "engine/mpi.h"

#include <dlfcn.h>

#include <cstdio>
#include <cstring>
#include <fstream>
#include <type_traits>

namespace aiak {
namespace engine {
namespace {

// Finds `name` among the symbols already loaded (mpi4py loads libmpi before we get here).
// mpi4py may load it with RTLD_LOCAL, so failing the global scope, the library is looked up
// by path in /proc/self/maps and reopened (RTLD_NOLOAD: never a second copy).
void* find_symbol(const char* name) {
  static void* library = nullptr;
  if (void* sym = dlsym(RTLD_DEFAULT, name)) return sym;
  if (library == nullptr) {
    std::ifstream maps("/proc/self/maps");
    std::string line;
    while (std::getline(maps, line)) {
      auto slash = line.find('/');
      if (slash == std::string::npos) continue;
      std::string path = line.substr(slash);
      auto base = path.substr(path.rfind('/') + 1);
      if (base.rfind("libmpi.so", 0) != 0 && base.rfind("libmpi_abi.so", 0) != 0) continue;
      library = dlopen(path.c_str(), RTLD_NOW | RTLD_NOLOAD);
      if (library != nullptr) break;
    }
  }
  void* sym = library ? dlsym(library, name) : nullptr;
  if (sym == nullptr)
    throw std::runtime_error(std::string("aiak engine: MPI symbol ") + name +
                             " not found (is mpi4py's MPI library loaded?)");
  return sym;
}

template <typename F>
F bind(const char* name) { return reinterpret_cast<F>(find_symbol(name)); }

// H: the library's handle type (int for MPICH's ABI, a pointer for Open MPI's).
template <typename H>
class TypedMpi final : public Transport {
 public:
  explicit TypedMpi(int64_t in_place_value) {
    in_place = reinterpret_cast<void*>(static_cast<intptr_t>(in_place_value));
    allreduce_ = bind<decltype(allreduce_)>("MPI_Allreduce");
    bcast_ = bind<decltype(bcast_)>("MPI_Bcast");
    gather_ = bind<decltype(gather_)>("MPI_Gather");
    gatherv_ = bind<decltype(gatherv_)>("MPI_Gatherv");
    op_create_ = bind<decltype(op_create_)>("MPI_Op_create");
    op_free_ = bind<decltype(op_free_)>("MPI_Op_free");
    error_string_ = bind<decltype(error_string_)>("MPI_Error_string");
  }

  void allreduce(const void* s, void* r, int n, TransportHandle dt, TransportHandle op, TransportHandle comm) override {
    check(allreduce_(s, r, n, h(dt), h(op), h(comm)), "MPI_Allreduce");
  }
  void bcast(void* b, int n, TransportHandle dt, int root, TransportHandle comm) override {
    check(bcast_(b, n, h(dt), root, h(comm)), "MPI_Bcast");
  }
  void gather(const void* s, int sn, TransportHandle sdt, void* r, int rn, TransportHandle rdt, int root,
              TransportHandle comm) override {
    check(gather_(s, sn, h(sdt), r, rn, h(rdt), root, h(comm)), "MPI_Gather");
  }
  void gatherv(const void* s, int sn, TransportHandle sdt, void* r, const int* rc, const int* dis,
               TransportHandle rdt, int root, TransportHandle comm) override {
    check(gatherv_(s, sn, h(sdt), r, rc, dis, h(rdt), root, h(comm)), "MPI_Gatherv");
  }
  TransportHandle op_create(UserFunction fn, bool commute) override {
    H op{};
    check(op_create_(reinterpret_cast<void*>(fn), commute ? 1 : 0, &op), "MPI_Op_create");
    return to_int(op);
  }
  void op_free(TransportHandle op) override {
    H handle = h(op);
    op_free_(&handle);
  }

 private:
  static H h(TransportHandle v) {
    if constexpr (std::is_pointer<H>::value) return reinterpret_cast<H>(static_cast<intptr_t>(v));
    else return static_cast<H>(v);
  }
  static int64_t to_int(H v) {
    if constexpr (std::is_pointer<H>::value) return static_cast<int64_t>(reinterpret_cast<intptr_t>(v));
    else return static_cast<int64_t>(v);
  }
  void check(int code, const char* what) const {
    if (code == 0) return;  // MPI_SUCCESS is 0 in every ABI
    char text[1024] = {0};
    int len = 0;
    if (error_string_(code, text, &len) != 0) std::snprintf(text, sizeof text, "error %d", code);
    throw TransportError("Exception", std::string(what) + ": " + text);
  }

  int (*allreduce_)(const void*, void*, int, H, H, H) = nullptr;
  int (*bcast_)(void*, int, H, int, H) = nullptr;
  int (*gather_)(const void*, int, H, void*, int, H, int, H) = nullptr;
  int (*gatherv_)(const void*, int, H, void*, const int*, const int*, H, int, H) = nullptr;
  int (*op_create_)(void*, int, H*) = nullptr;
  int (*op_free_)(H*) = nullptr;
  int (*error_string_)(int, char*, int*) = nullptr;
};

}  // namespace

std::unique_ptr<Transport> bind_mpi(int handle_bytes, int64_t in_place) {
  if (handle_bytes == 4) return std::make_unique<TypedMpi<int32_t>>(in_place);
  if (handle_bytes == static_cast<int>(sizeof(void*))) return std::make_unique<TypedMpi<void*>>(in_place);
  throw std::invalid_argument("aiak engine: unsupported MPI handle size " +
                              std::to_string(handle_bytes));
}

}  // namespace engine
}  // namespace aiak
