// Qwen3.5-MoE (docs/models.md §3): a hybrid stack from layer_types, Gated DeltaNet
// (linear_attention) or gated full attention (full_attention) as the mixer, then a softmax top-k
// MoE block with a sigmoid-gated shared expert; every norm zero-centred. Text path of
// Qwen3_5MoeForConditionalGeneration (vision tower and MTP head skipped) and the text-only
// Qwen3_5MoeForCausalLM. Only composes layers (worker/layers/).
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "nlohmann/json.hpp"
#include "schema/name_tables.h"
#include "worker/architectures/decoder.h"
#include "worker/architectures/qwen3_moe.h"
#include "worker/layers/attention.h"
#include "worker/layers/gated_delta_net.h"
#include "worker/layers/moe.h"
#include "worker/model/model_context.h"

namespace moelora {

namespace {

bool IsLinear(const ModelConfig& c, int l) { return c.layer_types[l] == "linear_attention"; }

// A layer's MoE block (router, routed experts, shared expert and its gate) at prefix p.
void AddMoeSpecs(std::vector<ParamSpec>& s, const std::string& p, const ModelConfig& c) {
  const int64_t H = c.info.hidden_size, E = c.info.num_experts,
                Is = c.info.shared_expert_intermediate_size;
  s.push_back({p + "mlp.gate.weight", {E, H}, TpSplit::kReplicated});
  AddExpertSpecs(s, p + "mlp.experts", c, /*lora_wrapped=*/true);
  AddSwiGluSpecs(s, p + "mlp.shared_expert.", H, Is);
  s.push_back({p + "mlp.shared_expert_gate.weight", {1, H}, TpSplit::kReplicated});
}

// The MTP head (`mtp.*`): fc over [embedding ; hidden], its two input norms, one full-attention
// MoE layer, its norm.
std::vector<ParamSpec> MtpSpecs(const ModelConfig& c) {
  const int64_t H = c.info.hidden_size;
  std::vector<ParamSpec> s = {{"mtp.fc.weight", {H, 2 * H}, TpSplit::kReplicated},
                              {"mtp.pre_fc_norm_embedding.weight", {H}, TpSplit::kReplicated},
                              {"mtp.pre_fc_norm_hidden.weight", {H}, TpSplit::kReplicated},
                              {"mtp.norm.weight", {H}, TpSplit::kReplicated}};
  const std::string p = "mtp.layers.0.";
  s.push_back({p + "input_layernorm.weight", {H}, TpSplit::kReplicated});
  s.push_back({p + "post_attention_layernorm.weight", {H}, TpSplit::kReplicated});
  AddAttentionSpecs(s, p, c, 2 * int64_t{c.info.num_attention_heads} * c.info.head_dim,
                    /*qk_norm=*/true, /*lora_wrapped=*/true);
  AddMoeSpecs(s, p, c);
  return s;
}

std::vector<ParamSpec> Qwen35Specs(const ModelConfig& c, bool with_lm_head) {
  const int64_t H = c.info.hidden_size, V = c.vocab_size, d = c.info.head_dim,
                hq = c.info.num_attention_heads;
  const int64_t kd = int64_t{c.info.linear_num_key_heads} * c.info.linear_key_head_dim,
                vd = int64_t{c.info.linear_num_value_heads} * c.info.linear_value_head_dim,
                nv = c.info.linear_num_value_heads, K = c.linear_conv_kernel;
  std::vector<ParamSpec> s = {{"model.embed_tokens.weight", {V, H}, TpSplit::kReplicated},
                              {"model.norm.weight", {H}, TpSplit::kReplicated}};
  if (with_lm_head) s.push_back({"lm_head.weight", {V, H}, TpSplit::kReplicated});
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    s.push_back({p + "input_layernorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "post_attention_layernorm.weight", {H}, TpSplit::kReplicated});
    if (IsLinear(c, l)) {
      const std::string a = p + "linear_attn.";
      s.push_back(
          {a + "in_proj_qkv.base_layer.weight", {2 * kd + vd, H}, TpSplit::kRows, {kd, kd, vd}});
      s.push_back({a + "in_proj_z.base_layer.weight", {vd, H}, TpSplit::kRows});
      s.push_back({a + "in_proj_b.base_layer.weight", {nv, H}, TpSplit::kRows});
      s.push_back({a + "in_proj_a.base_layer.weight", {nv, H}, TpSplit::kRows});
      s.push_back({a + "conv1d.weight", {2 * kd + vd, 1, K}, TpSplit::kRows, {kd, kd, vd}});
      s.push_back({a + "dt_bias", {nv}, TpSplit::kRows});
      s.push_back({a + "A_log", {nv}, TpSplit::kRows});
      s.push_back({a + "norm.weight", {c.info.linear_value_head_dim}, TpSplit::kReplicated});
      s.push_back({a + "out_proj.base_layer.weight", {H, vd}, TpSplit::kCols});
    } else {
      AddAttentionSpecs(s, p, c, 2 * hq * d, /*qk_norm=*/true, /*lora_wrapped=*/true);
    }
    AddMoeSpecs(s, p, c);
  }
  return s;
}

class Qwen35Moe final : public DecoderModel {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CausalLM>> Create(const ModelContext& ctx);
};

// config.json against what this Qwen3.5 implements; fills transformers' defaults for
// layer_types and partial_rotary_factor.
absl::Status CheckConfig(const std::string& cfg, ModelConfig& c, int tp) {
  if (c.hidden_act != "silu")
    return ConfigRefused(cfg, "hidden_act \"", c.hidden_act, "\" (silu only)");
  if (c.sliding_window > 0) {
    return ConfigRefused(cfg,
                         "use_sliding_window / sliding_window are not implemented for Qwen3.5");
  }
  if (!c.all_layers_moe) {
    return ConfigRefused(cfg,
                         "dense MLP layers (mlp_only_layers / decoder_sparse_step) are not "
                         "implemented for Qwen3.5");
  }
  if (c.attention_bias) {
    return ConfigRefused(cfg, "attention_bias true is not implemented for Qwen3.5");
  }
  if (!c.info.attn_output_gate) {
    return ConfigRefused(
        cfg, "attn_output_gate false is not implemented (Qwen3.5 gates attention output)");
  }
  if (!c.norm_topk_prob) {
    // transformers always renormalises Qwen3.5's top-k; a config that says otherwise is
    // ambiguous between it and vLLM.
    return ConfigRefused(
        cfg, "norm_topk_prob false is not implemented for Qwen3.5 (always renormalised)");
  }
  if (c.layer_types.empty()) {
    // transformers' default: full attention every full_attention_interval-th layer (4).
    for (int l = 0; l < c.info.num_layers; ++l) {
      c.layer_types.push_back((l + 1) % c.full_attention_interval == 0 ? "full_attention"
                                                                       : "linear_attention");
    }
  }
  for (size_t i = 0; i < c.layer_types.size(); ++i) {
    if (c.layer_types[i] != "full_attention" && c.layer_types[i] != "linear_attention") {
      return ConfigRefused(cfg, "layer_types[", i, "] \"", c.layer_types[i],
                           "\" is not a Qwen3.5 layer");
    }
  }
  // transformers defaults Qwen3.5's partial_rotary_factor to 0.25 when the config omits it.
  if (!c.rope.partial_rotary_given) c.rope.partial_rotary_factor = 0.25;
  if (c.rope.rotary_dim() % 2 != 0 || c.rope.rotary_dim() <= 0) {
    return ConfigInvalid(cfg, "partial_rotary_factor ", c.rope.partial_rotary_factor,
                         " of head_dim ", c.info.head_dim, " gives an odd number of rotary dims");
  }
  const ModelInfo& lin = c.info;
  if (lin.linear_num_key_heads <= 0 || lin.linear_num_value_heads <= 0 ||
      lin.linear_key_head_dim <= 0 || lin.linear_value_head_dim <= 0 || c.linear_conv_kernel < 1 ||
      lin.linear_num_value_heads % lin.linear_num_key_heads != 0) {
    return ConfigInvalid(cfg,
                         "linear_num_key_heads, linear_num_value_heads (a multiple of it), "
                         "linear_key_head_dim, linear_value_head_dim and linear_conv_kernel_dim "
                         "must be positive");
  }
  if (lin.linear_num_key_heads % tp != 0 || lin.linear_num_value_heads % tp != 0) {
    return ConfigInvalid(cfg, "linear_num_key_heads ", lin.linear_num_key_heads,
                         " and linear_num_value_heads ", lin.linear_num_value_heads,
                         " must divide by --tensor-parallel-size ", tp);
  }
  if (c.info.shared_expert_intermediate_size <= 0 ||
      c.info.shared_expert_intermediate_size % tp != 0) {
    return ConfigInvalid(cfg, "shared_expert_intermediate_size ",
                         c.info.shared_expert_intermediate_size,
                         " must be positive and divide by --tensor-parallel-size ", tp);
  }
  return absl::OkStatus();
}

// With --speculative-config: config.json must declare the MTP head (one layer, as released).
absl::Status CheckMtpConfig(const ModelContext& ctx, const std::string& cfg) {
  MOELORA_ASSIGN_OR_RETURN(const std::string text, ReadConfigText(ctx.dir));
  const auto j = nlohmann::json::parse(text, nullptr, false);
  const auto& t = j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
  const int n =
      t.contains("mtp_num_hidden_layers") && t["mtp_num_hidden_layers"].is_number_integer()
          ? t["mtp_num_hidden_layers"].get<int>()
          : 0;
  if (n <= 0) return ConfigRefused(cfg, "no mtp_num_hidden_layers: the checkpoint has no MTP head");
  if (n != 1) {
    return ConfigRefused(cfg, "mtp_num_hidden_layers ", n, " (an MTP head of one layer only)");
  }
  if (t.contains("mtp_use_dedicated_embeddings") && t["mtp_use_dedicated_embeddings"] == true) {
    return ConfigRefused(cfg,
                         "mtp_use_dedicated_embeddings true is not implemented (the head shares "
                         "the model's embeddings)");
  }
  return absl::OkStatus();
}

// Builds the layers of one Qwen3.5 model from its loaded parameters.
class Qwen35Builder : public LayerBuilder {
 public:
  using LayerBuilder::LayerBuilder;

  // A decoder layer at prefix p: its norms, its mixer (Gated DeltaNet or gated attention), its
  // MoE block.
  absl::StatusOr<DecoderLayer> Layer(const std::string& p, bool linear_attention) const {
    DecoderLayer L;
    L.in_norm = P_.at(p + "input_layernorm.weight");
    L.post_norm = P_.at(p + "post_attention_layernorm.weight");
    if (linear_attention) {
      MOELORA_RETURN_IF_ERROR(DeltaNet(p, L));
    } else {
      MOELORA_RETURN_IF_ERROR(GatedAttention(p, L));
    }
    MOELORA_RETURN_IF_ERROR(Moe(p, L));
    return L;
  }

 private:
  // Full attention with q and its output gate from one projection.
  absl::Status GatedAttention(const std::string& p, DecoderLayer& L) const {
    const int64_t q_rows = 2 * int64_t{c_.info.num_attention_heads} * c_.info.head_dim;
    MOELORA_ASSIGN_OR_RETURN(AttentionParts a,
                             MakeAttentionParts(P_, p, c_, o_.tp_size, q_rows, shape_));
    a.spec.qk_norm_kind = NormKind::kZeroCentred;
    a.spec.output_gate = true;
    L.attn = MakeAttention(std::move(a), P_, p, /*qk_norm=*/true);
    return absl::OkStatus();
  }
  absl::Status DeltaNet(const std::string& p, DecoderLayer& L) const {
    const ModelInfo& lin = c_.info;
    const int tp = o_.tp_size;
    const int64_t H = lin.hidden_size;
    const int64_t kd = int64_t{lin.linear_num_key_heads} * lin.linear_key_head_dim,
                  vd = int64_t{lin.linear_num_value_heads} * lin.linear_value_head_dim,
                  nv = lin.linear_num_value_heads;
    const std::string a = p + "linear_attn.";
    MOELORA_ASSIGN_OR_RETURN(auto qkv, Linear(a + "in_proj_qkv", TpMode::kColumn, H, {kd, kd, vd}));
    MOELORA_ASSIGN_OR_RETURN(auto z, Linear(a + "in_proj_z", TpMode::kColumn, H, {vd}));
    MOELORA_ASSIGN_OR_RETURN(auto bp, Linear(a + "in_proj_b", TpMode::kColumn, H, {nv}));
    MOELORA_ASSIGN_OR_RETURN(auto ap, Linear(a + "in_proj_a", TpMode::kColumn, H, {nv}));
    MOELORA_ASSIGN_OR_RETURN(auto out, Linear(a + "out_proj", TpMode::kRow, vd, {H}));
    GatedDeltaNetSpec gs;
    gs.num_key_heads = lin.linear_num_key_heads / tp;
    gs.num_value_heads = lin.linear_num_value_heads / tp;
    gs.key_head_dim = lin.linear_key_head_dim;
    gs.value_head_dim = lin.linear_value_head_dim;
    gs.conv_kernel = c_.linear_conv_kernel;
    gs.eps = c_.rms_norm_eps;
    L.gdn = std::make_unique<GatedDeltaNet>(
        gs, std::move(qkv), std::move(z), std::move(bp), std::move(ap), std::move(out),
        P_.at(a + "conv1d.weight").squeeze(1), P_.at(a + "dt_bias"), P_.at(a + "A_log"),
        P_.at(a + "norm.weight"));
    return absl::OkStatus();
  }
  // The MoE block with its sigmoid-gated shared expert.
  absl::Status Moe(const std::string& p, DecoderLayer& L) const {
    MOELORA_ASSIGN_OR_RETURN(auto shared,
                             MakeSwiGluMlp(P_, p + "mlp.shared_expert.", c_.info.hidden_size,
                                           c_.info.shared_expert_intermediate_size, shape_));
    shared->gate_weight = P_.at(p + "mlp.shared_expert_gate.weight");
    MOELORA_ASSIGN_OR_RETURN(auto experts,
                             MakeExperts(p + "mlp.experts", P_, c_, o_, wrapper_, shape_));
    L.moe = std::make_unique<MoeBlock>(P_.at(p + "mlp.gate.weight"), RouterKind::kSoftmaxTopK,
                                       c_.num_experts_per_tok, /*norm_topk_prob=*/true,
                                       std::move(experts), std::move(shared));
    return absl::OkStatus();
  }
};

absl::StatusOr<std::unique_ptr<CausalLM>> Qwen35Moe::Create(const ModelContext& ctx) {
  ModelConfig c = ctx.config;
  const ModelOptions& o = ctx.options;
  const std::string cfg = ctx.dir + "/config.json";
  MOELORA_RETURN_IF_ERROR(CheckConfig(cfg, c, o.tp_size));
  // The vision tower of the multimodal release (no DeepStack; image_token_id's class default).
  MOELORA_ASSIGN_OR_RETURN(std::optional<VisionConfig> vision,
                           ReadVisionConfig(ctx, c, /*deepstack=*/false, 248056));
  // The MTP head, when asked for: the checkpoint's `mtp.*` names are then read (the main table
  // skips them).
  ModelContext load_ctx = ctx;
  ArchTable with_mtp;
  if (o.mtp) {
    MOELORA_RETURN_IF_ERROR(CheckMtpConfig(ctx, cfg));
    with_mtp = *ctx.arch;
    with_mtp.map = &MapQwen35Moe;
    load_ctx.arch = &with_mtp;
  }
  MOELORA_ASSIGN_OR_RETURN(ModelWeights mw, LoadModelWeights(load_ctx, c, [&](bool lm) {
                             std::vector<ParamSpec> s = Qwen35Specs(c, lm);
                             if (vision) {
                               for (ParamSpec& v : VisionParamSpecs(*vision)) s.push_back(v);
                             }
                             if (o.mtp) {
                               for (ParamSpec& v : MtpSpecs(c)) s.push_back(v);
                             }
                             return s;
                           }));
  LoadedWeights& w = mw.weights;
  auto m = std::unique_ptr<Qwen35Moe>(new Qwen35Moe());
  auto& P = w.params;
  MOELORA_RETURN_IF_ERROR(m->Adopt(ctx, c, w.skipped, P));
  const at::Device dev = m->device();
  m->ends_ = LmEnds::From(P, mw.has_lm_head);
  m->rotaries_.emplace_back(c.rope, dev);
  m->norm_ = NormKind::kZeroCentred;
  const Qwen35Builder build(c, o, P, SlotShape::For(o, dev, ctx.comm), m->wrapper_);
  for (int l = 0; l < c.info.num_layers; ++l) {
    MOELORA_ASSIGN_OR_RETURN(DecoderLayer L,
                             build.Layer(absl::StrCat("model.layers.", l, "."), IsLinear(c, l)));
    m->layers_.push_back(std::move(L));
  }
  for (DecoderLayer& L : m->layers_) m->RegisterLayerLora(L);
  if (o.mtp) {
    auto head = std::make_unique<MtpHead>();
    head->fc = P.at("mtp.fc.weight");
    head->norm_embed = P.at("mtp.pre_fc_norm_embedding.weight");
    head->norm_hidden = P.at("mtp.pre_fc_norm_hidden.weight");
    head->norm = P.at("mtp.norm.weight");
    MOELORA_ASSIGN_OR_RETURN(head->layer, build.Layer("mtp.layers.0.", /*linear_attention=*/false));
    // Its keys and values: one more KV layer after the decoder's.
    head->kv_layer = c.info.num_layers;
    m->num_layers_ = c.info.num_layers + 1;
    // The head's modules take adapters too (their module paths are under `mtp.`).
    m->RegisterLayerLora(head->layer);
    m->mtp_.push_back(std::move(head));
  }
  if (vision) MOELORA_RETURN_IF_ERROR(m->BuildVision(*vision, P, ctx));
  return std::unique_ptr<CausalLM>(std::move(m));
}

}  // namespace

[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateQwen35Moe(const ModelContext& ctx) {
  return Qwen35Moe::Create(ctx);
}

}  // namespace moelora
