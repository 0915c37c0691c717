// Deep gradient compression (DGC) kernels for CPU: shared declarations.
//
// No framework headers: Python hands over raw data pointers (as ints), element counts and
// DataType codes.  The threshold scan, the only pass over a whole gradient tensor, has one
// implementation per ISA (scan_avx2.cpp, scan_avx512.cpp, and the portable one in
// module.cpp); module.cpp picks one at run time with __builtin_cpu_supports.
#pragma once

#include <cstdint>

#include "common/dtypes.h"

namespace aiak_dgc {

// dtype codes are the shared DataType codes (common/dtypes.h): float32 and float64 tensors,
// and float16 values on the wire.
using aiak::FLOAT16;
using aiak::FLOAT32;
using aiak::FLOAT64;

// Scan for candidates: writes, in ascending order, the indices i in [0, n) with
// |x[i]| >= t to `out`.  Requires t > 0 (so zeros and NaNs are never written).
// Returns the number of such indices, or cap + 1 as soon as more than `cap` exist
// (the scan then stops early).  `out` must have room for cap + 32 entries: the vector
// kernels store up to 32 indices past the cap before they check it.
using ScanF32 = int64_t (*)(const float* x, int64_t n, float t, int32_t* out, int64_t cap);

int64_t scan_f32_avx2(const float* x, int64_t n, float t, int32_t* out, int64_t cap);
int64_t scan_f32_avx512(const float* x, int64_t n, float t, int32_t* out, int64_t cap);

}  // namespace aiak_dgc
