// AVX-512 Adasum kernels (8 doubles / 16 floats per register).  Built with the AVX-512 flags
// by setup.py and only called after __builtin_cpu_supports says the machine has them.  Same
// arithmetic as kernels_avx2.cpp (see adasum.h for the rounding contract).
// GCC 12's AVX-512 cast/extract intrinsics start from _mm512_undefined_*, which its own
// -Wuninitialized flags when inlined; the values are never read.
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>

#include "adasum/adasum.h"
#include "adasum/scalar_ops.h"

namespace aiak_adasum {
namespace {

// Horizontal sum of 8 doubles.  Spelled out because GCC 12's _mm512_reduce_add_pd trips its
// own -Wuninitialized warnings.
inline double hsum(__m512d v) {
  const __m256d q = _mm256_add_pd(_mm512_castpd512_pd256(v), _mm512_extractf64x4_pd(v, 1));
  __m128d lo = _mm_add_pd(_mm256_castpd256_pd128(q), _mm256_extractf128_pd(q, 1));
  return _mm_cvtsd_f64(_mm_add_sd(lo, _mm_unpackhi_pd(lo, lo)));
}

inline void acc16(__m512 x, __m512 y, __m512d& ab, __m512d& aa, __m512d& bb) {
  const __m512d x0 = _mm512_cvtps_pd(_mm512_castps512_ps256(x));
  const __m512d x1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(x), 1)));
  const __m512d y0 = _mm512_cvtps_pd(_mm512_castps512_ps256(y));
  const __m512d y1 = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(y), 1)));
  ab = _mm512_fmadd_pd(x0, y0, _mm512_fmadd_pd(x1, y1, ab));
  aa = _mm512_fmadd_pd(x0, x0, _mm512_fmadd_pd(x1, x1, aa));
  bb = _mm512_fmadd_pd(y0, y0, _mm512_fmadd_pd(y1, y1, bb));
}

inline __m512 load_bf16(const uint16_t* p) {
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}

inline __m512 load_f16(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// float -> bfloat16, nearest even, NaN -> 0x7FC0 (as aiak::float_to_bf16).
inline void store_bf16(uint16_t* p, __m512 v) {
  const __m512i x = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
}

template <typename Load, typename T>
void dot16(const T* a, const T* b, int64_t n, double* s, Load load, int64_t& i) {
  __m512d ab = _mm512_setzero_pd(), aa = _mm512_setzero_pd(), bb = _mm512_setzero_pd();
  for (; i + 16 <= n; i += 16) acc16(load(a + i), load(b + i), ab, aa, bb);
  s[0] = hsum(ab), s[1] = hsum(aa), s[2] = hsum(bb);
}

void dot_f32(const void* pa, const void* pb, int64_t n, double* out) {
  const float* a = static_cast<const float*>(pa);
  const float* b = static_cast<const float*>(pb);
  int64_t i = 0;
  dot16(a, b, n, out, [](const float* p) { return _mm512_loadu_ps(p); }, i);
  dot_tail(a, b, i, n, out[0], out[1], out[2]);
}

void dot_f16(const void* pa, const void* pb, int64_t n, double* out) {
  const uint16_t* a = static_cast<const uint16_t*>(pa);
  const uint16_t* b = static_cast<const uint16_t*>(pb);
  int64_t i = 0;
  dot16(a, b, n, out, load_f16, i);
  dot_tail_f16(a, b, i, n, out[0], out[1], out[2]);
}

void dot_bf16(const void* pa, const void* pb, int64_t n, double* out) {
  const uint16_t* a = static_cast<const uint16_t*>(pa);
  const uint16_t* b = static_cast<const uint16_t*>(pb);
  int64_t i = 0;
  dot16(a, b, n, out, load_bf16, i);
  dot_tail_bf16(a, b, i, n, out[0], out[1], out[2]);
}

void dot_f64(const void* pa, const void* pb, int64_t n, double* out) {
  const double* a = static_cast<const double*>(pa);
  const double* b = static_cast<const double*>(pb);
  __m512d ab = _mm512_setzero_pd(), aa = _mm512_setzero_pd(), bb = _mm512_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512d x = _mm512_loadu_pd(a + i), y = _mm512_loadu_pd(b + i);
    ab = _mm512_fmadd_pd(x, y, ab);
    aa = _mm512_fmadd_pd(x, x, aa);
    bb = _mm512_fmadd_pd(y, y, bb);
  }
  out[0] = hsum(ab), out[1] = hsum(aa);
  out[2] = hsum(bb);
  dot_tail(a, b, i, n, out[0], out[1], out[2]);
}

