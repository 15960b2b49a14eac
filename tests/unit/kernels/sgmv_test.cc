#include "kernels/sgmv.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "tests/testing/bf16.h"

namespace moelora {
namespace {

using testing::FromBf16;
using testing::ToBf16;

struct Case {
  int64_t in_dim, out_dim, r_stride;
  bool row_list;  // segment entries index a permuted row list (the dense layer's case)
};

class SgmvTest : public ::testing::TestWithParam<Case> {};

// Segments of 1–9 rows (blocks of four and every tail), ranks below, at and not a multiple of
// 8 and 16, output widths with 16-, 8- and 1-column tails, strided x and out, in f32 and bf16,
// on every instruction set the CPU has (the AVX2 and AVX-512 paths giving the same bits):
// out += B (A x) per row against a double-precision reference on the same (widened) weights;
// columns past out_dim and rows of no segment stay untouched. Every other segment's A is packed
// at its own rank (SgmvSegment::a_stride), as CPU slots hold it.
TEST_P(SgmvTest, MatchesADoubleReferenceInF32AndBf16) {
  const auto [in_dim, out_dim, R, row_list] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(in_dim * 7919 + out_dim * 31 + R));
  std::normal_distribution<float> d;
  const std::vector<int64_t> lens = {1, 4, 3, 9, 2, 5, 8, 6, 7};
  int64_t rows_total = 0;
  for (int64_t n : lens) rows_total += n;
  const int64_t unused = 3;  // rows no segment covers (T = 48)
  const int64_t T = rows_total + unused, ldx = in_dim + 2, ldo = out_dim + 3;
  const int64_t S = static_cast<int64_t>(lens.size());
  std::vector<float> x(T * ldx), a(S * in_dim * R), b(S * R * out_dim), out0(T * ldo);
  for (auto& v : x) v = d(rng);
  for (auto& v : a) v = d(rng);
  for (auto& v : b) v = d(rng);
  for (auto& v : out0) v = d(rng);
  std::vector<uint16_t> ab(a.size()), bb(b.size());
  for (size_t i = 0; i < a.size(); ++i) ab[i] = ToBf16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) bb[i] = ToBf16(b[i]);
  // The row list: the first rows_total entries of a permutation of the T rows (5 is prime to
  // T = 48), so segments hit scattered, distinct rows.
  std::vector<int64_t> rows(rows_total);
  for (int64_t i = 0; i < rows_total; ++i) rows[i] = (i * 5 + 2) % T;
  const std::vector<int32_t> ranks = {1, 7, 8, 16, static_cast<int32_t>(R), 13, 0, 24, 9};
  for (SgmvWeight t : {SgmvWeight::kF32, SgmvWeight::kBF16}) {
    std::vector<SgmvSegment> segs;
    int64_t begin = 0;
    for (int64_t s = 0; s < S; ++s) {
      const int32_t r = std::min<int32_t>(ranks[s], static_cast<int32_t>(R));
      const size_t ao = s * in_dim * R, bo = s * R * out_dim;
      segs.push_back({begin, begin + lens[s],
                      t == SgmvWeight::kF32 ? static_cast<const void*>(a.data() + ao)
                                            : static_cast<const void*>(ab.data() + ao),
                      t == SgmvWeight::kF32 ? static_cast<const void*>(b.data() + bo)
                                            : static_cast<const void*>(bb.data() + bo),
                      r});
      if (s % 2 == 1 && r > 0) segs.back().a_stride = r;
      begin += lens[s];
    }
    // Every instruction set this CPU has; the vector ones must agree bit for bit.
    std::vector<float> vector_out;
    for (SgmvIsa isa : {SgmvIsa::kPortable, SgmvIsa::kAvx2, SgmvIsa::kAvx512}) {
      if (isa > SgmvBestIsa()) continue;
      SCOPED_TRACE(isa == SgmvIsa::kPortable ? "portable"
                   : isa == SgmvIsa::kAvx2   ? "avx2"
                                             : "avx512");
      std::vector<float> out = out0;
      SgmvParams p{x.data(), ldx,     out.data(), ldo, row_list ? rows.data() : nullptr,
                   in_dim,   out_dim, R,          t};
      SgmvCpuWith(isa, p, segs.data(), 0, 4);  // two calls, as two threads make them
      SgmvCpuWith(isa, p, segs.data(), 4, S);
      if (isa != SgmvIsa::kPortable) {
        if (vector_out.empty()) {
          vector_out = out;
        } else {
          for (size_t i = 0; i < out.size(); ++i)
            ASSERT_EQ(out[i], vector_out[i]) << "element " << i;
        }
      }
      auto av = [&](size_t i) { return t == SgmvWeight::kF32 ? a[i] : FromBf16(ab[i]); };
      auto bv = [&](size_t i) { return t == SgmvWeight::kF32 ? b[i] : FromBf16(bb[i]); };
      std::vector<bool> touched(T, false);
      for (int64_t s = 0; s < S; ++s) {
        const int64_t r = segs[s].rank, stride = segs[s].a_stride > 0 ? segs[s].a_stride : R;
        for (int64_t i = segs[s].begin; i < segs[s].end; ++i) {
          const int64_t row = row_list ? rows[i] : i;
          touched[row] = true;
          std::vector<double> mid(r, 0.0), mag_mid(r, 0.0);
          for (int64_t j = 0; j < r; ++j) {
            for (int64_t k = 0; k < in_dim; ++k) {
              const double v = av(s * in_dim * R + k * stride + j) * x[row * ldx + k];
              mid[j] += v;
              mag_mid[j] += std::abs(v);
            }
          }
          for (int64_t c = 0; c < out_dim; ++c) {
            double ref = out0[row * ldo + c], mag = std::abs(ref);
            for (int64_t j = 0; j < r; ++j) {
              const double bj = bv(s * R * out_dim + j * out_dim + c);
              ref += bj * mid[j];
              mag += std::abs(bj) * mag_mid[j];
            }
            ASSERT_NEAR(out[row * ldo + c], ref, 2e-6 * mag + 1e-6)
                << "segment " << s << " row " << row << " col " << c
                << (t == SgmvWeight::kF32 ? " f32" : " bf16");
          }
          for (int64_t c = out_dim; c < ldo; ++c) {
            ASSERT_EQ(out[row * ldo + c], out0[row * ldo + c]) << "wrote past out_dim";
          }
        }
      }
      for (int64_t row = 0; row < T; ++row) {
        if (touched[row]) continue;
        for (int64_t c = 0; c < ldo; ++c) {
          ASSERT_EQ(out[row * ldo + c], out0[row * ldo + c])
              << "row " << row << " is in no segment";
        }
      }
    }
  }
}

