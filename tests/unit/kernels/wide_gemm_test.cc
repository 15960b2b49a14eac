#include "kernels/wide_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "tests/testing/bf16.h"
#include "tests/testing/gemm_reference.h"

namespace moelora {
namespace {

using testing::FromBf16;
using testing::ToBf16;

using Case = testing::GemmCase;

class WideGemmTest : public ::testing::TestWithParam<Case> {};

// Every shape: x blocks of 1, 2 and 3 (and a partial one), 4 and 7 (the last four taken as two
// and two), weight-row tails of 1–7 rows, k not a multiple of 16; strided x and y; the output
// columns in two calls split off an 8-row boundary, with the next weight's rows to prefetch.
// Against a double-precision product of the same f32 inputs: the kernel's f32 sums differ from it
// only by f32 rounding.
TEST_P(WideGemmTest, MatchesADoubleReference) {
  if (!WideGemmSupported()) GTEST_SKIP() << "no AVX-512 on this CPU";
  const auto [m, n, k] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(m * 1000 + n * 10 + k));
  std::normal_distribution<float> d;
  const int64_t ldx = k + 5, ldy = n + 3;
  std::vector<float> x(m * ldx), w(n * k), next(16 * k, 1.0f);
  for (auto& v : x) v = d(rng);
  for (auto& v : w) v = d(rng);
  std::vector<float> packed(WidePackedXElements(m, k), NAN);
  WidePackX(x.data(), ldx, m, k, packed.data());
  double scale = 0;
  const std::vector<double> want = testing::DoubleXWt(
      m, n, k, [&](int64_t i, int64_t c) { return x[i * ldx + c]; },
      [&](int64_t j, int64_t c) { return w[j * k + c]; }, &scale);
  std::vector<float> y(m * ldy, -7.0f);
  WideGemmArgs a;
  a.x_packed = packed.data();
  a.w = w.data();
  a.y = y.data();
  a.ldy = ldy;
  a.m = m;
  a.n = n;
  a.k = k;
  a.next_w = next.data();
  const int64_t split = n / 2 + 3;  // not a multiple of 8
  WideGemmRows(a, split, n);
  WideGemmRows(a, 0, split);
  testing::ExpectOutput(
      m, n, ldy, want, [&](int64_t i, int64_t j) { return static_cast<double>(y[i * ldy + j]); },
      [&](double) { return 1e-6 * scale; });
}

INSTANTIATE_TEST_SUITE_P(Shapes, WideGemmTest,
                         ::testing::Values(Case{1, 8, 16}, Case{5, 13, 24}, Case{16, 32, 64},
                                           Case{17, 40, 100}, Case{32, 9, 1024}, Case{48, 64, 33},
                                           Case{49, 23, 512}, Case{100, 70, 96}, Case{256, 16, 7},
                                           Case{64, 37, 40}, Case{112, 19, 24}));

class WideBf16GemmTest : public ::testing::TestWithParam<Case> {};

// The bf16 kernel, as the f32 one above (k a multiple of 32, which it needs; tiles of 14 weight
// rows where x is an even number of blocks), with f32 and bf16 outputs. Against a double-precision
// product of the same bf16 inputs: f32 sums of exact products differ from it only by f32 rounding
// (and the bf16 output by its own rounding).
TEST_P(WideBf16GemmTest, MatchesADoubleReference) {
  if (!WideBf16GemmSupported()) GTEST_SKIP() << "no AVX512-BF16 on this CPU";
  const auto [m, n, k] = GetParam();
  ASSERT_TRUE(WideBf16GemmFits(k));
  std::mt19937 rng(static_cast<uint32_t>(m * 1000 + n * 10 + k));
  std::normal_distribution<float> d;
  const int64_t ldx = k + 32, ldy = n + 3;
  std::vector<uint16_t> x(m * ldx), w(n * k), next(16 * k, ToBf16(1.0f));
  for (auto& v : x) v = ToBf16(d(rng));
  for (auto& v : w) v = ToBf16(d(rng));
  std::vector<uint16_t> packed(WidePackedXBf16Elements(m, k), 0xFFFF);
  WidePackXBf16(x.data(), ldx, m, k, packed.data());
  double scale = 0;
  const std::vector<double> want = testing::DoubleXWt(
      m, n, k, [&](int64_t i, int64_t c) { return FromBf16(x[i * ldx + c]); },
      [&](int64_t j, int64_t c) { return FromBf16(w[j * k + c]); }, &scale);
  const int64_t split = n / 2 + 3;  // not a multiple of 8
  WideBf16GemmArgs a;
  a.next_w = next.data();
  testing::ExpectBf16Kernel(a, packed.data(), w.data(), m, n, k, ldy, want, scale,
                            [&](const WideBf16GemmArgs& b) {
                              WideBf16GemmRows(b, split, n);
                              WideBf16GemmRows(b, 0, split);
                            });
}

INSTANTIATE_TEST_SUITE_P(Shapes, WideBf16GemmTest,
                         ::testing::Values(Case{1, 8, 32}, Case{5, 13, 64}, Case{16, 32, 64},
                                           Case{17, 40, 96}, Case{32, 9, 1024}, Case{48, 64, 32},
                                           Case{49, 23, 512}, Case{100, 70, 160}, Case{256, 16, 32},
                                           // Two, four and six x blocks: tiles of 14 weight rows,
                                           // tails of 1-13.
                                           Case{25, 57, 64}, Case{32, 131, 96}, Case{64, 131, 64},
                                           Case{90, 29, 96}));

// The packed layout itself: line c of block b holds x[16 b + r, c] in lane r, zeros past m.
TEST(WideGemmPackTest, TransposesBlocksOfSixteenRowsAndZeroPads) {
  if (!WideGemmSupported()) GTEST_SKIP() << "no AVX-512 on this CPU";
  const int64_t m = 19, k = 21, ldx = 30;
  std::vector<float> x(m * ldx);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i) + 1;
  std::vector<float> p(WidePackedXElements(m, k), NAN);
  ASSERT_EQ(p.size(), 32u * 21u);
  WidePackX(x.data(), ldx, m, k, p.data());
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t c = 0; c < k; ++c) {
      for (int64_t r = 0; r < 16; ++r) {
        const int64_t row = b * 16 + r;
        const float want = row < m ? x[row * ldx + c] : 0.0f;
        ASSERT_EQ(p[(b * k + c) * 16 + r], want)
            << "block " << b << " column " << c << " row " << r;
      }
    }
  }
}

