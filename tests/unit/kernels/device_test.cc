// The device API on a machine without a CUDA device (or a build without CUDA): clean errors,
// never a crash, and NCCL linked whenever CUDA is.
#include "kernels/device.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "kernels/bgmv.h"
#include "kernels/moe_lora.h"
#include "tests/testing/moe_problem.h"
#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

TEST(Device, NoDeviceMeansCleanErrors) {
  if (CudaDeviceAvailable()) GTEST_SKIP() << "a device is present: covered by the gpu label";
  EXPECT_EQ(CudaDeviceCount(), 0);
  EXPECT_FALSE(CudaDeviceSummary().empty());
  auto buf = DeviceBuffer::Allocate(1024);
  EXPECT_FALSE(buf.ok());
  auto up = PinnedUploader::Create();
  EXPECT_FALSE(up.ok());
#ifdef MOELORA_HAVE_CUDA
  EXPECT_GT(NcclVersionCode(), 0) << "NCCL must link and answer its version";
#else
  EXPECT_EQ(NcclVersionCode(), 0);
  EXPECT_THAT(buf.status(), StatusIs(absl::StatusCode::kUnimplemented));
#endif
}

#ifdef MOELORA_HAVE_CUDA
TEST(Device, CudaOpsValidateOnTheHost) {
  // Validation runs before any launch, so a bad call fails the same way with or without a device.
  testing::MoeProblem p = testing::MoeProblem::Make({}, DType::kF32, 1);
  MoeLoraParams q = p.Params(2);
  q.max_rank = 65;
  q.workspace = p.out.bytes.data();
  EXPECT_THAT(MoeLoraCuda(q, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_rank 65")));
  q = p.Params(2);
  q.num_experts = 4000;
  q.workspace = p.out.bytes.data();
  EXPECT_THAT(MoeLoraCuda(q, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("device sort")));
  q = p.Params(2);
  EXPECT_THAT(MoeLoraCuda(q, nullptr),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("workspace")));
  BgmvParams b;
  EXPECT_THAT(BgmvCuda(b, nullptr), StatusIs(absl::StatusCode::kInvalidArgument));
}
#else
TEST(Device, CudaOpsUnimplementedWithoutCuda) {
  EXPECT_THAT(MoeLoraCuda(MoeLoraParams{}, nullptr), StatusIs(absl::StatusCode::kUnimplemented));
  EXPECT_THAT(BgmvCuda(BgmvParams{}, nullptr), StatusIs(absl::StatusCode::kUnimplemented));
}
#endif

}  // namespace
}  // namespace moelora
