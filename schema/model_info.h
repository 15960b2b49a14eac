// The few facts of a base model's config.json that adapter validation needs.
// Thread-safe: plain data and pure functions.
#ifndef MOELORA_SCHEMA_MODEL_INFO_H_
#define MOELORA_SCHEMA_MODEL_INFO_H_

#include <string>

#include "absl/status/statusor.h"

namespace moelora {

// The most MTP heads a model may bring (Step3.5's chained layers: one per draft token).
constexpr int kMaxMtpHeads = 4;

struct ModelInfo {
  std::string architecture;       // config.json architectures[0]
  int hidden_size = 0;            // H
  int moe_intermediate_size = 0;  // I (per expert)
  int num_experts = 0;            // E
  int num_layers = 0;
  int num_attention_heads = 0;
  int num_key_value_heads = 0;
  int head_dim = 0;
  bool interleaved_gate_up = false;  // GPT-OSS: gate/up rows interleaved
  // Qwen3.5: q_proj emits [q ; gate] per head (2 · heads · head_dim rows).
  bool attn_output_gate = false;
  // Qwen3.5 Gated DeltaNet (linear_attn.*): heads and head dims; 0 when the model has none.
  int linear_num_key_heads = 0, linear_num_value_heads = 0;
  int linear_key_head_dim = 0, linear_value_head_dim = 0;
  int shared_expert_intermediate_size = 0;  // 0: no shared expert
  // Step3.5: the query heads differ between layers (full / sliding): q/o dims are per layer.
  bool per_layer_heads = false;
  // Step3: q_proj is the shared low-rank query [share_q_dim, H], wq [heads · head_dim,
  // share_q_dim].
  int share_q_dim = 0;
  // Qwen3.5: the layers of its multi-token-prediction head (0: none declared).
  int mtp_num_hidden_layers = 0;
  // Step3.5: its MTP layers after num_hidden_layers (num_nextn_predict_layers), one chained draft
  // head each.
  int num_nextn_predict_layers = 0;

  // Expected [out, in] of a dense module by its path (`model.layers.3.self_attn.q_proj`, or
  // just its last components); false when the module's dims are not known here.
  bool DenseDims(const std::string& module, int* out, int* in) const;
};

// Reads `model_dir`/config.json (the text sub-config for VL/multimodal wrappers). NOT_FOUND if
// the file is missing, INVALID_ARGUMENT naming the file and field otherwise.
[[nodiscard]] absl::StatusOr<ModelInfo> ReadModelInfo(const std::string& model_dir);
// The same from JSON text; `file` names it in messages.
[[nodiscard]] absl::StatusOr<ModelInfo> ParseModelInfo(const std::string& text,
                                                       const std::string& file);

// "fnv1a64:<16 hex digits>" of `model_dir`/config.json's bytes: tells whether two processes
// serve the same model, wherever it is mounted. Not a cryptographic hash. NOT_FOUND if the file
// cannot be read.
[[nodiscard]] absl::StatusOr<std::string> ConfigFingerprint(const std::string& model_dir);

}  // namespace moelora

#endif  // MOELORA_SCHEMA_MODEL_INFO_H_
