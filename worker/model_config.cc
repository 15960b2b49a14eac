#include "worker/model_config.h"

#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

namespace moelora {

absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& text, const std::string& file) {
  ModelConfig c;
  MOELORA_ASSIGN_OR_RETURN(c.info, ParseModelInfo(text, file));
  // ParseModelInfo already proved this is a JSON object.
  const nlohmann::json j = nlohmann::json::parse(text);
  const nlohmann::json& t =
      j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
  auto bad = [&file](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", parts...));
  };
  auto num = [&](const char* key, double* out) {
    if (t.contains(key) && t[key].is_number()) {
      *out = t[key].get<double>();
      return true;
    }
    return false;
  };
  auto integer = [&](const char* key, int* out) {
    if (t.contains(key) && t[key].is_number_integer()) {
      *out = t[key].get<int>();
      return true;
    }
    return false;
  };
  if (!integer("vocab_size", &c.vocab_size) || c.vocab_size <= 0) return bad("no vocab_size");
  integer("num_experts_per_tok", &c.num_experts_per_tok);
  integer("max_position_embeddings", &c.max_position_embeddings);
  if (t.contains("norm_topk_prob") && t["norm_topk_prob"].is_boolean()) {
    c.norm_topk_prob = t["norm_topk_prob"].get<bool>();
  }
  num("rms_norm_eps", &c.rms_norm_eps);
  if (!num("rope_theta", &c.rope_theta) && t.contains("rope_parameters") &&
      t["rope_parameters"].is_object()) {
    const auto& rp = t["rope_parameters"];
    if (rp.contains("rope_theta") && rp["rope_theta"].is_number()) {
      c.rope_theta = rp["rope_theta"].get<double>();
    }
    if (rp.contains("rope_type") && rp["rope_type"].is_string() &&
        rp["rope_type"].get<std::string>() != "default") {
      return bad("rope_parameters.rope_type \"", rp["rope_type"].get<std::string>(),
                 "\" is not supported (only \"default\")");
    }
  }
  // The top-level flag wins for wrapper classes (the VL config sets it there).
  const nlohmann::json& tie_src = j.contains("tie_word_embeddings") ? j : t;
  if (tie_src.contains("tie_word_embeddings") && tie_src["tie_word_embeddings"].is_boolean()) {
    c.tie_word_embeddings = tie_src["tie_word_embeddings"].get<bool>();
  }
  if (t.contains("mlp_only_layers") && t["mlp_only_layers"].is_array() &&
      !t["mlp_only_layers"].empty()) {
    c.all_layers_moe = false;
  }
  int sparse_step = 1;
  if (integer("decoder_sparse_step", &sparse_step) && sparse_step != 1) c.all_layers_moe = false;
  if (t.contains("layer_types") && t["layer_types"].is_array()) {
    for (const auto& lt : t["layer_types"]) {
      if (lt.is_string() && lt.get<std::string>() != "full_attention") c.mixed_layer_types = true;
    }
  }
  return c;
}

absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& model_dir) {
  std::error_code ec;
  if (!std::filesystem::is_directory(model_dir, ec)) {
    return absl::NotFoundError(absl::StrCat(model_dir, ": model directory does not exist"));
  }
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  if (!in)
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot open (is --model an HF model directory?)"));
  std::stringstream ss;
  ss << in.rdbuf();
  return ParseModelConfig(ss.str(), path);
}

}  // namespace moelora