// bf16 activations (x_bf16, out_bf16, each alone and both): the same f32 arithmetic as the f32
// path on the widened rows, so out is exactly the f32 path's result rounded to bf16 once, and
// untouched elements keep their bits.
TEST_P(SgmvTest, Bf16ActivationsRoundTheF32PathOnce) {
  const auto [in_dim, out_dim, R, row_list] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(in_dim * 131 + out_dim + R));
  std::normal_distribution<float> d;
  const int64_t T = 20, ldx = in_dim + 2, ldo = out_dim + 3;
  std::vector<uint16_t> xb(T * ldx), ob(T * ldo), ab(2 * in_dim * R), bb(2 * R * out_dim);
  for (auto& v : xb) v = ToBf16(d(rng));
  for (auto& v : ob) v = ToBf16(d(rng));
  for (auto& v : ab) v = ToBf16(d(rng));
  for (auto& v : bb) v = ToBf16(d(rng));
  std::vector<float> xf(xb.size()), of(ob.size());
  for (size_t i = 0; i < xb.size(); ++i) xf[i] = FromBf16(xb[i]);
  for (size_t i = 0; i < ob.size(); ++i) of[i] = FromBf16(ob[i]);
  std::vector<int64_t> rows(T);
  for (int64_t i = 0; i < T; ++i) rows[i] = (i * 7 + 3) % T;
  const int32_t r1 = std::min<int32_t>(13, static_cast<int32_t>(R));
  const std::vector<SgmvSegment> segs = {
      {0, 7, ab.data(), bb.data(), static_cast<int32_t>(R)},
      {9, 15, ab.data() + in_dim * R, bb.data() + R * out_dim, r1}};  // rows 7, 8, 15.. untouched
  std::vector<float> want = of;
  SgmvParams pf{xf.data(), ldx, want.data(),      ldo, row_list ? rows.data() : nullptr, in_dim,
                out_dim,   R,   SgmvWeight::kBF16};
  SgmvCpu(pf, segs.data(), 0, 2);
  for (int mode = 0; mode < 3; ++mode) {  // 0: both bf16, 1: x only, 2: out only
    SCOPED_TRACE(mode == 0 ? "x and out bf16" : mode == 1 ? "x bf16" : "out bf16");
    std::vector<uint16_t> out = ob;
    std::vector<float> out32 = of;
    SgmvParams p = pf;
    p.x = mode == 2 ? xf.data() : nullptr;
    p.x_bf16 = mode == 2 ? nullptr : xb.data();
    p.out = mode == 1 ? out32.data() : nullptr;
    p.out_bf16 = mode == 1 ? nullptr : out.data();
    SgmvCpu(p, segs.data(), 0, 2);
    for (int64_t i = 0; i < T * ldo; ++i) {
      if (mode == 1) {
        ASSERT_EQ(out32[i], want[i]) << "element " << i;
      } else {
        ASSERT_EQ(out[i], ToBf16(want[i])) << "element " << i;
      }
    }
  }
}

