// CPU twin of the fused MoE LoRA (kernels/moe_lora.h) against identities that do not share its
// code: LoRA == merged expert weights, the 3D wrapper == the equivalent 2D one (bit-exact), base
// tokens untouched by loaded adapters (bit-exact), the routing weight scaling base + LoRA.
#include "kernels/moe_lora.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "tests/testing/moe_problem.h"
#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::IsOk;
using ::moelora::testing::MoeDims;
using ::moelora::testing::MoeProblem;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

TEST(MoeLoraCpu, TwoDLoraEqualsMergedWeights) {
  MoeDims d{.t = 6, .h = 24, .i = 10, .e = 5, .k = 2, .s = 2, .r = 3};
  MoeProblem p = MoeProblem::Make(d, DType::kF32, 11);
  for (auto& s : p.slots) s = 1;  // every token on slot 1
  ASSERT_THAT(MoeLoraCpu(p.Params(2)), IsOk());
  const std::vector<float> lora = p.out.floats();
  // Merge slot 1 into the expert weights: W13[e][c] += Σ_j B[1,e,j,c] A[1,e,:,j], W2 likewise.
  const int64_t H = d.h, I = d.i, R = d.r;
  for (int64_t e = 0; e < d.e; ++e) {
    const int64_t l = 1 * d.e + e;
    for (int64_t c = 0; c < 2 * I; ++c) {
      const bool up = c >= I;
      const auto& A = up ? p.up_a : p.gate_a;
      const auto& B = up ? p.up_b : p.gate_b;
      const int32_t r = (up ? p.up_rank : p.gate_rank)[l];
      for (int64_t h = 0; h < H; ++h) {
        double delta = 0;
        for (int64_t j = 0; j < r; ++j) {
          delta += static_cast<double>(B.at((l * R + j) * I + (c % I))) * A.at((l * H + h) * R + j);
        }
        const int64_t wi = (e * 2 * I + c) * H + h;
        p.w13.set(wi, static_cast<float>(p.w13.at(wi) + delta));
      }
    }
    for (int64_t h = 0; h < H; ++h) {
      for (int64_t c = 0; c < I; ++c) {
        double delta = 0;
        for (int64_t j = 0; j < p.down_rank[l]; ++j) {
          delta += static_cast<double>(p.down_b.at((l * R + j) * H + h)) *
                   p.down_a.at((l * I + c) * R + j);
        }
        const int64_t wi = (e * H + h) * I + c;
        p.w2.set(wi, static_cast<float>(p.w2.at(wi) + delta));
      }
    }
  }
  ASSERT_THAT(MoeLoraCpu(p.Params(0)), IsOk());
  EXPECT_LT(testing::RelErr(lora, p.out.floats()), 1e-5);
}

class MoeLoraCpuDType : public ::testing::TestWithParam<DType> {};

TEST_P(MoeLoraCpuDType, ThreeDEqualsEquivalentTwoD) {
  MoeDims d{.t = 7, .h = 20, .i = 9, .e = 6, .k = 3, .s = 3, .r = 4};
  MoeProblem p = MoeProblem::Make(d, GetParam(), 12);
  // The 2D adapter equivalent to the 3D one: gate and up share A; B splits by columns.
  const int64_t I = d.i, R = d.r;
  p.gate_a = p.up_a = p.w13_a;
  p.gate_rank = p.up_rank = p.w13_rank;
  for (int64_t l = 0; l < d.s * d.e; ++l) {
    for (int64_t j = 0; j < R; ++j) {
      for (int64_t c = 0; c < I; ++c) {
        p.gate_b.set((l * R + j) * I + c, p.w13_b.at((l * R + j) * 2 * I + c));
        p.up_b.set((l * R + j) * I + c, p.w13_b.at((l * R + j) * 2 * I + I + c));
      }
    }
  }
  ASSERT_THAT(MoeLoraCpu(p.Params(3)), IsOk());
  const std::vector<uint8_t> three_d = p.out.bytes;
  ASSERT_THAT(MoeLoraCpu(p.Params(2)), IsOk());
  EXPECT_EQ(three_d, p.out.bytes);
}

TEST_P(MoeLoraCpuDType, BaseTokensUntouchedByAdapters) {
  MoeDims d{.t = 9, .h = 16, .i = 8, .e = 4, .k = 2, .s = 2, .r = 2};
  MoeProblem p = MoeProblem::Make(d, GetParam(), 13);
  ASSERT_THAT(MoeLoraCpu(p.Params(0)), IsOk());
  const std::vector<uint8_t> base = p.out.bytes;
  ASSERT_THAT(MoeLoraCpu(p.Params(2)), IsOk());
  const size_t row = d.h * testing::DTypeBytes(GetParam());
  int base_tokens = 0, changed = 0;
  for (int64_t t = 0; t < d.t; ++t) {
    const bool same = std::memcmp(base.data() + t * row, p.out.bytes.data() + t * row, row) == 0;
    if (p.slots[t] < 0) {
      ++base_tokens;
      EXPECT_TRUE(same) << "base token " << t;
    } else {
      changed += !same;
    }
  }
  EXPECT_GT(base_tokens, 0);
  EXPECT_GT(changed, 0) << "adapter tokens must differ from the base";
}

INSTANTIATE_TEST_SUITE_P(DTypes, MoeLoraCpuDType,
                         ::testing::Values(DType::kF32, DType::kF16, DType::kBF16),
                         [](const auto& info) { return std::string(DTypeName(info.param)); });

