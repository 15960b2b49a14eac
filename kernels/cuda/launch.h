// Plain-argument entry points of the .cu files, called by the host code in kernels/cuda/*.cc
// (which turns cudaError_t into absl::Status). nvcc never sees Abseil. Internal to kernels/.
#ifndef MOELORA_KERNELS_CUDA_LAUNCH_H_
#define MOELORA_KERNELS_CUDA_LAUNCH_H_

#include <cuda_runtime.h>

#include <cstdint>

namespace moelora {
namespace cuda_internal {

enum class ElemType : int { kF32 = 0, kF16 = 1, kBF16 = 2 };

struct BgmvArgs {
  ElemType type = ElemType::kF32;
  const void* x = nullptr;
  int64_t x_stride = 0;
  void* out = nullptr;
  int64_t out_stride = 0;
  const void* a_t = nullptr;
  const void* b_t = nullptr;
  const int32_t* rank = nullptr;
  const int32_t* slot_of_token = nullptr;
  int64_t num_tokens = 0, in_dim = 0, out_dim = 0, max_rank = 0;
  float* y = nullptr;  // [T, max_rank] scratch
};
cudaError_t LaunchBgmv(const BgmvArgs& a, cudaStream_t stream);

struct MoeProjArgs {
  const void* a_t = nullptr;
  const void* b_t = nullptr;
  const int32_t* rank = nullptr;
  int64_t out_col = 0, out_dim = 0;
};

struct MoeArgs {
  ElemType type = ElemType::kF32;
  const void* x = nullptr;
  const int32_t* topk_ids = nullptr;
  const float* topk_weights = nullptr;
  const int32_t* slot_of_token = nullptr;  // null: no LoRA
  const void* w13 = nullptr;
  const void* w2 = nullptr;
  MoeProjArgs gate_up[2];
  int num_gate_up = 0;
  MoeProjArgs down;
  bool has_down = false;
  void* out = nullptr;
  int64_t num_tokens = 0, hidden = 0, inter = 0, num_experts = 0, top_k = 0, num_slots = 0,
          max_rank = 0;
  float swiglu_limit = 0;  // MoeLoraParams::swiglu_limit
  void* workspace = nullptr;
};
cudaError_t LaunchMoeLora(const MoeArgs& a, cudaStream_t stream);

// QuantGemmCuda's arguments (kernels/quant_gemm.h): y [m, n] = x [m, k] · dequant(w)ᵀ.
struct QuantGemmArgsDev {
  bool mxfp4 = true;
  const float* x = nullptr;
  int64_t ldx = 0, m = 0;
  const uint8_t* data = nullptr;
  int64_t row_bytes = 0, n = 0, k = 0;
  const uint8_t* e8m0 = nullptr;
  const float* block_scales = nullptr;
  int64_t scale_stride = 0, block_n = 128, block_k = 128;
  float* y = nullptr;
  int64_t ldy = 0;
};
cudaError_t LaunchQuantGemm(const QuantGemmArgsDev& a, cudaStream_t stream);

// PagedAttentionCuda's arguments (kernels/paged_attention.h, PagedAttentionBatch), d <= 256.
struct PagedAttentionArgsDev {
  const float* q = nullptr;
  float* out = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  bool kv_bf16 = false;
  int64_t rows = 0, hq = 0, hkv = 0, d = 0, block_size = 0, max_blocks = 0, window = 0;
  const int32_t* block_tables = nullptr;
  const int32_t* seq_of_row = nullptr;
  const int64_t* pos_of_row = nullptr;
  float scale = 1.0f;
  const float* sinks = nullptr;
};
cudaError_t LaunchPagedAttention(const PagedAttentionArgsDev& a, cudaStream_t stream);

}  // namespace cuda_internal
}  // namespace moelora

#endif  // MOELORA_KERNELS_CUDA_LAUNCH_H_
