// Negotiation of one process set (see controller.h; the Python twin explains the protocol).
#include "engine/controller.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <limits>

namespace aiak {
namespace engine {
namespace {

constexpr uint64_t kShutdown = 1, kUncached = 2, kJoined = 4, kStall = 8;
// kBusy: this rank is not stuck (LocalState); kPending: it has tensors in flight; kFresh:
// it submitted something this cycle, or another set of its moved.  OR-ed over ranks, so "no kBusy" means all are stuck.
constexpr uint64_t kBusy = 16, kPending = 32, kFresh = 64;
// The coordinator's first broadcast: the length of its responses and as many of their bytes
// as fit, so that a usual round (a few control ops or new tensors) needs one broadcast.
constexpr int64_t kInlineBytes = 4096;

bool cacheable(int32_t op) { return op >= ALLREDUCE && op <= REDUCESCATTER; }

const char* op_word(int32_t op) {
  static const char* words[] = {"allreduce", "allgather", "broadcast", "alltoall",
                                "reducescatter", "barrier", "join", "add_process_set",
                                "remove_process_set", "error"};
  return op >= 0 && op <= ERROR ? words[op] : "unknown";
}

const char* dtype_name(int32_t dtype) {
  static const char* names[] = {"uint8", "int8", "uint16", "int16", "int32", "int64",
                                "float16", "float32", "float64", "bool", "bfloat16"};
  return dtype >= 0 && dtype <= 10 ? names[dtype] : "unknown";
}

const char* reduce_op_name(int32_t op) {
  static const char* names[] = {"AVERAGE", "SUM", "ADASUM", "MIN", "MAX", "PRODUCT"};
  return op >= 0 && op <= 5 ? names[op] : "UNKNOWN";
}

std::string shape_str(const Shape& s) {
  std::string out = "[";
  for (size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

std::string join_ints(const std::vector<int>& v) {
  std::string out;
  for (size_t i = 0; i < v.size(); ++i) out += (i ? ", " : "") + std::to_string(v[i]);
  return out;
}

bool same_shape_op(int32_t op) { return op == ALLREDUCE || op == BROADCAST || op == REDUCESCATTER; }
bool no_join_op(int32_t op) { return op == ALLGATHER || op == BROADCAST || op == ALLTOALL; }

std::vector<int> set_bits(const uint64_t* words, int n) {
  std::vector<int> out;
  for (int w = 0; w < n; ++w) {
    uint64_t word = words[w];
    while (word) {
      int low = __builtin_ctzll(word);
      out.push_back(w * 64 + low);
      word &= word - 1;
    }
  }
  return out;
}

// "rank 2", "ranks 0, 3", "ranks 1-7".
std::string ranks_text(const std::vector<int>& ranks) {
  if (ranks.size() == 1) return "rank " + std::to_string(ranks[0]);
  bool consecutive = ranks.back() - ranks.front() + 1 == static_cast<int>(ranks.size());
  if (consecutive && ranks.size() > 2)
    return "ranks " + std::to_string(ranks.front()) + "-" + std::to_string(ranks.back());
  return "ranks " + join_ints(ranks);
}

// Up to three names of a rank's pending tensors, each with its helper, then "and N more".
std::string names_text(const PendingNames& names) {
  constexpr size_t kShown = 3;
  std::string out;
  for (size_t i = 0; i < names.size() && i < kShown; ++i) {
    out += (i ? ", " : "") + names[i].first;
    if (!names[i].second.empty()) out += " (from " + names[i].second + ")";
  }
  if (names.size() > kShown) out += " and " + std::to_string(names.size() - kShown) + " more";
  return out;
}

}  // namespace

std::string origins_note(const std::vector<std::optional<PendingNames>>& reports,
                         const std::string& before) {
  // helper -> (tensor names, ranks that submitted them through it)
  std::map<std::string, std::pair<std::set<std::string>, std::set<int>>> by_origin;
  for (size_t r = 0; r < reports.size(); ++r) {
    if (!reports[r]) continue;
    for (const auto& item : *reports[r]) {
      if (item.second.empty()) continue;
      auto& entry = by_origin[item.second];
      entry.first.insert(item.first);
      entry.second.insert(static_cast<int>(r));
    }
  }
  std::string out;
  for (const auto& kv : by_origin) {
    std::string names;
    for (const auto& n : kv.second.first) names += (names.empty() ? "" : ", ") + n;
    out += before + kv.first + "() is a collective that every rank must call; it submitted " +
           names + " on " +
           ranks_text(std::vector<int>(kv.second.second.begin(), kv.second.second.end())) +
           " only.";
  }
  return out;
}

std::string deadlock_message(const std::vector<std::optional<PendingNames>>& reports,
                             double seconds) {
  // Ranks waiting for the same names are listed together, in rank order of their first.
  std::vector<std::pair<std::string, std::vector<int>>> groups;
  for (size_t r = 0; r < reports.size(); ++r) {
    std::string what = reports[r] && !reports[r]->empty()
                           ? names_text(*reports[r])
                           : std::string("nothing of the global process set");
    auto it = std::find_if(groups.begin(), groups.end(),
                           [&](const auto& g) { return g.first == what; });
    if (it == groups.end()) groups.push_back({what, {static_cast<int>(r)}});
    else it->second.push_back(static_cast<int>(r));
  }
  std::string waits;
  for (size_t i = 0; i < groups.size(); ++i)
    waits += (i ? ", " : "") + ranks_text(groups[i].second) + (i ? " in " : " waits in ") +
             groups[i].first;
  char secs[32];
  std::snprintf(secs, sizeof secs, "%g", seconds);
  return "deadlock: " + waits + "; no rank can go on, as each waits for a collective that " +
         "the others did not submit (no rank submitted or completed one for " + secs +
         " s).\nLikely cause: a collective called on some ranks only (for example inside "
         "`if hvd.rank() == 0:`)." + origins_note(reports, " ") +
         "\nHorovod would wait here forever; to keep that behaviour, set "
         "HOROVOD_STALL_SHUTDOWN_TIME_SECONDS (0: wait forever) or HOROVOD_STALL_CHECK_DISABLE=1.";
}

std::string python_float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  // Shortest digit string that reads back as x (what repr() prints), laid out as Python
  // does: positional for exponents in [-4, 16), scientific otherwise.
  char buf[64];
  int precision = 1;
  for (; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s(buf);
  bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  auto e = s.find('e');
  int exponent = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (size_t i = 0; i < e; ++i)
    if (s[i] != '.') digits += s[i];
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  std::string out;
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out = "0." + std::string(-exponent - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exponent + 1) {
      out = digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
    } else {
      out = digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
    }
  } else {
    out = digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char exp[16];
    std::snprintf(exp, sizeof exp, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += exp;
  }
  return negative ? "-" + out : out;
}

// ---- response cache -----------------------------------------------------------------------
ResponseCache::ResponseCache(int capacity) : capacity_(capacity), slots_(std::max(capacity, 0)) {}

ResponseCache::Lookup ResponseCache::lookup(const Request& req, int* bit) const {
  auto it = bit_of_.find(req.name);
  if (it == bit_of_.end()) return Lookup::kMiss;
  *bit = it->second;
  const auto& sig = slots_[it->second]->signature;
  if (!sig || *sig != req.signature()) return Lookup::kInvalid;
  return Lookup::kHit;
}

void ResponseCache::touch(int bit) {
  auto it = lru_pos_.find(bit);
  if (it != lru_pos_.end()) lru_.splice(lru_.end(), lru_, it->second);
}

int ResponseCache::put(const ResponsePtr& resp, const std::optional<Signature>& sig) {
  if (!enabled() || !cacheable(resp->op_type) || resp->names.size() != 1) return -1;
  const std::string& name = resp->names[0];
  int evicted = -1;
  auto found = bit_of_.find(name);
  int bit;
  if (found != bit_of_.end()) {
    bit = found->second;
    if (slots_[bit]->response == resp) return -1;  // a cache hit that just ran
  } else {
    if (static_cast<int>(bit_of_.size()) >= capacity_) {
      evicted = lru_.front();
      evict(evicted);
    }
    // The lowest free bit: every rank inserts in the same order, so it is the same everywhere.
    bit = static_cast<int>(std::find_if(slots_.begin(), slots_.end(),
                                        [](const auto& s) { return !s.has_value(); }) -
                           slots_.begin());
    bit_of_[name] = bit;
  }
  slots_[bit] = Slot{resp, sig};
  auto pos = lru_pos_.find(bit);
  if (pos != lru_pos_.end()) lru_.erase(pos->second);
  lru_pos_[bit] = lru_.insert(lru_.end(), bit);
  return evicted;
}

void ResponseCache::evict(int bit) {
  if (bit < 0 || bit >= capacity_ || !slots_[bit]) return;
  bit_of_.erase(slots_[bit]->response->names[0]);
  slots_[bit].reset();
  auto pos = lru_pos_.find(bit);
  if (pos != lru_pos_.end()) {
    lru_.erase(pos->second);
    lru_pos_.erase(pos);
  }
}

void ResponseCache::set_active(bool on) {
  if (!on) {
    for (int bit = 0; bit < capacity_; ++bit) evict(bit);
  }
  active_ = on;
}

// ---- controller ---------------------------------------------------------------------------
Controller::Controller(Transport* transport, NegotiationTypes types, TransportHandle comm, int rank, int size,
                       int cache_capacity, double stall_check_s, double stall_shutdown_s,
                       double deadlock_s)
    : transport_(transport), types_(types), comm_(comm), rank_(rank), size_(size),
      words_(std::max(1, (cache_capacity + 63) / 64)), cache_(cache_capacity),
      stall_check_s_(stall_check_s), stall_shutdown_s_(stall_shutdown_s), deadlock_s_(deadlock_s),
      last_stall_report_(0.0) {}

void Controller::set_cache_active(bool on) {
  if (!on) {
    // Nothing of the set is pending at a step boundary; a leftover hit would point at an
    // emptied slot, so it is negotiated instead.
    for (auto& kv : cached_pending_) to_send_.push_back(std::move(kv.second));
    cached_pending_.clear();
  }
  cache_.set_active(on);
}

NegotiationResult Controller::negotiate(std::vector<Request> new_requests, const LocalState& local,
                                        double now) {
  if (last_stall_report_ == 0.0) last_stall_report_ = now;
  std::vector<int> invalid_bits;
  const bool fresh = !new_requests.empty();
  for (auto& req : new_requests) {
    submitted_at_[req.name] = now;
    if (!req.origin.empty()) origin_of_[req.name] = req.origin;
    if (req.op_type == JOIN) joined_ = true;
    if (is_control(req.op_type) || !cache_.enabled()) {
      to_send_.push_back(std::move(req));
      continue;
    }
    int bit = -1;
    auto state = cache_.lookup(req, &bit);
    if (state == ResponseCache::Lookup::kHit) {
      cached_pending_[bit] = std::move(req);
    } else {
      if (state == ResponseCache::Lookup::kInvalid) invalid_bits.push_back(bit);
      to_send_.push_back(std::move(req));
    }
  }

  NegotiationResult result;
  uint64_t flags = 0;
  if (local.want_shutdown) flags |= kShutdown;
  if (fresh || local.moved) flags |= kFresh;
  if (!local.stuck) flags |= kBusy;
  if (local.pending) flags |= kPending;
  if (!to_send_.empty()) flags |= kUncached;
  if (joined_) flags |= kJoined;
  if (stall_due(now)) {
    flags |= kStall;
    if (stall_shutdown_s_ > 0 && oldest_age(now) > stall_shutdown_s_) {
      flags |= kShutdown;
      result.shutdown_reason = "stalled tensors exceeded HOROVOD_STALL_SHUTDOWN_TIME_SECONDS";
    }
  }

  // This rank's part of a coordination round, sized now: the size rides in the bit vector.
  Writer piece = uncached_piece(false);
  auto vec = bit_vector(flags, invalid_bits, piece.bytes.size());
  transport_->allreduce(transport_->in_place, vec.data(), static_cast<int>(vec.size()), types_.uint64,
                  types_.band, comm_);
  uint64_t g_flags = ~vec[0];
  if (g_flags & kShutdown) {
    result.shutdown = true;
    if (result.shutdown_reason.empty()) result.shutdown_reason = "another rank shut down";
    return result;
  }
  // One stall report per interval, whichever rank's clock asked for it first.
  if (g_flags & kStall) last_stall_report_ = now;
  // Every rank waits, none has submitted or completed anything for deadlock_s_, and
  // something is in flight: no rank can make the move the others wait for.
  const bool deadlock = deadlock_s_ > 0 && !(g_flags & kBusy) && (g_flags & kPending);

  std::vector<uint64_t> invalid(words_);
  bool any_invalid = false;
  for (int w = 0; w < words_; ++w) {
    invalid[w] = ~vec[1 + w];
    any_invalid |= invalid[w] != 0;
  }
  for (int bit : set_bits(invalid.data(), words_)) {
    // Renegotiate a tensor whose cached response no longer matches on some rank.
    auto it = cached_pending_.find(bit);
    if (it != cached_pending_.end()) {
      to_send_.push_back(std::move(it->second));
      cached_pending_.erase(it);
    }
    cache_.evict(bit);
  }
  if (g_flags & kJoined) {
    // A joined rank contributes zeros: that needs full negotiation, not the cache.
    for (auto& kv : cached_pending_) to_send_.push_back(std::move(kv.second));
    cached_pending_.clear();
  }
  for (int bit : set_bits(vec.data() + 1 + words_, words_)) {
    auto it = cached_pending_.find(bit);
    if (it == cached_pending_.end()) continue;
    cached_pending_.erase(it);
    cache_.touch(bit);
    result.responses.push_back(cache_.response(bit));
  }
  std::string deadlock_report;
  if ((g_flags & (kUncached | kJoined | kStall)) || deadlock) {
    // Every rank's piece is still the one it sized unless requests moved to to_send_ since
    // (an invalid bit, a join) or a report is due: all ranks know which from `vec`.
    const bool report = (g_flags & kStall) || deadlock;
    bool sized = !(g_flags & kJoined) && !report && !any_invalid;
    int64_t width = sized ? static_cast<int64_t>(~vec.back()) : 0;
    if (width <= 0 || width > std::numeric_limits<int>::max() / size_) sized = false;
    auto planned = coordinate(report, &result.stall_report, deadlock ? &deadlock_report : nullptr,
                              sized ? &piece : nullptr, width);
    result.responses.insert(result.responses.end(), planned.begin(), planned.end());
  }
  if (deadlock && result.responses.empty()) {
    result.stall_report.clear();  // the error says it all
    result.shutdown = result.deadlock = true;
    result.shutdown_reason = deadlock_report;
    return result;
  }
  for (const auto& resp : result.responses)
    for (const auto& name : resp->names) {
      submitted_at_.erase(name);
      origin_of_.erase(name);
    }
  result.progress = !result.responses.empty() || (g_flags & kFresh) || !(g_flags & kPending);
  result.pending_anywhere = !result.responses.empty() || (g_flags & (kFresh | kPending));
  return result;
}

void Controller::record_executed(const ResponsePtr& resp, const std::optional<Signature>& sig) {
  if (!resp->error.empty() || !resp->joined_ranks.empty()) return;
  int evicted = cache_.put(resp, sig);
  if (evicted < 0) return;
  auto it = cached_pending_.find(evicted);
  if (it != cached_pending_.end()) {
    to_send_.push_back(std::move(it->second));
    cached_pending_.erase(it);
  }
}

TableCounts Controller::counts() const {
  TableCounts c;
  c.cache_entries = static_cast<int64_t>(cache_.size());
  c.cached_pending = static_cast<int64_t>(cached_pending_.size());
  c.uncached_pending = static_cast<int64_t>(to_send_.size());
  c.submitted_pending = static_cast<int64_t>(submitted_at_.size());
  c.coordinator_table = static_cast<int64_t>(table_.size());
  return c;
}

std::vector<uint64_t> Controller::bit_vector(uint64_t flags, const std::vector<int>& invalid_bits,
                                             uint64_t piece_bytes) const {
  // [~flags][~invalid words][hit words][~piece bytes]: AND over ranks gives OR of flags and
  // invalid bits, AND of hits ("ready everywhere"), and OR of the pieces' sizes, which is at
  // least the largest and less than twice it: a width every piece fits in.
  std::vector<uint64_t> vec(2 + 2 * words_, 0);
  vec[0] = ~flags;
  vec.back() = ~piece_bytes;
  for (int w = 0; w < words_; ++w) vec[1 + w] = ~uint64_t{0};
  for (int bit : invalid_bits) vec[1 + (bit >> 6)] &= ~(uint64_t{1} << (bit & 63));
  for (const auto& kv : cached_pending_)
    vec[1 + words_ + (kv.first >> 6)] |= uint64_t{1} << (kv.first & 63);
  return vec;
}

double Controller::oldest_age(double now) const {
  double age = 0.0;
  for (const auto& kv : submitted_at_) age = std::max(age, now - kv.second);
  return age;
}

bool Controller::stall_due(double now) {
  if (stall_check_s_ <= 0 || now - last_stall_report_ < stall_check_s_) return false;
  if (oldest_age(now) < stall_check_s_) return false;
  last_stall_report_ = now;
  return true;
}

// ---- coordinator --------------------------------------------------------------------------
Writer Controller::uncached_piece(bool with_report) const {
  // Its uncached requests, and on a stall report the names it waits for.
  Writer w;
  w.pod<int64_t>(static_cast<int64_t>(to_send_.size()));
  for (const auto& r : to_send_) write_request(w, r);
  w.pod<uint8_t>(with_report);
  if (with_report) {
    w.pod<int64_t>(static_cast<int64_t>(submitted_at_.size()));
    for (const auto& kv : submitted_at_) {
      w.str(kv.first);
      auto origin = origin_of_.find(kv.first);
      w.str(origin == origin_of_.end() ? std::string() : origin->second);
    }
  }
  return w;
}

std::vector<ResponsePtr> Controller::coordinate(bool with_report, std::string* stall_report,
                                                std::string* deadlock, const Writer* sized,
                                                int64_t width) {
  // Every rank sends its piece to the coordinator.  With `sized` (serialized before the bit
  // vector, whose last word gave `width`), one gather of pieces padded to that width; else
  // their sizes first, then a gather of variable pieces.  Over Gloo the second costs three
  // collectives, the first one (readers stop at a piece's end, so padding is ignored).
  std::vector<int> sizes(rank_ == 0 ? size_ : 0), displs(sizes.size());
  std::vector<char> all;
  if (sized != nullptr) {
    std::vector<char> mine(static_cast<size_t>(width), 0);
    std::copy(sized->bytes.begin(), sized->bytes.end(), mine.begin());
    for (size_t r = 0; r < sizes.size(); ++r) {
      sizes[r] = static_cast<int>(width);
      displs[r] = static_cast<int>(r * width);
    }
    if (rank_ == 0) all.resize(static_cast<size_t>(width * size_));
    transport_->gather(mine.data(), static_cast<int>(width), types_.byte, all.data(),
                       static_cast<int>(width), types_.byte, 0, comm_);
  } else {
    Writer w = uncached_piece(with_report);
    int mine = static_cast<int>(w.bytes.size());
    transport_->gather(&mine, 1, types_.int32, sizes.data(), 1, types_.int32, 0, comm_);
    if (rank_ == 0) {
      int64_t total = 0;
      for (int r = 0; r < size_; ++r) {
        displs[r] = static_cast<int>(total);
        total += sizes[r];
      }
      all.resize(std::max<int64_t>(total, 1));
    }
    transport_->gatherv(w.bytes.data(), mine, types_.byte, all.data(), sizes.data(),
                        displs.data(), types_.byte, 0, comm_);
  }
  to_send_.clear();

  Writer out;
  if (rank_ == 0) {
    std::vector<std::vector<Request>> requests(size_);
    std::vector<std::optional<PendingNames>> reports(size_);
    for (int r = 0; r < size_; ++r) {
      Reader rd(all.data() + displs[r], sizes[r]);
      auto n = rd.pod<int64_t>();
      for (int64_t i = 0; i < n; ++i) requests[r].push_back(read_request(rd));
      if (rd.pod<uint8_t>()) {
        PendingNames names(static_cast<size_t>(rd.pod<int64_t>()));
        for (auto& name : names) {
          name.first = rd.str();
          name.second = rd.str();
        }
        reports[r] = std::move(names);
      }
    }
    auto responses = plan(requests, reports, stall_report);
    out.pod<int64_t>(static_cast<int64_t>(responses.size()));
    for (const auto& resp : responses) write_response(out, *resp);
    if (deadlock != nullptr) {
      *deadlock = deadlock_message(reports, deadlock_s_);
      out.str(*deadlock);
    }
  }
  // [length][first bytes] in one fixed-size broadcast; the rest, if any, in a second.
  constexpr int64_t kFirst = kInlineBytes - static_cast<int64_t>(sizeof(int64_t));
  std::vector<char> head(kInlineBytes, 0);
  int64_t nbytes = static_cast<int64_t>(out.bytes.size());
  if (rank_ == 0) {
    std::memcpy(head.data(), &nbytes, sizeof(nbytes));
    if (nbytes)
      std::memcpy(head.data() + sizeof(nbytes), out.bytes.data(), std::min(nbytes, kFirst));
  }
  transport_->bcast(head.data(), static_cast<int>(kInlineBytes), types_.byte, 0, comm_);
  std::memcpy(&nbytes, head.data(), sizeof(nbytes));
  if (rank_ != 0) {
    out.bytes.resize(static_cast<size_t>(nbytes));
    if (nbytes)
      std::memcpy(out.bytes.data(), head.data() + sizeof(nbytes), std::min(nbytes, kFirst));
  }
  if (nbytes > kFirst)
    transport_->bcast(out.bytes.data() + kFirst, static_cast<int>(nbytes - kFirst), types_.byte,
                      0, comm_);
  Reader rd(out.bytes.data(), out.bytes.size());
  std::vector<ResponsePtr> responses(static_cast<size_t>(rd.pod<int64_t>()));
  for (auto& resp : responses) resp = std::make_shared<const Response>(read_response(rd));
  if (deadlock != nullptr && rank_ != 0) *deadlock = rd.str();
  return responses;
}

std::vector<ResponsePtr> Controller::plan(
    const std::vector<std::vector<Request>>& requests,
    const std::vector<std::optional<PendingNames>>& reports,
    std::string* stall_report) {
  std::vector<ResponsePtr> responses;
  for (int rank = 0; rank < size_; ++rank) {
    for (const auto& req : requests[rank]) {
      if (req.op_type == JOIN) {
        joined_ranks_.insert(rank);
        last_joined_ = rank;
        continue;
      }
      auto it = table_pos_.find(req.name);
      if (it == table_pos_.end()) {
        table_.emplace_back(req.name, std::map<int, Request>{});
        it = table_pos_.emplace(req.name, std::prev(table_.end())).first;
      }
      it->second->second[rank] = req;
    }
  }
  if (std::any_of(reports.begin(), reports.end(), [](const auto& r) { return r.has_value(); }))
    *stall_report = report_stall(reports);

  for (auto it = table_.begin(); it != table_.end();) {
    const auto& reqs = it->second;
    const Request& first = reqs.begin()->second;
    int present = static_cast<int>(reqs.size());
    int with_joined = present;
    for (int j : joined_ranks_)
      if (!reqs.count(j)) ++with_joined;
    bool ready;
    if (is_control(first.op_type))
      ready = present == size_ || (first.op_type == BARRIER && with_joined == size_);
    else
      ready = with_joined == size_;
    if (ready) {
      responses.push_back(std::make_shared<const Response>(construct(it->first, reqs)));
      table_pos_.erase(it->first);
      it = table_.erase(it);
    } else {
      ++it;
    }
  }
  if (static_cast<int>(joined_ranks_.size()) == size_) {
    Response join;
    join.op_type = JOIN;
    join.names = {"join"};
    join.last_joined = last_joined_;
    responses.push_back(std::make_shared<const Response>(std::move(join)));
    joined_ranks_.clear();
  }
  return responses;
}

std::string Controller::report_stall(const std::vector<std::optional<PendingNames>>& reports) const {
  // Horovod's "rank: [names it did not submit]" lines, which log scrapers read; then which of
  // the names come from a library helper that every rank must call.
  std::vector<std::set<std::string>> pending(size_);
  std::set<std::string> waiting;
  for (int r = 0; r < size_; ++r) {
    if (!reports[r]) continue;
    for (const auto& item : *reports[r]) {
      pending[r].insert(item.first);
      waiting.insert(item.first);
    }
  }
  std::map<int, std::vector<std::string>> missing;
  for (const auto& name : waiting)
    for (int r = 0; r < size_; ++r)
      if (!pending[r].count(name) && !joined_ranks_.count(r)) missing[r].push_back(name);
  std::string lines;
  for (const auto& kv : missing) {
    if (!lines.empty()) lines += "\n";
    lines += std::to_string(kv.first) + ": [";
    for (size_t i = 0; i < kv.second.size(); ++i) lines += (i ? ", " : "") + kv.second[i];
    lines += "]";
  }
  return lines + origins_note(reports, "\n");
}

Response Controller::construct(const std::string& name, const std::map<int, Request>& reqs) const {
  const Request& first = reqs.begin()->second;
  const int32_t op = first.op_type;
  auto error = [&](const std::string& msg) {
    Response r;
    r.op_type = ERROR;
    r.names = {name};
    r.error = msg;
    return r;
  };
  auto device_word = [](const Request& r) { return r.device >= 0 ? "GPU" : "CPU"; };

  for (const auto& kv : reqs) {
    const Request& other = kv.second;
    if (other.op_type != op)
      return error("Mismatched operations on tensor " + name + ": one or more ranks did an " +
                   op_word(op) + ", and one or more ranks did an " + op_word(other.op_type) + ".");
  }
  if (op == ADD_PROCESS_SET || op == REMOVE_PROCESS_SET) {
    for (const auto& kv : reqs)
      if (kv.second.payload != first.payload)
        return error(std::string("Mismatched ") + op_word(op) + " request " + name +
                     ": ranks passed different process sets.");
    Response r;
    r.op_type = op;
    r.names = {name};
    r.payload = first.payload;
    return r;
  }
  if (op == BARRIER) {
    Response r;
    r.op_type = op;
    r.names = {name};
    return r;
  }
  const std::string word = op_word(op);
  for (auto it = std::next(reqs.begin()); it != reqs.end(); ++it) {
    const Request& other = it->second;
    if (other.dtype != first.dtype)
      return error("Mismatched data types on tensor " + name + ": one rank had type " +
                   dtype_name(first.dtype) + ", but another rank had type " +
                   dtype_name(other.dtype) + ".");
    if (same_shape_op(op) && other.shape != first.shape)
      return error("Mismatched " + word + " tensor shapes on tensor " + name +
                   ": one rank sent a tensor of shape " + shape_str(first.shape) +
                   ", but another rank sent a tensor of shape " + shape_str(other.shape) + ".");
    if (op == ALLGATHER || op == ALLTOALL) {
      if (other.shape.size() != first.shape.size())
        return error("Mismatched " + word + " tensor shapes on tensor " + name +
                     ": one rank sent a tensor of rank " + std::to_string(first.shape.size()) +
                     ", but another rank sent a tensor of rank " +
                     std::to_string(other.shape.size()) + ".");
      if (!std::equal(other.shape.begin() + (other.shape.empty() ? 0 : 1), other.shape.end(),
                      first.shape.begin() + (first.shape.empty() ? 0 : 1)))
        return error("Mismatched " + word + " tensor shapes on tensor " + name +
                     ": one rank sent a tensor of shape " + shape_str(first.shape) +
                     ", but another rank sent a tensor of shape " + shape_str(other.shape) +
                     " (only the first dimension may differ).");
    }
    if ((other.device >= 0) != (first.device >= 0))
      return error("Mismatched " + word + " CPU/GPU device selection on tensor " + name +
                   ": one rank specified device " + device_word(first) +
                   ", but another rank specified device " + device_word(other) + ".");
    if (other.reduce_op != first.reduce_op)
      return error("Mismatched reduction operations on tensor " + name + ": one rank used " +
                   reduce_op_name(first.reduce_op) + ", but another rank used " +
                   reduce_op_name(other.reduce_op) + ".");
    if (other.prescale != first.prescale || other.postscale != first.postscale)
      return error("Mismatched prescale and/or postscale factors on tensor " + name + ": (" +
                   python_float_repr(first.prescale) + ", " + python_float_repr(first.postscale) +
                   ") versus (" + python_float_repr(other.prescale) + ", " +
                   python_float_repr(other.postscale) + ").");
    if (op == BROADCAST && other.root != first.root)
      return error("Mismatched broadcast root ranks on tensor " + name +
                   ": one rank specified root rank " + std::to_string(first.root) +
                   ", but another rank specified root rank " + std::to_string(other.root) + ".");
  }
  std::vector<int> joined;
  for (int r = 0; r < size_; ++r)
    if (!reqs.count(r)) joined.push_back(r);
  if (!joined.empty() && no_join_op(op))
    return error("Tensor " + name + ": " + word + " is not supported while ranks [" +
                 join_ints(joined) + "] have joined (hvd.join).");
  Response r;
  r.op_type = op;
  r.names = {name};
  r.dtype = first.dtype;
  r.shapes.emplace_back();
  for (int rank = 0; rank < size_; ++rank) {
    auto it = reqs.find(rank);
    r.shapes[0].push_back(it != reqs.end() ? it->second.shape : first.shape);
  }
  r.reduce_op = first.reduce_op;
  r.prescale = first.prescale;
  r.postscale = first.postscale;
  r.root = first.root;
  if (op == ALLTOALL) {
    r.has_splits = true;
    for (int rank = 0; rank < size_; ++rank) {
      auto it = reqs.find(rank);
      r.splits.push_back(it != reqs.end() ? it->second.splits.values : Shape{});
    }
  }
  r.joined_ranks.assign(joined.begin(), joined.end());
  r.gpu = first.device >= 0;
  return r;
}

}  // namespace engine
}  // namespace aiak
