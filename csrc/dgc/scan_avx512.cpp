// AVX-512F candidate scan (16 floats per register).  Built with AVX-512 flags by setup.py
// and only called after __builtin_cpu_supports("avx512f") says the machine has it.
// Intrinsics and builtins only: no inline library code that the linker could share with the
// baseline translation unit (see csrc/fused_optim/kernels_avx2.cpp for the reason).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include "dgc/dgc.h"

namespace aiak_dgc {

int64_t scan_f32_avx512(const float* x, int64_t n, float t, int32_t* out, int64_t cap) {
  const __m512 vt = _mm512_set1_ps(t);
  const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int64_t count = 0;
  int64_t i = 0;
  // 64 elements per round: at the densities DGC uses almost every round has no hit, so the
  // common path is four compares and one test of the OR of their masks.
  for (; i + 64 <= n; i += 64) {
    __mmask16 ms[4];
    for (int q = 0; q < 4; ++q) {
      const __m512 a = _mm512_abs_ps(_mm512_loadu_ps(x + i + 16 * q));
      ms[q] = _mm512_cmp_ps_mask(a, vt, _CMP_GE_OQ);
    }
    if ((ms[0] | ms[1] | ms[2] | ms[3]) == 0) continue;
    for (int q = 0; q < 4; ++q) {
      if (ms[q] == 0) continue;
      const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(int32_t(i + 16 * q)), lane);
      _mm512_mask_compressstoreu_epi32(out + count, ms[q], idx);
      count += __builtin_popcount(unsigned(ms[q]));
      if (count > cap) return cap + 1;
    }
  }
  for (; i < n; ++i) {
    float a = x[i];
    a = a < 0.0f ? -a : a;  // no fabsf: keep library code out of this TU
    if (a >= t) {
      out[count++] = int32_t(i);
      if (count > cap) return cap + 1;
    }
  }
  return count;
}

}  // namespace aiak_dgc
