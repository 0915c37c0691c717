// Fused multi-tensor optimizer kernels for CUDA (see aiak_fused_cuda.h for the C ABI).
//
// Multi-tensor apply: the host walks all tensors in 64K-element chunks; each chunk becomes one
// thread block.  Up to kMaxTensors tensors and kMaxBlocks chunks travel by value in one
// kernel-argument struct (CUDA >= 12.1 allows 32 KB of kernel arguments on sm_70+; it is read
// in place through __grid_constant__), so a ResNet-50 step needs only a couple of launches.
// Each element of param, grad and the states is loaded once and stored once.
//
// Arithmetic uses explicit round-to-nearest intrinsics (__fmaf_rn, __fdiv_rn, ...), so nvcc
// cannot contract or reassociate it: the update is the same expression, rounding for rounding,
// as the CPU kernels (csrc/fused_optim/kernels_impl.h), which mirror torch.optim's ATen ops.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>
#include <cstring>

#include "aiak_fused_cuda.h"
#include "common/dtypes.h"

namespace {

constexpr int kBlock = 512;
constexpr int kILP = 4;
constexpr int64_t kChunk = 65536;
constexpr int kMaxTensors = 160;
constexpr int kMaxBlocks = 1280;
constexpr int kDepth = 6;       // list slots: 0 param, 1 grad, 2 m/buf, 3 v, 4 vmax, 5 master
constexpr int kMaxSmall = 1024;  // tensors per launch of the per-tensor helper kernels

struct LaunchMeta {
  void* ptr[kDepth][kMaxTensors];
  float* step[kMaxTensors];
  int64_t numel[kMaxTensors];
  int64_t chunk_base[kMaxTensors];  // global index of the tensor's first chunk (LAMB partials)
  int index[kMaxTensors];           // position in the caller's arrays
  int flag[kMaxTensors];            // SGD: first step
  uint16_t block_tensor[kMaxBlocks];
  int block_chunk[kMaxBlocks];
};
static_assert(sizeof(LaunchMeta) < 30000, "kernel arguments must stay below 32 KB");

struct TensorMeta {  // per-tensor helper kernels (LAMB norm reduction, step counters)
  float* step[kMaxSmall];
  int64_t chunk_base[kMaxSmall];
  int nchunks[kMaxSmall];
  int index[kMaxSmall];
};
static_assert(sizeof(TensorMeta) < 30000, "kernel arguments must stay below 32 KB");

thread_local char g_last_error[512] = "";

int fail(cudaError_t err, const char* where) {
  std::snprintf(g_last_error, sizeof(g_last_error), "%s: %s", where, cudaGetErrorString(err));
  return int(err);
}

int fail_msg(const char* msg) {
  std::snprintf(g_last_error, sizeof(g_last_error), "%s", msg);
  return int(cudaErrorInvalidValue);
}

// ------------------------------------------------------------------------- exact arithmetic
__device__ __forceinline__ float add(float a, float b) { return __fadd_rn(a, b); }
__device__ __forceinline__ float sub(float a, float b) { return __fsub_rn(a, b); }
__device__ __forceinline__ float mul(float a, float b) { return __fmul_rn(a, b); }
__device__ __forceinline__ float dvd(float a, float b) { return __fdiv_rn(a, b); }
__device__ __forceinline__ float sqr(float a) { return __fsqrt_rn(a); }
__device__ __forceinline__ float fma_(float a, float b, float c) { return __fmaf_rn(a, b, c); }
__device__ __forceinline__ double add(double a, double b) { return __dadd_rn(a, b); }
__device__ __forceinline__ double sub(double a, double b) { return __dsub_rn(a, b); }
__device__ __forceinline__ double mul(double a, double b) { return __dmul_rn(a, b); }
__device__ __forceinline__ double dvd(double a, double b) { return __ddiv_rn(a, b); }
__device__ __forceinline__ double sqr(double a) { return __dsqrt_rn(a); }
__device__ __forceinline__ double fma_(double a, double b, double c) { return __fma_rn(a, b, c); }
// Same NaN behaviour as the CPU kernels' (v)maxps(a, b): b unless a > b.
template <typename T>
__device__ __forceinline__ T max_(T a, T b) { return a > b ? a : b; }

// --------------------------------------------------------------------- dtype conversions
template <typename PT> struct MathOf { using type = float; };
template <> struct MathOf<double> { using type = double; };

__device__ __forceinline__ float to_math(float x) { return x; }
__device__ __forceinline__ double to_math(double x) { return x; }
__device__ __forceinline__ float to_math(__half x) { return __half2float(x); }
__device__ __forceinline__ float to_math(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename PT> __device__ __forceinline__ PT from_math(typename MathOf<PT>::type x);
template <> __device__ __forceinline__ float from_math<float>(float x) { return x; }
template <> __device__ __forceinline__ double from_math<double>(double x) { return x; }
template <> __device__ __forceinline__ __half from_math<__half>(float x) { return __float2half_rn(x); }
template <> __device__ __forceinline__ __nv_bfloat16 from_math<__nv_bfloat16>(float x) {
  return __float2bfloat16_rn(x);
}

// ----------------------------------------------------------------------- vector load/store
template <typename T>
struct alignas(sizeof(T) * kILP) Pack {
  T v[kILP];
};

template <typename T>
__device__ __forceinline__ bool aligned_for_pack(const void* p) {
  return (reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kILP)) == 0;
}

// Loads kILP (vector path) or 1 element at i into registers (math type).
template <int N, typename T, typename M>
__device__ __forceinline__ void load(const T* base, int64_t i, M (&out)[kILP]) {
  if constexpr (N == kILP) {
    Pack<T> pk = *reinterpret_cast<const Pack<T>*>(base + i);
#pragma unroll
    for (int k = 0; k < kILP; ++k) out[k] = to_math(pk.v[k]);
  } else {
    out[0] = to_math(base[i]);
  }
}

template <int N, typename T, typename M>
__device__ __forceinline__ void store(T* base, int64_t i, const M (&in)[kILP]) {
  if constexpr (N == kILP) {
    Pack<T> pk;
#pragma unroll
    for (int k = 0; k < kILP; ++k) pk.v[k] = from_math<T>(in[k]);
    *reinterpret_cast<Pack<T>*>(base + i) = pk;
  } else {
    base[i] = from_math<T>(in[0]);
  }
}

// Calls body.template run<N>(offset) over a chunk of `len` elements: kILP-wide when every
// pointer is suitably aligned, then a scalar tail; plain strided scalar loop otherwise.
template <typename Body>
__device__ __forceinline__ void for_chunk(int64_t len, bool aligned, Body& body) {
  if (aligned) {
    const int64_t vec_len = len - (len % kILP);
    for (int64_t i = int64_t(threadIdx.x) * kILP; i < vec_len; i += int64_t(kBlock) * kILP) {
      body.template run<kILP>(i);
    }
    for (int64_t i = vec_len + threadIdx.x; i < len; i += kBlock) body.template run<1>(i);
  } else {
    for (int64_t i = threadIdx.x; i < len; i += kBlock) body.template run<1>(i);
  }
}

__device__ __forceinline__ bool skipped(const float* found_inf) {
  return found_inf != nullptr && *found_inf != 0.0f;
}

// Fixed-order block reduction (deterministic).  Every thread must call it.
template <typename T>
__device__ T block_sum(T v) {
  __shared__ T warp_sums[kBlock / 32 > 32 ? kBlock / 32 : 32];
#pragma unroll
  for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = v;
  __syncthreads();
  const int nwarps = (blockDim.x + 31) / 32;
  v = (threadIdx.x < nwarps) ? warp_sums[threadIdx.x] : T(0);
  if (warp == 0) {
#pragma unroll
    for (int off = 16; off > 0; off /= 2) v += __shfl_down_sync(0xffffffffu, v, off);
  }
  __syncthreads();  // warp_sums may be reused by a following call
  return v;
}

// ------------------------------------------------------------------------------------ Adam
struct AdamArgs {
  double lr, beta1, beta2, eps, weight_decay;
  const float* grad_scale;
  const float* found_inf;
  int decoupled, amsgrad, maximize;
};

template <typename PT>
struct AdamBody {
  using M = typename MathOf<PT>::type;
  PT* p; PT* g; M* m; M* v; M* vmax; M* master;
  M inv_scale, decay, wd, lerp_w, beta2, one_minus_beta2, neg_step_size, inv_bc2_sqrt, eps;
  bool unscale, decoupled, amsgrad, maximize;

