// CUDA kernel for the batched LoRA shrink (contract in kernels/lora_shrink.h). No Abseil here:
// the launcher returns cudaError_t and kernels/cuda/cuda_backend.cc turns it into a Status.
#include <cuda_runtime.h>

#include <cstdint>

namespace moelora {
namespace {

constexpr int kWarpsPerBlock = 8;

// One block per token; warp w computes ranks j = w, w + 8, ...; lanes stride over H_in and the
// warp reduces with shuffles. f32 accumulation throughout.
__global__ void LoraShrinkKernel(const float* __restrict__ x, const float* __restrict__ lora_a,
                                 const int32_t* __restrict__ rank,
                                 const int32_t* __restrict__ slot_of_token, float* __restrict__ y,
                                 int64_t h_in, int64_t max_rank) {
  const int64_t t = blockIdx.x;
  const int lane = threadIdx.x;
  const int warp = threadIdx.y;
  const int32_t s = slot_of_token[t];
  const int32_t r = s < 0 ? 0 : rank[s];
  const float* xt = x + t * h_in;
  for (int64_t j = warp; j < max_rank; j += kWarpsPerBlock) {
    float acc = 0.0f;
    if (j < r) {
      const float* a = lora_a + (static_cast<int64_t>(s) * max_rank + j) * h_in;
      for (int64_t k = lane; k < h_in; k += 32) acc += a[k] * xt[k];
      for (int off = 16; off > 0; off >>= 1) acc += __shfl_down_sync(0xffffffffu, acc, off);
    }
    if (lane == 0) y[t * max_rank + j] = acc;
  }
}

}  // namespace

cudaError_t LaunchLoraShrinkF32(const float* x, const float* lora_a, const int32_t* rank,
                                const int32_t* slot_of_token, float* y, int64_t num_tokens,
                                int64_t h_in, int64_t max_rank, cudaStream_t stream) {
  dim3 block(32, kWarpsPerBlock);
  dim3 grid(static_cast<unsigned>(num_tokens));
  LoraShrinkKernel<<<grid, block, 0, stream>>>(x, lora_a, rank, slot_of_token, y, h_in, max_rank);
  return cudaGetLastError();
}

}  // namespace moelora
