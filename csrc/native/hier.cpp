// Shared-memory intra-node stage of the aiak-hier allreduce (aiak_training/allreduce/aiak_hier.py).
//
// The local ranks of a node share one MPI-3 shared window.  Each rank's segment holds a
// control page (progress counters) followed by `slots` chunk-sized staging slots.  A fused
// buffer is cut into chunks; chunk g (counted over the whole life of the node, so counters
// never need resetting between calls) lives in slot g % slots of every segment and is cut
// into `owners` slices.  Per chunk:
//
//   copy-in   every rank copies its chunk into its own slot                  -> in_done
//   reduce    owner j reduces slice j over all ranks' slots, in one pass,
//             into its own slot (reading the peers' memory directly)         -> red_done
//   cross     owner j allreduces slice j over the cross communicator
//             (MPI, on the engine thread, in Python)                          -> x_done
//   copy-out  every rank copies all slices of the chunk back to its buffer    -> out_done
//
// A worker thread runs copy-in / reduce / copy-out of later and earlier chunks while the
// engine thread is inside the MPI call of the current one: that is the pipeline.  Processes
// synchronise only through the counters (release/acquire atomics in the shared page) and one
// node-wide futex "doorbell", so idle waiters sleep instead of spinning on a busy CPU.
#include "native/hier.h"

#include <pybind11/stl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <climits>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#ifdef __linux__
#include <linux/futex.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>
#endif

#include "common/dtypes.h"
#include "common/half.h"

namespace py = pybind11;

