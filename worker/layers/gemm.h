// y = x · wᵀ on the CPU: the skinny kernel (kernels/skinny_gemm.h) for few rows, ATen otherwise.
#ifndef MOELORA_WORKER_LAYERS_GEMM_H_
#define MOELORA_WORKER_LAYERS_GEMM_H_

#include <ATen/ATen.h>

#include <utility>
#include <vector>

namespace moelora {

// Rows of x up to which the skinny kernel beats at::matmul on the weights it serves (bench/
// skinny_gemm measures the crossover; docs/performance.md has the figures).
inline constexpr int64_t kSkinnyMaxRows = 24;

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
