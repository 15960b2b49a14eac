#include "kernels/elementwise.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "tests/testing/bf16.h"

namespace moelora {
namespace {

using testing::FromBf16;
using testing::ToBf16;

uint32_t Bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

// Lengths with and without a 16-lane tail; values that round up, down and to even, signed
// zeros, infinities, NaN, denormals and the largest finite floats (which round to infinity).
std::vector<float> Values(int64_t n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 10);
  std::vector<float> v(n);
  for (auto& x : v) x = d(rng);
  const float special[] = {0.0f,
                           -0.0f,
                           std::numeric_limits<float>::infinity(),
                           -std::numeric_limits<float>::infinity(),
                           std::numeric_limits<float>::quiet_NaN(),
                           std::numeric_limits<float>::denorm_min(),
                           std::numeric_limits<float>::max(),
                           1.0f + 1.0f / 256,  // a tie: stays 1.0 (even)
                           1.0f + 3.0f / 256,  // a tie: rounds up to even
                           -1.0f - 1.0f / 512};
  for (size_t i = 0; i < sizeof(special) / sizeof(special[0]) && i < v.size(); ++i) {
    v[i * 3 % v.size()] = special[i];
  }
  return v;
}

uint16_t ReferenceRound(float f) {
  if (std::isnan(f)) return 0x7FC0;
  const uint32_t u = Bits(f);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

TEST(ElementwiseKernelTest, RoundsAndWidensBf16LikeC10) {
  for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{37}, int64_t{1024}}) {
    const std::vector<float> v = Values(n, static_cast<uint32_t>(n));
    std::vector<uint16_t> r(n);
    RoundToBf16(v.data(), r.data(), n);
    std::vector<float> w(n), trip = v;
    WidenBf16(r.data(), w.data(), n);
    RoundTripBf16(trip.data(), n);
    for (int64_t i = 0; i < n; ++i) {
      ASSERT_EQ(r[i], ReferenceRound(v[i])) << "element " << i << " value " << v[i];
      ASSERT_EQ(Bits(w[i]), Bits(FromBf16(r[i]))) << "element " << i;
      ASSERT_EQ(Bits(trip[i]), Bits(w[i])) << "element " << i;
    }
  }
}

// ArgMax against the scalar loop it stands for (first index of the largest value, NaN never,
// 0 and -inf when nothing exceeds -inf): random rows of every length up to 70 (16-lane tails),
// with ties placed in other lanes and blocks, NaN and infinities, and rows of only -inf or NaN.
TEST(ElementwiseKernelTest, ArgMaxIsTheFirstLargestLikeAScalarLoop) {
  auto scalar = [](const std::vector<float>& v, float* max) {
    float mx = -std::numeric_limits<float>::infinity();
    int64_t best = 0;
    for (size_t i = 0; i < v.size(); ++i) {
      if (v[i] > mx) mx = v[i], best = static_cast<int64_t>(i);
    }
    *max = mx;
    return best;
  };
  std::mt19937 rng(31);
  std::uniform_int_distribution<int> small(-3, 3);
  std::vector<std::vector<float>> rows;
  for (int64_t n = 1; n <= 70; ++n) {
    rows.push_back(Values(n, static_cast<uint32_t>(n)));
    std::vector<float> ties(n);
    for (auto& x : ties) x = static_cast<float>(small(rng));  // many equal maxima
    rows.push_back(ties);
    rows.push_back(std::vector<float>(n, -std::numeric_limits<float>::infinity()));
    rows.push_back(std::vector<float>(n, std::numeric_limits<float>::quiet_NaN()));
  }
  std::vector<float> late(64, 1.0f);
  late[40] = 2.0f;
  late[56] = 2.0f;  // the same lane as 40, a later block
  late[9] = std::numeric_limits<float>::quiet_NaN();
  rows.push_back(late);
  for (const auto& v : rows) {
    float want_max = 0, got_max = 0;
    const int64_t want = scalar(v, &want_max);
    const int64_t got = ArgMax(v.data(), static_cast<int64_t>(v.size()), &got_max);
    ASSERT_EQ(got, want) << "length " << v.size();
    ASSERT_EQ(Bits(got_max), Bits(want_max)) << "length " << v.size();
  }
}

