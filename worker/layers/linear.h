// A linear layer with batched multi-LoRA, column- or row-parallel: y = x·Wᵀ (+ b) plus, for
// each token, the LoRA of its slot (SGMV segments on the CPU path, the BGMV kernel on the
// kernel paths). Its slots hold A transposed [S, in_local, R] and B transposed
// [S, R, out_local] with the scaling folded in; which part of a pair a rank keeps comes from
// lora/tp_slice.h.
#ifndef MOELORA_WORKER_LAYERS_LINEAR_H_
#define MOELORA_WORKER_LAYERS_LINEAR_H_

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "lora/tp_slice.h"
#include "worker/comm/communicator.h"
#include "worker/layers/lora_batch.h"
#include "worker/layers/lora_module.h"
#include "worker/layers/quantized.h"

namespace moelora {

// What every LoRA slot tensor of a model is made of.
struct SlotShape {
  int num_slots = 0;               // S
  int max_rank = 0;                // R
  at::TensorOptions slot_options;  // CPU path: CpuSlotDType; else the compute dtype, on the device
  at::TensorOptions rank_options;  // int32 on the device (kernel paths)
  LoraKernels kernels = LoraKernels::kCpuSgmv;
  int tp_rank = 0;
  int tp_size = 1;
  // --fully-sharded-loras (vLLM's meaning): column-parallel layers also shard lora_A (along the
  // rank dim: a rank holds R/tp of its columns, the rank-sized intermediate is all-gathered),
  // row-parallel ones lora_B (along the output dim: each rank adds its columns of the LoRA
  // output; the layer's all-reduce completes it). One extra collective per LoRA layer per step.
  bool fully_sharded = false;
  Communicator* comm = nullptr;  // for the extra collective
  static SlotShape For(const ModelOptions& o, const at::Device& device,
                       Communicator* comm = nullptr);
};

class LoraLinear final : public LoraModule {
 public:
  // `weight`: this rank's shard [out_local, in_local], already in the compute dtype and on the
  // model's device; `bias` (optional) this rank's part for column-parallel layers, the whole
  // bias for row-parallel ones (added on rank 0 only: the all-reduce sums the ranks).
  // `out_sections`: the full output dim's sections (one entry for a plain layer). `quantized`
  // (defined where the checkpoint stores the weight quantized): the base product reads it,
  // dequantizing tile by tile (the CPU path only), and `weight` is ignored.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<LoraLinear>> Create(
      std::string path, at::Tensor weight, at::Tensor bias, TpMode mode, int64_t in_full,
      std::vector<int64_t> out_sections, const SlotShape& shape,
      QuantizedWeight quantized = QuantizedWeight());

  [[nodiscard]] absl::StatusOr<at::Tensor> Forward(const at::Tensor& x, const LoraBatch& lb) const;
  // Forward of each layer on the same x, their base products in one MatmulWtEach call.
  [[nodiscard]] static absl::StatusOr<std::vector<at::Tensor>> ForwardEach(
      const std::vector<const LoraLinear*>& layers, const at::Tensor& x, const LoraBatch& lb);
  const at::Tensor& weight() const { return w_; }
  bool quantized() const { return q_.defined(); }
  int64_t out_local() const { return shard_.out_local; }

  bool takes_experts() const override { return false; }
  [[nodiscard]] absl::Status CheckDense(const LoraAdapter& a, const LoraPair& pair) const override;
  void WriteDense(const LoraPair& pair, const SlotWrite& w) override;
  int64_t DenseBytes(const LoraPair& pair, int64_t elem_bytes) const override;
  int64_t AllocatedSlotBytes() const override { return la_.nbytes() + lb_.nbytes(); }
  int64_t ResidentSlotBytes() const override;
  bool SaveSlot(int slot, ModuleSlotImage* out) const override;
  void RestoreSlot(const ModuleSlotImage& in, const SlotWrite& w) override;
  void Reset(int slot) override;
  void SyncRanks(int slot) override;

 private:
  using LoraModule::LoraModule;
  at::Tensor w_, bias_;
  QuantizedWeight q_;
  TpMode mode_ = TpMode::kReplicated;
  int64_t in_full_ = 0, out_full_ = 0;
  LoraShard shard_;
  SlotShape shape_;
  // Forward after the base product y = x · wᵀ: the bias and the adapters' deltas.
  [[nodiscard]] absl::StatusOr<at::Tensor> Finish(const at::Tensor& x, at::Tensor y,
                                                  const LoraBatch& lb) const;
  // The CPU path of --fully-sharded-loras: ATen GEMMs per slot run around the collective.
  [[nodiscard]] absl::Status AddFullyShardedLora(const at::Tensor& x, at::Tensor& y,
                                                 const LoraBatch& lb) const;

  bool fs_ = false;                 // fully sharded (and tp > 1)
  std::vector<IndexRange> fs_out_;  // row-parallel FS: this rank's output columns
  // [S, in_local, R] (fully sharded column-parallel: R / tp), [S, R, out_local] (fully sharded
  // row-parallel: out_full / tp)
  mutable at::Tensor la_, lb_;
  // The CPU path, not fully sharded: a slot's Aᵀ is packed [in_local, r] from the start of its
  // row (B's first r rows are at the start already), so an adapter takes its rank's share of the
  // slot's pages. PackedA: that view of la_[slot] (or of a host image of it).
  bool packed_ = false;
  at::Tensor PackedA(const at::Tensor& slot_t, int64_t r) const {
    return slot_t.view(-1).narrow(0, 0, slot_t.size(0) * r).view({slot_t.size(0), r});
  }
  std::vector<int32_t> rank_;  // [S]
  at::Tensor rank_t_;          // kernel paths: [S] int32 on the device
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_LINEAR_H_
