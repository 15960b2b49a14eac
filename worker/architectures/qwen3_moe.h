// Qwen3-MoE (Qwen3MoeForCausalLM) and the Qwen3-VL-MoE text path: attention with q/k norms and
// RoPE (default, linear, yarn, llama3; optional sliding window) and a softmax top-k MoE block
// in every layer. Includes ATen.
#ifndef MOELORA_WORKER_MODELS_QWEN3_MOE_H_
#define MOELORA_WORKER_MODELS_QWEN3_MOE_H_

#include <vector>

#include "schema/model_config.h"
#include "worker/loaders/weight_loader.h"

namespace moelora {

// Parameter specs (engine names, full shapes, TP split) of the Qwen3-MoE transformer.
std::vector<ParamSpec> Qwen3MoeParamSpecs(const ModelConfig& c, bool lora_wrapped,
                                          bool with_lm_head);

}  // namespace moelora

#endif  // MOELORA_WORKER_MODELS_QWEN3_MOE_H_
