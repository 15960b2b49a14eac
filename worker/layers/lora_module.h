// What every LoRA-capable module of a model offers the slot protocol (CausalLM::SetSlot): it is
// registered under its Hugging Face module path, checks an adapter's tensors for it before any
// slot is touched, writes its TP shard into a slot, and clears it.
#ifndef MOELORA_WORKER_LAYERS_LORA_MODULE_H_
#define MOELORA_WORKER_LAYERS_LORA_MODULE_H_

#include <ATen/ATen.h>

#include <functional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "lora/adapter.h"

namespace moelora {

// A copy of `t` in host memory, contiguous (from the device on the kernel paths).
inline at::Tensor HostCopy(const at::Tensor& t) {
  return t.is_cuda() ? t.to(at::kCPU).contiguous() : t.clone(at::MemoryFormat::Contiguous);
}

// Where a module writes slot `slot` of one of its slot tensors `full` [S, ...]: `full[slot]`
// itself (CPU path) or a host f32 image of it that CausalLM uploads afterwards (kernel paths).
using SlotDst = std::function<at::Tensor(at::Tensor& full)>;

struct SlotWrite {
  int slot = 0;
  int tp_rank = 0;
  int tp_size = 1;
  SlotDst dst;
  bool interleaved_gate_up =
      false;  // the adapter's 3D gate_up B rows are g0, u0, g1, ... (GPT-OSS)
};

// One module's part of a slot, for the worker's host cache: its slot tensors' rows of that slot
// (on the host, only the columns its ranks use) and its ranks. Already converted, TP-sliced
// and scaled: restoring it is a copy.
struct ModuleSlotImage {
  std::vector<at::Tensor> tensors;  // undefined where the module has no such tensor
  std::vector<int32_t> ranks;
  int64_t bytes() const {
    int64_t n = 0;
    for (const at::Tensor& t : tensors) n += t.defined() ? t.nbytes() : 0;
    return n;
  }
};

class LoraModule {
 public:
  explicit LoraModule(std::string path) : path_(std::move(path)) {}
  virtual ~LoraModule() = default;
  LoraModule(const LoraModule&) = delete;
  LoraModule& operator=(const LoraModule&) = delete;

  // The Hugging Face module path (`model.layers.0.self_attn.q_proj`).
  const std::string& path() const { return path_; }
  // A linear module takes dense pairs; an experts module takes MoeLayerLora.
  virtual bool takes_experts() const = 0;

  // INVALID_ARGUMENT naming the file, the tensor and the shapes when `pair` does not fit.
  [[nodiscard]] virtual absl::Status CheckDense(const LoraAdapter& a, const LoraPair& pair) const;
  // INVALID_ARGUMENT / FAILED_PRECONDITION when the layer's expert LoRA does not fit the wrapper.
  [[nodiscard]] virtual absl::Status CheckExperts(const LoraAdapter& a,
                                                  const MoeLayerLora& layer) const;
  // Write this rank's shard (after a successful Check).
  virtual void WriteDense(const LoraPair& pair, const SlotWrite& w);
  virtual void WriteExperts(const MoeLayerLora& layer, const SlotWrite& w);
  // Bytes this rank holds for it, at `elem_bytes` per value.
  virtual int64_t DenseBytes(const LoraPair& pair, int64_t elem_bytes) const;
  virtual int64_t ExpertBytes(const MoeLayerLora& layer, int64_t elem_bytes) const;

  // Bytes of the slot tensors this rank allocated for the module (every slot).
  virtual int64_t AllocatedSlotBytes() const = 0;
  // The part of them in memory now (CPU: pages written since they were last given back).
  virtual int64_t ResidentSlotBytes() const = 0;

  // Copies slot `slot` out (false: the slot does not use this module); RestoreSlot writes such
  // an image into `w.slot` (cleared before) through `w.dst`.
  virtual bool SaveSlot(int slot, ModuleSlotImage* out) const = 0;
  virtual void RestoreSlot(const ModuleSlotImage& in, const SlotWrite& w) = 0;

  virtual void Reset(int slot) = 0;
  // Kernel paths: copy the host ranks of `slot` into the device rank tensors the kernels read.
  virtual void SyncRanks(int slot) = 0;

 private:
  std::string path_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_LORA_MODULE_H_
