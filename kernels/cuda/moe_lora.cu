// Fused MoE with batched multi-LoRA on the GPU (contract in kernels/moe_lora.h). One call runs:
//   1. AlignKernel: counting sort of the T·K assignments by key (expert, slot + 1) in one block;
//      emits per sorted row its source assignment and LoRA index, the inverse map, and
//      the base-GEMM tiles (<= kTileRows rows of one expert each).
//   2. GroupedGemm: h13 = x[token] · w13[e]ᵀ per tile (f32 out), on tensor cores (WMMA) for
//      f16/bf16 when the dims allow, else a SIMT kernel.
//   3. LoRA shrink/expand on gate/up per sorted row (lora_kernels.cuh), added into h13.
//   4. ActKernel: act = dtype(silu(gate) · up) (clamped when swiglu_limit > 0).
//   5. GroupedGemm: y = act · w2[e]ᵀ (f32), then the down LoRA, added into y.
//   6. CombineKernel: out[t] = dtype(Σ_k w[t, k] · y[row(t, k)]), in k order (deterministic).
// Kernels whose grid depends on the routing (the GEMM tiles) are launched with the worst-case
// grid and blocks past the device-side tile count return at once, so nothing waits on the host.
#include <mma.h>

#include <algorithm>

#include "kernels/cuda/launch.h"
#include "kernels/cuda/lora_kernels.cuh"
#include "kernels/internal/moe_lora_workspace.h"

