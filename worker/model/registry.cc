#include "worker/model/registry.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moelora {

namespace {

// The factory bound to an entry of schema/architectures.cc (which must have it).
ArchTable Entry(const char* arch, ModelFactory factory = nullptr) {
  ArchTable t{arch, factory, FindArchFacts(arch)};
  if (t.facts == nullptr || t.facts->map == nullptr) {
    std::fprintf(stderr, "registry: %s has no entry in schema/architectures.cc\n", arch);
    std::abort();
  }
  t.map = t.facts->map;
  t.config_keys = &t.facts->config_keys;
  return t;
}

const std::vector<ArchTable>& Tables() {
  static const std::vector<ArchTable> tables = {
      Entry("Qwen3MoeForCausalLM", &CreateQwen3Moe),
      // The text path of the VL model is Qwen3-MoE with fused, transposed expert storage.
      Entry("Qwen3VLMoeForConditionalGeneration", &CreateQwen3Moe),
      // Qwen3.5/3.6-MoE: the text path of the VL release, and text-only checkpoints.
      Entry("Qwen3_5MoeForConditionalGeneration", &CreateQwen35Moe),
      Entry("Qwen3_5MoeForCausalLM", &CreateQwen35Moe),
      Entry("Qwen3_5MoeMTP"),
      Entry("GptOssForCausalLM", &CreateGptOss),  // bf16 checkpoints; the CPU path
      Entry("Step3TextForCausalLM", &CreateStep3Text),
      Entry("Step3p5ForCausalLM", &CreateStep3p5),
      Entry("Step3p5MTP"),
  };
  return tables;
}

}  // namespace

std::vector<std::string> SupportedArchitectures() {
  std::vector<std::string> out;
  for (const ArchTable& t : Tables()) out.push_back(t.architecture);
  return out;
}

std::vector<std::string> ServedArchitectures() {
  std::vector<std::string> out;
  for (const ArchTable& t : Tables()) {
    if (t.has_forward()) out.push_back(t.architecture);
  }
  return out;
}

[[nodiscard]] absl::StatusOr<const ArchTable*> FindArchTable(const std::string& architecture) {
  for (const ArchTable& t : Tables()) {
    if (t.architecture == architecture) return &t;
  }
  return absl::InvalidArgumentError(
      absl::StrCat("unknown architecture \"", architecture,
                   "\"; supported: ", absl::StrJoin(SupportedArchitectures(), ", ")));
}

}  // namespace moelora
