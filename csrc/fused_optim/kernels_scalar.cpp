// Portable scalar kernels (baseline ISA).  Used on machines without AVX2/FMA/F16C, for fp64
// params on every machine, and for testing the SIMD paths against.
#include <cstring>

#include "common/half.h"
#include "fused_optim/fused_optim.h"

namespace aiak_fo {
namespace {

#include "fused_optim/scalar_ops.h"

struct PortableHalf {
  static float load(const uint16_t* p) { return aiak::half_to_float(*p); }
  static void store(uint16_t* p, float v) { *p = aiak::float_to_half(v); }
};

using SO = ScalarOps<float, PortableHalf>;
using DO = ScalarOps<double, PortableHalf>;
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
