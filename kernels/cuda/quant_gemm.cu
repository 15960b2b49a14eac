// QuantGemmCuda's kernel (kernels/quant_gemm.h): one warp per weight row, eight rows a thread
// block. Each lane dequantizes its share of the row in registers (MXFP4: a whole 32-value block,
// its 16 bytes read by one load, consecutive lanes on consecutive blocks; FP8: 16 codes) and
// multiplies it into up to 8 x rows at once; the lanes' sums meet by warp shuffles. The values
// are the CPU twin's (E2M1 times 2 as integers, then half the E8M0 scale; E4M3 times the block's
// f32 scale), the sums in another order.
#include <cstdint>

#include "kernels/cuda/launch.h"

namespace moelora {
namespace cuda_internal {
namespace {

constexpr int kWarps = 8;  // weight rows per block
constexpr int kXRows = 8;  // x rows per pass
constexpr int kMxfp4Bytes = 16;

__device__ __forceinline__ float HalfE8m0(uint8_t s) {
  return s == 255 ? __int_as_float(0x7fc00000) : ldexpf(1.0f, static_cast<int>(s) - 128);
}

__device__ __forceinline__ float E2m1Twice(uint8_t code) {
  const int mag = code & 7;
  const float v = mag < 4 ? static_cast<float>(mag)
                          : static_cast<float>(4 << ((mag - 4) >> 1)) * ((mag & 1) ? 1.5f : 1.0f);
  return (code & 8) ? -v : v;
}

__device__ __forceinline__ float E4m3(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  float v = e == 0 ? static_cast<float>(m) * 0.001953125f : ldexpf(1.0f + m * 0.125f, e - 7);
  if ((b & 0x7F) == 0x7F) v = __int_as_float(0x7fc00000);
  return (b & 0x80) ? -v : v;
}

__device__ __forceinline__ float WarpSum(float v) {
  for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}

__global__ void QuantGemmKernel(QuantGemmArgsDev a) {
  const int lane = threadIdx.x & 31;
  const int64_t r = static_cast<int64_t>(blockIdx.x) * kWarps + (threadIdx.x >> 5);
  const int64_t i0 = static_cast<int64_t>(blockIdx.y) * kXRows;
  if (r >= a.n) return;
  const int rows = static_cast<int>(a.m - i0 < kXRows ? a.m - i0 : kXRows);
  const uint8_t* q = a.data + r * a.row_bytes;
  float acc[kXRows];
  for (int i = 0; i < kXRows; ++i) acc[i] = 0.0f;
  if (a.mxfp4) {
    const uint8_t* s = a.e8m0 + r * a.scale_stride;
    for (int64_t b = lane; b < a.k / 32; b += 32) {
      const uint4 raw = *reinterpret_cast<const uint4*>(q + b * kMxfp4Bytes);
      const uint32_t words[4] = {raw.x, raw.y, raw.z, raw.w};
      float w[32];
#pragma unroll
      for (int j = 0; j < kMxfp4Bytes; ++j) {
        const uint8_t byte = static_cast<uint8_t>(words[j / 4] >> (8 * (j % 4)));
        w[2 * j] = E2m1Twice(byte & 15);
        w[2 * j + 1] = E2m1Twice(byte >> 4);
      }
      const float h = HalfE8m0(s[b]);
#pragma unroll
      for (int i = 0; i < kXRows; ++i) {
        if (i >= rows) break;
        const float* x = a.x + (i0 + i) * a.ldx + b * 32;
        float t = 0.0f;
#pragma unroll
        for (int j = 0; j < 32; ++j) t = fmaf(w[j], x[j], t);
        acc[i] = fmaf(t, h, acc[i]);
      }
    }
  } else {
    const float* s = a.block_scales + (r / a.block_n) * a.scale_stride;
    for (int64_t c0 = static_cast<int64_t>(lane) * 16; c0 < a.k; c0 += 32 * 16) {
      const int64_t c1 = c0 + 16 < a.k ? c0 + 16 : a.k;
      for (int64_t c = c0; c < c1; ++c) {
        const float w = E4m3(q[c]) * s[c / a.block_k];
#pragma unroll
        for (int i = 0; i < kXRows; ++i) {
          if (i < rows) acc[i] = fmaf(w, a.x[(i0 + i) * a.ldx + c], acc[i]);
        }
      }
    }
  }
#pragma unroll
  for (int i = 0; i < kXRows; ++i) {
    if (i >= rows) break;
    const float v = WarpSum(acc[i]);
    if (lane == 0) a.y[(i0 + i) * a.ldy + r] = v;
  }
}

}  // namespace

cudaError_t LaunchQuantGemm(const QuantGemmArgsDev& a, cudaStream_t stream) {
  if (a.n == 0 || a.m == 0) return cudaSuccess;
  const dim3 grid(static_cast<unsigned>((a.n + kWarps - 1) / kWarps),
                  static_cast<unsigned>((a.m + kXRows - 1) / kXRows));
  QuantGemmKernel<<<grid, kWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

}  // namespace cuda_internal
}  // namespace moelora
