// aiak_training.allreduce._adasum_cpu: the arithmetic of Adasum on raw CPU buffers.
//
// aiak_training/allreduce/adasum.py runs the communication (vector halving, distance
// doubling) and calls in here for the two passes over the data at each level: the per-tensor
// dot products of a fused buffer, and, once those are summed over the ranks that hold the
// rest of each tensor, the per-tensor scaled add.  Python passes raw addresses (ints), element
// counts and DataType codes (common/dtypes.h); no framework headers are used, so one build
// serves every torch/TensorFlow version.  The GIL is released while the kernels run.
//
// The same functions are exported with a plain C ABI (aiak_adasum_*, below) for frontends
// that do not go through Python.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "adasum/adasum.h"
#include "adasum/scalar_ops.h"

namespace py = pybind11;

namespace aiak_adasum {
namespace {

// ------------------------------------------------------------------------ portable kernels
template <typename T>
void dot_plain(const void* pa, const void* pb, int64_t n, double* out) {
  double s[3] = {0.0, 0.0, 0.0};
  dot_tail(static_cast<const T*>(pa), static_cast<const T*>(pb), 0, n, s[0], s[1], s[2]);
  out[0] = s[0], out[1] = s[1], out[2] = s[2];
}

void dot_f16(const void* pa, const void* pb, int64_t n, double* out) {
  double s[3] = {0.0, 0.0, 0.0};
  dot_tail_f16(static_cast<const uint16_t*>(pa), static_cast<const uint16_t*>(pb), 0, n, s[0],
               s[1], s[2]);
  out[0] = s[0], out[1] = s[1], out[2] = s[2];
}

void dot_bf16(const void* pa, const void* pb, int64_t n, double* out) {
  double s[3] = {0.0, 0.0, 0.0};
  dot_tail_bf16(static_cast<const uint16_t*>(pa), static_cast<const uint16_t*>(pb), 0, n, s[0],
                s[1], s[2]);
  out[0] = s[0], out[1] = s[1], out[2] = s[2];
}

template <typename T>
void axpby_plain(void* pa, const void* pb, int64_t n, double ca, double cb) {
  axpby_tail(static_cast<T*>(pa), static_cast<const T*>(pb), 0, n, ca, cb);
}

void axpby_f16(void* pa, const void* pb, int64_t n, double ca, double cb) {
  axpby_tail_f16(static_cast<uint16_t*>(pa), static_cast<const uint16_t*>(pb), 0, n,
                 static_cast<float>(ca), static_cast<float>(cb));
}

void axpby_bf16(void* pa, const void* pb, int64_t n, double ca, double cb) {
  axpby_tail_bf16(static_cast<uint16_t*>(pa), static_cast<const uint16_t*>(pb), 0, n,
                  static_cast<float>(ca), static_cast<float>(cb));
}

Kernels make_scalar() {
  Kernels k{};
  k.isa = "scalar";
  k.dot[FLOAT32] = dot_plain<float>, k.dot[FLOAT64] = dot_plain<double>;
  k.dot[FLOAT16] = dot_f16, k.dot[BFLOAT16] = dot_bf16;
  k.axpby[FLOAT32] = axpby_plain<float>, k.axpby[FLOAT64] = axpby_plain<double>;
  k.axpby[FLOAT16] = axpby_f16, k.axpby[BFLOAT16] = axpby_bf16;
  return k;
}

// ------------------------------------------------------------------------------ ISA choice
bool has_avx512() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
         __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

bool has_avx2() {
#if defined(__x86_64__) || defined(_M_X64)
  __builtin_cpu_init();
  return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
         __builtin_cpu_supports("f16c");
#else
  return false;
#endif
}

const Kernels* by_name(const std::string& want) {
  if (want == "scalar") return scalar_kernels();
#if defined(__x86_64__) || defined(_M_X64)
  if (want == "avx2") {
    if (!has_avx2()) throw std::invalid_argument("this CPU lacks AVX2/FMA/F16C");
    return avx2_kernels();
  }
  if (want == "avx512") {
    if (!has_avx512()) throw std::invalid_argument("this CPU lacks AVX-512");
    return avx512_kernels();
  }
#endif
  throw std::invalid_argument("unknown Adasum kernel ISA '" + want +
                              "' (expected scalar, avx2 or avx512)");
}

// AIAK_ADASUM_ISA=scalar|avx2|avx512 pins an implementation (tests compare them); otherwise
// the widest the CPU supports.
const Kernels* detect() {
  const char* env = std::getenv("AIAK_ADASUM_ISA");
  if (env != nullptr && *env != '\0') return by_name(env);
#if defined(__x86_64__) || defined(_M_X64)
  if (has_avx512()) return avx512_kernels();
  if (has_avx2()) return avx2_kernels();
#endif
  return scalar_kernels();
}

const Kernels*& active() {
  static const Kernels* k = detect();
  return k;
}

void check_dtype(int dtype) {
  if (dtype != FLOAT16 && dtype != BFLOAT16 && dtype != FLOAT32 && dtype != FLOAT64)
    throw std::invalid_argument("Adasum kernels take float16, bfloat16, float32 or float64 "
                                "(DataType code " + std::to_string(dtype) + ")");
}

// Horovod's rule: a tensor whose squared norm is below 1e-8 keeps coefficient 1 on both
// sides, so a (near-)zero contribution is added rather than divided by ~0.
constexpr double kMinNormSq = 1e-8;

void coefficients(double ab, double aa, double bb, double& ca, double& cb) {
  ca = aa >= kMinNormSq ? 1.0 - ab / aa * 0.5 : 1.0;
  cb = bb >= kMinNormSq ? 1.0 - ab / bb * 0.5 : 1.0;
}

// Per-segment sums for consecutive segments of `counts` elements of a and b, written as
// [a.b, |left|^2, |right|^2] per segment, where "left" is a if a_is_left, else b.  The
// left/right order lets both partners of a pair add their partial sums in one allreduce.
void segment_dots(uintptr_t a, uintptr_t b, const std::vector<int64_t>& counts, int dtype,
                  double* out, bool a_is_left) {
  const Kernels* k = active();
  const int item = aiak::itemsize(dtype);
  int64_t off = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    double s[3] = {0.0, 0.0, 0.0};
    if (counts[t] > 0)
      k->dot[dtype](reinterpret_cast<const void*>(a + off * item),
                    reinterpret_cast<const void*>(b + off * item), counts[t], s);
    out[3 * t] = s[0];
    out[3 * t + 1] = a_is_left ? s[1] : s[2];
    out[3 * t + 2] = a_is_left ? s[2] : s[1];
    off += counts[t];
  }
}

// a <- ca a + cb b per segment, with each segment's coefficients from its full-vector sums
// (layout of segment_dots).
void segment_combine(uintptr_t a, uintptr_t b, const std::vector<int64_t>& counts, int dtype,
                     const double* sums, bool a_is_left) {
  const Kernels* k = active();
  const int item = aiak::itemsize(dtype);
  int64_t off = 0;
  for (size_t t = 0; t < counts.size(); ++t) {
    const double ab = sums[3 * t];
    const double aa = a_is_left ? sums[3 * t + 1] : sums[3 * t + 2];
    const double bb = a_is_left ? sums[3 * t + 2] : sums[3 * t + 1];
    double ca, cb;
    coefficients(ab, aa, bb, ca, cb);
    if (counts[t] > 0)
      k->axpby[dtype](reinterpret_cast<void*>(a + off * item),
                      reinterpret_cast<const void*>(b + off * item), counts[t], ca, cb);
    off += counts[t];
  }
}

}  // namespace

