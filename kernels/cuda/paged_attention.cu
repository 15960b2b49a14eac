// PagedAttentionCuda's kernel (kernels/paged_attention.h): one thread block per (query row, query
// head). The keys are taken in tiles of the block's width: each thread scores one key of the tile
// against the query (held in shared memory), the tile's maximum and exponentials fold into a
// running maximum and denominator (the online softmax), and then each of the first d threads adds
// the tile's weighted values to its output element. The same arithmetic as the CPU twin up to the
// order of the sums.
#include <cuda_bf16.h>

#include <cfloat>

#include "kernels/cuda/launch.h"

namespace moelora {
namespace cuda_internal {
namespace {

constexpr int kThreads = 256;  // keys per tile, and the largest d

__device__ __forceinline__ float Load(const float* p) { return *p; }
__device__ __forceinline__ float Load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

template <typename T>
__global__ void PagedAttentionKernel(PagedAttentionArgsDev a) {
  const int64_t row = blockIdx.x, head = blockIdx.y;
  const int tid = threadIdx.x;
  __shared__ float q[kThreads];
  __shared__ float p[kThreads];
  __shared__ float red[kThreads];
  const int64_t d = a.d, groups = a.hq / a.hkv, g = head / groups;
  if (tid < d) q[tid] = a.q[(row * a.hq + head) * d + tid];
  const int64_t pos = a.pos_of_row[row];
  const int32_t* table = a.block_tables + static_cast<int64_t>(a.seq_of_row[row]) * a.max_blocks;
  const int64_t lo = a.window > 0 ? max(int64_t{0}, pos - a.window + 1) : 0;
  const T* K = static_cast<const T*>(a.k);
  const T* V = static_cast<const T*>(a.v);
  float m = -FLT_MAX, l = 0.0f, acc = 0.0f;  // acc: output element tid (tid < d)
  bool seen = false;
  __syncthreads();
  for (int64_t j0 = lo; j0 <= pos; j0 += kThreads) {
    const int64_t j = j0 + tid;
    float s = -FLT_MAX;
    if (j <= pos) {
      const int64_t at =
          (static_cast<int64_t>(table[j / a.block_size]) * a.block_size + j % a.block_size) *
              a.hkv +
          g;
      const T* kr = K + at * d;
      float dot = 0.0f;
      for (int64_t c = 0; c < d; ++c) dot += q[c] * Load(kr + c);
      s = dot * a.scale;
    }
    red[tid] = s;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w >>= 1) {
      if (tid < w) red[tid] = fmaxf(red[tid], red[tid + w]);
      __syncthreads();
    }
    const float tile_max = red[0];
    __syncthreads();
    const float m2 = fmaxf(m, tile_max);
    const float corr = seen ? __expf(m - m2) : 0.0f;
    const float e = j <= pos ? __expf(s - m2) : 0.0f;
    p[tid] = e;
    red[tid] = e;
    __syncthreads();
    for (int w = kThreads / 2; w > 0; w >>= 1) {
      if (tid < w) red[tid] += red[tid + w];
      __syncthreads();
    }
    l = l * corr + red[0];
    m = m2;
    seen = true;
    if (tid < d) {
      acc *= corr;
      const int64_t n = min(int64_t{kThreads}, pos + 1 - j0);
      for (int64_t t = 0; t < n; ++t) {
        const int64_t jj = j0 + t;
        const int64_t at =
            (static_cast<int64_t>(table[jj / a.block_size]) * a.block_size + jj % a.block_size) *
                a.hkv +
            g;
        acc += p[t] * Load(V + at * d + tid);
      }
    }
    __syncthreads();
  }
  if (tid < d) {
    float den = l, scale = 1.0f;
    if (a.sinks != nullptr) {
      const float sk = a.sinks[head], m2 = fmaxf(m, sk);
      scale = __expf(m - m2);
      den = l * scale + __expf(sk - m2);
    }
    a.out[(row * a.hq + head) * d + tid] = acc * scale / den;
  }
}

}  // namespace

cudaError_t LaunchPagedAttention(const PagedAttentionArgsDev& a, cudaStream_t stream) {
  if (a.rows == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>(a.rows), static_cast<unsigned>(a.hq));
  if (a.kv_bf16) {
    PagedAttentionKernel<__nv_bfloat16><<<grid, kThreads, 0, stream>>>(a);
  } else {
    PagedAttentionKernel<float><<<grid, kThreads, 0, stream>>>(a);
  }
  return cudaGetLastError();
}

}  // namespace cuda_internal
}  // namespace moelora
