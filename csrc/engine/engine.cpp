// The engine's C++ thread, queues, handles and host data path (see engine.h).
#include "engine/engine.h"

#include <pthread.h>

#include <algorithm>
#include <climits>
#include <cstring>
#include <ctime>

#include "common/dtypes.h"
#include "native/kernels.h"

namespace aiak {
namespace engine {

double monotonic_now() {
  // CLOCK_MONOTONIC is what Python's time.monotonic() reads on Linux: the watchdog and the
  // timeline compare our timestamps with theirs.
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
}

namespace {

// MPI user ops for the half types, which MPI cannot reduce: one function per (type, op),
// because the datatype MPI passes back is just "16-bit words" for both.
template <int DType, int Op>
void half_user_op(void* in, void* inout, int* len, void*) {
  reduce_into(reinterpret_cast<uintptr_t>(in), reinterpret_cast<uintptr_t>(inout), *len, DType, Op);
}

template <int DType>
UserFunction half_op_for(int op) {
  switch (op) {
    case SUM: case AVERAGE: return &half_user_op<DType, SUM>;
    case MIN: return &half_user_op<DType, MIN>;
    case MAX: return &half_user_op<DType, MAX>;
    case PRODUCT: return &half_user_op<DType, PRODUCT>;
    default: throw std::invalid_argument("unsupported reduce op " + std::to_string(op));
  }
}

// MPI counts are ints: longer buffers go in slices of this many elements.
constexpr int64_t kMaxCount = INT_MAX / 2;

// The cycle slows down once the global set has made no progress for kQuietBeforeBackoff
// seconds: the pause grows to 1/kBackoffDivisor of the quiet time, at most kLongestPause.
// A peer's late submission then waits at most that long for this rank's next negotiation
// (5% of what it already waited), and a wait that lasts costs next to no CPU: MPICH polls
// inside a collective, so a rank that cycles every millisecond keeps a core busy.
constexpr double kQuietBeforeBackoff = 0.1, kBackoffDivisor = 20, kLongestPause = 0.05;

thread_local std::string t_call_origin;

}  // namespace

Engine::Engine(EngineConfig config, Lane lane, std::unique_ptr<Transport> transport)
    : config_(std::move(config)), lane_(std::move(lane)), transport_(std::move(transport)) {
  cycle_time_s = config_.cycle_time_s;
}

Engine::~Engine() {
  request_shutdown();
  if (thread_.joinable()) thread_.detach();  // never block interpreter exit on MPI
}

// ---- process sets ---------------------------------------------------------------------------
void Engine::add_set(int set_id, TransportHandle comm, int rank, int size, bool flat,
                     bool one_host) {
  auto state = std::make_shared<SetState>();
  state->id = set_id;
  state->rank = rank;
  state->size = size;
  state->comm = comm;
  state->flat = flat;
  transport_->set_one_host(comm, one_host);
  // Only the global set, which every rank negotiates every cycle, decides on a deadlock: a
  // subset whose members all wait may be waiting for a rank outside it that still works.
  state->controller = std::make_unique<Controller>(
      transport_.get(), config_.types, comm, rank, size, config_.cache_capacity, config_.stall_check_s,
      config_.stall_shutdown_s, set_id == 0 ? config_.deadlock_s : 0.0);
  state->counts = state->controller->counts();
  std::lock_guard<std::mutex> lock(mu_);
  sets_[set_id] = std::move(state);
}

bool Engine::set_flat(int set_id, bool flat) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(set_id);
  if (it == sets_.end()) return false;
  it->second->flat = flat;
  return true;
}

bool Engine::remove_set(int set_id, const std::string& why) {
  std::shared_ptr<SetState> state;
  std::vector<std::string> names;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = sets_.find(set_id);
    if (it == sets_.end()) return false;
    state = it->second;
    sets_.erase(it);
    for (const auto& kv : state->entries) names.push_back(kv.first);
  }
  fail_names(*state, names, why);
  return true;
}

int Engine::set_rank(int set_id) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = sets_.find(set_id);
  return it == sets_.end() ? -1 : it->second->rank;
}

// ---- lifecycle ------------------------------------------------------------------------------
void Engine::start() {
  started_ = true;
  thread_ = std::thread([this] { run(); });
}

void Engine::request_shutdown() {
  shutdown_requested_ = true;
  wake_cv_.notify_all();
}

void Engine::join() {
  if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
}