namespace aiak {
namespace {

// ---- multi-source reduction: dst = op(src_0, src_1, ..., src_{k-1}) ----------------------
// One pass over dst, blocked so that the partial result of a block stays in L1 while every
// source is folded in.  dst may alias src_0 (and only src_0).
constexpr int64_t kBlock = 2048;

template <typename T>
struct SumOp { static T apply(T a, T b) { return static_cast<T>(a + b); } };
template <typename T>
struct MinOp { static T apply(T a, T b) { return b < a ? b : a; } };
template <typename T>
struct MaxOp { static T apply(T a, T b) { return b > a ? b : a; } };
template <typename T>
struct ProdOp { static T apply(T a, T b) { return static_cast<T>(a * b); } };
// Half types are accumulated in float and rounded once (MIN/MAX round-trip exactly).
struct FMinOp { static float apply(float a, float b) { return std::fmin(a, b); } };
struct FMaxOp { static float apply(float a, float b) { return std::fmax(a, b); } };

template <typename T, typename Op>
void fold_plain(const std::vector<uintptr_t>& srcs, T* dst, int64_t n) {
  const size_t k = srcs.size();
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t e = std::min(n, b + kBlock);
    const T* s0 = reinterpret_cast<const T*>(srcs[0]);
    if (k == 1) {
      if (s0 != dst) std::memcpy(dst + b, s0 + b, (e - b) * sizeof(T));
      continue;
    }
    const T* s1 = reinterpret_cast<const T*>(srcs[1]);
    for (int64_t i = b; i < e; ++i) dst[i] = Op::apply(s0[i], s1[i]);
    for (size_t s = 2; s < k; ++s) {
      const T* sp = reinterpret_cast<const T*>(srcs[s]);
      for (int64_t i = b; i < e; ++i) dst[i] = Op::apply(dst[i], sp[i]);
    }
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float), typename Op>
void fold_half(const std::vector<uintptr_t>& srcs, uint16_t* dst, int64_t n) {
  float acc[kBlock];
  for (int64_t b = 0; b < n; b += kBlock) {
    const int64_t m = std::min(n - b, kBlock);
    const uint16_t* s0 = reinterpret_cast<const uint16_t*>(srcs[0]) + b;
    for (int64_t i = 0; i < m; ++i) acc[i] = ToF(s0[i]);
    for (size_t s = 1; s < srcs.size(); ++s) {
      const uint16_t* sp = reinterpret_cast<const uint16_t*>(srcs[s]) + b;
      for (int64_t i = 0; i < m; ++i) acc[i] = Op::apply(acc[i], ToF(sp[i]));
    }
    for (int64_t i = 0; i < m; ++i) dst[b + i] = FromF(acc[i]);
  }
}

struct FSum { static float apply(float a, float b) { return a + b; } };
struct FProd { static float apply(float a, float b) { return a * b; } };

template <typename T>
void fold_typed(const std::vector<uintptr_t>& srcs, T* dst, int64_t n, int op) {
  switch (op) {
    case AVERAGE:  // Average is reduced as Sum; the engine applies the scale factors.
    case SUM: fold_plain<T, SumOp<T>>(srcs, dst, n); break;
    case MIN: fold_plain<T, MinOp<T>>(srcs, dst, n); break;
    case MAX: fold_plain<T, MaxOp<T>>(srcs, dst, n); break;
    case PRODUCT: fold_plain<T, ProdOp<T>>(srcs, dst, n); break;
    default: throw std::invalid_argument("reduce_sources: unsupported op " + std::to_string(op));
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void fold_half_op(const std::vector<uintptr_t>& srcs, uint16_t* dst, int64_t n, int op) {
  switch (op) {
    case AVERAGE:
    case SUM: fold_half<ToF, FromF, FSum>(srcs, dst, n); break;
    case MIN: fold_half<ToF, FromF, FMinOp>(srcs, dst, n); break;
    case MAX: fold_half<ToF, FromF, FMaxOp>(srcs, dst, n); break;
    case PRODUCT: fold_half<ToF, FromF, FProd>(srcs, dst, n); break;
    default: throw std::invalid_argument("reduce_sources: unsupported op " + std::to_string(op));
  }
}

// Bool: Sum and Max are logical OR, Min and Product logical AND (as the MPI path does).
struct OrOp { static uint8_t apply(uint8_t a, uint8_t b) { return (a | b) ? 1 : 0; } };
struct AndOp { static uint8_t apply(uint8_t a, uint8_t b) { return (a && b) ? 1 : 0; } };

bool supported(int dtype, int op) {
  if (dtype < UINT8 || dtype > BFLOAT16) return false;
  if (dtype == BOOL) return op == SUM || op == MAX || op == MIN || op == PRODUCT;
  return op == AVERAGE || op == SUM || op == MIN || op == MAX || op == PRODUCT;
}

void fold(const std::vector<uintptr_t>& srcs, uintptr_t dst, int64_t n, int dtype, int op) {
  if (n <= 0 || srcs.empty()) return;
  switch (dtype) {
    case UINT8: fold_typed(srcs, reinterpret_cast<uint8_t*>(dst), n, op); break;
    case INT8: fold_typed(srcs, reinterpret_cast<int8_t*>(dst), n, op); break;
    case UINT16: fold_typed(srcs, reinterpret_cast<uint16_t*>(dst), n, op); break;
    case INT16: fold_typed(srcs, reinterpret_cast<int16_t*>(dst), n, op); break;
    case INT32: fold_typed(srcs, reinterpret_cast<int32_t*>(dst), n, op); break;
    case INT64: fold_typed(srcs, reinterpret_cast<int64_t*>(dst), n, op); break;
    case FLOAT32: fold_typed(srcs, reinterpret_cast<float*>(dst), n, op); break;
    case FLOAT64: fold_typed(srcs, reinterpret_cast<double*>(dst), n, op); break;
    case FLOAT16:
      fold_half_op<half_to_float, float_to_half>(srcs, reinterpret_cast<uint16_t*>(dst), n, op);
      break;
    case BFLOAT16:
      fold_half_op<bf16_to_float, float_to_bf16>(srcs, reinterpret_cast<uint16_t*>(dst), n, op);
      break;
    case BOOL:
      if (op == SUM || op == MAX) {
        fold_plain<uint8_t, OrOp>(srcs, reinterpret_cast<uint8_t*>(dst), n);
      } else if (op == MIN || op == PRODUCT) {
        fold_plain<uint8_t, AndOp>(srcs, reinterpret_cast<uint8_t*>(dst), n);
      } else {
        throw std::invalid_argument("reduce_sources: unsupported op for bool " + std::to_string(op));
      }
      break;
    default: throw std::invalid_argument("reduce_sources: unsupported dtype " + std::to_string(dtype));
  }
}

void reduce_sources(const std::vector<uintptr_t>& srcs, uintptr_t dst, int64_t n, int dtype,
                    int op) {
  if (!supported(dtype, op))
    throw std::invalid_argument("reduce_sources: unsupported dtype/op " + std::to_string(dtype) +
                                "/" + std::to_string(op));
  for (size_t s = 1; s < srcs.size(); ++s)
    if (srcs[s] == dst) throw std::invalid_argument("reduce_sources: dst may alias only srcs[0]");
  py::gil_scoped_release release;
  fold(srcs, dst, n, dtype, op);
}

// ---- shared control page -----------------------------------------------------------------
constexpr int64_t kControlBytes = 4096;

struct alignas(64) Counter {
  std::atomic<uint64_t> v;
};

// At the start of every rank's segment.  Counters are chunk sequence numbers: "chunks
// 0..v-1 of this node's lifetime have passed this step on this rank".
struct RankControl {
  Counter in_done;   // copied in
  Counter red_done;  // own slice reduced over the node (owners only)
  Counter x_done;    // own slice allreduced across nodes: final (owners only)
  Counter out_done;  // copied back out in full
};

// Node-wide, in local rank 0's control page after its RankControl.
struct NodeControl {
  alignas(64) std::atomic<uint32_t> bell;      // bumped after every counter store
  alignas(64) std::atomic<uint32_t> waiters;   // threads asleep (or about to be) on bell
  alignas(64) std::atomic<uint32_t> poisoned;  // set when a rank fails: everyone stops
};

static_assert(sizeof(RankControl) + sizeof(NodeControl) + 64 <= kControlBytes, "control page");
static_assert(std::atomic<uint64_t>::is_always_lock_free, "need address-free 64-bit atomics");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "need address-free 32-bit atomics");
constexpr int64_t kNodeControlOffset = 1024;

void futex_wait(std::atomic<uint32_t>* addr, uint32_t expected, int64_t timeout_ns) {
#ifdef __linux__
  struct timespec ts;
  ts.tv_sec = timeout_ns / 1000000000;
  ts.tv_nsec = timeout_ns % 1000000000;
  // Not FUTEX_PRIVATE: the word lives in memory shared between processes.
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAIT, expected, &ts, nullptr, 0);
#else
  (void)addr;
  (void)expected;
  std::this_thread::sleep_for(std::chrono::microseconds(50));
  (void)timeout_ns;
#endif
}

void futex_wake_all(std::atomic<uint32_t>* addr) {
#ifdef __linux__
  syscall(SYS_futex, reinterpret_cast<uint32_t*>(addr), FUTEX_WAKE, INT_MAX, nullptr, nullptr, 0);
#else
  (void)addr;
#endif
}

class NodeFailure : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// ---- the per-process view of a node ------------------------------------------------------
class HierNode {
 public:
  HierNode(std::vector<uintptr_t> segments, int local_rank, int owners, int slots,
           int64_t slot_bytes, double timeout_s, bool use_worker)
      : seg_(std::move(segments)), me_(local_rank), owners_(owners), slots_(slots),
        slot_bytes_(slot_bytes), timeout_s_(timeout_s) {
    const int L = static_cast<int>(seg_.size());
    if (L < 1 || me_ < 0 || me_ >= L) throw std::invalid_argument("HierNode: bad local rank");
    if (owners_ < 1 || owners_ > L) throw std::invalid_argument("HierNode: owners not in 1..L");
    if (slots_ < 2) throw std::invalid_argument("HierNode: need at least 2 slots");
    if (slot_bytes_ < 64 || slot_bytes_ % 64) throw std::invalid_argument("HierNode: slot_bytes");
    node_ = reinterpret_cast<NodeControl*>(seg_[0] + kNodeControlOffset);
    if (use_worker) worker_ = std::thread([this] { worker_main(); });
  }

