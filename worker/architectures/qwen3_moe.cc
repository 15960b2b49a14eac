// Qwen3-MoE: h += o(attn(norm(h))); h += moe(norm(h)); logits = lm_head(norm(h)). Only composes
// layers (worker/layers/).
#include "worker/architectures/qwen3_moe.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "nlohmann/json.hpp"
#include "worker/architectures/decoder.h"
#include "worker/layers/attention.h"
#include "worker/layers/moe.h"
#include "worker/model/model_context.h"

namespace moelora {

std::vector<ParamSpec> Qwen3MoeParamSpecs(const ModelConfig& c, bool lw, bool with_lm_head) {
  const int64_t H = c.info.hidden_size, V = c.vocab_size, E = c.info.num_experts;
  std::vector<ParamSpec> s = {{"model.embed_tokens.weight", {V, H}, TpSplit::kReplicated},
                              {"model.norm.weight", {H}, TpSplit::kReplicated}};
  if (with_lm_head) s.push_back({"lm_head.weight", {V, H}, TpSplit::kReplicated});
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    s.push_back({p + "input_layernorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "post_attention_layernorm.weight", {H}, TpSplit::kReplicated});
    AddAttentionSpecs(s, p, c, int64_t{c.info.num_attention_heads} * c.info.head_dim,
                      /*qk_norm=*/true, lw);
    s.push_back({p + "mlp.gate.weight", {E, H}, TpSplit::kReplicated});
    AddExpertSpecs(s, p + "mlp.experts", c, lw);
  }
  return s;
}

namespace {

class Qwen3Moe final : public DecoderModel {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CausalLM>> Create(const ModelContext& ctx);
};

absl::StatusOr<std::unique_ptr<CausalLM>> Qwen3Moe::Create(const ModelContext& ctx) {
  const ModelConfig& c = ctx.config;
  const ModelOptions& o = ctx.options;
  const std::string cfg = ctx.dir + "/config.json";
  if (!c.all_layers_moe) {
    return absl::InvalidArgumentError(absl::StrCat(
        cfg, ": dense MLP layers (mlp_only_layers / decoder_sparse_step) are not served yet"));
  }
  if (c.hidden_act != "silu") {
    return ConfigRefused(cfg, "hidden_act \"", c.hidden_act, "\" is not implemented (silu only)");
  }
  if (c.attention_bias)
    return ConfigRefused(cfg, "attention_bias true is not implemented for ", c.info.architecture);
  // Keys Qwen3-Coder's release carries that transformers' Qwen3-MoE does not read: accepted where
  // they describe this forward (no q/k/v bias, q/k norms on, no shared expert).
  MOELORA_ASSIGN_OR_RETURN(const std::string text, ReadConfigText(ctx.dir));
  const nlohmann::json j = nlohmann::json::parse(text);
  const nlohmann::json& t = j.contains("text_config") ? j["text_config"] : j;
  if (t.value("qkv_bias", false)) return ConfigRefused(cfg, "qkv_bias true is not implemented");
  if (!t.value("use_qk_norm", true))
    return ConfigRefused(cfg, "use_qk_norm false is not implemented");
  if (c.info.shared_expert_intermediate_size != 0) {
    return ConfigRefused(cfg, "shared_expert_intermediate_size ",
                         c.info.shared_expert_intermediate_size, ": ", c.info.architecture,
                         " has no shared expert");
  }
  for (size_t i = 0; i < c.layer_types.size(); ++i) {
    if (c.layer_types[i] != "full_attention" && c.layer_types[i] != "sliding_attention") {
      return ConfigRefused(cfg, "layer_types[", i, "] \"", c.layer_types[i],
                           "\" is not a layer of ", c.info.architecture);
    }
  }
  if (c.rope.partial_rotary_factor != 1.0) {
    // transformers' Qwen3-MoE rotates whole heads (its cos/sin would not even broadcast).
    return ConfigRefused(cfg, "partial_rotary_factor ", c.rope.partial_rotary_factor,
                         " is not implemented for ", c.info.architecture,
                         " (whole-head RoPE only)");
  }
  // Qwen3-VL-MoE: the vision tower with DeepStack mergers (image_token_id's class default).
  std::optional<VisionConfig> vision;
  if (c.info.architecture == "Qwen3VLMoeForConditionalGeneration") {
    MOELORA_ASSIGN_OR_RETURN(vision, ReadVisionConfig(ctx, c, /*deepstack=*/true, 151655));
    if (vision && static_cast<int>(vision->deepstack_visual_indexes.size()) > c.info.num_layers) {
      return ConfigRefused(
          cfg, "vision_config.deepstack_visual_indexes: more DeepStack features than layers");
    }
  }
  MOELORA_ASSIGN_OR_RETURN(ModelWeights mw, LoadModelWeights(ctx, c, [&](bool lm) {
                             std::vector<ParamSpec> s = Qwen3MoeParamSpecs(c, true, lm);
                             if (vision) {
                               for (ParamSpec& v : VisionParamSpecs(*vision)) s.push_back(v);
                             }
                             return s;
                           }));
  LoadedWeights& w = mw.weights;
  const bool has_lm_head = mw.has_lm_head;
  auto m = std::unique_ptr<Qwen3Moe>(new Qwen3Moe());
  auto& P = w.params;
  MOELORA_RETURN_IF_ERROR(m->Adopt(ctx, c, w.skipped, P));
  const int tp = o.tp_size;
  const int64_t d = c.info.head_dim, hq = c.info.num_attention_heads;
  const at::Device dev = m->device();
  m->ends_ = LmEnds::From(P, has_lm_head);
  m->rotaries_.emplace_back(c.rope, dev);
  m->norm_ = NormKind::kPlain;
  const SlotShape shape = SlotShape::For(o, dev, ctx.comm);
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    DecoderLayer L;
    L.in_norm = P.at(p + "input_layernorm.weight");
    L.post_norm = P.at(p + "post_attention_layernorm.weight");
    MOELORA_ASSIGN_OR_RETURN(AttentionParts a, MakeAttentionParts(P, p, c, tp, hq * d, shape));
    const bool sliding = c.sliding_window > 0 && !c.sliding_layers.empty() && c.sliding_layers[l];
    a.spec.sliding_window = sliding ? c.sliding_window : 0;
    L.attn = MakeAttention(std::move(a), P, p, /*qk_norm=*/true);
    MOELORA_ASSIGN_OR_RETURN(auto experts,
                             MakeExperts(p + "mlp.experts", P, c, o, m->wrapper_, shape));
    L.moe = std::make_unique<MoeBlock>(P.at(p + "mlp.gate.weight"), RouterKind::kSoftmaxTopK,
                                       c.num_experts_per_tok, c.norm_topk_prob, std::move(experts));
    m->layers_.push_back(std::move(L));
  }
  for (DecoderLayer& L : m->layers_) m->RegisterLayerLora(L);
  if (vision) MOELORA_RETURN_IF_ERROR(m->BuildVision(*vision, P, ctx));
  return std::unique_ptr<CausalLM>(std::move(m));
}

}  // namespace

[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateQwen3Moe(const ModelContext& ctx) {
  return Qwen3Moe::Create(ctx);
}

}  // namespace moelora