std::string Engine::fatal() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fatal_;
}

void Engine::run() {
  // Named, so that its CPU time can be told apart in /proc/<pid>/task (benchmarks, top -H).
  pthread_setname_np(pthread_self(), "aiak-engine");
  std::string reason = config_.shut_down;
  try {
    std::unique_lock<std::mutex> lock(mu_, std::defer_lock);
    while (true) {
      double started = monotonic_now();
      cycle_started_ = started;
      if (timeline_on) events_.push_back({"", "", started});
      std::string why;
      bool deadlock = false;
      bool stop_now = cycle(&why, &deadlock);
      flush_timeline();
      if (stop_now) {
        // A deadlock's report is the error itself: not a consequence of another failure.
        if (deadlock) reason = why;
        else if (!why.empty()) reason = config_.shut_down + " (" + why + ")";
        break;
      }
      // Collectives match by order, not time: an idle rank may park for several cycles, and
      // a peer with work waits in its next negotiation until this rank's park ends or a
      // thread here waits on a handle (the moment this rank's own requests matter).
      lock.lock();
      double pause = pause_after_cycle();
      backing_off_ = pause > cycle_time_s.load();
      bool idle = !has_local_work_locked();
      // A waiter whose handle this cycle completed needs no early cycle: starting one would
      // negotiate nothing, a round trip every peer must join (over Gloo a Python call and a
      // wake-up of Gloo's threads, competing with the frontend that takes its results).
      if (idle) waiter_blocked_ = false;
      // Park only when no rank has anything in flight: a peer's work (in any process set)
      // needs this rank's next negotiation.  A waiter ends the park; a submission shortens it.
      parked_ = config_.idle_park_s > pause && idle && !pending_anywhere_;
      if (parked_) pause = config_.idle_park_s;
      // A backed-off pause counts from the end of the cycle, not its start: the cycle's
      // negotiation just synchronized the ranks, so they all wake together.  Counted from
      // the start, a rank that once arrived early (and polled in the collective until its
      // peers came) would stay early by as much, and poll as long, every cycle.
      const double until = (backing_off_ ? monotonic_now() : started) + pause;
      while (!shutdown_requested_ && !waiter_blocked_) {
        // Work submitted during a park or back-off gets a normal cycle's window to gather
        // the tensors that follow it (a backward pass submits them one by one), no longer.
        double end = until;
        if (submitted_at_ > 0) end = std::min(end, submitted_at_ + cycle_time_s.load());
        double remaining = end - monotonic_now();
        if (remaining <= 0) break;
        const bool known = submitted_at_ > 0;
        wake_cv_.wait_for(lock, std::chrono::duration<double>(remaining), [&] {
          return shutdown_requested_.load() || waiter_blocked_ || (!known && submitted_at_ > 0);
        });
      }
      waiter_blocked_ = parked_ = backing_off_ = false;
      submitted_at_ = 0;
      lock.unlock();
    }
  } catch (const std::exception& exc) {
    // "The background thread failed: ..."; the lane adds the peers that are gone (a
    // transport error usually means one vanished) and logs it.
    auto* failed = dynamic_cast<const TransportError*>(&exc);
    std::string message = "The background thread failed: " +
                          (failed ? failed->kind : std::string("RuntimeError")) + ": " + exc.what();
    try {
      std::string full = lane_("fatal", 0, &message);
      reason = full.empty() ? message : full;
    } catch (...) {
      reason = message;
    }
    std::lock_guard<std::mutex> guard(mu_);
    fatal_ = reason;
  }
  stop(reason);
}

bool Engine::has_local_work_locked() const {
  for (const auto& kv : sets_)
    if (!kv.second->entries.empty() || !kv.second->queue.empty()) return true;
  return false;
}

void Engine::begin_wait_locked() {
  if (waiters_++ == 0) waiting_since_ = monotonic_now();
}

bool Engine::stuck_locked(double now) const {
  return config_.deadlock_s > 0 && waiters_ > 0 &&
         now - std::max(waiting_since_, last_activity_) >= config_.deadlock_s;
}

double Engine::pause_after_cycle() const {
  // quiet_since_ moves when the global set's negotiation, which every rank takes part in,
  // agrees on progress: so every rank pauses alike, and none waits in a collective, polling,
  // for a peer that pauses longer.
  const double base = cycle_time_s.load();
  const double quiet = monotonic_now() - quiet_since_;
  if (quiet < kQuietBeforeBackoff) return base;
  return std::max(base, std::min(kLongestPause, quiet / kBackoffDivisor));
}

