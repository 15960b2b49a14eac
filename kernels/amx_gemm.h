// y = x · wᵀ with bf16 x and bf16 weights on AMX (Intel Advanced Matrix Extensions: eight 1 KB
// tile registers and TDPBF16PS, a 16 x 16 x 32 bf16 product into f32 in one instruction). For the
// CPU engine's bf16 decode and prefill products: the experts of a layer grouped in one parallel
// region, and the dense layers. Written by hand because libtorch 1.13 reaches AMX only through
// oneDNN one call per expert (about 5 ms per layer against 2 ms of weight reads at 4–8 rows per
// expert, docs/performance.md), and no packaged library offers a grouped AMX GEMM over row runs.
//
// The weight is the tiles' A operand, read in place: 16 of its rows by 32 of its columns (1 KB)
// per tile load, with the row stride of the matrix. So w [n, k] needs no repacking and stays the
// layout every other path reads. x is the B operand and is packed once per call (WidePackXBf16,
// kernels/wide_gemm.h): 16 rows at a time into VNNI pairs. The accumulator tile holds yᵀ (16 weight
// rows by 16 x rows). Products of bf16 pairs are exact in f32 and summed in f32 (TDPBF16PS flushes
// denormals and rounds to nearest even), so results agree with an f32 reference of the bf16 inputs
// up to the order of f32 additions.
//
// Layouts (row-major): x [m, k] bf16 (row stride ldx); w [n, k] bf16, contiguous rows; y [m, n]
// f32 (row stride ldy). Needs k % 32 == 0 and n % 16 == 0 (AmxGemmFits); other shapes take the
// caller's other paths.
#ifndef MOELORA_KERNELS_AMX_GEMM_H_
#define MOELORA_KERNELS_AMX_GEMM_H_

#include <cstdint>

namespace moelora {

// True when this CPU has AMX-TILE and AMX-BF16 and the kernel (Linux) granted this process the
// tile state; asked once. MOELORA_AMX=0 turns the kernel off (benchmarks, tests of the other
// paths).
bool AmxGemmAvailable();
// Whether the CPU has AMX at all, whatever MOELORA_AMX says (tests run the kernel where it can).
bool AmxGemmSupported();

// Whether y = x · wᵀ of these sizes fits the kernel's tiles.
inline bool AmxGemmFits(int64_t n, int64_t k) {
  return k > 0 && n > 0 && k % 32 == 0 && n % 16 == 0;
}

struct AmxGemmArgs {
  const uint16_t* x_packed = nullptr;  // WidePackXBf16 of x [m, k]
  const uint16_t* w = nullptr;         // [n, k] bf16
  float* y = nullptr;                  // [m, n] f32, or
  uint16_t* y_bf16 = nullptr;          // [m, n] bf16 (the f32 sums rounded to nearest even)
  int64_t ldy = 0;
  int64_t m = 0, n = 0, k = 0;
  // Optional: the weight rows read after this product's last block (the next product's w, e.g.
  // the next expert's), prefetched while that block computes; next_rows of them, k columns each.
  const uint16_t* next_w = nullptr;
  int64_t next_rows = 0;
};

// Output columns [n0, n1) of y = x · wᵀ (overwritten), n0 and n1 multiples of 16; calls on
// disjoint column ranges may run concurrently, on any thread (each call sets up and releases
// its thread's tiles). While a block of 32 weight rows computes, the next 32 rows (of w, or of
// next_w after w's last block) are prefetched into L2. Needs AmxGemmSupported() and
// AmxGemmFits(n, k).
void AmxGemmRows(const AmxGemmArgs& a, int64_t n0, int64_t n1);

}  // namespace moelora

#endif  // MOELORA_KERNELS_AMX_GEMM_H_
