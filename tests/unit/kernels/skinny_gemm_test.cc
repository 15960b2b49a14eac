#include "kernels/skinny_gemm.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <random>
#include <vector>

#include "tests/testing/bf16.h"

namespace moelora {
namespace {

using testing::FromBf16;
using testing::ToBf16;

struct Case {
  int64_t m, n, k;
};

class SkinnyGemmTest : public ::testing::TestWithParam<Case> {};

void CheckAgainstReference(const Case& shape, SkinnyIsa isa, bool x_bf16, bool next_w);

// Every (m, n, k) shape, on every instruction set this CPU has: one weight row at a time (1-8 x
// rows), tiles of 6 / 3 / 2 / 1 x rows and their tails, 8 / 4 / 2 / 1 weight rows, k with and
// without an 8- and a 16-lane tail; strided x and y; any output-column split; row streams with
// the CPU's prefetch distance and hint, and with 4 KB (into the next product's rows past the last)
// both with the L1 / L2 hints and non-temporal; against a double-precision reference.
TEST_P(SkinnyGemmTest, MatchesADoubleReferenceInF32AndBf16) {
  if (!SkinnyGemmAvailable()) GTEST_SKIP() << "no AVX2 + FMA on this CPU";
  for (SkinnyIsa isa : {SkinnyIsa::kAvx2, SkinnyIsa::kAvx512, SkinnyIsa::kAvx512Bf16}) {
    if (!SkinnyGemmSupports(isa)) continue;
    for (bool x_bf16 : {false, true}) {
      // Row streams up to the CPU's default rows, up to 8 (every RowStream instantiation, on
      // any CPU), and off (tiles at every row count).
      for (int rows : {0, 8, -1}) {
        for (int64_t prefetch : {int64_t{-1}, int64_t{4096}, int64_t{-4096}}) {
          if (rows < 0 && prefetch != -1) continue;  // tiles: no row streams to prefetch for
          // -4096: 4 KB with the non-temporal hint.
          const bool nta = prefetch == -4096;
          if (nta) prefetch = 4096;
          SCOPED_TRACE(isa == SkinnyIsa::kAvx2     ? "AVX2"
                       : isa == SkinnyIsa::kAvx512 ? "AVX-512"
                                                   : "AVX512-BF16");
          SCOPED_TRACE(x_bf16 ? "x bf16" : "x f32");
          SCOPED_TRACE(rows == 0   ? "row streams up to the CPU's rows"
                       : rows == 8 ? "row streams up to 8 x rows"
                                   : "tiles at every x row count");
          SCOPED_TRACE(prefetch < 0 ? "the CPU's prefetch"
                       : nta        ? "prefetch 4 KB (f32 also 8 KB), non-temporal, then next_w"
                                    : "prefetch 4 KB (f32 also 8 KB into L2), then next_w");
          SetSkinnyRowStreams(rows >= 0);
          SetSkinnyRowStreamRows(std::max(rows, 0));
          SetSkinnyRowStreamPrefetchBytes(prefetch);
          SetSkinnyRowStreamFarPrefetchBytes(prefetch < 0 ? -1 : 2 * prefetch);
          SetSkinnyRowStreamNonTemporal(prefetch < 0 ? -1 : (nta ? 1 : 0));
          CheckAgainstReference(GetParam(), isa, x_bf16, prefetch >= 0);
          SetSkinnyRowStreams(true);
          SetSkinnyRowStreamRows(0);
          SetSkinnyRowStreamPrefetchBytes(-1);
          SetSkinnyRowStreamFarPrefetchBytes(-1);
          SetSkinnyRowStreamNonTemporal(-1);
        }
      }
    }
  }
}

// The row streams' prefetch distance per weight type: MOELORA_SKINNY_PREFETCH_BYTES (when the
// process starts with it; ctest runs this test once more with it set) replaces both types' CPU
// values, SetSkinnyRowStreamPrefetchBytes overrides both, and -1 gives back what was there.
TEST(SkinnyGemmSettingsTest, PrefetchBytesPerWeightTypeEnvAndOverride) {
  const int64_t f32 = SkinnyRowStreamPrefetchBytes(SkinnyWeight::kF32);
  const int64_t bf16 = SkinnyRowStreamPrefetchBytes(SkinnyWeight::kBF16);
  if (const char* env = std::getenv("MOELORA_SKINNY_PREFETCH_BYTES")) {
    EXPECT_EQ(f32, std::atoll(env));
    EXPECT_EQ(bf16, std::atoll(env));
  } else {
    EXPECT_GE(f32, 0);
    EXPECT_GE(bf16, f32);  // 0 and 0, or 4 KB and 8 KB on Zen 5
  }
  SetSkinnyRowStreamPrefetchBytes(12345);
  EXPECT_EQ(SkinnyRowStreamPrefetchBytes(SkinnyWeight::kF32), 12345);
  EXPECT_EQ(SkinnyRowStreamPrefetchBytes(SkinnyWeight::kBF16), 12345);
  SetSkinnyRowStreamPrefetchBytes(-1);
  EXPECT_EQ(SkinnyRowStreamPrefetchBytes(SkinnyWeight::kF32), f32);
  EXPECT_EQ(SkinnyRowStreamPrefetchBytes(SkinnyWeight::kBF16), bf16);
}

// The row streams' prefetch hint: MOELORA_SKINNY_PREFETCH_NTA=0|1 (when the process starts with
// it; ctest runs this test once more with it set to 0) replaces the CPU's default (non-temporal on
// Zen 5 and later), SetSkinnyRowStreamNonTemporal overrides it, and -1 gives back what was there.
TEST(SkinnyGemmSettingsTest, NonTemporalHintEnvAndOverride) {
  const bool hint = SkinnyRowStreamNonTemporal();
  if (const char* env = std::getenv("MOELORA_SKINNY_PREFETCH_NTA")) {
    EXPECT_EQ(hint, std::strcmp(env, "1") == 0);
  }
  SetSkinnyRowStreamNonTemporal(hint ? 0 : 1);
  EXPECT_EQ(SkinnyRowStreamNonTemporal(), !hint);
  SetSkinnyRowStreamNonTemporal(7);  // any other value: on
  EXPECT_TRUE(SkinnyRowStreamNonTemporal());
  SetSkinnyRowStreamNonTemporal(-1);
  EXPECT_EQ(SkinnyRowStreamNonTemporal(), hint);
}

void CheckAgainstReference(const Case& shape, SkinnyIsa isa, bool x_bf16, bool next_w) {
  const auto [m, n, k] = shape;
  std::mt19937 rng(static_cast<uint32_t>(m * 1000 + n * 10 + k));
  std::normal_distribution<float> d;
  const int64_t ldx = k + 3, ldy = n + 5;
  std::vector<float> x(m * ldx), w(n * k);
  for (auto& v : x) v = x_bf16 ? FromBf16(ToBf16(d(rng))) : d(rng);
  std::vector<uint16_t> xb(x.size());  // x's bf16 rows (exact: x was rounded to bf16 above)
  for (size_t i = 0; i < x.size(); ++i) xb[i] = ToBf16(x[i]);
  for (auto& v : w) v = d(rng);
  std::vector<uint16_t> wb(n * k);
  for (int64_t i = 0; i < n * k; ++i) wb[i] = ToBf16(w[i]);
  for (SkinnyWeight t : {SkinnyWeight::kF32, SkinnyWeight::kBF16}) {
    std::vector<float> y(m * ldy, -7.0f);
    SkinnyGemmArgs a{x.data(),
                     ldx,
                     t == SkinnyWeight::kF32 ? static_cast<const void*>(w.data())
                                             : static_cast<const void*>(wb.data()),
                     t,
                     y.data(),
                     ldy,
                     m,
                     n,
                     k,
                     x_bf16 ? xb.data() : nullptr,
                     ldx};
    // A next product (the same weight again, as the kernel only prefetches it).
    if (next_w) {
      a.next_w = a.w;
      a.next_rows = n;
    }
    const int64_t cut = n / 3;  // two calls on disjoint column ranges, as the threads make them
    SkinnyGemmRows(a, 0, cut, isa);
    SkinnyGemmRows(a, cut, n, isa);
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        double ref = 0, mag = 0;
        for (int64_t c = 0; c < k; ++c) {
          const double wv = t == SkinnyWeight::kF32 ? w[j * k + c] : FromBf16(wb[j * k + c]);
          ref += wv * x[i * ldx + c];
          mag += std::abs(wv * x[i * ldx + c]);
        }
        ASSERT_NEAR(y[i * ldy + j], ref, 1e-6 * mag + 1e-6)
            << "m " << i << " n " << j << (t == SkinnyWeight::kF32 ? " f32" : " bf16");
      }
      for (int64_t j = n; j < ldy; ++j) ASSERT_EQ(y[i * ldy + j], -7.0f) << "wrote past n";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Shapes, SkinnyGemmTest,
    ::testing::Values(Case{1, 1, 1}, Case{1, 4, 8}, Case{2, 5, 9}, Case{3, 8, 16}, Case{4, 7, 31},
                      Case{5, 13, 64}, Case{6, 16, 100}, Case{7, 3, 7}, Case{11, 9, 47},
                      Case{13, 6, 33}, Case{24, 33, 129},
                      // f32 rows of 4 KB at 1-3 x rows (8 weight rows a
                      // tile) and of 2 KB at 1-4 (2 a tile), with tails
                      Case{1, 37, 1024}, Case{3, 20, 1030}, Case{2, 21, 512}, Case{4, 9, 500},
                      // 1-2 x rows, one weight row at a time: k with
                      // whole 4-vector steps, 1-3 single vectors after
                      // them, and an element tail
                      Case{1, 5, 200}, Case{2, 7, 77}, Case{2, 3, 300}, Case{1, 6, 4160},
                      // 3-8 x rows one weight row at a time (4 accumulators a row
                      // up to 4 rows, 2 from 5), with vector and element tails
                      Case{3, 5, 300}, Case{4, 3, 1030}, Case{5, 4, 97}, Case{6, 3, 160},
                      Case{7, 5, 1024}, Case{8, 10, 130}, Case{8, 3, 2048}));

}  // namespace
}  // namespace moelora
