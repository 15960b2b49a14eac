// What the worker needs from a model's config.json: the architecture and every dimension of the
// text model. Thread-safe: plain data and pure functions.
#ifndef MOELORA_SCHEMA_MODEL_CONFIG_H_
#define MOELORA_SCHEMA_MODEL_CONFIG_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"
#include "schema/model_info.h"
#include "schema/rope.h"

namespace moelora {

// config.json's quantization_config: how the checkpoint's quantized weights are stored.
struct WeightQuantization {
  enum class Method {
    kNone,
    kMxfp4,  // GPT-OSS: experts as `<name>_blocks` (E2M1 pairs) and `<name>_scales` (E8M0)
    kFp8,    // block FP8: `<name>.weight` float8_e4m3fn and `<name>.weight_scale_inv`
  } method = Method::kNone;
  int64_t block_n = 128, block_k = 128;  // kFp8: weight_block_size
  // Modules the config keeps unquantized (`*` matches any run of characters).
  std::vector<std::string> modules_to_not_convert;
  // Whether `param` (a checkpoint tensor name) lies under a module of modules_to_not_convert.
  bool KeptUnquantized(const std::string& param) const;
};

struct ModelConfig {
  ModelInfo info;  // architecture, H, I, E, layers, heads (shared with adapter validation)
  int vocab_size = 0;
  int num_experts_per_tok = 0;  // top-k
  bool norm_topk_prob = true;   // renormalise the top-k routing weights
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  RopeSpec rope;  // rope_parameters (transformers 5) or rope_scaling + rope_theta (4.x)
  int max_position_embeddings = 0;
  bool tie_word_embeddings = false;  // lm_head = embed_tokens when the checkpoint has no lm_head
  // Layers whose MLP is dense rather than MoE (Qwen3 `mlp_only_layers`, `decoder_sparse_step`).
  // Only all-MoE models are served for now; a config with dense layers is rejected by name.
  bool all_layers_moe = true;
  bool mixed_layer_types = false;  // hybrid attention (Qwen3.5 linear attention): not served yet
  // layer_types[i] when the config lists them ("full_attention", "sliding_attention",
  // "linear_attention"), else empty.
  std::vector<std::string> layer_types;
  // Sliding-window attention: a query at position p sees keys at positions > p - window.
  // 0: none. Which layers use it: sliding_layers[i] (all layers when use_sliding_window is set
  // without layer_types, as transformers' Qwen3-MoE does).
  int sliding_window = 0;
  std::vector<bool> sliding_layers;
  // config.json's sliding_window whether or not the config turns the window on (GPT-OSS's
  // default layer_types use it); 0 when absent or null.
  int sliding_window_value = 0;
  std::string hidden_act = "silu";
  bool attention_bias = false;
  // Qwen3.5 Gated DeltaNet layers: the causal conv's kernel (their heads and head dims, and the
  // shared expert's size, are in `info`).
  int linear_conv_kernel = 4;
  int full_attention_interval = 4;  // Qwen3.5 without layer_types: every N-th layer is full
  double swiglu_alpha = 1.702, swiglu_limit = 7.0;  // GPT-OSS's clamped SwiGLU
  WeightQuantization quantization;
};

// quantization_config (`value`) of `architecture`'s config `file`: MXFP4 for GPT-OSS, block FP8
// (dynamic activations, e4m3) for any architecture. FAILED_PRECONDITION naming the method or the
// setting for anything else; INVALID_ARGUMENT for a malformed entry.
[[nodiscard]] absl::StatusOr<WeightQuantization> ParseWeightQuantization(
    const nlohmann::json& value, const std::string& file, const std::string& architecture);

// Keys of a config.json (and of its text_config) that never change the forward pass: ids,
// training-only settings, bookkeeping. Every other key must be implemented by the architecture
// (CheckConfigKeys).
bool IsBenignConfigKey(const std::string& key);

// FAILED_PRECONDITION naming the first key of `text` (its text_config for multimodal wrappers,
// and the top level) that is neither benign nor in `implemented`: a setting the forward pass
// would otherwise ignore, giving wrong answers with no error.
[[nodiscard]] absl::Status CheckConfigKeys(const std::string& text, const std::string& file,
                                           const std::string& architecture,
                                           const std::vector<std::string>& implemented);

// Reads `model_dir`/config.json (text_config for multimodal wrappers). NOT_FOUND if the file is
// missing; INVALID_ARGUMENT naming the file and the field otherwise.
[[nodiscard]] absl::StatusOr<ModelConfig> ReadModelConfig(const std::string& model_dir);
[[nodiscard]] absl::StatusOr<ModelConfig> ParseModelConfig(const std::string& text,
                                                           const std::string& file);

}  // namespace moelora

#endif  // MOELORA_SCHEMA_MODEL_CONFIG_H_
