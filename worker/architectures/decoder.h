// The one decoder stack the models (worker/architectures/*.cc) compose: DecoderModel runs every
// layer as mixer (attention or Gated DeltaNet) and FFN (MoE block or dense MLP), each after its
// norm and followed by the TP all-reduce and the residual add; a model file only builds its layers.
// Also the start and end of a forward step, the embedding / final norm / LM head, and the
// parameter specs and modules of the parts every architecture has (attention projections,
// routed experts). Internal to worker/models. Includes ATen.
#ifndef MOELORA_WORKER_ARCHITECTURES_DECODER_H_
#define MOELORA_WORKER_ARCHITECTURES_DECODER_H_

#include <ATen/ATen.h>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"
#include "worker/architectures/vision_tower.h"
#include "worker/layers/attention.h"
#include "worker/layers/gated_delta_net.h"
#include "worker/layers/moe.h"
#include "worker/layers/norm.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model/causal_lm.h"
#include "worker/model/model_context.h"

namespace moelora {

// The step's inputs: the batch checked, this thread's CUDA device set (the raw kernel launches
// use it), each token's position (its sequence's length so far + its offset) and the token ids
// on `device`.
struct StepInputs {
  std::vector<int64_t> positions;
  at::Tensor tokens;
};
// The vision config of a multimodal checkpoint (VisionConfig::Parse of config.json; nullopt for
// a text-only one). `deepstack`: the architecture has DeepStack mergers.
[[nodiscard]] absl::StatusOr<std::optional<VisionConfig>> ReadVisionConfig(
    const ModelContext& ctx, const ModelConfig& c, bool deepstack, int64_t image_token_default);
// Sliding-window blocks no later query sees go back first: queries of the target at its length
// or later, and of the first `mtp_heads` MTP heads at their own positions (SeqState::mtp_len).
[[nodiscard]] absl::StatusOr<StepInputs> BeginStep(const ForwardBatch& b, const ModelOptions& o,
                                                   const at::Device& device, int mtp_heads = 0);

// A factory's checkpoint load: INVALID_ARGUMENT unless lm_head.weight is there or tied to the
// embedding; then this rank's shard of `specs(has_lm_head)`.
struct ModelWeights {
  LoadedWeights weights;
  bool has_lm_head = false;
};
[[nodiscard]] absl::StatusOr<ModelWeights> LoadModelWeights(
    const ModelContext& ctx, const ModelConfig& c,
    const std::function<std::vector<ParamSpec>(bool has_lm_head)>& specs);

// The embedding and the output end of a model.
struct LmEnds {
  at::Tensor embed, final_norm, lm_head;
  // From the loaded parameters; lm_head is the embedding when the checkpoint ties them.
  static LmEnds From(const std::map<std::string, at::Tensor>& params, bool has_lm_head);
  // The step's end: every sequence's state advanced by its new tokens; the rows whose logits
  // are asked for through the final norm and the LM head, f32 on the host (*hidden, when given,
  // gets every new token's row, after the final norm or, with `hidden_pre_norm`, before it).
  at::Tensor Finish(const ForwardBatch& b, const at::Tensor& x, double eps, NormKind kind,
                    at::Tensor* hidden = nullptr, bool hidden_pre_norm = false) const;
};

// One decoder layer: exactly one mixer and one FFN.
struct DecoderLayer {
  at::Tensor in_norm, post_norm;
  std::unique_ptr<Attention> attn;     // attention layers
  std::unique_ptr<GatedDeltaNet> gdn;  // linear-attention (Gated DeltaNet) layers
  size_t rope = 0;                     // the attention's RoPE: an index into the model's rotaries
  std::unique_ptr<MoeBlock> moe;       // MoE layers
  std::unique_ptr<SwiGluMlp> mlp;      // dense layers
};

// A multi-token-prediction head (Qwen3.5's `mtp.*`, one of Step3.5's layers after
// num_hidden_layers; docs/models.md): the normed embedding of its input token and the normed
// hidden input, concatenated (embedding first) through fc (Step3.5: eh_proj), one decoder layer
// (its keys and values in KV layer `kv_layer`), the head's norm, then its LM head.
struct MtpHead {
  at::Tensor fc;  // [hidden, 2 · hidden], whole on every rank
  at::Tensor norm_embed, norm_hidden, norm;
  at::Tensor lm_head;  // its own (Step3.5's shared_head.output); undefined: the model's
  DecoderLayer layer;
  int kv_layer = 0;
};

// The decoder loop every architecture runs. A model's factory (a static member of its subclass,
// for CausalLM's protected setup) fills ends_, rotaries_, layers_ and norm_, and registers the
// layers' LoRA modules.
class DecoderModel : public CausalLM {
 public:
  [[nodiscard]] absl::StatusOr<at::Tensor> Forward(const ForwardBatch& b) final;
  std::vector<KvLayerShape> KvShapes() const final;
  std::vector<StateLayerShape> StateShapes() const final;
  const VisionConfig* vision() const final { return vision_ ? &vision_->config() : nullptr; }
  [[nodiscard]] absl::StatusOr<VisionEncoding> EncodeImages(
      const std::vector<VisionImage>& images) final;
  int mtp_heads() const final { return static_cast<int>(mtp_.size()); }
  bool mtp_chained() const final { return mtp_chained_; }
  at::Tensor last_hidden() const final { return last_hidden_; }
  [[nodiscard]] absl::StatusOr<at::Tensor> ForwardMtp(const ForwardBatch& b,
                                                      const at::Tensor& hidden, at::Tensor* out,
                                                      int head, bool every_row) final;

