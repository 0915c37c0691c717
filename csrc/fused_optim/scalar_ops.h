// Scalar ops (W == 1) in float or double: kernels_scalar.cpp's float and double paths and the
// tails of the AVX translation units.  Included inside each TU's anonymous namespace, so every
// TU keeps its own copy compiled with its own ISA flags (see kernels_avx2.cpp on why nothing
// may be shared inline); hence builtins, not <cmath>.  Half says how float16 is loaded and
// stored: with F16C where the TU is built with it, with the portable conversion otherwise (the
// same bits).  The low-precision loads and stores exist for float only.
#pragma once

template <class Math, class Half>
struct ScalarOps {
  using T = Math;
  using V = Math;
  static constexpr bool kFloat = sizeof(Math) == 4;
  static constexpr int W = 1;
  static V load(const T* p) { return *p; }
  static void store(T* p, V v) { *p = v; }
  static V set1(T x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) {
    if constexpr (kFloat) return __builtin_sqrtf(a); else return __builtin_sqrt(a);
  }
  static V max(V a, V b) { return a > b ? a : b; }  // same NaN behaviour as (v)maxps
  // Exact fused multiply-add, so scalar code rounds like the SIMD paths do.
  static V fma(V a, V b, V c) {
    if constexpr (kFloat) return __builtin_fmaf(a, b, c); else return __builtin_fma(a, b, c);
  }
  static V neg(V a) { return -a; }
  using S = double;
  static S sq_zero() { return 0.0; }
  static S add_sq(S s, V a) {  // a float's square is exact in double
    if constexpr (kFloat) return s + double(a) * double(a); else return __builtin_fma(a, a, s);
  }
  static double sq_total(S s) { return s; }
  static V load_bf16(const uint16_t* p) { return aiak::bf16_to_float(*p); }
  static void store_bf16(uint16_t* p, V v) { *p = aiak::float_to_bf16(v); }
  static V load_f16(const uint16_t* p) { return Half::load(p); }
  static void store_f16(uint16_t* p, V v) { Half::store(p, v); }
};
