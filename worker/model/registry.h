// The one architecture registry: config.json `architectures[0]` -> the checkpoint name rule, the
// config keys its forward pass implements, the factory that builds its model (none: the weights
// can be named and loaded, but nothing runs them), and its facts (lora/architectures.h: native
// MoE LoRA layout, checkpoint layout, key names). Nothing else decides which architectures
// exist. No libtorch in this header.
#ifndef MOELORA_WORKER_MODEL_REGISTRY_H_
#define MOELORA_WORKER_MODEL_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lora/adapter.h"
#include "lora/architectures.h"
#include "worker/loaders/name_tables.h"

namespace moelora {

class CausalLM;
struct ModelContext;  // worker/model/model_context.h
using ModelFactory = absl::StatusOr<std::unique_ptr<CausalLM>> (*)(const ModelContext& ctx);

struct ArchTable {
  std::string architecture;        // config.json architectures[0]
  NameRule map = nullptr;          // checkpoint name -> engine parameter
  ModelFactory factory = nullptr;  // nullptr: weight names only, no forward pass
  // config.json keys (besides the benign ones, lora/model_config.h) that the forward implements.
  const std::vector<std::string>* config_keys = nullptr;
  // What needs no forward pass: native MoE LoRA layout, checkpoint layout facts, key names.
  const ArchFacts* facts = nullptr;
  bool has_forward() const { return factory != nullptr; }
  AdapterFormat native_moe_format() const { return facts->native_moe_format; }
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
