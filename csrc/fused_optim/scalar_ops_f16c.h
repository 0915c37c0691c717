// The scalar ops of the translation units built with F16C (AVX2, AVX-512): float16 goes
// through the F16C instructions.  Included inside each TU's anonymous namespace.
#pragma once

#include "fused_optim/scalar_ops.h"

struct F16cHalf {
  static float load(const uint16_t* p) { return _cvtsh_ss(*p); }
  static void store(uint16_t* p, float v) { *p = _cvtss_sh(v, _MM_FROUND_TO_NEAREST_INT); }
};

using SO = ScalarOps<float, F16cHalf>;
