// Host reference of kernels/moe_lora.h: a direct loop over (token, k), the twin the CUDA
// pipeline (device sort, grouped GEMMs, LoRA shrink/expand, combine) is tested against.
#include "kernels/moe_lora.h"

#include <algorithm>
#include <cmath>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/dtype.h"
#include "kernels/internal/moe_lora_workspace.h"

namespace moelora {

absl::Status MoeLoraParams::Validate() const {
  auto bad = [](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("moe_lora: ", parts...));
  };
  if (dtype != DType::kF32 && dtype != DType::kF16 && dtype != DType::kBF16) {
    return bad("dtype ", DTypeName(dtype), " is not F32, F16 or BF16");
  }
  if (!x || !topk_ids || !topk_weights || !w13 || !w2 || !out) return bad("null pointer");
  if (num_tokens <= 0 || hidden <= 0 || inter <= 0 || num_experts <= 0 || top_k <= 0) {
    return bad("dims must be positive: T=", num_tokens, " H=", hidden, " I=", inter,
               " E=", num_experts, " K=", top_k);
  }
  if (top_k > num_experts) return bad("top_k ", top_k, " > num_experts ", num_experts);
  if (num_gate_up < 0 || num_gate_up > 2) return bad("num_gate_up ", num_gate_up);
  const bool any_lora = num_gate_up > 0 || has_down;
  if (any_lora) {
    if (!slot_of_token) return bad("LoRA projections given but slot_of_token is null");
    if (num_slots <= 0 || max_rank <= 0) {
      return bad("LoRA needs num_slots > 0 and max_rank > 0 (S=", num_slots, ", R_max=", max_rank,
                 ")");
    }
  }
  auto check = [&](const MoeLoraProj& p, const char* what, int64_t cols) -> absl::Status {
    if (!p.a_t || !p.b_t || !p.rank) return bad(what, ": null pointer");
    if (p.out_dim <= 0 || p.out_col < 0 || p.out_col + p.out_dim > cols) {
      return bad(what, ": columns [", p.out_col, ", ", p.out_col + p.out_dim,
                 ") leave the output's ", cols);
    }
    return absl::OkStatus();
  };
  for (int i = 0; i < num_gate_up; ++i) {
    if (auto s = check(gate_up[i], i == 0 ? "gate_up[0]" : "gate_up[1]", 2 * inter); !s.ok()) {
      return s;
    }
  }
  if (has_down) {
    if (auto s = check(down, "down", hidden); !s.ok()) return s;
  }
  return absl::OkStatus();
}

size_t MoeLoraWorkspaceBytes(const MoeLoraParams& p) {
  const size_t db = p.dtype == DType::kF32 ? 4 : 2;
  return moe_internal::ComputeMoeWorkspace(p.num_tokens, p.top_k, p.num_experts, p.hidden, p.inter,
                                           p.max_rank, db)
      .total;
}

namespace {

// acc[p.out_col + c] += Σ_j B[l, j, c] · Σ_h A[l, h, j] · in[h], l = s·E + e; the rank-sized
// intermediate is f32.
void AddProj(DType d, const MoeLoraProj& p, int64_t l, int32_t r, int64_t in_dim, int64_t R,
             const float* in, float* acc) {
  const auto* a = static_cast<const uint8_t*>(p.a_t);
  const auto* b = static_cast<const uint8_t*>(p.b_t);
  std::vector<float> mid(r, 0.0f);
  for (int32_t j = 0; j < r; ++j) {
    float s = 0.0f;
    for (int64_t h = 0; h < in_dim; ++h) s += LoadAsF32(d, a, (l * in_dim + h) * R + j) * in[h];
    mid[j] = s;
  }
  for (int64_t c = 0; c < p.out_dim; ++c) {
    float s = 0.0f;
    for (int32_t j = 0; j < r; ++j) s += LoadAsF32(d, b, (l * R + j) * p.out_dim + c) * mid[j];
    acc[p.out_col + c] += s;
  }
}

float RoundTo(DType d, float v) {
  uint8_t buf[4];
  StoreFromF32(d, buf, 0, v);
  return LoadAsF32(d, buf, 0);
}

}  // namespace

