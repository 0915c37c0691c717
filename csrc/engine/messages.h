// Requests and responses of the engine, and their wire format between ranks (a flat byte
// string).
//
// The fields and their meaning are those of aiak_training/common/messages.py, which builds the
// requests the frontends submit and the responses the lane (runtime/engine.py) executes.
#pragma once

#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <vector>

namespace aiak {
namespace engine {

enum OpType : int32_t {
  ALLREDUCE = 0, ALLGATHER = 1, BROADCAST = 2, ALLTOALL = 3, REDUCESCATTER = 4, BARRIER = 5,
  JOIN = 6, ADD_PROCESS_SET = 7, REMOVE_PROCESS_SET = 8, ERROR = 9,
};

inline bool is_control(int32_t op) {
  return op == BARRIER || op == JOIN || op == ADD_PROCESS_SET || op == REMOVE_PROCESS_SET;
}

using Shape = std::vector<int64_t>;

// An optional list of ints (alltoall splits, process-set payloads): Python's None vs tuple.
struct OptInts {
  bool present = false;
  std::vector<int64_t> values;
  bool operator==(const OptInts& o) const {
    return present == o.present && (!present || values == o.values);
  }
  bool operator!=(const OptInts& o) const { return !(*this == o); }
};

// What must match for a cached response to be reused (Request.signature() in Python).
struct Signature {
  int32_t op_type = 0, dtype = 0;
  Shape shape;
  int32_t reduce_op = 1;
  double prescale = 1.0, postscale = 1.0;
  int32_t root = -1;
  OptInts splits;
  bool gpu = false;
  bool operator==(const Signature& o) const {
    return op_type == o.op_type && dtype == o.dtype && shape == o.shape &&
           reduce_op == o.reduce_op && prescale == o.prescale && postscale == o.postscale &&
           root == o.root && splits == o.splits && gpu == o.gpu;
  }
  bool operator!=(const Signature& o) const { return !(*this == o); }
};

struct Request {
  int32_t rank = 0;  // rank within the process set
  std::string name;
  int32_t op_type = 0, dtype = 0;
  Shape shape;
  int32_t reduce_op = 1;
  double prescale = 1.0, postscale = 1.0;
  int32_t root = -1;
  OptInts splits, payload;
  int32_t device = -1;
  // This rank only, never sent: the library helper that submitted the request
  // (``consolidate_state_dict``, ``broadcast_object``...), named in stall and deadlock reports.
  std::string origin;

  Signature signature() const {
    return Signature{op_type, dtype, shape, reduce_op, prescale, postscale, root, splits,
                     device >= 0};
  }
};

struct Response {
  int32_t op_type = 0;
  std::vector<std::string> names;
  int32_t dtype = 0;
  std::vector<std::vector<Shape>> shapes;  // shapes[i][r]: tensor i on rank r
  int32_t reduce_op = 1;
  double prescale = 1.0, postscale = 1.0;
  int32_t root = -1;
  bool has_splits = false;
  std::vector<Shape> splits;               // alltoall: splits[r] sent by rank r
  std::string error;
  std::vector<int32_t> joined_ranks;
  int32_t last_joined = -1;
  OptInts payload;
  bool gpu = false;

  // Bytes of the first tensor (the only one, for a fusable response).
  int64_t nbytes(int item) const {
    int64_t n = 1;
    for (int64_t d : shapes.at(0).at(0)) n *= d;
    return n * item;
  }
  // Allreduce responses with equal keys may share one fusion buffer (Response.fusion_key).
  bool fuses_with(const Response& o) const {
    return op_type == o.op_type && gpu == o.gpu && dtype == o.dtype &&
           reduce_op == o.reduce_op && prescale == o.prescale && postscale == o.postscale &&
           joined_ranks == o.joined_ranks;
  }
};
using ResponsePtr = std::shared_ptr<const Response>;

// ---- wire format: little-endian PODs, length-prefixed strings and lists ------------------
class Writer {
 public:
  std::vector<char> bytes;
  template <typename T>
  void pod(T v) {
    const char* p = reinterpret_cast<const char*>(&v);
    bytes.insert(bytes.end(), p, p + sizeof(T));
  }
  void str(const std::string& s) {
    pod<int64_t>(static_cast<int64_t>(s.size()));
    bytes.insert(bytes.end(), s.begin(), s.end());
  }
  void ints(const std::vector<int64_t>& v) {
    pod<int64_t>(static_cast<int64_t>(v.size()));
    for (int64_t x : v) pod(x);
  }
  void opt(const OptInts& o) {
    pod<uint8_t>(o.present);
    if (o.present) ints(o.values);
  }
};

class Reader {
 public:
  Reader(const char* data, size_t size) : p_(data), end_(data + size) {}
  template <typename T>
  T pod() {
    need(sizeof(T));
    T v;
    std::memcpy(&v, p_, sizeof(T));
    p_ += sizeof(T);
    return v;
  }
  std::string str() {
    auto n = static_cast<size_t>(pod<int64_t>());
    need(n);
    std::string s(p_, n);
    p_ += n;
    return s;
  }
  std::vector<int64_t> ints() {
    auto n = static_cast<size_t>(pod<int64_t>());
    std::vector<int64_t> v(n);
    for (auto& x : v) x = pod<int64_t>();
    return v;
  }
  OptInts opt() {
    OptInts o;
    o.present = pod<uint8_t>() != 0;
    if (o.present) o.values = ints();
    return o;
  }
  bool done() const { return p_ == end_; }

 private:
  void need(size_t n) const {
    if (static_cast<size_t>(end_ - p_) < n) throw std::runtime_error("aiak engine: truncated message");
  }
  const char* p_;
  const char* end_;
};

void write_request(Writer& w, const Request& r);
Request read_request(Reader& rd);
void write_response(Writer& w, const Response& r);
Response read_response(Reader& rd);

}  // namespace engine
}  // namespace aiak