TEST(ElementwiseKernelTest, SiluMulIsWithinTwoUlpOfADoubleReference) {
  for (int64_t n : {int64_t{7}, int64_t{16}, int64_t{517}}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::normal_distribution<float> d(0, 6);
    std::vector<float> g(n), u(n), out(n), outr(n);
    for (auto& x : g) x = d(rng);
    for (auto& x : u) x = d(rng);
    g[0] = -100.0f;  // exp(100) overflows: silu is -0
    if (n > 1) g[1] = 100.0f;
    SiluMul(g.data(), u.data(), out.data(), n, false);
    SiluMul(g.data(), u.data(), outr.data(), n, true);
    for (int64_t i = 0; i < n; ++i) {
      const double s = g[i] / (1.0 + std::exp(-static_cast<double>(g[i])));
      const double want = s * u[i];
      ASSERT_NEAR(out[i], want, std::abs(want) * 3e-7 + 1e-30) << "g " << g[i] << " u " << u[i];
      // round_silu: silu rounded to bf16 first (where it is not within 2 ulp of a rounding
      // boundary, the rounding is the reference's).
      const float sf = static_cast<float>(s);
      const float sb = FromBf16(ReferenceRound(sf));
      ASSERT_NEAR(outr[i], sb * u[i], std::abs(s * u[i]) / 128 + 1e-30) << "g " << g[i];
    }
  }
}

// The router's softmax against a double-precision one, f32 and bf16 logits, lengths with and
// without a 16-lane tail; a logit far below the others underflows to 0 (not NaN).
TEST(ElementwiseKernelTest, SoftmaxRowIsWithinAFewUlpOfADoubleSoftmax) {
  for (int64_t n : {int64_t{1}, int64_t{7}, int64_t{16}, int64_t{32}, int64_t{45}, int64_t{128}}) {
    std::mt19937 rng(static_cast<uint32_t>(n + 3));
    std::normal_distribution<float> d(0, 4);
    for (bool bf16 : {false, true}) {
      std::vector<float> l(n);
      std::vector<uint16_t> lb(n);
      for (int64_t i = 0; i < n; ++i) {
        lb[i] = ToBf16(d(rng));
        l[i] = bf16 ? FromBf16(lb[i]) : d(rng);
      }
      if (n > 1) l[n - 1] = l[0] - 200.0f, lb[n - 1] = ToBf16(l[n - 1]);
      if (bf16) {
        for (int64_t i = 0; i < n; ++i) l[i] = FromBf16(lb[i]);
      }
      std::vector<float> p(n, -1.0f);
      SoftmaxRow(bf16 ? static_cast<const void*>(lb.data()) : l.data(), bf16, p.data(), n);
      // exp of l - max as f32 computes the difference (rounded: exp's argument is that).
      float mx = l[0];
      for (float v : l) mx = std::max(mx, v);
      double sum = 0;
      for (float v : l) sum += std::exp(static_cast<double>(v - mx));
      for (int64_t i = 0; i < n; ++i) {
        const double want = std::exp(static_cast<double>(l[i] - mx)) / sum;
        ASSERT_NEAR(p[i], want, want * 8e-7 + 1e-30)
            << "n " << n << (bf16 ? " bf16" : " f32") << " i " << i;
      }
    }
  }
}

// The flash-attention row fed a row in chunks (growing and shrinking maxima, 16-lane tails):
// every chunk's exps rescaled by the factors returned after it, and the final sum, give the
// double-precision softmax of the whole row; an all −inf row contributes nothing.
TEST(ElementwiseKernelTest, OnlineSoftmaxRowInChunksIsTheSoftmaxOfTheRow) {
  for (int64_t n : {int64_t{1}, int64_t{23}, int64_t{100}, int64_t{1030}}) {
    for (int64_t chunk : {int64_t{1}, int64_t{16}, int64_t{37}, int64_t{512}}) {
      std::mt19937 rng(static_cast<uint32_t>(n * 7 + chunk));
      std::normal_distribution<float> d(0, 6);
      std::vector<float> l(n);
      for (int64_t i = 0; i < n; ++i) l[i] = d(rng) + 0.05f * static_cast<float>(i % 97);
      std::vector<float> p = l;
      std::vector<double> scale(n, 1.0);  // what each element's exp is multiplied by afterwards
      float m = -std::numeric_limits<float>::infinity(), sum = 0;
      for (int64_t b = 0; b < n; b += chunk) {
        const int64_t c = std::min(chunk, n - b);
        const float f = OnlineSoftmaxRow(p.data() + b, c, &m, &sum);
        if (b == 0) {
          ASSERT_EQ(f, 0.0f);
        } else {
          ASSERT_LE(f, 1.0f);
        }
        for (int64_t i = 0; i < b; ++i) scale[i] *= f;
      }
      const float mx = *std::max_element(l.begin(), l.end());
      ASSERT_EQ(m, mx);
      double want_sum = 0;
      for (float v : l) want_sum += std::exp(static_cast<double>(v - mx));
      ASSERT_NEAR(sum, want_sum, want_sum * 1e-5) << "n " << n << " chunk " << chunk;
      for (int64_t i = 0; i < n; ++i) {
        const double want = std::exp(static_cast<double>(l[i] - mx)) / want_sum;
        ASSERT_NEAR(p[i] * scale[i] / sum, want, want * 2e-5 + 1e-30)
            << "n " << n << " chunk " << chunk << " i " << i;
      }
    }
  }
  std::vector<float> none(20, -std::numeric_limits<float>::infinity());
  float m = -std::numeric_limits<float>::infinity(), sum = 0;
  EXPECT_EQ(OnlineSoftmaxRow(none.data(), 20, &m, &sum), 1.0f);
  EXPECT_EQ(sum, 0.0f);
  for (float v : none) EXPECT_EQ(v, 0.0f);
}