[[nodiscard]] absl::Status MoeLoraCpu(const MoeLoraParams& p) {
  if (auto s = p.Validate(); !s.ok()) return s;
  const DType d = p.dtype;
  const int64_t T = p.num_tokens, H = p.hidden, I = p.inter, E = p.num_experts, K = p.top_k,
                R = p.max_rank;
  const bool any_lora = p.num_gate_up > 0 || p.has_down;
  auto rank_ok = [&](const MoeLoraProj& pr) -> absl::Status {
    for (int64_t i = 0; i < p.num_slots * E; ++i) {
      if (pr.rank[i] < 0 || pr.rank[i] > R) {
        return absl::InvalidArgumentError(absl::StrCat(
            "moe_lora: rank[", i / E, ", ", i % E, "] = ", pr.rank[i], " outside [0, ", R, "]"));
      }
    }
    return absl::OkStatus();
  };
  for (int i = 0; i < p.num_gate_up; ++i) {
    if (auto s = rank_ok(p.gate_up[i]); !s.ok()) return s;
  }
  if (p.has_down) {
    if (auto s = rank_ok(p.down); !s.ok()) return s;
  }
  const auto* x = static_cast<const uint8_t*>(p.x);
  const auto* w13 = static_cast<const uint8_t*>(p.w13);
  const auto* w2 = static_cast<const uint8_t*>(p.w2);
  auto* out = static_cast<uint8_t*>(p.out);
  std::vector<float> xt(H), h13(2 * I), act(I), y(H), sum(H);
  for (int64_t t = 0; t < T; ++t) {
    const int32_t s = any_lora ? p.slot_of_token[t] : -1;
    if (s < -1 || s >= (any_lora ? p.num_slots : 0)) {
      return absl::InvalidArgumentError(
          absl::StrCat("moe_lora: token ", t, " has slot ", s, " outside [-1, ", p.num_slots, ")"));
    }
    for (int64_t h = 0; h < H; ++h) xt[h] = LoadAsF32(d, x, t * H + h);
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t k = 0; k < K; ++k) {
      const int32_t e = p.topk_ids[t * K + k];
      if (e < 0 || e >= E) {
        return absl::InvalidArgumentError(
            absl::StrCat("moe_lora: token ", t, " routes to expert ", e, " outside [0, ", E, ")"));
      }
      for (int64_t c = 0; c < 2 * I; ++c) {
        float acc = 0.0f;
        for (int64_t h = 0; h < H; ++h) acc += LoadAsF32(d, w13, (e * 2 * I + c) * H + h) * xt[h];
        h13[c] = acc;
      }
      const int64_t l = s >= 0 ? s * E + e : -1;
      for (int i = 0; l >= 0 && i < p.num_gate_up; ++i) {
        const int32_t r = p.gate_up[i].rank[l];
        if (r > 0) AddProj(d, p.gate_up[i], l, r, H, R, xt.data(), h13.data());
      }
      for (int64_t c = 0; c < I; ++c) {
        const float g = h13[c];
        float a = g / (1.0f + std::exp(-g)), u = h13[I + c];
        if (p.swiglu_limit > 0) {
          a = std::min(a, p.swiglu_limit);
          u = std::min(std::max(u, -p.swiglu_limit), p.swiglu_limit);
        }
        act[c] = RoundTo(d, a * u);
      }
      for (int64_t h = 0; h < H; ++h) {
        float acc = 0.0f;
        for (int64_t c = 0; c < I; ++c) acc += LoadAsF32(d, w2, (e * H + h) * I + c) * act[c];
        y[h] = acc;
      }
      if (l >= 0 && p.has_down && p.down.rank[l] > 0) {
        AddProj(d, p.down, l, p.down.rank[l], I, R, act.data(), y.data());
      }
      const float w = p.topk_weights[t * K + k];
      for (int64_t h = 0; h < H; ++h) sum[h] += w * y[h];
    }
    for (int64_t h = 0; h < H; ++h) StoreFromF32(d, out, t * H + h, sum[h]);
  }
  return absl::OkStatus();
}

}  // namespace moelora
