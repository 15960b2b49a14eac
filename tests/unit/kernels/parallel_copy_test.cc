// ParallelCopier: every byte lands, for sizes around the split threshold and the 64-byte part
// boundaries, with more threads than parts, and back to back (the pool is reused).
#include "kernels/internal/parallel_copy.h"

#include <gtest/gtest.h>

#include <random>
#include <vector>

namespace moelora::kernels_internal {
namespace {

std::vector<uint8_t> RandomBytes(size_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<uint8_t> v(n);
  for (auto& b : v) b = static_cast<uint8_t>(rng());
  return v;
}

TEST(ParallelCopier, CopiesEveryByteAtEverySplit) {
  for (int threads : {1, 2, 3, 8}) {
    ParallelCopier c(threads, /*min_split_bytes=*/1000);
    EXPECT_EQ(c.threads(), threads);
    for (size_t n : {size_t{0}, size_t{1}, size_t{999}, size_t{1000}, size_t{2047}, size_t{2048},
                     size_t{4095}, size_t{64 * 1000 + 63}, size_t{1 << 20}}) {
      SCOPED_TRACE(testing::Message() << "threads " << threads << " bytes " << n);
      const auto src = RandomBytes(n, static_cast<uint32_t>(n + threads));
      // Guard bytes on both sides: nothing written outside [dst, dst + n).
      std::vector<uint8_t> dst(n + 128, 0xA5);
      c.Copy(dst.data() + 64, src.data(), n);
      EXPECT_TRUE(std::equal(src.begin(), src.end(), dst.begin() + 64));
      for (size_t i = 0; i < 64; ++i) {
        ASSERT_EQ(dst[i], 0xA5);
        ASSERT_EQ(dst[64 + n + i], 0xA5);
      }
    }
  }
}

TEST(ParallelCopier, ReusedManyTimes) {
  ParallelCopier c(4, 256);
  const auto src = RandomBytes(100000, 7);
  for (int rep = 0; rep < 200; ++rep) {
    const size_t off = static_cast<size_t>(rep) * 37 % 5000;
    std::vector<uint8_t> dst(src.size() - off);
    c.Copy(dst.data(), src.data() + off, dst.size());
    ASSERT_TRUE(std::equal(dst.begin(), dst.end(), src.begin() + off)) << rep;
  }
}

}  // namespace
}  // namespace moelora::kernels_internal
