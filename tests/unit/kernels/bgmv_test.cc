// CPU twin of the dense batched multi-LoRA (kernels/bgmv.h): a hand-computed batch, the merged
// weight identity, dtype rounding, and input checks.
#include "kernels/bgmv.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "tests/testing/kernel_data.h"
#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::IsOk;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

BgmvParams F32Params(const float* x, float* out, const float* a, const float* b,
                     const int32_t* rank, const int32_t* slot) {
  BgmvParams p;
  p.x = x;
  p.out = out;
  p.a_t = a;
  p.b_t = b;
  p.rank = rank;
  p.slot_of_token = slot;
  return p;
}

TEST(BgmvCpu, EachTokenUsesItsOwnSlot) {
  // 3 tokens: slot 1, base (-1), slot 0. in 2, out 2, R_max 2; slot 0 rank 1, slot 1 rank 2.
  const float x[] = {1, 2, 3, 4, 5, 6};  // [3, 2]
  // a_t [2, in=2, R=2]: slot 0 column j=0 = A row 0 = (1, 0) (column j=1 is padding, must be
  // ignored); slot 1 columns: A row 0 = (1, 1), A row 1 = (0, 1).
  const float a[] = {1, 9, 0, 9, 1, 0, 1, 1};
  // b_t [2, R=2, out=2]: slot 0 Bᵀ row 0 = (2, 3) (row 1 ignored); slot 1 rows (1, 0), (0, 1).
  const float b[] = {2, 3, 9, 9, 1, 0, 0, 1};
  const int32_t rank[] = {1, 2};
  const int32_t slot[] = {1, -1, 0};
  float out[] = {10, 20, 30, 40, 50, 60};
  BgmvParams p = F32Params(x, out, a, b, rank, slot);
  p.x_stride = p.out_stride = 2;
  p.num_tokens = 3;
  p.in_dim = p.out_dim = p.max_rank = p.num_slots = 2;
  ASSERT_THAT(BgmvCpu(p), IsOk());
  // token 0 (slot 1): y = (1 + 2, 2) = (3, 2); out += (3, 2).
  // token 1 (base): unchanged. token 2 (slot 0): y = 5; out += (10, 15).
  EXPECT_THAT(std::vector<float>(out, out + 6), ::testing::ElementsAre(13, 22, 30, 40, 60, 75));
}

TEST(BgmvCpu, EqualsMergedWeights) {
  // x·(W + B·A)ᵀ == x·Wᵀ + B·(A·x) for every token of one slot, with strided rows.
  std::mt19937 rng(3);
  const int64_t T = 5, in = 37, out_dim = 29, R = 8, S = 2, stride_x = 40, stride_o = 31;
  auto x = testing::Random(DType::kF32, T * stride_x, rng);
  auto a = testing::Random(DType::kF32, S * in * R, rng);
  auto b = testing::Random(DType::kF32, S * R * out_dim, rng);
  auto w = testing::Random(DType::kF32, out_dim * in, rng);
  std::vector<int32_t> rank = {5, 8}, slot(T, 1);
  std::vector<float> base(T * stride_o, 0.0f), merged(T * stride_o, 0.0f);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t c = 0; c < out_dim; ++c) {
      double s0 = 0, s1 = 0;
      for (int64_t k = 0; k < in; ++k) {
        double delta = 0;
        for (int64_t j = 0; j < rank[1]; ++j) {
          delta += static_cast<double>(b.at((R + j) * out_dim + c)) * a.at((in + k) * R + j);
        }
        s0 += static_cast<double>(w.at(c * in + k)) * x.at(t * stride_x + k);
        s1 += (w.at(c * in + k) + delta) * x.at(t * stride_x + k);
      }
      base[t * stride_o + c] = static_cast<float>(s0);
      merged[t * stride_o + c] = static_cast<float>(s1);
    }
  }
  BgmvParams p =
      F32Params(reinterpret_cast<const float*>(x.bytes.data()), base.data(),
                reinterpret_cast<const float*>(a.bytes.data()),
                reinterpret_cast<const float*>(b.bytes.data()), rank.data(), slot.data());
  p.x_stride = stride_x;
  p.out_stride = stride_o;
  p.num_tokens = T;
  p.in_dim = in;
  p.out_dim = out_dim;
  p.max_rank = R;
  p.num_slots = S;
  ASSERT_THAT(BgmvCpu(p), IsOk());
  EXPECT_LT(testing::RelErr(base, merged), 1e-5);
}

TEST(BgmvCpu, RoundsOutputOnceInBf16) {
  // out (bf16) = bf16(out + Σ lora): four contributions of 1/256 added to 1.0 give 1 + 4/256,
  // representable in bf16 (ulp 1/128 at 1.0: 4/256 = 2 ulps). Rounding after each
  // contribution would lose every one of them (1/256 is half an ulp: ties to even stay at 1).
  std::vector<uint16_t> x = {F32ToBF16(1.0f)};
  std::vector<uint16_t> a(4, F32ToBF16(1.0f));        // [1, in=1, R=4]
  std::vector<uint16_t> b(4, F32ToBF16(1.0f / 256));  // [1, R=4, out=1]
  std::vector<uint16_t> out = {F32ToBF16(1.0f)};
  const int32_t rank[] = {4}, slot[] = {0};
  BgmvParams p;
  p.dtype = DType::kBF16;
  p.x = x.data();
  p.out = out.data();
  p.a_t = a.data();
  p.b_t = b.data();
  p.rank = rank;
  p.slot_of_token = slot;
  p.x_stride = p.out_stride = 1;
  p.num_tokens = p.in_dim = p.out_dim = p.num_slots = 1;
  p.max_rank = 4;
  ASSERT_THAT(BgmvCpu(p), IsOk());
  EXPECT_EQ(BF16ToF32(out[0]), 1.0f + 4.0f / 256);
}

TEST(BgmvCpu, RejectsBadInput) {
  const float x[] = {1}, a[] = {1}, b[] = {1};
  float out[] = {0};
  const int32_t rank[] = {1}, bad_rank[] = {2}, slot[] = {0}, bad_slot[] = {1};
  BgmvParams p = F32Params(x, out, a, b, rank, slot);
  p.x_stride = p.out_stride = 1;
  p.num_tokens = p.in_dim = p.out_dim = p.max_rank = p.num_slots = 1;
  BgmvParams q = p;
  q.slot_of_token = bad_slot;
  EXPECT_THAT(BgmvCpu(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("token 0")));
  q = p;
  q.rank = bad_rank;
  EXPECT_THAT(BgmvCpu(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("rank[0]")));
  q = p;
  q.x = nullptr;
  EXPECT_THAT(BgmvCpu(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("null")));
  q = p;
  q.x_stride = 0;
  EXPECT_THAT(BgmvCpu(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("x_stride")));
  q = p;
  q.dtype = DType::kI8;
  EXPECT_THAT(BgmvCpu(q), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype")));
  EXPECT_FLOAT_EQ(out[0], 0.0f);  // no rejected call wrote
  ASSERT_THAT(BgmvCpu(p), IsOk());
  EXPECT_FLOAT_EQ(out[0], 1.0f);
}

}  // namespace
}  // namespace moelora
