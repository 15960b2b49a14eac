// Step3 text (Step3TextForCausalLM; docs/models.md §5): MQA whose query comes from a shared
// low-rank latent (q_proj → inter_norm → wq) and whose single KV head is replicated on every
// rank; neox RoPE over the whole head; then a dense SwiGLU MLP (layers outside
// moe_layers_enum) or the MoE block: softmax over all experts, top-k, renormalised iff
// norm_expert_weight, plus the ungated shared expert. Plain RMSNorm everywhere. vLLM's
// step3_text.py is the anchor (transformers has no class for it; the reference is
// tools/step3_reference.py). Only composes layers (worker/layers/).
#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "nlohmann/json.hpp"
#include "worker/architectures/decoder.h"
#include "worker/layers/attention.h"
#include "worker/layers/moe.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model/model_context.h"

namespace moelora {

namespace {

struct Step3Layout {
  std::vector<bool> moe;
  int64_t share_q = 0, dense_inter = 0, share_inter = 0;
  bool renormalise = false;
};

std::vector<ParamSpec> Step3Specs(const ModelConfig& c, const Step3Layout& L, bool with_lm_head) {
  const int64_t H = c.info.hidden_size, V = c.vocab_size, E = c.info.num_experts,
                d = c.info.head_dim, hq = c.info.num_attention_heads, Q = L.share_q;
  std::vector<ParamSpec> s = {{"model.embed_tokens.weight", {V, H}, TpSplit::kReplicated},
                              {"model.norm.weight", {H}, TpSplit::kReplicated}};
  if (with_lm_head) s.push_back({"lm_head.weight", {V, H}, TpSplit::kReplicated});
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const std::string a = p + "self_attn.";
    s.push_back({p + "input_layernorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "post_attention_layernorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({a + "q_proj.base_layer.weight", {Q, H}, TpSplit::kReplicated});
    s.push_back({a + "inter_norm.weight", {Q}, TpSplit::kReplicated});
    s.push_back({a + "wq.base_layer.weight", {hq * d, Q}, TpSplit::kRows});
    s.push_back({a + "k_proj.base_layer.weight", {d, H}, TpSplit::kReplicated});
    s.push_back({a + "v_proj.base_layer.weight", {d, H}, TpSplit::kReplicated});
    s.push_back({a + "o_proj.base_layer.weight", {H, hq * d}, TpSplit::kCols});
    if (L.moe[l]) {
      s.push_back({p + "moe.gate.weight", {E, H}, TpSplit::kReplicated});
      AddExpertSpecs(s, p + "moe.experts", c, /*lora_wrapped=*/true);
      AddSwiGluSpecs(s, p + "share_expert.", H, L.share_inter);
    } else {
      AddSwiGluSpecs(s, p + "mlp.", H, L.dense_inter);
    }
  }
  return s;
}

class Step3Text final : public DecoderModel {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CausalLM>> Create(const ModelContext& ctx);
};

absl::StatusOr<std::unique_ptr<CausalLM>> Step3Text::Create(const ModelContext& ctx) {
  ModelConfig c = ctx.config;
  const ModelOptions& o = ctx.options;
  const std::string cfg = ctx.dir + "/config.json";
  MOELORA_ASSIGN_OR_RETURN(std::string text, ReadConfigText(ctx.dir));
  const nlohmann::json t = nlohmann::json::parse(text, nullptr, false);
  auto get_int = [&](const char* key, int64_t* out) {
    if (t.contains(key) && t[key].is_number_integer()) *out = t[key].get<int64_t>();
  };
  Step3Layout lay;
  MOELORA_ASSIGN_OR_RETURN(lay.moe,
                           MoeLayersEnum(text, c.info.num_layers, cfg, /*required=*/false));
  get_int("share_q_dim", &lay.share_q);
  get_int("intermediate_size", &lay.dense_inter);
  lay.share_inter = c.info.shared_expert_intermediate_size;
  lay.renormalise = t.contains("norm_expert_weight") && t["norm_expert_weight"].is_boolean() &&
                    t["norm_expert_weight"].get<bool>();
  // Step3 names it in the singular.
  if (c.max_position_embeddings == 0) {
    int64_t m = 0;
    get_int("max_position_embedding", &m);
    c.max_position_embeddings = static_cast<int>(m);
  }
  if (c.hidden_act != "silu")
    return ConfigRefused(cfg, "hidden_act \"", c.hidden_act, "\" (silu only)");
  if (c.info.num_key_value_heads != 1) {
    return ConfigRefused(cfg, "num_attention_groups ", c.info.num_key_value_heads,
                         " is not implemented (Step3 has one KV head; vLLM requires 1 too)");
  }
  if (c.rope.partial_rotary_factor != 1.0)
    return ConfigRefused(cfg, "partial rotary is not Step3's");
  const int tp = o.tp_size;
  const bool any_moe = std::find(lay.moe.begin(), lay.moe.end(), true) != lay.moe.end();
  const bool any_dense = std::find(lay.moe.begin(), lay.moe.end(), false) != lay.moe.end();
  if (lay.share_q <= 0) return ConfigInvalid(cfg, "share_q_dim must be a positive integer");
  if (any_moe && (lay.share_inter <= 0 || lay.share_inter % tp != 0)) {
    return ConfigInvalid(cfg, "share_expert_dim ", lay.share_inter,
                         " must be positive and divide by --tensor-parallel-size ", tp);
  }
  if (any_dense && (lay.dense_inter <= 0 || lay.dense_inter % tp != 0)) {
    return ConfigInvalid(cfg, "intermediate_size ", lay.dense_inter,
                         " must be positive and divide by --tensor-parallel-size ", tp);
  }
  MOELORA_ASSIGN_OR_RETURN(
      ModelWeights mw, LoadModelWeights(ctx, c, [&](bool lm) { return Step3Specs(c, lay, lm); }));
  LoadedWeights& w = mw.weights;
  const bool has_lm_head = mw.has_lm_head;
  auto m = std::unique_ptr<Step3Text>(new Step3Text());
  auto& P = w.params;
  MOELORA_RETURN_IF_ERROR(m->Adopt(ctx, c, w.skipped, P));
  const at::Device dev = m->device();
  m->ends_ = LmEnds::From(P, has_lm_head);
  m->rotaries_.emplace_back(c.rope, dev);
  m->norm_ = NormKind::kPlain;
  const SlotShape shape = SlotShape::For(o, dev, ctx.comm);
  const int64_t H = c.info.hidden_size, d = c.info.head_dim, hq = c.info.num_attention_heads,
                Q = lay.share_q;
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    const std::string a = p + "self_attn.";
    DecoderLayer L;
    L.in_norm = P.at(p + "input_layernorm.weight");
    L.post_norm = P.at(p + "post_attention_layernorm.weight");
    auto linear = [&](const std::string& path, TpMode mode, int64_t in_dim, int64_t out_dim) {
      return LoraLinear::Create(path, P.at(path + ".base_layer.weight"), at::Tensor(), mode, in_dim,
                                {out_dim}, shape, QuantizedParam(P, path + ".base_layer.weight"));
    };
    MOELORA_ASSIGN_OR_RETURN(auto q_down, linear(a + "q_proj", TpMode::kReplicated, H, Q));
    MOELORA_ASSIGN_OR_RETURN(auto wq, linear(a + "wq", TpMode::kColumn, Q, hq * d));
    MOELORA_ASSIGN_OR_RETURN(auto k, linear(a + "k_proj", TpMode::kReplicated, H, d));
    MOELORA_ASSIGN_OR_RETURN(auto v, linear(a + "v_proj", TpMode::kReplicated, H, d));
    MOELORA_ASSIGN_OR_RETURN(auto out, linear(a + "o_proj", TpMode::kRow, hq * d, H));
    AttentionSpec as;
    as.heads = hq / tp;
    as.kv_heads = 1;  // replicated
    as.head_dim = d;
    as.eps = c.rms_norm_eps;  // inter_norm
    L.attn = std::make_unique<Attention>(as, std::move(wq), std::move(k), std::move(v),
                                         std::move(out), at::Tensor(), at::Tensor());
    L.attn->set_query_latent(std::move(q_down), P.at(a + "inter_norm.weight"));
    if (lay.moe[l]) {
      MOELORA_ASSIGN_OR_RETURN(auto shared,
                               MakeSwiGluMlp(P, p + "share_expert.", H, lay.share_inter, shape));
      MOELORA_ASSIGN_OR_RETURN(auto experts,
                               MakeExperts(p + "moe.experts", P, c, o, m->wrapper_, shape));
      L.moe = std::make_unique<MoeBlock>(P.at(p + "moe.gate.weight"), RouterKind::kSoftmaxTopK,
                                         c.num_experts_per_tok, lay.renormalise, std::move(experts),
                                         std::move(shared));
    } else {
      MOELORA_ASSIGN_OR_RETURN(L.mlp, MakeSwiGluMlp(P, p + "mlp.", H, lay.dense_inter, shape));
    }
    m->layers_.push_back(std::move(L));
  }
  for (size_t l = 0; l < m->layers_.size(); ++l) {
    DecoderLayer& L = m->layers_[l];
    for (LoraModule* x : {L.attn->q_down(), L.attn->q(), L.attn->k(), L.attn->v(), L.attn->o()}) {
      m->RegisterLora(x);
    }
    SwiGluMlp* s = L.mlp ? L.mlp.get() : L.moe->shared();
    for (LoraModule* x : {s->gate.get(), s->up.get(), s->down.get()}) m->RegisterLora(x);
    if (L.moe) m->RegisterLora(L.moe->experts());
  }
  return std::unique_ptr<CausalLM>(std::move(m));
}

}  // namespace

[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateStep3Text(const ModelContext& ctx) {
  return Step3Text::Create(ctx);
}

}  // namespace moelora
