// Batched device copies for the engine's GPU fusion buffer (aiak_training/common/gpu).
//
// Packing 161 gradients into the fusion buffer with one cudaMemcpyAsync each costs the host a
// few microseconds per call, which is more than the copies themselves take on the device.  One
// launch copies up to kBatch buffers: blockIdx.y picks the buffer, and the blocks along x
// stride over it with 16-byte loads and stores where both addresses allow them.
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "aiak_fused_cuda.h"

namespace {

constexpr int kBatch = 64;
constexpr int kThreads = 256;
constexpr int kMaxBlocksX = 1024;

struct CopyBatch {  // kernel parameters: 64 * 24 + 8 bytes, well under the 4 KB limit
  const char* src[kBatch];
  char* dst[kBatch];
  int64_t bytes[kBatch];
};

__global__ void batched_copy_kernel(CopyBatch b) {
  const int t = blockIdx.y;
  const char* __restrict__ s = b.src[t];
  char* __restrict__ d = b.dst[t];
  const int64_t n = b.bytes[t];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t first = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(s) | reinterpret_cast<uintptr_t>(d)) & 15) == 0) {
    const int64_t nv = n / 16;
    const uint4* s4 = reinterpret_cast<const uint4*>(s);
    uint4* d4 = reinterpret_cast<uint4*>(d);
    for (int64_t i = first; i < nv; i += stride) d4[i] = s4[i];
    done = nv * 16;
  }
  for (int64_t i = done + first; i < n; i += stride) d[i] = s[i];
}

thread_local char g_copy_error[256] = "";

}  // namespace

extern "C" {

AIAK_FUSED_API const char* aiak_batched_copy_cuda_last_error(void) { return g_copy_error; }

AIAK_FUSED_API int aiak_batched_copy_cuda(int n, void* const* dsts, const void* const* srcs,
                                          const int64_t* nbytes, void* stream) {
  if (n < 0 || (n > 0 && (dsts == nullptr || srcs == nullptr || nbytes == nullptr))) {
    std::snprintf(g_copy_error, sizeof(g_copy_error), "batched_copy: bad arguments (n=%d)", n);
    return int(cudaErrorInvalidValue);
  }
  for (int start = 0; start < n; start += kBatch) {
    CopyBatch b;
    int count = 0;
    int64_t largest = 0;
    for (int i = start; i < n && count < kBatch; ++i) {
      if (nbytes[i] < 0) {
        std::snprintf(g_copy_error, sizeof(g_copy_error), "batched_copy: nbytes[%d] < 0", i);
        return int(cudaErrorInvalidValue);
      }
      if (nbytes[i] == 0) continue;
      b.src[count] = static_cast<const char*>(srcs[i]);
      b.dst[count] = static_cast<char*>(dsts[i]);
      b.bytes[count] = nbytes[i];
      largest = nbytes[i] > largest ? nbytes[i] : largest;
      ++count;
    }
    if (count == 0) continue;
    int64_t blocks = (largest / 16 + kThreads - 1) / kThreads;
    if (blocks < 1) blocks = 1;
    if (blocks > kMaxBlocksX) blocks = kMaxBlocksX;
    const dim3 grid{static_cast<unsigned>(blocks), static_cast<unsigned>(count), 1u};
    batched_copy_kernel<<<grid, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) {
      std::snprintf(g_copy_error, sizeof(g_copy_error), "batched_copy: %s",
                    cudaGetErrorString(err));
      return int(err);
    }
  }
  return 0;
}

}  // extern "C"
