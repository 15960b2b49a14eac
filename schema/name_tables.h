// Model-specific loaders as name tables: checkpoint tensor name -> engine parameter name.
//
// The engine's parameter tree follows vLLM's: every module a LoRA wrapper wraps keeps its base
// weight under `.base_layer.` (dense: `self_attn.q_proj.base_layer.weight`; experts:
// `mlp.experts.base_layer.w13_weight [E, 2I, H]` = [gate ; up] per expert and
// `mlp.experts.base_layer.w2_weight [E, H, I]`). With LoRA off the `.base_layer.` segment is
// absent. docs/formats.md §6 gives the checkpoint side per architecture; names that come from
// a PEFT-wrapped trainer already carry `.base_layer.` and are accepted too (docs/formats.md §6).
//
// Engine names drop multimodal wrappers' text prefixes (`model.language_model.` -> `model.`), so
// one transformer implementation serves Qwen3-MoE and the Qwen3-VL-MoE text path.
//
// Thread-safe: the tables are immutable.
#ifndef MOELORA_SCHEMA_NAME_TABLES_H_
#define MOELORA_SCHEMA_NAME_TABLES_H_

#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moelora {

// Which part of a fused expert parameter a checkpoint tensor fills.
enum class ExpertShard {
  kNone,  // not an expert weight: the whole parameter
  kW1,    // gate rows [0, I) of w13
  kW3,    // up rows [I, 2I) of w13
  kW13,   // both halves at once (source already fused [gate ; up])
  kW2,    // down
};
const char* ExpertShardName(ExpertShard s);

// Where one checkpoint tensor goes.
struct WeightTarget {
  std::string param;  // engine parameter name
  int expert = -1;    // -1: the source stacks all experts on its dim 0
  ExpertShard shard = ExpertShard::kNone;
  bool transposed = false;  // source is [.., in, out] (x @ W): transpose the last two dims
  // kW13 only: the source's 2I rows are interleaved g0, u0, g1, u1, ... (GPT-OSS).
  bool interleaved = false;
  // kW13 only: the source is the experts' gate_up bias [E, 2I] (param [E, 2I, 1]).
  bool bias = false;
  // Qwen3-VL-MoE's fused experts come in two layouts: as released (gate_up_proj [E, H, 2I],
  // down_proj [E, I, H]: `transposed`) and as transformers 5's save_pretrained writes them
  // ([E, 2I, H], [E, H, I]). The loader decides from the shapes of the layer's two tensors.
  bool either_layout = false;
};

// What a table says about one checkpoint name.
struct NameMapping {
  enum Kind { kLoad, kSkip, kUnknown } kind = kUnknown;
  WeightTarget target;  // kLoad
  std::string reason;   // kSkip: why (e.g. "vision tower: text path only")
};

// Maps a checkpoint name to an engine parameter. `lora_wrapped`: the engine has LoRA wrappers
// (names get `.base_layer.`). One rule per checkpoint family; the architecture registry
// (worker/model/registry.h) says which architecture uses which.
using NameRule = NameMapping (*)(const std::string& ckpt_name, bool lora_wrapped);
NameMapping MapQwen3Moe(const std::string& ckpt_name, bool lora_wrapped);
NameMapping MapQwen3VlMoe(const std::string& ckpt_name, bool lora_wrapped);  // fused, transposed
NameMapping MapQwen35Moe(const std::string& ckpt_name, bool lora_wrapped);   // fused or per expert
// The main model's checkpoint: as MapQwen35Moe, with the MTP head's `mtp.*` skipped.
NameMapping MapQwen35MoeMain(const std::string& ckpt_name, bool lora_wrapped);
// N of a `model.layers.N.` (or `model.language_model.layers.N.`) name; -1 for other names.
int CheckpointLayerIndex(const std::string& name);

NameMapping MapStep3(const std::string& ckpt_name, bool lora_wrapped);  // stacked moe.*_proj
// Step3.5's MTP layers (model.layers.{N + i}.*): as MapStep3, `.transformer.` dropped and a
// layer's own embed_tokens skipped.
NameMapping MapStep3p5Mtp(const std::string& ckpt_name, bool lora_wrapped);
// GPT-OSS bf16 checkpoints: fused, transposed experts with interleaved gate/up and biases.
NameMapping MapGptOss(const std::string& ckpt_name, bool lora_wrapped);

// Engine names of the two expert parameters of the MoE block at `experts_prefix`
// (e.g. "model.layers.3.mlp.experts").
std::string W13Name(const std::string& experts_prefix, bool lora_wrapped);
std::string W2Name(const std::string& experts_prefix, bool lora_wrapped);

}  // namespace moelora

#endif  // MOELORA_SCHEMA_NAME_TABLES_H_
