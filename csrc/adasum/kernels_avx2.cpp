// AVX2 Adasum kernels (4 doubles / 8 floats per register).  Built with -mavx2 -mfma -mf16c by
// setup.py and only called after __builtin_cpu_supports says the machine has them.  The dot
// products widen every element to double before multiplying; the scaled add follows the
// rounding contract of adasum.h (no FMA there, so every ISA gives the same bits).
#include <immintrin.h>

#include "adasum/adasum.h"
#include "adasum/scalar_ops.h"

namespace aiak_adasum {
namespace {

inline double hsum(__m256d v) {
  __m128d lo = _mm256_castpd256_pd128(v), hi = _mm256_extractf128_pd(v, 1);
  lo = _mm_add_pd(lo, hi);
  return _mm_cvtsd_f64(_mm_add_sd(lo, _mm_unpackhi_pd(lo, lo)));
}

// Accumulates one block of 8 floats (as two 4-double halves) into the three sums.
inline void acc8(__m256 x, __m256 y, __m256d& ab, __m256d& aa, __m256d& bb) {
  const __m256d x0 = _mm256_cvtps_pd(_mm256_castps256_ps128(x));
  const __m256d x1 = _mm256_cvtps_pd(_mm256_extractf128_ps(x, 1));
  const __m256d y0 = _mm256_cvtps_pd(_mm256_castps256_ps128(y));
  const __m256d y1 = _mm256_cvtps_pd(_mm256_extractf128_ps(y, 1));
  ab = _mm256_fmadd_pd(x0, y0, _mm256_fmadd_pd(x1, y1, ab));
  aa = _mm256_fmadd_pd(x0, x0, _mm256_fmadd_pd(x1, x1, aa));
  bb = _mm256_fmadd_pd(y0, y0, _mm256_fmadd_pd(y1, y1, bb));
}

inline __m256 load_bf16(const uint16_t* p) {
  const __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
}

inline __m256 load_f16(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// float -> bfloat16, nearest even, NaN -> 0x7FC0 (as aiak::float_to_bf16).
inline void store_bf16(uint16_t* p, __m256 v) {
  const __m256i x = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
  __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
  r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
}

void dot_f32(const void* pa, const void* pb, int64_t n, double* out) {
  const float* a = static_cast<const float*>(pa);
  const float* b = static_cast<const float*>(pb);
  __m256d ab = _mm256_setzero_pd(), aa = _mm256_setzero_pd(), bb = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc8(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), ab, aa, bb);
  double s[3] = {hsum(ab), hsum(aa), hsum(bb)};
  dot_tail(a, b, i, n, s[0], s[1], s[2]);
  out[0] = s[0], out[1] = s[1], out[2] = s[2];
}

void dot_f64(const void* pa, const void* pb, int64_t n, double* out) {
  const double* a = static_cast<const double*>(pa);
  const double* b = static_cast<const double*>(pb);
  __m256d ab = _mm256_setzero_pd(), aa = _mm256_setzero_pd(), bb = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d x = _mm256_loadu_pd(a + i), y = _mm256_loadu_pd(b + i);
    ab = _mm256_fmadd_pd(x, y, ab);
    aa = _mm256_fmadd_pd(x, x, aa);
    bb = _mm256_fmadd_pd(y, y, bb);
  }
  double s[3] = {hsum(ab), hsum(aa), hsum(bb)};
  dot_tail(a, b, i, n, s[0], s[1], s[2]);
  out[0] = s[0], out[1] = s[1], out[2] = s[2];
}

void dot_f16(const void* pa, const void* pb, int64_t n, double* out) {
  const uint16_t* a = static_cast<const uint16_t*>(pa);
  const uint16_t* b = static_cast<const uint16_t*>(pb);
  __m256d ab = _mm256_setzero_pd(), aa = _mm256_setzero_pd(), bb = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc8(load_f16(a + i), load_f16(b + i), ab, aa, bb);
  double s[3] = {hsum(ab), hsum(aa), hsum(bb)};
  dot_tail_f16(a, b, i, n, s[0], s[1], s[2]);
  out[0] = s[0], out[1] = s[1], out[2] = s[2];
}

void dot_bf16(const void* pa, const void* pb, int64_t n, double* out) {
  const uint16_t* a = static_cast<const uint16_t*>(pa);
  const uint16_t* b = static_cast<const uint16_t*>(pb);
  __m256d ab = _mm256_setzero_pd(), aa = _mm256_setzero_pd(), bb = _mm256_setzero_pd();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) acc8(load_bf16(a + i), load_bf16(b + i), ab, aa, bb);
  double s[3] = {hsum(ab), hsum(aa), hsum(bb)};
  dot_tail_bf16(a, b, i, n, s[0], s[1], s[2]);
  out[0] = s[0], out[1] = s[1], out[2] = s[2];
}

