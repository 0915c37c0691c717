// Adasum combination kernels for CPU: shared declarations.
//
// Adasum (Maleki et al., "Scaling Distributed Training with Adaptive Summation", MLSys 2021)
// combines two gradients a and b as
//     a' = (1 - a.b / (2 |a|^2)) a + (1 - a.b / (2 |b|^2)) b
// The two passes over the data are (1) a.b, |a|^2 and |b|^2, accumulated in float64 whatever
// the element type, and (2) the scaled add a <- ca * a + cb * b.  No framework headers: Python
// (aiak_training/allreduce/adasum.py) hands over raw addresses, element counts and DataType
// codes.  One implementation per ISA (kernels_avx2.cpp, kernels_avx512.cpp, and the portable
// one in module.cpp); module.cpp picks one at run time with __builtin_cpu_supports.
//
// Rounding contract, identical in every ISA so results do not depend on the machine:
//  * float64: ca * a + cb * b in double (two products, one add; no FMA).
//  * float32: the same in double, rounded to float once.
//  * float16 / bfloat16: in float32 with the coefficients rounded to float32 (two products,
//    one add; no FMA), rounded to the half type once (nearest even).
// The dot products are summed in a different order per ISA (vector lanes), which only moves
// the float64 sums by a few ulps.
#pragma once

#include <cstdint>

#include "common/dtypes.h"

namespace aiak_adasum {

using aiak::BFLOAT16;
using aiak::FLOAT16;
using aiak::FLOAT32;
using aiak::FLOAT64;

// out[0] = a.b, out[1] = |a|^2, out[2] = |b|^2 over n elements, in float64.
using DotFn = void (*)(const void* a, const void* b, int64_t n, double* out);
// a[i] = ca * a[i] + cb * b[i] (see the rounding contract above).
using AxpbyFn = void (*)(void* a, const void* b, int64_t n, double ca, double cb);

struct Kernels {
  const char* isa;
  DotFn dot[aiak::kNumDataTypes];
  AxpbyFn axpby[aiak::kNumDataTypes];
};

const Kernels* scalar_kernels();
const Kernels* avx2_kernels();
const Kernels* avx512_kernels();

}  // namespace aiak_adasum