  ~HierNode() { close(); }

  // Zero a fresh control page (collectively, before a barrier; MPI does not zero windows).
  static void init_control(uintptr_t segment) {
    std::memset(reinterpret_cast<void*>(segment), 0, kControlBytes);
  }

  static int64_t control_bytes() { return kControlBytes; }

  bool is_owner() const { return me_ < owners_; }

  // Begin an allreduce of `count` elements at `addr` (in place).  Returns the number of
  // chunks; the caller then, if it is an owner, does wait_reduced / cross / mark_crossed for
  // every chunk in order, and finally finish().  A single-chunk call runs on the calling
  // thread; a longer one hands the intra-node work to the worker thread.
  int64_t start(uintptr_t addr, int64_t count, int dtype, int op) {
    if (busy_) throw std::runtime_error("HierNode: a previous allreduce did not finish");
    if (!supported(dtype, op))
      throw std::invalid_argument("HierNode: unsupported dtype/op " + std::to_string(dtype) +
                                  "/" + std::to_string(op));
    check_poison();
    Job& j = job_;
    j = Job();
    j.addr = addr;
    j.count = count;
    j.dtype = dtype;
    j.op = op;
    j.isz = itemsize(dtype);
    j.chunk_elems = slot_bytes_ / j.isz;
    j.nchunks = count <= 0 ? 0 : (count + j.chunk_elems - 1) / j.chunk_elems;
    j.base = seq_;
    j.copied.assign(owners_, 0);
    busy_ = true;
    inline_ = !worker_.joinable() || j.nchunks <= 1;
    if (j.nchunks == 0) return 0;
    if (inline_) {
      py::gil_scoped_release release;
      // Run our own steps until the first chunk is ready for the network.
      drive([&] { return is_owner() ? j.next_red >= 1 : j.next_in >= 1; });
    } else {
      std::lock_guard<std::mutex> lk(mu_);
      job_ready_ = true;
      job_done_ = false;
      error_.clear();
      cv_.notify_all();
    }
    return j.nchunks;
  }

