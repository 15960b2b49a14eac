// y = x · wᵀ on the CPU: the skinny kernel (kernels/skinny_gemm.h) for few rows, the wide kernel
// (kernels/wide_gemm.h) for more rows (f32, and bf16 without AMX), AMX (kernels/amx_gemm.h) in
// bf16, ATen otherwise.
#ifndef MOELORA_WORKER_LAYERS_GEMM_H_
#define MOELORA_WORKER_LAYERS_GEMM_H_

#include <ATen/ATen.h>

#include <string>
#include <utility>
#include <vector>

namespace moelora {

// The row bounds between the CPU GEMM routes, each where bench/skinny_gemm measured the faster
// route to change hands (the figures, per CPU: docs/decisions/cpu-gemms-chosen-by-the-cpu-s-
// instruction-sets.md).
// The skinny kernel ahead of at::matmul: f32 with the AVX2 kernel, with the AVX-512 kernel, and
// bf16 on the widened route (whose alternative reads and writes the weight twice more).
inline constexpr int64_t kSkinnyMaxRows = 24;
inline constexpr int64_t kSkinnyMaxRowsAvx512 = 64;
inline constexpr int64_t kSkinnyMaxRowsBf16 = 64;
// bf16 on the native route with the kernel's vdpbf16ps path, ahead of oneDNN on AMX.
inline constexpr int64_t kSkinnyMaxRowsBf16Dp = 2;
// The same without AMX, where oneDNN's bf16 GEMM has only vdpbf16ps too.
inline constexpr int64_t kSkinnyMaxRowsBf16DpNoAmx = 24;
// bf16 on the native route where the CPU has AMX (kernels/amx_gemm.h): rows up to which the AMX
// kernel serves a product (experts grouped per layer, dense layers), ahead of both of the above.
inline constexpr int64_t kAmxMaxRows = 256;
// f32 with AVX-512: the wide kernel from kWideMinRows (below, the prefetching skinny kernel is
// ahead) to kWideMaxRows (above, OpenBLAS runs at the same rate).
inline constexpr int64_t kWideMinRows = 13;
inline constexpr int64_t kWideMaxRows = 256;
// bf16 with AVX512-BF16 and no AMX: the wide kernel's vdpbf16ps variant between the skinny kernel
// (which ties it up to 24 rows, and keeps those) and oneDNN.
inline constexpr int64_t kWideBf16MinRows = kSkinnyMaxRowsBf16DpNoAmx + 1;
inline constexpr int64_t kWideBf16MaxRows = 128;

// How a CPU bf16 GEMM runs. libtorch 1.13's own bf16 GEMM is fast only where the CPU has
// AVX512-BF16 (oneDNN's bf16 kernels): on an AVX2 EPYC, 8 experts x 24 rows took 417 ms against
// 8 ms through f32; on a Xeon with AVX512-BF16 and AMX it beat both our kernel and widening
// (bench/skinny_gemm --dtype bfloat16, docs/performance.md). So:
//   kNative  (CPU has AVX512-BF16): ATen's bf16 GEMM, except up to kSkinnyMaxRowsBf16Dp rows
//            (kSkinnyMaxRowsBf16DpNoAmx where the CPU has no AMX), which go through the
//            kernel's vdpbf16ps path;
//   kWidened (otherwise): the skinny kernel up to kSkinnyMaxRowsBf16 rows, then f32 BLAS on
//            widened copies, the result rounded back.
// MOELORA_CPU_BF16_GEMM=native|widened overrides the choice (benchmarks, tests); read once.
enum class Bf16Gemm { kNative, kWidened };
Bf16Gemm CpuBf16Gemm();

// The BLAS under ATen's larger f32 products, for the log and the benchmarks: "OpenBLAS
// Cooperlake", with " (OPENBLAS_CORETYPE=Haswell)" where the environment chose the core, or ""
// where the BLAS is not OpenBLAS (symbols looked up with dlsym: nothing links against it).
// *slower_than_cpu is set where that variable holds OpenBLAS to kernels below the CPU's
// instruction set (an AVX2 core on an AVX-512 CPU: a 784-row vision tower on a Zen 5 ran its
// products at 231 GFLOP/s there against 346 with the core OpenBLAS picks itself).
std::string BlasDescription(bool* slower_than_cpu);

// Rows up to which x of this dtype goes through the skinny kernel (0: never).
int64_t SkinnyMaxRows(at::ScalarType x_dtype);

// at::matmul(a, b), except CPU bf16 on the widened route (above), which runs as f32.
at::Tensor CpuMatmul(const at::Tensor& a, const at::Tensor& b);

// x [m, k] · w [n, k]ᵀ -> [m, n] in x's dtype.
at::Tensor MatmulWt(const at::Tensor& x, const at::Tensor& w);
// MatmulWt(x, w) for each w of ws. On the CPU, where every product takes the same kernel, in one
// parallel region with x packed once, each product prefetching the next one's first rows (an
// attention layer's q, k and v: k and v are small, and alone each paid a region's start and
// its streams' ramp-up).
std::vector<at::Tensor> MatmulWtEach(const at::Tensor& x, const std::vector<at::Tensor>& ws);

// For each run r: out rows [begin, end) = x rows [begin, end) · weights[expert[r]]ᵀ, where
// weights is [E, n, k] and out [rows, n] (contiguous, x's dtype). Runs with few rows go through
// the skinny, wide or AMX kernel in one parallel region (the grouped expert GEMM); longer ones
// through at::mm_out.
void GroupedMatmulWt(const at::Tensor& x, const at::Tensor& weights,
                     const std::vector<std::pair<int64_t, int64_t>>& runs,
                     const std::vector<int64_t>& expert, at::Tensor& out);

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_GEMM_H_
