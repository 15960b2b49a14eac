// The MoE transformer (Qwen3-MoE and the Qwen3-VL-MoE text path) with batched multi-LoRA, for
// one tensor-parallel rank. Includes ATen: only for translation units that use libtorch.
//
// One forward pass serves tokens of many sequences and adapters: every token carries its LoRA
// slot (or none). LoRA applies to q/k/v/o_proj and to the experts, through one of two MoE
// wrappers (FORMATS.md §1.3, §1.4): 2D (w1, w3, w2 per expert) or 3D (fused w13, w2). Slots hold
// A transposed and B transposed with the scaling folded in, in f32 (kernels/sgmv.h).
//
// Tensor parallelism (DESIGN.md): attention heads and the expert intermediate dim are sharded;
// o_proj and the MoE block end in an all-reduce. LoRA of column-parallel layers (q/k/v, w1/w3)
// keeps A whole and shards B; row-parallel layers (o, w2) shard A and keep B whole.
//
// Thread-safety: Forward, SetSlot and ResetSlot must not run concurrently on the same slot;
// Forward never reads a slot that no token of its batch carries.
#ifndef MOELORA_WORKER_MODEL_H_
#define MOELORA_WORKER_MODEL_H_

#include <ATen/ATen.h>

#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lora/adapter.h"
#include "worker/comm/communicator.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model_config.h"

namespace moelora {

class PinnedUploader;  // kernels/device.h

// How LoRA (and, off the CPU path, the whole MoE block) is computed.
enum class LoraKernels {
  kCpuSgmv,   // CPU: ATen GEMMs per expert + the SGMV kernel on f32 slots (kernels/sgmv.h)
  kCpuTwins,  // CPU: the CPU twins of the CUDA kernels (kernels/bgmv.h, moe_lora.h) on slots in
              // the compute dtype: the device path's code, testable without a device
  kCuda,      // GPU: the CUDA kernels, weights and slots in device memory
};

struct ModelOptions {
  LoraKernels kernels = LoraKernels::kCpuSgmv;
  int cuda_device = 0;  // with kCuda
  int tp_rank = 0;
  int tp_size = 1;
  at::ScalarType dtype = at::kFloat;
  int max_loras = 4;
  int max_lora_rank = 16;
  bool mixed_moe_lora_format = false;  // every MoE layer uses the 2D wrapper
};

// One sequence's KV cache on this rank: per layer [capacity, kv_heads_local, head_dim].
struct SeqCache {
  std::vector<at::Tensor> k, v;
  int64_t len = 0;
  int64_t capacity = 0;
};

struct ForwardBatch {
  std::vector<int64_t> tokens;  // all new tokens, sequence after sequence
  std::vector<int32_t> slots;   // per token: LoRA slot, -1 = base model
  struct Seq {
    SeqCache* cache = nullptr;
    int64_t begin = 0;        // first token in `tokens`
    int64_t count = 0;        // new tokens (prompt at prefill, 1 at decode)
    bool all_logits = false;  // logits for every new token, else only the last
  };
  std::vector<Seq> seqs;
};

// Parameter specs (engine names, full shapes, TP split) of the Qwen3-MoE transformer.
std::vector<ParamSpec> Qwen3MoeParamSpecs(const ModelConfig& c, bool lora_wrapped,
                                          bool with_lm_head);

class MoeModel {
 public:
  // Loads `dir` through the architecture's loader. `comm` must outlive the model.
  // With kCuda, the weights are moved to the device after loading; FAILED_PRECONDITION when
  // this libtorch has no CUDA or no device answers.
  static absl::StatusOr<std::unique_ptr<MoeModel>> Load(const std::string& dir,
                                                        const ModelOptions& options,
                                                        Communicator* comm);
  ~MoeModel();

  // Logits (f32, on the host) [rows, vocab]: per sequence in order, every new token's row
  // (all_logits) or the last one. Appends the new tokens' K/V to each sequence's cache.
  absl::StatusOr<at::Tensor> Forward(const ForwardBatch& batch);

  SeqCache NewCache() const;

  // Copies `adapter` (TP-sliced) into `slot`, replacing what was there (on kCuda: a host image of
  // the slot, uploaded through pinned staging buffers). Checks first and changes nothing on
  // error: INVALID_ARGUMENT for a module the engine does not wrap, FAILED_PRECONDITION
  // for an expert layout the MoE wrapper does not take, RESOURCE_EXHAUSTED for a rank above
  // max_lora_rank.
  absl::Status SetSlot(int slot, const LoraAdapter& adapter);
  void ResetSlot(int slot);
  // Bytes of LoRA weights a slot holds on this rank (for reporting).
  int64_t SlotBytes(const LoraAdapter& adapter) const;

  const ModelConfig& config() const { return config_; }
  const ModelOptions& options() const { return options_; }
  // The MoE wrapper in use: k3D for 3D-native models without mixed mode, else k2D.
  AdapterFormat wrapper_format() const { return wrapper_; }
  AdapterFormat native_format() const { return native_; }
  const std::vector<std::string>& skipped_tensors() const { return skipped_; }

 private:
  struct Layer;
  MoeModel() = default;
  // `slots`: int32 [T] on the model's device for the kernel paths when any token carries an
  // adapter; undefined otherwise.
  absl::StatusOr<at::Tensor> Attention(Layer& L, int layer_idx, const at::Tensor& h,
                                       const ForwardBatch& b, const at::Tensor& cos,
                                       const at::Tensor& sin, const at::Tensor& slots);
  absl::StatusOr<at::Tensor> Moe(Layer& L, const at::Tensor& h, const ForwardBatch& b,
                                 const at::Tensor& slots);
  // The kernel paths (kCpuTwins, kCuda): dense LoRA into y, and the fused MoE block.
  absl::Status AddDenseLora(Layer& L, int k, const at::Tensor& x, at::Tensor& y,
                            const at::Tensor& slots);
  absl::StatusOr<at::Tensor> FusedMoe(Layer& L, const at::Tensor& h, const at::Tensor& slots);
  absl::Status AllReduce(at::Tensor& t);
  bool kernel_path() const { return options_.kernels != LoraKernels::kCpuSgmv; }
  at::Device device() const;
  // Copies host `src` into device tensor `dst` (same shape; converted to dst's dtype).
  absl::Status Upload(at::Tensor& dst, const at::Tensor& src);
  // Kernel paths: uploads SetSlot's host images (keyed by the full slot tensor) and the ranks.
  absl::Status UploadSlot(int slot, std::map<at::Tensor*, at::Tensor>& staged);

  ModelConfig config_;
  ModelOptions options_;
  Communicator* comm_ = nullptr;
  AdapterFormat wrapper_ = AdapterFormat::k2D;
  AdapterFormat native_ = AdapterFormat::k2D;
  std::vector<std::string> skipped_;
  at::Tensor embed_, final_norm_, lm_head_, inv_freq_;
  std::vector<std::unique_ptr<Layer>> layers_;
  std::unique_ptr<PinnedUploader> uploader_;   // kCuda: adapter uploads
  std::mutex upload_mu_;                       // guards uploader_
  int64_t hq_ = 0, hkv_ = 0, d_ = 0, ip_ = 0;  // local heads, head dim, local I
};

}  // namespace moelora

#endif  // MOELORA_WORKER_MODEL_H_