  template <int N>
  __device__ __forceinline__ void run(int64_t i) {
    M rp[kILP], rg[kILP], rm[kILP], rv[kILP], rx[kILP];
    load<N>(g, i, rg);
    if (master) load<N>(master, i, rp); else load<N>(p, i, rp);
    load<N>(m, i, rm);
    load<N>(v, i, rv);
    if (amsgrad) load<N>(vmax, i, rx);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      if (unscale) rg[k] = mul(rg[k], inv_scale);
    }
    if (unscale) store<N>(g, i, rg);
#pragma unroll
    for (int k = 0; k < N; ++k) {
      M gk = maximize ? -rg[k] : rg[k];
      M pk = rp[k];
      if (wd != M(0)) {
        if (decoupled) pk = mul(pk, decay);
        else gk = fma_(pk, wd, gk);
      }
      const M diff = sub(gk, rm[k]);
      rm[k] = lerp_w < M(0.5) ? fma_(lerp_w, diff, rm[k]) : fma_(sub(lerp_w, M(1)), diff, gk);
      rv[k] = fma_(mul(one_minus_beta2, gk), gk, mul(rv[k], beta2));
      M vv = rv[k];
      if (amsgrad) {
        vv = max_(rx[k], rv[k]);
        rx[k] = vv;
      }
      const M denom = add(mul(sqr(vv), inv_bc2_sqrt), eps);  // as the CPU kernels
      rp[k] = add(pk, dvd(mul(neg_step_size, rm[k]), denom));
    }
    store<N>(m, i, rm);
    store<N>(v, i, rv);
    if (amsgrad) store<N>(vmax, i, rx);
    if (master) store<N>(master, i, rp);
    store<N>(p, i, rp);
  }
};

