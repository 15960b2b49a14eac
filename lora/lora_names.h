// LoRA tensor names, parsed as vLLM's parse_fine_tuned_lora_name does (docs/formats.md §7), and
// classified into dense modules, 2D per-expert and 3D fused expert LoRA.
// Thread-safe: pure functions.
#ifndef MOELORA_LORA_LORA_NAMES_H_
#define MOELORA_LORA_LORA_NAMES_H_

#include <string>

#include "absl/status/statusor.h"

namespace moelora {

struct LoraTensorName {
  std::string
      module;         // e.g. "model.layers.3.mlp.experts.7.gate_proj" ("base_model.model." removed)
  bool is_a = false;  // lora_A (true) or lora_B (false)
};

// "base_model.model.<module>.lora_{A,B}.weight" or "<module>.lora_{A,B}.weight".
// INVALID_ARGUMENT for anything else, with a hint for DoRA magnitude vectors, embedding LoRA and
// LoRA biases.
[[nodiscard]] absl::StatusOr<LoraTensorName> ParseLoraTensorName(const std::string& name);

enum class ExpertProj { kGate = 0, kUp = 1, kDown = 2 };  // vLLM w1, w3, w2
const char* ExpertProjName(ExpertProj p);                 // "gate_proj" ...

enum class ModuleKind { kDense, kExpert2D, kGateUp3D, kDown3D };

struct ModuleClass {
  ModuleKind kind = ModuleKind::kDense;
  std::string experts_prefix;           // for expert kinds: module path up to ".experts"
  int expert = -1;                      // kExpert2D only
  ExpertProj proj = ExpertProj::kGate;  // kExpert2D only
  int layer = -1;                       // from ".layers.<L>." when present
};

// Classifies a module path: "<p>.experts.<e>.{gate,up,down}_proj" (also w1/w3/w2) is 2D,
// "<p>.experts.base_layer" is the 3D gate_up pair, "<p>.experts" the 3D down pair.
ModuleClass ClassifyModule(const std::string& module);

}  // namespace moelora

#endif  // MOELORA_LORA_LORA_NAMES_H_
