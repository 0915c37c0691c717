/* Fused optimizer kernels for CUDA: plain C ABI.
 *
 * Everything is passed as raw device pointers, element counts and a stream, so PyTorch (via
 * ctypes), TensorFlow, CuPy or C code can call these without any framework headers.
 *
 * Conventions for every entry point:
 *  - n tensors; numels[i] elements each; pointer arrays (host memory) of length n give the
 *    device address of tensor i in each list.  Tensors are walked as flat arrays, so each must
 *    be dense, and all lists of one tensor index must share one layout.
 *  - dtype is the parameter (and gradient) dtype, a DataType code of csrc/common/dtypes.h:
 *    7 float32, 6 float16, 10 bfloat16, 8 float64.
 *    Optimizer states and master params are float32 (float64 for float64 params).  All maths
 *    is done in float32 (float64 for float64 params).
 *  - steps[i] is a device float32 scalar per tensor: the kernels use steps[i] + 1 and then
 *    advance it, so any subset of parameters can be stepped on its own.
 *  - grad_scale (nullable, device float32): gradients are divided by it (and stored back
 *    unscaled), as torch.amp.GradScaler expects of fused optimizers.
 *  - found_inf (nullable, device float32): when non-zero nothing is written at all (params,
 *    grads, states and steps keep their bits).
 *  - Work is enqueued on `stream` (a cudaStream_t; 0 for the legacy default stream) on the
 *    calling thread's current device; nothing synchronises with the host.
 *  - Return 0 on success, else a CUDA error code; aiak_fused_cuda_last_error() describes it.
 */
#ifndef AIAK_FUSED_CUDA_H_
#define AIAK_FUSED_CUDA_H_

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// 2: dtype codes are the shared DataType codes (were 0-3).
#define AIAK_FUSED_CUDA_ABI_VERSION 2
#if defined(__GNUC__)
#define AIAK_FUSED_API __attribute__((visibility("default")))
#else
#define AIAK_FUSED_API
#endif

AIAK_FUSED_API int aiak_fused_cuda_abi_version(void);
/* Message for the last failure on this thread ("" if none). */
AIAK_FUSED_API const char* aiak_fused_cuda_last_error(void);

/* Adam (decoupled=0: L2 weight decay added to the gradient) or AdamW (decoupled=1), with
 * torch.optim.Adam's exact definitions, including amsgrad and maximize.
 * max_exp_avg_sqs: used when amsgrad (else may be NULL).  master_params: NULL, or an array
 * whose entries are NULL or fp32 master copies of low-precision params. */
AIAK_FUSED_API int aiak_fused_adam_cuda(
    int n, const int64_t* numels, void* const* params, void* const* grads,
    void* const* exp_avgs, void* const* exp_avg_sqs, void* const* max_exp_avg_sqs,
    void* const* master_params, void* const* steps, int dtype, double lr, double beta1,
    double beta2, double eps, double weight_decay, int decoupled, int amsgrad, int maximize,
    const void* grad_scale, const void* found_inf, void* stream);

/* SGD with torch.optim.SGD's definitions.  momentum_buffers: used when momentum != 0;
 * first_step[i] != 0 initialises buffer i from the gradient (torch's "buffer is None"). */
AIAK_FUSED_API int aiak_fused_sgd_cuda(
    int n, const int64_t* numels, void* const* params, void* const* grads,
    void* const* momentum_buffers, void* const* master_params, const int* first_step, int dtype,
    double lr, double momentum, double dampening, double weight_decay, int nesterov,
    int maximize, const void* grad_scale, const void* found_inf, void* stream);

/* Bytes of device workspace needed by aiak_fused_lamb_cuda and aiak_fused_sum_squares_cuda
 * for these tensors. */
AIAK_FUSED_API size_t aiak_fused_lamb_cuda_workspace_bytes(int n, const int64_t* numels);

/* LAMB (paper + Apex FusedLAMB options).  global_grad_norm (nullable, device float32) is the L2
 * norm of all unscaled gradients; with max_grad_norm > 0 gradients are divided by
 * max(norm / max_grad_norm, 1).  Per-tensor norms are reduced in a fixed order, so results are
 * deterministic.  workspace: device memory of aiak_fused_lamb_cuda_workspace_bytes(). */
AIAK_FUSED_API int aiak_fused_lamb_cuda(
    int n, const int64_t* numels, void* const* params, void* const* grads,
    void* const* exp_avgs, void* const* exp_avg_sqs, void* const* master_params,
    void* const* steps, int dtype, double lr, double beta1, double beta2, double eps,
    double weight_decay, int bias_correction, int grad_averaging, int adam_w_mode,
    int use_nvlamb, double max_grad_norm, const void* global_grad_norm,
    const void* grad_scale, const void* found_inf, void* workspace, void* stream);

/* *out (device float32) = sum of squares of all elements of all tensors (deterministic).
 * workspace: aiak_fused_lamb_cuda_workspace_bytes() bytes of device memory. */
AIAK_FUSED_API int aiak_fused_sum_squares_cuda(
    int n, const int64_t* numels, void* const* tensors, int dtype, void* out, void* workspace,
    void* stream);

/* Testing aid, host only (no GPU needed): packs tensors of these sizes into launches the way
 * the kernels above do and checks that every 64K-element chunk is covered exactly once.
 * Returns the number of kernel launches one list-wide call would make, or -1 on error. */
AIAK_FUSED_API int64_t aiak_fused_cuda_plan_check(int n, const int64_t* numels);

/* Copy n device buffers (srcs[i] -> dsts[i], nbytes[i] bytes each) with one kernel launch
 * per 64 buffers, on `stream`.  Used by the engine to
 * fill and empty its GPU fusion buffer.  0 on success, else a CUDA error code;
 * aiak_batched_copy_cuda_last_error() describes it. */
AIAK_FUSED_API int aiak_batched_copy_cuda(int n, void* const* dsts, const void* const* srcs,
                                          const int64_t* nbytes, void* stream);
AIAK_FUSED_API const char* aiak_batched_copy_cuda_last_error(void);

#ifdef __cplusplus
}
#endif
#endif /* AIAK_FUSED_CUDA_H_ */
