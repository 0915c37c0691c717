// AVX2 + FMA + F16C kernels (8 floats per register).  Built with -mavx2 -mfma -mf16c by
// setup.py and only called after __builtin_cpu_supports says the machine has them.
//
// Nothing in this TU may emit a non-static inline function (e.g. from <cmath> or <vector>):
// the linker could pick this AVX2 copy for the baseline TU.  Hence intrinsics and builtins only.
#include <immintrin.h>

#include <cstring>

#include "common/half.h"
#include "fused_optim/fused_optim.h"

namespace aiak_fo {
namespace {

#include "fused_optim/scalar_ops_f16c.h"

struct VO {
  using T = float;
  using V = __m256;
  static constexpr int W = 8;
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, V v) { _mm256_storeu_ps(p, v); }
  static V set1(float x) { return _mm256_set1_ps(x); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static V sub(V a, V b) { return _mm256_sub_ps(a, b); }
  static V mul(V a, V b) { return _mm256_mul_ps(a, b); }
  static V div(V a, V b) { return _mm256_div_ps(a, b); }
  static V sqrt(V a) { return _mm256_sqrt_ps(a); }
  static V max(V a, V b) { return _mm256_max_ps(a, b); }
  static V fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  static V neg(V a) { return _mm256_xor_ps(a, _mm256_set1_ps(-0.0f)); }
  struct S {
    __m256d lo, hi;  // squares of lanes 0-3 and 4-7, in double
  };
  static S sq_zero() { return {_mm256_setzero_pd(), _mm256_setzero_pd()}; }
  static S add_sq(S s, V a) {
    const __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(a));
    const __m256d hi = _mm256_cvtps_pd(_mm256_extractf128_ps(a, 1));
    return {_mm256_fmadd_pd(lo, lo, s.lo), _mm256_fmadd_pd(hi, hi, s.hi)};
  }
  static double sq_total(S s) {
    alignas(32) double x[4];
    _mm256_store_pd(x, _mm256_add_pd(s.lo, s.hi));
    return (x[0] + x[1]) + (x[2] + x[3]);
  }
  static V load_bf16(const uint16_t* p) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
    return _mm256_castsi256_ps(_mm256_slli_epi32(w, 16));
  }
  static void store_bf16(uint16_t* p, V v) {
    __m256i x = _mm256_castps_si256(v);
    __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(x, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
    __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(v, v, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Values fit in 16 bits, so unsigned-saturating pack is exact; fix the lane interleave.
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static V load_f16(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store_f16(uint16_t* p, V v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};

#include "fused_optim/kernels_impl.h"

}  // namespace

const KernelTable* avx2_table() {
  static const KernelTable table = make_table("avx2");
  return &table;
}

}  // namespace aiak_fo