// The bf16 packed layout (AMX's B tiles too): line 16 s + p of block b holds pair 16 s + p of x
// rows 16 b..16 b+15, zeros past m.
TEST(WideGemmPackTest, PacksPairsOfSixteenRowsAndZeroPads) {
  if (!WideGemmSupported()) GTEST_SKIP() << "no AVX-512 on this CPU";
  const int64_t m = 19, k = 64, ldx = 70;
  std::vector<uint16_t> x(m * ldx);
  for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<uint16_t>(i * 7 + 1);
  std::vector<uint16_t> p(WidePackedXBf16Elements(m, k), 0xFFFF);
  ASSERT_EQ(p.size(), 32u * 64u);
  WidePackXBf16(x.data(), ldx, m, k, p.data());
  for (int64_t b = 0; b < 2; ++b) {
    for (int64_t s = 0; s < 2; ++s) {
      for (int64_t pr = 0; pr < 16; ++pr) {
        for (int64_t r = 0; r < 16; ++r) {
          for (int64_t q = 0; q < 2; ++q) {
            const int64_t row = b * 16 + r;
            const uint16_t want = row < m ? x[row * ldx + s * 32 + 2 * pr + q] : 0;
            ASSERT_EQ(p[((b * 2 + s) * 16 + pr) * 32 + 2 * r + q], want)
                << "block " << b << " step " << s << " pair " << pr << " row " << r;
          }
        }
      }
    }
  }
}

}  // namespace
}  // namespace moelora
