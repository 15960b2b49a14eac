// The vision tower of Qwen3-VL(-MoE) and Qwen3.5 (transformers' Qwen3VLMoeVisionModel,
// Qwen3_5MoeVisionModel): patch embedding (the Conv3d as one product over each patch), the
// learned position table interpolated (bilinear, corners aligned) to each image's grid, blocks of
// LayerNorm → attention with 2D rotary positions within each image → LayerNorm → GELU MLP, the
// patch merger (merge × merge patches into one LM token), and Qwen3-VL's DeepStack mergers,
// whose outputs the decoder adds to its first layers' hidden states at the image tokens.
// Tensor-parallel like the LM (qkv and fc1 column-parallel, proj and fc2 row-parallel, each
// followed by the all-reduce); every linear is a LoRA module (the tower/connector LoRA).
// Internal to worker/models. Includes ATen.
#ifndef MOELORA_WORKER_ARCHITECTURES_VISION_TOWER_H_
#define MOELORA_WORKER_ARCHITECTURES_VISION_TOWER_H_

#include <ATen/ATen.h>

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/layers/linear.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model/causal_lm.h"

namespace moelora {

// config.json's vision_config, with the configuration class's defaults for absent keys, and the
// wrapper's image token ids.
struct VisionConfig {
  int depth = 27;
  int hidden_size = 1152;
  int num_heads = 16;
  int intermediate_size = 4304;
  int in_channels = 3;
  int patch_size = 16;
  int temporal_patch_size = 2;
  int spatial_merge_size = 2;
  int out_hidden_size = 3584;
  int num_position_embeddings = 2304;
  std::vector<int> deepstack_visual_indexes;  // Qwen3-VL: blocks whose output feeds a merger
  std::string hidden_act = "gelu_pytorch_tanh";
  double rope_theta = 10000.0;
  int64_t image_token_id = 0;

  int head_dim() const { return hidden_size / num_heads; }
  int64_t patch_dim() const {
    return int64_t{in_channels} * temporal_patch_size * patch_size * patch_size;
  }
  // nullopt when config.json has no vision_config. `deepstack`: the architecture has DeepStack
  // mergers (Qwen3-VL; its default list applies when the key is absent). `image_token_default`:
  // the wrapper's image_token_id when absent. INVALID_ARGUMENT / FAILED_PRECONDITION naming
  // `file` and the key (sizes that do not divide, an activation not implemented).
  [[nodiscard]] static absl::StatusOr<std::optional<VisionConfig>> Parse(
      const std::string& config_text, const std::string& file, bool deepstack,
      int64_t image_token_default, int64_t text_hidden_size, int64_t vocab_size);
};

// Attention within each frame, no mask: q, k, v [N, heads, head_dim], `frames` the row bounds of
// each frame; [N, heads · head_dim] in q's dtype. `tiled` (the CPU's): flash attention's
// schedule over 512 x 512 tiles with BLAS products; else ATen over query chunks (other devices).
at::Tensor FrameAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::vector<int64_t>& frames, double scale, bool tiled);

// The tower's parameters (`model.visual.…`, whole on every rank; the tower slices them).
std::vector<ParamSpec> VisionParamSpecs(const VisionConfig& v);

class VisionTower {
 public:
  // From the loaded parameters (in the compute dtype, on the model's device). `lora`: its
  // linears take adapters (--enable-tower-connector-lora); they are LoRA modules either way.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<VisionTower>> Create(
      const VisionConfig& v, const std::map<std::string, at::Tensor>& params, const ModelOptions& o,
      const SlotShape& shape, bool lora);

  // Every image's merged embeddings [tokens, out_hidden] and DeepStack features (one tensor per
  // DeepStack merger, same rows), images one after the other. `all_reduce` sums a tensor over
  // the tensor-parallel group.
  using Output = VisionEncoding;
  [[nodiscard]] absl::StatusOr<Output> Forward(
      const std::vector<VisionImage>& images,
      const std::function<absl::Status(at::Tensor&)>& all_reduce) const;

  const VisionConfig& config() const { return v_; }
  // The LoRA modules (HF paths under model.visual.).
  std::vector<LoraModule*> lora_modules() const;

 private:
  struct Block {
    at::Tensor norm1_w, norm1_b, norm2_w, norm2_b;
    std::unique_ptr<LoraLinear> qkv, proj, fc1, fc2;
  };
  struct Merger {
    bool postshuffle = false;
    at::Tensor norm_w, norm_b;
    std::unique_ptr<LoraLinear> fc1, fc2;
  };
  [[nodiscard]] absl::StatusOr<at::Tensor> RunMerger(
      const Merger& m, const at::Tensor& x, const LoraBatch& lb,
      const std::function<absl::Status(at::Tensor&)>& all_reduce) const;

  VisionConfig v_;
  ModelOptions o_;
  bool lora_ = false;
  int heads_local_ = 0;
  at::Tensor patch_w_, patch_b_, pos_embed_, inv_freq_;
  std::vector<Block> blocks_;
  Merger merger_;
  std::vector<Merger> deepstack_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_ARCHITECTURES_VISION_TOWER_H_