TEST(MoeLoraCpu, RoutingWeightScalesBaseAndLora) {
  MoeDims d{.t = 3, .h = 12, .i = 6, .e = 4, .k = 2, .s = 1, .r = 2};
  MoeProblem p = MoeProblem::Make(d, DType::kF32, 14);
  for (auto& s : p.slots) s = 0;
  ASSERT_THAT(MoeLoraCpu(p.Params(3)), IsOk());
  const std::vector<float> one = p.out.floats();
  for (auto& w : p.topk_weights) w *= 2;
  ASSERT_THAT(MoeLoraCpu(p.Params(3)), IsOk());
  const std::vector<float> two = p.out.floats();
  for (size_t i = 0; i < one.size(); ++i) EXPECT_FLOAT_EQ(two[i], 2 * one[i]) << i;
}

TEST(MoeLoraCpu, RejectsBadInputAndWritesNothing) {
  MoeDims d{.t = 2, .h = 8, .i = 4, .e = 3, .k = 2, .s = 1, .r = 2};
  MoeProblem p = MoeProblem::Make(d, DType::kF32, 15);
  const std::vector<uint8_t> before = p.out.bytes;
  const int32_t saved = p.topk_ids[0];
  p.topk_ids[0] = 3;
  EXPECT_THAT(MoeLoraCpu(p.Params(2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert 3")));
  p.topk_ids[0] = saved;
  p.slots[0] = 1;
  EXPECT_THAT(MoeLoraCpu(p.Params(2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 0 has slot 1")));
  p.slots[0] = 0;
  p.down_rank[2] = 3;
  EXPECT_THAT(MoeLoraCpu(p.Params(2)),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank[0, 2] = 3")));
  p.down_rank[2] = 1;
  MoeLoraParams q = p.Params(2);
  q.gate_up[1].out_col = 2 * d.i - 1;
  EXPECT_THAT(MoeLoraCpu(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("gate_up[1]")));
  q = p.Params(2);
  q.top_k = 4;
  EXPECT_THAT(MoeLoraCpu(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_k")));
  q = p.Params(2);
  q.slot_of_token = nullptr;
  EXPECT_THAT(MoeLoraCpu(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("slot")));
  EXPECT_EQ(before, p.out.bytes);
}

TEST(MoeLoraWorkspace, GrowsWithTokensAndIsAligned) {
  MoeLoraParams p;
  p.num_tokens = 256;
  p.top_k = 8;
  p.num_experts = 128;
  p.hidden = 2048;
  p.inter = 768;
  p.max_rank = 16;
  p.dtype = DType::kBF16;
  const size_t big = MoeLoraWorkspaceBytes(p);
  p.num_tokens = 1;
  const size_t small = MoeLoraWorkspaceBytes(p);
  EXPECT_GT(big, small);
  EXPECT_EQ(big % 256, 0u);
  // h13 (f32, 2I) + y (f32, H) + act (bf16, I) dominate: 256·8 rows.
  EXPECT_GE(big, 256u * 8 * (2 * 768 * 4 + 2048 * 4 + 768 * 2));
}

// Step3.5's clamped SwiGLU: a limit above every activation changes nothing (bit-exact), a small
// one changes the output, and a token's result is the clamp of its own h13 (one token, one
// expert, no LoRA: act = min(silu(g), L) · clamp(u, ±L) computed here from w13 directly).
TEST(MoeLoraCpu, ClampedSwiGlu) {
  MoeDims d{.t = 5, .h = 16, .i = 8, .e = 3, .k = 2, .s = 2, .r = 4};
  MoeProblem p = MoeProblem::Make(d, DType::kF32, 17);
  ASSERT_THAT(MoeLoraCpu(p.Params(2)), IsOk());
  const std::vector<float> plain = p.out.floats();
  p.swiglu_limit = 1e30f;
  ASSERT_THAT(MoeLoraCpu(p.Params(2)), IsOk());
  EXPECT_EQ(p.out.floats(), plain);
  p.swiglu_limit = 0.05f;
  ASSERT_THAT(MoeLoraCpu(p.Params(2)), IsOk());
  EXPECT_GT(testing::RelErr(p.out.floats(), plain), 1e-3);

  MoeDims one{.t = 1, .h = 16, .i = 8, .e = 1, .k = 1, .s = 1, .r = 1};
  MoeProblem q = MoeProblem::Make(one, DType::kF32, 18);
  q.topk_ids = {0};
  q.topk_weights = {1.0f};
  q.swiglu_limit = 0.05f;
  ASSERT_THAT(MoeLoraCpu(q.Params(0)), IsOk());
  std::vector<double> act(one.i);
  for (int64_t c = 0; c < one.i; ++c) {
    double g = 0, u = 0;
    for (int64_t h = 0; h < one.h; ++h) {
      g += static_cast<double>(q.w13.at(c * one.h + h)) * q.x.at(h);
      u += static_cast<double>(q.w13.at((one.i + c) * one.h + h)) * q.x.at(h);
    }
    act[c] = std::min(g / (1 + std::exp(-g)), 0.05) * std::clamp(u, -0.05, 0.05);
  }
  for (int64_t h = 0; h < one.h; ++h) {
    double y = 0;
    for (int64_t c = 0; c < one.i; ++c) y += q.w2.at(h * one.i + c) * act[c];
    EXPECT_NEAR(q.out.at(h), y, 1e-5) << "h " << h;
  }
}

}  // namespace
}  // namespace moelora
