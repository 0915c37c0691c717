// The engine's C++ core: a background thread that negotiates and runs collectives without
// the GIL.
//
// Python (aiak_training/runtime/engine.py) enqueues tensors and waits on handles; the
// thread here owns the queues, the negotiation of every process set (controller.h), the
// fusion buffer and the transport calls (MPI or Gloo, transport.h) of host allreduce and
// broadcast, and completes handles.
// What it cannot do without Python (GPU collectives, allgather/alltoall/reducescatter, whose
// results are allocated by the frontend, process-set changes and the hierarchical
// algorithms) it hands, in agreed order, to a "lane": a Python callable it calls with the GIL.
// The steady-state path of a host allreduce never touches the interpreter.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "common/dtypes.h"
#include "engine/controller.h"
#include "engine/messages.h"
#include "engine/transport.h"

namespace aiak {
namespace engine {

struct EngineConfig {
  double cycle_time_s = 0.001;
  int cache_capacity = 1024;
  double stall_check_s = 60.0, stall_shutdown_s = 0.0;
  // A certain deadlock (every rank waits on a handle, and none submitted or completed
  // anything for this long) ends the job with an error on every rank; 0: off.
  double deadlock_s = 0.0;
  // Idle cycles park for up to this long (0: never); a waiter wakes the thread.
  double idle_park_s = 0.0;
  NegotiationTypes types;
  TransportHandle dtypes[11] = {};                          // by DataType code
  TransportHandle sum = 0, min = 0, max = 0, prod = 0, lor = 0, land = 0;
  std::string shut_down, duplicate_name;              // messages users match on
};

// One tensor of this rank, as raw memory.
struct Entry {
  std::string name;
  int32_t dtype = 0;
  int64_t count = 0, nbytes = 0;
  uintptr_t in = 0, out = 0;
  int64_t handle = -1;
  Signature signature;
  bool lane = false;  // the Python lane holds this tensor's entry (runtime/entries.py)
  // CUDA tensors: the device, and the cudaEvent_t recorded on the producer's stream at
  // submission, which the engine's stream waits on before it reads the tensor.
  int32_t device = -1;
  int64_t ready_event = 0;
};

// This rank's entry for request `r`, whose data is at `in` (result at `out`).
inline Entry make_entry(const Request& r, uintptr_t in, uintptr_t out) {
  Entry e;
  e.name = r.name;
  e.dtype = r.dtype;
  e.count = 1;
  for (int64_t d : r.shape) e.count *= d;
  e.nbytes = e.count * itemsize(r.dtype);
  e.in = in;
  e.out = out;
  return e;
}

// How a call into the engine failed, for the binding to raise the right Python exception.
class EngineStopped : public std::runtime_error {  // HorovodInternalError
 public:
  using std::runtime_error::runtime_error;
};
class BadRequest : public std::invalid_argument {  // ValueError
 public:
  using std::invalid_argument::invalid_argument;
};

struct WaitResult {
  bool done = false, failed = false, unknown = false;
  std::string error;
  bool has_result = false;
  int64_t result = 0, event = 0;
};

// A fused allreduce of CUDA tensors, as the lane receives it: one list per field, so that
// the Python side builds no object per tensor.  Tensor i of this rank reads ins[i] and
// writes outs[i]; where this rank joined (hvd.join) it has no tensor: i is in `missing`,
// and the lane supplies zeros of counts[i] elements.  The lane writes the completion
// cudaEvent_t it recorded (with one use per tensor of this rank) into `event`.
struct GpuAllreduce {
  std::vector<std::string> names;
  int32_t dtype = 0, reduce_op = 1;
  double prescale = 1.0, postscale = 1.0;
  int32_t device = -1;
  std::vector<uintptr_t> ins, outs;
  std::vector<int64_t> counts, ready_events;
  std::vector<int64_t> missing;
  int64_t event = 0;
};

// The lane: called on the engine thread with the GIL.  kind is "execute" (responses),
// "gpu_allreduce" (a GpuAllreduce), "timeline" (events), "stall" (report lines) or "fatal"
// (a failure message); it returns a failure message to stop the engine with, or an empty
// string.
using Lane = std::function<std::string(const std::string& kind, int set_id, const void* data)>;

struct TimelineEvent {
  std::string name, activity;  // activity "" ends the open one; name "" marks a cycle
  double ts;
};

class Engine {
 public:
  Engine(EngineConfig config, Lane lane, std::unique_ptr<Transport> transport);
  ~Engine();