void axpby_f64(void* pa, const void* pb, int64_t n, double ca, double cb) {
  double* a = static_cast<double*>(pa);
  const double* b = static_cast<const double*>(pb);
  const __m256d va = _mm256_set1_pd(ca), vb = _mm256_set1_pd(cb);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d x = _mm256_mul_pd(va, _mm256_loadu_pd(a + i));
    const __m256d y = _mm256_mul_pd(vb, _mm256_loadu_pd(b + i));
    _mm256_storeu_pd(a + i, _mm256_add_pd(x, y));
  }
  axpby_tail(a, b, i, n, ca, cb);
}

void axpby_f32(void* pa, const void* pb, int64_t n, double ca, double cb) {
  float* a = static_cast<float*>(pa);
  const float* b = static_cast<const float*>(pb);
  const __m256d va = _mm256_set1_pd(ca), vb = _mm256_set1_pd(cb);
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    const __m256d x = _mm256_mul_pd(va, _mm256_cvtps_pd(_mm_loadu_ps(a + i)));
    const __m256d y = _mm256_mul_pd(vb, _mm256_cvtps_pd(_mm_loadu_ps(b + i)));
    _mm_storeu_ps(a + i, _mm256_cvtpd_ps(_mm256_add_pd(x, y)));
  }
  axpby_tail(a, b, i, n, ca, cb);
}

void axpby_f16(void* pa, const void* pb, int64_t n, double ca, double cb) {
  uint16_t* a = static_cast<uint16_t*>(pa);
  const uint16_t* b = static_cast<const uint16_t*>(pb);
  const float fa = static_cast<float>(ca), fb = static_cast<float>(cb);
  const __m256 va = _mm256_set1_ps(fa), vb = _mm256_set1_ps(fb);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 r = _mm256_add_ps(_mm256_mul_ps(va, load_f16(a + i)),
                                   _mm256_mul_ps(vb, load_f16(b + i)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(a + i),
                     _mm256_cvtps_ph(r, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
  axpby_tail_f16(a, b, i, n, fa, fb);
}

void axpby_bf16(void* pa, const void* pb, int64_t n, double ca, double cb) {
  uint16_t* a = static_cast<uint16_t*>(pa);
  const uint16_t* b = static_cast<const uint16_t*>(pb);
  const float fa = static_cast<float>(ca), fb = static_cast<float>(cb);
  const __m256 va = _mm256_set1_ps(fa), vb = _mm256_set1_ps(fb);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    store_bf16(a + i, _mm256_add_ps(_mm256_mul_ps(va, load_bf16(a + i)),
                                    _mm256_mul_ps(vb, load_bf16(b + i))));
  }
  axpby_tail_bf16(a, b, i, n, fa, fb);
}

Kernels make() {
  Kernels k{};
  k.isa = "avx2";
  k.dot[FLOAT32] = dot_f32, k.dot[FLOAT64] = dot_f64, k.dot[FLOAT16] = dot_f16;
  k.dot[BFLOAT16] = dot_bf16;
  k.axpby[FLOAT32] = axpby_f32, k.axpby[FLOAT64] = axpby_f64, k.axpby[FLOAT16] = axpby_f16;
  k.axpby[BFLOAT16] = axpby_bf16;
  return k;
}

}  // namespace

const Kernels* avx2_kernels() {
  static const Kernels k = make();
  return &k;
}

}  // namespace aiak_adasum
