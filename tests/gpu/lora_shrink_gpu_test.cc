// GPU vs CPU twin for the batched LoRA shrink on random shapes (T=1, rank 1, sizes that are not
// multiples of a warp). Skips without a CUDA device.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "kernels/lora_shrink.h"
#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::IsOk;

TEST(LoraShrinkGpu, MatchesCpuTwin) {
  if (!CudaDeviceAvailable()) GTEST_SKIP() << "no CUDA device";
  std::mt19937 rng(5);
  std::normal_distribution<float> dist;
  struct Shape {
    int64_t t, h, r, s;
  };
  for (const Shape& sh : {Shape{1, 1, 1, 1}, Shape{1, 33, 1, 2}, Shape{7, 100, 16, 3},
                          Shape{64, 2048, 64, 8}, Shape{257, 777, 17, 5}}) {
    std::vector<float> x(sh.t * sh.h), a(sh.s * sh.r * sh.h), y_cpu(sh.t * sh.r),
        y_gpu(sh.t * sh.r, -1.0f);
    for (auto& v : x) v = dist(rng);
    for (auto& v : a) v = dist(rng);
    std::vector<int32_t> rank(sh.s), slot(sh.t);
    for (auto& v : rank) v = 1 + static_cast<int32_t>(rng() % sh.r);
    for (auto& v : slot) v = static_cast<int32_t>(rng() % (sh.s + 1)) - 1;
    LoraShrinkParams p{x.data(), a.data(), rank.data(), slot.data(), y_cpu.data(),
                       sh.t,     sh.h,     sh.r,        sh.s};
    ASSERT_THAT(LoraShrinkCpu(p), IsOk());
    p.y = y_gpu.data();
    ASSERT_THAT(LoraShrinkCudaFromHost(p), IsOk());
    double num = 0, den = 0;
    for (size_t i = 0; i < y_cpu.size(); ++i) {
      num += (y_cpu[i] - y_gpu[i]) * (y_cpu[i] - y_gpu[i]);
      den += y_cpu[i] * y_cpu[i];
    }
    EXPECT_LT(num / std::max(den, 1e-30), 1e-10) << "T=" << sh.t << " H=" << sh.h << " R=" << sh.r;
  }
}

}  // namespace
}  // namespace moelora