  // Owner: block until slice me_ of chunk c is reduced over the node; return (address, count)
  // of that slice in shared memory, for the cross-node allreduce.
  std::pair<uintptr_t, int64_t> wait_reduced(int64_t c) {
    const Job& j = job_;
    if (!is_owner()) throw std::runtime_error("wait_reduced: not an owner");
    if (c < 0 || c >= j.nchunks) throw std::out_of_range("wait_reduced: chunk");
    const uint64_t g = j.base + c;
    {
      py::gil_scoped_release release;
      if (inline_) {
        drive([&] { return j.next_red > c; });
      } else {
        wait_until([&] { return ctrl(me_)->red_done.v.load(std::memory_order_acquire) > g; });
      }
    }
    int64_t off, len;
    slice(j.chunk_count(c), me_, &off, &len);
    return {slot(me_, g) + off * j.isz, len};
  }

  // Owner: slice me_ of chunk c is final; peers may copy it out.
  void mark_crossed(int64_t c) {
    const Job& j = job_;
    if (!is_owner()) throw std::runtime_error("mark_crossed: not an owner");
    publish(ctrl(me_)->x_done, j.base + c + 1);
  }

  // Wait until this rank's buffer holds the result.
  void finish() {
    if (!busy_) return;
    Job& j = job_;
    std::string err;
    {
      py::gil_scoped_release release;
      if (inline_) {
        try {
          drive([&] { return j.next_out >= j.nchunks; });
        } catch (const std::exception& e) {
          err = e.what();
        }
      } else {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return job_done_; });
        err = error_;
      }
    }
    busy_ = false;
    if (!err.empty()) {
      poison();
      throw std::runtime_error(err);
    }
    seq_ += j.nchunks;
  }

  // The caller failed mid-allreduce (e.g. MPI raised): stop the node so no rank hangs.
  void abort() {
    poison();
    if (busy_ && !inline_) {
      py::gil_scoped_release release;
      std::unique_lock<std::mutex> lk(mu_);
      cv_.wait(lk, [&] { return job_done_; });
    }
    busy_ = false;
  }

  void close() {
    {
      std::lock_guard<std::mutex> lk(mu_);
      stop_ = true;
      cv_.notify_all();
    }
    if (worker_.joinable()) {
      if (busy_) poison();  // a job left running would wait on peers forever
      // No GIL release: this also runs from the destructor during interpreter teardown, and
      // the worker never takes the GIL, so joining it while holding the GIL cannot deadlock.
      worker_.join();
    }
  }

  uint64_t sequence() const { return seq_; }

 private:
  struct Job {
    uintptr_t addr = 0;
    int64_t count = 0;
    int dtype = 0, op = 0, isz = 1;
    int64_t chunk_elems = 1, nchunks = 0;
    uint64_t base = 0;
    int64_t next_in = 0, next_red = 0, next_out = 0;
    std::vector<char> copied;  // slices of chunk next_out already copied out
    int64_t chunk_count(int64_t c) const { return std::min(chunk_elems, count - c * chunk_elems); }
  };

