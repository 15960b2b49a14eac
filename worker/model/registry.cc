#include "worker/model/registry.h"

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moelora {

namespace {

const std::vector<ArchTable>& Tables() {
  static const std::vector<ArchTable> tables = {
      {"Qwen3MoeForCausalLM", AdapterFormat::k2D, &MapQwen3Moe, &CreateQwen3Moe,
       &Qwen3MoeConfigKeys()},
      // The text path of the VL model is Qwen3-MoE with fused, transposed expert storage.
      {"Qwen3VLMoeForConditionalGeneration", AdapterFormat::k3D, &MapQwen3VlMoe, &CreateQwen3Moe,
       &Qwen3MoeConfigKeys()},
      // Qwen3.5/3.6-MoE: the text path of the VL release, and text-only checkpoints.
      {"Qwen3_5MoeForConditionalGeneration", AdapterFormat::k3D, &MapQwen35MoeMain,
       &CreateQwen35Moe, &Qwen35MoeConfigKeys()},
      {"Qwen3_5MoeForCausalLM", AdapterFormat::k3D, &MapQwen35MoeMain, &CreateQwen35Moe,
       &Qwen35MoeConfigKeys()},
      // The MTP head's checkpoint keys are `mtp.layers.{i}.mlp.experts.gate_up_proj` etc.
      {"Qwen3_5MoeMTP", AdapterFormat::k3D, &MapQwen35Moe},
      // GPT-OSS (bf16 checkpoints; 3D-native with interleaved gate/up). CPU path.
      {"GptOssForCausalLM", AdapterFormat::k3D, &MapGptOss, &CreateGptOss, &GptOssConfigKeys()},
      // Step3 text: MQA with one replicated KV head and the shared low-rank query.
      {"Step3TextForCausalLM", AdapterFormat::k2D, &MapStep3, &CreateStep3Text,
       &Step3TextConfigKeys(), /*mtp_layers_follow=*/false, /*kv_replicated=*/true},
      // Step3.5 (Step-3.5-Flash): the hub layout, its MTP layers skipped.
      {"Step3p5ForCausalLM", AdapterFormat::k2D, &MapStep3, &CreateStep3p5, &Step3p5ConfigKeys(),
       /*mtp_layers_follow=*/true},
      // The Step3.5 MTP layers follow the backbone's (model.layers.{N+i}.moe.*_proj.weight).
      {"Step3p5MTP", AdapterFormat::k2D, &MapStep3},
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
