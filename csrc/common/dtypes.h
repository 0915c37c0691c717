// Element types and reduce ops: one numbering for every extension in csrc/ (native,
// fused_optim, dgc, and the CUDA library's host code) and for aiak_training/common/dtypes.py.
// It is Horovod's DataType / ReduceOp numbering, extended with BOOL and BFLOAT16.
//
// Plain C++17, no library calls, so nvcc compiles it too.  Functions are static (see half.h
// for why a header included by ISA-specific translation units must not share inline code).
#pragma once

namespace aiak {

enum DataType : int {
  UINT8 = 0, INT8 = 1, UINT16 = 2, INT16 = 3, INT32 = 4, INT64 = 5,
  FLOAT16 = 6, FLOAT32 = 7, FLOAT64 = 8, BOOL = 9, BFLOAT16 = 10,
};
constexpr int kNumDataTypes = 11;

enum ReduceOp : int { AVERAGE = 0, SUM = 1, ADASUM = 2, MIN = 3, MAX = 4, PRODUCT = 5 };

// Bytes per element; 0 for a code that is not a DataType.
static constexpr int itemsize(int dtype) {
  switch (dtype) {
    case UINT8: case INT8: case BOOL: return 1;
    case UINT16: case INT16: case FLOAT16: case BFLOAT16: return 2;
    case INT32: case FLOAT32: return 4;
    case INT64: case FLOAT64: return 8;
    default: return 0;
  }
}

}  // namespace aiak