  RankControl* ctrl(int r) const { return reinterpret_cast<RankControl*>(seg_[r]); }
  uintptr_t slot(int r, uint64_t g) const {
    return seg_[r] + kControlBytes + static_cast<int64_t>(g % slots_) * slot_bytes_;
  }
  // Slice k of an n-element chunk: the first n % owners slices get one extra element.
  void slice(int64_t n, int k, int64_t* off, int64_t* len) const {
    const int64_t base = n / owners_, extra = n % owners_;
    *off = k * base + std::min<int64_t>(k, extra);
    *len = base + (k < extra ? 1 : 0);
  }
  int local_size() const { return static_cast<int>(seg_.size()); }

  void check_poison() const {
    if (node_->poisoned.load(std::memory_order_acquire))
      throw NodeFailure("aiak-hier: another rank on this node failed during an allreduce");
  }
  void poison() {
    node_->poisoned.store(1, std::memory_order_release);
    ring();
  }
  void ring() {
    node_->bell.fetch_add(1, std::memory_order_seq_cst);
    if (node_->waiters.load(std::memory_order_seq_cst) > 0) futex_wake_all(&node_->bell);
  }
  void publish(Counter& c, uint64_t value) {
    c.v.store(value, std::memory_order_release);
    ring();
  }

  // Sleep until `pred` holds.  Raises if the node is poisoned or nothing on the node has
  // moved for timeout_s (a peer died or desynchronised), instead of hanging forever.
  template <typename Pred>
  void wait_until(Pred pred) {
    auto last_change = std::chrono::steady_clock::now();
    uint32_t last_bell = node_->bell.load(std::memory_order_seq_cst);
    for (int spin = 0;; ++spin) {
      const uint32_t bell = node_->bell.load(std::memory_order_seq_cst);
      if (pred()) return;
      check_poison();
      if (spin < 64) {  // a short spin catches a peer that is about to publish
#if defined(__x86_64__) || defined(__i386__)
        __builtin_ia32_pause();
#endif
        continue;
      }
      auto now = std::chrono::steady_clock::now();
      if (bell != last_bell) {
        last_bell = bell;
        last_change = now;
      } else if (std::chrono::duration<double>(now - last_change).count() > timeout_s_) {
        throw NodeFailure("aiak-hier: no progress on this node for " +
                          std::to_string(timeout_s_) + " s (AIAK_HIER_TIMEOUT_S)");
      }
      node_->waiters.fetch_add(1, std::memory_order_seq_cst);
      if (!pred()) futex_wait(&node_->bell, bell, 50 * 1000 * 1000);
      node_->waiters.fetch_sub(1, std::memory_order_seq_cst);
    }
  }

  // Run steps of the current job until `done` holds, sleeping when no step can run.
  template <typename Done>
  void drive(Done done) {
    while (!done()) {
      if (!step()) {
        wait_until([&] { return done() || can_step(); });
      }
    }
  }

  bool all_at_least(int which, uint64_t value, int upto) const {
    for (int r = 0; r < upto; ++r) {
      const RankControl* c = ctrl(r);
      const Counter& k = which == 0 ? c->in_done : c->out_done;
      if (k.v.load(std::memory_order_acquire) < value) return false;
    }
    return true;
  }

  bool reduce_ready() const {
    const Job& j = job_;
    return is_owner() && j.next_red < j.next_in &&
           all_at_least(0, j.base + j.next_red + 1, local_size());
  }
  bool copy_in_ready() const {
    const Job& j = job_;
    if (j.next_in >= j.nchunks) return false;
    const uint64_t g = j.base + j.next_in;
    // The slot of chunk g held chunk g - slots: every rank must have copied that one out.
    return g < static_cast<uint64_t>(slots_) || all_at_least(1, g - slots_ + 1, local_size());
  }
  bool copy_out_ready() const {
    const Job& j = job_;
    if (j.next_out >= j.next_in) return false;
    const uint64_t g = j.base + j.next_out;
    for (int k = 0; k < owners_; ++k)
      if (!j.copied[k] && ctrl(k)->x_done.v.load(std::memory_order_acquire) > g) return true;
    return false;
  }
  bool can_step() const { return reduce_ready() || copy_in_ready() || copy_out_ready(); }

