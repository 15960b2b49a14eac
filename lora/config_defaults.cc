#include "lora/config_defaults.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moelora {

namespace {

// The defaults below are the class defaults of transformers 5.24.0 (tests/integration/
// config_defaults_test.py compares them with the installed classes), of the hub's
// configuration_step3p5.py (Step-3.5-Flash) and of vLLM's Step3TextConfig (Step3 has no
// transformers class), written down where no package ships them. Keys a class derives rather than
// defaults (head_dim from hidden_size / heads, layer_types from the interval) are left to the
// parsers, which derive them the same way.
const char kQwen3Moe[] = R"({
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
  "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
  "tie_word_embeddings": false, "rope_theta": 10000.0, "attention_bias": false,
  "use_sliding_window": false, "sliding_window": null, "decoder_sparse_step": 1,
  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
  "norm_topk_prob": false, "mlp_only_layers": []
})";

// Qwen3VLMoeTextConfig; the wrapper's own tie_word_embeddings (false) decides for the LM head.
// The VL router always renormalises its top-k (the class has no norm_topk_prob).
const char kQwen3VlMoe[] = R"({
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
  "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
  "hidden_act": "silu", "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
  "rope_theta": 500000.0, "attention_bias": false, "decoder_sparse_step": 1,
  "moe_intermediate_size": 1408, "num_experts_per_tok": 4, "num_experts": 60,
  "mlp_only_layers": [],
  "@top": {"tie_word_embeddings": false}
})";

// Qwen3_5MoeTextConfig (partial_rotary_factor: `kwargs.setdefault(..., 0.25)`; layer_types from
// full_attention_interval, popped with a default of 4); the router always renormalises.
const char kQwen35Moe[] = R"({
  "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
  "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu",
  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
  "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "attention_bias": false,
  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
  "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
  "@top": {"tie_word_embeddings": false}
})";

// GptOssConfig: YaRN by default (rope_parameters None -> the dict below, theta default_theta).
const char kGptOss[] = R"({
  "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
  "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
  "num_key_value_heads": 8, "sliding_window": 128, "tie_word_embeddings": false,
  "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
  "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": true,
  "rope_theta": 150000.0,
  "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                   "truncate": false, "original_max_position_embeddings": 4096}
})";

// The hub's configuration_step3p5.py (Step-3.5-Flash; share_expert_dims is its keyword for
// share_expert_dim). The keys its modeling code reads without a class default are required below.
const char kStep3p5[] = R"({
  "hidden_size": 4096, "intermediate_size": 11264, "num_attention_heads": 64,
  "num_attention_groups": 8, "num_hidden_layers": 45, "max_seq_len": 128000,
  "vocab_size": 128815, "rms_norm_eps": 1e-5, "moe_intermediate_size": 1280,
  "moe_num_experts": 288, "moe_top_k": 8, "rope_theta": 10000.0,
  "max_position_embeddings": 128000, "share_expert_dim": 1280, "head_dim": 128,
  "norm_expert_weight": true, "sliding_window": null
})";

// vLLM's Step3TextConfig (vllm/transformers_utils/configs/step3_vl.py).
const char kStep3Text[] = R"({
  "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
  "num_attention_groups": 1, "num_hidden_layers": 61, "max_seq_len": 65536,
  "vocab_size": 128815, "rms_norm_eps": 1e-5, "moe_intermediate_size": 5120,
  "moe_num_experts": 48, "moe_top_k": 3, "rope_theta": 500000.0,
  "max_position_embedding": 65536, "share_expert_dim": 5120, "share_q_dim": 2048,
  "head_dim": 256, "norm_expert_weight": false,
  "moe_layers_enum": [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
                      24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42,
                      43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
})";

}  // namespace