namespace moelora {
namespace cuda_internal {
namespace {

using moe_internal::kTileRows;

constexpr int kAlignThreads = 1024;

// Single block. key(i) = e · S1 + (s + 1) where S1 = S + 1 (1 without LoRA).
__global__ void __launch_bounds__(kAlignThreads)
    AlignKernel(const int32_t* __restrict__ topk_ids, const int32_t* __restrict__ slot_of_token,
                int64_t n, int top_k, int num_experts, int s1, int32_t* __restrict__ sorted_src,
                int32_t* __restrict__ inv, int32_t* __restrict__ row_lora,
                int32_t* __restrict__ tiles, int32_t* __restrict__ num_tiles) {
  extern __shared__ int32_t cnt[];  // [num_keys]
  __shared__ int32_t part[kAlignThreads];
  const int tid = threadIdx.x;
  const int num_keys = num_experts * s1;
  auto key_of = [&](int64_t i, int32_t* e_out, int32_t* s_out) {
    const int32_t e = topk_ids[i];
    const int32_t s = slot_of_token ? slot_of_token[i / top_k] : -1;
    *e_out = e;
    *s_out = s;
    return e * s1 + (s1 > 1 ? s + 1 : 0);
  };
  for (int k = tid; k < num_keys; k += kAlignThreads) cnt[k] = 0;
  __syncthreads();
  for (int64_t i = tid; i < n; i += kAlignThreads) {
    int32_t e, s;
    atomicAdd(&cnt[key_of(i, &e, &s)], 1);
  }
  __syncthreads();
  // Exclusive scan: each thread sums a contiguous chunk of keys, the chunk sums are scanned
  // (Hillis-Steele), then each thread rewrites its chunk as offsets.
  const int chunk = (num_keys + kAlignThreads - 1) / kAlignThreads;
  const int k0 = min(tid * chunk, num_keys), k1 = min(k0 + chunk, num_keys);
  int32_t local = 0;
  for (int k = k0; k < k1; ++k) local += cnt[k];
  part[tid] = local;
  __syncthreads();
  for (int off = 1; off < kAlignThreads; off <<= 1) {
    const int32_t v = tid >= off ? part[tid - off] : 0;
    __syncthreads();
    part[tid] += v;
    __syncthreads();
  }
  int32_t base = tid > 0 ? part[tid - 1] : 0;
  for (int k = k0; k < k1; ++k) {
    const int32_t c = cnt[k];
    cnt[k] = base;
    base += c;
  }
  __syncthreads();
  // Tiles of one expert each (its keys are contiguous: all slots of expert e).
  if (tid == 0) {
    int32_t t = 0;
    for (int e = 0; e < num_experts; ++e) {
      const int32_t b = cnt[e * s1];
      const int32_t end = e + 1 < num_experts ? cnt[(e + 1) * s1] : static_cast<int32_t>(n);
      for (int32_t r = b; r < end; r += kTileRows) {
        tiles[3 * t] = e;
        tiles[3 * t + 1] = r;
        tiles[3 * t + 2] = min(r + static_cast<int32_t>(kTileRows), end);
        ++t;
      }
    }
    *num_tiles = t;
  }
  __syncthreads();
  for (int64_t i = tid; i < n; i += kAlignThreads) {
    int32_t e, s;
    const int32_t pos = atomicAdd(&cnt[key_of(i, &e, &s)], 1);
    sorted_src[pos] = static_cast<int32_t>(i);
    inv[i] = pos;
    row_lora[pos] = s >= 0 ? s * num_experts + e : -1;
  }
}

// out[row, c] = Σ_k in[src(row), k] · w[e, c, k] for the rows of each tile, f32 out. src(row) =
// gather ? gather[row] / gather_div : row.
constexpr int kGemmWarps = 4;
constexpr int kGemmThreads = 32 * kGemmWarps;
constexpr int kWmmaColsPerWarp = 32;  // two 16x16 accumulators
constexpr int kWmmaCols = kGemmWarps * kWmmaColsPerWarp;
constexpr int kKStep = 32;

// Tensor-core path: requires k_dim % 16 == 0, n_dim % 16 == 0 and 32-byte aligned w.
template <typename T>
__global__ void __launch_bounds__(kGemmThreads)
    GroupedGemmWmma(const T* __restrict__ in, int64_t in_stride, const int32_t* __restrict__ gather,
                    int gather_div, const T* __restrict__ w, const int32_t* __restrict__ tiles,
                    const int32_t* __restrict__ num_tiles, float* __restrict__ out,
                    int64_t out_stride, int64_t n_dim, int64_t k_dim) {
  using namespace nvcuda;
  const int tile = blockIdx.x;
  if (tile >= *num_tiles) return;
  const int32_t e = tiles[3 * tile], rb = tiles[3 * tile + 1], re = tiles[3 * tile + 2];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int64_t n0 = static_cast<int64_t>(blockIdx.y) * kWmmaCols + warp * kWmmaColsPerWarp;
  __shared__ __align__(32) T as[kTileRows][kKStep];
  __shared__ __align__(32) float cs[kGemmWarps][kTileRows][kWmmaColsPerWarp];
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2];
  wmma::fill_fragment(acc[0], 0.0f);
  wmma::fill_fragment(acc[1], 0.0f);
  const T* we = w + static_cast<int64_t>(e) * n_dim * k_dim;
  for (int64_t k0 = 0; k0 < k_dim; k0 += kKStep) {
    for (int idx = threadIdx.x; idx < kTileRows * kKStep; idx += kGemmThreads) {
      const int r = idx / kKStep, kk = idx % kKStep;
      const int64_t row = rb + r, k = k0 + kk;
      T v = FromF<T>(0.0f);
      if (row < re && k < k_dim) {
        const int64_t src = gather ? gather[row] / gather_div : row;
        v = in[src * in_stride + k];
      }
      as[r][kk] = v;
    }
    __syncthreads();
#pragma unroll
    for (int sub = 0; sub < kKStep / 16; ++sub) {
      const int64_t k = k0 + sub * 16;
      if (k >= k_dim) break;
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::load_matrix_sync(a, &as[0][sub * 16], kKStep);
#pragma unroll
      for (int f = 0; f < 2; ++f) {
        const int64_t n = n0 + f * 16;
        if (n >= n_dim) continue;  // warp-uniform
        // Bᵀ = w[e] is [n_dim, k_dim] row-major, i.e. B [k_dim, n_dim] column-major.
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;
        wmma::load_matrix_sync(b, we + n * k_dim + k, static_cast<unsigned>(k_dim));
        wmma::mma_sync(acc[f], a, b, acc[f]);
      }
    }
    __syncthreads();
  }
#pragma unroll
  for (int f = 0; f < 2; ++f) {
    wmma::store_matrix_sync(&cs[warp][0][f * 16], acc[f], kWmmaColsPerWarp, wmma::mem_row_major);
  }
  __syncwarp();
  for (int idx = lane; idx < kTileRows * kWmmaColsPerWarp; idx += 32) {
    const int r = idx / kWmmaColsPerWarp, c = idx % kWmmaColsPerWarp;
    const int64_t row = rb + r, col = n0 + c;
    if (row < re && col < n_dim) out[row * out_stride + col] = cs[warp][r][c];
  }
}

// SIMT path for any shape and f32: one thread per output column, kTileRows accumulators.
template <typename T>
__global__ void __launch_bounds__(kGemmThreads)
    GroupedGemmSimt(const T* __restrict__ in, int64_t in_stride, const int32_t* __restrict__ gather,
                    int gather_div, const T* __restrict__ w, const int32_t* __restrict__ tiles,
                    const int32_t* __restrict__ num_tiles, float* __restrict__ out,
                    int64_t out_stride, int64_t n_dim, int64_t k_dim) {
  const int tile = blockIdx.x;
  if (tile >= *num_tiles) return;
  const int32_t e = tiles[3 * tile], rb = tiles[3 * tile + 1], re = tiles[3 * tile + 2];
  const int64_t n = static_cast<int64_t>(blockIdx.y) * kGemmThreads + threadIdx.x;
  __shared__ float as[kTileRows][kKStep];
  float acc[kTileRows];
#pragma unroll
  for (int r = 0; r < kTileRows; ++r) acc[r] = 0.0f;
  const T* wn = w + (static_cast<int64_t>(e) * n_dim + n) * k_dim;
  for (int64_t k0 = 0; k0 < k_dim; k0 += kKStep) {
    for (int idx = threadIdx.x; idx < kTileRows * kKStep; idx += kGemmThreads) {
      const int r = idx / kKStep, kk = idx % kKStep;
      const int64_t row = rb + r, k = k0 + kk;
      float v = 0.0f;
      if (row < re && k < k_dim) {
        const int64_t src = gather ? gather[row] / gather_div : row;
        v = ToF(in[src * in_stride + k]);
      }
      as[r][kk] = v;
    }
    __syncthreads();
    if (n < n_dim) {
      const int64_t kn = min(static_cast<int64_t>(kKStep), k_dim - k0);
      for (int64_t kk = 0; kk < kn; ++kk) {
        const float wv = ToF(wn[k0 + kk]);
#pragma unroll
        for (int r = 0; r < kTileRows; ++r) acc[r] += as[r][kk] * wv;
      }
    }
    __syncthreads();
  }
  if (n >= n_dim) return;
  for (int r = 0; r < kTileRows && rb + r < re; ++r) out[(rb + r) * out_stride + n] = acc[r];
}

template <typename T>
bool CanUseWmma(const T* w, int64_t n_dim, int64_t k_dim) {
  return sizeof(T) == 2 && n_dim % 16 == 0 && k_dim % 16 == 0 &&
         reinterpret_cast<uintptr_t>(w) % 32 == 0;
}

template <typename T>
cudaError_t LaunchGroupedGemm(const T* in, int64_t in_stride, const int32_t* gather, int gather_div,
                              const T* w, const int32_t* tiles, const int32_t* num_tiles,
                              int64_t max_tiles, float* out, int64_t out_stride, int64_t n_dim,
                              int64_t k_dim, cudaStream_t stream) {
  if constexpr (sizeof(T) == 2) {
    if (CanUseWmma(w, n_dim, k_dim)) {
      const dim3 grid(static_cast<unsigned>(max_tiles),
                      static_cast<unsigned>((n_dim + kWmmaCols - 1) / kWmmaCols));
      GroupedGemmWmma<T><<<grid, kGemmThreads, 0, stream>>>(
          in, in_stride, gather, gather_div, w, tiles, num_tiles, out, out_stride, n_dim, k_dim);
      return cudaGetLastError();
    }
  }
  const dim3 grid(static_cast<unsigned>(max_tiles),
                  static_cast<unsigned>((n_dim + kGemmThreads - 1) / kGemmThreads));
  GroupedGemmSimt<T><<<grid, kGemmThreads, 0, stream>>>(in, in_stride, gather, gather_div, w, tiles,
                                                        num_tiles, out, out_stride, n_dim, k_dim);
  return cudaGetLastError();
}

template <typename T>
__global__ void ActKernel(const float* __restrict__ h13, T* __restrict__ act, int64_t rows,
                          int64_t inter, float limit) {
  const int64_t total = rows * inter;
  for (int64_t idx = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; idx < total;
       idx += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int64_t r = idx / inter, c = idx % inter;
    const float g = h13[r * 2 * inter + c], u = h13[r * 2 * inter + inter + c];
    float a = g / (1.0f + __expf(-g)), v = u;
    if (limit > 0.0f) {
      a = fminf(a, limit);
      v = fminf(fmaxf(v, -limit), limit);
    }
    act[idx] = FromF<T>(a * v);
  }
}

constexpr int kCombineThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kCombineThreads)
    CombineKernel(const float* __restrict__ y, const int32_t* __restrict__ inv,
                  const float* __restrict__ topk_weights, T* __restrict__ out, int64_t hidden,
                  int top_k) {
  const int64_t t = blockIdx.x;
  const int64_t h = static_cast<int64_t>(blockIdx.y) * kCombineThreads + threadIdx.x;
  if (h >= hidden) return;
  float s = 0.0f;
  for (int k = 0; k < top_k; ++k) {
    s += topk_weights[t * top_k + k] * y[static_cast<int64_t>(inv[t * top_k + k]) * hidden + h];
  }
  out[t * hidden + h] = FromF<T>(s);
}

#define MOELORA_CUDA_TRY(...)               \
  do {                                      \
    const cudaError_t err_ = (__VA_ARGS__); \
    if (err_ != cudaSuccess) return err_;   \
  } while (false)

template <typename T>
cudaError_t Run(const MoeArgs& a, cudaStream_t stream) {
  const int64_t T_ = a.num_tokens, K = a.top_k, E = a.num_experts, H = a.hidden, I = a.inter,
                R = a.max_rank, N = T_ * K;
  const bool lora = a.slot_of_token != nullptr && (a.num_gate_up > 0 || a.has_down);
  const int s1 = lora ? static_cast<int>(a.num_slots) + 1 : 1;
  const auto L = moe_internal::ComputeMoeWorkspace(T_, K, E, H, I, R, sizeof(T));
  auto* ws = static_cast<uint8_t*>(a.workspace);
  auto* sorted_src = reinterpret_cast<int32_t*>(ws + L.sorted_src);
  auto* inv = reinterpret_cast<int32_t*>(ws + L.inv);
  auto* row_lora = reinterpret_cast<int32_t*>(ws + L.row_lora);
  auto* tiles = reinterpret_cast<int32_t*>(ws + L.tiles);
  auto* num_tiles = reinterpret_cast<int32_t*>(ws + L.num_tiles);
  auto* h13 = reinterpret_cast<float*>(ws + L.h13);
  auto* act = reinterpret_cast<T*>(ws + L.act);
  auto* y = reinterpret_cast<float*>(ws + L.y);
  auto* mid = reinterpret_cast<float*>(ws + L.lora_mid);
  const auto* x = static_cast<const T*>(a.x);

  const size_t shmem = static_cast<size_t>(E * s1) * sizeof(int32_t);
  AlignKernel<<<1, kAlignThreads, shmem, stream>>>(a.topk_ids, lora ? a.slot_of_token : nullptr, N,
                                                   static_cast<int>(K), static_cast<int>(E), s1,
                                                   sorted_src, inv, row_lora, tiles, num_tiles);
  MOELORA_CUDA_TRY(cudaGetLastError());

  MOELORA_CUDA_TRY(LaunchGroupedGemm<T>(x, H, sorted_src, static_cast<int>(K),
                                        static_cast<const T*>(a.w13), tiles, num_tiles, L.max_tiles,
                                        h13, 2 * I, 2 * I, H, stream));
  if (lora && a.num_gate_up > 0) {
    // Gate and up (2D wrapper) read the same rows of x: one shrink launch for both.
    ShrinkProj<T> proj[kShrinkMaxProj];
    for (int p = 0; p < a.num_gate_up; ++p) {
      proj[p] = {static_cast<const T*>(a.gate_up[p].a_t), a.gate_up[p].rank, mid + p * R};
    }
    MOELORA_CUDA_TRY(LaunchShrink<T>(N, x, H, sorted_src, static_cast<int>(K), row_lora, proj,
                                     a.num_gate_up, 2 * R, H, R, stream));
    for (int p = 0; p < a.num_gate_up; ++p) {
      const MoeProjArgs& pr = a.gate_up[p];
      MOELORA_CUDA_TRY(LaunchExpand<T, float>(N, mid + p * R, 2 * R, row_lora,
                                              static_cast<const T*>(pr.b_t), pr.rank,
                                              h13 + pr.out_col, 2 * I, pr.out_dim, R, stream));
    }
  }
  {
    const int64_t total = N * I;
    const int blocks = static_cast<int>(std::min<int64_t>((total + 255) / 256, 65536));
    ActKernel<T><<<blocks, 256, 0, stream>>>(h13, act, N, I, a.swiglu_limit);
    MOELORA_CUDA_TRY(cudaGetLastError());
  }
  MOELORA_CUDA_TRY(LaunchGroupedGemm<T>(act, I, nullptr, 1, static_cast<const T*>(a.w2), tiles,
                                        num_tiles, L.max_tiles, y, H, H, I, stream));
  if (lora && a.has_down) {
    const MoeProjArgs& pr = a.down;
    const ShrinkProj<T> down{static_cast<const T*>(pr.a_t), pr.rank, mid};
    MOELORA_CUDA_TRY(
        LaunchShrink<T>(N, act, I, nullptr, 1, row_lora, &down, 1, 2 * R, I, R, stream));
    MOELORA_CUDA_TRY(LaunchExpand<T, float>(N, mid, 2 * R, row_lora, static_cast<const T*>(pr.b_t),
                                            pr.rank, y + pr.out_col, H, pr.out_dim, R, stream));
  }
  const dim3 grid(static_cast<unsigned>(T_),
                  static_cast<unsigned>((H + kCombineThreads - 1) / kCombineThreads));
  CombineKernel<T><<<grid, kCombineThreads, 0, stream>>>(
      y, inv, a.topk_weights, static_cast<T*>(a.out), H, static_cast<int>(K));
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchMoeLora(const MoeArgs& a, cudaStream_t stream) {
  return DispatchElem(a.type, [&](auto tag) { return Run<decltype(tag)>(a, stream); });
}

}  // namespace cuda_internal
}  // namespace moelora
