// Batched LoRA shrink, y = x · Aᵀ, for a batch whose tokens belong to different adapters
// (Punica/S-LoRA "SGMV shrink"): each token t reads the lora_A of its own slot.
//
// Shapes are outermost first, row-major (kernels/README.md): T tokens, H_in input features,
// S adapter slots, R_max the slot rank capacity.
//
// Two implementations with the same contract: LoraShrinkCpu (always built; the reference) and
// LoraShrinkCuda (only when built with MOELORA_ENABLE_CUDA; device pointers). This header has no
// CUDA types, so it compiles without nvcc. Thread-safe: no shared state.
#ifndef MOELORA_KERNELS_LORA_SHRINK_H_
#define MOELORA_KERNELS_LORA_SHRINK_H_

#include <cstdint>

#include "absl/status/status.h"

namespace moelora {

struct LoraShrinkParams {
  const float* x = nullptr;       // in  [T, H_in]
  const float* lora_a = nullptr;  // in  [S, R_max, H_in]  rows >= rank[s] ignored (PEFT lora_A)
  const int32_t* rank = nullptr;  // in  [S]               0 <= rank[s] <= R_max
  const int32_t* slot_of_token = nullptr;  // in  [T]               -1 = base model (no adapter)
  float* y = nullptr;  // out [T, R_max]        y[t,j] = Σ_k A[s,j,k]·x[t,k] for j < rank[s]; else 0
  int64_t num_tokens = 0;  // T
  int64_t h_in = 0;        // H_in
  int64_t max_rank = 0;    // R_max
  int64_t num_slots = 0;   // S

  // INVALID_ARGUMENT when a pointer is null or a dimension is not positive.
  [[nodiscard]] absl::Status Validate() const;
};

// Reference implementation (f32 accumulation). Also checks every slot index and rank:
// INVALID_ARGUMENT naming the token when slot_of_token[t] >= S or rank out of range.
[[nodiscard]] absl::Status LoraShrinkCpu(const LoraShrinkParams& p);

// True when built with CUDA and a device is visible.
bool CudaDeviceAvailable();

// The same on the GPU. `p` holds DEVICE pointers; `stream` is a cudaStream_t (nullptr: default).
// UNIMPLEMENTED when built without CUDA; INTERNAL on a CUDA error.
[[nodiscard]] absl::Status LoraShrinkCuda(const LoraShrinkParams& p, void* stream);

// Convenience for tests: `p` holds HOST pointers; copies in, runs LoraShrinkCuda, copies y back.
[[nodiscard]] absl::Status LoraShrinkCudaFromHost(const LoraShrinkParams& p);

// NCCL's version code (e.g. 22807) when built with CUDA, 0 otherwise: proves NCCL links.
int NcclVersionCode();

}  // namespace moelora

#endif  // MOELORA_KERNELS_LORA_SHRINK_H_
