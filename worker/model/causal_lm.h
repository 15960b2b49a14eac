// The causal-LM interface every architecture implements, for one tensor-parallel rank, and the
// per-sequence state it keeps. Includes ATen: only for translation units that use libtorch.
//
// One forward pass serves tokens of many sequences and adapters: every token carries its LoRA
// slot (or none). A model is built from layers (worker/layers/); each LoRA-capable module
// registers itself under its Hugging Face module path (`model.layers.3.self_attn.q_proj`,
// `model.layers.3.mlp.experts`), and loading an adapter into a slot is a lookup of each of the
// adapter's modules there (SetSlot). Slots hold A and B transposed with the scaling folded in:
// on the CPU path bf16 for a bf16 model and f32 otherwise, the compute dtype on the kernel paths.
//
// Thread-safety: Forward, SetSlot and ResetSlot must not run concurrently on the same slot;
// Forward never reads a slot that no token of its batch carries.
#ifndef MOELORA_WORKER_MODEL_CAUSAL_LM_H_
#define MOELORA_WORKER_MODEL_CAUSAL_LM_H_

#include <ATen/ATen.h>

#include <array>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lora/adapter.h"
#include "schema/model_config.h"
#include "worker/comm/communicator.h"
#include "worker/layers/forward_batch.h"
#include "worker/layers/kv_cache.h"
#include "worker/layers/lora_module.h"

namespace moelora {

class PinnedUploader;  // kernels/device.h
struct VisionConfig;   // worker/architectures/vision_tower.h

// An image for the vision tower: its pixel_values rows (vision/image_processor.h), patch grid,
// and the LoRA slot of its request (-1: none).
struct VisionImage {
  at::Tensor pixel_values;  // f32 [t·h·w, patch_dim] on the host
  int grid_t = 1, grid_h = 0, grid_w = 0;
  int32_t slot = -1;
};
// The tower's output for a list of images, one after the other: merged embeddings
// [tokens, hidden] and the DeepStack features (one tensor per merger, same rows).
struct VisionEncoding {
  at::Tensor embeds;
  std::vector<at::Tensor> deepstack;
};

struct ModelContext;  // worker/model/model_context.h

// What every architecture's model shares: config, options, the TP communicator, the LoRA
// module registry and the slot protocol. An architecture (worker/architectures/) subclasses it and
// implements Forward.
class CausalLM {
 public:
  virtual ~CausalLM();

  // Logits (f32, on the host) [rows, vocab]: per sequence in order, every new token's row
  // (all_logits) or the last one. Advances each sequence's state by its new tokens.
  [[nodiscard]] virtual absl::StatusOr<at::Tensor> Forward(const ForwardBatch& batch) = 0;

  // The MTP heads (a model built with ModelOptions::mtp): how many there are (0: none); whether
  // they form a chain; the target's hidden states [tokens, hidden] (compute dtype, on the
  // model's device) of every new token of the last Forward, as the heads read them; and head
  // `head` over `b`.
  //
  // A reused head (Qwen3.5: one head, `chained` false) drafts d1 at the target's last position
  // from the target's hidden state after the final norm, then d2, d3, ... at the positions after
  // it, each from its own previous output after its norm. Chained heads (Step3.5: head j for
  // draft j + 1) all sit at the target's last position: head j at position p reads token
  // p + 1 + j and head j - 1's output at p before its norm (head 0: the target's hidden state
  // before the final norm), and predicts token p + 2 + j.
  //
  // In `b` each sequence's tokens are the head's inputs at its next positions (position
  // state->mtp_len[head] + offset) and `hidden` [tokens, hidden] holds the hidden input at each
  // (row i with token i). Writes the head's keys and values at those positions (its own KV
  // layer; the blocks are the sequence's), advances mtp_len[head], and returns the draft logits
  // (f32, host) of the rows `b` asks for, as Forward does. *out (when given) gets the hidden
  // input of the next draft step: those rows' output (after the head's norm for a reused head,
  // before it for chained heads), or every token's row when `every_row`. `b.slots` adapt the
  // head's own modules (IsMtpModule; -1: unadapted).
  virtual int mtp_heads() const { return 0; }
  bool has_mtp() const { return mtp_heads() > 0; }
  virtual bool mtp_chained() const { return false; }
  virtual at::Tensor last_hidden() const { return at::Tensor(); }
  [[nodiscard]] virtual absl::StatusOr<at::Tensor> ForwardMtp(const ForwardBatch& b,
                                                              const at::Tensor& hidden,
                                                              at::Tensor* out = nullptr,
                                                              int head = 0, bool every_row = false);
  // Whether an adapter's module path names a module of an MTP head: under `mtp.` (Qwen3.5), or
  // in a layer after num_hidden_layers where the checkpoint appends its MTP layers (Step3.5).
  bool IsMtpModule(const std::string& module) const;