template <typename PT>
__global__ void __launch_bounds__(kBlock) adam_kernel(const __grid_constant__ LaunchMeta meta,
                                                      const AdamArgs a) {
  using M = typename MathOf<PT>::type;
  if (skipped(a.found_inf)) return;
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t start = int64_t(meta.block_chunk[blockIdx.x]) * kChunk;
  const int64_t len = min(kChunk, meta.numel[t] - start);
  // Bias corrections in double from the per-tensor step, like torch's Python scalars.
  const double step = double(*meta.step[t]) + 1.0;
  const double bc1 = 1.0 - pow(a.beta1, step);
  const double bc2 = 1.0 - pow(a.beta2, step);
  AdamBody<PT> b;
  b.p = static_cast<PT*>(meta.ptr[0][t]) + start;
  b.g = static_cast<PT*>(meta.ptr[1][t]) + start;
  b.m = static_cast<M*>(meta.ptr[2][t]) + start;
  b.v = static_cast<M*>(meta.ptr[3][t]) + start;
  b.vmax = a.amsgrad ? static_cast<M*>(meta.ptr[4][t]) + start : nullptr;
  b.master = meta.ptr[5][t] ? static_cast<M*>(meta.ptr[5][t]) + start : nullptr;
  b.unscale = a.grad_scale != nullptr;
  b.inv_scale = b.unscale ? M(1.0 / double(*a.grad_scale)) : M(1);
  b.decay = M(1.0 - a.lr * a.weight_decay);
  b.wd = M(a.weight_decay);
  b.lerp_w = M(1.0 - a.beta1);
  b.beta2 = M(a.beta2);
  b.one_minus_beta2 = M(1.0 - a.beta2);
  b.neg_step_size = M(-(a.lr / bc1));
  b.inv_bc2_sqrt = M(1.0 / sqrt(bc2));
  b.eps = M(a.eps);
  b.decoupled = a.decoupled != 0;
  b.amsgrad = a.amsgrad != 0;
  b.maximize = a.maximize != 0;
  const bool aligned = aligned_for_pack<PT>(b.p) && aligned_for_pack<PT>(b.g) &&
                       aligned_for_pack<M>(b.m) && aligned_for_pack<M>(b.v) &&
                       (!b.vmax || aligned_for_pack<M>(b.vmax)) &&
                       (!b.master || aligned_for_pack<M>(b.master));
  for_chunk(len, aligned, b);
}

// ------------------------------------------------------------------------------------- SGD
struct SgdArgs {
  double lr, momentum, dampening, weight_decay;
  const float* grad_scale;
  const float* found_inf;
  int nesterov, maximize;
};

template <typename PT>
struct SgdBody {
  using M = typename MathOf<PT>::type;
  PT* p; PT* g; M* buf; M* master;
  M inv_scale, wd, momentum, one_minus_damp, neg_lr;
  bool unscale, first, nesterov, maximize;

  template <int N>
  __device__ __forceinline__ void run(int64_t i) {
    M rp[kILP], rg[kILP], rb[kILP];
    load<N>(g, i, rg);
    if (master) load<N>(master, i, rp); else load<N>(p, i, rp);
    if (buf && !first) load<N>(buf, i, rb);
    if (unscale) {
#pragma unroll
      for (int k = 0; k < N; ++k) rg[k] = mul(rg[k], inv_scale);
      store<N>(g, i, rg);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      M gk = maximize ? -rg[k] : rg[k];
      if (wd != M(0)) gk = fma_(rp[k], wd, gk);
      if (buf) {
        rb[k] = first ? gk : fma_(gk, one_minus_damp, mul(rb[k], momentum));
        gk = nesterov ? fma_(rb[k], momentum, gk) : rb[k];
      }
      rp[k] = fma_(gk, neg_lr, rp[k]);
    }
    if (buf) store<N>(buf, i, rb);
    if (master) store<N>(master, i, rp);
    store<N>(p, i, rp);
  }
};

template <typename PT>
__global__ void __launch_bounds__(kBlock) sgd_kernel(const __grid_constant__ LaunchMeta meta,
                                                     const SgdArgs a) {
  using M = typename MathOf<PT>::type;
  if (skipped(a.found_inf)) return;
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t start = int64_t(meta.block_chunk[blockIdx.x]) * kChunk;
  const int64_t len = min(kChunk, meta.numel[t] - start);
  SgdBody<PT> b;
  b.p = static_cast<PT*>(meta.ptr[0][t]) + start;
  b.g = static_cast<PT*>(meta.ptr[1][t]) + start;
  b.buf = (a.momentum != 0.0) ? static_cast<M*>(meta.ptr[2][t]) + start : nullptr;
  b.master = meta.ptr[5][t] ? static_cast<M*>(meta.ptr[5][t]) + start : nullptr;
  b.unscale = a.grad_scale != nullptr;
  b.inv_scale = b.unscale ? M(1.0 / double(*a.grad_scale)) : M(1);
  b.wd = M(a.weight_decay);
  b.momentum = M(a.momentum);
  b.one_minus_damp = M(1.0 - a.dampening);
  b.neg_lr = M(-a.lr);
  b.first = meta.flag[t] != 0;
  b.nesterov = a.nesterov != 0;
  b.maximize = a.maximize != 0;
  const bool aligned = aligned_for_pack<PT>(b.p) && aligned_for_pack<PT>(b.g) &&
                       (!b.buf || aligned_for_pack<M>(b.buf)) &&
                       (!b.master || aligned_for_pack<M>(b.master));
  for_chunk(len, aligned, b);
}

