// Element-wise kernels of csrc/native/ops.cpp that other native code (the engine in
// csrc/engine/) calls directly, without going through Python.
#pragma once
#include <cstdint>

#include "common/dtypes.h"

namespace aiak {

// Types scale_into() accepts: every numeric type (bool has no meaningful scale).
inline bool scalable(int dtype) { return dtype != BOOL && itemsize(dtype) != 0; }

// dst[i] = src[i] * factor with Horovod's ScaleBuffer arithmetic; src may equal dst.
void scale_into(uintptr_t src, uintptr_t dst, int64_t n, int dtype, double factor);

// dst[i] = op(dst[i], src[i]) for ReduceOp `op` (Average reduces as Sum).
void reduce_into(uintptr_t src, uintptr_t dst, int64_t n, int dtype, int op);

}  // namespace aiak