  // After a Forward that gave `st` `count` new tokens with keep_states, keeps the first `keep`
  // of them (1 <= keep <= count): len goes back by count - keep, each recurrent layer's state
  // to what it was after token keep - 1, the blocks past the new length are given back, and
  // every mtp_len is held below len. The steps kept for this are dropped either way.
  [[nodiscard]] absl::Status RollBack(SeqState& st, int64_t count, int64_t keep);

  // The vision tower (models built with one: Qwen3-VL-MoE, Qwen3.5 with a vision_config);
  // nullptr otherwise. EncodeImages runs it over `images` (each with its request's LoRA slot).
  virtual const VisionConfig* vision() const { return nullptr; }
  [[nodiscard]] virtual absl::StatusOr<VisionEncoding> EncodeImages(
      const std::vector<VisionImage>& images);

  // A fresh per-sequence state (nothing held; the first forward reserves it blocks and a zeroed
  // recurrent state). Creates a KV cache with the default options when InitKvCache was not
  // called.
  SeqState NewState();

  // The KV cache: this rank's attention pools and recurrent-state pool
  // (worker/layers/kv_cache.h). The engine calls this once, after the load; FAILED_PRECONDITION
  // when a cache exists.
  [[nodiscard]] absl::Status InitKvCache(const KvCacheOptions& o);
  KvCache* kv_cache() { return kv_.get(); }
  // This rank's attention layers and their K/V shapes.
  virtual std::vector<KvLayerShape> KvShapes() const { return {}; }
  // This rank's recurrent layers (Gated DeltaNet) and their state shapes.
  virtual std::vector<StateLayerShape> StateShapes() const { return {}; }
  bool has_recurrent_layers() const { return !StateShapes().empty(); }

  // Copies `adapter` (TP-sliced) into `slot`, replacing what was there (on kCuda: a host image of
  // the slot, uploaded through pinned staging buffers). Checks first and changes nothing on
  // error: INVALID_ARGUMENT for a module the model does not have or does not wrap (naming the
  // module and the ones it does), FAILED_PRECONDITION for an expert layout the MoE wrapper does
  // not take, RESOURCE_EXHAUSTED for a rank above max_lora_rank. Modules under `mtp.` are left
  // out when the model was built without its MTP head.
  [[nodiscard]] absl::Status SetSlot(int slot, const LoraAdapter& adapter);
  void ResetSlot(int slot);
  // A slot's contents in host memory (the worker's host cache): what SetSlot wrote, converted,
  // TP-sliced and scaled, trimmed to the ranks in use. RestoreSlot writes one back into `slot`
  // (any slot) as SetSlot would, without reading or converting anything.
  struct SlotImage {
    std::vector<std::pair<LoraModule*, ModuleSlotImage>> modules;
    int64_t bytes = 0;
  };
  SlotImage SaveSlot(int slot) const;
  [[nodiscard]] absl::Status RestoreSlot(int slot, const SlotImage& image);
  // Bytes of LoRA weights a slot holds on this rank for `adapter` (for reporting).
  int64_t SlotBytes(const LoraAdapter& adapter) const;
  // Bytes of every slot tensor this rank allocated: of the experts modules (`experts`) or of
  // the rest.
  int64_t AllocatedSlotBytes(bool experts) const;
  // What of them is in memory now (CPU slots take memory as adapters are written into them).
  int64_t ResidentSlotBytes() const;

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  // The MoE wrapper in use: k3D for 3D-native models without mixed mode, else k2D.
  AdapterFormat wrapper_format() const { return wrapper_; }
  AdapterFormat native_format() const { return native_; }
  const std::vector<std::string>& skipped_tensors() const { return skipped_; }
  // Hugging Face module paths of every LoRA-capable module, in registration order.
  std::vector<std::string> lora_modules() const;
  at::Device device() const;
  bool kernel_path() const { return options_.kernels != LoraKernels::kCpuSgmv; }