// ------------------------------------------------------------------------------------ LAMB
struct LambArgs {
  double lr, beta1, beta2, eps, weight_decay, max_grad_norm;
  const float* global_grad_norm;
  const float* grad_scale;
  const float* found_inf;
  double* partials;  // 2 per global chunk: sum p^2, sum u^2
  const double* norms;  // 2 per tensor (stage 2): ||p||, ||u||
  int bias_correction, grad_averaging, adam_w_mode, use_nvlamb;
};

template <typename PT>
struct LambBody {
  using M = typename MathOf<PT>::type;
  PT* p; PT* g; M* m; M* v; M* master;
  M grad_factor, inv_scale, wd, beta1, beta2, beta3, one_minus_beta2, bc1, bc2, eps, neg_ratio;
  bool unscale, adam_w_mode, stage2;
  M acc_p = M(0), acc_u = M(0);

  __device__ __forceinline__ M update(M mk, M vk, M pk) const {
    const M denom = add(sqr(dvd(vk, bc2)), eps);
    M u = dvd(dvd(mk, bc1), denom);
    if (adam_w_mode && wd != M(0)) u = fma_(wd, pk, u);
    return u;
  }

  template <int N>
  __device__ __forceinline__ void run(int64_t i) {
    M rp[kILP], rm[kILP], rv[kILP];
    if (master) load<N>(master, i, rp); else load<N>(p, i, rp);
    load<N>(m, i, rm);
    load<N>(v, i, rv);
    if (stage2) {
#pragma unroll
      for (int k = 0; k < N; ++k) rp[k] = fma_(neg_ratio, update(rm[k], rv[k], rp[k]), rp[k]);
      if (master) store<N>(master, i, rp);
      store<N>(p, i, rp);
      return;
    }
    M rg[kILP];
    load<N>(g, i, rg);
    if (unscale) {
      M us[kILP];
#pragma unroll
      for (int k = 0; k < N; ++k) us[k] = mul(rg[k], inv_scale);
      store<N>(g, i, us);
    }
#pragma unroll
    for (int k = 0; k < N; ++k) {
      M gk = mul(rg[k], grad_factor);
      if (!adam_w_mode && wd != M(0)) gk = fma_(wd, rp[k], gk);
      rm[k] = fma_(beta3, gk, mul(beta1, rm[k]));
      rv[k] = fma_(one_minus_beta2, mul(gk, gk), mul(beta2, rv[k]));
      const M u = update(rm[k], rv[k], rp[k]);
      acc_p = fma_(rp[k], rp[k], acc_p);
      acc_u = fma_(u, u, acc_u);
    }
    store<N>(m, i, rm);
    store<N>(v, i, rv);
  }
};

template <typename PT>
__global__ void __launch_bounds__(kBlock) lamb_kernel(const __grid_constant__ LaunchMeta meta,
                                                      const LambArgs a, int stage2) {
  using M = typename MathOf<PT>::type;
  if (skipped(a.found_inf)) return;
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t chunk = meta.block_chunk[blockIdx.x];
  const int64_t start = chunk * kChunk;
  const int64_t len = min(kChunk, meta.numel[t] - start);
  const double step = double(*meta.step[t]) + 1.0;
  LambBody<PT> b;
  b.p = static_cast<PT*>(meta.ptr[0][t]) + start;
  b.g = static_cast<PT*>(meta.ptr[1][t]) + start;
  b.m = static_cast<M*>(meta.ptr[2][t]) + start;
  b.v = static_cast<M*>(meta.ptr[3][t]) + start;
  b.master = meta.ptr[5][t] ? static_cast<M*>(meta.ptr[5][t]) + start : nullptr;
  b.unscale = a.grad_scale != nullptr;
  const double inv_scale = b.unscale ? 1.0 / double(*a.grad_scale) : 1.0;
  double clip = 1.0;
  if (a.global_grad_norm != nullptr && a.max_grad_norm > 0.0) {
    const double norm = double(*a.global_grad_norm);
    if (norm > a.max_grad_norm) clip = norm / a.max_grad_norm;
  }
  b.inv_scale = M(inv_scale);
  b.grad_factor = M(inv_scale / clip);
  b.wd = M(a.weight_decay);
  b.beta1 = M(a.beta1);
  b.beta2 = M(a.beta2);
  b.beta3 = M(a.grad_averaging ? 1.0 - a.beta1 : 1.0);
  b.one_minus_beta2 = M(1.0 - a.beta2);
  b.bc1 = M(a.bias_correction ? 1.0 - pow(a.beta1, step) : 1.0);
  b.bc2 = M(a.bias_correction ? 1.0 - pow(a.beta2, step) : 1.0);
  b.eps = M(a.eps);
  b.adam_w_mode = a.adam_w_mode != 0;
  b.stage2 = stage2 != 0;
  if (b.stage2) {
    const double p_norm = a.norms[2 * meta.index[t]], u_norm = a.norms[2 * meta.index[t] + 1];
    double ratio = a.lr;
    if ((a.use_nvlamb || a.weight_decay != 0.0) && p_norm > 0.0 && u_norm > 0.0) {
      ratio = a.lr * (p_norm / u_norm);
    }
    b.neg_ratio = M(-ratio);
  }
  const bool aligned = aligned_for_pack<PT>(b.p) && aligned_for_pack<PT>(b.g) &&
                       aligned_for_pack<M>(b.m) && aligned_for_pack<M>(b.v) &&
                       (!b.master || aligned_for_pack<M>(b.master));
  for_chunk(len, aligned, b);
  if (!b.stage2) {
    const double sp = block_sum<double>(double(b.acc_p));
    const double su = block_sum<double>(double(b.acc_u));
    if (threadIdx.x == 0) {
      const int64_t gc = meta.chunk_base[t] + chunk;
      a.partials[2 * gc] = sp;
      a.partials[2 * gc + 1] = su;
    }
  }
}

