// y = x · wᵀ for few rows of x (decode: a handful of tokens per expert, a batch per dense layer),
// streaming each weight row once. Written by hand because the BLAS under Debian's libtorch 1.13
// (OpenBLAS 0.3.21) packs the whole weight on every call: in a decode step of the medium
// Qwen3-MoE 35% of the time went to sgemm_incopy (perf, docs/performance.md), and a GEMM with
// 1–8 rows is a matrix–vector product bound by reading the weight, which packing reads twice.
//
// Layouts (row-major): x [m, k] f32 (row stride ldx), w [n, k] f32 or bf16 (contiguous rows: an
// nn.Linear weight, an expert's w13 or w2), y [m, n] f32 (row stride ldy). Accumulation in f32;
// bf16 weights are widened exactly. Rows [n0, n1) of the output are written (overwritten), so
// callers split n across threads; calls on disjoint row ranges may run concurrently.
//
// Instruction sets chosen at run time (the build needs no -mavx2): AVX-512 (F, BW, VL) where
// the CPU has it, 16 lanes and 4 x 6 tiles in 32 registers, with AVX512-BF16's vdpbf16ps for
// bf16 weights against bf16 x where it has that too; else AVX2 + FMA, 8 lanes and 4 x 3 tiles.
// MOELORA_SKINNY_ISA=avx2|avx512|avx512bf16 picks a lower one (benchmarks; other values are
// ignored). Without AVX2 + FMA, SkinnyGemmAvailable() is false and callers keep their BLAS call.
#ifndef MOELORA_KERNELS_SKINNY_GEMM_H_
#define MOELORA_KERNELS_SKINNY_GEMM_H_

#include <cstdint>

namespace moelora {

enum class SkinnyWeight { kF32, kBF16 };

struct SkinnyGemmArgs {
  const float* x = nullptr;
  int64_t ldx = 0;
  const void* w = nullptr;
  SkinnyWeight w_type = SkinnyWeight::kF32;
  float* y = nullptr;
  int64_t ldy = 0;
  int64_t m = 0, n = 0, k = 0;
  // Optional: the same x as bf16 [m, k] (row stride ldx_bf16), for x that came from bf16 (x holds
  // its exact widening). With bf16 weights on kAvx512Bf16 the kernel then multiplies in bf16
  // (vdpbf16ps; exact products, f32 sums); elsewhere it is ignored.
  const uint16_t* x_bf16_rows = nullptr;
  int64_t ldx_bf16 = 0;
  // Optional: the weight of the product that runs after this one (same k and type, next_rows
  // rows). The last rows of this weight then prefetch its first rows, as every other tile
  // prefetches the rows after its own.
  const void* next_w = nullptr;
  int64_t next_rows = 0;
};

// kAvx512Bf16: kAvx512, plus vdpbf16ps for bf16 weights against a bf16 x (x_bf16_rows).
enum class SkinnyIsa { kNone, kAvx2, kAvx512, kAvx512Bf16 };

// The instruction set SkinnyGemmRows uses (read once).
SkinnyIsa SkinnyGemmIsa();
// True when this CPU runs the vectorised kernel.
bool SkinnyGemmAvailable();
// Whether this CPU can run `isa` (tests run every one it can).
bool SkinnyGemmSupports(SkinnyIsa isa);

// Whether few x rows (SkinnyRowStreamRows) run one weight row at a time (one sequential stream a
// thread) rather than in tiles of several weight rows. On unless MOELORA_SKINNY_ROW_STREAMS=0 at
// start; SetSkinnyRowStreams switches it at any time (bench/decode_step --ab-row-streams alternates
// it step by step, to measure it against the tiles on another CPU). Both give the same products up
// to the order of the sums.
bool SkinnyRowStreams();
void SetSkinnyRowStreams(bool on);
// With row streams on: up to how many x rows a weight (f32, or bf16 under vdpbf16ps) is read one
// row at a time; 0 with them off. By CPU as measured (kernels/cpu/skinny_gemm.cc): 2, or 8 on AMD
// Zen 5 and later (the AVX2 path, and bf16 weights widened to f32, stop at 2 whatever this says).
// SetSkinnyRowStreamRows overrides it (1-8; 0: the CPU's default again), for the tests and for
// bench/decode_step --ab-row-stream-rows.
int SkinnyRowStreamRows();
void SetSkinnyRowStreamRows(int rows);
// How far ahead, in bytes of weight, a row stream prefetches while it computes (f32 weights into
// L1, bf16 into L2; rounded up to whole weight rows; at 3-8 x rows at least one row): 0 leaves it
// to the hardware prefetcher at 1-2 x rows. By CPU and weight type as measured: on AMD Zen 5 and
// later 4096 for f32 weights and 8192 for bf16, 0 elsewhere (the Zen 4 and the Xeon were
// measured without). MOELORA_SKINNY_PREFETCH_BYTES=N at start replaces both defaults (0 to
// 1048576; other values are ignored). SetSkinnyRowStreamPrefetchBytes overrides it for both types
// (a negative value: the defaults again), for the tests and for bench/decode_step
// --ab-row-stream-prefetch.
int64_t SkinnyRowStreamPrefetchBytes(SkinnyWeight w);
void SetSkinnyRowStreamPrefetchBytes(int64_t bytes);
// A second, farther prefetch for f32 weights at 5-8 x rows: the row this many bytes ahead (rounded
// up to whole rows, at least one row past the first prefetch's) into L2, while the first brings
// its nearer row into L1. 0: none. By CPU as measured: 8192 on AMD Zen 5 and later, 0 elsewhere
// (not measured there). SetSkinnyRowStreamFarPrefetchBytes overrides it (a negative value: the
// CPU's default again), for the tests and for bench/decode_step --ab-row-stream-far-prefetch.
int64_t SkinnyRowStreamFarPrefetchBytes();
void SetSkinnyRowStreamFarPrefetchBytes(int64_t bytes);
// Whether the row streams' prefetches (both distances) use the non-temporal hint (prefetchnta)
// rather than the L1 / L2 ones: a row stream reads each weight row once a call, so its lines need
// not displace what the caches hold. By CPU as measured: on AMD Zen 5 and later, off elsewhere
// (not measured there). MOELORA_SKINNY_PREFETCH_NTA=0 or 1 at start replaces the default (other
// values are ignored); SetSkinnyRowStreamNonTemporal overrides it (0: off, -1: the default again,
// any other value: on), for the tests and for bench/decode_step --ab-row-stream-nta.
bool SkinnyRowStreamNonTemporal();
void SetSkinnyRowStreamNonTemporal(int on);

// Output columns [n0, n1) of y = x · wᵀ. Needs SkinnyGemmAvailable(); 0 <= n0 <= n1 <= n.
void SkinnyGemmRows(const SkinnyGemmArgs& a, int64_t n0, int64_t n1);
// The same with a given instruction set; needs SkinnyGemmSupports(isa).
void SkinnyGemmRows(const SkinnyGemmArgs& a, int64_t n0, int64_t n1, SkinnyIsa isa);

}  // namespace moelora

#endif  // MOELORA_KERNELS_SKINNY_GEMM_H_
