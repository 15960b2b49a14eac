// Gated DeltaNet (Qwen3.5's linear-attention layers, docs/models.md §3), for one TP rank:
//   x = in_proj_qkv(u) -> causal depthwise conv (kernel K, SiLU) -> q | k | v; q, k l2-normed,
//   q scaled by dk^-0.5; β = sigmoid(in_proj_b(u)), g = -exp(A_log) · softplus(in_proj_a(u) +
//   dt_bias); per value head a state S [dk, dv]: S ← e^g S; S ← S + k (β (v - Sᵀk))ᵀ; o = Sᵀq;
//   y = w ⊙ rmsnorm(o) ⊙ silu(in_proj_z(u)) per head; out_proj(y) (row-parallel: the caller
//   all-reduces).
// A sequence's state is fixed-size: the last K - 1 pre-conv inputs and S per value head (f32).
// Prefill runs the chunked form of the delta rule (chunks of 64, a triangular solve per chunk);
// single-token steps run the recurrent form; both give the same result up to rounding.
// Value head j uses key head j / (nv / nk) (transformers' repeat_interleave); TP shards the key
// and value heads, and the conv channels along their q, k and v sections.
#ifndef MOELORA_WORKER_LAYERS_GATED_DELTA_NET_H_
#define MOELORA_WORKER_LAYERS_GATED_DELTA_NET_H_

#include <ATen/ATen.h>

#include <memory>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/layers/forward_batch.h"
#include "worker/layers/linear.h"
#include "worker/layers/lora_batch.h"

namespace moelora {

struct GatedDeltaNetSpec {
  int64_t num_key_heads = 0;    // on this rank
  int64_t num_value_heads = 0;  // on this rank
  int64_t key_head_dim = 0, value_head_dim = 0;
  int64_t conv_kernel = 4;
  double eps = 1e-6;  // the gated RMSNorm
  int64_t chunk = 64;
  // Which form of the delta rule: by token count (chunked for more than one token), or forced
  // (tests and benchmarks compare the two).
  enum class Form { kAuto, kRecurrent, kChunked } form = Form::kAuto;
};

class GatedDeltaNet {
 public:
  // conv_weight [channels_local, K]; dt_bias, a_log [value_heads_local]; norm [value_head_dim].
  GatedDeltaNet(const GatedDeltaNetSpec& spec, std::unique_ptr<LoraLinear> in_qkv,
                std::unique_ptr<LoraLinear> in_z, std::unique_ptr<LoraLinear> in_b,
                std::unique_ptr<LoraLinear> in_a, std::unique_ptr<LoraLinear> out,
                at::Tensor conv_weight, at::Tensor dt_bias, at::Tensor a_log, at::Tensor norm);

  // h [T, H] (normalised); advances each sequence's state of this layer (its entry in the KV
  // cache's recurrent-state pool, reserved before the step).
  [[nodiscard]] absl::StatusOr<at::Tensor> Forward(const at::Tensor& h, const ForwardBatch& b,
                                                   int layer, const LoraBatch& lb);
  void set_form(GatedDeltaNetSpec::Form f) { spec_.form = f; }
  // A sequence's state on this rank: the last K - 1 pre-conv inputs [K - 1, channels] (model
  // dtype) and S per value head [value_heads, dk, dv] (f32).
  std::vector<int64_t> conv_shape() const {
    return {spec_.conv_kernel - 1, 2 * spec_.num_key_heads * spec_.key_head_dim +
                                       spec_.num_value_heads * spec_.value_head_dim};
  }
  std::vector<int64_t> ssm_shape() const {
    return {spec_.num_value_heads, spec_.key_head_dim, spec_.value_head_dim};
  }

  LoraLinear* in_qkv() { return in_qkv_.get(); }
  LoraLinear* in_z() { return in_z_.get(); }
  LoraLinear* in_b() { return in_b_.get(); }
  LoraLinear* in_a() { return in_a_.get(); }
  LoraLinear* out() { return out_.get(); }

 private:
  // q, k [nv, n, dk], v [nv, n, dv], g, beta [nv, n] (f32); state [nv, dk, dv] updated in place
  // (and, with `steps` [n, nv, dk, dv], copied there after each token).
  at::Tensor Recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& g, const at::Tensor& beta, at::Tensor& state,
                       at::Tensor* steps = nullptr) const;
  at::Tensor Chunked(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                     const at::Tensor& g, const at::Tensor& beta, at::Tensor& state) const;

  GatedDeltaNetSpec spec_;
  std::unique_ptr<LoraLinear> in_qkv_, in_z_, in_b_, in_a_, out_;
  at::Tensor conv_w_;  // f32 [channels_local, K]
  at::Tensor dt_bias_, a_neg_exp_, norm_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_GATED_DELTA_NET_H_