// One block per tensor: sums its chunk partials in a fixed order into ||p||, ||u||.
__global__ void __launch_bounds__(kBlock) lamb_norms_kernel(const __grid_constant__ TensorMeta tm,
                                                            const double* partials, double* norms,
                                                            const float* found_inf) {
  if (skipped(found_inf)) return;
  const int t = blockIdx.x;
  double sp = 0.0, su = 0.0;
  for (int c = threadIdx.x; c < tm.nchunks[t]; c += blockDim.x) {
    sp += partials[2 * (tm.chunk_base[t] + c)];
    su += partials[2 * (tm.chunk_base[t] + c) + 1];
  }
  sp = block_sum<double>(sp);
  su = block_sum<double>(su);
  if (threadIdx.x == 0) {
    norms[2 * tm.index[t]] = sqrt(sp);
    norms[2 * tm.index[t] + 1] = sqrt(su);
  }
}

// ---------------------------------------------------------------------------- sum of squares
template <typename PT>
struct SumSqBody {
  using M = typename MathOf<PT>::type;
  const PT* x;
  M acc = M(0);
  template <int N>
  __device__ __forceinline__ void run(int64_t i) {
    M r[kILP];
    load<N>(x, i, r);
#pragma unroll
    for (int k = 0; k < N; ++k) acc = fma_(r[k], r[k], acc);
  }
};

template <typename PT>
__global__ void __launch_bounds__(kBlock) sumsq_kernel(const __grid_constant__ LaunchMeta meta,
                                                       double* partials) {
  const int t = meta.block_tensor[blockIdx.x];
  const int64_t chunk = meta.block_chunk[blockIdx.x];
  const int64_t start = chunk * kChunk;
  const int64_t len = min(kChunk, meta.numel[t] - start);
  SumSqBody<PT> b;
  b.x = static_cast<const PT*>(meta.ptr[0][t]) + start;
  for_chunk(len, aligned_for_pack<PT>(b.x), b);
  const double s = block_sum<double>(double(b.acc));
  if (threadIdx.x == 0) partials[meta.chunk_base[t] + chunk] = s;
}

__global__ void __launch_bounds__(kBlock) reduce_all_kernel(const double* partials, int64_t n,
                                                            float* out) {
  double s = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += blockDim.x) s += partials[i];
  s = block_sum<double>(s);
  if (threadIdx.x == 0) *out = float(s);
}

// ---------------------------------------------------------------------------- step counters
__global__ void step_kernel(const __grid_constant__ TensorMeta tm, int n, const float* found_inf) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n && !skipped(found_inf)) *tm.step[i] += 1.0f;
}

// ------------------------------------------------------------------------------ host side
struct Lists {
  void* const* list[kDepth] = {nullptr, nullptr, nullptr, nullptr, nullptr, nullptr};
  void* const* steps = nullptr;
  const int* flags = nullptr;
};