 protected:
  // One decoder layer over the stream (mixer, all-reduce, residual; FFN, all-reduce, residual).
  [[nodiscard]] absl::Status RunLayer(DecoderLayer& L, int index, ResidualStream& x,
                                      const ForwardBatch& b, const std::vector<Rotary::Table>& t,
                                      const LoraBatch& lb);
  // Registers a layer's LoRA modules under their own paths: the mixer's projections (attention:
  // q_down, q, k, v, o, g where present; Gated DeltaNet: in_qkv, in_z, in_b, in_a, out), the
  // dense MLP or the shared expert (gate, up, down), then the routed experts.
  void RegisterLayerLora(DecoderLayer& L);
  // The factory's last step for a multimodal checkpoint: the tower from the loaded parameters
  // (after Adopt), its linears registered as LoRA modules when --enable-tower-connector-lora.
  [[nodiscard]] absl::Status BuildVision(const VisionConfig& v,
                                         const std::map<std::string, at::Tensor>& params,
                                         const ModelContext& ctx);
  std::unique_ptr<VisionTower> vision_;

  LmEnds ends_;
  std::vector<Rotary> rotaries_;  // one per distinct RoPE of the layers
  std::vector<DecoderLayer> layers_;
  NormKind norm_ = NormKind::kPlain;           // every norm of the stack, the final one included
  std::vector<std::unique_ptr<MtpHead>> mtp_;  // ModelOptions::mtp
  bool mtp_chained_ = false;  // the heads form a chain (CausalLM::ForwardMtp), else one reused
  at::Tensor last_hidden_;    // with mtp_: the last Forward's rows, as the first head reads them
};

// Specs of a layer's attention projections (`<layer>self_attn.{q,k,v,o}_proj`, q with
// `q_rows` rows) and, when `qk_norm`, its q/k norms.
void AddAttentionSpecs(std::vector<ParamSpec>& s, const std::string& layer_prefix,
                       const ModelConfig& c, int64_t q_rows, bool qk_norm, bool lora_wrapped);
// Specs of a layer's routed experts (w13 / w2 of the module at `experts`, e.g.
// `model.layers.3.mlp.experts`).
void AddExpertSpecs(std::vector<ParamSpec>& s, const std::string& experts, const ModelConfig& c,
                    bool lora_wrapped);
// Specs of a SwiGLU MLP of LoRA linears at `mlp` (`<mlp>{gate,up,down}_proj`, e.g.
// `model.layers.0.mlp.`): gate/up column-parallel, down row-parallel.
void AddSwiGluSpecs(std::vector<ParamSpec>& s, const std::string& mlp, int64_t hidden,
                    int64_t inter);
// The MLP itself (`limit` > 0: Step3.5's clamp).
[[nodiscard]] absl::StatusOr<std::unique_ptr<SwiGluMlp>> MakeSwiGluMlp(
    const std::map<std::string, at::Tensor>& params, const std::string& mlp, int64_t hidden,
    int64_t inter, const SlotShape& shape, double limit = 0);
// A layer's attention (`<layer>self_attn.`): its q, k, v and o projections as LoRA linears
// over `.base_layer.weight` (with `.bias` when config.json's attention_bias), q of `q_rows` rows;
// `spec` starts from this rank's heads and KV heads, the head dim and the RMS eps, for the
// architecture to complete; `qk_norm`: the q_norm / k_norm weights; `sinks`: GPT-OSS's.
struct AttentionParts {
  std::unique_ptr<LoraLinear> q, k, v, o;
  AttentionSpec spec;
};
[[nodiscard]] absl::StatusOr<AttentionParts> MakeAttentionParts(
    const std::map<std::string, at::Tensor>& params, const std::string& layer_prefix,
    const ModelConfig& c, int tp, int64_t q_rows, const SlotShape& shape);
std::unique_ptr<Attention> MakeAttention(AttentionParts parts,
                                         const std::map<std::string, at::Tensor>& params,
                                         const std::string& layer_prefix, bool qk_norm,
                                         bool sinks = false);
// The routed experts at `experts` as one LoRA module, with this rank's experts under expert
// parallelism; kept quantized where the checkpoint stores them so (the CPU path only:
// FAILED_PRECONDITION on the kernel paths).
[[nodiscard]] absl::StatusOr<std::unique_ptr<MoeExperts>> MakeExperts(
    const std::string& experts, const std::map<std::string, at::Tensor>& params,
    const ModelConfig& c, const ModelOptions& o, AdapterFormat wrapper, const SlotShape& shape);

// What an architecture's layer builder reads (the config, the options, the loaded parameters,
// the LoRA slot shape, the MoE wrapper layout), and a LoRA linear over a parameter's
// `.base_layer.weight` without bias.
class LayerBuilder {
 public:
  LayerBuilder(const ModelConfig& c, const ModelOptions& o, std::map<std::string, at::Tensor>& P,
               const SlotShape& shape, AdapterFormat wrapper)
      : c_(c), o_(o), P_(P), shape_(shape), wrapper_(wrapper) {}

