#include "schema/model_config.h"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"
#include "schema/architectures.h"
#include "schema/config_defaults.h"

namespace moelora {

namespace {

// rope_parameters (transformers 5) or rope_scaling (4.x, "type" or "rope_type"), with rope_theta
// and partial_rotary_factor at the top level or inside; the keys each type reads, as
// transformers' modeling_rope_utils reads them. Types whose frequencies depend on the sequence
// length (dynamic) or that need per-position tables (longrope) are refused by name.
[[nodiscard]] absl::StatusOr<RopeSpec> ParseRope(const nlohmann::json& t, const ModelConfig& c,
                                                 const std::string& file) {
  RopeSpec r;
  r.head_dim = c.info.head_dim;
  auto refuse = [&](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat(file, ": ", parts...));
  };
  nlohmann::json rp = nlohmann::json::object();
  const char* where = "rope_parameters";
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (t.contains(key) && t[key].is_object()) {
      rp = t[key];
      where = key;
      break;
    }
    if (t.contains(key) && !t[key].is_null()) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": ", key, " must be an object"));
    }
  }
  if (rp.contains("rope_type") && rp["rope_type"].is_string()) {
    r.type = rp["rope_type"].get<std::string>();
  } else if (rp.contains("type") && rp["type"].is_string()) {
    r.type = rp["type"].get<std::string>();
  }
  auto number = [&](const nlohmann::json& o, const char* key, double* out) {
    if (o.contains(key) && o[key].is_number()) {
      *out = o[key].get<double>();
      return true;
    }
    return false;
  };
  if (!number(rp, "rope_theta", &r.theta)) number(t, "rope_theta", &r.theta);
  r.partial_rotary_given = number(rp, "partial_rotary_factor", &r.partial_rotary_factor) ||
                           number(t, "partial_rotary_factor", &r.partial_rotary_factor);
  if (r.theta <= 0) return absl::InvalidArgumentError(absl::StrCat(file, ": rope_theta <= 0"));
  if (r.partial_rotary_factor <= 0 || r.partial_rotary_factor > 1 || r.rotary_dim() % 2 != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(file, ": partial_rotary_factor ", r.partial_rotary_factor, " of head_dim ",
                     r.head_dim, " must give an even number of rotary dims in (0, head_dim]"));
  }
  // Multimodal RoPE (Qwen3-VL, Qwen3.5): which of the (temporal, height, width) position streams
  // each frequency takes (schema/rope.h).
  if (rp.contains("mrope_section") && !rp["mrope_section"].is_null()) {
    const auto& ms = rp["mrope_section"];
    if (ms.is_array() && ms.size() == 3) {
      for (const auto& v : ms) {
        if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() > (1 << 20)) break;
        r.mrope_section.push_back(v.get<int>());
      }
    }
    if (r.mrope_section.size() != 3) {
      return absl::InvalidArgumentError(absl::StrCat(file, ": ", where, ".mrope_section ",
                                                     ms.dump(), ": three non-negative integers"));
    }
  }
  // Keys each type may carry; anything else in the dict changes the math in a way we do not.
  std::vector<std::string> allowed = {"rope_type", "type", "rope_theta", "partial_rotary_factor",
                                      // Qwen3-VL / Qwen3.5 multimodal RoPE: with text-only
                                      // positions (all three rows equal) it is 1-D RoPE.
                                      "mrope_section", "mrope_interleaved"};
  const int max_pos = c.max_position_embeddings;
  auto original_max = [&]() -> absl::Status {
    double v = 0;
    if (number(t, "original_max_position_embeddings", &v) ||
        number(rp, "original_max_position_embeddings", &v)) {
      r.original_max_position_embeddings = static_cast<int>(v);
    } else {
      r.original_max_position_embeddings = max_pos;
    }
    if (r.original_max_position_embeddings <= 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": ", where,
                       ".original_max_position_embeddings (or max_position_embeddings) "
                       "is needed for rope_type ",
                       r.type));
    }
    return absl::OkStatus();
  };
  auto need_factor = [&]() -> absl::Status {
    if (!number(rp, "factor", &r.factor) || r.factor <= 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          file, ": ", where, ".factor must be a positive number for rope_type ", r.type));
    }
    return absl::OkStatus();
  };
  if (r.type == "default") {
  } else if (r.type == "linear") {
    MOELORA_RETURN_IF_ERROR(need_factor());
    allowed.push_back("factor");
  } else if (r.type == "yarn") {
    double v = 0;
    if (!number(rp, "factor", &r.factor)) {
      // transformers: factor = max_position_embeddings / original_max_position_embeddings.
      MOELORA_RETURN_IF_ERROR(original_max());
      r.factor = static_cast<double>(max_pos) / r.original_max_position_embeddings;
    }
    if (r.factor <= 0) return absl::InvalidArgumentError(absl::StrCat(file, ": yarn factor <= 0"));
    MOELORA_RETURN_IF_ERROR(original_max());
    if (number(rp, "attention_factor", &v)) r.attention_factor = v;
    if (number(rp, "mscale", &v)) r.mscale = v;
    if (number(rp, "mscale_all_dim", &v)) r.mscale_all_dim = v;
    // transformers: `get("beta_fast") or 32`, so 0 or null mean the default too.
    if (number(rp, "beta_fast", &v) && v != 0) r.beta_fast = v;
    if (number(rp, "beta_slow", &v) && v != 0) r.beta_slow = v;
    if (rp.contains("truncate") && rp["truncate"].is_boolean()) r.truncate = rp["truncate"];
    allowed.insert(allowed.end(),
                   {"factor", "original_max_position_embeddings", "attention_factor", "mscale",
                    "mscale_all_dim", "beta_fast", "beta_slow", "truncate"});
  } else if (r.type == "llama3") {
    MOELORA_RETURN_IF_ERROR(need_factor());
    MOELORA_RETURN_IF_ERROR(original_max());
    if (!number(rp, "low_freq_factor", &r.low_freq_factor) ||
        !number(rp, "high_freq_factor", &r.high_freq_factor) ||
        r.high_freq_factor <= r.low_freq_factor) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": rope_type llama3 needs low_freq_factor < high_freq_factor"));
    }
    allowed.insert(allowed.end(), {"factor", "original_max_position_embeddings", "low_freq_factor",
                                   "high_freq_factor"});
  } else {
    return refuse(where, ".rope_type \"", r.type,
                  "\" is not implemented (implemented: default, linear, yarn, llama3)");
  }
  for (const auto& [key, value] : rp.items()) {
    if (std::find(allowed.begin(), allowed.end(), key) == allowed.end() && !value.is_null()) {
      return refuse(where, ".", key, " is not implemented for rope_type ", r.type);
    }
  }
  return r;
}

}  // namespace

