// Wire format of requests and responses (see messages.h).
#include "engine/messages.h"

namespace aiak {
namespace engine {

void write_request(Writer& w, const Request& r) {
  w.pod(r.rank);
  w.str(r.name);
  w.pod(r.op_type);
  w.pod(r.dtype);
  w.ints(r.shape);
  w.pod(r.reduce_op);
  w.pod(r.prescale);
  w.pod(r.postscale);
  w.pod(r.root);
  w.opt(r.splits);
  w.opt(r.payload);
  w.pod(r.device);
}

Request read_request(Reader& rd) {
  Request r;
  r.rank = rd.pod<int32_t>();
  r.name = rd.str();
  r.op_type = rd.pod<int32_t>();
  r.dtype = rd.pod<int32_t>();
  r.shape = rd.ints();
  r.reduce_op = rd.pod<int32_t>();
  r.prescale = rd.pod<double>();
  r.postscale = rd.pod<double>();
  r.root = rd.pod<int32_t>();
  r.splits = rd.opt();
  r.payload = rd.opt();
  r.device = rd.pod<int32_t>();
  return r;
}

void write_response(Writer& w, const Response& r) {
  w.pod(r.op_type);
  w.pod<int64_t>(static_cast<int64_t>(r.names.size()));
  for (const auto& n : r.names) w.str(n);
  w.pod(r.dtype);
  w.pod<int64_t>(static_cast<int64_t>(r.shapes.size()));
  for (const auto& per_rank : r.shapes) {
    w.pod<int64_t>(static_cast<int64_t>(per_rank.size()));
    for (const auto& s : per_rank) w.ints(s);
  }
  w.pod(r.reduce_op);
  w.pod(r.prescale);
  w.pod(r.postscale);
  w.pod(r.root);
  w.pod<uint8_t>(r.has_splits);
  if (r.has_splits) {
    w.pod<int64_t>(static_cast<int64_t>(r.splits.size()));
    for (const auto& s : r.splits) w.ints(s);
  }
  w.str(r.error);
  w.ints(std::vector<int64_t>(r.joined_ranks.begin(), r.joined_ranks.end()));
  w.pod(r.last_joined);
  w.opt(r.payload);
  w.pod<uint8_t>(r.gpu);
}

Response read_response(Reader& rd) {
  Response r;
  r.op_type = rd.pod<int32_t>();
  r.names.resize(static_cast<size_t>(rd.pod<int64_t>()));
  for (auto& n : r.names) n = rd.str();
  r.dtype = rd.pod<int32_t>();
  r.shapes.resize(static_cast<size_t>(rd.pod<int64_t>()));
  for (auto& per_rank : r.shapes) {
    per_rank.resize(static_cast<size_t>(rd.pod<int64_t>()));
    for (auto& s : per_rank) s = rd.ints();
  }
  r.reduce_op = rd.pod<int32_t>();
  r.prescale = rd.pod<double>();
  r.postscale = rd.pod<double>();
  r.root = rd.pod<int32_t>();
  r.has_splits = rd.pod<uint8_t>() != 0;
  if (r.has_splits) {
    r.splits.resize(static_cast<size_t>(rd.pod<int64_t>()));
    for (auto& s : r.splits) s = rd.ints();
  }
  r.error = rd.str();
  for (int64_t j : rd.ints()) r.joined_ranks.push_back(static_cast<int32_t>(j));
  r.last_joined = rd.pod<int32_t>();
  r.payload = rd.opt();
  r.gpu = rd.pod<uint8_t>() != 0;
  return r;
}

}  // namespace engine
}  // namespace aiak
