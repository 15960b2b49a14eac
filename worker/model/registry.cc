#include "worker/model/registry.h"

#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moelora {

namespace {

// One entry per architecture of lora/architectures.cc that the worker can load; the facts come
// from there (FindArchFacts), so a layout is written down once.
ArchTable Entry(const char* arch, NameRule map, ModelFactory factory = nullptr,
                const std::vector<std::string>* keys = nullptr) {
  ArchTable t{arch, map, factory, keys, FindArchFacts(arch)};
  if (t.facts == nullptr) {
    std::fprintf(stderr, "registry: %s has no entry in lora/architectures.cc\n", arch);
    std::abort();
  }
  return t;
}

const std::vector<ArchTable>& Tables() {
  static const std::vector<ArchTable> tables = {
      Entry("Qwen3MoeForCausalLM", &MapQwen3Moe, &CreateQwen3Moe, &Qwen3MoeConfigKeys()),
      // The text path of the VL model is Qwen3-MoE with fused, transposed expert storage.
      Entry("Qwen3VLMoeForConditionalGeneration", &MapQwen3VlMoe, &CreateQwen3Moe,
            &Qwen3MoeConfigKeys()),
      // Qwen3.5/3.6-MoE: the text path of the VL release, and text-only checkpoints.
      Entry("Qwen3_5MoeForConditionalGeneration", &MapQwen35MoeMain, &CreateQwen35Moe,
            &Qwen35MoeConfigKeys()),
      Entry("Qwen3_5MoeForCausalLM", &MapQwen35MoeMain, &CreateQwen35Moe, &Qwen35MoeConfigKeys()),
      // The MTP head's checkpoint keys are `mtp.layers.{i}.mlp.experts.gate_up_proj` etc.
      Entry("Qwen3_5MoeMTP", &MapQwen35Moe),
      // GPT-OSS (bf16 checkpoints; interleaved gate/up). CPU path.
      Entry("GptOssForCausalLM", &MapGptOss, &CreateGptOss, &GptOssConfigKeys()),
      // Step3 text: MQA with one replicated KV head and the shared low-rank query.
      Entry("Step3TextForCausalLM", &MapStep3, &CreateStep3Text, &Step3TextConfigKeys()),
      // Step3.5 (Step-3.5-Flash): the hub layout, its MTP layers skipped.
      Entry("Step3p5ForCausalLM", &MapStep3, &CreateStep3p5, &Step3p5ConfigKeys()),
      // The Step3.5 MTP layers follow the backbone's (model.layers.{N+i}.moe.*_proj.weight).
      Entry("Step3p5MTP", &MapStep3),
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