// A segment with a second B (b2_t) and an out_col: exactly what two segments give, one with
// B at out_col and one with the second B at out_col + out_dim, on every instruction set, with f32
// and bf16 weights, f32 rows and bf16 rows in place; the columns outside stay untouched. Mixed
// with plain segments at other offsets over the same rows, split across two calls as two threads
// make them.
TEST_P(SgmvTest, ASecondBSharesTheShrinkBitForBit) {
  const auto [in_dim, out_dim, R, row_list] = GetParam();
  std::mt19937 rng(static_cast<uint32_t>(in_dim * 17 + out_dim * 3 + R));
  std::normal_distribution<float> d;
  const int64_t T = 24, ldx = in_dim + 1, ldo = 3 * out_dim + 5;  // out_col 2, then 2 out_dim
  std::vector<float> x(T * ldx), a(2 * in_dim * R), b(3 * R * out_dim), out0(T * ldo);
  for (auto& v : x) v = d(rng);
  for (auto& v : a) v = d(rng);
  for (auto& v : b) v = d(rng);
  for (auto& v : out0) v = d(rng);
  std::vector<uint16_t> ab(a.size()), bb(b.size()), xb(x.size()), ob(out0.size());
  for (size_t i = 0; i < a.size(); ++i) ab[i] = ToBf16(a[i]);
  for (size_t i = 0; i < b.size(); ++i) bb[i] = ToBf16(b[i]);
  for (size_t i = 0; i < x.size(); ++i) xb[i] = ToBf16(x[i]);
  for (size_t i = 0; i < out0.size(); ++i) ob[i] = ToBf16(out0[i]);
  std::vector<int64_t> rows(T);
  for (int64_t i = 0; i < T; ++i) rows[i] = (i * 5 + 1) % T;
  const int32_t r = std::min<int32_t>(11, static_cast<int32_t>(R));
  for (SgmvWeight t : {SgmvWeight::kF32, SgmvWeight::kBF16}) {
    const bool f32 = t == SgmvWeight::kF32;
    auto A = [&](int64_t i) -> const void* {
      return f32 ? static_cast<const void*>(a.data() + i * in_dim * R) : ab.data() + i * in_dim * R;
    };
    auto B = [&](int64_t i) -> const void* {
      return f32 ? static_cast<const void*>(b.data() + i * R * out_dim)
                 : bb.data() + i * R * out_dim;
    };
    // Entries 0-8: A0 into B0 | B1 from column 2; entries 13-20: A1 into B2 | B0 from column 2;
    // the rest untouched.
    const std::vector<SgmvSegment> fused = {{0, 9, A(0), B(0), r, B(1), 2},
                                            {13, 21, A(1), B(2), r, B(0), 2}};
    const std::vector<SgmvSegment> split = {{0, 9, A(0), B(0), r, nullptr, 2},
                                            {0, 9, A(0), B(1), r, nullptr, 2 + out_dim},
                                            {13, 21, A(1), B(2), r, nullptr, 2},
                                            {13, 21, A(1), B(0), r, nullptr, 2 + out_dim}};
    for (SgmvIsa isa : {SgmvIsa::kPortable, SgmvIsa::kAvx2, SgmvIsa::kAvx512}) {
      if (isa > SgmvBestIsa()) continue;
      for (bool bf16_rows : {false, true}) {
        SCOPED_TRACE(::testing::Message()
                     << "isa " << static_cast<int>(isa) << (f32 ? " f32" : " bf16")
                     << (bf16_rows ? " weights, bf16 rows" : " weights"));
        SgmvParams p{x.data(), ldx,     out0.data(), ldo, row_list ? rows.data() : nullptr,
                     in_dim,   out_dim, R,           t};
        if (bf16_rows) {
          p.x = nullptr;
          p.out = nullptr;
          p.x_bf16 = xb.data();
        }
        auto run = [&](const std::vector<SgmvSegment>& segs) {
          std::vector<float> out = out0;
          std::vector<uint16_t> outb = ob;
          SgmvParams q = p;
          if (bf16_rows) {
            q.out_bf16 = outb.data();
          } else {
            q.out = out.data();
          }
          const int64_t n = static_cast<int64_t>(segs.size());
          SgmvCpuWith(isa, q, segs.data(), 0, n / 2);
          SgmvCpuWith(isa, q, segs.data(), n / 2, n);
          std::vector<float> got(out.size());
          for (size_t i = 0; i < got.size(); ++i) got[i] = bf16_rows ? FromBf16(outb[i]) : out[i];
          return got;
        };
        const std::vector<float> want = run(split), got = run(fused);
        int64_t changed = 0;
        for (int64_t i = 0; i < T * ldo; ++i) {
          ASSERT_EQ(got[i], want[i]) << "element " << i;
          const float before = bf16_rows ? FromBf16(ob[i]) : out0[i];
          const int64_t row = row_list ? -1 : i / ldo, col = i % ldo;
          if (got[i] != before) {
            ++changed;
            ASSERT_TRUE(col >= 2 && col < 2 + 2 * out_dim) << "column " << col << " written";
            if (row >= 0) {
              ASSERT_TRUE(row < 9 || (row >= 13 && row < 21)) << "row " << row;
            }
          }
        }
        EXPECT_GT(changed, 17 * out_dim) << "the segments added next to nothing";
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Shapes, SgmvTest,
                         ::testing::Values(Case{5, 3, 16, false}, Case{64, 40, 16, true},
                                           Case{100, 129, 24, false}, Case{33, 16, 8, true},
                                           Case{128, 264, 64, true}));

}  // namespace
}  // namespace moelora