 protected:
  CausalLM() = default;
  // Registers `m` under its module path, and under `aliases` (other names adapters use for the
  // same module, e.g. transformers' names next to the hub checkpoint's); the model keeps
  // ownership elsewhere.
  void RegisterLora(LoraModule* m, const std::vector<std::string>& aliases = {});
  // Sums `t` over the tensor-parallel group (in place; f32 on the wire).
  [[nodiscard]] absl::Status AllReduce(at::Tensor& t);
  // What every factory does once its weights are loaded: the shared fields from `ctx` and `c`
  // (the config as the architecture completed it), the weights moved to the device on the
  // kernel paths, the uploader on kCuda.
  [[nodiscard]] absl::Status Adopt(const ModelContext& ctx, const ModelConfig& c,
                                   std::vector<std::string> skipped,
                                   std::map<std::string, at::Tensor>& params);

  ModelConfig config_;
  ModelOptions options_;
  Communicator* comm_ = nullptr;
  AdapterFormat wrapper_ = AdapterFormat::k2D;
  AdapterFormat native_ = AdapterFormat::k2D;
  std::vector<std::string> skipped_;
  int num_layers_ = 0;  // layer indices the KV cache holds: the decoder's (and the MTP heads')
  bool mtp_layers_follow_ = false;  // the checkpoint's MTP layers follow the decoder's
  std::unique_ptr<KvCache> kv_;

 private:
  // Kernel paths: uploads SetSlot's host images (keyed by the full slot tensor) and the ranks.
  [[nodiscard]] absl::Status UploadSlot(int slot, std::map<at::Tensor*, at::Tensor>& staged);
  // The SlotWrite for `slot`: writes go to the slot (CPU path) or to f32 host images collected
  // in `staged` (kernel paths).
  SlotWrite MakeSlotWrite(int slot, std::map<at::Tensor*, at::Tensor>* staged);
  // After the writes: uploads `staged` on the kernel paths (the slot is cleared again if that
  // fails); nothing on the CPU path.
  [[nodiscard]] absl::Status FinishSlotWrite(int slot, std::map<at::Tensor*, at::Tensor>& staged);
  LoraModule* FindLora(const std::string& module) const;

  std::vector<LoraModule*> lora_order_;
  std::map<std::string, LoraModule*> lora_by_name_;
  std::unique_ptr<PinnedUploader> uploader_;  // kCuda: adapter uploads
  std::mutex upload_mu_;                      // guards uploader_
};

// Loads `dir` through its architecture's registry entry (worker/model/registry.h): the config,
// the checks every model shares, then the architecture's factory. `comm` must outlive the model.
// With kCuda, the weights are moved to the device after loading; FAILED_PRECONDITION when this
// libtorch has no CUDA or no device answers. UNIMPLEMENTED for an architecture whose weights
// can be named but that has no forward pass; FAILED_PRECONDITION naming a config key that
// changes the math and is not implemented.
[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> LoadCausalLM(const std::string& dir,
                                                                     const ModelOptions& options,
                                                                     Communicator* comm);

}  // namespace moelora

#endif  // MOELORA_WORKER_MODEL_CAUSAL_LM_H_