// Packs tensors and chunks into LaunchMeta structs and calls launch(meta, nblocks) for each.
template <typename Launch>
int for_each_launch(int n, const int64_t* numels, const Lists& l, Launch launch) {
  static thread_local LaunchMeta meta;  // ~20 KB: keep it off the stack
  int nt = 0, nb = 0;
  int64_t gchunk = 0;
  for (int t = 0; t < n; ++t) {
    const int64_t chunks = (numels[t] + kChunk - 1) / kChunk;
    if (chunks <= 0) continue;  // empty tensor: only its step advances
    if (chunks > (int64_t(1) << 31) - 1) return fail_msg("tensor too large");
    for (int d = 0; d < kDepth; ++d) meta.ptr[d][nt] = l.list[d] ? l.list[d][t] : nullptr;
    meta.step[nt] = l.steps ? static_cast<float*>(l.steps[t]) : nullptr;
    meta.numel[nt] = numels[t];
    meta.chunk_base[nt] = gchunk;
    meta.index[nt] = t;
    meta.flag[nt] = l.flags ? l.flags[t] : 0;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_tensor[nb] = uint16_t(nt);
      meta.block_chunk[nb] = int(c);
      ++nb;
      const bool last = c == chunks - 1;
      if (nb == kMaxBlocks || (last && nt + 1 == kMaxTensors)) {
        const int rc = launch(meta, nb);
        if (rc != 0) return rc;
        nb = 0;
        if (last) {
          nt = -1;
        } else {  // carry the unfinished tensor over to slot 0 of the next launch
          for (int d = 0; d < kDepth; ++d) meta.ptr[d][0] = meta.ptr[d][nt];
          meta.step[0] = meta.step[nt];
          meta.numel[0] = meta.numel[nt];
          meta.chunk_base[0] = meta.chunk_base[nt];
          meta.index[0] = meta.index[nt];
          meta.flag[0] = meta.flag[nt];
          nt = 0;
        }
      }
    }
    ++nt;
    gchunk += chunks;
  }
  if (nb > 0) return launch(meta, nb);
  return 0;
}

int64_t total_chunks(int n, const int64_t* numels) {
  int64_t total = 0;
  for (int t = 0; t < n; ++t) total += (numels[t] + kChunk - 1) / kChunk;
  return total;
}

int advance_steps(int n, void* const* steps, const float* found_inf, cudaStream_t stream) {
  static thread_local TensorMeta tm;
  for (int base = 0; base < n; base += kMaxSmall) {
    const int cnt = n - base < kMaxSmall ? n - base : kMaxSmall;
    for (int i = 0; i < cnt; ++i) tm.step[i] = static_cast<float*>(steps[base + i]);
    step_kernel<<<(cnt + 255) / 256, 256, 0, stream>>>(tm, cnt, found_inf);
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return fail(err, "step_kernel");
  }
  return 0;
}

int check_common(int n, const int64_t* numels, int dtype) {
  if (n < 0) return fail_msg("n must be >= 0");
  if (n > 0 && numels == nullptr) return fail_msg("numels is NULL");
  if (dtype != aiak::FLOAT32 && dtype != aiak::FLOAT16 && dtype != aiak::BFLOAT16 &&
      dtype != aiak::FLOAT64) {
    return fail_msg("unsupported dtype code (7 f32, 6 f16, 10 bf16, 8 f64)");
  }
  return 0;
}

template <typename PT>
int launch_adam(int n, const int64_t* numels, const Lists& l, const AdamArgs& a,
                cudaStream_t stream) {
  return for_each_launch(n, numels, l, [&](const LaunchMeta& meta, int nb) {
    adam_kernel<PT><<<nb, kBlock, 0, stream>>>(meta, a);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? 0 : fail(err, "adam_kernel");
  });
}

template <typename PT>
int launch_sgd(int n, const int64_t* numels, const Lists& l, const SgdArgs& a,
               cudaStream_t stream) {
  return for_each_launch(n, numels, l, [&](const LaunchMeta& meta, int nb) {
    sgd_kernel<PT><<<nb, kBlock, 0, stream>>>(meta, a);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? 0 : fail(err, "sgd_kernel");
  });
}

template <typename PT>
int launch_lamb(int n, const int64_t* numels, const Lists& l, const LambArgs& a, int stage2,
                cudaStream_t stream) {
  return for_each_launch(n, numels, l, [&](const LaunchMeta& meta, int nb) {
    lamb_kernel<PT><<<nb, kBlock, 0, stream>>>(meta, a, stage2);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? 0 : fail(err, "lamb_kernel");
  });
}

template <typename PT>
int launch_sumsq(int n, const int64_t* numels, const Lists& l, double* partials,
                 cudaStream_t stream) {
  return for_each_launch(n, numels, l, [&](const LaunchMeta& meta, int nb) {
    sumsq_kernel<PT><<<nb, kBlock, 0, stream>>>(meta, partials);
    const cudaError_t err = cudaGetLastError();
    return err == cudaSuccess ? 0 : fail(err, "sumsq_kernel");
  });
}

}  // namespace

