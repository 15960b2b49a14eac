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

// Rows of x up to which the skinny kernel beats at::matmul on the weights it serves (bench/
// skinny_gemm measures the crossover; docs/performance.md has the figures). f32 with the AVX2
// kernel: 24 (an AMD EPYC against OpenBLAS). f32 with the AVX-512 kernel (a Xeon): a dense
// [m, 1024] x [4096, 1024]ᵀ 1.5x OpenBLAS at 32 rows, 1.13x at 64, even at 96; a layer's experts
// grouped 1.26x at 32 rows each, 1.03x at 64, 0.96x at 96 (where the wide kernel below is on, it
// takes f32 products from kWideMinRows rows, ahead of this bound). bf16 on the widened route goes
// to 64: its alternative is f32 BLAS on widened copies of the weight (CpuMatmul), which reads and
// writes the weight twice more.
inline constexpr int64_t kSkinnyMaxRows = 24;
inline constexpr int64_t kSkinnyMaxRowsAvx512 = 64;
inline constexpr int64_t kSkinnyMaxRowsBf16 = 64;
// bf16 on the native route with the kernel's AVX512-BF16 path (vdpbf16ps). On a Xeon, where
// oneDNN's bf16 GEMM runs on AMX, it beat oneDNN's per-expert GEMM at 1 row (3.1–3.8 against
// 4.7–5.3 ms per layer) and 2 (3.9–4.3 against 4.6–4.9), tied at 4 and lost at 8 (bench/
// skinny_gemm, 3 paired runs).
inline constexpr int64_t kSkinnyMaxRowsBf16Dp = 2;
// The same on a CPU with AVX512-BF16 and no AMX (an AMD EPYC 9004, Zen 4), where oneDNN's bf16
// GEMM has only vdpbf16ps too, and is far behind at few rows: bench/skinny_gemm --dtype
// bfloat16, a layer's 32 experts grouped, kernel against ATen, at 4 / 8 / 16 / 24 / 32 rows each:
// 3.9 / 5.0 / 8.2 / 11.3 / 14.1 against 7.0 / 8.3 / 10.5 / 12.7 / 13.6 ms; 128 experts from
// memory at 4 rows 12.6 against 32.1 ms; a dense [m, 1024] x [1024, 1024]ᵀ at 16 / 32 / 64 rows
// 0.17 / 0.30 / 0.54 against 0.23 / 0.29 / 0.48 ms.
inline constexpr int64_t kSkinnyMaxRowsBf16DpNoAmx = 24;
// bf16 on the native route where the CPU has AMX (kernels/amx_gemm.h): rows up to which the AMX
// kernel serves a product (experts grouped per layer, dense layers), ahead of both of the above.
inline constexpr int64_t kAmxMaxRows = 256;
// f32 on a CPU with AVX-512: rows of x from which the wide kernel takes a product ahead of the
// skinny kernel, and up to which it takes it ahead of ATen (OpenBLAS). bench/skinny_gemm, a
// layer's 32 experts grouped, 2 threads: 16 rows 7.0 against the skinny kernel's 8.8 ms, 32
// rows 9.8 against 14.4, 64 rows 18.0 against 26.1 (and OpenBLAS 30.6). From memory (128
// experts, two paired runs): 12 rows 30.3, 30.9 against 31.6, 32.5 ms, and a dense [12, 1024] x
// [4096, 1024]ᵀ 0.60 against 0.65 ms; 8 rows even (29.9, 31.1 against 31.6, 30.7); 2 and 4 rows
// 8–15 % slower (the skinny kernel streams its rows at the read rate, the wide one multiplies
// zero rows). A 512-row dense product in OpenBLAS runs at about the wide kernel's rate (380
// GFLOP/s), so ATen keeps those. Since the skinny kernel prefetches across blocks and products
// it is ahead up to 12 rows: 128 experts from memory, two runs each, wide
// against skinny: 9 rows 34.3, 35.1 / 31.6, 31.8 ms; 10 rows 34.3, 36.1 / 31.7, 32.0; 12 rows
// 35.0, 35.8 / 33.2, 34.1; 13 rows 36.5, 36.7 / 38.2, 39.9 (so the wide kernel from 13); a dense
// [9, 1024] x [1024, 1024]ᵀ 0.189, 0.194 / 0.155, 0.159 ms, the LM head at 11 rows 0.680, 0.681
// / 0.631, 0.643 ms.
inline constexpr int64_t kWideMinRows = 13;
inline constexpr int64_t kWideMaxRows = 256;
// bf16 on the native route where the CPU has AVX512-BF16 but no AMX: the rows of x for which the
// wide kernel's vdpbf16ps variant takes a product, between the skinny kernel (up to
// kSkinnyMaxRowsBf16DpNoAmx) and oneDNN. On a Zen 4 (bench/skinny_gemm --dtype bfloat16, two
// runs each, MOELORA_WIDE_GEMM=1 against 0): a layer's 32 experts grouped at 32 / 48 / 64 / 96 /
// 128 / 256 rows each 11.2, 10.0 / 15.4, 14.5 / 20.8, 20.2 / 29.7, 29.0 / 38.7, 40.0 / 82.4,
// 77.1 ms against oneDNN's 15.5, 15.7 / 19.1, 22.5 / 27.1, 24.4 / 32.5, 33.3 / 39.4, 40.4 /
// 75.0, 79.0; a dense [m, 1024] x [1024, 1024]ᵀ at 32 / 64 / 128 / 256 rows 0.19, 0.23 / 0.36,
// 0.40 / 0.78, 0.79 / 1.69, 1.66 against 0.33, 0.33 / 0.50, 0.56 / 0.92, 0.82 / 1.53, 1.65 ms;
// the LM head [4096, 1024] at 32 rows 0.73, 0.78 against 1.14, 1.47. From 13 to 24 rows it tied
// with the skinny kernel (one 16-row block of x: 5.5-6.8 against 4.9-7.0 ms for the experts at
// 12-16 rows), so the skinny kernel keeps those.
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
