#include "worker/layers/lora_batch.h"

#include <algorithm>

namespace moelora {

LoraBatch LoraBatch::Make(const ModelOptions& o, const std::vector<int32_t>& slots,
                          const at::Device& device) {
  LoraBatch b;
  b.kernels = o.kernels;
  b.max_rank = o.max_lora_rank;
  b.num_slots = o.max_loras;
  b.slots = &slots;
  b.any = std::any_of(slots.begin(), slots.end(), [](int32_t s) { return s >= 0; });
  if (!b.any) return b;
  if (b.kernel_path()) {
    b.slots_t = at::from_blob(const_cast<int32_t*>(slots.data()),
                              {static_cast<int64_t>(slots.size())}, at::kInt)
                    .to(device, at::kInt, false, /*copy=*/true);
    return b;
  }
  for (int64_t t = 0; t < static_cast<int64_t>(slots.size()); ++t) {
    if (slots[t] >= 0) b.rows.push_back(t);
  }
  std::stable_sort(b.rows.begin(), b.rows.end(),
                   [&](int64_t x, int64_t y) { return slots[x] < slots[y]; });
  for (size_t i = 0; i < b.rows.size(); ++i) {
    if (i + 1 == b.rows.size() || slots[b.rows[i + 1]] != slots[b.rows[i]]) {
      b.runs.push_back({static_cast<int64_t>(i + 1), slots[b.rows[i]]});
    }
  }
  return b;
}

}  // namespace moelora
