// Step3.5 (Step3p5ForCausalLM, Step-3.5-Flash; docs/models.md §6): per layer, from layer_types,
// full or sliding-window GQA with its own query-head count (attention_other_setting), θ and
// partial rotary (llama3 scaling on the yarn_only_types layers), zero-centred q/k norms and a
// head-wise sigmoid gate (g_proj); then a dense SwiGLU MLP (layers outside moe_layers_enum) or
// a MoE block: sigmoid router (f32) whose bias only selects, renormalised top-k weights times
// moe_router_scaling_factor, clamped SwiGLU experts where swiglu_limits is set, and the ungated
// shared expert (clamped by swiglu_limits_shared, as the dense MLPs are). Every norm is
// zero-centred. The hub checkpoint's MTP layers (after num_hidden_layers) are skipped, or with
// ModelOptions::mtp built as chained draft heads.
//
// Module paths are the hub's (`moe.experts`, `share_expert.*`, `mlp.*` for dense layers);
// adapters trained on transformers' Step3p7 classes name the same modules `mlp.experts` and
// `mlp.shared_experts.*`: both are accepted. Only composes layers (worker/layers/).
#include <algorithm>
#include <set>
#include <tuple>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"
#include "nlohmann/json.hpp"
#include "schema/architectures.h"
#include "worker/architectures/decoder.h"
#include "worker/layers/attention.h"
#include "worker/layers/moe.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model/model_context.h"
#include "worker/model/registry.h"

namespace moelora {

namespace {

// What config.json says per layer, beyond ModelConfig: of the decoder's layers, and with
// `with_mtp` of the MTP layers after them too (their entries follow the decoder's in every
// per-layer list).
struct Step35Layout {
  std::vector<int64_t> heads, kv_heads;  // query and KV heads, all ranks
  std::vector<bool> moe;
  std::vector<std::string> types;  // layer_types
  std::vector<RopeSpec> rope;
  std::vector<double> limit, limit_shared;  // 0: no clamp
  int64_t dense_inter = 0, share_inter = 0;
  int top_k = 0;
  double routed_scaling = 1.0;
  bool router_bias = true, head_gate = true;
  int mtp = 0;  // num_nextn_predict_layers: MTP layers after the decoder's
};

// Reads config.json's per-layer keys (the decoder's layers, then the MTP layers' when they are
// built) into a Step35Layout, one part at a time.
struct LayoutReader {
  LayoutReader(const std::string& text, const ModelConfig& c, const std::string& file,
               bool with_mtp)
      : text(text),
        t(nlohmann::json::parse(text, nullptr, false)),
        c(c),
        file(file),
        n(c.info.num_layers) {
    if (t.contains("num_nextn_predict_layers") &&
        t["num_nextn_predict_layers"].is_number_integer()) {
      mtp = t["num_nextn_predict_layers"].get<int>();
    }
    total = with_mtp ? n + std::max(mtp, 0) : n;
  }
  absl::StatusOr<Step35Layout> Read(bool with_mtp) {
    if (with_mtp && mtp <= 0) {
      return ConfigRefused(file, "no num_nextn_predict_layers: the checkpoint has no MTP layers");
    }
    Step35Layout L;
    MOELORA_RETURN_IF_ERROR(CheckFeatures());
    MOELORA_RETURN_IF_ERROR(Attention(L));
    MOELORA_RETURN_IF_ERROR(Mlp(L));
    L.mtp = mtp;
    return L;
  }