void Engine::set_call_origin(std::string origin) { t_call_origin = std::move(origin); }

const std::string& Engine::call_origin() { return t_call_origin; }

void Engine::wake_for_waiter_locked() const {
  // The cycle's pause (or an idle park) exists to let more tensors join a batch; a caller
  // blocked on a handle submits none, so start the next cycle now.
  waiter_blocked_ = true;
  wake_cv_.notify_one();
}

bool Engine::cycle(std::string* why, bool* deadlock) {
  std::vector<std::shared_ptr<SetState>> sets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& kv : sets_) sets.push_back(kv.second);
  }
  for (const auto& set : sets) {
    std::vector<Request> fresh;
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (!sets_.count(set->id)) continue;  // removed by an earlier set's response
      fresh.swap(set->queue);
    }
    LocalState local;
    if (set->id == 0) {
      local.want_shutdown = shutdown_requested_;
      int sw = cache_switch.exchange(-1);
      if (sw >= 0) set->controller->set_cache_active(sw != 0);
      std::lock_guard<std::mutex> lock(mu_);
      local.stuck = stuck_locked(monotonic_now());
      local.pending = has_local_work_locked();
      // Work of other sets counts as progress, so that their members do not slow down (and
      // every rank of the global set still agrees on it through the negotiation).
      local.moved = moved_elsewhere_;
      for (const auto& kv : sets_) local.moved |= kv.first != 0 && !kv.second->queue.empty();
      moved_elsewhere_ = false;
    }
    auto result = set->controller->negotiate(std::move(fresh), local, monotonic_now());
    if (set->id == 0) ++negotiations_;
    if (!result.stall_report.empty()) {
      std::string msg = lane_("stall", set->id, &result.stall_report);
      if (!msg.empty()) throw std::runtime_error(msg);
    }
    if (result.shutdown) {
      *why = shutdown_requested_ ? "" : result.shutdown_reason;
      *deadlock = result.deadlock && !shutdown_requested_;
      return true;
    }
    if (set->id == 0 && (result.progress || quiet_since_ == 0)) quiet_since_ = monotonic_now();
    if (set->id == 0) pending_anywhere_ = result.pending_anywhere;
    if (set->id != 0 && !result.responses.empty()) moved_elsewhere_ = true;
    {
      // Before anything completes: a waiter that reads counts() then sees this cycle's.
      auto counts = set->controller->counts();
      std::lock_guard<std::mutex> lock(mu_);
      set->counts = counts;
    }
    if (!result.responses.empty()) execute(*set, result.responses);
    auto counts = set->controller->counts();
    std::lock_guard<std::mutex> lock(mu_);
    set->counts = counts;
  }
  return false;
}

void Engine::fail_all(const std::string& reason) {
  std::vector<std::shared_ptr<SetState>> sets;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& kv : sets_) sets.push_back(kv.second);
  }
  for (const auto& set : sets) {
    std::vector<std::string> names;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& kv : set->entries) names.push_back(kv.first);
    }
    fail_names(*set, names, reason);
  }
}

void Engine::stop(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    stopped_ = true;
  }
  fail_all(reason);
  if (fatal().empty()) {
    for (auto& kv : user_ops_) transport_->op_free(kv.second);
  }
  user_ops_.clear();
  done_cv_.notify_all();
}

void Engine::abandon(const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    fatal_ = reason;
  }
  fail_all(reason);
}