  // `one_host`: every rank of the set is on this host (the transport may choose its
  // algorithms by it: mpi.cpp).
  void add_set(int set_id, TransportHandle comm, int rank, int size, bool flat,
               bool one_host = false);
  bool remove_set(int set_id, const std::string& why);
  // Switches a set between the native flat allreduce and the lane's algorithms (autotune).
  // Safe only while the set has no allreduce in flight; false if the set is unknown.
  bool set_flat(int set_id, bool flat);
  void start();
  void request_shutdown();
  void join();

  // Submits requests atomically (a group lands in one cycle); returns their handles.
  std::vector<int64_t> enqueue(int set_id, std::vector<Request> requests, std::vector<Entry> entries);
  WaitResult wait(int64_t handle, bool forget);
  // Waits for every handle and forgets them all, failed or not (the first failure is in the
  // results, in order); a handle unknown when the wait starts is reported as such.
  std::vector<WaitResult> wait_all(const std::vector<int64_t>& handles);
  WaitResult poll(int64_t handle) const;
  std::vector<int64_t> wait_any(const std::vector<int64_t>& handles, double timeout_s);
  std::optional<double> completion_time(int64_t handle) const;
  // Completes a lane-executed tensor (the lane's completer): removes its entry, then marks
  // its handle done, so a resubmission under the same name never sees a duplicate.
  void finish_name(int set_id, const std::string& name, const std::string& error, int64_t event);
  void abandon(const std::string& reason);
  // The library helper (``consolidate_state_dict``...) whose requests the calling thread is
  // submitting, "" for none: stall and deadlock reports name it.  Per thread.
  static void set_call_origin(std::string origin);
  static const std::string& call_origin();

  int64_t handle_of(int set_id, const std::string& name) const;
  std::map<std::string, int64_t> counts() const;
  // Counters that grow as the engine works (unlike counts()): negotiations of the global
  // set and allreduces run as the transport's own ring.
  std::map<std::string, int64_t> progress_counters() const;
  // (set id, name, bytes) of every tensor submitted and not yet completed.
  std::vector<std::tuple<int, std::string, int64_t>> in_flight() const;
  double cycle_started() const { return cycle_started_.load(); }
  bool running() const { return started_ && !stopped_.load(); }
  bool stopped() const { return stopped_.load(); }
  std::string fatal() const;
  int set_rank(int set_id) const;

  std::atomic<int64_t> fusion_threshold{64 << 20};
  // Seconds between cycles; starts at config.cycle_time_s and may be changed while running.
  std::atomic<double> cycle_time_s{0.001};
  std::atomic<int64_t> zero_copy_bytes{1 << 20};
  std::atomic<bool> timeline_on{false};
  // Autotune's response cache switch for the global set: -1 none, 0 off, 1 on.  Set before
  // the step's first tensor is queued, taken by the next cycle before it negotiates.
  std::atomic<int> cache_switch{-1};

 private:
  struct SetState {
    int id, rank, size;
    TransportHandle comm;
    std::atomic<bool> flat{true};  // read by the engine thread, changed by set_flat
    std::unique_ptr<Controller> controller;
    std::vector<Request> queue;
    std::unordered_map<std::string, Entry> entries;
    TableCounts counts;  // the controller's, as of its last change seen by a waiter
  };
  struct Handle {
    bool done = false;
    std::string error;
    bool failed = false;
    bool has_result = false;
    int64_t result = 0, event = 0;
    double done_at = 0;
  };

