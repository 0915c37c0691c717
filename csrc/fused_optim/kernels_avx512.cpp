// AVX-512 (F/BW/VL/DQ) kernels, 16 floats per register.  Built with AVX-512 flags by
// setup.py and only called after __builtin_cpu_supports says the machine has them.
// Same rule as kernels_avx2.cpp: intrinsics and builtins only, no non-static inline code.
// GCC 12's AVX-512 headers build many intrinsics on _mm512_undefined_*(), which trips
// -W(maybe-)uninitialized false positives (GCC bug 105593); silence them for this TU only.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#include <immintrin.h>

#include <cstring>

#include "common/half.h"
#include "fused_optim/fused_optim.h"

namespace aiak_fo {
namespace {

#include "fused_optim/scalar_ops_f16c.h"

struct VO {
  using T = float;
  using V = __m512;
  static constexpr int W = 16;
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static void store(float* p, V v) { _mm512_storeu_ps(p, v); }
  static V set1(float x) { return _mm512_set1_ps(x); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V sub(V a, V b) { return _mm512_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm512_mul_ps(a, b); }
  static V div(V a, V b) { return _mm512_div_ps(a, b); }
  static V sqrt(V a) { return _mm512_sqrt_ps(a); }
  static V max(V a, V b) { return _mm512_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  static V neg(V a) {
    return _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(a), _mm512_set1_epi32(int(0x80000000u))));
  }
  struct S {
    __m512d lo, hi;  // squares of lanes 0-7 and 8-15, in double
  };
  static S sq_zero() { return {_mm512_setzero_pd(), _mm512_setzero_pd()}; }
  static S add_sq(S s, V a) {
    const __m512d lo = _mm512_cvtps_pd(_mm512_extractf32x8_ps(a, 0));
    const __m512d hi = _mm512_cvtps_pd(_mm512_extractf32x8_ps(a, 1));
    return {_mm512_fmadd_pd(lo, lo, s.lo), _mm512_fmadd_pd(hi, hi, s.hi)};
  }
  static double sq_total(S s) {
    // Fixed pairwise order (not _mm512_reduce_add_pd, whose order is compiler-defined).  Via
    // memory because GCC 12's 512->256 casts trip -Wuninitialized; this runs once per chunk.
    alignas(64) double x[8];
    _mm512_store_pd(x, _mm512_add_pd(s.lo, s.hi));
    for (int w = 4; w >= 1; w /= 2) {
      for (int i = 0; i < w; ++i) x[i] += x[i + w];
    }
    return x[0];
  }
  static V load_bf16(const uint16_t* p) {
    __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
    return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, V v) {
    __m512i x = _mm512_castps_si512(v);
    __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(x, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    r = _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(r));
  }
  static V load_f16(const uint16_t* p) {
    return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  }
  static void store_f16(uint16_t* p, V v) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                        _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
  }
};

#include "fused_optim/kernels_impl.h"

}  // namespace

const KernelTable* avx512_table() {
  static const KernelTable table = make_table("avx512");
  return &table;
}

}  // namespace aiak_fo
