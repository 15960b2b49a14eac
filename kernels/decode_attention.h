// Attention of one KV head's query heads against that head's cached keys, for the CPU engine's
// decode and short prefill rows (worker/layers/attention.cc): the heads that share a K/V head
// (grouped-query attention) in one call, one head after the other, each reading the key and
// value rows in place (bf16 widened as it goes; after the first head they come from L1);
// arithmetic in f32, AVX-512.
//
// Why by hand: a decode query has a few dozen to a few thousand keys of 64-256 values; per
// (sequence, head) ATen GEMMs cost more in dispatch than the arithmetic, and the scalar loop
// this replaces (one dot product call per key, one exp per key) was 5-7 % of bench/peer's
// decode step.
#ifndef MOELORA_KERNELS_DECODE_ATTENTION_H_
#define MOELORA_KERNELS_DECODE_ATTENTION_H_

#include <cstdint>

namespace moelora {

struct DecodeAttentionArgs {
  const float* q = nullptr;  // heads rows of d f32 values, q_stride apart
  int64_t q_stride = 0;
  // n key rows and n value rows of d values each, kv_stride elements apart: f32, or bf16 bits
  // when kv_bf16.
  const void* k = nullptr;
  const void* v = nullptr;
  bool kv_bf16 = false;
  int64_t kv_stride = 0;
  int64_t n = 0, d = 0, heads = 0;
  float scale = 1.0f;            // applied to q · k
  const float* sinks = nullptr;  // heads logits that join each softmax's denominator, or null
  float* out = nullptr;          // heads rows of d f32 values, out_stride apart
  int64_t out_stride = 0;
  // Optional (null: none): the cache rows that k and v point into, whole: row j of every KV
  // head's keys at k_rows + j · kv_stride elements, row_bytes of them (v_rows the same for
  // values). The call's first heads prefetch each whole row a few rows ahead of the one they read
  // (into L2), so that the calls for the row's other KV heads, made next on the same thread, find
  // their parts there instead of in memory. Changes no result.
  const void* k_rows = nullptr;
  const void* v_rows = nullptr;
  int64_t row_bytes = 0;
};

// Whether callers pass whole cache rows to prefetch (DecodeAttentionArgs::k_rows): on unless
// switched off (bench/decode_step --ab-attention-row-prefetch alternates it step by step).
bool DecodeAttentionRowPrefetch();
void SetDecodeAttentionRowPrefetch(bool on);

// Whether DecodeAttention runs here: a CPU with AVX-512F, d a multiple of 16 up to 256.
bool DecodeAttentionAvailable(int64_t d);

// out[h] = Σ_j softmax_j(scale · q[h] · k[j]) · v[j] (a sink, when given, joins the
// denominator only). scratch: at least heads · (n + 16) floats. Sums run in 16-lane partial sums
// and exp is a polynomial within 2 ulp, so results differ from a scalar loop in the last bits.
void DecodeAttention(const DecodeAttentionArgs& a, float* scratch);

}  // namespace moelora

#endif  // MOELORA_KERNELS_DECODE_ATTENTION_H_
