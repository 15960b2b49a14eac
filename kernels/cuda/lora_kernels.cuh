// Device code shared by kernels/cuda/bgmv.cu and kernels/cuda/moe_lora.cu: dtype conversions
// and the row-wise LoRA shrink and expand kernels. A "row" is a token (dense BGMV) or a sorted
// (token, expert) assignment (MoE); row_lora[i] names the LoRA of row i (an index into a_t/b_t
// and rank: the slot for dense layers, slot·E + expert for experts), -1 for none.
#ifndef MOELORA_KERNELS_CUDA_LORA_KERNELS_CUH_
#define MOELORA_KERNELS_CUDA_LORA_KERNELS_CUH_

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "kernels/cuda/launch.h"

namespace moelora {
namespace cuda_internal {

__device__ __forceinline__ float ToF(float v) { return v; }
__device__ __forceinline__ float ToF(__half v) { return __half2float(v); }
__device__ __forceinline__ float ToF(__nv_bfloat16 v) { return __bfloat162float(v); }

template <typename T>
__device__ __forceinline__ T FromF(float v);
template <>
__device__ __forceinline__ float FromF<float>(float v) {
  return v;
}
template <>
__device__ __forceinline__ __half FromF<__half>(float v) {
  return __float2half_rn(v);
}
template <>
__device__ __forceinline__ __nv_bfloat16 FromF<__nv_bfloat16>(float v) {
  return __float2bfloat16_rn(v);
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int off = 16; off > 0; off >>= 1) v += __shfl_down_sync(0xffffffffu, v, off);
  return v;
}

constexpr int kShrinkThreads = 128;
constexpr int kShrinkWarps = kShrinkThreads / 32;
constexpr int kExpandThreads = 256;
constexpr int kMaxRank = 64;

// mid[i, j] = Σ_k a_t[l, k, j] · in[src(i), k] for j < rank[l], 0 for rank[l] <= j < R; rows
// without a LoRA are left alone. One block per row; each thread keeps RB partial sums (RB >= R:
// 16, 32 or 64) over a strided slice of k, reading a_t's row k (R contiguous values: the warp
// reads one contiguous span), then the block reduces. src(i) = gather ? gather[i] / gather_div
// : i.
template <typename T, int RB>
__global__ void __launch_bounds__(kShrinkThreads)
    ShrinkKernel(const T* __restrict__ in, int64_t in_stride, const int32_t* __restrict__ gather,
                 int gather_div, const int32_t* __restrict__ row_lora, const T* __restrict__ a_t,
                 const int32_t* __restrict__ rank, float* __restrict__ mid, int64_t mid_stride,
                 int64_t in_dim, int64_t R) {
  const int64_t i = blockIdx.x;
  const int32_t l = row_lora[i];
  if (l < 0) return;  // uniform over the block
  const int r = rank[l];
  float* m = mid + i * mid_stride;
  if (r == 0) {
    for (int j = threadIdx.x; j < R; j += kShrinkThreads) m[j] = 0.0f;
    return;
  }
  const int64_t src = gather ? gather[i] / gather_div : i;
  const T* x = in + src * in_stride;
  const T* a = a_t + static_cast<int64_t>(l) * in_dim * R;
  float acc[RB];
#pragma unroll
  for (int j = 0; j < RB; ++j) acc[j] = 0.0f;
  for (int64_t k = threadIdx.x; k < in_dim; k += kShrinkThreads) {
    const float xv = ToF(x[k]);
    const T* ak = a + k * R;
#pragma unroll
    for (int j = 0; j < RB; ++j) {
      if (j < r) acc[j] += ToF(ak[j]) * xv;
    }
  }
  __shared__ float part[kShrinkWarps][RB];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
#pragma unroll
  for (int j = 0; j < RB; ++j) {
    const float v = WarpSum(acc[j]);
    if (lane == 0) part[warp][j] = v;
  }
  __syncthreads();
  for (int j = threadIdx.x; j < R; j += kShrinkThreads) {
    float v = 0.0f;
    if (j < r) {
#pragma unroll
      for (int w = 0; w < kShrinkWarps; ++w) v += part[w][j];
    }
    m[j] = v;
  }
}

// out[i, c] += Σ_j b_t[l, j, c] · mid[i, j] for c < out_dim; rows without a LoRA untouched. Grid
// (rows, ceil(out_dim / kExpandThreads)); one thread per output column: the warp reads
// contiguous b_t. OutT is the compute dtype (dense layers) or f32 (MoE intermediates).
template <typename T, typename OutT>
__global__ void __launch_bounds__(kExpandThreads)
    ExpandKernel(const float* __restrict__ mid, int64_t mid_stride,
                 const int32_t* __restrict__ row_lora, const T* __restrict__ b_t,
                 const int32_t* __restrict__ rank, OutT* __restrict__ out, int64_t out_stride,
                 int64_t out_dim, int64_t R) {
  const int64_t i = blockIdx.x;
  const int32_t l = row_lora[i];
  if (l < 0) return;
  const int r = rank[l];
  if (r == 0) return;
  __shared__ float m[kMaxRank];
  for (int j = threadIdx.x; j < r; j += kExpandThreads) m[j] = mid[i * mid_stride + j];
  __syncthreads();
  const int64_t c = static_cast<int64_t>(blockIdx.y) * kExpandThreads + threadIdx.x;
  if (c >= out_dim) return;
  const T* b = b_t + static_cast<int64_t>(l) * R * out_dim + c;
  float acc = 0.0f;
  for (int j = 0; j < r; ++j) acc += m[j] * ToF(b[j * out_dim]);
  OutT* o = out + i * out_stride + c;
  *o = FromF<OutT>(ToF(*o) + acc);
}

// Calls fn(T{}) with T the element type `type` names (float, __half or __nv_bfloat16).
template <typename Fn>
cudaError_t DispatchElem(ElemType type, Fn&& fn) {
  switch (type) {
    case ElemType::kF32:
      return fn(float{});
    case ElemType::kF16:
      return fn(__half{});
    case ElemType::kBF16:
      return fn(__nv_bfloat16{});
  }
  return cudaErrorInvalidValue;
}

// Launches ShrinkKernel with the smallest register bucket that holds R (R <= kMaxRank).
template <typename T>
cudaError_t LaunchShrink(int64_t rows, const T* in, int64_t in_stride, const int32_t* gather,
                         int gather_div, const int32_t* row_lora, const T* a_t, const int32_t* rank,
                         float* mid, int64_t mid_stride, int64_t in_dim, int64_t R,
                         cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows));
  if (R <= 16) {
    ShrinkKernel<T, 16><<<grid, kShrinkThreads, 0, stream>>>(
        in, in_stride, gather, gather_div, row_lora, a_t, rank, mid, mid_stride, in_dim, R);
  } else if (R <= 32) {
    ShrinkKernel<T, 32><<<grid, kShrinkThreads, 0, stream>>>(
        in, in_stride, gather, gather_div, row_lora, a_t, rank, mid, mid_stride, in_dim, R);
  } else {
    ShrinkKernel<T, 64><<<grid, kShrinkThreads, 0, stream>>>(
        in, in_stride, gather, gather_div, row_lora, a_t, rank, mid, mid_stride, in_dim, R);
  }
  return cudaGetLastError();
}

template <typename T, typename OutT>
cudaError_t LaunchExpand(int64_t rows, const float* mid, int64_t mid_stride,
                         const int32_t* row_lora, const T* b_t, const int32_t* rank, OutT* out,
                         int64_t out_stride, int64_t out_dim, int64_t R, cudaStream_t stream) {
  const dim3 grid(static_cast<unsigned>(rows),
                  static_cast<unsigned>((out_dim + kExpandThreads - 1) / kExpandThreads));
  ExpandKernel<T, OutT><<<grid, kExpandThreads, 0, stream>>>(mid, mid_stride, row_lora, b_t, rank,
                                                             out, out_stride, out_dim, R);
  return cudaGetLastError();
}

}  // namespace cuda_internal
}  // namespace moelora

#endif  // MOELORA_KERNELS_CUDA_LORA_KERNELS_CUH_