extern "C" {

int aiak_fused_cuda_abi_version(void) { return AIAK_FUSED_CUDA_ABI_VERSION; }

const char* aiak_fused_cuda_last_error(void) { return g_last_error; }

int aiak_fused_adam_cuda(int n, const int64_t* numels, void* const* params, void* const* grads,
                         void* const* exp_avgs, void* const* exp_avg_sqs,
                         void* const* max_exp_avg_sqs, void* const* master_params,
                         void* const* steps, int dtype, double lr, double beta1, double beta2,
                         double eps, double weight_decay, int decoupled, int amsgrad,
                         int maximize, const void* grad_scale, const void* found_inf,
                         void* stream) {
  g_last_error[0] = '\0';
  if (int rc = check_common(n, numels, dtype)) return rc;
  if (n == 0) return 0;
  if (!params || !grads || !exp_avgs || !exp_avg_sqs || !steps) return fail_msg("adam: NULL list");
  if (amsgrad && !max_exp_avg_sqs) return fail_msg("adam: amsgrad needs max_exp_avg_sqs");
  Lists l;
  l.list[0] = params; l.list[1] = grads; l.list[2] = exp_avgs; l.list[3] = exp_avg_sqs;
  l.list[4] = amsgrad ? max_exp_avg_sqs : nullptr; l.list[5] = master_params;
  l.steps = steps;
  const AdamArgs a{lr, beta1, beta2, eps, weight_decay, static_cast<const float*>(grad_scale),
                   static_cast<const float*>(found_inf), decoupled, amsgrad, maximize};
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  int rc = 0;
  switch (dtype) {
    case aiak::FLOAT32: rc = launch_adam<float>(n, numels, l, a, s); break;
    case aiak::FLOAT16: rc = launch_adam<__half>(n, numels, l, a, s); break;
    case aiak::BFLOAT16: rc = launch_adam<__nv_bfloat16>(n, numels, l, a, s); break;
    default: rc = launch_adam<double>(n, numels, l, a, s); break;
  }
  if (rc != 0) return rc;
  // After the update kernels (same stream), so every block saw the old step.
  return advance_steps(n, steps, static_cast<const float*>(found_inf), s);
}

int aiak_fused_sgd_cuda(int n, const int64_t* numels, void* const* params, void* const* grads,
                        void* const* momentum_buffers, void* const* master_params,
                        const int* first_step, int dtype, double lr, double momentum,
                        double dampening, double weight_decay, int nesterov, int maximize,
                        const void* grad_scale, const void* found_inf, void* stream) {
  g_last_error[0] = '\0';
  if (int rc = check_common(n, numels, dtype)) return rc;
  if (n == 0) return 0;
  if (!params || !grads) return fail_msg("sgd: NULL list");
  if (momentum != 0.0 && !momentum_buffers) return fail_msg("sgd: momentum needs buffers");
  Lists l;
  l.list[0] = params; l.list[1] = grads;
  l.list[2] = momentum != 0.0 ? momentum_buffers : nullptr; l.list[5] = master_params;
  l.flags = first_step;
  const SgdArgs a{lr, momentum, dampening, weight_decay, static_cast<const float*>(grad_scale),
                  static_cast<const float*>(found_inf), nesterov, maximize};
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  switch (dtype) {
    case aiak::FLOAT32: return launch_sgd<float>(n, numels, l, a, s);
    case aiak::FLOAT16: return launch_sgd<__half>(n, numels, l, a, s);
    case aiak::BFLOAT16: return launch_sgd<__nv_bfloat16>(n, numels, l, a, s);
    default: return launch_sgd<double>(n, numels, l, a, s);
  }
}

size_t aiak_fused_lamb_cuda_workspace_bytes(int n, const int64_t* numels) {
  if (n <= 0 || numels == nullptr) return sizeof(double);
  return size_t(2 * total_chunks(n, numels) + 2 * int64_t(n)) * sizeof(double);
}

int aiak_fused_lamb_cuda(int n, const int64_t* numels, void* const* params, void* const* grads,
                         void* const* exp_avgs, void* const* exp_avg_sqs,
                         void* const* master_params, void* const* steps, int dtype, double lr,
                         double beta1, double beta2, double eps, double weight_decay,
                         int bias_correction, int grad_averaging, int adam_w_mode, int use_nvlamb,
                         double max_grad_norm, const void* global_grad_norm,
                         const void* grad_scale, const void* found_inf, void* workspace,
                         void* stream) {
  g_last_error[0] = '\0';
  if (int rc = check_common(n, numels, dtype)) return rc;
  if (n == 0) return 0;
  if (!params || !grads || !exp_avgs || !exp_avg_sqs || !steps || !workspace) {
    return fail_msg("lamb: NULL list or workspace");
  }
  Lists l;
  l.list[0] = params; l.list[1] = grads; l.list[2] = exp_avgs; l.list[3] = exp_avg_sqs;
  l.list[5] = master_params;
  l.steps = steps;
  double* partials = static_cast<double*>(workspace);
  const int64_t nchunks = total_chunks(n, numels);
  double* norms = partials + 2 * nchunks;
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  // Zero the norms so empty tensors read (0, 0) and take a trust ratio of 1.
  cudaError_t err = cudaMemsetAsync(norms, 0, size_t(2 * n) * sizeof(double), s);
  if (err != cudaSuccess) return fail(err, "cudaMemsetAsync");
  LambArgs a{lr, beta1, beta2, eps, weight_decay, max_grad_norm,
             static_cast<const float*>(global_grad_norm), static_cast<const float*>(grad_scale),
             static_cast<const float*>(found_inf), partials, norms, bias_correction,
             grad_averaging, adam_w_mode, use_nvlamb};
  for (int stage = 0; stage < 2; ++stage) {
    int rc = 0;
    switch (dtype) {
      case aiak::FLOAT32: rc = launch_lamb<float>(n, numels, l, a, stage, s); break;
      case aiak::FLOAT16: rc = launch_lamb<__half>(n, numels, l, a, stage, s); break;
      case aiak::BFLOAT16: rc = launch_lamb<__nv_bfloat16>(n, numels, l, a, stage, s); break;
      default: rc = launch_lamb<double>(n, numels, l, a, stage, s); break;
    }
    if (rc != 0) return rc;
    if (stage == 0) {  // per-tensor norms from the chunk partials, in a fixed order
      static thread_local TensorMeta tm;
      int cnt = 0;
      int64_t base = 0;
      for (int t = 0; t < n; ++t) {
        const int64_t c = (numels[t] + kChunk - 1) / kChunk;
        if (c > 0) {
          tm.chunk_base[cnt] = base;
          tm.nchunks[cnt] = int(c);
          tm.index[cnt] = t;
          ++cnt;
        }
        base += c;
        if (cnt == kMaxSmall || (t == n - 1 && cnt > 0)) {
          lamb_norms_kernel<<<cnt, kBlock, 0, s>>>(tm, partials, norms, a.found_inf);
          err = cudaGetLastError();
          if (err != cudaSuccess) return fail(err, "lamb_norms_kernel");
          cnt = 0;
        }
      }
    }
  }
  return advance_steps(n, steps, a.found_inf, s);
}

int64_t aiak_fused_cuda_plan_check(int n, const int64_t* numels) {
  // Host-only: runs the launch packing with a recording "launch" and checks that every chunk
  // of every tensor lands in exactly one block with consistent per-slot metadata.
  if (n < 0 || (n > 0 && numels == nullptr)) return -1;
  const int64_t total = n > 0 ? total_chunks(n, numels) : 0;
  int64_t* first = new int64_t[size_t(n) + 1];
  int64_t acc = 0;
  for (int t = 0; t < n; ++t) {
    first[t] = acc;
    acc += (numels[t] + kChunk - 1) / kChunk;
  }
  unsigned char* seen = new unsigned char[size_t(total) + 1]();
  int64_t launches = 0;
  bool ok = true;
  Lists l;
  const int rc = for_each_launch(n, numels, l, [&](const LaunchMeta& meta, int nb) {
    ++launches;
    if (nb <= 0 || nb > kMaxBlocks) ok = false;
    for (int b = 0; b < nb && ok; ++b) {
      const int slot = meta.block_tensor[b];
      if (slot < 0 || slot >= kMaxTensors) { ok = false; break; }
      const int t = meta.index[slot];
      if (t < 0 || t >= n || meta.numel[slot] != numels[t] || meta.chunk_base[slot] != first[t]) {
        ok = false;
        break;
      }
      const int64_t c = meta.block_chunk[b];
      if (c < 0 || c * kChunk >= numels[t] || seen[first[t] + c]++) ok = false;
    }
    return 0;
  });
  for (int64_t i = 0; i < total && ok; ++i) ok = seen[i] == 1;
  delete[] seen;
  delete[] first;
  return (rc == 0 && ok) ? launches : -1;
}

int aiak_fused_sum_squares_cuda(int n, const int64_t* numels, void* const* tensors, int dtype,
                                void* out, void* workspace, void* stream) {
  g_last_error[0] = '\0';
  if (int rc = check_common(n, numels, dtype)) return rc;
  if (!out || !workspace) return fail_msg("sum_squares: NULL out or workspace");
  const cudaStream_t s = static_cast<cudaStream_t>(stream);
  const int64_t nchunks = n > 0 ? total_chunks(n, numels) : 0;
  if (nchunks == 0) {
    const cudaError_t err = cudaMemsetAsync(out, 0, sizeof(float), s);
    return err == cudaSuccess ? 0 : fail(err, "cudaMemsetAsync");
  }
  if (!tensors) return fail_msg("sum_squares: NULL list");
  Lists l;
  l.list[0] = tensors;
  double* partials = static_cast<double*>(workspace);
  int rc = 0;
  switch (dtype) {
    case aiak::FLOAT32: rc = launch_sumsq<float>(n, numels, l, partials, s); break;
    case aiak::FLOAT16: rc = launch_sumsq<__half>(n, numels, l, partials, s); break;
    case aiak::BFLOAT16: rc = launch_sumsq<__nv_bfloat16>(n, numels, l, partials, s); break;
    default: rc = launch_sumsq<double>(n, numels, l, partials, s); break;
  }
  if (rc != 0) return rc;
  reduce_all_kernel<<<1, kBlock, 0, s>>>(partials, nchunks, static_cast<float*>(out));
  const cudaError_t err = cudaGetLastError();
  return err == cudaSuccess ? 0 : fail(err, "reduce_all_kernel");
}

}  // extern "C"
