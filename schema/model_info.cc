#include "schema/model_info.h"

#include <cstdint>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "schema/architectures.h"
#include "schema/config_defaults.h"

namespace moelora {

bool ModelInfo::DenseDims(const std::string& module, int* out, int* in) const {
  auto ends = [&](const std::string& suffix) {
    return module == suffix ||
           (module.size() > suffix.size() && module.compare(module.size() - suffix.size() - 1,
                                                            std::string::npos, "." + suffix) == 0);
  };
  auto set = [&](int o, int i) {
    *out = o;
    *in = i;
    return o > 0 && i > 0;
  };
  const int q = num_attention_heads * head_dim;
  const int kv = num_key_value_heads * head_dim;
  if (hidden_size <= 0) return false;
  // The shared expert's projections share their last name with the routed experts' (which the
  // expert validation checks): only the full path tells them apart.
  if (ends("shared_expert.gate_proj") || ends("shared_expert.up_proj") ||
      ends("share_expert.gate_proj") || ends("share_expert.up_proj") ||
      ends("shared_experts.gate_proj") || ends("shared_experts.up_proj")) {
    return set(shared_expert_intermediate_size, hidden_size);
  }
  if (ends("shared_expert.down_proj") || ends("share_expert.down_proj") ||
      ends("shared_experts.down_proj")) {
    return set(hidden_size, shared_expert_intermediate_size);
  }
  const int key_dim = linear_num_key_heads * linear_key_head_dim;
  const int value_dim = linear_num_value_heads * linear_value_head_dim;
  if (ends("in_proj_qkv")) return set(2 * key_dim + value_dim, hidden_size);
  if (ends("in_proj_z")) return set(value_dim, hidden_size);
  if (ends("in_proj_b") || ends("in_proj_a")) return set(linear_num_value_heads, hidden_size);
  if (ends("out_proj")) return set(hidden_size, value_dim);
  if (q <= 0) return false;
  // The model checks the attention projections per layer when heads differ between layers.
  if (per_layer_heads) return false;
  if (share_q_dim > 0 && ends("q_proj")) return set(share_q_dim, hidden_size);
  if (share_q_dim > 0 && ends("wq")) return set(q, share_q_dim);
  if (ends("q_proj")) return set(attn_output_gate ? 2 * q : q, hidden_size);
  if (ends("k_proj") || ends("v_proj")) return set(kv, hidden_size);
  if (ends("o_proj")) return set(hidden_size, q);
  return false;
}

[[nodiscard]] absl::StatusOr<ModelInfo> ParseModelInfo(const std::string& text,
                                                       const std::string& file) {
  auto bad = [&file](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", parts...));
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    return bad("not valid JSON: ", e.what());
  }
  if (!j.is_object()) return bad("not a JSON object");
  // Absent keys mean the architecture's class defaults (schema/config_defaults.h).
  MOELORA_ASSIGN_OR_RETURN(const std::string with_defaults, ApplyConfigDefaults(text, file));
  j = nlohmann::json::parse(with_defaults);
  ModelInfo info;
  if (!j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string()) {
    return bad("no architectures[0] (cannot tell which model this is)");
  }
  info.architecture = j["architectures"][0].get<std::string>();
  // What differs between architectures comes from their entry (schema/architectures.h); an unknown
  // architecture reads every spelling, so that the caller can name it as unsupported.
  static const ArchFacts kAnyArchitecture = [] {
    ArchFacts a;
    a.kv_heads_keys = {"num_key_value_heads", "num_attention_groups"};
    a.experts_keys = {"num_experts", "num_local_experts", "moe_num_experts"};
    a.shared_expert_keys = {"shared_expert_intermediate_size", "share_expert_dim"};
    return a;
  }();
  const ArchFacts* known = FindArchFacts(info.architecture);
  const ArchFacts& facts = known ? *known : kAnyArchitecture;
  info.interleaved_gate_up = facts.interleaved_gate_up;
  const nlohmann::json& t =
      j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
  auto get_int = [&](const std::vector<std::string>& keys, int* out) {
    for (const std::string& k : keys) {
      if (t.contains(k) && t[k].is_number_integer()) {
        *out = t[k].get<int>();
        return true;
      }
    }
    return false;
  };
  if (!get_int({"hidden_size"}, &info.hidden_size)) return bad("no hidden_size");
  get_int({"num_hidden_layers"}, &info.num_layers);
  get_int({"num_attention_heads"}, &info.num_attention_heads);
  if (!get_int(facts.kv_heads_keys, &info.num_key_value_heads)) {
    info.num_key_value_heads = info.num_attention_heads;
  }
  if (!get_int({"head_dim"}, &info.head_dim) && info.num_attention_heads > 0) {
    info.head_dim = info.hidden_size / info.num_attention_heads;
  }
  get_int(facts.experts_keys, &info.num_experts);
  get_int(facts.expert_inter_keys, &info.moe_intermediate_size);
  // transformers always gates Qwen3.5's attention output; vLLM reads attn_output_gate.
  info.attn_output_gate = facts.attn_output_gate &&
                          !(t.contains("attn_output_gate") && t["attn_output_gate"].is_boolean() &&
                            !t["attn_output_gate"].get<bool>());
  get_int({"linear_num_key_heads"}, &info.linear_num_key_heads);
  get_int({"linear_num_value_heads"}, &info.linear_num_value_heads);
  get_int({"linear_key_head_dim"}, &info.linear_key_head_dim);
  get_int({"linear_value_head_dim"}, &info.linear_value_head_dim);
  get_int(facts.shared_expert_keys, &info.shared_expert_intermediate_size);
  // Step3.5's sliding layers have their own head count (attention_other_setting).
  info.per_layer_heads = t.contains("attention_other_setting");
  get_int({"share_q_dim"}, &info.share_q_dim);
  get_int({"mtp_num_hidden_layers"}, &info.mtp_num_hidden_layers);
  if (facts.mtp_layers_follow)
    get_int({"num_nextn_predict_layers"}, &info.num_nextn_predict_layers);
  return info;
}

[[nodiscard]] absl::StatusOr<std::string> ConfigFingerprint(const std::string& model_dir) {
  const std::string file = model_dir + "/config.json";
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(file, ": cannot read"));
  // FNV-1a over the bytes: a mismatch check between processes, not a security boundary, so no
  // crypto library for it.
  uint64_t h = 14695981039346656037ull;
  for (char c; in.get(c);) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ull;
  }
  char hex[17];
  std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
  return absl::StrCat("fnv1a64:", hex);
}

[[nodiscard]] absl::StatusOr<ModelInfo> ReadModelInfo(const std::string& model_dir) {
  const std::string file = model_dir + "/config.json";
  std::ifstream in(file);
  if (!in)
    return absl::NotFoundError(absl::StrCat(file, ": cannot read (is --model a model directory?)"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelInfo(ss.str(), file);
}

}  // namespace moelora
