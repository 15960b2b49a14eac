// GPT-OSS (docs/models.md §4): h += o(attn(norm(h))) with biases, sinks and sliding-window layers
// from layer_types (YaRN RoPE); h += moe(norm(h)) with a biased top-k-then-softmax router and
// experts with biases and the clamped SwiGLU of interleaved gate/up. The release's MXFP4 experts
// stay MXFP4 (MakeExperts); bf16 or f32 checkpoints load too. The CPU path only for now: the
// fused GPU MoE kernel has no expert biases or clamped activation. Only composes layers
// (worker/layers/).
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "worker/architectures/decoder.h"
#include "worker/layers/attention.h"
#include "worker/layers/moe.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model/model_context.h"

namespace moelora {

namespace {

std::vector<ParamSpec> GptOssSpecs(const ModelConfig& c, bool with_lm_head) {
  const int64_t H = c.info.hidden_size, V = c.vocab_size, E = c.info.num_experts,
                I = c.info.moe_intermediate_size, d = c.info.head_dim,
                hq = c.info.num_attention_heads, hkv = c.info.num_key_value_heads;
  std::vector<ParamSpec> s = {{"model.embed_tokens.weight", {V, H}, TpSplit::kReplicated},
                              {"model.norm.weight", {H}, TpSplit::kReplicated}};
  if (with_lm_head) s.push_back({"lm_head.weight", {V, H}, TpSplit::kReplicated});
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const std::string a = p + "self_attn.";
    s.push_back({p + "input_layernorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "post_attention_layernorm.weight", {H}, TpSplit::kReplicated});
    AddAttentionSpecs(s, p, c, hq * d, /*qk_norm=*/false, /*lora_wrapped=*/true);
    if (c.attention_bias) {
      s.push_back({a + "q_proj.bias", {hq * d}, TpSplit::kRows});
      s.push_back({a + "k_proj.bias", {hkv * d}, TpSplit::kRows});
      s.push_back({a + "v_proj.bias", {hkv * d}, TpSplit::kRows});
      s.push_back({a + "o_proj.bias", {H}, TpSplit::kReplicated});
    }
    s.push_back({a + "sinks", {hq}, TpSplit::kRows});
    s.push_back({p + "mlp.router.weight", {E, H}, TpSplit::kReplicated});
    s.push_back({p + "mlp.router.bias", {E}, TpSplit::kReplicated});
    AddExpertSpecs(s, p + "mlp.experts", c, /*lora_wrapped=*/true);
    s.push_back({p + "mlp.experts.w13_bias", {E, 2 * I, 1}, TpSplit::kExperts});
    s.push_back({p + "mlp.experts.w2_bias", {E, H}, TpSplit::kReplicated});
  }
  return s;
}

class GptOss final : public DecoderModel {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CausalLM>> Create(const ModelContext& ctx);
};

absl::StatusOr<std::unique_ptr<CausalLM>> GptOss::Create(const ModelContext& ctx) {
  ModelConfig c = ctx.config;
  const ModelOptions& o = ctx.options;
  const std::string cfg = ctx.dir + "/config.json";
  if (o.kernels != LoraKernels::kCpuSgmv) {
    return absl::FailedPreconditionError(
        "GptOssForCausalLM runs on the CPU path only for now (--device cpu): the fused GPU MoE "
        "kernel has no expert biases or clamped SwiGLU");
  }
  if (c.layer_types.empty()) {
    // transformers' default: even layers sliding, odd layers full.
    for (int l = 0; l < c.info.num_layers; ++l) {
      c.layer_types.push_back(l % 2 == 0 ? "sliding_attention" : "full_attention");
    }
  }
  c.sliding_window = c.sliding_window_value;
  c.sliding_layers.assign(c.info.num_layers, false);
  for (int l = 0; l < c.info.num_layers; ++l) {
    if (c.layer_types[l] == "sliding_attention") {
      if (c.sliding_window <= 0)
        return ConfigRefused(cfg, "sliding_attention layers need sliding_window");
      c.sliding_layers[l] = true;
    } else if (c.layer_types[l] != "full_attention") {
      return ConfigRefused(cfg, "layer_types[", l, "] \"", c.layer_types[l],
                           "\" is not a GPT-OSS layer");
    }
  }
  if (c.rope.partial_rotary_factor != 1.0)
    return ConfigRefused(cfg, "partial_rotary_factor is not GPT-OSS's");
  MOELORA_ASSIGN_OR_RETURN(ModelWeights mw,
                           LoadModelWeights(ctx, c, [&](bool lm) { return GptOssSpecs(c, lm); }));
  LoadedWeights& w = mw.weights;
  const bool has_lm_head = mw.has_lm_head;
  auto m = std::unique_ptr<GptOss>(new GptOss());
  auto& P = w.params;
  MOELORA_RETURN_IF_ERROR(m->Adopt(ctx, c, w.skipped, P));
  const at::Device dev = m->device();
  m->ends_ = LmEnds::From(P, has_lm_head);
  m->rotaries_.emplace_back(c.rope, dev);
  m->norm_ = NormKind::kPlainF32Weight;
  const SlotShape shape = SlotShape::For(o, dev, ctx.comm);
  const int tp = o.tp_size;
  const int64_t d = c.info.head_dim, hq = c.info.num_attention_heads;
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    DecoderLayer L;
    L.in_norm = P.at(p + "input_layernorm.weight");
    L.post_norm = P.at(p + "post_attention_layernorm.weight");
    MOELORA_ASSIGN_OR_RETURN(AttentionParts parts, MakeAttentionParts(P, p, c, tp, hq * d, shape));
    parts.spec.sliding_window = c.sliding_layers[l] ? c.sliding_window : 0;
    L.attn = MakeAttention(std::move(parts), P, p, /*qk_norm=*/false, /*sinks=*/true);
    MOELORA_ASSIGN_OR_RETURN(auto experts,
                             MakeExperts(p + "mlp.experts", P, c, o, m->wrapper_, shape));
    // The down bias is added once over the ranks: by rank 0 under plain TP (every rank holds
    // part of every expert), by the expert's own rank under expert parallelism.
    experts->SetBiases(P.at(p + "mlp.experts.w13_bias").squeeze(-1),
                       P.at(p + "mlp.experts.w2_bias"), o.expert_parallel || o.tp_rank == 0);
    ExpertActivation act;
    act.kind = ExpertActivation::Kind::kClampedSwiGlu;
    act.alpha = c.swiglu_alpha;
    act.limit = c.swiglu_limit;
    experts->set_activation(act);
    L.moe = std::make_unique<MoeBlock>(P.at(p + "mlp.router.weight"), RouterKind::kTopKSoftmax,
                                       c.num_experts_per_tok, false, std::move(experts), nullptr,
                                       P.at(p + "mlp.router.bias"));
    m->layers_.push_back(std::move(L));
  }
  for (DecoderLayer& L : m->layers_) m->RegisterLayerLora(L);
  return std::unique_ptr<CausalLM>(std::move(m));
}

}  // namespace

[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateGptOss(const ModelContext& ctx) {
  return GptOss::Create(ctx);
}

}  // namespace moelora