void axpby_f64(void* pa, const void* pb, int64_t n, double ca, double cb) {
  double* a = static_cast<double*>(pa);
  const double* b = static_cast<const double*>(pb);
  const __m512d va = _mm512_set1_pd(ca), vb = _mm512_set1_pd(cb);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512d x = _mm512_mul_pd(va, _mm512_loadu_pd(a + i));
    const __m512d y = _mm512_mul_pd(vb, _mm512_loadu_pd(b + i));
    _mm512_storeu_pd(a + i, _mm512_add_pd(x, y));
  }
  axpby_tail(a, b, i, n, ca, cb);
}

void axpby_f32(void* pa, const void* pb, int64_t n, double ca, double cb) {
  float* a = static_cast<float*>(pa);
  const float* b = static_cast<const float*>(pb);
  const __m512d va = _mm512_set1_pd(ca), vb = _mm512_set1_pd(cb);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m512d x = _mm512_mul_pd(va, _mm512_cvtps_pd(_mm256_loadu_ps(a + i)));
    const __m512d y = _mm512_mul_pd(vb, _mm512_cvtps_pd(_mm256_loadu_ps(b + i)));
    _mm256_storeu_ps(a + i, _mm512_cvtpd_ps(_mm512_add_pd(x, y)));
  }
  axpby_tail(a, b, i, n, ca, cb);
}

void axpby_f16(void* pa, const void* pb, int64_t n, double ca, double cb) {
  uint16_t* a = static_cast<uint16_t*>(pa);
  const uint16_t* b = static_cast<const uint16_t*>(pb);
  const float fa = static_cast<float>(ca), fb = static_cast<float>(cb);
  const __m512 va = _mm512_set1_ps(fa), vb = _mm512_set1_ps(fb);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512 r = _mm512_add_ps(_mm512_mul_ps(va, load_f16(a + i)),
                                   _mm512_mul_ps(vb, load_f16(b + i)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(a + i),
                        _mm512_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  axpby_tail_f16(a, b, i, n, fa, fb);
}

void axpby_bf16(void* pa, const void* pb, int64_t n, double ca, double cb) {
  uint16_t* a = static_cast<uint16_t*>(pa);
  const uint16_t* b = static_cast<const uint16_t*>(pb);
  const float fa = static_cast<float>(ca), fb = static_cast<float>(cb);
  const __m512 va = _mm512_set1_ps(fa), vb = _mm512_set1_ps(fb);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    store_bf16(a + i, _mm512_add_ps(_mm512_mul_ps(va, load_bf16(a + i)),
                                    _mm512_mul_ps(vb, load_bf16(b + i))));
  }
  axpby_tail_bf16(a, b, i, n, fa, fb);
}

Kernels make() {
  Kernels k{};
  k.isa = "avx512";
  k.dot[FLOAT32] = dot_f32, k.dot[FLOAT64] = dot_f64, k.dot[FLOAT16] = dot_f16;
  k.dot[BFLOAT16] = dot_bf16;
  k.axpby[FLOAT32] = axpby_f32, k.axpby[FLOAT64] = axpby_f64, k.axpby[FLOAT16] = axpby_f16;
  k.axpby[BFLOAT16] = axpby_bf16;
  return k;
}

}  // namespace

const Kernels* avx512_kernels() {
  static const Kernels k = make();
  return &k;
}

}  // namespace aiak_adasum
