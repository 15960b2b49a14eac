// The MoE block: a router, routed experts with batched multi-LoRA in either wrapper, and an
// optional shared expert (with an optional sigmoid gate, Qwen3.5); and the SwiGLU MLP of LoRA
// linears that is a shared expert or a dense layer's MLP.
//
// Experts (one LoraModule at `<layer>.mlp.experts`): this rank's shard of w13 [E, 2·I_p, H]
// ([gate ; up] per expert) and w2 [E, H, I_p]. Expert LoRA goes through one of two wrappers
// (docs/formats.md §2, §3): 2D (w1, w3, w2 per expert) or 3D (fused w13, w2). On the CPU path the
// (token, expert) assignments are sorted by (expert, slot) and run as one GEMM per expert plus
// SGMV segments per (expert, slot); on the kernel paths the whole block is one fused call
// (kernels/moe_lora.h).
#ifndef MOELORA_WORKER_LAYERS_MOE_H_
#define MOELORA_WORKER_LAYERS_MOE_H_

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/layers/linear.h"
#include "worker/layers/lora_batch.h"
#include "worker/layers/lora_module.h"
#include "worker/layers/quantized.h"

namespace moelora {

// The experts' activation of [gate ; up].
struct ExpertActivation {
  enum class Kind {
    kSwiGlu,         // silu(g) · u
    kClampedSwiGlu,  // GPT-OSS: g ≤ limit, |u| ≤ limit, (u + 1) · g · sigmoid(alpha · g)
    kSwiGluStep      // Step3.5: min(silu(g), limit) · clamp(u, -limit, limit)
  } kind = Kind::kSwiGlu;
  double alpha = 1.702, limit = 7.0;
};

class MoeExperts final : public LoraModule {
 public:
  // `wrapper`: the expert LoRA layout the slots take; `architecture` names the model in errors.
  // Expert parallelism: w13/w2 hold experts [expert_offset, expert_offset + local) of
  // `total_experts`, whole (their intermediate dim is inter_full); tokens routed elsewhere
  // contribute nothing here (the all-reduce after the block sums the ranks). Without it
  // (total_experts = 0): every expert, 1/tp of its intermediate dim.
  MoeExperts(std::string path, at::Tensor w13, at::Tensor w2, int64_t inter_full,
             AdapterFormat wrapper, std::string architecture, const SlotShape& shape,
             int64_t expert_offset = 0, int64_t total_experts = 0);

  // h [T, H], ids [T, K] int64, weights [T, K] in h's dtype: Σ_k w · expert(h) for this rank.
  [[nodiscard]] absl::StatusOr<at::Tensor> Forward(const at::Tensor& h, const at::Tensor& ids,
                                                   const at::Tensor& weights,
                                                   const LoraBatch& lb) const;
  int64_t num_experts() const { return E_total_; }
  // Optional expert biases (GPT-OSS): w13 [E_local, 2·I_p] ([gate ; up] rows, this rank's part)
  // and w2 [E_total, H] (added once over the ranks: by rank 0, or by the expert's rank with
  // expert parallelism). The CPU path only: the fused kernel has neither.
  void SetBiases(at::Tensor w13_bias, at::Tensor w2_bias, bool add_w2_bias) {
    w13_bias_ = std::move(w13_bias);
    w2_bias_ = std::move(w2_bias);
    add_w2_bias_ = add_w2_bias;
  }
  void set_activation(const ExpertActivation& a) { act_ = a; }
  // Quantized experts (the CPU path, not the fused kernel): the products read w13 [E, 2·I_p, H]
  // and w2 [E, H, I_p] from these, dequantizing tile by tile; the constructor's w13 and w2 then
  // give only the shapes (meta tensors do).
  void SetQuantized(QuantizedWeight w13, QuantizedWeight w2) {
    q13_ = std::move(w13);
    q2_ = std::move(w2);
  }
  bool quantized() const { return q13_.defined(); }
  bool expert_parallel() const { return E_total_ != E_; }