bool IsBenignConfigKey(const std::string& key) {
  // Bookkeeping, token ids, generation and training settings, and PretrainedConfig defaults
  // that transformers may write: none changes the forward pass of a served model.
  static const char* const kBenign[] = {
      "_name_or_path", "architectures", "model_type", "transformers_version", "torch_dtype",
      "dtype", "use_cache", "bos_token_id", "eos_token_id", "pad_token_id", "sep_token_id",
      "decoder_start_token_id", "initializer_range", "output_router_logits", "router_aux_loss_coef",
      "attention_dropout", "output_attentions", "output_hidden_states", "return_dict",
      "torchscript", "use_bfloat16", "tf_legacy_loss", "pruned_heads", "chunk_size_feed_forward",
      "is_encoder_decoder", "is_decoder", "add_cross_attention", "tie_encoder_decoder", "id2label",
      "label2id", "problem_type", "tokenizer_class", "prefix", "task_specific_params",
      "finetuning_task", "num_labels", "max_length", "auto_map", "image_token_id", "video_token_id",
      "vision_start_token_id", "vision_end_token_id", "vision_token_id", "image_token_index",
      "vision_config", "text_config",
      // Qwen2/Qwen3 4.x configs carry it; transformers 5 and vLLM ignore it for Qwen3-MoE,
      // whose sliding window (when on) covers every layer.
      "max_window_layers"};
  for (const char* k : kBenign) {
    if (key == k) return true;
  }
  return false;
}

bool WeightQuantization::KeptUnquantized(const std::string& param) const {
  // Glob match of `*` only (the configs' patterns: `model.layers.*.self_attn`), as a prefix of
  // the name ending at a dot: by hand, as fnmatch has no "prefix up to a dot" mode.
  auto match = [](const std::string& pat, const std::string& s, size_t pi, size_t si,
                  auto&& self) -> bool {
    for (; pi < pat.size(); ++pi, ++si) {
      if (pat[pi] == '*') {
        for (size_t k = si; k <= s.size(); ++k) {
          if (self(pat, s, pi + 1, k, self)) return true;
        }
        return false;
      }
      if (si >= s.size() || s[si] != pat[pi]) return false;
    }
    return si == s.size() || s[si] == '.';
  };
  for (const std::string& m : modules_to_not_convert) {
    if (match(m, param, 0, 0, match)) return true;
  }
  return false;
}

