// Engine hot loops: scaling, reduction kernels for MPI user ops, and batched copies for the
// fusion buffer.  Every entry point takes raw addresses (Python ints) and element counts, so
// this module never sees a framework type and one build serves every torch/TF version.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "common/dtypes.h"
#include "common/half.h"
#include "engine/binding.h"
#include "native/hier.h"
#include "native/kernels.h"

namespace py = pybind11;
using namespace aiak;

namespace {

template <typename T>
inline T* as_ptr(uintptr_t addr) { return reinterpret_cast<T*>(addr); }

// ---- scaling ---------------------------------------------------------------------------
// d[i] = s[i] * factor with the arithmetic of Horovod 0.28.1's CPU ScaleBuffer, so pre/postscale
// and Average match it bit for bit: integers are multiplied in double and truncated; float32
// in float, by the factor rounded to float; float16 (and bfloat16, which Horovod lacks) the
// same in float, then rounded to the half type; float64 in double.  s may equal d.  Each loop
// is a plain element-wise pass the compiler vectorises.
template <typename T>
void scale_int(const T* s, T* d, int64_t n, double f) {
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<T>(static_cast<double>(s[i]) * f);
}

template <typename T>
void scale_float(const T* s, T* d, int64_t n, T f) {
  for (int64_t i = 0; i < n; ++i) d[i] = s[i] * f;
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void scale_half(const uint16_t* s, uint16_t* d, int64_t n, float f) {
  for (int64_t i = 0; i < n; ++i) d[i] = FromF(ToF(s[i]) * f);
}


}  // namespace

void aiak::scale_into(uintptr_t src, uintptr_t dst, int64_t n, int dtype, double factor) {
  switch (dtype) {
    case UINT8: scale_int(as_ptr<const uint8_t>(src), as_ptr<uint8_t>(dst), n, factor); break;
    case INT8: scale_int(as_ptr<const int8_t>(src), as_ptr<int8_t>(dst), n, factor); break;
    case UINT16: scale_int(as_ptr<const uint16_t>(src), as_ptr<uint16_t>(dst), n, factor); break;
    case INT16: scale_int(as_ptr<const int16_t>(src), as_ptr<int16_t>(dst), n, factor); break;
    case INT32: scale_int(as_ptr<const int32_t>(src), as_ptr<int32_t>(dst), n, factor); break;
    case INT64: scale_int(as_ptr<const int64_t>(src), as_ptr<int64_t>(dst), n, factor); break;
    case FLOAT32:
      scale_float(as_ptr<const float>(src), as_ptr<float>(dst), n, static_cast<float>(factor));
      break;
    case FLOAT64: scale_float(as_ptr<const double>(src), as_ptr<double>(dst), n, factor); break;
    case FLOAT16:
      scale_half<half_to_float, float_to_half>(as_ptr<const uint16_t>(src), as_ptr<uint16_t>(dst),
                                               n, static_cast<float>(factor));
      break;
    case BFLOAT16:
      scale_half<bf16_to_float, float_to_bf16>(as_ptr<const uint16_t>(src), as_ptr<uint16_t>(dst),
                                               n, static_cast<float>(factor));
      break;
  }
}

namespace {

void scale(uintptr_t addr, int64_t n, int dtype, double factor) {
  if (n <= 0 || factor == 1.0) return;  // as Horovod: a factor of 1 is no pass at all
  if (!scalable(dtype))
    throw std::invalid_argument("scale: unsupported dtype " + std::to_string(dtype));
  py::gil_scoped_release release;
  scale_into(addr, addr, n, dtype, factor);
}

// ---- reduction: dst = op(dst, src) -------------------------------------------------------
template <typename T, typename F>
void reduce_plain(const T* src, T* dst, int64_t n, F f) {
  for (int64_t i = 0; i < n; ++i) dst[i] = f(dst[i], src[i]);
}

template <typename T>
void reduce_typed(const T* s, T* d, int64_t n, int op) {
  switch (op) {
    case AVERAGE:
    case SUM: reduce_plain(s, d, n, [](T a, T b) { return static_cast<T>(a + b); }); break;
    case MIN: reduce_plain(s, d, n, [](T a, T b) { return b < a ? b : a; }); break;
    case MAX: reduce_plain(s, d, n, [](T a, T b) { return b > a ? b : a; }); break;
    case PRODUCT: reduce_plain(s, d, n, [](T a, T b) { return static_cast<T>(a * b); }); break;
    default: throw std::invalid_argument("reduce: unsupported op " + std::to_string(op));
  }
}

template <float (*ToF)(uint16_t), uint16_t (*FromF)(float)>
void reduce_half(const uint16_t* s, uint16_t* d, int64_t n, int op) {
  switch (op) {
    case AVERAGE:
    case SUM:
      for (int64_t i = 0; i < n; ++i) d[i] = FromF(ToF(d[i]) + ToF(s[i]));
      break;
    case MIN:
      for (int64_t i = 0; i < n; ++i) d[i] = FromF(std::fmin(ToF(d[i]), ToF(s[i])));
      break;
    case MAX:
      for (int64_t i = 0; i < n; ++i) d[i] = FromF(std::fmax(ToF(d[i]), ToF(s[i])));
      break;
    case PRODUCT:
      for (int64_t i = 0; i < n; ++i) d[i] = FromF(ToF(d[i]) * ToF(s[i]));
      break;
    default: throw std::invalid_argument("reduce: unsupported op " + std::to_string(op));
  }
}

void reduce_bool(const uint8_t* s, uint8_t* d, int64_t n, int op) {
  // Sum and Max are logical OR; Min and Product are logical AND.
  if (op == SUM || op == MAX) {
    for (int64_t i = 0; i < n; ++i) d[i] = (d[i] | s[i]) ? 1 : 0;
  } else if (op == MIN || op == PRODUCT) {
    for (int64_t i = 0; i < n; ++i) d[i] = (d[i] && s[i]) ? 1 : 0;
  } else {
    throw std::invalid_argument("reduce: unsupported op for bool " + std::to_string(op));
  }
}

}  // namespace

void aiak::reduce_into(uintptr_t src, uintptr_t dst, int64_t n, int dtype, int op) {
  if (n <= 0) return;
  switch (dtype) {
    case UINT8: reduce_typed(as_ptr<uint8_t>(src), as_ptr<uint8_t>(dst), n, op); break;
    case INT8: reduce_typed(as_ptr<int8_t>(src), as_ptr<int8_t>(dst), n, op); break;
    case UINT16: reduce_typed(as_ptr<uint16_t>(src), as_ptr<uint16_t>(dst), n, op); break;
    case INT16: reduce_typed(as_ptr<int16_t>(src), as_ptr<int16_t>(dst), n, op); break;
    case INT32: reduce_typed(as_ptr<int32_t>(src), as_ptr<int32_t>(dst), n, op); break;
    case INT64: reduce_typed(as_ptr<int64_t>(src), as_ptr<int64_t>(dst), n, op); break;
    case FLOAT32: reduce_typed(as_ptr<float>(src), as_ptr<float>(dst), n, op); break;
    case FLOAT64: reduce_typed(as_ptr<double>(src), as_ptr<double>(dst), n, op); break;
    case FLOAT16:
      reduce_half<half_to_float, float_to_half>(as_ptr<uint16_t>(src), as_ptr<uint16_t>(dst), n, op);
      break;
    case BFLOAT16:
      reduce_half<bf16_to_float, float_to_bf16>(as_ptr<uint16_t>(src), as_ptr<uint16_t>(dst), n, op);
      break;
    case BOOL: reduce_bool(as_ptr<uint8_t>(src), as_ptr<uint8_t>(dst), n, op); break;
    default: throw std::invalid_argument("reduce: unsupported dtype " + std::to_string(dtype));
  }
}

namespace {

void reduce(uintptr_t src, uintptr_t dst, int64_t n, int dtype, int op) {
  py::gil_scoped_release release;
  reduce_into(src, dst, n, dtype, op);
}

// Reduce `count` source buffers into dst (dst = op(dst, src_k) for each k, in order).
// One pass over dst per source; used by the shared-memory intra-node stage.
void reduce_many(const std::vector<uintptr_t>& srcs, uintptr_t dst, int64_t n, int dtype, int op) {
  py::gil_scoped_release release;
  for (uintptr_t s : srcs) reduce_into(s, dst, n, dtype, op);
}

// ---- batched copies (fusion buffer pack / unpack) ----------------------------------------
void copy_batch(const std::vector<uintptr_t>& dst, const std::vector<uintptr_t>& src,
                const std::vector<int64_t>& nbytes) {
  if (dst.size() != src.size() || dst.size() != nbytes.size())
    throw std::invalid_argument("copy_batch: dst, src and nbytes must have equal lengths");
  py::gil_scoped_release release;
  for (size_t i = 0; i < dst.size(); ++i) {
    if (nbytes[i] > 0 && dst[i] != src[i])
      std::memcpy(reinterpret_cast<void*>(dst[i]), reinterpret_cast<const void*>(src[i]), nbytes[i]);
  }
}

// Unpack with a scale folded into the same pass: dst[k] = src[k] * factor, with scale()'s
// arithmetic.  Saves one full read+write of the fusion buffer compared with scale-then-copy.
void copy_scaled_batch(const std::vector<uintptr_t>& dst, const std::vector<uintptr_t>& src,
                       const std::vector<int64_t>& counts, int dtype, double factor) {
  if (dst.size() != src.size() || dst.size() != counts.size())
    throw std::invalid_argument("copy_scaled_batch: dst, src and counts must have equal lengths");
  if (itemsize(dtype) == 0 || (factor != 1.0 && !scalable(dtype)))
    throw std::invalid_argument("copy_scaled_batch: unsupported dtype " + std::to_string(dtype));
  py::gil_scoped_release release;
  for (size_t k = 0; k < dst.size(); ++k) {
    if (counts[k] <= 0) continue;
    if (factor == 1.0) {
      if (dst[k] != src[k])
        std::memcpy(as_ptr<void>(dst[k]), as_ptr<const void>(src[k]), counts[k] * itemsize(dtype));
    } else {
      scale_into(src[k], dst[k], counts[k], dtype, factor);
    }
  }
}

}  // namespace

PYBIND11_MODULE(_native, m) {
  m.doc() = "aiak-training engine kernels (raw pointers only; no framework ABI)";
  m.def("scale", &scale, py::arg("addr"), py::arg("count"), py::arg("dtype"), py::arg("factor"),
        "In-place multiply of `count` elements at `addr` by `factor`, as Horovod's CPU "
        "ScaleBuffer computes it (float32/float16/bfloat16 in float, integers truncated).");
  m.def("reduce", &reduce, py::arg("src"), py::arg("dst"), py::arg("count"), py::arg("dtype"),
        py::arg("op"), "dst = op(dst, src), elementwise.");
  m.def("reduce_many", &reduce_many, py::arg("srcs"), py::arg("dst"), py::arg("count"),
        py::arg("dtype"), py::arg("op"), "dst = op(dst, src) for every src in order.");
  m.def("copy_batch", &copy_batch, py::arg("dst"), py::arg("src"), py::arg("nbytes"),
        "memcpy each (dst[i], src[i], nbytes[i]) without holding the GIL.");
  m.def("copy_scaled_batch", &copy_scaled_batch, py::arg("dst"), py::arg("src"),
        py::arg("counts"), py::arg("dtype"), py::arg("factor"),
        "dst[i][:] = src[i][:] * factor, with scale()'s arithmetic.");
  m.def("half_roundtrip", [](float f) { return half_to_float(float_to_half(f)); },
        "Round a float through IEEE half (for tests).");
  m.def("bf16_roundtrip", [](float f) { return bf16_to_float(float_to_bf16(f)); },
        "Round a float through bfloat16 (for tests).");
  register_hier(m);
  register_engine(m);
}