  bool takes_experts() const override { return true; }
  [[nodiscard]] absl::Status CheckExperts(const LoraAdapter& a,
                                          const MoeLayerLora& layer) const override;
  void WriteExperts(const MoeLayerLora& layer, const SlotWrite& w) override;
  int64_t ExpertBytes(const MoeLayerLora& layer, int64_t elem_bytes) const override;
  int64_t AllocatedSlotBytes() const override {
    int64_t n = 0;
    for (int k = 0; k < 3; ++k) n += ea_[k].defined() ? ea_[k].nbytes() + eb_[k].nbytes() : 0;
    return n;
  }
  int64_t ResidentSlotBytes() const override;
  bool SaveSlot(int slot, ModuleSlotImage* out) const override;
  void RestoreSlot(const ModuleSlotImage& in, const SlotWrite& w) override;
  void Reset(int slot) override;
  void SyncRanks(int slot) override;
  // The experts of `slot` whose gate and up LoRA run as one shrink (tests).
  int64_t SharedGateUpA(int slot) const;

 private:
  // Marks the experts of `slot` whose gate and up A are the same (after every write of the slot).
  void NoteSharedA(int slot);
  [[nodiscard]] absl::StatusOr<at::Tensor> CpuForward(const at::Tensor& h, const at::Tensor& ids,
                                                      const at::Tensor& weights,
                                                      const LoraBatch& lb) const;
  [[nodiscard]] absl::StatusOr<at::Tensor> FusedForward(const at::Tensor& h, const at::Tensor& ids,
                                                        const at::Tensor& weights,
                                                        const LoraBatch& lb) const;
  // --fully-sharded-loras on the CPU path: one (expert, slot) run of the sorted assignments.
  struct FsSegment {
    int64_t begin, end;
    int32_t slot;
    int64_t expert;
  };
  // Adds projection k's LoRA of `in` (sorted rows) to out[:, col : col + its B width].
  [[nodiscard]] absl::Status AddFullyShardedLora(int k, const at::Tensor& in, at::Tensor& out,
                                                 int64_t col, bool row_parallel,
                                                 const std::vector<FsSegment>& segs) const;

