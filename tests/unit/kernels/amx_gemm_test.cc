#include "kernels/amx_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "kernels/wide_gemm.h"
#include "tests/testing/bf16.h"
#include "tests/testing/gemm_reference.h"

namespace moelora {
namespace {

using testing::FromBf16;
using testing::ToBf16;

using Case = testing::GemmCase;

class AmxGemmTest : public ::testing::TestWithParam<Case> {};

// Every shape: 1 and 2 weight tiles per step and an odd 16-row block, 1 and 2 x blocks and a
// partial one, several x-block pairs; strided x and y; f32 and bf16 outputs; the output columns
// in two calls split at a 16-row boundary. Against a double-precision product of the same bf16
// inputs: f32 sums of exact products differ from it only by f32 rounding.
TEST_P(AmxGemmTest, MatchesADoubleReference) {
  if (!AmxGemmSupported()) GTEST_SKIP() << "no AMX on this CPU (or the OS withheld the tiles)";
  const auto [m, n, k] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(m * 1000 + n * 10 + k));
  std::normal_distribution<float> d;
  const int64_t ldx = k + 32, ldy = n + 5;
  std::vector<uint16_t> x(m * ldx), w(n * k);
  for (auto& v : x) v = ToBf16(d(rng));
  for (auto& v : w) v = ToBf16(d(rng));
  std::vector<uint16_t> packed(WidePackedXBf16Elements(m, k), 0xFFFF);
  WidePackXBf16(x.data(), ldx, m, k, packed.data());
  double scale = 0;
  const std::vector<double> want = testing::DoubleXWt(
      m, n, k, [&](int64_t i, int64_t c) { return FromBf16(x[i * ldx + c]); },
      [&](int64_t j, int64_t c) { return FromBf16(w[j * k + c]); }, &scale);
  const int64_t split = n / 32 * 16;  // a multiple of 16, maybe 0
  AmxGemmArgs a;
  testing::ExpectBf16Kernel(a, packed.data(), w.data(), m, n, k, ldy, want, scale,
                            [&](const AmxGemmArgs& b) {
                              AmxGemmRows(b, split, n);
                              AmxGemmRows(b, 0, split);
                            });
}

INSTANTIATE_TEST_SUITE_P(Shapes, AmxGemmTest,
                         ::testing::Values(Case{1, 16, 32}, Case{1, 48, 64}, Case{2, 32, 96},
                                           Case{5, 64, 128}, Case{16, 16, 32}, Case{17, 80, 64},
                                           Case{32, 32, 256}, Case{33, 48, 32}, Case{70, 96, 160}));

TEST(AmxGemmTest, FitsOnlyWholeTiles) {
  EXPECT_TRUE(AmxGemmFits(16, 32));
  EXPECT_TRUE(AmxGemmFits(4096, 1024));
  EXPECT_FALSE(AmxGemmFits(8, 32));
  EXPECT_FALSE(AmxGemmFits(16, 48));
  EXPECT_FALSE(AmxGemmFits(0, 32));
}

}  // namespace
}  // namespace moelora