// ---- submission and completion ----------------------------------------------------------------
std::vector<int64_t> Engine::enqueue(int set_id, std::vector<Request> requests,
                                     std::vector<Entry> entries) {
  std::vector<int64_t> out;
  out.reserve(entries.size());
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (!fatal_.empty()) throw EngineStopped(fatal_);
    if (stopped_ || shutdown_requested_) throw EngineStopped(config_.shut_down);
    auto it = sets_.find(set_id);
    if (it == sets_.end())
      throw BadRequest("Process set " + std::to_string(set_id) +
                       " is not registered on this rank (it was removed, or this rank is not a "
                       "member).");
    SetState& set = *it->second;
    const std::string& origin = t_call_origin;
    if (!origin.empty())
      for (auto& r : requests) r.origin = origin;
    last_activity_ = monotonic_now();
    // A backed-off or parked cycle would hold this rank's new work for its longer pause.
    if ((backing_off_ || parked_) && submitted_at_ == 0) {
      submitted_at_ = monotonic_now();
      wake_cv_.notify_one();
    }
    for (size_t i = 0; i < entries.size(); ++i) {
      const std::string& name = entries[i].name;
      bool repeated = set.entries.count(name) > 0;
      for (size_t j = 0; j < i && !repeated; ++j) repeated = entries[j].name == name;
      if (repeated) throw BadRequest(config_.duplicate_name + " (tensor name: " + name + ")");
    }
    for (size_t i = 0; i < entries.size(); ++i) {
      int64_t hid = next_handle_++;
      handles_.emplace(hid, Handle{});
      entries[i].handle = hid;
      entries[i].signature = requests[i].signature();
      std::string name = entries[i].name;
      set.entries.emplace(std::move(name), std::move(entries[i]));
      out.push_back(hid);
    }
    for (auto& r : requests) set.queue.push_back(std::move(r));
  }
  return out;
}

void Engine::complete_locked(int64_t handle, const std::string* error, bool has_result,
                             int64_t result, int64_t event) {
  auto it = handles_.find(handle);
  if (it == handles_.end()) return;
  Handle& h = it->second;
  if (error != nullptr) {
    h.failed = true;
    h.error = *error;
  }
  h.has_result = has_result;
  h.result = result;
  h.event = event;
  h.done_at = last_activity_ = monotonic_now();
  h.done = true;
}

void Engine::finish(SetState& set, const ResponsePtr& resp, bool has_result, int64_t result) {
  finish(set, std::vector<ResponsePtr>{resp}, has_result, result);
}

void Engine::finish(SetState& set, const std::vector<ResponsePtr>& responses, bool has_result,
                    int64_t result, int64_t event) {
  // One lock to take the entries out, one to complete them: the submitting thread contends
  // for this lock, so it is taken per batch, not per tensor.
  std::vector<std::pair<int64_t, std::optional<Signature>>> done;  // (handle or -1, signature)
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& resp : responses) {
      for (const auto& name : resp->names) {
        auto it = set.entries.find(name);
        if (it == set.entries.end()) {
          done.emplace_back(-1, std::nullopt);
          continue;
        }
        done.emplace_back(it->second.handle, std::move(it->second.signature));
        set.entries.erase(it);
      }
    }
  }
  // Cache first, then complete: a waiter woken by the completion reads up-to-date counts.
  size_t k = 0;
  for (const auto& resp : responses) {
    for (const auto& name : resp->names) {
      if (timeline_on) events_.push_back({name, "", monotonic_now()});
      set.controller->record_executed(resp, done[k++].second);
    }
  }
  auto counts = set.controller->counts();
  std::lock_guard<std::mutex> lock(mu_);
  set.counts = counts;
  for (const auto& d : done)
    if (d.first >= 0) complete_locked(d.first, nullptr, has_result, result, event);
}

void Engine::finish_name(int set_id, const std::string& name, const std::string& error,
                         int64_t event) {
  std::lock_guard<std::mutex> lock(mu_);
  auto sit = sets_.find(set_id);
  if (sit == sets_.end()) return;
  auto& entries = sit->second->entries;
  auto it = entries.find(name);
  if (it == entries.end()) return;
  complete_locked(it->second.handle, error.empty() ? nullptr : &error, false, 0, event);
  entries.erase(it);
}

void Engine::fail_names(SetState& set, const std::vector<std::string>& names,
                        const std::string& error) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& name : names) {
      auto it = set.entries.find(name);
      if (it == set.entries.end()) continue;
      complete_locked(it->second.handle, &error, false, 0, 0);
      set.entries.erase(it);
    }
  }
  done_cv_.notify_all();
}

WaitResult Engine::wait(int64_t handle, bool forget) {
  std::unique_lock<std::mutex> lock(mu_);
  WaitResult out;
  auto it = handles_.find(handle);
  if (it == handles_.end()) {
    out.unknown = true;
    return out;
  }
  if (!it->second.done) {
    wake_for_waiter_locked();
    begin_wait_locked();
    while (!it->second.done) {
      done_cv_.wait_for(lock, std::chrono::milliseconds(500));
      it = handles_.find(handle);
      // Cleared by another waiter; or the engine stopped, which failed every entry it held
      // (this only guards against a handle that lost its entry some other way).
      if (it == handles_.end() || stopped_) break;
    }
    end_wait_locked();
    if (it == handles_.end()) {
      out.unknown = true;
      return out;
    }
  }
  const Handle& h = it->second;
  out.done = h.done;
  out.failed = h.failed || !h.done;
  out.error = h.done ? h.error : (fatal_.empty() ? config_.shut_down : fatal_);
  out.has_result = h.has_result;
  out.result = h.result;
  out.event = h.event;
  if (forget) handles_.erase(it);
  return out;
}

