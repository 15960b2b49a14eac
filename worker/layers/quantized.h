// Base weights kept in their checkpoint's quantized storage (MXFP4 experts, block-FP8 weights:
// kernels/quant_gemm.h), and the products that read them, dequantizing tile by tile.
#ifndef MOELORA_WORKER_LAYERS_QUANTIZED_H_
#define MOELORA_WORKER_LAYERS_QUANTIZED_H_

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "kernels/quant_gemm.h"

namespace moelora {

// A weight of logical shape [.., n, k] (a linear's [n, k] or experts' [E, n, k]): codes (uint8,
// MXFP4 [.., n, k / 2], FP8 [.., n, k]) and scales (MXFP4 uint8 [.., n, k / 32]; FP8 f32
// [.., ceil(n / block_n), ceil(k / block_k)]), contiguous, on the CPU.
struct QuantizedWeight {
  QuantFormat format = QuantFormat::kMxfp4;
  at::Tensor codes, scales;
  int64_t block_n = 128, block_k = 128;

  bool defined() const { return codes.defined(); }
  int64_t n() const { return codes.size(-2); }
  int64_t k() const { return format == QuantFormat::kMxfp4 ? 2 * codes.size(-1) : codes.size(-1); }
  // The kernel's view of matrix `e` of a stacked weight (0 for a linear's).
  QuantMatrix Matrix(int64_t e) const;
  // Bytes held (codes and scales).
  int64_t nbytes() const { return codes.nbytes() + scales.nbytes(); }
};

// FAILED_PRECONDITION for `what` (a module's path) on a kernel path: quantized weights are read
// on the CPU path only.
absl::Status QuantizedNeedsCpuPath(const std::string& what);

// x [m, k] (f32 or bf16) · w [n, k]ᵀ -> [m, n] in x's dtype; w a linear's weight.
at::Tensor QuantizedMatmulWt(const at::Tensor& x, const QuantizedWeight& w);

// GroupedMatmulWt (worker/layers/gemm.h) for quantized experts w [E, n, k]: for each run r,
// out rows [begin, end) = x rows [begin, end) · w[expert[r]]ᵀ (out contiguous, x's dtype).
void GroupedQuantizedMatmulWt(const at::Tensor& x, const QuantizedWeight& w,
                              const std::vector<std::pair<int64_t, int64_t>>& runs,
                              const std::vector<int64_t>& expert, at::Tensor& out);

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_QUANTIZED_H_
