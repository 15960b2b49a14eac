// The architectures the worker serves: each entry of schema/architectures.cc (name rule, layouts,
// config keys, defaults) bound to the factory that builds its model (none: the weights can be
// named and loaded, but nothing runs them). No libtorch in this header.
#ifndef MOELORA_WORKER_MODEL_REGISTRY_H_
#define MOELORA_WORKER_MODEL_REGISTRY_H_

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lora/adapter.h"
#include "schema/architectures.h"

namespace moelora {

class CausalLM;
struct ModelContext;  // worker/model/model_context.h
using ModelFactory = absl::StatusOr<std::unique_ptr<CausalLM>> (*)(const ModelContext& ctx);

struct ArchTable {
  std::string architecture;          // config.json architectures[0]
  ModelFactory factory = nullptr;    // nullptr: weight names only, no forward pass
  const ArchFacts* facts = nullptr;  // everything else (schema/architectures.h)
  // From `facts`, for the loader and the config check.
  NameRule map = nullptr;
  const std::vector<std::string>* config_keys = nullptr;
  bool has_forward() const { return factory != nullptr; }
  AdapterFormat native_moe_format() const { return facts->native_moe_format; }
};

// The entry for `architecture`; INVALID_ARGUMENT listing the supported ones when unknown.
[[nodiscard]] absl::StatusOr<const ArchTable*> FindArchTable(const std::string& architecture);
std::vector<std::string> SupportedArchitectures();
std::vector<std::string> ServedArchitectures();  // those with a forward pass

// Factories (worker/architectures/*.cc).
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateQwen3Moe(const ModelContext& ctx);
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateQwen35Moe(const ModelContext& ctx);
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateGptOss(const ModelContext& ctx);
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateStep3p5(const ModelContext& ctx);
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> CreateStep3Text(const ModelContext& ctx);

}  // namespace moelora

#endif  // MOELORA_WORKER_MODEL_REGISTRY_H_
