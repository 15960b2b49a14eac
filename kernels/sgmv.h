// Segmented gather matrix-vector LoRA (Punica/S-LoRA "SGMV", shrink + expand in one pass) on the
// CPU: out[row] += B_s · (A_s · x[row]) for every row of every segment, where a segment is a run
// of rows that share one LoRA (an adapter slot, and for MoE an expert). Cost grows with the
// number of rows, not with the number of distinct adapters. A segment writes columns
// [out_col, out_col + out_dim) of out, or [out_col, out_col + 2 out_dim) with a second B.
//
// Layouts (outermost first, row-major): x and out f32; A is stored transposed, a_t [in_dim,
// r_stride] (column j = lora_A row j), B transposed, b_t [r_stride, out_dim] (row j = lora_B
// column j, scaling folded in), both f32 or bf16 (SgmvParams::w_type; bf16 is widened exactly).
// Only the first `rank` columns/rows are read. The rank-sized intermediate is kept in f32
// (docs/formats.md §1).
//
// Where the CPU has AVX-512 (else AVX2 + FMA; checked at run time, the build needs neither) a
// segment's rows go four at a time, so A and B are read once per four rows, with the four rows'
// sums in registers (16 or 8 lanes); elsewhere a portable loop does one row at a time. The vector
// paths sum over the rank in order and over the input dim in 2 or 4 interleaved partial sums
// (several chains of FMAs, so a one-row shrink is not bound by FMA latency), the same on both, so
// they agree bit for bit; the portable loop sums in order and differs from them by rounding.
//
// Thread-safety: no shared state. Segments that write disjoint rows, or disjoint columns of the
// same rows, may run on different threads.
#ifndef MOELORA_KERNELS_SGMV_H_
#define MOELORA_KERNELS_SGMV_H_

#include <cstdint>

namespace moelora {

enum class SgmvWeight { kF32, kBF16 };

struct SgmvSegment {
  int64_t begin = 0;          // first entry of this segment (a row, or an index into `rows`)
  int64_t end = 0;            // one past the last
  const void* a_t = nullptr;  // [in_dim, r_stride], of SgmvParams::w_type
  const void* b_t = nullptr;  // [r_stride, out_dim], of SgmvParams::w_type
  int32_t rank = 0;           // 0 < rank <= r_stride; 0 = nothing to add
  // A second B sharing this A (nullptr: none), [r_stride, out_dim]: its expand adds into the
  // out_dim columns after the first B's. One shrink serves both, so A is read once: a 3D
  // adapter's fused gate/up A, converted to 2D, is both gate's and up's (docs/formats.md §4).
  const void* b2_t = nullptr;
  int64_t out_col = 0;  // this segment's first column of out (added to every out row)
  // a_t's row stride when it is not r_stride (0): [in_dim, a_stride], rank <= a_stride. CPU
  // slots pack an adapter's A at its own rank, so that a slot's memory follows the rank in use.
  int64_t a_stride = 0;
};

struct SgmvParams {
  const float* x = nullptr;  // [*, x_stride]
  int64_t x_stride = 0;
  float* out = nullptr;  // [*, out_stride]; the first out_dim columns are accumulated into
  int64_t out_stride = 0;
  const int64_t* rows = nullptr;  // when set, segment entries index this row list
  int64_t in_dim = 0;
  int64_t out_dim = 0;
  int64_t r_stride = 0;
  SgmvWeight w_type = SgmvWeight::kF32;  // of every segment's a_t and b_t
  // bf16 activations instead (bf16 models): x_bf16 is read in place of x (widened exactly), and
  // out_bf16 accumulated into in place of out (each element widened, the f32 sum rounded to
  // nearest even once). Either may be set alone; strides as above.
  const uint16_t* x_bf16 = nullptr;
  uint16_t* out_bf16 = nullptr;
};

// Runs segments [first, last) of `segs`. Preconditions (checked by the caller, which built the
// segments): pointers valid for the dims given, rank <= r_stride <= kSgmvMaxRank.
void SgmvCpu(const SgmvParams& p, const SgmvSegment* segs, int64_t first, int64_t last);

// The instruction sets SgmvCpu may take. SgmvBestIsa: the best one this CPU has (the one SgmvCpu
// runs). SgmvCpuWith runs a given one, at most SgmvBestIsa() (tests of each path).
enum class SgmvIsa { kPortable, kAvx2, kAvx512 };
SgmvIsa SgmvBestIsa();
void SgmvCpuWith(SgmvIsa isa, const SgmvParams& p, const SgmvSegment* segs, int64_t first,
                 int64_t last);

inline constexpr int64_t kSgmvMaxRank = 512;

}  // namespace moelora

#endif  // MOELORA_KERNELS_SGMV_H_