const Kernels* scalar_kernels() {
  static const Kernels k = make_scalar();
  return &k;
}

}  // namespace aiak_adasum

// ---- C ABI ------------------------------------------------------------------------------
// Return 0 on success, -1 for a dtype the kernels do not take.
extern "C" {

// out[0..2] = a.b, |a|^2, |b|^2 over n elements of dtype, in float64.
__attribute__((visibility("default"))) int aiak_adasum_dot_norms(const void* a, const void* b,
                                                                 int64_t n, int32_t dtype,
                                                                 double* out) {
  using namespace aiak_adasum;
  if (dtype != FLOAT16 && dtype != BFLOAT16 && dtype != FLOAT32 && dtype != FLOAT64) return -1;
  active()->dot[dtype](a, b, n, out);
  return 0;
}

// a <- (1 - ab/(2 aa)) a + (1 - ab/(2 bb)) b over n elements (Horovod's 1e-8 norm rule).
__attribute__((visibility("default"))) int aiak_adasum_combine(void* a, const void* b, int64_t n,
                                                               int32_t dtype, double ab,
                                                               double aa, double bb) {
  using namespace aiak_adasum;
  if (dtype != FLOAT16 && dtype != BFLOAT16 && dtype != FLOAT32 && dtype != FLOAT64) return -1;
  double ca, cb;
  coefficients(ab, aa, bb, ca, cb);
  active()->axpby[dtype](a, b, n, ca, cb);
  return 0;
}

}  // extern "C"

