// The LoraModule defaults: a module that takes no LoRA of a kind refuses it by name.
#include "worker/layers/lora_module.h"

#include "absl/strings/str_cat.h"

namespace moelora {

absl::Status LoraModule::CheckDense(const LoraAdapter& a, const LoraPair& pair) const {
  return absl::InvalidArgumentError(absl::StrCat(a.safetensors_path, ": tensor ", pair.a_name,
                                                 " targets ", path_,
                                                 ", which takes expert LoRA only"));
}
absl::Status LoraModule::CheckExperts(const LoraAdapter& a, const MoeLayerLora& layer) const {
  return absl::InvalidArgumentError(absl::StrCat(a.safetensors_path, ": expert LoRA for ",
                                                 layer.prefix, " targets ", path_,
                                                 ", which is not an experts module"));
}
void LoraModule::WriteDense(const LoraPair&, const SlotWrite&) {}
void LoraModule::WriteExperts(const MoeLayerLora&, const SlotWrite&) {}
int64_t LoraModule::DenseBytes(const LoraPair&, int64_t) const { return 0; }
int64_t LoraModule::ExpertBytes(const MoeLayerLora&, int64_t) const { return 0; }

}  // namespace moelora
