// Host reference of kernels/bgmv.h: the twin the CUDA kernel is tested against.
#include "kernels/bgmv.h"

#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"

namespace moelora {

namespace {
bool ComputeDType(DType d) { return d == DType::kF32 || d == DType::kF16 || d == DType::kBF16; }
}  // namespace

absl::Status BgmvParams::Validate() const {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("bgmv: ", parts...));
  };
  if (!ComputeDType(dtype)) return bad("dtype ", DTypeName(dtype), " is not F32, F16 or BF16");
  if (!x || !out || !a_t || !b_t || !rank || !slot_of_token) return bad("null pointer");
  if (num_tokens <= 0 || in_dim <= 0 || out_dim <= 0 || max_rank <= 0 || num_slots <= 0) {
    return bad("dims must be positive: T=", num_tokens, " in=", in_dim, " out=", out_dim,
               " R_max=", max_rank, " S=", num_slots);
  }
  if (x_stride < in_dim || out_stride < out_dim) {
    return bad("x_stride ", x_stride, " < in_dim ", in_dim, " or out_stride ", out_stride,
               " < out_dim ", out_dim);
  }
  return absl::OkStatus();
}

size_t BgmvWorkspaceBytes(const BgmvParams& p) {
  return static_cast<size_t>(p.num_tokens * p.max_rank) * sizeof(float);
}

[[nodiscard]] absl::Status BgmvCpu(const BgmvParams& p) {
  if (auto s = p.Validate(); !s.ok()) return s;
  for (int64_t s = 0; s < p.num_slots; ++s) {
    if (p.rank[s] < 0 || p.rank[s] > p.max_rank) {
      return absl::InvalidArgumentError(
          absl::StrCat("bgmv: rank[", s, "] = ", p.rank[s], " outside [0, ", p.max_rank, "]"));
    }
  }
  const auto* x = static_cast<const uint8_t*>(p.x);
  const auto* a = static_cast<const uint8_t*>(p.a_t);
  const auto* b = static_cast<const uint8_t*>(p.b_t);
  auto* out = static_cast<uint8_t*>(p.out);
  const DType d = p.dtype;
  std::vector<float> y(p.max_rank), acc(p.out_dim);
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int32_t s = p.slot_of_token[t];
    if (s < -1 || s >= p.num_slots) {
      return absl::InvalidArgumentError(
          absl::StrCat("bgmv: token ", t, " has slot ", s, " outside [-1, ", p.num_slots, ")"));
    }
    if (s < 0 || p.rank[s] == 0) continue;
    const int64_t r = p.rank[s];
    const int64_t a0 = s * p.in_dim * p.max_rank, b0 = s * p.max_rank * p.out_dim;
    for (int64_t j = 0; j < r; ++j) {
      float sum = 0.0f;
      for (int64_t k = 0; k < p.in_dim; ++k) {
        sum += LoadAsF32(d, a, a0 + k * p.max_rank + j) * LoadAsF32(d, x, t * p.x_stride + k);
      }
      y[j] = sum;
    }
    for (int64_t c = 0; c < p.out_dim; ++c) {
      float sum = 0.0f;
      for (int64_t j = 0; j < r; ++j) sum += LoadAsF32(d, b, b0 + j * p.out_dim + c) * y[j];
      const int64_t o = t * p.out_stride + c;
      StoreFromF32(d, out, o, LoadAsF32(d, out, o) + sum);
    }
  }
  return absl::OkStatus();
}

}  // namespace moelora
