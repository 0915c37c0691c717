// Scalar float ops for the translation units built with F16C (AVX2, AVX-512): their scalar
// tails.  Included inside each TU's anonymous namespace, so every TU keeps its own copy,
// compiled with its own ISA flags (see kernels_avx2.cpp on why nothing may be shared inline).
#pragma once

struct SO {
  using T = float;
  using V = float;
  static constexpr int W = 1;
  static V load(const float* p) { return *p; }
  static void store(float* p, V v) { *p = v; }
  static V set1(float x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return __builtin_sqrtf(a); }
  static V max(V a, V b) { return a > b ? a : b; }
  static V fma(V a, V b, V c) { return __builtin_fmaf(a, b, c); }
  static V neg(V a) { return -a; }
  using S = double;
  static S sq_zero() { return 0.0; }
  static S add_sq(S s, V a) { return s + double(a) * double(a); }  // the square is exact
  static double sq_total(S s) { return s; }
  static V load_bf16(const uint16_t* p) { return aiak::bf16_to_float(*p); }
  static void store_bf16(uint16_t* p, V v) { *p = aiak::float_to_bf16(v); }
  static V load_f16(const uint16_t* p) { return _cvtsh_ss(*p); }
  static void store_f16(uint16_t* p, V v) { *p = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }
};