[[nodiscard]] absl::StatusOr<WeightQuantization> ParseWeightQuantization(
    const nlohmann::json& value, const std::string& file, const std::string& architecture) {
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": quantization_config", parts...));
  };
  auto refused = [&](auto&&... parts) {
    return absl::FailedPreconditionError(absl::StrCat(file, ": quantization_config", parts...));
  };
  if (!value.is_object()) return bad(" must be an object");
  WeightQuantization q;
  const std::string method = value.contains("quant_method") && value["quant_method"].is_string()
                                 ? value["quant_method"].get<std::string>()
                                 : "";
  if (value.contains("modules_to_not_convert") && !value["modules_to_not_convert"].is_null()) {
    const nlohmann::json& m = value["modules_to_not_convert"];
    if (!m.is_array()) return bad(".modules_to_not_convert must be a list of module names");
    for (const auto& e : m) {
      if (!e.is_string() || e.get<std::string>().empty() || e.get<std::string>().size() > 512) {
        return bad(".modules_to_not_convert must be a list of module names");
      }
      q.modules_to_not_convert.push_back(e.get<std::string>());
    }
    if (q.modules_to_not_convert.size() > 65536) return bad(".modules_to_not_convert is too long");
  }
  if (method == "mxfp4") {
    if (architecture != "GptOssForCausalLM") {
      return refused(": MXFP4 is served for GPT-OSS's experts only, not for ", architecture);
    }
    q.method = WeightQuantization::Method::kMxfp4;
    return q;
  }
  if (method == "fp8") {
    q.method = WeightQuantization::Method::kFp8;
    if (value.contains("activation_scheme") && value["activation_scheme"] != "dynamic") {
      return refused(".activation_scheme ", value["activation_scheme"].dump(),
                     ": only \"dynamic\" is served (activations are not quantized here)");
    }
    if (value.contains("scale_fmt") && value["scale_fmt"] != "float32") {
      return refused(".scale_fmt ", value["scale_fmt"].dump(),
                     ": only scales stored as numbers (F32 or BF16) are served");
    }
    if (value.contains("fmt") && value["fmt"] != "e4m3") {
      return refused(".fmt ", value["fmt"].dump(), ": only \"e4m3\" FP8 weights are served");
    }
    const nlohmann::json& b =
        value.contains("weight_block_size") ? value["weight_block_size"] : nlohmann::json();
    if (b.is_null()) {
      return refused(": FP8 without weight_block_size (one scale per tensor) is not served; ",
                     "block FP8 ([128, 128] blocks) is");
    }
    if (!b.is_array() || b.size() != 2 || !b[0].is_number_integer() || !b[1].is_number_integer() ||
        b[0].get<int64_t>() < 1 || b[1].get<int64_t>() < 1 || b[0].get<int64_t>() > 65536 ||
        b[1].get<int64_t>() > 65536) {
      return bad(".weight_block_size must be two positive integers, got ", b.dump());
    }
    q.block_n = b[0].get<int64_t>();
    q.block_k = b[1].get<int64_t>();
    return q;
  }
  return refused(
      ".quant_method ",
      value.contains("quant_method") ? value["quant_method"].dump() : std::string("(missing)"),
      " is not served (served: \"mxfp4\" for GPT-OSS, \"fp8\" with weight_block_size)");
}

[[nodiscard]] absl::Status CheckConfigKeys(const std::string& text, const std::string& file,
                                           const std::string& architecture,
                                           const std::vector<std::string>& implemented) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return absl::InvalidArgumentError(absl::StrCat(file, ": not a JSON object"));
  auto check = [&](const nlohmann::json& o, const std::string& where) -> absl::Status {
    for (const auto& [key, value] : o.items()) {
      if (IsBenignConfigKey(key)) continue;
      if (std::find(implemented.begin(), implemented.end(), key) != implemented.end()) continue;
      if (key == "quantization_config") {
        MOELORA_RETURN_IF_ERROR(ParseWeightQuantization(value, file, architecture).status());
        continue;
      }
      return absl::FailedPreconditionError(
          absl::StrCat(file, ": ", where, key, " = ", value.dump(), " is not implemented by the ",
                       architecture, " forward pass (serving it anyway could give wrong answers)"));
    }
    return absl::OkStatus();
  };
  MOELORA_RETURN_IF_ERROR(check(j, ""));
  if (j.contains("text_config") && j["text_config"].is_object()) {
    MOELORA_RETURN_IF_ERROR(check(j["text_config"], "text_config."));
  }
  return absl::OkStatus();
}

