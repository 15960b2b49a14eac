// Causal self-attention with grouped KV heads over each sequence's KV cache: optional q/k norms
// (before RoPE), an optional sliding window, and an optional output gate before o_proj: per
// element (Qwen3.5: q_proj emits [q_h ; gate_h] per head, attn · sigmoid(gate)) or per head
// (Step3.5: g_proj gives one scalar per head, head h's output · sigmoid(g_h)).
// Projections are LoraLinear (q/k/v column-parallel, o row-parallel): the caller all-reduces
// the output.
#ifndef MOELORA_WORKER_LAYERS_ATTENTION_H_
#define MOELORA_WORKER_LAYERS_ATTENTION_H_

#include <ATen/ATen.h>

#include <memory>

#include "absl/status/statusor.h"
#include "worker/layers/forward_batch.h"
#include "worker/layers/linear.h"
#include "worker/layers/lora_batch.h"
#include "worker/layers/norm.h"
#include "worker/layers/rotary.h"

namespace moelora {

// q [T, hq, d] and k [T, hkv, d] (heads at any stride, each head's d values contiguous) replaced by
// rope.Apply(RmsNorm(x, norm, eps, kind), table) of each, as new contiguous tensors, in one pass
// over the tokens on the CPU: the arithmetic and roundings of RmsNorm and Rotary::Apply where
// those run by hand (contiguous x), the same bits. Returns false, and leaves q and k as they
// were, where it does not apply: not on the CPU, another dtype than f32 or bf16, a norm missing or
// of another dtype, a table of another shape.
bool NormRotaryQk(at::Tensor& q, at::Tensor& k, const at::Tensor& q_norm, const at::Tensor& k_norm,
                  double eps, NormKind kind, const Rotary& rope, const Rotary::Table& table);

struct AttentionSpec {
  int64_t heads = 0;     // query heads on this rank
  int64_t kv_heads = 0;  // KV heads on this rank
  int64_t head_dim = 0;
  double eps = 1e-6;  // q/k norm
  NormKind qk_norm_kind = NormKind::kPlain;
  int64_t sliding_window = 0;  // 0: full causal
  bool output_gate = false;
};

// GPT-OSS's attention sinks: a learned logit per head that joins each softmax's denominator
// (and has no value).

class Attention {
 public:
  // q_norm / k_norm may be undefined (no q/k norm); sinks ([heads] on this rank) too.
  Attention(const AttentionSpec& spec, std::unique_ptr<LoraLinear> q, std::unique_ptr<LoraLinear> k,
            std::unique_ptr<LoraLinear> v, std::unique_ptr<LoraLinear> o, at::Tensor q_norm,
            at::Tensor k_norm, at::Tensor sinks = at::Tensor());

  // h [T, H] (normalised); writes the new tokens' K/V into each sequence's KV cache blocks
  // (reserved by the caller: SeqState::blocks covers len + count positions) and attends over
  // them.
  [[nodiscard]] absl::StatusOr<at::Tensor> Forward(const at::Tensor& h, const ForwardBatch& b,
                                                   int layer, const Rotary& rope,
                                                   const Rotary::Table& table, const LoraBatch& lb);
  const AttentionSpec& spec() const { return spec_; }
  LoraLinear* q() { return q_.get(); }
  LoraLinear* k() { return k_.get(); }
  LoraLinear* v() { return v_.get(); }
  LoraLinear* o() { return o_.get(); }
  // Step3's shared low-rank query: q = q_proj(RmsNorm(q_down(h), latent_norm)), with q_down
  // replicated (every rank computes the whole latent) and q_proj (`wq`) column-parallel.
  void set_query_latent(std::unique_ptr<LoraLinear> q_down, at::Tensor latent_norm) {
    q_down_ = std::move(q_down);
    latent_norm_ = std::move(latent_norm);
  }
  LoraLinear* q_down() { return q_down_.get(); }
  // Step3.5's head-wise gate: g_proj, column-parallel like q ([heads on this rank] outputs).
  void set_head_gate(std::unique_ptr<LoraLinear> g) { g_ = std::move(g); }
  LoraLinear* g() { return g_.get(); }

 private:
  AttentionSpec spec_;
  std::unique_ptr<LoraLinear> q_, k_, v_, o_, g_, q_down_;
  at::Tensor q_norm_, k_norm_, sinks_, latent_norm_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_ATTENTION_H_
