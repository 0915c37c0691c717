// AVX2 candidate scan (8 floats per register).  Built with -mavx2 by setup.py and only called
// after __builtin_cpu_supports("avx2") says the machine has it.  Intrinsics and builtins only
// (see scan_avx512.cpp).
#include <immintrin.h>

#include "dgc/dgc.h"

namespace aiak_dgc {

int64_t scan_f32_avx2(const float* x, int64_t n, float t, int32_t* out, int64_t cap) {
  const __m256 vt = _mm256_set1_ps(t);
  const __m256 absmask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
  int64_t count = 0;
  int64_t i = 0;
  for (; i + 32 <= n; i += 32) {
    const unsigned m0 = unsigned(_mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), absmask), vt, _CMP_GE_OQ)));
    const unsigned m1 = unsigned(_mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i + 8), absmask), vt, _CMP_GE_OQ)));
    const unsigned m2 = unsigned(_mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i + 16), absmask), vt, _CMP_GE_OQ)));
    const unsigned m3 = unsigned(_mm256_movemask_ps(
        _mm256_cmp_ps(_mm256_and_ps(_mm256_loadu_ps(x + i + 24), absmask), vt, _CMP_GE_OQ)));
    unsigned m = m0 | (m1 << 8) | (m2 << 16) | (m3 << 24);
    while (m != 0) {  // hits are rare: walk the set bits
      out[count++] = int32_t(i + __builtin_ctz(m));
      m &= m - 1;
    }
    if (count > cap) return cap + 1;
  }
  for (; i < n; ++i) {
    float a = x[i];
    a = a < 0.0f ? -a : a;
    if (a >= t) {
      out[count++] = int32_t(i);
      if (count > cap) return cap + 1;
    }
  }
  return count;
}

}  // namespace aiak_dgc
