// y = x · wᵀ in f32 for 13 to a few hundred rows of x (prefill expert runs, the dense layers of a
// decode batch of 13 or more): the counterpart of the skinny kernel (few rows) on AVX-512. Below,
// the same kernel for bf16 on AVX512-BF16 (for CPUs without AMX).
//
// The skinny kernel takes dot products along k: every step loads one line of each weight row and
// of each x row of its tile (10 lines per 24 FMAs), ends with horizontal sums, and from about 16
// rows on it is bound by those loads from L2 (250 GFLOP/s of the 470 two cores can do here).
// This kernel broadcasts instead: x is packed once per call, transposed in blocks of 16 rows
// (WidePackX: for each column c, the 16 rows' x[·, c] in one line), and a register tile of 8
// weight rows by up to 48 x rows (24 accumulators; 14 rows by 32 in bf16) takes, per column, a
// broadcast of w[·, c] per row (each weight line serves 16 columns) and up to 3 lines of packed
// x. The weight is read in place (its rows stay the layout every other path reads); the next
// tile's weight rows are prefetched into L1 while the first x block passes over the current ones.
// Written by hand because the BLAS under Debian's libtorch 1.13 (OpenBLAS) packs the whole weight
// on each call, which for one expert's 16–256 rows costs about a third of the product (perf of an
// f32 prefill, docs/performance.md).
//
// Layouts (row-major): x [m, k] f32 (row stride ldx); w [n, k] f32, contiguous rows; y [m, n] f32
// (row stride ldy). Accumulation in f32, in column order c = 0, 1, ..., k - 1 for every output.
#ifndef MOELORA_KERNELS_WIDE_GEMM_H_
#define MOELORA_KERNELS_WIDE_GEMM_H_

#include <cstdint>

