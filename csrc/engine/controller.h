// Negotiation of one process set: which submitted tensors are ready on every rank, in one
// order that every rank agrees on.
//
// Each cycle every rank takes part in one bitwise-AND allreduce of a vector of words:
// [~flags][~invalid cache bits][cache hits][~size of its coordinator piece].  The AND gives
// the OR of the flags (shutdown, uncached requests, a join, a stall report) and of the
// invalid bits, and the AND of the hits.  A tensor whose response is in the response cache
// (a bounded LRU of responses, one bit each, kept identical on every rank because every rank
// inserts and evicts in the order the responses run) is ready once its bit is set everywhere;
// nothing else crosses the wire for it.  New tensors, and cached ones whose request changed on
// some rank, go through a coordinator round: rank 0 gathers every rank's uncached requests,
// matches them by name, checks that shapes, dtypes, ops and devices agree (else the error
// response that names the tensor) and broadcasts the ordered responses.
#pragma once

#include <cstdint>
#include <list>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/messages.h"
#include "engine/transport.h"

namespace aiak {
namespace engine {

// Handles of the transport objects negotiation needs (element types and the BAND op).
struct NegotiationTypes {
  TransportHandle uint64 = 0, int32 = 0, int64 = 0, byte = 0, band = 0;
};

class ResponseCache {
 public:
  enum class Lookup { kHit, kMiss, kInvalid };
  explicit ResponseCache(int capacity);
  bool enabled() const { return capacity_ > 0 && active_; }
  // Autotune's on/off knob (the capacity, hence the bit vector's size, stays); off empties
  // the cache so that every rank starts again from the same empty one.
  void set_active(bool on);
  size_t size() const { return bit_of_.size(); }
  Lookup lookup(const Request& req, int* bit) const;
  const ResponsePtr& response(int bit) const { return slots_[bit]->response; }
  void touch(int bit);
  // Inserts a single-tensor response; returns the bit evicted to make room, or -1.
  int put(const ResponsePtr& resp, const std::optional<Signature>& sig);
  void evict(int bit);

 private:
  struct Slot {
    ResponsePtr response;
    std::optional<Signature> signature;
  };
  int capacity_;
  bool active_ = true;
  std::vector<std::optional<Slot>> slots_;
  std::unordered_map<std::string, int> bit_of_;
  std::list<int> lru_;  // least recently used first
  std::unordered_map<int, std::list<int>::iterator> lru_pos_;
};

// Sizes of one set's negotiation tables (leak checks in long runs).
struct TableCounts {
  int64_t cache_entries = 0, cached_pending = 0, uncached_pending = 0, submitted_pending = 0,
          coordinator_table = 0;
};

// What this rank tells its peers in a negotiation besides its requests.
struct LocalState {
  bool want_shutdown = false;
  // A thread of this rank waits on a handle, and this rank has submitted and completed
  // nothing for the deadlock time: it can only go on if a peer does.
  bool stuck = false;
  bool pending = false;  // this rank has tensors in flight (in any process set)
  // Another process set of this rank moved since the last cycle (new requests or
  // responses): progress, though not the global set's own.
  bool moved = false;
};

struct NegotiationResult {
  std::vector<ResponsePtr> responses;
  bool shutdown = false;
  bool deadlock = false;  // the shutdown is a certain deadlock; shutdown_reason names it
  std::string shutdown_reason;
  std::string stall_report;  // coordinator only: "rank: [names]" lines, when ranks stall
  // Agreed by every rank: something was submitted or completed, or nothing is in flight
  // anywhere.  The engine slows its cycle down while this stays false (engine.cpp).
  bool progress = false;
  // Agreed by every rank: some rank has a collective in flight (or one just ran).
  bool pending_anywhere = false;
};

// A rank's pending tensors in a stall or deadlock report: (name, library helper or "").
using PendingNames = std::vector<std::pair<std::string, std::string>>;

class Controller {
 public:
  // deadlock_s > 0: when every rank is stuck (LocalState) and some tensor is in flight,
  // the negotiation ends the job with a report of what each rank waits for.
  Controller(Transport* transport, NegotiationTypes types, TransportHandle comm, int rank, int size, int cache_capacity,
             double stall_check_s, double stall_shutdown_s, double deadlock_s = 0.0);

  NegotiationResult negotiate(std::vector<Request> new_requests, const LocalState& local,
                              double now);
  // Response cache on/off from the next negotiation on (autotune, at a step boundary).
  void set_cache_active(bool on);
  void record_executed(const ResponsePtr& resp, const std::optional<Signature>& sig);
  void mark_unjoined() { joined_ = false; }
  TableCounts counts() const;

 private:
  std::vector<uint64_t> bit_vector(uint64_t flags, const std::vector<int>& invalid_bits,
                                   uint64_t piece_bytes) const;
  Writer uncached_piece(bool with_report) const;
  double oldest_age(double now) const;
  bool stall_due(double now);
  // With `deadlock`, the coordinator's deadlock report travels with the responses and
  // lands there on every rank.
  std::vector<ResponsePtr> coordinate(bool with_report, std::string* stall_report,
                                      std::string* deadlock, const Writer* sized, int64_t width);
  std::vector<ResponsePtr> plan(const std::vector<std::vector<Request>>& requests,
                                const std::vector<std::optional<PendingNames>>& reports,
                                std::string* stall_report);
  std::string report_stall(const std::vector<std::optional<PendingNames>>& reports) const;
  Response construct(const std::string& name, const std::map<int, Request>& reqs) const;

  Transport* transport_;
  NegotiationTypes types_;
  TransportHandle comm_;
  int rank_, size_, words_;
  ResponseCache cache_;
  double stall_check_s_, stall_shutdown_s_, deadlock_s_;
  std::map<int, Request> cached_pending_;        // bit -> request waiting on other ranks
  std::vector<Request> to_send_;                 // requests for the coordinator
  std::map<std::string, double> submitted_at_;   // name -> when this rank submitted it
  std::map<std::string, std::string> origin_of_; // name -> library helper that submitted it
  double last_stall_report_;
  bool joined_ = false;
  // Coordinator state (rank 0 of the set): pending requests by name, in arrival order.
  std::list<std::pair<std::string, std::map<int, Request>>> table_;
  std::unordered_map<std::string, decltype(table_)::iterator> table_pos_;
  std::set<int> joined_ranks_;
  int last_joined_ = -1;
};

// The error that ends a certain deadlock: what each rank waits for (reports[r], empty for
// a rank with nothing pending in this set) and the likely cause; `seconds` without progress.
std::string deadlock_message(const std::vector<std::optional<PendingNames>>& reports,
                             double seconds);
// For each library helper among the reports' names, `before` and one sentence saying that
// it is a collective, what it submitted and on which ranks ("" when none has a helper).
std::string origins_note(const std::vector<std::optional<PendingNames>>& reports,
                         const std::string& before);

// Python's repr() of a float ("1.0", "0.5", "1e-05"), the form the API's messages print.
std::string python_float_repr(double x);

}  // namespace engine
}  // namespace aiak
