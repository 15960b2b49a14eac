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

// One shrink projection: its A (transposed, [L, in_dim, R]), ranks [L] and where its rank-sized
// intermediate goes (mid + i · mid_stride for row i).
template <typename T>
struct ShrinkProj {
  const T* a_t;
  const int32_t* rank;
  float* mid;
};
constexpr int kShrinkMaxProj = 2;  // gate and up of the 2D expert wrapper, in one launch
constexpr int kShrinkRows = 8;     // rows per block: A is read once per run of rows of one LoRA
constexpr int kShrinkChunk = 128;  // input values staged in shared memory per row and pass

// mid[i, j] = Σ_k a_t[l, k, j] · in[src(i), k] for j < rank[l], 0 for rank[l] <= j < R; rows
// without a LoRA are left alone. Block (b, p) handles rows [b·8, b·8 + 8) for projection p. Its
// rows fall into runs of one LoRA index l (rows are sorted by (expert, slot) on the MoE path, and
// a prompt's tokens share a slot on the dense path); per run, each warp takes every fourth k of
// a staged chunk of the inputs and its lanes read a_t's row k (R contiguous values: one
// coalesced load per warp), so a value of A is read once per run and used for all its rows.
// Lane q·32 + lane keeps the partial sums of column j = lane + 32·q for each row; the block
// then sums the four warps. src(i) = gather ? gather[i] / gather_div : i.
template <typename T>
__global__ void __launch_bounds__(kShrinkThreads)
    ShrinkKernel(const T* __restrict__ in, int64_t in_stride, const int32_t* __restrict__ gather,
                 int gather_div, const int32_t* __restrict__ row_lora, ShrinkProj<T> p0,
                 ShrinkProj<T> p1, int64_t mid_stride, int64_t rows, int64_t in_dim, int64_t R) {
  const ShrinkProj<T> pr = blockIdx.y == 0 ? p0 : p1;
  const int64_t r0 = static_cast<int64_t>(blockIdx.x) * kShrinkRows;
  const int64_t r1 = min(r0 + kShrinkRows, rows);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  __shared__ float xs[kShrinkRows][kShrinkChunk];
  __shared__ float part[kShrinkWarps][kShrinkRows][kMaxRank];
  __shared__ int64_t src[kShrinkRows];
  for (int64_t s = r0; s < r1;) {
    // The run [s, e) of rows with LoRA index l (uniform over the block).
    const int32_t l = row_lora[s];
    int64_t e = s + 1;
    while (e < r1 && row_lora[e] == l) ++e;
    const int c = static_cast<int>(e - s);
    if (l < 0) {
      s = e;
      continue;
    }
    const int r = pr.rank[l];
    if (r == 0) {
      for (int idx = threadIdx.x; idx < c * R; idx += kShrinkThreads) {
        pr.mid[(s + idx / R) * mid_stride + idx % R] = 0.0f;
      }
      s = e;
      continue;
    }
    if (threadIdx.x < c) {
      const int64_t i = s + threadIdx.x;
      src[threadIdx.x] = gather ? gather[i] / gather_div : i;
    }
    const T* a = pr.a_t + static_cast<int64_t>(l) * in_dim * R;
    float acc[kShrinkRows][2];
#pragma unroll
    for (int m = 0; m < kShrinkRows; ++m) acc[m][0] = acc[m][1] = 0.0f;
    const int j0 = lane, j1 = lane + 32;
    for (int64_t k0 = 0; k0 < in_dim; k0 += kShrinkChunk) {
      const int kn = static_cast<int>(min(static_cast<int64_t>(kShrinkChunk), in_dim - k0));
      __syncthreads();  // src written; the previous chunk's readers done
      for (int idx = threadIdx.x; idx < c * kShrinkChunk; idx += kShrinkThreads) {
        const int m = idx / kShrinkChunk, kk = idx % kShrinkChunk;
        xs[m][kk] = kk < kn ? ToF(in[src[m] * in_stride + k0 + kk]) : 0.0f;
      }
      __syncthreads();
      for (int kk = warp; kk < kn; kk += kShrinkWarps) {
        const T* ak = a + (k0 + kk) * R;
        const float a0 = j0 < r ? ToF(ak[j0]) : 0.0f;
        const float a1 = j1 < r ? ToF(ak[j1]) : 0.0f;
#pragma unroll
        for (int m = 0; m < kShrinkRows; ++m) {
          if (m < c) {
            const float xv = xs[m][kk];
            acc[m][0] += a0 * xv;
            acc[m][1] += a1 * xv;
          }
        }
      }
    }
#pragma unroll
    for (int m = 0; m < kShrinkRows; ++m) {
      if (m < c) {
        if (j0 < R) part[warp][m][j0] = acc[m][0];
        if (j1 < R) part[warp][m][j1] = acc[m][1];
      }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < c * R; idx += kShrinkThreads) {
      const int m = idx / static_cast<int>(R), j = idx % static_cast<int>(R);
      float v = 0.0f;
      if (j < r) {
#pragma unroll
        for (int w = 0; w < kShrinkWarps; ++w) v += part[w][m][j];
      }
      pr.mid[(s + m) * mid_stride + j] = v;
    }
    __syncthreads();  // part and src are reused by the next run
    s = e;
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

// Launches ShrinkKernel for one or two projections that read the same rows (R <= kMaxRank).
template <typename T>
cudaError_t LaunchShrink(int64_t rows, const T* in, int64_t in_stride, const int32_t* gather,
                         int gather_div, const int32_t* row_lora, const ShrinkProj<T>* proj,
                         int num_proj, int64_t mid_stride, int64_t in_dim, int64_t R,
                         cudaStream_t stream) {
  if (num_proj < 1 || num_proj > kShrinkMaxProj || R > kMaxRank) return cudaErrorInvalidValue;
  if (rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((rows + kShrinkRows - 1) / kShrinkRows),
                  static_cast<unsigned>(num_proj));
  ShrinkKernel<T><<<grid, kShrinkThreads, 0, stream>>>(in, in_stride, gather, gather_div, row_lora,
                                                       proj[0], proj[num_proj - 1], mid_stride,
                                                       rows, in_dim, R);
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