PYBIND11_MODULE(_adasum_cpu, m) {
  using namespace aiak_adasum;
  m.doc() = "Adasum dot products and scaled adds on raw CPU buffers";
  m.def("isa", []() { return std::string(active()->isa); },
        "The kernel implementation in use: scalar, avx2 or avx512.");
  m.def("set_isa", [](const std::string& name) { active() = by_name(name); },
        "Pin an implementation (tests compare them).");
  m.def("supported_isas", []() {
    std::vector<std::string> out{"scalar"};
    if (has_avx2()) out.push_back("avx2");
    if (has_avx512()) out.push_back("avx512");
    return out;
  });
  m.def("dot_norms", [](uintptr_t a, uintptr_t b, int64_t n, int dtype) {
    check_dtype(dtype);
    double s[3];
    {
      py::gil_scoped_release nogil;
      active()->dot[dtype](reinterpret_cast<const void*>(a), reinterpret_cast<const void*>(b), n, s);
    }
    return py::make_tuple(s[0], s[1], s[2]);
  }, "(a.b, |a|^2, |b|^2) of n elements at addresses a and b, summed in float64.");
  m.def("axpby", [](uintptr_t a, uintptr_t b, int64_t n, int dtype, double ca, double cb) {
    check_dtype(dtype);
    py::gil_scoped_release nogil;
    active()->axpby[dtype](reinterpret_cast<void*>(a), reinterpret_cast<const void*>(b), n, ca, cb);
  }, "a[i] = ca * a[i] + cb * b[i] in place.");
  m.def("segment_dots", [](uintptr_t a, uintptr_t b, const std::vector<int64_t>& counts, int dtype,
                           uintptr_t out, bool a_is_left) {
    check_dtype(dtype);
    py::gil_scoped_release nogil;
    segment_dots(a, b, counts, dtype, reinterpret_cast<double*>(out), a_is_left);
  }, "Per-segment [a.b, |left|^2, |right|^2] (float64) into 3*len(counts) doubles at out.");
  m.def("segment_combine", [](uintptr_t a, uintptr_t b, const std::vector<int64_t>& counts,
                              int dtype, uintptr_t sums, bool a_is_left) {
    check_dtype(dtype);
    py::gil_scoped_release nogil;
    segment_combine(a, b, counts, dtype, reinterpret_cast<const double*>(sums), a_is_left);
  }, "Per-segment Adasum combination a <- ca a + cb b from summed segment_dots.");
}
