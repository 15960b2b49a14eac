// Everything about each supported architecture but its forward pass: its checkpoint name rule,
// native MoE LoRA layout, how its checkpoint stores experts and heads, which config.json keys it
// uses and implements, and its configuration class's defaults. One entry per architecture: the
// worker's registry (worker/model/registry.h) only binds forward passes to these entries, and
// adapter validation, config parsing and the loader read them here instead of testing
// architecture names. Thread-safe: a constant table.
#ifndef MOELORA_SCHEMA_ARCHITECTURES_H_
#define MOELORA_SCHEMA_ARCHITECTURES_H_

#include <string>
#include <vector>

#include "schema/formats.h"
#include "schema/name_tables.h"

namespace moelora {

struct ArchFacts {
  std::string architecture;  // config.json architectures[0]
  NameRule map = nullptr;    // checkpoint tensor name -> engine parameter (schema/name_tables.h)
  // The config.json keys its forward pass implements besides the benign ones (CheckConfigKeys);
  // empty for entries without a forward pass of their own (MTP heads).
  std::vector<std::string> config_keys;
  AdapterFormat native_moe_format = AdapterFormat::k2D;  // vLLM's `is_3d_moe_weight`
  bool interleaved_gate_up = false;  // gate/up rows interleaved (GPT-OSS), else [gate ; up]
  // q_proj emits [q ; gate] per head unless config.json says attn_output_gate false (Qwen3.5).
  bool attn_output_gate = false;
  // The checkpoint appends the MTP layers to the backbone's (model.layers.{N + i}.*).
  bool mtp_layers_follow = false;
  // KV heads are replicated on every rank instead of sharded (Step3's single KV head).
  bool kv_replicated = false;
  // config.json key names, in the order they are looked up (the first one present wins).
  std::vector<std::string> kv_heads_keys = {"num_key_value_heads"};
  std::vector<std::string> experts_keys = {"num_experts", "num_local_experts"};
  // Per-expert intermediate size; GPT-OSS calls it intermediate_size.
  std::vector<std::string> expert_inter_keys = {"moe_intermediate_size"};
  std::vector<std::string> shared_expert_keys = {"shared_expert_intermediate_size"};
  std::vector<std::string> top_k_keys = {"num_experts_per_tok"};
  // The defaults the model's own configuration class gives absent config.json keys (applied by
  // schema/config_defaults.h): where they come from, a JSON object of key -> default for the text
  // config ("@top": the wrapper's own keys), and keys that must be present because the sources
  // disagree on their default. Empty for entries that are never served on their own (MTP).
  std::string defaults_source;
  const char* defaults_json = nullptr;
  struct Required {
    std::string key, reason;
  };
  std::vector<Required> required;
};

const std::vector<ArchFacts>& AllArchFacts();
// The entry for `architecture`, or nullptr.
const ArchFacts* FindArchFacts(const std::string& architecture);

}  // namespace moelora

#endif  // MOELORA_SCHEMA_ARCHITECTURES_H_
