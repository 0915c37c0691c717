// Portable scalar kernels (baseline ISA).  Used on machines without AVX2/FMA/F16C, for fp64
// params on every machine, and for testing the SIMD paths against.
#include <cmath>
#include <cstring>

#include "common/half.h"
#include "fused_optim/fused_optim.h"

namespace aiak_fo {
namespace {

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
  static V sqrt(V a) { return std::sqrt(a); }
  static V max(V a, V b) { return a > b ? a : b; }  // same NaN behaviour as (v)maxps
  // Exact fused multiply-add, so the scalar path rounds like the SIMD paths do.
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V neg(V a) { return -a; }
  using S = double;
  static S sq_zero() { return 0.0; }
  static S add_sq(S s, V a) { return s + double(a) * double(a); }  // the square is exact
  static double sq_total(S s) { return s; }
  static V load_bf16(const uint16_t* p) { return aiak::bf16_to_float(*p); }
  static void store_bf16(uint16_t* p, V v) { *p = aiak::float_to_bf16(v); }
  static V load_f16(const uint16_t* p) { return aiak::half_to_float(*p); }
  static void store_f16(uint16_t* p, V v) { *p = aiak::float_to_half(v); }
};

struct DO {
  using T = double;
  using V = double;
  static constexpr int W = 1;
  static V load(const double* p) { return *p; }
  static void store(double* p, V v) { *p = v; }
  static V set1(double x) { return x; }
  static V add(V a, V b) { return a + b; }
  static V sub(V a, V b) { return a - b; }
  static V mul(V a, V b) { return a * b; }
  static V div(V a, V b) { return a / b; }
  static V sqrt(V a) { return std::sqrt(a); }
  static V max(V a, V b) { return a > b ? a : b; }
  static V fma(V a, V b, V c) { return std::fma(a, b, c); }
  static V neg(V a) { return -a; }
  using S = double;
  static S sq_zero() { return 0.0; }
  static S add_sq(S s, V a) { return std::fma(a, a, s); }
  static double sq_total(S s) { return s; }
};

using VO = SO;
#define AIAK_WITH_F64 1
#include "fused_optim/kernels_impl.h"
#undef AIAK_WITH_F64

}  // namespace

const KernelTable* scalar_table() {
  static const KernelTable table = make_table("scalar");
  return &table;
}

}  // namespace aiak_fo