  void run();
  bool has_local_work_locked() const;
  void wake_for_waiter_locked() const;
  // Counts a thread that blocks on a pending handle (the deadlock check's input).
  void begin_wait_locked();
  void end_wait_locked() { --waiters_; }
  bool stuck_locked(double now) const;
  // Seconds to pause after a cycle: the cycle time, longer once the global set has made no
  // progress for a while (a wait that no peer ends should not keep a core busy).
  double pause_after_cycle() const;
  // One negotiation and execution per process set; true when the engine must stop, with
  // why (and whether it is a deadlock report, the error itself).
  bool cycle(std::string* why, bool* deadlock);
  void execute(SetState& set, const std::vector<ResponsePtr>& responses);
  bool is_lane(const SetState& set, const Response& resp) const;
  void run_lane(SetState& set, const std::vector<ResponsePtr>& batch);
  void allreduce_group(SetState& set, const std::vector<ResponsePtr>& group);
  void gpu_allreduce_group(SetState& set, const std::vector<ResponsePtr>& group);
  void broadcast(SetState& set, const ResponsePtr& resp);
  void reduce_host(SetState& set, uintptr_t addr, int64_t count, int32_t dtype, int32_t op);
  TransportHandle op_handle(int32_t dtype, int32_t op);
  // This rank's entries of `group` (copies), zeros of the agreed shape where it joined.
  std::vector<Entry> entries_or_zeros(SetState& set, const std::vector<ResponsePtr>& group);
  void finish(SetState& set, const ResponsePtr& resp, bool has_result = false, int64_t result = 0);
  void finish(SetState& set, const std::vector<ResponsePtr>& responses, bool has_result = false,
              int64_t result = 0, int64_t event = 0);
  void fail_names(SetState& set, const std::vector<std::string>& names, const std::string& error);
  void complete_locked(int64_t handle, const std::string* error, bool has_result, int64_t result,
                       int64_t event);
  void stop(const std::string& reason);
  void fail_all(const std::string& reason);
  void activity(const std::vector<std::string>& names, const char* what);
  void flush_timeline();

  EngineConfig config_;
  Lane lane_;
  std::unique_ptr<Transport> transport_;
  mutable std::mutex mu_;
  std::condition_variable done_cv_;
  mutable std::condition_variable wake_cv_;
  std::map<int, std::shared_ptr<SetState>> sets_;
  std::unordered_map<int64_t, Handle> handles_;
  int64_t next_handle_ = 1;
  std::thread thread_;
  bool started_ = false;
  std::atomic<bool> stopped_{false}, shutdown_requested_{false};
  std::string fatal_;
  mutable bool waiter_blocked_ = false;  // a waiter found its handle pending: skip the pause
  bool parked_ = false;                  // the thread is in an idle park (under mu_)
  std::atomic<int64_t> negotiations_{0};  // of the global set, since start
  bool pending_anywhere_ = true;
  double submitted_at_ = 0;  // the first submission during a park or back-off (under mu_)  // engine thread: the last global negotiation's verdict
  bool backing_off_ = false;             // the pause is longer than the cycle (under mu_)
  // The deadlock check's view of this rank (under mu_): threads blocked on a pending
  // handle, since when one has been, and the last submission or completion.
  int waiters_ = 0;
  double waiting_since_ = 0, last_activity_ = 0;
  double quiet_since_ = 0;  // engine thread: the global set's last progress (controller.h)
  bool moved_elsewhere_ = false;  // engine thread: a non-global set had responses
  std::atomic<double> cycle_started_{0.0};
  std::vector<char> fusion_;
  std::vector<std::vector<char>> zeros_keep_;
  std::map<std::pair<int, int>, TransportHandle> user_ops_;
  std::vector<TimelineEvent> events_;
};

double monotonic_now();

}  // namespace engine
}  // namespace aiak
