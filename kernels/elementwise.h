// Row helpers for the CPU engine's hand-written elementwise passes (RmsNorm, rotary, SwiGLU, the
// MoE combine in worker/layers): bf16 <-> f32 over a row, and SwiGLU's silu(g) · u. AVX-512 where
// the CPU has it (chosen at run time: the build needs no -mavx512f), a scalar loop elsewhere;
// both give the same bits except silu's exp (below).
//
// Why by hand: ATen 1.13 converts bf16 element by element in these ops (c10::BFloat16's
// rounding has a NaN branch the compiler does not vectorise), so a pass over a bf16 row costs
// several ns per element; widened and rounded 16 at a time it costs a fraction of one.
#ifndef MOELORA_KERNELS_ELEMENTWISE_H_
#define MOELORA_KERNELS_ELEMENTWISE_H_

#include <cstdint>

namespace moelora {

// Whether the vectorised (AVX-512) paths run on this CPU. Where they do not, SiluMul's exp is
// std::exp one element at a time, slower than ATen's own vectorised silu: callers keep ATen's.
bool ElementwiseVectorised();

// dst[i] = the f32 value of bf16 src[i] (exact).
void WidenBf16(const uint16_t* src, float* dst, int64_t n);
// dst[i] = src[i] rounded to bf16, to nearest even; NaN becomes 0x7FC0 (as c10::BFloat16 does).
void RoundToBf16(const float* src, uint16_t* dst, int64_t n);
// v[i] = float(bf16(v[i])): the value an op that rounds to bf16 leaves.
void RoundTripBf16(float* v, int64_t n);
// out[i] = s(silu(g[i])) · u[i], silu(x) = x / (1 + exp(-x)), where s rounds to bf16 when
// `round_silu` (what a bf16 ATen silu then mul computes) and is the identity otherwise. exp is
// a Cephes-style polynomial on AVX-512 (within 2 ulp of f32 exp) and std::exp elsewhere.
void SiluMul(const float* g, const float* u, float* out, int64_t n, bool round_silu);
// Σ a[i] · b[i], in 16 partial sums added in a fixed order (a loop the compiler vectorises).
float Dot(const float* a, const float* b, int64_t n);
// Dot(x, x, n).
float SumSquares(const float* x, int64_t n);
// The first i with x[i] the largest value (NaN never counts; 0 when no value exceeds -inf), and
// that value in *max (-inf then): what a scalar loop keeping `x[i] > best` finds. A greedy
// decode step takes it over every row's logits; 16 lanes at a time on AVX-512, where the scalar
// loop (a compare and branch per logit) showed in profiles.
int64_t ArgMax(const float* x, int64_t n, float* max);
// p[i] = exp(l[i] - max) · (1 / Σ_j exp(l[j] - max)), the softmax of n logits in f32 (ATen's
// softmax(·, kFloat) in form), l either f32 or bf16 (bf16_logits: widened exactly). exp: the
// AVX-512 polynomial (within 2 ulp of f32 exp) and the sum in 16 lanes, or std::exp and a plain
// sum where the CPU has no AVX-512. The MoE router's softmax over a token's experts: by hand
// because at::softmax, its bf16 -> f32 copy and at::topk were a pass and a dispatch each, and
// std::exp one element at a time took most of what is left.
void SoftmaxRow(const void* l, bool bf16_logits, float* p, int64_t n);

// One row of a flash-attention tile of n scores, in place: with m' = max(*m, max_j s[j]), s[j]
// becomes exp(s[j] − m'), *l becomes *l · c + Σ_j exp(s[j] − m') and *m becomes m'; returns c =
// exp(*m − m') (0 while *m was −inf), the factor for the row's output accumulated so far. Two
// passes over a row that stays in L1 (its max; exp, store and sum), where ATen took six passes
// over the whole tile (scale, max, subtract, exp, sum, and the factor's own ops) and its exp is
// Sleef's 8-lane one: the vision tower's attention (worker/architectures/vision_tower.cc). exp as
// in SoftmaxRow. A row whose scores and *m are all −inf is left as no contribution (s[j] = 0, c =
// 1).
float OnlineSoftmaxRow(float* s, int64_t n, float* m, float* l);

// The forms of RmsNorm the served architectures use (the worker's NormKind): with
// r = 1 / sqrt(SumSquares(x, n) / n + eps),
//   kPlain:       out = w · R(x · r), R rounding to bf16 when round_bf16 (else the identity);
//   kZeroCentred: out = (x · r) · (1 + w);
//   kF32Weight:   out = w · (x · r).
enum class NormForm { kPlain, kZeroCentred, kF32Weight };
// One row of n; out may be x.
void RmsNormRow(const float* x, const float* w, float* out, int64_t n, float eps, NormForm form,
                bool round_bf16);
// RmsNormRow on a bf16 row (bf16 model: round_bf16), out rounded to bf16; where delta is given,
// x is first replaced by bf16(x + delta), which is also written to `sum` (a residual add and the
// next norm in one pass). The same bits as widening, AddRows, RmsNormRow and RoundToBf16.
void RmsNormRowBf16(const uint16_t* x, const uint16_t* delta, const float* w, uint16_t* sum,
                    uint16_t* out, int64_t n, float eps, NormForm form);
// acc[i] = R(acc[i] + R(y[i] · w)): one expert's share of a token's MoE output, as ATen's mul
// then index_add compute it (R as above).
void AddScaledRow(const float* y, float w, float* acc, int64_t n, bool round_bf16);
// out[i] = R(a[i] + b[i]); out may be a or b.
void AddRows(const float* a, const float* b, float* out, int64_t n, bool round_bf16);
// Rotary embedding of one head's first rd dims (rd even, h = rd / 2): for i < h,
// out[i] = R(R(x[i] · c[i]) + R(-x[i + h] · s[i])) and out[i + h] = R(R(x[i + h] · c[i + h]) +
// R(x[i] · s[i + h])), transformers' x · cos + rotate_half(x) · sin (R as above). out != x.
void RotaryRow(const float* x, const float* c, const float* s, float* out, int64_t rd,
               bool round_bf16);
// (These and the rounding helpers give the same bits on every path: each product and sum is
// rounded on its own, never fused into an FMA; SumSquares sums in the same order.)

// Rows per parallel task for a pass over rows of `row` elements: at least 8192 elements a task,
// so the smallest passes (a decode step of up to 8 sequences) stay on the calling thread, where
// waking the thread pool costs more than the pass; larger passes (a batch of 32 rows of 1024)
// split across the threads.
inline int64_t ElementwiseGrain(int64_t row) {
  const int64_t rows = 8192 / (row > 0 ? row : 1);
  return rows > 0 ? rows : 1;
}

}  // namespace moelora

#endif  // MOELORA_KERNELS_ELEMENTWISE_H_