std::vector<WaitResult> Engine::wait_all(const std::vector<int64_t>& handles) {
  std::vector<WaitResult> out;
  out.reserve(handles.size());
  for (int64_t h : handles) out.push_back(wait(h, true));
  return out;
}

WaitResult Engine::poll(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  WaitResult out;
  auto it = handles_.find(handle);
  if (it == handles_.end()) {
    out.unknown = true;
    return out;
  }
  out.done = it->second.done;
  out.event = it->second.done ? it->second.event : 0;
  if (!out.done && parked_) wake_for_waiter_locked();
  return out;
}

std::vector<int64_t> Engine::wait_any(const std::vector<int64_t>& handles, double timeout_s) {
  std::unique_lock<std::mutex> lock(mu_);
  for (int64_t h : handles)
    if (!handles_.count(h)) throw std::out_of_range(std::to_string(h));
  if (handles.empty()) return {};
  double deadline = timeout_s >= 0 ? monotonic_now() + timeout_s : -1;
  bool counted = false;  // as a waiter, for the deadlock check
  while (true) {
    std::vector<int64_t> done;
    for (int64_t h : handles) {
      auto it = handles_.find(h);
      if (it != handles_.end() && it->second.done) done.push_back(h);
    }
    double wait_s = 0.5;
    if (deadline >= 0) wait_s = std::min(wait_s, deadline - monotonic_now());
    if (!done.empty() || stopped_ || wait_s <= 0) {
      if (counted) end_wait_locked();
      if (!done.empty()) return done;
      if (stopped_) throw EngineStopped(fatal_.empty() ? config_.shut_down : fatal_);
      return {};
    }
    if (parked_) wake_for_waiter_locked();
    if (!counted) begin_wait_locked();
    counted = true;
    done_cv_.wait_for(lock, std::chrono::duration<double>(wait_s));
  }
}

std::optional<double> Engine::completion_time(int64_t handle) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = handles_.find(handle);
  if (it == handles_.end() || !it->second.done) return std::nullopt;
  return it->second.done_at;
}

std::map<std::string, int64_t> Engine::counts() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::map<std::string, int64_t> out{{"open_handles", static_cast<int64_t>(handles_.size())},
                                     {"process_sets", static_cast<int64_t>(sets_.size())},
                                     {"entries", 0}, {"queued_requests", 0},
                                     {"cache_entries", 0}, {"cached_pending", 0},
                                     {"uncached_pending", 0}, {"submitted_pending", 0},
                                     {"coordinator_table", 0}};
  for (const auto& kv : sets_) {
    out["entries"] += static_cast<int64_t>(kv.second->entries.size());
    out["queued_requests"] += static_cast<int64_t>(kv.second->queue.size());
    const TableCounts& c = kv.second->counts;
    out["cache_entries"] += c.cache_entries;
    out["cached_pending"] += c.cached_pending;
    out["uncached_pending"] += c.uncached_pending;
    out["submitted_pending"] += c.submitted_pending;
    out["coordinator_table"] += c.coordinator_table;
  }
  out["fusion_buffer_bytes"] = static_cast<int64_t>(fusion_.size());
  return out;
}

std::map<std::string, int64_t> Engine::progress_counters() const {
  return {{"negotiations", negotiations_.load()},
          {"ring_allreduces", transport_->ring_allreduces.load()}};
}

std::vector<std::tuple<int, std::string, int64_t>> Engine::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<std::tuple<int, std::string, int64_t>> out;
  for (const auto& kv : sets_)
    for (const auto& e : kv.second->entries) out.emplace_back(kv.first, e.first, e.second.nbytes);
  std::sort(out.begin(), out.end());
  return out;
}

int64_t Engine::handle_of(int set_id, const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto sit = sets_.find(set_id);
  if (sit == sets_.end()) return -1;
  auto it = sit->second->entries.find(name);
  return it == sit->second->entries.end() ? -1 : it->second.handle;
}

