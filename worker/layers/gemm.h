// y = x · wᵀ on the CPU: the skinny kernel (kernels/skinny_gemm.h) for few rows, ATen otherwise.
#ifndef MOELORA_WORKER_LAYERS_GEMM_H_
#define MOELORA_WORKER_LAYERS_GEMM_H_

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace moelora {

// Rows of x up to which the skinny kernel beats at::matmul on the weights it serves (bench/
// skinny_gemm measures the crossover; docs/performance.md has the figures). bf16 goes further:
// its alternative is f32 BLAS on widened copies of the weight (CpuMatmul), which reads and
// writes the weight twice more.
inline constexpr int64_t kSkinnyMaxRows = 24;
inline constexpr int64_t kSkinnyMaxRowsBf16 = 64;

// at::matmul(a, b), except bf16 on the CPU, which runs as f32 (widened copies, the result
// rounded back): libtorch 1.13's bf16 GEMM has no fast path on CPUs without AVX512-BF16
// (bench/skinny_gemm --dtype bfloat16: 8 experts x 24 rows took 417 ms, 8 ms through f32).
at::Tensor CpuMatmul(const at::Tensor& a, const at::Tensor& b);

// x [m, k] · w [n, k]ᵀ -> [m, n] in x's dtype.
at::Tensor MatmulWt(const at::Tensor& x, const at::Tensor& w);

// For each run r: out rows [begin, end) = x rows [begin, end) · weights[expert[r]]ᵀ, where
// weights is [E, n, k] and out [rows, n] (contiguous, x's dtype). Runs with few rows go through
// the skinny kernel in one parallel region (the grouped expert GEMM); longer ones through
// at::mm_out.
void GroupedMatmulWt(const at::Tensor& x, const at::Tensor& weights,
                     const std::vector<std::pair<int64_t, int64_t>>& runs,
                     const std::vector<int64_t>& expert, at::Tensor& out);

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_GEMM_H_