[[nodiscard]] absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& raw_text,
                                                           const std::string& file) {
  ModelConfig c;
  MOELORA_ASSIGN_OR_RETURN(c.info, ParseModelInfo(raw_text, file));
  // ParseModelInfo already proved this is a JSON object. Absent keys read as the architecture's
  // class defaults (schema/config_defaults.h).
  MOELORA_ASSIGN_OR_RETURN(const std::string text, ApplyConfigDefaults(raw_text, file));
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
  // Top-k under the architecture's key names (schema/architectures.h).
  if (const ArchFacts* facts = FindArchFacts(c.info.architecture)) {
    for (const std::string& k : facts->top_k_keys) {
      if (integer(k.c_str(), &c.num_experts_per_tok)) break;
    }
  } else {
    integer("num_experts_per_tok", &c.num_experts_per_tok);
  }
  integer("max_position_embeddings", &c.max_position_embeddings);
  if (t.contains("norm_topk_prob") && t["norm_topk_prob"].is_boolean()) {
    c.norm_topk_prob = t["norm_topk_prob"].get<bool>();
  }
  num("rms_norm_eps", &c.rms_norm_eps);
  MOELORA_ASSIGN_OR_RETURN(c.rope, ParseRope(t, c, file));
  c.rope_theta = c.rope.theta;
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
      if (!lt.is_string()) return bad("layer_types must be a list of strings");
      c.layer_types.push_back(lt.get<std::string>());
      if (c.layer_types.back() == "linear_attention") c.mixed_layer_types = true;
    }
    // Step3.5 lists the MTP layers' types after the backbone's.
    int mtp = 0;
    integer("num_nextn_predict_layers", &mtp);
    if (mtp > 0 && static_cast<int>(c.layer_types.size()) == c.info.num_layers + mtp) {
      c.layer_types.resize(c.info.num_layers);
    }
    if (static_cast<int>(c.layer_types.size()) != c.info.num_layers) {
      return bad("layer_types has ", c.layer_types.size(), " entries for ", c.info.num_layers,
                 " layers");
    }
  }
  for (const nlohmann::json* src : {&j, &t}) {
    if (src->contains("quantization_config")) {
      MOELORA_ASSIGN_OR_RETURN(
          c.quantization,
          ParseWeightQuantization((*src)["quantization_config"], file, c.info.architecture));
    }
  }
  integer("linear_conv_kernel_dim", &c.linear_conv_kernel);
  num("swiglu_alpha", &c.swiglu_alpha);
  num("swiglu_limit", &c.swiglu_limit);
  if (integer("full_attention_interval", &c.full_attention_interval) &&
      c.full_attention_interval < 1) {
    return bad("full_attention_interval must be >= 1");
  }
  if (t.contains("hidden_act")) {
    if (!t["hidden_act"].is_string()) return bad("hidden_act must be a string");
    c.hidden_act = t["hidden_act"].get<std::string>();
  }
  if (t.contains("attention_bias") && t["attention_bias"].is_boolean()) {
    c.attention_bias = t["attention_bias"].get<bool>();
  }
  // Sliding window: transformers' Qwen3-MoE applies `sliding_window` to every layer when
  // use_sliding_window is true; configs with layer_types name the sliding layers instead.
  integer("sliding_window", &c.sliding_window_value);
  bool use_sw = t.contains("use_sliding_window") && t["use_sliding_window"].is_boolean() &&
                t["use_sliding_window"].get<bool>();
  bool any_sliding_type = false;
  for (const std::string& lt : c.layer_types) any_sliding_type |= lt == "sliding_attention";
  if (use_sw || any_sliding_type) {
    if (!integer("sliding_window", &c.sliding_window) || c.sliding_window <= 0) {
      return bad(use_sw ? "use_sliding_window is true" : "layer_types has sliding_attention",
                 " but sliding_window is not a positive integer");
    }
    c.sliding_layers.assign(c.info.num_layers, !any_sliding_type);
    for (size_t i = 0; i < c.layer_types.size(); ++i) {
      if (c.layer_types[i] == "sliding_attention") c.sliding_layers[i] = true;
    }
  }
  return c;
}

[[nodiscard]] absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& model_dir) {
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