// ---- execution --------------------------------------------------------------------------------
bool Engine::is_lane(const SetState& set, const Response& resp) const {
  switch (resp.op_type) {
    // Adasum runs in Python (aiak_training/allreduce/adasum.py), whatever the set's algorithm.
    // CUDA tensors are fused here and handed to the lane as one GpuAllreduce.
    case ALLREDUCE: return !resp.gpu && (!set.flat || resp.reduce_op == aiak::ADASUM);
    case BROADCAST: return resp.gpu;
    case BARRIER: case JOIN: return false;
    case ERROR: {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = set.entries.find(resp.names[0]);
      return it != set.entries.end() && it->second.lane;
    }
    default: return true;  // allgather, alltoall, reducescatter, process-set changes
  }
}

void Engine::execute(SetState& set, const std::vector<ResponsePtr>& responses) {
  size_t i = 0;
  while (i < responses.size()) {
    const ResponsePtr& resp = responses[i];
    if (is_lane(set, *resp)) {
      std::vector<ResponsePtr> batch;
      while (i < responses.size() && is_lane(set, *responses[i])) batch.push_back(responses[i++]);
      run_lane(set, batch);
      continue;
    }
    switch (resp->op_type) {
      case ERROR: fail_names(set, resp->names, resp->error); ++i; continue;
      case BARRIER: finish(set, resp); break;
      case JOIN:
        set.controller->mark_unjoined();
        finish(set, resp, true, resp->last_joined);
        break;
      case BROADCAST:
        activity(resp->names, nullptr);
        activity(resp->names, "BROADCAST");
        broadcast(set, resp);
        finish(set, resp);
        break;
      case ALLREDUCE: {
        std::vector<ResponsePtr> group{resp};
        int item = itemsize(resp->dtype);
        int64_t total = resp->nbytes(item);
        size_t j = i + 1;
        const int64_t threshold = fusion_threshold.load();
        while (j < responses.size() && responses[j]->fuses_with(*resp) &&
               !is_lane(set, *responses[j]) && total + responses[j]->nbytes(item) <= threshold) {
          total += responses[j]->nbytes(item);
          group.push_back(responses[j++]);
        }
        for (const auto& r : group) {
          activity(r->names, nullptr);
          activity(r->names, "ALLREDUCE");
        }
        if (resp->gpu) gpu_allreduce_group(set, group);
        else allreduce_group(set, group);
        done_cv_.notify_all();
        i = j;
        continue;
      }
      default: throw std::logic_error("engine: unexpected op " + std::to_string(resp->op_type));
    }
    ++i;
    // Wake waiters as each bucket lands: the caller can use it while the rest still run.
    done_cv_.notify_all();
  }
  zeros_keep_.clear();
}

void Engine::run_lane(SetState& set, const std::vector<ResponsePtr>& batch) {
  // The signatures the lane's tensors were submitted with, for the cache (the lane removes
  // the entries as it completes them).
  std::vector<std::vector<std::optional<Signature>>> sigs;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (const auto& resp : batch) {
      sigs.emplace_back();
      for (const auto& name : resp->names) {
        auto it = set.entries.find(name);
        if (it == set.entries.end()) sigs.back().emplace_back();
        else sigs.back().emplace_back(it->second.signature);
      }
    }
  }
  flush_timeline();  // keep the timeline in order around the lane's own events
  std::string failure = lane_("execute", set.id, &batch);
  done_cv_.notify_all();
  if (!failure.empty()) throw std::runtime_error(failure);
  for (size_t k = 0; k < batch.size(); ++k) {
    if (batch[k]->op_type == ERROR) continue;
    for (const auto& sig : sigs[k]) set.controller->record_executed(batch[k], sig);
  }
  auto counts = set.controller->counts();
  std::lock_guard<std::mutex> lock(mu_);
  set.counts = counts;
}

