// Batched multi-LoRA for a dense projection where every token carries its own adapter slot
// (Punica "BGMV"): shrink then expand, accumulated into the base projection's output.
//
//   y[t, j]   = Σ_k a_t[s, k, j] · x[t, k]                 for j < rank[s], s = slot_of_token[t]
//   out[t, c] = out[t, c] + Σ_j b_t[s, j, c] · y[t, j]     (tokens with s = -1 are not touched)
//
// Layouts (outermost first, row-major) are the worker's slot layout (kernels/sgmv.h): A stored
// transposed, a_t [S, in_dim, R_max]; B stored transposed with the LoRA scaling folded in,
// b_t [S, R_max, out_dim]. x, out, a_t and b_t share one dtype: F32, F16 or BF16. y and every
// sum are f32; `out` is rounded to the dtype once, after the whole LoRA sum is added.
//
// Two implementations with one contract: BgmvCpu (host pointers; the reference twin) and
// BgmvCuda (device pointers, ranks up to kBgmvCudaMaxRank). Thread-safe: no shared state.
#ifndef MOELORA_KERNELS_BGMV_H_
#define MOELORA_KERNELS_BGMV_H_

#include <cstddef>
#include <cstdint>

#include "absl/status/status.h"
#include "common/safetensors.h"

namespace moelora {

inline constexpr int64_t kBgmvCudaMaxRank = 64;

struct BgmvParams {
  DType dtype = DType::kF32;
  const void* x = nullptr;  // [T, x_stride], first in_dim columns read
  int64_t x_stride = 0;
  void* out = nullptr;  // [T, out_stride], first out_dim columns accumulated into
  int64_t out_stride = 0;
  const void* a_t = nullptr;               // [S, in_dim, max_rank]
  const void* b_t = nullptr;               // [S, max_rank, out_dim]
  const int32_t* rank = nullptr;           // [S], 0 <= rank <= max_rank (0: slot empty)
  const int32_t* slot_of_token = nullptr;  // [T], -1 = base model, else < S
  int64_t num_tokens = 0;
  int64_t in_dim = 0;
  int64_t out_dim = 0;
  int64_t max_rank = 0;
  int64_t num_slots = 0;
  // CUDA only: device scratch of BgmvWorkspaceBytes() bytes (the f32 intermediate y).
  void* workspace = nullptr;

  // INVALID_ARGUMENT naming the field: null pointer, non-positive dim, stride below the dim,
  // unsupported dtype.
  [[nodiscard]] absl::Status Validate() const;
};

size_t BgmvWorkspaceBytes(const BgmvParams& p);

// Host reference. Also checks every slot index and rank (INVALID_ARGUMENT naming the token or
// slot), which the CUDA kernel cannot afford to do.
[[nodiscard]] absl::Status BgmvCpu(const BgmvParams& p);

// Device pointers; `stream` is a cudaStream_t (nullptr: default stream). Asynchronous.
// UNIMPLEMENTED without CUDA; INVALID_ARGUMENT when max_rank > kBgmvCudaMaxRank; INTERNAL on a
// launch error.
[[nodiscard]] absl::Status BgmvCuda(const BgmvParams& p, void* stream);

}  // namespace moelora

#endif  // MOELORA_KERNELS_BGMV_H_
