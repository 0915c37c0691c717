// Run-time binding of the MPI library (see mpi.h for why).
#include "engine/mpi.h"

#include <dlfcn.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <mutex>
#include <type_traits>
#include <unordered_set>
#include <vector>

#include "engine/quiet_wait.h"

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
  TypedMpi(int64_t in_place_value, const MpiTuning& tuning) : tuning_(tuning) {
    in_place = reinterpret_cast<void*>(static_cast<intptr_t>(in_place_value));
    allreduce_ = bind<decltype(allreduce_)>("MPI_Allreduce");
    bcast_ = bind<decltype(bcast_)>("MPI_Bcast");
    gather_ = bind<decltype(gather_)>("MPI_Gather");
    gatherv_ = bind<decltype(gatherv_)>("MPI_Gatherv");
    iallreduce_ = bind<decltype(iallreduce_)>("MPI_Iallreduce");
    ibcast_ = bind<decltype(ibcast_)>("MPI_Ibcast");
    igather_ = bind<decltype(igather_)>("MPI_Igather");
    igatherv_ = bind<decltype(igatherv_)>("MPI_Igatherv");
    isend_ = bind<decltype(isend_)>("MPI_Isend");
    irecv_ = bind<decltype(irecv_)>("MPI_Irecv");
    test_ = bind<decltype(test_)>("MPI_Test");
    reduce_local_ = bind<decltype(reduce_local_)>("MPI_Reduce_local");
    comm_rank_ = bind<decltype(comm_rank_)>("MPI_Comm_rank");
    comm_size_ = bind<decltype(comm_size_)>("MPI_Comm_size");
    type_size_ = bind<decltype(type_size_)>("MPI_Type_size");
    op_create_ = bind<decltype(op_create_)>("MPI_Op_create");
    op_free_ = bind<decltype(op_free_)>("MPI_Op_free");
    error_string_ = bind<decltype(error_string_)>("MPI_Error_string");
  }

  void set_one_host(TransportHandle comm, bool one_host) override {
    std::lock_guard<std::mutex> lock(one_host_mu_);
    if (one_host) one_host_.insert(comm);
    else one_host_.erase(comm);
  }

  // On one host MPI's blocking collectives are faster than its nonblocking ones (which
  // MPICH runs from schedules), and a late peer is a few microseconds away: they are used
  // there, polling as MPI does.  Across hosts a wait may last as long as a transfer over the
  // network, and is quiet.
  void allreduce(const void* s, void* r, int n, TransportHandle dt, TransportHandle op, TransportHandle comm) override {
    if (on_one_host(comm)) {
      check(allreduce_(s, r, n, h(dt), h(op), h(comm)), "MPI_Allreduce");
      return;
    }
    H req{};
    check(iallreduce_(s, r, n, h(dt), h(op), h(comm), &req), "MPI_Iallreduce");
    wait(&req, "MPI_Iallreduce");
  }
  void reduce_in_place(void* buf, int n, TransportHandle dt, TransportHandle op,
                       TransportHandle comm) override {
    const bool one_host = on_one_host(comm);
    int item = 0, size = 1;
    check(type_size_(h(dt), &item), "MPI_Type_size");
    check(comm_size_(h(comm), &size), "MPI_Comm_size");
    // On one host MPI's shared-memory algorithms move the data with fewer copies.
    if (size > 1 && (!one_host || tuning_.ring_on_one_host) && tuning_.ring_min_bytes > 0 &&
        int64_t(n) * item >= tuning_.ring_min_bytes) {
      ring_allreduce(static_cast<char*>(buf), n, item, h(dt), h(op), h(comm), size);
      ++ring_allreduces;
    } else {
      allreduce(in_place, buf, n, dt, op, comm);
    }
  }
  void bcast(void* b, int n, TransportHandle dt, int root, TransportHandle comm) override {
    if (on_one_host(comm)) {
      check(bcast_(b, n, h(dt), root, h(comm)), "MPI_Bcast");
      return;
    }
    H req{};
    check(ibcast_(b, n, h(dt), root, h(comm), &req), "MPI_Ibcast");
    wait(&req, "MPI_Ibcast");
  }
  void gather(const void* s, int sn, TransportHandle sdt, void* r, int rn, TransportHandle rdt, int root,
              TransportHandle comm) override {
    if (on_one_host(comm)) {
      check(gather_(s, sn, h(sdt), r, rn, h(rdt), root, h(comm)), "MPI_Gather");
      return;
    }
    H req{};
    check(igather_(s, sn, h(sdt), r, rn, h(rdt), root, h(comm), &req), "MPI_Igather");
    wait(&req, "MPI_Igather");
  }
  void gatherv(const void* s, int sn, TransportHandle sdt, void* r, const int* rc, const int* dis,
               TransportHandle rdt, int root, TransportHandle comm) override {
    if (on_one_host(comm)) {
      check(gatherv_(s, sn, h(sdt), r, rc, dis, h(rdt), root, h(comm)), "MPI_Gatherv");
      return;
    }
    H req{};
    check(igatherv_(s, sn, h(sdt), r, rc, dis, h(rdt), root, h(comm), &req), "MPI_Igatherv");
    wait(&req, "MPI_Igatherv");
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

  bool on_one_host(TransportHandle comm) {
    std::lock_guard<std::mutex> lock(one_host_mu_);
    return one_host_.count(comm) > 0;
  }

  // True once `req` completed (MPI then resets it to MPI_REQUEST_NULL).
  bool done(H* req, const char* what) {
    int flag = 0;
    check(test_(req, &flag, status_), what);
    return flag != 0;
  }

  void wait(H* req, const char* what) {
    QuietWait pause(tuning_.wait);
    while (!done(req, what)) pause.after_test(false);
  }

  // A ring allreduce in place: reduce-scatter then allgather, 2(size-1) steps of one chunk
  // each (bandwidth-optimal: each rank sends and receives 2(size-1)/size of the buffer).
  // Each chunk moves in segments, up to `window` of them in flight each way, so that a
  // segment is reduced while the next ones are on the wire, and a segment goes on to the
  // next rank as soon as it is reduced rather than when its whole chunk is.
  //
  // At step t rank r sends chunk (r - t) mod size to its right and receives chunk
  // (r - t - 1) mod size from its left: reduced into place during the first size-1 steps
  // (after which rank r holds chunk r+1 complete), written into place during the others.
  // Sends and receives are posted in (step, segment) order on one tag, so MPI's ordering
  // matches them.  Every chunk's value is reduced once, in the order of the ring starting at
  // its first sender, and then copied: every rank gets the same bits.
  void ring_allreduce(char* buf, int64_t count, int item, H dt, H op, H comm, int size) {
    int rank = 0;
    check(comm_rank_(comm, &rank), "MPI_Comm_rank");
    const int right = (rank + 1) % size, left = (rank + size - 1) % size;
    const int64_t base = count / size, rem = count % size;
    auto chunk_start = [&](int c) { return c * base + std::min<int64_t>(c, rem); };
    auto chunk_len = [&](int c) { return base + (c < rem ? 1 : 0); };
    const int64_t seg = std::max<int64_t>(1, tuning_.segment_bytes / item);
    struct Piece { int step; int64_t start, len; };
    // first[t]: the index of step t's first piece, in the send (or receive) order.
    std::vector<Piece> sends, recvs;
    std::vector<size_t> first_send, first_recv;
    const int steps = 2 * (size - 1);
    for (int t = 0; t < steps; ++t) {
      for (int pass = 0; pass < 2; ++pass) {
        int c = ((rank - t - pass) % size + size) % size;
        auto& list = pass == 0 ? sends : recvs;
        (pass == 0 ? first_send : first_recv).push_back(list.size());
        for (int64_t off = 0; off < chunk_len(c); off += seg)
          list.push_back({t, chunk_start(c) + off, std::min(seg, chunk_len(c) - off)});
      }
    }
    const size_t window = static_cast<size_t>(std::max(1, tuning_.window));
    if (scratch_.size() < window * seg * item) scratch_.resize(window * seg * item);
    std::vector<H> send_reqs(window), recv_reqs(window);
    size_t posted_sends = 0, sent = 0, posted_recvs = 0, received = 0;
    const int tag = kRingTag;
    QuietWait pause(tuning_.wait);
    while (received < recvs.size() || sent < sends.size()) {
      bool moved = false;
      while (posted_sends < sends.size() && posted_sends - sent < window) {
        const Piece& p = sends[posted_sends];
        // A chunk leaves once it holds what the previous step received into it.
        if (p.step > 0 && received <= first_recv[p.step - 1] + (posted_sends - first_send[p.step]))
          break;
        check(isend_(buf + p.start * item, int(p.len), dt, right, tag, comm,
                     &send_reqs[posted_sends % window]), "MPI_Isend");
        ++posted_sends;
        moved = true;
      }
      while (posted_recvs < recvs.size() && posted_recvs - received < window) {
        const Piece& p = recvs[posted_recvs];
        char* into;
        if (p.step < size - 1) {
          into = scratch_.data() + (posted_recvs % window) * seg * item;
        } else {
          // The allgather writes where this rank sent from size-1 steps before: only once
          // that send is done.
          int earlier = p.step - (size - 1);
          if (sent <= first_send[earlier] + (posted_recvs - first_recv[p.step])) break;
          into = buf + p.start * item;
        }
        check(irecv_(into, int(p.len), dt, left, tag, comm, &recv_reqs[posted_recvs % window]),
              "MPI_Irecv");
        ++posted_recvs;
        moved = true;
      }
      while (sent < posted_sends && done(&send_reqs[sent % window], "MPI_Isend")) {
        ++sent;
        moved = true;
      }
      while (received < posted_recvs && done(&recv_reqs[received % window], "MPI_Irecv")) {
        const Piece& p = recvs[received];
        if (p.step < size - 1)
          check(reduce_local_(scratch_.data() + (received % window) * seg * item,
                              buf + p.start * item, int(p.len), dt, op), "MPI_Reduce_local");
        ++received;
        moved = true;
      }
      pause.after_test(moved);
    }
  }

  static constexpr int kRingTag = 0x41a1;
  std::mutex one_host_mu_;  // sets are added from Python threads, read by the engine's
  std::unordered_set<TransportHandle> one_host_;
  MpiTuning tuning_;
  std::vector<char> scratch_;
  // Room for an MPI_Status of either ABI (MPI_STATUS_IGNORE's value differs between them).
  alignas(8) char status_[64] = {};
  int (*allreduce_)(const void*, void*, int, H, H, H) = nullptr;
  int (*bcast_)(void*, int, H, int, H) = nullptr;
  int (*gather_)(const void*, int, H, void*, int, H, int, H) = nullptr;
  int (*gatherv_)(const void*, int, H, void*, const int*, const int*, H, int, H) = nullptr;
  int (*iallreduce_)(const void*, void*, int, H, H, H, H*) = nullptr;
  int (*ibcast_)(void*, int, H, int, H, H*) = nullptr;
  int (*igather_)(const void*, int, H, void*, int, H, int, H, H*) = nullptr;
  int (*igatherv_)(const void*, int, H, void*, const int*, const int*, H, int, H, H*) = nullptr;
  int (*isend_)(const void*, int, H, int, int, H, H*) = nullptr;
  int (*irecv_)(void*, int, H, int, int, H, H*) = nullptr;
  int (*test_)(H*, int*, void*) = nullptr;
  int (*reduce_local_)(const void*, void*, int, H, H) = nullptr;
  int (*comm_rank_)(H, int*) = nullptr;
  int (*comm_size_)(H, int*) = nullptr;
  int (*type_size_)(H, int*) = nullptr;
  int (*op_create_)(void*, int, H*) = nullptr;
  int (*op_free_)(H*) = nullptr;
  int (*error_string_)(int, char*, int*) = nullptr;
};

}  // namespace

std::unique_ptr<Transport> bind_mpi(int handle_bytes, int64_t in_place, const MpiTuning& tuning) {
  if (handle_bytes == 4) return std::make_unique<TypedMpi<int32_t>>(in_place, tuning);
  if (handle_bytes == static_cast<int>(sizeof(void*)))
    return std::make_unique<TypedMpi<void*>>(in_place, tuning);
  throw std::invalid_argument("aiak engine: unsupported MPI handle size " +
                              std::to_string(handle_bytes));
}

}  // namespace engine
}  // namespace aiak