std::vector<Entry> Engine::entries_or_zeros(SetState& set, const std::vector<ResponsePtr>& group) {
  std::vector<Entry> out(group.size());
  std::vector<size_t> missing;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < group.size(); ++i) {
      auto it = set.entries.find(group[i]->names[0]);
      if (it == set.entries.end()) {
        missing.push_back(i);
        continue;
      }
      const Entry& e = it->second;
      out[i].dtype = e.dtype;
      out[i].count = e.count;
      out[i].nbytes = e.nbytes;
      out[i].in = e.in;
      out[i].out = e.out;
    }
  }
  for (size_t i : missing) {
    // This rank joined (hvd.join): it takes part with zeros of the agreed shape.
    const Response& resp = *group[i];
    Entry& zeros = out[i];
    zeros.dtype = resp.dtype;
    zeros.count = 1;
    for (int64_t d : resp.shapes.at(0).at(set.rank)) zeros.count *= d;
    zeros.nbytes = zeros.count * itemsize(resp.dtype);
    zeros_keep_.emplace_back(std::max<int64_t>(zeros.nbytes, 1), 0);
    zeros.in = zeros.out = reinterpret_cast<uintptr_t>(zeros_keep_.back().data());
  }
  return out;
}

TransportHandle Engine::op_handle(int32_t dtype, int32_t op) {
  if (dtype == BOOL) {
    if (op == SUM || op == MAX) return config_.lor;
    if (op == MIN || op == PRODUCT) return config_.land;
    throw std::invalid_argument("Reduce op " + std::to_string(op) + " is not supported for bool tensors.");
  }
  if ((dtype == FLOAT16 || dtype == BFLOAT16) && !transport_->reduces_halves()) {
    int key_op = op == AVERAGE ? SUM : op;
    auto key = std::make_pair(static_cast<int>(dtype), key_op);
    auto it = user_ops_.find(key);
    if (it != user_ops_.end()) return it->second;
    UserFunction fn = dtype == FLOAT16 ? half_op_for<FLOAT16>(key_op) : half_op_for<BFLOAT16>(key_op);
    TransportHandle handle = transport_->op_create(fn, true);
    user_ops_[key] = handle;
    return handle;
  }
  switch (op) {
    case AVERAGE: case SUM: return config_.sum;
    case MIN: return config_.min;
    case MAX: return config_.max;
    case PRODUCT: return config_.prod;
    default: throw std::invalid_argument("unsupported reduce op " + std::to_string(op));
  }
}

void Engine::reduce_host(SetState& set, uintptr_t addr, int64_t count, int32_t dtype, int32_t op) {
  TransportHandle mop = op_handle(dtype, op);
  int item = itemsize(dtype);
  for (int64_t off = 0; off < count; off += kMaxCount) {
    int n = static_cast<int>(std::min(kMaxCount, count - off));
    transport_->reduce_in_place(reinterpret_cast<void*>(addr + off * item), n,
                                config_.dtypes[dtype], mop, set.comm);
  }
}

static void scale_in_place(uintptr_t addr, int64_t n, int32_t dtype, double factor) {
  if (n > 0 && factor != 1.0) {
    if (!scalable(dtype)) throw std::invalid_argument("scale: unsupported dtype " + std::to_string(dtype));
    scale_into(addr, addr, n, dtype, factor);
  }
}

void Engine::allreduce_group(SetState& set, const std::vector<ResponsePtr>& group) {
  const Response& first = *group[0];
  const int32_t dtype = first.dtype, op = first.reduce_op;
  const double pre = first.prescale;
  const double post = op == AVERAGE ? first.postscale / set.size : first.postscale;
  const int64_t zero_copy = zero_copy_bytes.load();
  const int item = itemsize(dtype);
  std::vector<std::pair<ResponsePtr, Entry>> packed, in_place;
  auto entries = entries_or_zeros(set, group);
  for (size_t i = 0; i < group.size(); ++i)
    (entries[i].nbytes < zero_copy ? packed : in_place).emplace_back(group[i], std::move(entries[i]));
  if (packed.size() == 1) {  // a lone small tensor gains nothing from the fusion buffer
    in_place.push_back(std::move(packed[0]));
    packed.clear();
  }
  for (auto& [resp, e] : in_place) {
    if (e.in != e.out && e.count)
      std::memcpy(reinterpret_cast<void*>(e.out), reinterpret_cast<const void*>(e.in), e.nbytes);
    scale_in_place(e.out, e.count, dtype, pre);
    activity(resp->names, "MPI_ALLREDUCE");
    reduce_host(set, e.out, e.count, dtype, op);
    activity(resp->names, nullptr);
    scale_in_place(e.out, e.count, dtype, post);
    // Each large tensor completes as it lands: an overlapped optimizer can update it while
    // the rest are still on the wire.
    finish(set, resp);
    done_cv_.notify_all();
  }
  if (packed.empty()) return;
  int64_t total = 0;
  std::vector<std::string> names;
  for (const auto& [resp, e] : packed) {
    total += e.nbytes;
    names.push_back(resp->names[0]);
  }
  if (static_cast<int64_t>(fusion_.size()) < total)
    fusion_.resize(std::max<int64_t>(total, 2 * static_cast<int64_t>(fusion_.size())));
  char* base = fusion_.data();
  activity(names, "MEMCPY_IN_FUSION_BUFFER");
  int64_t off = 0;
  for (const auto& [resp, e] : packed) {
    if (e.nbytes) std::memcpy(base + off, reinterpret_cast<const void*>(e.in), e.nbytes);
    off += e.nbytes;
  }
  activity(names, nullptr);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(base);
  scale_in_place(addr, total / item, dtype, pre);
  activity(names, "MPI_ALLREDUCE");
  reduce_host(set, addr, total / item, dtype, op);
  activity(names, nullptr);
  activity(names, "MEMCPY_OUT_FUSION_BUFFER");
  off = 0;
  for (const auto& [resp, e] : packed) {
    if (e.count) {
      if (post != 1.0) scale_into(addr + off, e.out, e.count, dtype, post);
      else std::memcpy(reinterpret_cast<void*>(e.out), base + off, e.nbytes);
    }
    off += e.nbytes;
  }
  activity(names, nullptr);
  std::vector<ResponsePtr> landed;
  for (const auto& p : packed) landed.push_back(p.first);
  finish(set, landed);
}

