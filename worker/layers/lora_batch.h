// Per-forward LoRA routing shared by every LoRA-capable layer: each token's slot, grouped for
// the CPU path's SGMV segments, or as a device tensor for the kernel paths.
#ifndef MOELORA_WORKER_LAYERS_LORA_BATCH_H_
#define MOELORA_WORKER_LAYERS_LORA_BATCH_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <utility>
#include <vector>

#include "worker/layers/forward_batch.h"

namespace moelora {

struct LoraBatch {
  LoraKernels kernels = LoraKernels::kCpuSgmv;
  int max_rank = 0;
  int num_slots = 0;
  const std::vector<int32_t>* slots = nullptr;  // per token, -1 = none
  bool any = false;                             // some token carries a slot
  // Kernel paths, when `any`: int32 [T] on the model's device.
  at::Tensor slots_t;
  // CPU path: the tokens that carry a slot, stably sorted by slot, and the runs of one slot
  // (end index into `rows`, slot).
  std::vector<int64_t> rows;
  std::vector<std::pair<int64_t, int32_t>> runs;

  bool kernel_path() const { return kernels != LoraKernels::kCpuSgmv; }
  static LoraBatch Make(const ModelOptions& o, const std::vector<int32_t>& slots,
                        const at::Device& device);
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_LORA_BATCH_H_
