// Python binding of the engine's C++ core (aiak_training._native.EngineCore), and its C ABI.
//
// Every call that may block or take the engine's lock releases the GIL first, so a busy
// Python thread and the engine never wait on each other.  The C ABI (aiak_engine_*) lets a
// frontend that is not Python (a TensorFlow custom op, say) enqueue and wait on host
// allreduce and broadcast through the same engine the Python frontends use.
#include "engine/binding.h"

#include <pybind11/stl.h>

#include <atomic>
#include <cstring>

#include "common/dtypes.h"
#include "engine/engine.h"
#include "engine/mpi.h"
#include "engine/python_transport.h"

namespace py = pybind11;

namespace aiak {
namespace engine {
namespace {

// The started engine the C ABI talks to (one per process, as hvd.init() makes one).
std::atomic<Engine*> g_engine{nullptr};

Shape to_shape(const py::handle& obj) {
  Shape out;
  if (PyTuple_Check(obj.ptr())) {  // the usual case, without pybind11's iteration
    const Py_ssize_t n = PyTuple_GET_SIZE(obj.ptr());
    out.reserve(n);
    for (Py_ssize_t i = 0; i < n; ++i) {
      long long d = PyLong_AsLongLong(PyTuple_GET_ITEM(obj.ptr(), i));
      if (d == -1 && PyErr_Occurred()) throw py::error_already_set();
      out.push_back(d);
    }
    return out;
  }
  for (auto d : obj) out.push_back(d.cast<int64_t>());
  return out;
}

// Item i of a list (the caller checked the length), as an int or a str.  Addresses fit in
// a signed 64-bit int: user-space pointers on the platforms we build for are below 2**63.
long long list_int(PyObject* list, size_t i) {
  long long v = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
  if (v == -1 && PyErr_Occurred()) throw py::error_already_set();
  return v;
}

std::string list_str(PyObject* list, size_t i) {
  Py_ssize_t len = 0;
  const char* text = PyUnicode_AsUTF8AndSize(PyList_GET_ITEM(list, i), &len);
  if (text == nullptr) throw py::error_already_set();
  return std::string(text, static_cast<size_t>(len));
}

OptInts to_opt(const py::handle& obj) {
  OptInts out;
  if (obj.is_none()) return out;
  out.present = true;
  out.values = to_shape(obj);
  return out;
}

py::object from_opt(const OptInts& o) {
  if (!o.present) return py::none();
  return py::tuple(py::cast(o.values));
}

// (rank, name, op_type, dtype, shape, reduce_op, prescale, postscale, root, splits, payload,
//  device, in_addr, out_addr, lane, ready_event) -> the request and this rank's entry.
void parse(const py::handle& t, std::vector<Request>* reqs, std::vector<Entry>* entries) {
  auto tup = py::reinterpret_borrow<py::tuple>(t);
  if (tup.size() != 16) throw std::invalid_argument("enqueue: a request is a 16-tuple");
  Request r;
  r.rank = tup[0].cast<int32_t>();
  r.name = tup[1].cast<std::string>();
  r.op_type = tup[2].cast<int32_t>();
  r.dtype = tup[3].cast<int32_t>();
  r.shape = to_shape(tup[4]);
  r.reduce_op = tup[5].cast<int32_t>();
  r.prescale = tup[6].cast<double>();
  r.postscale = tup[7].cast<double>();
  r.root = tup[8].cast<int32_t>();
  r.splits = to_opt(tup[9]);
  r.payload = to_opt(tup[10]);
  r.device = tup[11].cast<int32_t>();
  Entry e = make_entry(r, tup[12].cast<uintptr_t>(), tup[13].cast<uintptr_t>());
  e.lane = tup[14].cast<bool>();
  e.device = r.device;
  e.ready_event = tup[15].cast<int64_t>();
  reqs->push_back(std::move(r));
  entries->push_back(std::move(e));
}

Request allreduce_request(int rank, std::string name, int dtype, Shape shape, int reduce_op,
                          double prescale, double postscale, int device) {
  Request r;
  r.rank = rank;
  r.name = std::move(name);
  r.op_type = ALLREDUCE;
  r.dtype = dtype;
  r.shape = std::move(shape);
  r.reduce_op = reduce_op;
  r.prescale = prescale;
  r.postscale = postscale;
  r.device = device;
  return r;
}

py::tuple response_tuple(const Response& r) {
  py::list shapes;
  for (const auto& per_rank : r.shapes) {
    py::list ranks;
    for (const auto& s : per_rank) ranks.append(py::tuple(py::cast(s)));
    shapes.append(ranks);
  }
  py::object splits = py::none();
  if (r.has_splits) {
    py::list l;
    for (const auto& s : r.splits) l.append(py::tuple(py::cast(s)));
    splits = l;
  }
  return py::make_tuple(r.op_type, py::cast(r.names), r.dtype, shapes, r.reduce_op, r.prescale,
                        r.postscale, r.root, splits, r.error,
                        py::tuple(py::cast(r.joined_ranks)), r.last_joined, from_opt(r.payload),
                        r.gpu);
}

py::tuple gpu_allreduce_tuple(const GpuAllreduce& c) {
  return py::make_tuple(py::cast(c.names), c.dtype, c.reduce_op, c.prescale, c.postscale,
                        c.device, py::cast(c.ins),
                        py::cast(c.outs), py::cast(c.counts), py::cast(c.ready_events),
                        py::cast(c.missing));
}

Lane make_lane(py::function fn) {
  auto holder = std::make_shared<py::function>(std::move(fn));
  return [holder](const std::string& kind, int set_id, const void* data) -> std::string {
    py::gil_scoped_acquire gil;
    try {
      py::object payload;
      if (kind == "execute") {
        py::list l;
        for (const auto& r : *static_cast<const std::vector<ResponsePtr>*>(data))
          l.append(response_tuple(*r));
        payload = l;
      } else if (kind == "gpu_allreduce") {
        payload = gpu_allreduce_tuple(*static_cast<const GpuAllreduce*>(data));
      } else if (kind == "timeline") {
        py::list l;
        for (const auto& ev : *static_cast<const std::vector<TimelineEvent>*>(data))
          l.append(py::make_tuple(ev.name, ev.activity, ev.ts));
        payload = l;
      } else {
        payload = py::str(*static_cast<const std::string*>(data));
      }
      py::object result = (*holder)(kind, set_id, payload);
      if (kind == "gpu_allreduce" && py::isinstance<py::int_>(result)) {
        // The completion event of the fused response (the lane's success value).
        static_cast<GpuAllreduce*>(const_cast<void*>(data))->event = result.cast<int64_t>();
        return std::string();
      }
      return result.is_none() ? std::string() : result.cast<std::string>();
    } catch (py::error_already_set& exc) {
      return std::string("The background thread failed: ") + exc.what();
    }
  };
}

EngineConfig make_config(const py::dict& d) {
  EngineConfig c;
  c.cycle_time_s = d["cycle_time_s"].cast<double>();
  c.cache_capacity = d["cache_capacity"].cast<int>();
  c.stall_check_s = d["stall_check_s"].cast<double>();
  c.stall_shutdown_s = d["stall_shutdown_s"].cast<double>();
  c.idle_park_s = d.contains("idle_park_s") ? d["idle_park_s"].cast<double>() : 0.0;
  c.deadlock_s = d.contains("deadlock_s") ? d["deadlock_s"].cast<double>() : 0.0;
  c.types.uint64 = d["UINT64_T"].cast<int64_t>();
  c.types.int32 = d["INT32_T"].cast<int64_t>();
  c.types.int64 = d["INT64_T"].cast<int64_t>();
  c.types.byte = d["BYTE"].cast<int64_t>();
  c.types.band = d["BAND"].cast<int64_t>();
  auto dtypes = d["dtypes"].cast<std::vector<int64_t>>();
  if (dtypes.size() != 11) throw std::invalid_argument("EngineCore: 11 datatype handles expected");
  std::copy(dtypes.begin(), dtypes.end(), c.dtypes);
  c.sum = d["SUM"].cast<int64_t>();
  c.min = d["MIN"].cast<int64_t>();
  c.max = d["MAX"].cast<int64_t>();
  c.prod = d["PROD"].cast<int64_t>();
  c.lor = d["LOR"].cast<int64_t>();
  c.land = d["LAND"].cast<int64_t>();
  c.shut_down = d["shut_down"].cast<std::string>();
  c.duplicate_name = d["duplicate_name"].cast<std::string>();
  return c;
}

MpiTuning mpi_tuning(const py::dict& d) {
  MpiTuning t;
  auto get = [&](const char* key, double fallback) {
    return d.contains(key) ? d[key].cast<double>() : fallback;
  };
  t.ring_min_bytes = static_cast<int64_t>(get("ring_min_bytes", double(t.ring_min_bytes)));
  t.segment_bytes = static_cast<int64_t>(get("ring_segment_bytes", double(t.segment_bytes)));
  t.window = static_cast<int>(get("ring_window", t.window));
  t.ring_on_one_host = get("ring_on_one_host", 0) != 0;
  t.wait.spin_us = get("wait_spin_us", t.wait.spin_us);
  t.wait.longest_sleep_us = get("wait_sleep_us", t.wait.longest_sleep_us);
  return t;
}

void copy_error(const std::string& text, char* out, size_t len) {
  if (out == nullptr || len == 0) return;
  std::strncpy(out, text.c_str(), len - 1);
  out[len - 1] = '\0';
}

}  // namespace

}  // namespace engine

void register_engine(py::module_& m) {
  using namespace engine;
  py::register_exception<EngineStopped>(m, "EngineStopped", PyExc_RuntimeError);
  py::register_exception<BadRequest>(m, "BadRequest", PyExc_ValueError);

  m.def("float_repr", &python_float_repr, py::arg("x"),
        "repr() of a float as the engine writes it into messages (for tests).");
  m.def("set_call_origin", &Engine::set_call_origin, py::arg("origin"),
        "Name the library helper whose collectives this thread submits from now on (\"\" for "
        "none): stall warnings and deadlock errors name it.");
  m.def("call_origin", &Engine::call_origin,
        "The helper set_call_origin() named for this thread, or \"\".");

  py::class_<Engine>(m, "EngineCore",
                     "The engine's C++ core (csrc/engine/): negotiation, fusion and host collectives "
                     "(MPI, or Gloo through Python) on its own thread.")
      .def(py::init([](py::dict config, py::function lane, py::object gloo) {
             // MPI by default, bound to mpi4py's library; Gloo when a Python object that runs
             // its collectives is given (runtime/transport/gloo_calls.py).
             auto transport = gloo.is_none()
                                  ? bind_mpi(config["handle_bytes"].cast<int>(),
                                             config["in_place"].cast<int64_t>(),
                                             mpi_tuning(config))
                                  : python_transport(gloo);
             return new Engine(make_config(config), make_lane(std::move(lane)),
                               std::move(transport));
           }),
           py::arg("config"), py::arg("lane"), py::arg("gloo") = py::none())
      .def("add_set", &Engine::add_set, py::arg("set_id"), py::arg("comm"), py::arg("rank"),
           py::arg("size"), py::arg("flat"), py::arg("one_host") = false,
           py::call_guard<py::gil_scoped_release>())
      .def("set_flat", &Engine::set_flat, py::arg("set_id"), py::arg("flat"),
           py::call_guard<py::gil_scoped_release>())
      .def("remove_set", &Engine::remove_set, py::arg("set_id"), py::arg("why"),
           py::call_guard<py::gil_scoped_release>())
      .def("start", [](Engine& e) {
             e.start();
             g_engine = &e;
           })
      .def("request_shutdown", &Engine::request_shutdown)
      .def("join", [](Engine& e) {
             {
               py::gil_scoped_release release;
               e.join();
             }
             Engine* expected = &e;
             g_engine.compare_exchange_strong(expected, nullptr);
           })
      .def("enqueue",
           [](Engine& e, int set_id, py::sequence requests) {
             std::vector<Request> reqs;
             std::vector<Entry> entries;
             reqs.reserve(py::len(requests));
             entries.reserve(py::len(requests));
             for (auto t : requests) parse(t, &reqs, &entries);
             py::gil_scoped_release release;
             return e.enqueue(set_id, std::move(reqs), std::move(entries));
           },
           py::arg("set_id"), py::arg("requests"))
      .def("enqueue_allreduce",
           // The hot path of hvd.allreduce_async: one host tensor, no list or tuple to build.
           [](Engine& e, int set_id, int rank, std::string name, int dtype, py::tuple shape,
              uintptr_t in, uintptr_t out, int reduce_op, double prescale, double postscale) {
             std::vector<Request> reqs{allreduce_request(rank, std::move(name), dtype,
                                                         to_shape(shape), reduce_op, prescale,
                                                         postscale, -1)};
             std::vector<Entry> entries{make_entry(reqs[0], in, out)};
             py::gil_scoped_release release;
             return e.enqueue(set_id, std::move(reqs), std::move(entries))[0];
           })
      .def("enqueue_allreduces",
           // Allreduces of one call, one list per field and no tuple per tensor: grouped
           // allreduces, and every allreduce of CUDA tensors.  Host tensors (device -1) run
           // in C++; CUDA tensors are handed to the lane fused (GpuAllreduce), each waiting
           // for `ready_event`, recorded on the producer's stream.  The lists are read
           // with the CPython API, which costs a fraction of pybind11's generic conversions.
           [](Engine& e, int set_id, int rank, py::list names, py::list dtypes, py::list shapes,
              py::list ins, py::list outs, int reduce_op, double prescale, double postscale,
              int device, int64_t ready_event) {
             const size_t n = names.size();
             if (dtypes.size() != n || shapes.size() != n || ins.size() != n || outs.size() != n)
               throw std::invalid_argument("enqueue_allreduces: one dtype, shape, input and "
                                           "output per name");
             std::vector<Request> reqs;
             std::vector<Entry> entries;
             reqs.reserve(n);
             entries.reserve(n);
             for (size_t i = 0; i < n; ++i) {
               reqs.push_back(allreduce_request(
                   rank, list_str(names.ptr(), i), static_cast<int>(list_int(dtypes.ptr(), i)),
                   to_shape(PyList_GET_ITEM(shapes.ptr(), i)), reduce_op, prescale, postscale,
                   device));
               const Request& r = reqs.back();
               entries.push_back(make_entry(r, static_cast<uintptr_t>(list_int(ins.ptr(), i)),
                                            static_cast<uintptr_t>(list_int(outs.ptr(), i))));
               entries.back().device = device;
               entries.back().ready_event = ready_event;
             }
             std::vector<int64_t> handles;
             {
               py::gil_scoped_release release;
               handles = e.enqueue(set_id, std::move(reqs), std::move(entries));
             }
             py::list out(handles.size());
             for (size_t i = 0; i < handles.size(); ++i)
               PyList_SET_ITEM(out.ptr(), i, PyLong_FromLongLong(handles[i]));
             return out;
           },
           py::arg("set_id"), py::arg("rank"), py::arg("names"), py::arg("dtypes"),
           py::arg("shapes"), py::arg("ins"), py::arg("outs"), py::arg("reduce_op"),
           py::arg("prescale"), py::arg("postscale"), py::arg("device") = -1,
           py::arg("ready_event") = 0)
      .def("wait",
           // Blocks (GIL released) until `handle` completes, forgets it, and returns
           // (result or None, completion event).  IndexError for an unknown handle,
           // EngineStopped (with the reason) for a failed one.
           [](Engine& e, int64_t handle) -> py::tuple {
             WaitResult w;
             {
               py::gil_scoped_release release;
               w = e.wait(handle, true);
             }
             if (w.unknown) throw std::out_of_range(std::to_string(handle));
             if (w.failed) throw EngineStopped(w.error);
             return py::make_tuple(
                 w.has_result ? py::object(py::int_(w.result)) : py::object(py::none()), w.event);
           },
           py::arg("handle"))
      .def("wait_all",
           // wait() for every handle, all forgotten even if one failed; returns (results,
           // events), one of each per handle.  The first failure raises after all are waited.
           [](Engine& e, const std::vector<int64_t>& handles) -> py::tuple {
             std::vector<WaitResult> ws;
             {
               py::gil_scoped_release release;
               ws = e.wait_all(handles);
             }
             py::list results, events;
             const WaitResult* bad = nullptr;
             int64_t unknown = -1;
             for (size_t i = 0; i < ws.size(); ++i) {
               const WaitResult& w = ws[i];
               if (w.unknown && unknown < 0) unknown = handles[i];
               if (w.failed && bad == nullptr) bad = &w;
               results.append(w.has_result ? py::object(py::int_(w.result))
                                           : py::object(py::none()));
               events.append(w.event);
             }
             if (unknown >= 0) throw std::out_of_range(std::to_string(unknown));
             if (bad != nullptr) throw EngineStopped(bad->error);
             return py::make_tuple(results, events);
           },
           py::arg("handles"))
      .def("poll",
           [](Engine& e, int64_t handle) {
             auto w = e.poll(handle);
             return w.unknown ? -1 : (w.done ? 1 : 0);
           },
           py::call_guard<py::gil_scoped_release>(), py::arg("handle"),
           "1 done, 0 in flight, -1 unknown handle.")
      .def("event", [](Engine& e, int64_t handle) { return e.poll(handle).event; },
           py::call_guard<py::gil_scoped_release>(), py::arg("handle"),
           "The completion cudaEvent_t of a done GPU handle (0 otherwise).")
      .def("handle_of", &Engine::handle_of, py::call_guard<py::gil_scoped_release>())
      .def("wait_any",
           [](Engine& e, const std::vector<int64_t>& handles, double timeout) {
             py::gil_scoped_release release;
             return e.wait_any(handles, timeout);
           },
           py::arg("handles"), py::arg("timeout") = -1.0)
      .def("completion_time", &Engine::completion_time, py::call_guard<py::gil_scoped_release>())
      .def("finish_name", &Engine::finish_name, py::arg("set_id"), py::arg("name"),
           py::arg("error") = "", py::arg("event") = 0, py::call_guard<py::gil_scoped_release>())
      .def("abandon", &Engine::abandon, py::call_guard<py::gil_scoped_release>())
      .def("counts", &Engine::counts, py::call_guard<py::gil_scoped_release>())
      .def("progress_counters", &Engine::progress_counters)
      .def("in_flight", &Engine::in_flight, py::call_guard<py::gil_scoped_release>())
      .def("set_rank", &Engine::set_rank, py::call_guard<py::gil_scoped_release>())
      .def("fatal", &Engine::fatal, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("cycle_started", &Engine::cycle_started)
      .def_property_readonly("running", &Engine::running)
      .def_property_readonly("stopped", &Engine::stopped)
      .def_property(
          "fusion_threshold", [](const Engine& e) { return e.fusion_threshold.load(); },
          [](Engine& e, int64_t v) { e.fusion_threshold = v; })
      .def_property(
          "cycle_time_s", [](const Engine& e) { return e.cycle_time_s.load(); },
          [](Engine& e, double v) { e.cycle_time_s = v; })
      .def_property(
          "cache_switch", [](const Engine& e) { return e.cache_switch.load(); },
          [](Engine& e, int v) { e.cache_switch = v; })
      .def_property(
          "zero_copy_bytes", [](const Engine& e) { return e.zero_copy_bytes.load(); },
          [](Engine& e, int64_t v) { e.zero_copy_bytes = v; })
      .def_property(
          "timeline_on", [](const Engine& e) { return e.timeline_on.load(); },
          [](Engine& e, bool v) { e.timeline_on = v; });
}

}  // namespace aiak

// ---- C ABI ----------------------------------------------------------------------------------
using namespace aiak::engine;

extern "C" {

// Enqueues a host allreduce (op_type 0) or broadcast (2) of `ndim`-dimensional `shape` on
// process set `set_id`; returns its handle, or -1 with `error` filled in.
__attribute__((visibility("default"))) int64_t aiak_engine_enqueue(
    int32_t set_id, int32_t op_type, const char* name, int32_t dtype, const int64_t* shape,
    int32_t ndim, const void* input, void* output, int32_t reduce_op, double prescale,
    double postscale, int32_t root, char* error, size_t error_len) {
  using namespace aiak::engine;
  Engine* e = g_engine.load();
  try {
    if (e == nullptr) throw std::runtime_error("the engine is not running (call hvd.init())");
    if (op_type != ALLREDUCE && op_type != BROADCAST)
      throw std::invalid_argument("the C ABI enqueues allreduce (0) and broadcast (2) only");
    if (op_type == ALLREDUCE && reduce_op == aiak::ADASUM)
      throw std::invalid_argument("the C ABI does not run Adasum (op 2): it runs in Python; use "
                                  "the torch or TensorFlow frontend");
    if (name == nullptr || aiak::itemsize(dtype) == 0 || ndim < 0)
      throw std::invalid_argument("a name, a known dtype and ndim >= 0 are required");
    int rank = e->set_rank(set_id);
    if (rank < 0) throw std::invalid_argument("this rank is not in process set " + std::to_string(set_id));
    std::vector<Request> reqs(1);
    Request& r = reqs[0];
    r.rank = rank;
    r.name = name;
    r.op_type = op_type;
    r.dtype = dtype;
    r.shape.assign(shape, shape + ndim);
    r.reduce_op = reduce_op;
    r.prescale = prescale;
    r.postscale = postscale;
    r.root = op_type == BROADCAST ? root : -1;
    std::vector<Entry> entries{make_entry(r, reinterpret_cast<uintptr_t>(input),
                                          reinterpret_cast<uintptr_t>(output))};
    return e->enqueue(set_id, std::move(reqs), std::move(entries))[0];
  } catch (const std::exception& exc) {
    copy_error(exc.what(), error, error_len);
    return -1;
  }
}

// Waits for `handle` and forgets it: 0 done, 1 failed (`error` says why), -1 unknown handle.
__attribute__((visibility("default"))) int aiak_engine_wait(int64_t handle, char* error,
                                                            size_t error_len) {
  Engine* e = g_engine.load();
  if (e == nullptr) {
    copy_error("the engine is not running", error, error_len);
    return -1;
  }
  auto w = e->wait(handle, true);
  if (w.unknown) return -1;
  if (w.failed) {
    copy_error(w.error, error, error_len);
    return 1;
  }
  return 0;
}

// 1 if `handle` is done, 0 if in flight, -1 if unknown.
__attribute__((visibility("default"))) int aiak_engine_poll(int64_t handle) {
  Engine* e = g_engine.load();
  if (e == nullptr) return -1;
  auto w = e->poll(handle);
  return w.unknown ? -1 : (w.done ? 1 : 0);
}

}  // extern "C"
