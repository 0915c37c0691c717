// Fused optimizer kernels for CPU: shared declarations.
//
// Nothing here includes framework headers.  Python hands over raw data pointers (as ints),
// element counts and a dtype code; the kernels read every element of param, grad and the
// optimizer states once and write each once.
//
// Each ISA translation unit (kernels_scalar.cpp, kernels_avx2.cpp, kernels_avx512.cpp)
// instantiates the same kernel templates (kernels_impl.h) inside its own namespace and exports
// only a table of function pointers, so no ISA-specific code can leak into another TU through
// the linker's deduplication of inline functions.
#pragma once

#include <cstdint>

#include "common/dtypes.h"

namespace aiak_fo {

// Parameter dtypes are the shared DataType codes (common/dtypes.h); kernel tables are
// indexed by them and hold entries for these four only.
using aiak::BFLOAT16;
using aiak::FLOAT16;
using aiak::FLOAT32;
using aiak::FLOAT64;
using aiak::kNumDataTypes;

// Per-call Adam/AdamW scalars.  Host code computes them in double, exactly as torch.optim
// computes its Python-float scalars; the kernel casts them to its math type.
struct AdamArgs {
  double beta1, beta2, eps, weight_decay;
  double lerp_weight;  // 1 - beta1
  double one_minus_beta2;
  double step_size;    // lr / (1 - beta1^t)   (per tensor)
  double bc2_sqrt;     // sqrt(1 - beta2^t)    (per tensor)
  double decay;        // 1 - lr * weight_decay (AdamW)
  double inv_scale;    // 1 / grad_scale
  bool adamw, amsgrad, maximize, unscale;
};

// Pointers of one tensor for Adam.  States are float (double for fp64 params).
// master is an fp32 copy of a low-precision param, or null.
struct AdamPtrs {
  void* p;
  void* g;
  void* m;
  void* v;
  void* vmax;    // null unless amsgrad
  void* master;  // null unless master weights
};

struct SgdArgs {
  double lr, momentum, dampening, weight_decay, inv_scale;
  bool nesterov, maximize, unscale;
};

struct SgdPtrs {
  void* p;
  void* g;
  void* buf;     // null when momentum == 0
  void* master;
  bool first;    // momentum buffer is initialised from the gradient on this step
};

// LAMB, following the LAMB paper (You et al., 2019) and Apex's FusedLAMB.
struct LambArgs {
  double beta1, beta2, beta3, eps, weight_decay;
  double bc1, bc2;     // bias corrections (per tensor; 1 when disabled)
  double grad_factor;  // 1 / (grad_scale * clip), applied to the gradient
  double inv_scale;    // 1 / grad_scale, for storing the unscaled gradient back
  double ratio;        // stage 2 only: lr * trust ratio (per tensor)
  bool adam_w_mode, unscale;
};

struct LambPtrs {
  void* p;
  void* g;
  void* m;
  void* v;
  void* master;
};

using AdamFn = void (*)(const AdamArgs&, const AdamPtrs&, int64_t begin, int64_t end);
using SgdFn = void (*)(const SgdArgs&, const SgdPtrs&, int64_t begin, int64_t end);
// Stage 1 updates m and v and returns sum(p^2) and sum(update^2) over [begin, end).
using Lamb1Fn = void (*)(const LambArgs&, const LambPtrs&, int64_t begin, int64_t end,
                         double* p_sq, double* u_sq);
// Stage 2 recomputes the update from m, v, p and applies it with the trust ratio.
using Lamb2Fn = void (*)(const LambArgs&, const LambPtrs&, int64_t begin, int64_t end);
using SumSqFn = double (*)(const void* x, int64_t begin, int64_t end);

struct KernelTable {
  const char* name;
  AdamFn adam[kNumDataTypes];
  SgdFn sgd[kNumDataTypes];
  Lamb1Fn lamb1[kNumDataTypes];
  Lamb2Fn lamb2[kNumDataTypes];
  SumSqFn sumsq[kNumDataTypes];
};

// Exported by the ISA translation units.  A null entry means "use the scalar table".
const KernelTable* scalar_table();
#if defined(__x86_64__) || defined(_M_X64) || defined(__i386__)
const KernelTable* avx2_table();
const KernelTable* avx512_table();
#endif

}  // namespace aiak_fo