const std::vector<ArchConfigDefaults>& AllConfigDefaults() {
  static const std::vector<ArchConfigDefaults> tables = {
      {"Qwen3MoeForCausalLM", "transformers 5.24.0 Qwen3MoeConfig", kQwen3Moe, {}},
      {"Qwen3VLMoeForConditionalGeneration",
       "transformers 5.24.0 Qwen3VLMoeTextConfig (text_config) and Qwen3VLMoeConfig",
       kQwen3VlMoe,
       {}},
      {"Qwen3_5MoeForConditionalGeneration",
       "transformers 5.24.0 Qwen3_5MoeTextConfig (text_config) and Qwen3_5MoeConfig",
       kQwen35Moe,
       {}},
      {"Qwen3_5MoeForCausalLM", "transformers 5.24.0 Qwen3_5MoeTextConfig", kQwen35Moe, {}},
      {"GptOssForCausalLM", "transformers 5.24.0 GptOssConfig", kGptOss, {}},
      {"Step3p5ForCausalLM",
       "the hub's configuration_step3p5.py (stepfun-ai/Step-3.5-Flash)",
       kStep3p5,
       {{"layer_types",
         "the hub class defaults it to None and transformers' Step3p7 to all full attention"},
        {"moe_layers_enum",
         "the hub class defaults it to layers 3..44 of the 45-layer release, transformers' Step3p7 "
         "to a different split"},
        {"moe_router_activation",
         "the hub class has no default and vLLM's Step3p5Config defaults it to softmax, while the "
         "release uses sigmoid"},
        {"use_head_wise_attn_gate",
         "the hub class has no default and vLLM's Step3p5Config defaults it to false, while the "
         "release uses the gate"}}},
      {"Step3TextForCausalLM",
       "vLLM's Step3TextConfig (transformers has no Step3 class)",
       kStep3Text,
       {}},
  };
  return tables;
}

const ArchConfigDefaults* FindConfigDefaults(const std::string& architecture) {
  for (const ArchConfigDefaults& t : AllConfigDefaults()) {
    if (t.architecture == architecture) return &t;
  }
  return nullptr;
}

[[nodiscard]] absl::StatusOr<std::string> ApplyConfigDefaults(const std::string& text,
                                                              const std::string& file) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(file, ": not valid JSON"));
  if (!j.is_object() || !j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string()) {
    return text;
  }
  const ArchConfigDefaults* table = FindConfigDefaults(j["architectures"][0].get<std::string>());
  if (table == nullptr) return text;
  const nlohmann::json d = nlohmann::json::parse(table->defaults_json);
  const bool wrapped = j.contains("text_config") && j["text_config"].is_object();
  nlohmann::json& t = wrapped ? j["text_config"] : j;
  auto set_rope = [](const nlohmann::json& o) {
    for (const char* k : {"rope_parameters", "rope_scaling"}) {
      if (o.contains(k) && !o[k].is_null()) return true;
    }
    return false;
  };
  for (const auto& [key, value] : d.items()) {
    if (key == "@top") {
      for (const auto& [k, v] : value.items()) {
        if (!j.contains(k)) j[k] = v;
      }
      continue;
    }
    // A default rope dict only where the config has none of its own (transformers maps
    // rope_scaling onto rope_parameters; either one replaces the class default).
    if (key == "rope_scaling") {
      if (!set_rope(t)) t[key] = value;
      continue;
    }
    // transformers' attribute_map aliases: either spelling sets the value.
    if (key == "num_experts" || key == "num_local_experts") {
      if (!t.contains("num_experts") && !t.contains("num_local_experts")) t[key] = value;
      continue;
    }
    if (!t.contains(key)) t[key] = value;
  }
  return j.dump();
}

[[nodiscard]] absl::Status CheckRequiredConfigKeys(const std::string& text,
                                                   const std::string& file) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string()) {
    return absl::OkStatus();
  }
  const ArchConfigDefaults* table = FindConfigDefaults(j["architectures"][0].get<std::string>());
  if (table == nullptr) return absl::OkStatus();
  const nlohmann::json& t =
      j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
  for (const ArchConfigDefaults::Required& r : table->required) {
    if (!t.contains(r.key) || t[r.key].is_null()) {
      return absl::FailedPreconditionError(absl::StrCat(file, ": ", r.key, " is required for ",
                                                        table->architecture, " (", r.reason, ")"));
    }
  }
  return absl::OkStatus();
}

std::string ConfigDefaultsJson() {
  nlohmann::json out = nlohmann::json::object();
  for (const ArchConfigDefaults& t : AllConfigDefaults()) {
    nlohmann::json req = nlohmann::json::object();
    for (const auto& r : t.required) req[r.key] = r.reason;
    out[t.architecture] = {{"source", t.source},
                           {"defaults", nlohmann::json::parse(t.defaults_json)},
                           {"required", req}};
  }
  return out.dump(2);
}

}  // namespace moelora
