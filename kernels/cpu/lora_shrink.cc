#include "kernels/lora_shrink.h"

#include "absl/strings/str_cat.h"

namespace moelora {

absl::Status LoraShrinkParams::Validate() const {
  if (!x || !lora_a || !rank || !slot_of_token || !y)
    return absl::InvalidArgumentError("LoraShrinkParams: null pointer");
  if (num_tokens <= 0 || h_in <= 0 || max_rank <= 0 || num_slots <= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("LoraShrinkParams: dims must be positive (T=", num_tokens, ", H_in=", h_in,
                     ", R_max=", max_rank, ", S=", num_slots, ")"));
  }
  return absl::OkStatus();
}

absl::Status LoraShrinkCpu(const LoraShrinkParams& p) {
  if (auto s = p.Validate(); !s.ok()) return s;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int32_t s = p.slot_of_token[t];
    float* yt = p.y + t * p.max_rank;
    for (int64_t j = 0; j < p.max_rank; ++j) yt[j] = 0.0f;
    if (s < 0) continue;
    if (s >= p.num_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("token ", t, ": slot ", s, " >= ", p.num_slots, " slots"));
    }
    const int32_t r = p.rank[s];
    if (r < 0 || r > p.max_rank) {
      return absl::InvalidArgumentError(
          absl::StrCat("slot ", s, ": rank ", r, " outside [0, ", p.max_rank, "]"));
    }
    const float* xt = p.x + t * p.h_in;
    for (int32_t j = 0; j < r; ++j) {
      const float* a = p.lora_a + (static_cast<int64_t>(s) * p.max_rank + j) * p.h_in;
      float acc = 0.0f;
      for (int64_t k = 0; k < p.h_in; ++k) acc += a[k] * xt[k];
      yt[j] = acc;
    }
  }
  return absl::OkStatus();
}

}  // namespace moelora