  // A per-layer list of numbers (the hub pads it with the MTP layers' entries; null = 0), or one
  // number for every layer.
  absl::Status PerLayer(const char* key, double fallback, std::vector<double>* out) const {
    out->assign(total, fallback);
    if (!t.contains(key) || t[key].is_null()) return absl::OkStatus();
    const nlohmann::json& v = t[key];
    if (v.is_number()) {
      out->assign(total, v.get<double>());
      return absl::OkStatus();
    }
    if (!v.is_array() ||
        (static_cast<int>(v.size()) != n && static_cast<int>(v.size()) != n + mtp)) {
      return ConfigInvalid(file, key, " must be a number or a list of ", n, " (or ", n + mtp,
                           " with the MTP layers) numbers");
    }
    if (static_cast<int>(v.size()) < total) {
      return ConfigInvalid(file, key, " lists ", v.size(), " layers: the MTP layers (", n, " .. ",
                           total - 1, ") need theirs after the decoder's");
    }
    for (int i = 0; i < total; ++i) {
      if (v[i].is_null()) {
        (*out)[i] = 0;
      } else if (v[i].is_number()) {
        (*out)[i] = v[i].get<double>();
      } else {
        return ConfigInvalid(file, key, "[", i, "] is not a number");
      }
    }
    return absl::OkStatus();
  }
  bool Flag(const char* key, bool fallback) const {
    return t.contains(key) && t[key].is_boolean() ? t[key].get<bool>() : fallback;
  }
  // What this server implements of the release's switches.
  absl::Status CheckFeatures() const {
    if (c.hidden_act != "silu")
      return ConfigRefused(file, "hidden_act \"", c.hidden_act, "\" (silu only)");
    if (t.contains("att_impl_type") && t["att_impl_type"] != "GQA") {
      return ConfigRefused(file, "att_impl_type ", t["att_impl_type"].dump(),
                           " is not implemented (GQA only)");
    }
    if (!Flag("use_qk_norm", true))
      return ConfigRefused(file, "use_qk_norm false is not implemented");
    if (t.contains("use_rope_layers") && t["use_rope_layers"].is_array()) {
      for (const auto& v : t["use_rope_layers"]) {
        if (!v.is_boolean() || !v.get<bool>()) {
          return ConfigRefused(
              file,
              "use_rope_layers with a layer without RoPE is not implemented (vLLM honours it, "
              "transformers ignores it)");
        }
      }
    }
    // The defaults of layer_types and moe_layers_enum differ between the hub's code and
    // transformers: both must be given.
    if (c.layer_types.empty()) {
      return ConfigRefused(
          file, "layer_types is required (the hub code and transformers default it differently)");
    }
    return absl::OkStatus();
  }
  // Heads, layer types and RoPE per layer.
  absl::Status Attention(Step35Layout& L) const {
    int64_t sw_heads = c.info.num_attention_heads, sw_kv = c.info.num_key_value_heads;
    if (t.contains("attention_other_setting")) {
      const nlohmann::json& o = t["attention_other_setting"];
      if (!o.is_object()) return ConfigInvalid(file, "attention_other_setting must be an object");
      if (o.contains("attention_type") && o["attention_type"] != "sliding_attention") {
        return ConfigRefused(file, "attention_other_setting.attention_type ",
                             o["attention_type"].dump(),
                             " is not implemented (sliding_attention only)");
      }
      if (o.contains("head_dim") && o["head_dim"] != c.info.head_dim) {
        return ConfigRefused(file, "attention_other_setting.head_dim ", o["head_dim"].dump(),
                             " differs from head_dim ", c.info.head_dim, ": not implemented");
      }
      if (o.contains("num_attention_heads")) {
        if (!o["num_attention_heads"].is_number_integer()) {
          return ConfigInvalid(file,
                               "attention_other_setting.num_attention_heads must be an integer");
        }
        sw_heads = o["num_attention_heads"].get<int64_t>();
      }
      if (o.contains("num_attention_groups")) {
        if (!o["num_attention_groups"].is_number_integer()) {
          return ConfigInvalid(file,
                               "attention_other_setting.num_attention_groups must be an integer");
        }
        sw_kv = o["num_attention_groups"].get<int64_t>();
      }
    }
    // RoPE per layer: θ and the partial factor from the per-layer lists, llama3 (or whatever
    // rope_scaling says) on the layer types in yarn_only_types.
    std::vector<double> theta, partial;
    MOELORA_RETURN_IF_ERROR(PerLayer("rope_theta", 10000.0, &theta));
    MOELORA_RETURN_IF_ERROR(PerLayer("partial_rotary_factors", 1.0, &partial));
    std::set<std::string> scaled_types;
    const bool scaling = t.contains("rope_scaling") && t["rope_scaling"].is_object();
    if (scaling) {
      if (!t.contains("yarn_only_types") || !t["yarn_only_types"].is_array()) {
        return ConfigRefused(
            file,
            "rope_scaling without yarn_only_types: the hub code scales every layer, transformers "
            "only the full-attention ones; say which in yarn_only_types");
      }
      for (const auto& v : t["yarn_only_types"]) {
        if (!v.is_string()) return ConfigInvalid(file, "yarn_only_types must be a list of strings");
        scaled_types.insert(v.get<std::string>());
      }
    }
    L.types = c.layer_types;
    for (int i = n; i < total; ++i) {
      const nlohmann::json& lt = t["layer_types"];
      if (!lt.is_array() || static_cast<int>(lt.size()) <= i || !lt[i].is_string()) {
        return ConfigInvalid(file, "layer_types lists no type for MTP layer ", i,
                             " (the MTP layers' follow the decoder's)");
      }
      L.types.push_back(lt[i].get<std::string>());
    }
    for (int i = 0; i < total; ++i) {
      const bool sliding = L.types[i] == "sliding_attention";
      if (!sliding && L.types[i] != "full_attention") {
        return ConfigRefused(file, "layer_types[", i, "] \"", L.types[i],
                             "\" is not a Step3.5 layer");
      }
      L.heads.push_back(sliding ? sw_heads : c.info.num_attention_heads);
      L.kv_heads.push_back(sliding ? sw_kv : c.info.num_key_value_heads);
      RopeSpec r = scaling && scaled_types.count(L.types[i]) ? c.rope : RopeSpec();
      r.head_dim = c.info.head_dim;
      r.theta = theta[i];
      r.partial_rotary_factor = partial[i];
      if (r.rotary_dim() <= 0 || r.rotary_dim() % 2 != 0 || r.rotary_dim() > r.head_dim) {
        return ConfigInvalid(file, "partial_rotary_factors[", i, "] ", partial[i], " of head_dim ",
                             r.head_dim, " gives ", r.rotary_dim(),
                             " rotary dims (must be even, positive, <= head_dim)");
      }
      L.rope.push_back(r);
    }
    return absl::OkStatus();
  }
  // MLP or MoE per layer, the clamps, the router.
  absl::Status Mlp(Step35Layout& L) const {
    // MLP / MoE per layer: moe_layers_enum decides (as the hub code and vLLM do). The release also
    // carries the older keys use_moe, moe_layer_offset and moe_every_n_layer; they must agree with
    // it: MoE layers only with use_moe, and each one a layer the older rule allows
    // (i >= offset, (i - offset) % every == 0).
    MOELORA_ASSIGN_OR_RETURN(L.moe, MoeLayersEnum(text, total, file, /*required=*/true));
    const int num_moe = static_cast<int>(std::count(L.moe.begin(), L.moe.end(), true));
    if (t.contains("use_moe") && !t["use_moe"].is_boolean())
      return ConfigInvalid(file, "use_moe must be a boolean");
    if (!Flag("use_moe", true) && num_moe > 0) {
      return ConfigRefused(file, "use_moe is false but moe_layers_enum names ", num_moe,
                           " MoE layers");
    }
    int64_t offset = 0, every = 1;
    for (auto [key, out, least] :
         {std::tuple<const char*, int64_t*, int64_t>{"moe_layer_offset", &offset, 0},
          {"moe_every_n_layer", &every, 1}}) {
      if (!t.contains(key)) continue;
      if (!t[key].is_number_integer() || t[key].get<int64_t>() < least) {
        return ConfigInvalid(file, key, " must be an integer >= ", least);
      }
      *out = t[key].get<int64_t>();
    }
    for (int i = 0; i < total; ++i) {
      if (L.moe[i] && (i < offset || (i - offset) % every != 0)) {
        return ConfigRefused(file, "moe_layers_enum makes layer ", i, " MoE, but moe_layer_offset ",
                             offset, " and moe_every_n_layer ", every, " do not");
      }
    }
    // Every norm here is zero-centred and attention has no sinks: the release says so.
    if (!Flag("zero_centered", true)) {
      return ConfigRefused(
          file, "zero_centered false is not implemented (Step3.5's norms are zero-centred)");
    }
    if (Flag("sink", false))
      return ConfigRefused(file, "sink true (attention sinks) is not implemented");
    MOELORA_RETURN_IF_ERROR(PerLayer("swiglu_limits", 0, &L.limit));
    MOELORA_RETURN_IF_ERROR(PerLayer("swiglu_limits_shared", 0, &L.limit_shared));
    auto get_int = [&](const char* key, int64_t* out) {
      if (t.contains(key) && t[key].is_number_integer()) *out = t[key].get<int64_t>();
    };
    get_int("intermediate_size", &L.dense_inter);
    L.share_inter = c.info.shared_expert_intermediate_size;
    L.top_k = c.num_experts_per_tok;  // moe_top_k
    if (t.contains("moe_router_scaling_factor") && t["moe_router_scaling_factor"].is_number()) {
      L.routed_scaling = t["moe_router_scaling_factor"].get<double>();
    }
    const std::string act =
        t.contains("moe_router_activation") && t["moe_router_activation"].is_string()
            ? t["moe_router_activation"].get<std::string>()
            : "sigmoid";
    L.router_bias = Flag("use_moe_router_bias", true);
    if (act != "sigmoid") {
      return ConfigRefused(file, "moe_router_activation \"", act,
                           "\" is not implemented (sigmoid only)");
    }
    if (!Flag("norm_expert_weight", true)) {
      return ConfigRefused(
          file,
          "norm_expert_weight false is not implemented: the hub code and transformers "
          "renormalise the sigmoid router's top-k weights regardless");
    }
    L.head_gate = Flag("use_head_wise_attn_gate", true);
    L.mtp = mtp;
    const bool any_moe = num_moe > 0;
    const bool any_dense = num_moe < total;
    if (any_moe && (c.info.num_experts <= 0 || L.top_k <= 0 || L.top_k > c.info.num_experts ||
                    L.share_inter <= 0 || c.info.moe_intermediate_size <= 0)) {
      return ConfigInvalid(
          file,
          "MoE layers need moe_num_experts, moe_top_k (<= experts), moe_intermediate_size "
          "and share_expert_dim");
    }
    if (any_dense && L.dense_inter <= 0)
      return ConfigInvalid(file, "dense layers need intermediate_size");
    return absl::OkStatus();
  }

