// Per-element Adasum arithmetic shared by every ISA's tail loop and by the portable kernels,
// so a vector body and its tail round the same way (the contract in adasum.h).  Static
// inline: see common/half.h for why headers included by ISA-specific units must not share
// inline code through the linker.
#pragma once

#include <cstdint>

#include "common/half.h"

namespace aiak_adasum {

static inline double load_f64(const double* p, int64_t i) { return p[i]; }
static inline double load_f64(const float* p, int64_t i) { return static_cast<double>(p[i]); }

static inline void dot_tail_f16(const uint16_t* a, const uint16_t* b, int64_t i, int64_t n,
                                double& ab, double& aa, double& bb) {
  for (; i < n; ++i) {
    const double x = aiak::half_to_float(a[i]), y = aiak::half_to_float(b[i]);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
}

static inline void dot_tail_bf16(const uint16_t* a, const uint16_t* b, int64_t i, int64_t n,
                                 double& ab, double& aa, double& bb) {
  for (; i < n; ++i) {
    const double x = aiak::bf16_to_float(a[i]), y = aiak::bf16_to_float(b[i]);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
}

template <typename T>
static inline void dot_tail(const T* a, const T* b, int64_t i, int64_t n, double& ab, double& aa,
                            double& bb) {
  for (; i < n; ++i) {
    const double x = load_f64(a, i), y = load_f64(b, i);
    ab += x * y;
    aa += x * x;
    bb += y * y;
  }
}

// float32 and float64: computed in double, rounded to T once.
template <typename T>
static inline void axpby_tail(T* a, const T* b, int64_t i, int64_t n, double ca, double cb) {
  for (; i < n; ++i) {
    const double pa = ca * static_cast<double>(a[i]);
    const double pb = cb * static_cast<double>(b[i]);
    a[i] = static_cast<T>(pa + pb);
  }
}

// Half types: in float with float coefficients, rounded to the half type once.
static inline void axpby_tail_f16(uint16_t* a, const uint16_t* b, int64_t i, int64_t n, float ca,
                                  float cb) {
  for (; i < n; ++i) {
    const float pa = ca * aiak::half_to_float(a[i]);
    const float pb = cb * aiak::half_to_float(b[i]);
    a[i] = aiak::float_to_half(pa + pb);
  }
}

static inline void axpby_tail_bf16(uint16_t* a, const uint16_t* b, int64_t i, int64_t n,
                                   float ca, float cb) {
  for (; i < n; ++i) {
    const float pa = ca * aiak::bf16_to_float(a[i]);
    const float pb = cb * aiak::bf16_to_float(b[i]);
    a[i] = aiak::float_to_bf16(pa + pb);
  }
}

}  // namespace aiak_adasum
