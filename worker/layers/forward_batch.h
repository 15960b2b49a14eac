// What a forward pass reads and the layers share: how LoRA is computed (LoraKernels), the
// model's options, a sequence's state on this rank (SeqState: its KV blocks, recurrent states
// and MTP heads' positions) and the batch of one forward (ForwardBatch). Includes ATen.
#ifndef MOELORA_WORKER_LAYERS_FORWARD_BATCH_H_
#define MOELORA_WORKER_LAYERS_FORWARD_BATCH_H_

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <map>
#include <utility>
#include <vector>

#include "schema/model_info.h"
#include "worker/layers/kv_cache.h"

namespace moelora {

// How LoRA (and, off the CPU path, the whole MoE block) is computed.
enum class LoraKernels {
  kCpuSgmv,   // CPU: GEMMs per expert + the SGMV kernel on f32/bf16 slots (kernels/sgmv.h)
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
  // Expert parallelism: rank r holds experts [r·E/tp, (r+1)·E/tp) whole, and their LoRA only.
  bool expert_parallel = false;
  // --fully-sharded-loras: dense LoRA layers shard lora_A (column-parallel) / lora_B
  // (row-parallel) too, with one more collective each (worker/layers/linear.h).
  bool fully_sharded_loras = false;
  // --enable-tower-connector-lora (vLLM's name): the vision tower's and mergers' linears take
  // adapters (else an adapter that targets them is refused).
  bool tower_connector_lora = false;
  // --load-format dummy (vLLM's name): random weights of the shapes config.json implies, no
  // checkpoint read. For trying a config (release configs in tests, sizing) without its weights.
  bool dummy_weights = false;
  // Build the checkpoint's multi-token-prediction head (Qwen3.5's `mtp.*`) beside the model:
  // CausalLM::ForwardMtp, its layer's keys and values in one more KV layer. Off: the head's
  // weights are skipped (and listed) as before.
  bool mtp = false;
};

// A sequence's state on this rank: the tokens computed so far and what it holds in the KV
// cache (blocks, recurrent-state entry), given back when the state goes.
struct SeqState {
  SeqState() = default;
  SeqState(SeqState&& o) noexcept { *this = std::move(o); }
  SeqState& operator=(SeqState&& o) noexcept;
  SeqState(const SeqState&) = delete;
  SeqState& operator=(const SeqState&) = delete;
  ~SeqState();

  int64_t len = 0;
  // Positions each MTP head has computed (ForwardMtp, by head): its keys and values at 0 ..
  // mtp_len[h] - 1 of the sequence's blocks. Head h at position p reads token p + 1 + h (chained
  // heads; a reused head reads p + 1), so it runs behind the target.
  std::array<int64_t, kMaxMtpHeads> mtp_len{};
  // With ForwardBatch::Seq::keep_states: each recurrent layer's state after every token of the
  // last forward (by layer: the SSM states [count, ...] and the conv inputs [K - 1 + count,
  // channels]), which RollBack returns to.
  std::map<int, std::pair<at::Tensor, at::Tensor>> steps;
  KvTable table;
  KvCache* kv = nullptr;
};

struct ForwardBatch {
  std::vector<int64_t> tokens;  // all new tokens, sequence after sequence
  std::vector<int32_t> slots;   // per token: LoRA slot, -1 = base model
  // Multimodal RoPE (models whose rotary has an mrope_section): each token's (temporal, height,
  // width) positions as three rows of tokens.size() values. Empty: every stream is the token's
  // index in its sequence (len + offset), as for text.
  std::vector<int64_t> positions3;
  // Image tokens: their indices in `tokens` (ascending), the embeddings that replace their token
  // embeddings [rows, hidden], and the DeepStack features added to the hidden states after the
  // first layers at those rows (one [rows, hidden] tensor per layer); compute dtype, on the
  // model's device. Empty: none.
  std::vector<int64_t> visual_rows;
  at::Tensor visual_embeds;
  std::vector<at::Tensor> visual_deepstack;
  struct Seq {
    SeqState* state = nullptr;
    int64_t begin = 0;        // first token in `tokens`
    int64_t count = 0;        // new tokens (prompt at prefill, 1 at decode)
    bool all_logits = false;  // logits for every new token, else only the last
    // Keep the recurrent layers' state after each new token (SeqState::steps), so that
    // CausalLM::RollBack can drop the last ones (a speculative verify).
    bool keep_states = false;
  };
  std::vector<Seq> seqs;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_FORWARD_BATCH_H_
