// Batched device copies for the engine's GPU fusion buffer (aiak_training/common/gpu).
//
// Packing 161 gradients into the fusion buffer with one cudaMemcpyAsync each costs the host a
// few microseconds per call, which is more than the copies themselves take on the device.  One
// launch copies up to kBatch buffers with 16-byte loads and stores where both addresses allow
// them.  The grid is one-dimensional and each buffer gets a run of blocks in proportion to its
// size (at least one, at most kMaxBlocksPerBuffer); a block finds its buffer by a binary search
// of the runs.  (A grid of "blocks for the largest buffer" x "buffers" would launch mostly idle
// blocks when one large gradient is batched with many small ones.)
#include <cuda_runtime.h>

#include <cstdint>
#include <cstdio>

#include "aiak_fused_cuda.h"

namespace {

constexpr int kBatch = 64;
constexpr int kThreads = 256;
// Bytes one block copies per pass of its loop: 256 threads x 16 bytes x 4 iterations.
constexpr int64_t kBytesPerBlock = int64_t(kThreads) * 16 * 4;
constexpr int64_t kMaxBlocksPerBuffer = 1024;

struct CopyBatch {  // kernel parameters: 64 * 24 + 65 * 4 + 4 bytes, well under the 4 KB limit
  const char* src[kBatch];
  char* dst[kBatch];
  int64_t bytes[kBatch];
  int block_start[kBatch + 1];  // buffer i owns blocks [block_start[i], block_start[i + 1])
  int count;
};

__global__ void batched_copy_kernel(const CopyBatch b) {
  // The last buffer whose run starts at or before this block.
  int lo = 0, hi = b.count - 1;
  const int block = int(blockIdx.x);
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (b.block_start[mid] <= block) lo = mid; else hi = mid - 1;
  }
  const int t = lo;
  const char* __restrict__ s = b.src[t];
  char* __restrict__ d = b.dst[t];
  const int64_t n = b.bytes[t];
  const int64_t stride = int64_t(b.block_start[t + 1] - b.block_start[t]) * blockDim.x;
  const int64_t first = int64_t(block - b.block_start[t]) * blockDim.x + threadIdx.x;
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
  int i = 0;
  while (i < n) {
    CopyBatch b;
    int count = 0;
    int blocks = 0;
    for (; i < n && count < kBatch; ++i) {
      if (nbytes[i] < 0) {
        std::snprintf(g_copy_error, sizeof(g_copy_error), "batched_copy: nbytes[%d] < 0", i);
        return int(cudaErrorInvalidValue);
      }
      if (nbytes[i] == 0) continue;
      b.src[count] = static_cast<const char*>(srcs[i]);
      b.dst[count] = static_cast<char*>(dsts[i]);
      b.bytes[count] = nbytes[i];
      int64_t own = (nbytes[i] + kBytesPerBlock - 1) / kBytesPerBlock;
      own = own < 1 ? 1 : (own > kMaxBlocksPerBuffer ? kMaxBlocksPerBuffer : own);
      b.block_start[count] = blocks;
      blocks += int(own);
      ++count;
    }
    if (count == 0) continue;
    b.block_start[count] = blocks;
    b.count = count;
    batched_copy_kernel<<<blocks, kThreads, 0, static_cast<cudaStream_t>(stream)>>>(b);
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
