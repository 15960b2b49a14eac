// Causal attention of a run of query rows against keys and values held in fixed-size blocks (the
// worker's paged KV cache), with an online softmax: the scores of one block of keys at a time are
// folded into a running maximum, denominator and weighted sum per query head, so memory stays
// O(rows · heads · d) whatever the number of keys (no [queries, keys] score matrix). Serves the
// prompt rows of a prefill chunk and the decode rows alike. Optional sliding window and per-head
// sinks (a logit that joins the denominator and has no value). Arithmetic in f32; keys and
// values f32 or bf16 (widened as they are read). AVX-512 or AVX2 + FMA where the CPU has them, a
// portable loop elsewhere.
//
// Why by hand: libtorch 1.13 has no fused attention, and the ATen form of one sequence's prefill
// builds [heads, queries, keys] scores (then masked and softmax copies): 4 GB at 8,192 tokens.
#ifndef MOELORA_KERNELS_PAGED_ATTENTION_H_
#define MOELORA_KERNELS_PAGED_ATTENTION_H_

#include <cstdint>

#include "absl/status/status.h"

namespace moelora {

struct PagedAttentionArgs {
  // Query vectors, f32: row i (position pos0 + i), head h at q + i · q_row_stride + h ·
  // q_head_stride, d values each.
  const float* q = nullptr;
  int64_t q_row_stride = 0, q_head_stride = 0;
  int64_t rows = 0;   // consecutive query positions pos0 .. pos0 + rows - 1
  int64_t heads = 0;  // query heads that share this KV head
  int64_t d = 0;
  int64_t pos0 = 0;
  int64_t window = 0;  // > 0: a query at p sees keys p - window + 1 .. p; 0: every key up to p
  // Keys: the sequence's block table; key position p lives in block blocks[p / block_size], row
  // p % block_size, at k + blocks[..] · block_stride + row · row_stride elements (v the same).
  const int32_t* blocks = nullptr;
  int64_t block_size = 0;
  const void* k = nullptr;
  const void* v = nullptr;
  bool kv_bf16 = false;
  int64_t block_stride = 0, row_stride = 0;
  float scale = 1.0f;            // applied to q · k
  const float* sinks = nullptr;  // heads logits, or null
  // Output, f32: row i, head h at out + i · out_row_stride + h · out_head_stride.
  float* out = nullptr;
  int64_t out_row_stride = 0, out_head_stride = 0;
};

// Floats of scratch PagedAttention needs for these arguments.
int64_t PagedAttentionScratchFloats(const PagedAttentionArgs& a);

// out = softmax(scale · q · kᵀ over the visible keys [+ sink]) · v, per query row and head.
void PagedAttention(const PagedAttentionArgs& a, float* scratch);

// The portable loop, whatever the CPU (tests compare the two).
void PagedAttentionPortable(const PagedAttentionArgs& a, float* scratch);

// Whether PagedAttention takes the AVX-512 path here: AVX-512F, d a multiple of 16 up to 256.
// Otherwise it takes the AVX2 + FMA path where the CPU has them (d a multiple of 8 up to 256),
// else the portable loop.
bool PagedAttentionVectorized(int64_t d);

// The AVX2 + FMA path alone (tests compare it on CPUs that also have AVX-512); false, running
// nothing, where the CPU or d does not allow it.
bool PagedAttentionAvx2(const PagedAttentionArgs& a, float* scratch);

// The same attention for every query row of a step at once, as the device kernel takes it:
// row t (of sequence seq_of_row[t], at position pos_of_row[t]) and query head h attend to that
// sequence's keys of KV head h / (hq / hkv). Pointers are host pointers for the twin, device
// pointers for PagedAttentionCuda.
struct PagedAttentionBatch {
  const float* q = nullptr;  // [rows, hq, d]
  float* out = nullptr;      // [rows, hq, d]
  const void* k = nullptr;   // pools [blocks, block_size, hkv, d]
  const void* v = nullptr;
  bool kv_bf16 = false;
  int64_t rows = 0, hq = 0, hkv = 0, d = 0, block_size = 0;
  const int32_t* block_tables = nullptr;  // [sequences, max_blocks]
  int64_t max_blocks = 0;
  const int32_t* seq_of_row = nullptr;  // [rows]
  const int64_t* pos_of_row = nullptr;  // [rows]
  int64_t window = 0;
  float scale = 1.0f;
  const float* sinks = nullptr;  // [hq] or null

  // INVALID_ARGUMENT naming the field.
  [[nodiscard]] absl::Status Validate() const;
};

// The host twin: PagedAttentionPortable per (row, KV head).
[[nodiscard]] absl::Status PagedAttentionBatchCpu(const PagedAttentionBatch& b);

// Device pointers; `stream` a cudaStream_t (nullptr: the default stream). Asynchronous.
// UNIMPLEMENTED without CUDA; INVALID_ARGUMENT for d > 256.
[[nodiscard]] absl::Status PagedAttentionCuda(const PagedAttentionBatch& b, void* stream);

}  // namespace moelora

#endif  // MOELORA_KERNELS_PAGED_ATTENTION_H_