 protected:
  absl::StatusOr<std::unique_ptr<LoraLinear>> Linear(const std::string& path, TpMode mode,
                                                     int64_t in, std::vector<int64_t> out) const {
    return LoraLinear::Create(path, P_.at(path + ".base_layer.weight"), at::Tensor(), mode, in,
                              std::move(out), shape_,
                              QuantizedParam(P_, path + ".base_layer.weight"));
  }

  const ModelConfig& c_;
  const ModelOptions& o_;
  std::map<std::string, at::Tensor>& P_;
  const SlotShape shape_;
  const AdapterFormat wrapper_;
};

// A factory's errors about `file` (config.json): INVALID_ARGUMENT for a value that cannot be,
// FAILED_PRECONDITION for a feature this server does not implement.
template <typename... Parts>
absl::Status ConfigInvalid(const std::string& file, const Parts&... parts) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", parts...));
}
template <typename... Parts>
absl::Status ConfigRefused(const std::string& file, const Parts&... parts) {
  return absl::FailedPreconditionError(absl::StrCat(file, ": ", parts...));
}

// Which of `n` layers are MoE by config.json's `moe_layers_enum` (Step3, Step3.5: a
// comma-separated string or a list of layer indices). Absent: FAILED_PRECONDITION when
// `required`, else layers 1..n-1 (vLLM's fallback for Step3).
[[nodiscard]] absl::StatusOr<std::vector<bool>> MoeLayersEnum(const std::string& config_text, int n,
                                                              const std::string& file,
                                                              bool required);

// config.json's text with the class defaults filled in (schema/config_defaults.h), read again by
// factories that need keys ModelConfig does not keep.
[[nodiscard]] absl::StatusOr<std::string> ReadConfigText(const std::string& model_dir);

}  // namespace moelora

#endif  // MOELORA_WORKER_ARCHITECTURES_DECODER_H_