  const std::string& text;
  const nlohmann::json t;
  const ModelConfig& c;
  const std::string& file;
  const int n;    // the decoder's layers
  int mtp = 0;    // num_nextn_predict_layers: MTP layers after the decoder's
  int total = 0;  // the layers read
};

[[nodiscard]] absl::StatusOr<Step35Layout> ReadLayout(const std::string& text, const ModelConfig& c,
                                                      const std::string& file, bool with_mtp) {
  return LayoutReader(text, c, file, with_mtp).Read(with_mtp);
}

// Layer l's parameters (decoder or MTP layer: the same block).
void AddLayerSpecs(std::vector<ParamSpec>& s, const ModelConfig& c, const Step35Layout& L, int l) {
  const int64_t H = c.info.hidden_size, E = c.info.num_experts, d = c.info.head_dim;
  const std::string p = absl::StrCat("model.layers.", l, ".");
  const std::string a = p + "self_attn.";
  const int64_t hq = L.heads[l], hkv = L.kv_heads[l];
  s.push_back({p + "input_layernorm.weight", {H}, TpSplit::kReplicated});
  s.push_back({p + "post_attention_layernorm.weight", {H}, TpSplit::kReplicated});
  s.push_back({a + "q_proj.base_layer.weight", {hq * d, H}, TpSplit::kRows});
  s.push_back({a + "k_proj.base_layer.weight", {hkv * d, H}, TpSplit::kRows});
  s.push_back({a + "v_proj.base_layer.weight", {hkv * d, H}, TpSplit::kRows});
  s.push_back({a + "o_proj.base_layer.weight", {H, hq * d}, TpSplit::kCols});
  s.push_back({a + "q_norm.weight", {d}, TpSplit::kReplicated});
  s.push_back({a + "k_norm.weight", {d}, TpSplit::kReplicated});
  if (L.head_gate) s.push_back({a + "g_proj.base_layer.weight", {hq, H}, TpSplit::kRows});
  if (L.moe[l]) {
    s.push_back({p + "moe.gate.weight", {E, H}, TpSplit::kReplicated});
    if (L.router_bias) s.push_back({p + "moe.router_bias", {E}, TpSplit::kReplicated});
    AddExpertSpecs(s, p + "moe.experts", c, /*lora_wrapped=*/true);
    AddSwiGluSpecs(s, p + "share_expert.", H, L.share_inter);
  } else {
    AddSwiGluSpecs(s, p + "mlp.", H, L.dense_inter);
  }
}

// The model's parameters; with the MTP layers, each one's fusion (enorm, hnorm, eh_proj) and
// its own output end (shared_head.norm, shared_head.output) beside its block.
std::vector<ParamSpec> Step35Specs(const ModelConfig& c, const Step35Layout& L, bool with_lm_head,
                                   bool with_mtp) {
  const int64_t H = c.info.hidden_size, V = c.vocab_size;
  std::vector<ParamSpec> s = {{"model.embed_tokens.weight", {V, H}, TpSplit::kReplicated},
                              {"model.norm.weight", {H}, TpSplit::kReplicated}};
  if (with_lm_head) s.push_back({"lm_head.weight", {V, H}, TpSplit::kReplicated});
  const int n = c.info.num_layers;
  for (int l = 0; l < n + (with_mtp ? L.mtp : 0); ++l) {
    AddLayerSpecs(s, c, L, l);
    if (l < n) continue;
    const std::string p = absl::StrCat("model.layers.", l, ".");
    s.push_back({p + "enorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "hnorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "eh_proj.weight", {H, 2 * H}, TpSplit::kReplicated});
    s.push_back({p + "shared_head.norm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "shared_head.output.weight", {V, H}, TpSplit::kReplicated});
  }
  return s;
}

class Step3p5 final : public DecoderModel {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<CausalLM>> Create(const ModelContext& ctx);

 private:
  void RegisterStep35Lora(int l, DecoderLayer& L);
};

bool SameRope(const RopeSpec& a, const RopeSpec& b) {
  return a.type == b.type && a.theta == b.theta &&
         a.partial_rotary_factor == b.partial_rotary_factor;
}

// The layout against the tensor-parallel size: heads, KV heads and MLP dims divide by it.
absl::Status CheckParallel(const Step35Layout& lay, const std::string& cfg, int tp, int total) {
  for (int l = 0; l < total; ++l) {
    if (lay.heads[l] % tp != 0 || lay.kv_heads[l] % tp != 0 || lay.heads[l] % lay.kv_heads[l]) {
      return ConfigInvalid(cfg, "layer ", l, ": ", lay.heads[l], " query heads and ",
                           lay.kv_heads[l], " KV heads must divide by --tensor-parallel-size ", tp,
                           " (and the query heads by the KV heads)");
    }
  }
  if ((lay.share_inter > 0 && lay.share_inter % tp != 0) ||
      (lay.dense_inter > 0 && lay.dense_inter % tp != 0)) {
    return ConfigInvalid(cfg, "share_expert_dim ", lay.share_inter, " and intermediate_size ",
                         lay.dense_inter, " must divide by --tensor-parallel-size ", tp);
  }
  return absl::OkStatus();
}

// Builds layer l's block (a decoder or an MTP layer: the same block) from the loaded parameters;
// its RoPE index is the caller's.
class Step35Builder : public LayerBuilder {
 public:
  Step35Builder(const ModelConfig& c, const ModelOptions& o, const Step35Layout& lay,
                std::map<std::string, at::Tensor>& P, const SlotShape& shape, AdapterFormat wrapper)
      : LayerBuilder(c, o, P, shape, wrapper), lay_(lay) {}

  absl::StatusOr<DecoderLayer> Layer(int l) const {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    DecoderLayer L;
    L.in_norm = P_.at(p + "input_layernorm.weight");
    L.post_norm = P_.at(p + "post_attention_layernorm.weight");
    MOELORA_RETURN_IF_ERROR(Attention(l, p, L));
    MOELORA_RETURN_IF_ERROR(Ffn(l, p, L));
    return L;
  }

 private:
  // Attention with this layer's heads (full or sliding), zero-centred q/k norms and, with
  // use_head_wise_attn_gate, a gate per head.
  absl::Status Attention(int l, const std::string& p, DecoderLayer& L) const {
    const std::string a = p + "self_attn.";
    const int tp = o_.tp_size;
    const int64_t H = c_.info.hidden_size, d = c_.info.head_dim, hq = lay_.heads[l],
                  hkv = lay_.kv_heads[l];
    MOELORA_ASSIGN_OR_RETURN(auto q, Linear(a + "q_proj", TpMode::kColumn, H, {hq * d}));
    MOELORA_ASSIGN_OR_RETURN(auto k, Linear(a + "k_proj", TpMode::kColumn, H, {hkv * d}));
    MOELORA_ASSIGN_OR_RETURN(auto v, Linear(a + "v_proj", TpMode::kColumn, H, {hkv * d}));
    MOELORA_ASSIGN_OR_RETURN(auto out, Linear(a + "o_proj", TpMode::kRow, hq * d, {H}));
    AttentionSpec as;
    as.heads = hq / tp;
    as.kv_heads = hkv / tp;
    as.head_dim = d;
    as.eps = c_.rms_norm_eps;
    as.qk_norm_kind = NormKind::kZeroCentred;
    as.sliding_window = lay_.types[l] == "sliding_attention" ? c_.sliding_window : 0;
    L.attn = std::make_unique<moelora::Attention>(as, std::move(q), std::move(k), std::move(v),
                                                  std::move(out), P_.at(a + "q_norm.weight"),
                                                  P_.at(a + "k_norm.weight"));
    if (lay_.head_gate) {
      MOELORA_ASSIGN_OR_RETURN(auto g, Linear(a + "g_proj", TpMode::kColumn, H, {hq}));
      L.attn->set_head_gate(std::move(g));
    }
    return absl::OkStatus();
  }
  // The MoE block (sigmoid router with bias, shared expert, clamped SwiGLU) or the dense MLP.
  absl::Status Ffn(int l, const std::string& p, DecoderLayer& L) const {
    const int64_t H = c_.info.hidden_size;
    if (!lay_.moe[l]) {
      MOELORA_ASSIGN_OR_RETURN(
          L.mlp, MakeSwiGluMlp(P_, p + "mlp.", H, lay_.dense_inter, shape_, lay_.limit_shared[l]));
      return absl::OkStatus();
    }
    MOELORA_ASSIGN_OR_RETURN(
        auto shared,
        MakeSwiGluMlp(P_, p + "share_expert.", H, lay_.share_inter, shape_, lay_.limit_shared[l]));
    MOELORA_ASSIGN_OR_RETURN(auto experts,
                             MakeExperts(p + "moe.experts", P_, c_, o_, wrapper_, shape_));
    if (lay_.limit[l] > 0) {
      ExpertActivation act;
      act.kind = ExpertActivation::Kind::kSwiGluStep;
      act.limit = lay_.limit[l];
      experts->set_activation(act);
    }
    L.moe = std::make_unique<MoeBlock>(
        P_.at(p + "moe.gate.weight"), RouterKind::kSigmoidBiasTopK, lay_.top_k,
        /*norm_topk_prob=*/true, std::move(experts), std::move(shared),
        lay_.router_bias ? P_.at(p + "moe.router_bias") : at::Tensor(), lay_.routed_scaling);
    return absl::OkStatus();
  }

  const Step35Layout& lay_;
};

absl::StatusOr<std::unique_ptr<CausalLM>> Step3p5::Create(const ModelContext& ctx) {
  const ModelConfig& c = ctx.config;
  const ModelOptions& o = ctx.options;
  const std::string cfg = ctx.dir + "/config.json";
  MOELORA_ASSIGN_OR_RETURN(std::string text, ReadConfigText(ctx.dir));
  MOELORA_ASSIGN_OR_RETURN(Step35Layout lay, ReadLayout(text, c, cfg, o.mtp));
  const int n = c.info.num_layers;
  const int total = n + (o.mtp ? lay.mtp : 0);  // with the MTP layers when they are built
  if (o.mtp && lay.mtp > kMaxMtpHeads) {
    return ConfigRefused(cfg, "num_nextn_predict_layers ", lay.mtp, " (at most ", kMaxMtpHeads,
                         " MTP layers are served)");
  }
  MOELORA_RETURN_IF_ERROR(CheckParallel(lay, cfg, o.tp_size, total));
  // With the MTP layers, the checkpoint's names after num_hidden_layers are read too (the main
  // table skips them).
  ModelContext load_ctx = ctx;
  ArchTable with_mtp;
  if (o.mtp) {
    with_mtp = *ctx.arch;
    with_mtp.facts = FindArchFacts("Step3p5MTP");
    with_mtp.map = with_mtp.facts->map;
    load_ctx.arch = &with_mtp;
  }
  MOELORA_ASSIGN_OR_RETURN(ModelWeights mw, LoadModelWeights(load_ctx, c, [&](bool lm) {
                             return Step35Specs(c, lay, lm, o.mtp);
                           }));
  LoadedWeights& w = mw.weights;
  auto m = std::unique_ptr<Step3p5>(new Step3p5());
  auto& P = w.params;
  MOELORA_RETURN_IF_ERROR(m->Adopt(ctx, c, w.skipped, P));
  const at::Device dev = m->device();
  m->ends_ = LmEnds::From(P, mw.has_lm_head);
  m->norm_ = NormKind::kZeroCentred;
  const Step35Builder build(c, o, lay, P, SlotShape::For(o, dev, ctx.comm), m->wrapper_);
  std::vector<RopeSpec> distinct;
  // Layer l's block, its RoPE one of the model's distinct ones.
  auto layer = [&](int l) -> absl::StatusOr<DecoderLayer> {
    MOELORA_ASSIGN_OR_RETURN(DecoderLayer L, build.Layer(l));
    size_t r = 0;
    while (r < distinct.size() && !SameRope(distinct[r], lay.rope[l])) ++r;
    if (r == distinct.size()) {
      distinct.push_back(lay.rope[l]);
      m->rotaries_.emplace_back(lay.rope[l], dev);
    }
    L.rope = r;
    return L;
  };
  for (int l = 0; l < n; ++l) {
    MOELORA_ASSIGN_OR_RETURN(DecoderLayer L, layer(l));
    m->layers_.push_back(std::move(L));
  }
  // The MTP layers: head j (layer n + j) drafts token j + 1 of a step, chained (vLLM's
  // step3p5_mtp: embedding and the previous head's output before its norm, each head with its
  // own KV layer n + j and vocabulary head).
  for (int l = n; l < total; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    auto head = std::make_unique<MtpHead>();
    head->fc = P.at(p + "eh_proj.weight");
    head->norm_embed = P.at(p + "enorm.weight");
    head->norm_hidden = P.at(p + "hnorm.weight");
    head->norm = P.at(p + "shared_head.norm.weight");
    head->lm_head = P.at(p + "shared_head.output.weight");
    MOELORA_ASSIGN_OR_RETURN(head->layer, layer(l));
    head->kv_layer = l;
    m->mtp_.push_back(std::move(head));
  }
  m->mtp_chained_ = !m->mtp_.empty();
  m->num_layers_ = total;
  for (int l = 0; l < n; ++l) m->RegisterStep35Lora(l, m->layers_[l]);
  for (int l = n; l < total; ++l) m->RegisterStep35Lora(l, m->mtp_[l - n]->layer);
  return std::unique_ptr<CausalLM>(std::move(m));
}

// Layer l's LoRA modules: as RegisterLayerLora, with the names transformers' Step3p7 and vLLM
// give the shared expert and the experts as aliases.
void Step3p5::RegisterStep35Lora(int l, DecoderLayer& L) {
  if (L.mlp) return RegisterLayerLora(L);
  const std::string p = absl::StrCat("model.layers.", l, ".");
  for (LoraModule* x : {L.attn->q(), L.attn->k(), L.attn->v(), L.attn->o(), L.attn->g()}) {
    if (x != nullptr) RegisterLora(x);
  }
  SwiGluMlp* s = L.moe->shared();
  for (auto [x, name] : {std::pair<LoraModule*, const char*>{s->gate.get(), "gate_proj"},
                         {s->up.get(), "up_proj"},
                         {s->down.get(), "down_proj"}}) {
    RegisterLora(x, {absl::StrCat(p, "mlp.shared_experts.", name),
                     absl::StrCat(p, "moe.share_expert.", name)});
  }
  RegisterLora(L.moe->experts(), {p + "mlp.experts"});
}

}  // namespace

[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateStep3p5(const ModelContext& ctx) {
  return Step3p5::Create(ctx);
}

}  // namespace moelora