TEST(ElementwiseKernelTest, SumSquaresMatchesADoubleSum) {
  for (int64_t n : {int64_t{3}, int64_t{64}, int64_t{1000}}) {
    const std::vector<float> v = Values(n, 99);
    std::vector<float> finite;
    for (float x : v) {
      if (std::isfinite(x) && std::abs(x) < 1e6f) finite.push_back(x);
    }
    double want = 0;
    for (float x : finite) want += static_cast<double>(x) * x;
    EXPECT_NEAR(SumSquares(finite.data(), static_cast<int64_t>(finite.size())), want, want * 1e-5);
  }
}

// Each product and sum rounded on its own (f32, then bf16 where asked): the bits of a reference
// written element by element.
TEST(ElementwiseKernelTest, AddRowsAndAddScaledRowRoundEachStepLikeAScalarReference) {
  auto r = [](float v, bool bf16) { return bf16 ? FromBf16(ReferenceRound(v)) : v; };
  for (bool bf16 : {false, true}) {
    for (int64_t n : {int64_t{1}, int64_t{15}, int64_t{16}, int64_t{37}, int64_t{1024}}) {
      const std::vector<float> a = Values(n, 5), b = Values(n, 6);
      std::vector<float> sum(n), acc = Values(n, 7);
      const std::vector<float> acc0 = acc;
      AddRows(a.data(), b.data(), sum.data(), n, bf16);
      const float w = 0.37f;
      AddScaledRow(a.data(), w, acc.data(), n, bf16);
      for (int64_t i = 0; i < n; ++i) {
        const float want_sum = r(a[i] + b[i], bf16);
        const float want_acc = r(acc0[i] + r(a[i] * w, bf16), bf16);
        if (std::isnan(want_sum)) {
          ASSERT_TRUE(std::isnan(sum[i])) << i;
        } else {
          ASSERT_EQ(Bits(sum[i]), Bits(want_sum)) << "n " << n << " element " << i;
        }
        if (std::isnan(want_acc)) {
          ASSERT_TRUE(std::isnan(acc[i])) << i;
        } else {
          ASSERT_EQ(Bits(acc[i]), Bits(want_acc)) << "n " << n << " element " << i;
        }
      }
    }
  }
}

// RmsNormRow in each form against a double-precision definition; the plain form with bf16
// rounding of x · r against that rounding applied to the f32 scale (what ATen computes).
TEST(ElementwiseKernelTest, RmsNormRowMatchesItsDefinitionInEveryForm) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{64}, int64_t{1024}}) {
    std::mt19937 rng(static_cast<uint32_t>(n));
    std::normal_distribution<float> d(0, 3);
    std::vector<float> x(n), w(n), out(n);
    for (auto& v : x) v = d(rng);
    for (auto& v : w) v = 1 + d(rng) / 6;
    const float eps = 1e-6f;
    double ss = 0;
    for (float v : x) ss += static_cast<double>(v) * v;
    const double rs = 1 / std::sqrt(ss / n + eps);
    for (NormForm form : {NormForm::kPlain, NormForm::kZeroCentred, NormForm::kF32Weight}) {
      for (bool bf16 : {false, true}) {
        if (bf16 && form != NormForm::kPlain) continue;  // the rounding is the plain form's
        RmsNormRow(x.data(), w.data(), out.data(), n, eps, form, bf16);
        for (int64_t i = 0; i < n; ++i) {
          double want = x[i] * rs;
          if (bf16) want = FromBf16(ReferenceRound(static_cast<float>(want)));
          want *= form == NormForm::kZeroCentred ? 1.0 + w[i] : w[i];
          // bf16: x · r may sit on the other side of a rounding boundary than the double value.
          const double tol = bf16 ? std::abs(want) / 128 + 1e-6 : std::abs(want) * 1e-5 + 1e-6;
          ASSERT_NEAR(out[i], want, tol) << "n " << n << " form " << static_cast<int>(form);
        }
        // In place gives the same.
        std::vector<float> in_place = x;
        RmsNormRow(in_place.data(), w.data(), in_place.data(), n, eps, form, bf16);
        for (int64_t i = 0; i < n; ++i) ASSERT_EQ(Bits(in_place[i]), Bits(out[i])) << i;
      }
    }
  }
}

