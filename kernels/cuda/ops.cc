// Host side of the CUDA ops: validation, then the plain-argument launchers of the .cu files.
#include "absl/strings/str_cat.h"
#include "kernels/bgmv.h"
#include "kernels/cuda/launch.h"
#include "kernels/cuda/status.h"
#include "kernels/internal/moe_lora_workspace.h"
#include "kernels/moe_lora.h"
#include "kernels/paged_attention.h"
#include "kernels/quant_gemm.h"

namespace moelora {

using cuda_internal::CudaStatus;
using cuda_internal::ElemType;

namespace {
[[nodiscard]] absl::Status CheckCudaRank(const char* op, int64_t max_rank) {
  if (max_rank <= kBgmvCudaMaxRank) return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat(op, ": max_rank ", max_rank, " > ", kBgmvCudaMaxRank, " (CUDA kernel)"));
}

ElemType ToElem(DType d) {
  return d == DType::kF16 ? ElemType::kF16 : d == DType::kBF16 ? ElemType::kBF16 : ElemType::kF32;
}
}  // namespace

[[nodiscard]] absl::Status BgmvCuda(const BgmvParams& p, void* stream) {
  if (auto s = p.Validate(); !s.ok()) return s;
  if (auto s = CheckCudaRank("bgmv", p.max_rank); !s.ok()) return s;
  if (!p.workspace) return absl::InvalidArgumentError("bgmv: CUDA needs a workspace");
  cuda_internal::BgmvArgs a;
  a.type = ToElem(p.dtype);
  a.x = p.x;
  a.x_stride = p.x_stride;
  a.out = p.out;
  a.out_stride = p.out_stride;
  a.a_t = p.a_t;
  a.b_t = p.b_t;
  a.rank = p.rank;
  a.slot_of_token = p.slot_of_token;
  a.num_tokens = p.num_tokens;
  a.in_dim = p.in_dim;
  a.out_dim = p.out_dim;
  a.max_rank = p.max_rank;
  a.y = static_cast<float*>(p.workspace);
  return CudaStatus(cuda_internal::LaunchBgmv(a, static_cast<cudaStream_t>(stream)), "bgmv launch");
}

[[nodiscard]] absl::Status MoeLoraCuda(const MoeLoraParams& p, void* stream) {
  if (auto s = p.Validate(); !s.ok()) return s;
  const bool lora = p.num_gate_up > 0 || p.has_down;
  if (lora) {
    if (auto s = CheckCudaRank("moe_lora", p.max_rank); !s.ok()) return s;
  }
  const int64_t keys = p.num_experts * (lora ? p.num_slots + 1 : 1);
  if (keys > kMoeLoraCudaMaxSortKeys) {
    return absl::InvalidArgumentError(absl::StrCat("moe_lora: experts x (slots + 1) = ", keys,
                                                   " > ", kMoeLoraCudaMaxSortKeys,
                                                   " (the device sort's counters)"));
  }
  if (p.num_tokens * p.top_k > (int64_t{1} << 30)) {
    return absl::InvalidArgumentError("moe_lora: more than 2^30 assignments");
  }
  if (!p.workspace) return absl::InvalidArgumentError("moe_lora: CUDA needs a workspace");
  cuda_internal::MoeArgs a;
  a.type = ToElem(p.dtype);
  a.x = p.x;
  a.topk_ids = p.topk_ids;
  a.topk_weights = p.topk_weights;
  a.slot_of_token = lora ? p.slot_of_token : nullptr;
  a.w13 = p.w13;
  a.w2 = p.w2;
  auto proj = [](const MoeLoraProj& m) {
    return cuda_internal::MoeProjArgs{m.a_t, m.b_t, m.rank, m.out_col, m.out_dim};
  };
  for (int i = 0; i < p.num_gate_up; ++i) a.gate_up[i] = proj(p.gate_up[i]);
  a.num_gate_up = p.num_gate_up;
  if (p.has_down) a.down = proj(p.down);
  a.has_down = p.has_down;
  a.out = p.out;
  a.num_tokens = p.num_tokens;
  a.hidden = p.hidden;
  a.inter = p.inter;
  a.num_experts = p.num_experts;
  a.top_k = p.top_k;
  a.num_slots = p.num_slots;
  a.max_rank = p.max_rank;
  a.swiglu_limit = p.swiglu_limit;
  a.workspace = p.workspace;
  return CudaStatus(cuda_internal::LaunchMoeLora(a, static_cast<cudaStream_t>(stream)),
                    "moe_lora launch");
}

[[nodiscard]] absl::Status PagedAttentionCuda(const PagedAttentionBatch& b, void* stream) {
  if (auto s = b.Validate(); !s.ok()) return s;
  if (b.d > 256) {
    return absl::InvalidArgumentError(
        absl::StrCat("paged_attention: head dim ", b.d, " > 256 (CUDA kernel)"));
  }
  cuda_internal::PagedAttentionArgsDev a;
  a.q = b.q;
  a.out = b.out;
  a.k = b.k;
  a.v = b.v;
  a.kv_bf16 = b.kv_bf16;
  a.rows = b.rows;
  a.hq = b.hq;
  a.hkv = b.hkv;
  a.d = b.d;
  a.block_size = b.block_size;
  a.max_blocks = b.max_blocks;
  a.window = b.window;
  a.block_tables = b.block_tables;
  a.seq_of_row = b.seq_of_row;
  a.pos_of_row = b.pos_of_row;
  a.scale = b.scale;
  a.sinks = b.sinks;
  return CudaStatus(cuda_internal::LaunchPagedAttention(a, static_cast<cudaStream_t>(stream)),
                    "paged attention launch");
}

[[nodiscard]] absl::Status QuantGemmCuda(const QuantGemmArgs& g, void* stream) {
  if (auto s = ValidateQuantGemm(g); !s.ok()) return s;
  cuda_internal::QuantGemmArgsDev a;
  a.mxfp4 = g.w.format == QuantFormat::kMxfp4;
  a.x = g.x;
  a.ldx = g.ldx;
  a.m = g.m;
  a.data = g.w.data;
  a.row_bytes = g.w.row_bytes;
  a.n = g.w.n;
  a.k = g.w.k;
  a.e8m0 = g.w.e8m0;
  a.block_scales = g.w.block_scales;
  a.scale_stride = g.w.scale_stride;
  a.block_n = g.w.block_n;
  a.block_k = g.w.block_k;
  a.y = g.y;
  a.ldy = g.ldy;
  return CudaStatus(cuda_internal::LaunchQuantGemm(a, static_cast<cudaStream_t>(stream)),
                    "quantized GEMM launch");
}

}  // namespace moelora