namespace moelora {

// True when this CPU has AVX-512 (F, BW, VL) and the skinny kernel's instruction set is an
// AVX-512 one (MOELORA_SKINNY_ISA=avx2 turns this kernel off too), and MOELORA_WIDE_GEMM is not
// "0" (benchmarks and tests of the other paths). Read once.
bool WideGemmAvailable();
// Whether the CPU can run the kernel at all, whatever the variables say (its tests).
bool WideGemmSupported();

// Weight rows per register tile of the f32 kernel: 8 (for up to 3 blocks of 16 x rows a pass, 24
// accumulators). A thread's range of output columns is best a multiple of it (the last tile of a
// range takes what is left). Not more at two blocks, as the bf16 kernel: f32 rows of k 1024 are
// 4 KB apart, so the tile's current line of every row falls into one 8-way L1 set (14 rows:
// 0.70x at 32 rows; on the Zen 5, 0.86-0.92x at 32 and 64 rows; docs/performance.md).
constexpr int WideTileRows(int64_t /*m*/) { return 8; }

// f32 elements of x packed for m rows of k columns: 16-row blocks, padded with zero rows.
inline int64_t WidePackedXElements(int64_t m, int64_t k) { return (m + 15) / 16 * 16 * k; }

// Packs x [m, k] (row stride ldx) into `packed` (WidePackedXElements(m, k) floats): per block of
// 16 rows, k lines of 16 floats (line c: x[r, c] of the block's rows r; rows past m are 0).
// Needs WideGemmSupported().
void WidePackX(const float* x, int64_t ldx, int64_t m, int64_t k, float* packed);

struct WideGemmArgs {
  const float* x_packed = nullptr;  // WidePackX of x [m, k]
  const float* w = nullptr;         // [n, k] f32
  float* y = nullptr;               // [m, n] f32
  int64_t ldy = 0;
  int64_t m = 0, n = 0, k = 0;
  // Optional: the weight rows read after this product's last rows (the next product's w, e.g. the
  // next expert's), whose first tile of rows (WideTileRows) is prefetched while the last ones
  // compute.
  const float* next_w = nullptr;
};

// Output columns [n0, n1) of y = x · wᵀ (overwritten); 0 <= n0 <= n1 <= n. Calls on disjoint
// column ranges may run concurrently. Needs WideGemmSupported().
void WideGemmRows(const WideGemmArgs& a, int64_t n0, int64_t n1);

// The same kernel for bf16 x against bf16 weights, on AVX512-BF16's vdpbf16ps (a CPU without
// AMX: an AMD EPYC 9004, Zen 4, where the skinny kernel's dot products and oneDNN's bf16 GEMM
// both ran 32-row products at about half of what the CPU can multiply). Each step takes a pair
// of columns: one 64-byte line of packed x holds 16 rows' pairs, and each weight row's pair (32
// bits, read in place) is broadcast; products of bf16 pairs are exact in f32 and summed in f32
// (the instruction flushes denormals). x is packed by WidePackXBf16, AMX's B layout.

// Weight rows per register tile of the bf16 kernel for m rows of x: 14 where x is an even number
// of blocks of 16 rows, taken two blocks a pass (28 accumulators; 17 to 32 rows: a decode batch's
// dense products; 49 to 64: about half of the experts of a 512-token prefill), else 8 (three
// blocks a pass). bf16 rows of k 1024 are 2 KB apart: the 14 rows' current lines fall into two
// L1 sets, 7 each. 8 -> 14 at 32 rows, with the kernel's loop and prefetch order: 1.05-1.09x; at
// 64 rows (bench/skinny_gemm --rows 64, 32 experts): 731 -> 839 GFLOP/s (docs/performance.md).
constexpr int WideBf16TileRows(int64_t m) { return (m + 15) / 16 % 2 == 0 ? 14 : 8; }

// True when this CPU has AVX-512 with BF16, the skinny kernel's instruction set is kAvx512Bf16,
// and MOELORA_WIDE_GEMM is not "0". Read once.
bool WideBf16GemmAvailable();
// Whether the CPU can run the bf16 kernel at all (its tests).
bool WideBf16GemmSupported();
// Whether the bf16 kernel takes a product with k columns (its packing works in 32 columns).
inline bool WideBf16GemmFits(int64_t k) { return k > 0 && k % 32 == 0; }

// uint16_t elements of bf16 x packed for m rows of k columns: 16-row blocks, padded with zero rows.
inline int64_t WidePackedXBf16Elements(int64_t m, int64_t k) { return (m + 15) / 16 * 16 * k; }

// Packs bf16 x [m, k] (row stride ldx) into `packed` (WidePackedXBf16Elements(m, k) elements):
// per block of 16 rows, k / 2 lines of 32 bf16 (line p: x[r, 2p] and x[r, 2p + 1] of the
// block's rows r, in that order; rows past m are 0). Needs WideGemmSupported() and
// WideBf16GemmFits(k). The AMX kernel's B tiles are the same layout (per 32 columns,
// 16 column pairs by 16 rows by 2: VNNI order).
void WidePackXBf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, uint16_t* packed);

struct WideBf16GemmArgs {
  const uint16_t* x_packed = nullptr;  // WidePackXBf16 of x [m, k]
  const uint16_t* w = nullptr;         // [n, k] bf16
  float* y = nullptr;                  // [m, n] f32, or
  uint16_t* y_bf16 = nullptr;          // [m, n] bf16 (the f32 sums rounded to nearest even)
  int64_t ldy = 0;
  int64_t m = 0, n = 0, k = 0;
  const uint16_t* next_w = nullptr;  // as WideGemmArgs::next_w
};

// Output columns [n0, n1) of y = x · wᵀ (overwritten); 0 <= n0 <= n1 <= n. Calls on disjoint
// column ranges may run concurrently. Needs WideBf16GemmSupported() and WideBf16GemmFits(k).
void WideBf16GemmRows(const WideBf16GemmArgs& a, int64_t n0, int64_t n1);

}  // namespace moelora

#endif  // MOELORA_KERNELS_WIDE_GEMM_H_
