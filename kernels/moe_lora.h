// Fused MoE with batched multi-LoRA on the experts: the whole MoE block after routing, for tokens
// of many adapters at once, with the 2D (w1, w3, w2 per expert) or the 3D (fused w13, w2) LoRA
// wrapper (docs/formats.md §2, §3).
//
// For every token t and each of its top_k assignments (e = topk_ids[t, k], w = topk_weights[t,
// k], s = slot_of_token[t]):
//   h13 = w13[e] · x[t]                                   f32 [2I]: gate rows [0, I), up [I, 2I)
//   h13[p.out_col + c] += Σ_j p.b_t[s, e, j, c] · Σ_h p.a_t[s, e, h, j] · x[t, h]
//                                                          for each gate/up projection p, s >= 0
//   act = dtype(silu(h13[c]) · h13[I + c])                 [I], rounded to the compute dtype
//         (swiglu_limit L > 0, Step3.5: dtype(min(silu(g), L) · clamp(u, -L, L)))
//   y   = w2[e] · act  (+ down LoRA the same way, from act) f32 [H]
//   out[t] = dtype(Σ_k w · y)                              the routing weight scales base + LoRA
// The LoRA intermediate (A·x, rank-sized) is f32, as are h13, y and the sum over k (docs/formats.md
// §1.7). 2D wrapper: two gate/up projections (gate: out_col 0, up: out_col I, out_dim I each);
// 3D wrapper: one (w13: out_col 0, out_dim 2I). No projection at all is the base fused MoE.
//
// Layouts (outermost first, row-major; x, out, w13, w2, a_t and b_t share one dtype: F32, F16 or
// BF16): x [T, H]; w13 [E, 2I, H]; w2 [E, H, I]; a_t [S, E, in, R_max]; b_t [S, E, R_max, out];
// rank [S, E] (0: that expert has no LoRA in that slot). I is the rank's local intermediate size
// under tensor parallelism.
//
// The CUDA version sorts the assignments by (expert, slot) on the device, runs the base GEMMs per
// expert on tensor cores (f16/bf16 when H and I are multiples of 16) and the LoRA shrink/expand
// per sorted row, then combines in token order (deterministic: no atomics on values).
// Thread-safe: no shared state.
#ifndef MOELORA_KERNELS_MOE_LORA_H_
#define MOELORA_KERNELS_MOE_LORA_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/safetensors.h"

namespace moelora {

struct MoeLoraProj {
  const void* a_t = nullptr;      // [S, E, in, max_rank]
  const void* b_t = nullptr;      // [S, E, max_rank, out_dim]
  const int32_t* rank = nullptr;  // [S, E]
  int64_t out_col = 0;            // first column of h13 (gate/up) or y (down) written
  int64_t out_dim = 0;
};

struct MoeLoraParams {
  DType dtype = DType::kF32;
  const void* x = nullptr;                 // [T, H]
  const int32_t* topk_ids = nullptr;       // [T, K], each in [0, E)
  const float* topk_weights = nullptr;     // [T, K]
  const int32_t* slot_of_token = nullptr;  // [T], -1 = base; may be null when there is no LoRA
  const void* w13 = nullptr;               // [E, 2I, H]
  const void* w2 = nullptr;                // [E, H, I]
  MoeLoraProj gate_up[2];                  // the first num_gate_up are used
  int num_gate_up = 0;                     // 0 (no gate/up LoRA), 1 (3D: w13) or 2 (2D: w1, w3)
  MoeLoraProj down;                        // used when has_down
  bool has_down = false;
  void* out = nullptr;  // [T, H], overwritten
  int64_t num_tokens = 0;
  int64_t hidden = 0;       // H
  int64_t inter = 0;        // I (local)
  int64_t num_experts = 0;  // E
  int64_t top_k = 0;        // K
  int64_t num_slots = 0;    // S (>= 1 when any LoRA projection is given)
  int64_t max_rank = 0;     // R_max
  float swiglu_limit = 0;   // > 0: Step3.5's clamped SwiGLU (see above); 0: plain SwiGLU
  // CUDA only: device scratch of MoeLoraWorkspaceBytes() bytes.
  void* workspace = nullptr;

  // INVALID_ARGUMENT naming the field: null pointer, non-positive dim, top_k > E, a projection
  // whose columns leave h13 or y, unsupported dtype.
  [[nodiscard]] absl::Status Validate() const;
};

size_t MoeLoraWorkspaceBytes(const MoeLoraParams& p);

// The CUDA kernel sorts a call's (token, expert) assignments by (expert, slot + 1) with one
// block's shared-memory counters: num_experts · (num_slots + 1) must not exceed this.
inline constexpr int64_t kMoeLoraCudaMaxSortKeys = 10240;

// Host reference: a direct loop over (token, k). Also checks every expert id, slot and rank
// (INVALID_ARGUMENT naming the token), which the CUDA version cannot afford to do.
[[nodiscard]] absl::Status MoeLoraCpu(const MoeLoraParams& p);

// Device pointers; asynchronous on `stream` (a cudaStream_t; nullptr: default stream).
// UNIMPLEMENTED without CUDA; INVALID_ARGUMENT when max_rank > 64 or E · (S + 1) > 10240;
// INTERNAL on a launch error.
[[nodiscard]] absl::Status MoeLoraCuda(const MoeLoraParams& p, void* stream);

}  // namespace moelora

#endif  // MOELORA_KERNELS_MOE_LORA_H_
