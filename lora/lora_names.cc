#include "lora/lora_names.h"

#include <cstdlib>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"

namespace moelora {

[[nodiscard]] absl::StatusOr<LoraTensorName> ParseLoraTensorName(const std::string& name) {
  std::vector<std::string> parts = absl::StrSplit(name, '.');
  size_t start = 0;
  if (parts.size() > 2 && parts[0] == "base_model" && parts[1] == "model") start = 2;
  const size_t n = parts.size();
  if (n >= start + 3 && parts[n - 1] == "weight" &&
      (parts[n - 2] == "lora_A" || parts[n - 2] == "lora_B")) {
    LoraTensorName out;
    out.module = absl::StrJoin(parts.begin() + start, parts.end() - 2, ".");
    out.is_a = parts[n - 2] == "lora_A";
    return out;
  }
  std::string hint;
  if (absl::StrContains(name, "lora_magnitude_vector")) {
    hint = " (a DoRA magnitude vector: DoRA is not supported)";
  } else if (absl::StrContains(name, "lora_embedding")) {
    hint = " (embedding LoRA is not supported)";
  } else if (absl::EndsWith(name, ".bias")) {
    hint = " (LoRA biases are not supported)";
  } else if (absl::StrContains(name, "base_layer.weight") ||
             absl::StrContains(name, "modules_to_save")) {
    hint = " (full base weights in an adapter are not supported)";
  }
  return absl::InvalidArgumentError(absl::StrCat(
      "tensor '", name,
      "' is not a LoRA weight (expected <module>.lora_A.weight or .lora_B.weight)", hint));
}

const char* ExpertProjName(ExpertProj p) {
  switch (p) {
    case ExpertProj::kGate:
      return "gate_proj";
    case ExpertProj::kUp:
      return "up_proj";
    case ExpertProj::kDown:
      return "down_proj";
  }
  return "?";
}

ModuleClass ClassifyModule(const std::string& module) {
  ModuleClass c;
  std::vector<std::string> parts = absl::StrSplit(module, '.');
  for (size_t i = 0; i + 1 < parts.size(); ++i) {
    int layer;
    if (parts[i] == "layers" && absl::SimpleAtoi(parts[i + 1], &layer)) {
      c.layer = layer;
      break;
    }
  }
  const size_t n = parts.size();
  auto prefix_upto = [&](size_t k) {
    return absl::StrJoin(parts.begin(), parts.begin() + k + 1, ".");
  };
  if (n >= 1 && parts[n - 1] == "experts") {
    c.kind = ModuleKind::kDown3D;
    c.experts_prefix = module;
    return c;
  }
  if (n >= 2 && parts[n - 2] == "experts" && parts[n - 1] == "base_layer") {
    c.kind = ModuleKind::kGateUp3D;
    c.experts_prefix = prefix_upto(n - 2);
    return c;
  }
  int expert;
  if (n >= 3 && parts[n - 3] == "experts" && absl::SimpleAtoi(parts[n - 2], &expert) &&
      expert >= 0 && parts[n - 2].find_first_not_of("0123456789") == std::string::npos) {
    const std::string& p = parts[n - 1];
    ExpertProj proj;
    if (p == "gate_proj" || p == "w1") {
      proj = ExpertProj::kGate;
    } else if (p == "up_proj" || p == "w3") {
      proj = ExpertProj::kUp;
    } else if (p == "down_proj" || p == "w2") {
      proj = ExpertProj::kDown;
    } else {
      return c;  // an unknown per-expert module: treated as dense, validation will name it
    }
    c.kind = ModuleKind::kExpert2D;
    c.experts_prefix = prefix_upto(n - 3);
    c.expert = expert;
    c.proj = proj;
  }
  return c;
}

}  // namespace moelora