void Engine::gpu_allreduce_group(SetState& set, const std::vector<ResponsePtr>& group) {
  const Response& first = *group[0];
  GpuAllreduce call;
  call.dtype = first.dtype;
  call.reduce_op = first.reduce_op;
  call.prescale = first.prescale;
  call.postscale = first.postscale;
  const size_t n = group.size();
  call.names.reserve(n);
  call.ins.assign(n, 0);
  call.outs.assign(n, 0);
  call.counts.assign(n, 0);
  call.ready_events.assign(n, 0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (size_t i = 0; i < n; ++i) {
      const Response& resp = *group[i];
      call.names.push_back(resp.names[0]);
      auto it = set.entries.find(resp.names[0]);
      if (it == set.entries.end()) {  // this rank joined: zeros of the agreed shape
        int64_t count = 1;
        for (int64_t d : resp.shapes.at(0).at(set.rank)) count *= d;
        call.counts[i] = count;
        call.missing.push_back(static_cast<int64_t>(i));
        continue;
      }
      const Entry& e = it->second;
      if (call.device < 0) call.device = e.device;
      call.ins[i] = e.in;
      call.outs[i] = e.out;
      call.counts[i] = e.count;
      call.ready_events[i] = e.ready_event;
    }
  }
  flush_timeline();  // keep the timeline in order around the lane's own events
  std::string failure = lane_("gpu_allreduce", set.id, &call);
  if (!failure.empty()) throw std::runtime_error(failure);
  finish(set, group, false, 0, call.event);
}

void Engine::broadcast(SetState& set, const ResponsePtr& resp_ptr) {
  const Response& resp = *resp_ptr;
  Entry e = entries_or_zeros(set, {resp_ptr})[0];
  if (set.rank == resp.root && e.in != e.out && e.count)
    std::memcpy(reinterpret_cast<void*>(e.out), reinterpret_cast<const void*>(e.in), e.nbytes);
  activity(resp.names, "MPI_BCAST");
  const int item = itemsize(resp.dtype);
  for (int64_t off = 0; off < e.count; off += kMaxCount) {
    int n = static_cast<int>(std::min(kMaxCount, e.count - off));
    transport_->bcast(reinterpret_cast<void*>(e.out + off * item), n, config_.dtypes[resp.dtype],
                resp.root, set.comm);
  }
  activity(resp.names, nullptr);
}

// ---- timeline -----------------------------------------------------------------------------------
void Engine::activity(const std::vector<std::string>& names, const char* what) {
  if (!timeline_on) return;
  double now = monotonic_now();
  for (const auto& name : names) events_.push_back({name, what ? what : "", now});
}

void Engine::flush_timeline() {
  if (events_.empty()) return;
  std::vector<TimelineEvent> batch;
  batch.swap(events_);
  std::string failure = lane_("timeline", 0, &batch);
  if (!failure.empty()) throw std::runtime_error(failure);
}

}  // namespace engine
}  // namespace aiak
