// y = x · wᵀ where w is stored quantized, as released checkpoints store it:
//   MXFP4 (OCP Microscaling, GPT-OSS's experts): each row of k values as k/32 blocks of 16 bytes
//     (two E2M1 codes a byte, the low nibble first) and one E8M0 scale a block (2^(s - 127));
//   block FP8 (DeepSeek-style "fine-grained" FP8, the Qwen3/Qwen3.5/Step-3.5 FP8 releases): each
//     value one float8_e4m3fn byte, and one f32 scale per block_n × block_k block of the matrix
//     (the checkpoint's `weight_scale_inv`: the value is code × scale).
// The weight is never widened whole: each call dequantizes a few of its rows at a time into a
// buffer of the calling thread (a tile of at most kQuantTileBytes) and multiplies x by that
// tile in f32 (the skinny kernel where the CPU has AVX2 + FMA, a portable loop otherwise), so
// memory holds the quantized bytes only. Dequantization is exact in f32 (E2M1 and E4M3 values
// times a power of two or an f32 scale: MXFP4 exactly, FP8 as one f32 product).
//
// The instruction set is chosen at run time: AVX2 + FMA + F16C where the CPU has them, portable
// C++ otherwise; both give the same dequantized values bit for bit (tests compare them).
#ifndef MOELORA_KERNELS_QUANT_GEMM_H_
#define MOELORA_KERNELS_QUANT_GEMM_H_

#include <cstdint>

#include "absl/status/status.h"

namespace moelora {

enum class QuantFormat : uint8_t { kMxfp4, kFp8Block };

// Elements a block of one MXFP4 scale covers, and the bytes that hold them.
inline constexpr int64_t kMxfp4Block = 32;
inline constexpr int64_t kMxfp4BlockBytes = 16;

// One quantized [n, k] matrix (row r's bytes at data + r · row_bytes).
struct QuantMatrix {
  QuantFormat format = QuantFormat::kMxfp4;
  const uint8_t* data = nullptr;
  int64_t row_bytes = 0;  // MXFP4: at least k / 2; FP8: at least k
  int64_t n = 0, k = 0;   // MXFP4: k a multiple of 32
  // MXFP4: row r's k / 32 scales at e8m0 + r · scale_stride.
  const uint8_t* e8m0 = nullptr;
  // FP8: the scale of the block holding (r, c) at
  // block_scales[(r / block_n) · scale_stride + c / block_k].
  const float* block_scales = nullptr;
  int64_t scale_stride = 0;
  int64_t block_n = 128, block_k = 128;
};

// Rows [r0, r1) of w as f32 into out (row stride ld ≥ k). `vectorized` false forces the portable
// path (tests); true uses AVX2 where the CPU has it.
void DequantizeRows(const QuantMatrix& w, int64_t r0, int64_t r1, float* out, int64_t ld,
                    bool vectorized = true);

// Whether the vectorized dequantization runs on this CPU (AVX2, FMA and F16C).
bool QuantVectorized();

// Up to this many x rows, each weight row is dequantized in registers and multiplied into every
// x row at once (AVX2; FP8 where block_k is a multiple of 16): no tile is written. Such FP8
// products read NaN codes as 480 (the loader refuses checkpoints that hold any).
inline constexpr int64_t kQuantFusedRows = 8;

// The largest tile of dequantized rows one call holds at a time, per thread.
inline constexpr int64_t kQuantTileBytes = 128 * 1024;

struct QuantGemmArgs {
  const float* x = nullptr;  // [m, k], row stride ldx
  int64_t ldx = 0;
  int64_t m = 0;
  QuantMatrix w;
  float* y = nullptr;  // [m, n], row stride ldy
  int64_t ldy = 0;
};

// Output columns [n0, n1) of y = x · wᵀ (overwritten); calls on disjoint column ranges may run
// concurrently. `vectorized` as for DequantizeRows (the product then runs the portable loop too).
void QuantGemmRows(const QuantGemmArgs& a, int64_t n0, int64_t n1, bool vectorized = true);

// INVALID_ARGUMENT naming what is wrong with `a`: sizes, strides, pointers, MXFP4 rows that are
// not whole blocks, FP8 blocks that are not positive.
[[nodiscard]] absl::Status ValidateQuantGemm(const QuantGemmArgs& a);

// The whole of y = x · wᵀ on a CUDA device (every pointer a device pointer; `stream` a
// cudaStream_t or null), the CPU twin's values up to the order of the sums. UNIMPLEMENTED
// without CUDA; INVALID_ARGUMENT as ValidateQuantGemm; INTERNAL on a launch error.
[[nodiscard]] absl::Status QuantGemmCuda(const QuantGemmArgs& a, void* stream);

}  // namespace moelora

#endif  // MOELORA_KERNELS_QUANT_GEMM_H_
