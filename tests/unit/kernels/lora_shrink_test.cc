// CPU reference of the batched LoRA shrink against a direct per-token computation.
#include "kernels/lora_shrink.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <random>

#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::IsOk;
using ::moelora::testing::StatusIs;

TEST(LoraShrinkCpu, EachTokenUsesItsOwnSlot) {
  // 3 tokens: slot 1, base (-1), slot 0. Slot ranks 1 and 2; R_max 3.
  const float x[] = {1, 2, 3, 4, 5, 6};                    // [3, 2]
  const float a[] = {1, 0, 9, 9, 9, 9, 0, 1, 2, 3, 9, 9};  // [2 slots, 3, 2]
  const int32_t rank[] = {1, 2};
  const int32_t slot[] = {1, -1, 0};
  float y[9];
  LoraShrinkParams p{x, a, rank, slot, y, 3, 2, 3, 2};
  ASSERT_THAT(LoraShrinkCpu(p), IsOk());
  EXPECT_THAT(std::vector<float>(y, y + 9),
              ::testing::ElementsAre(2, 2 * 1 + 3 * 2, 0,  // token 0, slot 1
                                     0, 0, 0,              // token 1, base
                                     5, 0, 0));            // token 2, slot 0
}

TEST(LoraShrinkCpu, RejectsBadSlotsAndDims) {
  const float x[2] = {1, 2}, a[2] = {1, 1};
  const int32_t rank[1] = {1}, slot[1] = {3};
  float y[1];
  EXPECT_THAT(LoraShrinkCpu({x, a, rank, slot, y, 1, 2, 1, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LoraShrinkCpu({x, a, rank, slot, y, 0, 2, 1, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(LoraShrinkCpu({nullptr, a, rank, slot, y, 1, 2, 1, 1}),
              StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(Kernels, CudaEntryPointsAnswerWithoutADevice) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a device is present: covered by the gpu label";
  const float x[2] = {1, 2}, a[2] = {1, 1};
  const int32_t rank[1] = {1}, slot[1] = {0};
  float y[1];
  auto s = LoraShrinkCudaFromHost({x, a, rank, slot, y, 1, 2, 1, 1});
  EXPECT_FALSE(s.ok());  // UNIMPLEMENTED without CUDA, INTERNAL (no device) with it: never a crash
#ifdef MOELORA_HAVE_CUDA
  EXPECT_GT(NcclVersionCode(), 0) << "NCCL must link and answer its version";
#else
  EXPECT_EQ(NcclVersionCode(), 0);
#endif
}

}  // namespace
}  // namespace moelora