// RotaryRow against its formula written element by element, f32 and bf16 roundings, with
// half-widths that fill no, one and several 16-lane vectors.
TEST(ElementwiseKernelTest, RotaryRowIsItsFormulaBitForBit) {
  auto r = [](float v, bool bf16) { return bf16 ? FromBf16(ReferenceRound(v)) : v; };
  for (bool bf16 : {false, true}) {
    for (int64_t rd : {int64_t{2}, int64_t{34}, int64_t{64}, int64_t{128}}) {
      std::mt19937 rng(static_cast<uint32_t>(rd));
      std::normal_distribution<float> d(0, 2);
      std::vector<float> x(rd), c(rd), s(rd), out(rd);
      for (auto& v : x) v = d(rng);
      for (auto& v : c) v = d(rng) / 2;
      for (auto& v : s) v = d(rng) / 2;
      RotaryRow(x.data(), c.data(), s.data(), out.data(), rd, bf16);
      const int64_t h = rd / 2;
      for (int64_t i = 0; i < rd; ++i) {
        const float rot = i < h ? -x[i + h] : x[i - h];
        const float want = r(r(x[i] * c[i], bf16) + r(rot * s[i], bf16), bf16);
        ASSERT_EQ(Bits(out[i]), Bits(want)) << "rd " << rd << " element " << i;
      }
    }
  }
}

// The fused bf16 row: the same bits as its composition from the f32 helpers, with and without
// the residual, tails included.
TEST(ElementwiseKernelTest, RmsNormRowBf16IsItsCompositionBitForBit) {
  for (int64_t n : {int64_t{1}, int64_t{37}, int64_t{64}, int64_t{1024}}) {
    std::mt19937 rng(static_cast<uint32_t>(n) + 3);
    std::normal_distribution<float> d(0, 3);
    std::vector<float> xf(n), df(n), w(n);
    for (auto& v : xf) v = d(rng);
    for (auto& v : df) v = d(rng);
    for (auto& v : w) v = 1 + d(rng) / 6;
    std::vector<uint16_t> x(n), delta(n);
    RoundToBf16(xf.data(), x.data(), n);
    RoundToBf16(df.data(), delta.data(), n);
    for (NormForm form : {NormForm::kPlain, NormForm::kZeroCentred, NormForm::kF32Weight}) {
      for (bool with_delta : {false, true}) {
        std::vector<float> f(n), g(n);
        WidenBf16(x.data(), f.data(), n);
        std::vector<uint16_t> want_sum(n), want(n), sum(n, 0xFFFF), out(n);
        if (with_delta) {
          WidenBf16(delta.data(), g.data(), n);
          AddRows(f.data(), g.data(), f.data(), n, true);
          RoundToBf16(f.data(), want_sum.data(), n);
        }
        RmsNormRow(f.data(), w.data(), f.data(), n, 1e-6f, form, true);
        RoundToBf16(f.data(), want.data(), n);
        RmsNormRowBf16(x.data(), with_delta ? delta.data() : nullptr, w.data(), sum.data(),
                       out.data(), n, 1e-6f, form);
        EXPECT_EQ(out, want) << "n " << n << " form " << static_cast<int>(form);
        if (with_delta) {
          EXPECT_EQ(sum, want_sum) << "n " << n;
        } else {
          EXPECT_EQ(sum, std::vector<uint16_t>(n, 0xFFFF)) << "sum written without a delta";
        }
      }
    }
  }
}

}  // namespace
}  // namespace moelora