  at::Tensor w13_, w2_;
  QuantizedWeight q13_, q2_;
  at::Tensor w13_bias_, w2_bias_;
  bool add_w2_bias_ = false;
  ExpertActivation act_;
  int64_t E_ = 0, H_ = 0, I_ = 0, Ip_ = 0;  // E_: experts held here
  int64_t e0_ = 0, E_total_ = 0;            // the first one held, and all of them
  AdapterFormat wrapper_;
  std::string architecture_;
  SlotShape shape_;
  bool fs_ = false;  // fully sharded (plain TP, tp > 1)
  // 2D: [kW1], [kW3]: a_t [S, E, H, R], b_t [S, E, R, I_p]; 3D: [kW1] holds w13 with b_t
  // [S, E, R, 2 I_p]. [kW2]: a_t [S, E, I_p, R], b_t [S, E, R, H]. rank [S * E]. Fully
  // sharded: gate/up a_t [S, E, H, R / tp], down b_t [S, E, R, H / tp].
  mutable at::Tensor ea_[3], eb_[3];
  std::vector<int32_t> erank_[3];
  // Packed slots (the CPU path, not fully sharded): a slot holds each expert's A as [in, p] and
  // B as [p, out] one after the other from the start of its region, p = pr_[k][slot] the largest
  // rank of its experts for projection k, so an adapter of rank r touches about r / R of the
  // slot's pages (slot memory is taken as it is written: SlotZeros). Otherwise expert e's A is
  // the [in, R] block e, B the [R, out] block e.
  bool packed_ = false;
  std::vector<int32_t> pr_[3];
  // Expert e's A and B in `slot` of projection k: offsets (elements) into ea_[k] / eb_[k], and
  // A's row stride.
  int64_t AOffset(int k, int slot, int64_t e) const;
  int64_t BOffset(int k, int slot, int64_t e) const;
  int64_t AStride(int k, int slot) const { return packed_ ? pr_[k][slot] : shape_.max_rank; }
  // Views of them in the slot tensor `slot_t` (ea_[k][slot] / eb_[k][slot] or a host image of it):
  // [in, stride] and [stride, out].
  at::Tensor AView(int k, int slot, int64_t e, const at::Tensor& slot_t) const;
  at::Tensor BView(int k, int slot, int64_t e, const at::Tensor& slot_t) const;
  at::Tensor erank_t_[3];  // kernel paths
  // 2D wrapper on the CPU path, not fully sharded: per (slot, expert), 1 where gate's and up's A
  // are equal and of one rank: then one SGMV shrink feeds both expands (SgmvSegment::b2_t). A
  // 3D adapter converted to 2D shares its fused gate_up A between gate and up (docs/formats.md
  // §1.5), so this saves a fifth of its expert LoRA reads. Found by comparing the slot's bytes
  // after every write (WriteExperts, RestoreSlot, Reset), so it follows the slot whatever wrote it.
  std::vector<uint8_t> shared_a_;
};

enum class RouterKind {
  kSoftmaxTopK,  // softmax over all experts (f32), top-k, renormalised when norm_topk_prob
  kTopKSoftmax,  // GPT-OSS: logits (+ bias), top-k of the logits, softmax over those k
  // Step3.5: s = sigmoid(f32 logits); the top-k of s + bias (the bias only selects); weights
  // s of those, renormalised when norm_topk_prob.
  kSigmoidBiasTopK,
};

// kSoftmaxTopK's routing on the CPU path, by hand (MoeBlock uses it; declared for its test):
// per row of logits [T, E] (f32 or bf16), p = softmax in f32, the k largest (ties to the lower
// expert id) into idx [T, k] (int64), their p into wts [T, k] (f32), divided by their sum when
// `norm`, times `scale`.
void SoftmaxTopKCpu(const at::Tensor& logits, int k, bool norm, double scale, at::Tensor& wts,
                    at::Tensor& idx);

// down(act(gate(x)) · up(x)) of LoRA linears (column, column, row): a shared expert or a dense
// layer's MLP. `limit` > 0: Step3.5's clamp, min(silu(g), limit) · clamp(u, ±limit).
// `gate_weight` [1, H]: Qwen3.5's sigmoid gate on the output. This rank's part (the caller
// all-reduces).
struct SwiGluMlp {
  std::unique_ptr<LoraLinear> gate, up, down;
  at::Tensor gate_weight;
  double limit = 0;
  [[nodiscard]] absl::StatusOr<at::Tensor> Forward(const at::Tensor& h, const LoraBatch& lb) const;
};
using SharedExpert = SwiGluMlp;

class MoeBlock {
 public:
  // `router_bias`: added to the logits (kTopKSoftmax) or to the scores that select
  // (kSigmoidBiasTopK). `routed_scaling`: the routed experts' output is multiplied by it
  // (folded into the routing weights).
  MoeBlock(at::Tensor router, RouterKind kind, int top_k, bool norm_topk_prob,
           std::unique_ptr<MoeExperts> experts, std::unique_ptr<SharedExpert> shared = nullptr,
           at::Tensor router_bias = at::Tensor(), double routed_scaling = 1.0);
  // This rank's part of the block's output (the caller all-reduces).
  [[nodiscard]] absl::StatusOr<at::Tensor> Forward(const at::Tensor& h, const LoraBatch& lb) const;
  MoeExperts* experts() { return experts_.get(); }
  SharedExpert* shared() { return shared_.get(); }

 private:
  at::Tensor router_, router_bias_;
  RouterKind kind_;
  int top_k_;
  double routed_scaling_ = 1.0;
  bool norm_topk_prob_;
  std::unique_ptr<MoeExperts> experts_;
  std::unique_ptr<SharedExpert> shared_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_MOE_H_
