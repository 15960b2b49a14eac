// The one architecture registry: config.json `architectures[0]` -> the checkpoint name rule, the
// native MoE LoRA layout, the config keys its forward pass implements, and the factory that
// builds its model (none: the weights can be named and loaded, but nothing runs them). Nothing
// else decides which architectures exist. No libtorch in this header.
#ifndef MOELORA_WORKER_MODEL_REGISTRY_H_
#define MOELORA_WORKER_MODEL_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lora/adapter.h"
#include "worker/loaders/name_tables.h"

namespace moelora {

class CausalLM;
struct ModelContext;  // worker/model/model_context.h
using ModelFactory = absl::StatusOr<std::unique_ptr<CausalLM>> (*)(const ModelContext& ctx);

struct ArchTable {
  std::string architecture;         // config.json architectures[0]
  AdapterFormat native_moe_format;  // k2D or k3D (vLLM `is_3d_moe_weight`)
  NameRule map = nullptr;           // checkpoint name -> engine parameter
  ModelFactory factory = nullptr;   // nullptr: weight names only, no forward pass
  // config.json keys (besides the benign ones, model_config.h) that the forward implements.
  const std::vector<std::string>* config_keys = nullptr;
  // The checkpoint appends the MTP layers to the backbone's (Step3.5: model.layers.{N + i}.*,
  // N = num_hidden_layers): the main model skips them.
  bool mtp_layers_follow = false;
  // KV heads are replicated on every rank instead of sharded (Step3's single KV head): the
  // shared check that they divide by the TP size does not apply; the model checks its own.
  bool kv_replicated = false;
  bool has_forward() const { return factory != nullptr; }
};

// The entry for `architecture`; INVALID_ARGUMENT listing the supported ones when unknown.
[[nodiscard]] absl::StatusOr<const ArchTable*> FindArchTable(const std::string& architecture);
std::vector<std::string> SupportedArchitectures();
std::vector<std::string> ServedArchitectures();  // those with a forward pass

// Factories (worker/models/*.cc).
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateQwen3Moe(const ModelContext& ctx);
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateQwen35Moe(const ModelContext& ctx);
// config.json keys each model implements.
const std::vector<std::string>& Qwen3MoeConfigKeys();
const std::vector<std::string>& Qwen35MoeConfigKeys();
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateGptOss(const ModelContext& ctx);
const std::vector<std::string>& GptOssConfigKeys();
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateStep3p5(const ModelContext& ctx);
const std::vector<std::string>& Step3p5ConfigKeys();
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateStep3Text(const ModelContext& ctx);
const std::vector<std::string>& Step3TextConfigKeys();

}  // namespace moelora

#endif  // MOELORA_WORKER_MODEL_REGISTRY_H_