  // One unit of intra-node work, most urgent first: the reduction feeds the network, then
  // copy-in keeps reductions coming, then copy-out frees slots.  False if nothing could run.
  bool step() {
    Job& j = job_;
    if (reduce_ready()) {
      const uint64_t g = j.base + j.next_red;
      int64_t off, len;
      slice(j.chunk_count(j.next_red), me_, &off, &len);
      std::vector<uintptr_t> srcs;
      srcs.reserve(local_size());
      srcs.push_back(slot(me_, g) + off * j.isz);  // own copy first: it is also dst
      for (int r = 0; r < local_size(); ++r)
        if (r != me_) srcs.push_back(slot(r, g) + off * j.isz);
      fold(srcs, srcs[0], len, j.dtype, j.op);
      ++j.next_red;
      publish(ctrl(me_)->red_done, g + 1);
      return true;
    }
    if (copy_in_ready()) {
      const uint64_t g = j.base + j.next_in;
      const int64_t n = j.chunk_count(j.next_in);
      std::memcpy(reinterpret_cast<void*>(slot(me_, g)),
                  reinterpret_cast<const void*>(j.addr + j.next_in * j.chunk_elems * j.isz),
                  n * j.isz);
      ++j.next_in;
      publish(ctrl(me_)->in_done, g + 1);
      return true;
    }
    if (copy_out_ready()) {
      const uint64_t g = j.base + j.next_out;
      const int64_t n = j.chunk_count(j.next_out);
      const uintptr_t out = j.addr + j.next_out * j.chunk_elems * j.isz;
      bool all = true;
      for (int k = 0; k < owners_; ++k) {
        if (j.copied[k]) continue;
        if (ctrl(k)->x_done.v.load(std::memory_order_acquire) > g) {
          int64_t off, len;
          slice(n, k, &off, &len);
          if (len) {
            std::memcpy(reinterpret_cast<void*>(out + off * j.isz),
                        reinterpret_cast<const void*>(slot(k, g) + off * j.isz), len * j.isz);
          }
          j.copied[k] = 1;
        } else {
          all = false;
        }
      }
      if (all) {
        std::fill(j.copied.begin(), j.copied.end(), 0);
        ++j.next_out;
        publish(ctrl(me_)->out_done, g + 1);
      }
      return true;
    }
    return false;
  }

  void worker_main() {
    for (;;) {
      {
        std::unique_lock<std::mutex> lk(mu_);
        cv_.wait(lk, [&] { return job_ready_ || stop_; });
        if (!job_ready_) return;  // stop_ with nothing to do
        job_ready_ = false;
      }
      std::string err;
      try {
        drive([&] { return job_.next_out >= job_.nchunks; });
      } catch (const std::exception& e) {
        err = e.what();
      }
      std::lock_guard<std::mutex> lk(mu_);
      error_ = err;
      job_done_ = true;
      cv_.notify_all();
    }
  }

  std::vector<uintptr_t> seg_;
  NodeControl* node_ = nullptr;
  const int me_, owners_, slots_;
  const int64_t slot_bytes_;
  const double timeout_s_;
  uint64_t seq_ = 0;  // chunks this node finished before the current job
  Job job_;
  bool busy_ = false, inline_ = true;

  std::thread worker_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool job_ready_ = false, job_done_ = true, stop_ = false;
  std::string error_;
};

}  // namespace

void register_hier(py::module_& m) {
  m.def("reduce_sources", &reduce_sources, py::arg("srcs"), py::arg("dst"), py::arg("count"),
        py::arg("dtype"), py::arg("op"),
        "dst = op(srcs[0], ..., srcs[-1]) elementwise in one pass; dst may alias srcs[0] only. "
        "Half types accumulate in float and round once.");
  py::class_<HierNode>(m, "HierNode",
                       "One process's view of a node's shared-memory allreduce pipeline.")
      .def(py::init<std::vector<uintptr_t>, int, int, int, int64_t, double, bool>(),
           py::arg("segments"), py::arg("local_rank"), py::arg("owners"), py::arg("slots"),
           py::arg("slot_bytes"), py::arg("timeout_s"), py::arg("use_worker") = true)
      .def_static("init_control", &HierNode::init_control, py::arg("segment"))
      .def_static("control_bytes", &HierNode::control_bytes)
      .def_property_readonly("is_owner", &HierNode::is_owner)
      .def_property_readonly("sequence", &HierNode::sequence)
      .def("start", &HierNode::start, py::arg("addr"), py::arg("count"), py::arg("dtype"),
           py::arg("op"))
      .def("wait_reduced", &HierNode::wait_reduced, py::arg("chunk"))
      .def("mark_crossed", &HierNode::mark_crossed, py::arg("chunk"))
      .def("finish", &HierNode::finish)
      .def("abort", &HierNode::abort)
      .def("close", &HierNode::close);
}

}  // namespace aiak
