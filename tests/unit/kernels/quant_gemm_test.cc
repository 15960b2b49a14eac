#include "kernels/quant_gemm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

namespace moelora {
namespace {

// The reference decodings, written from the format texts rather than shared with the kernel:
// E2M1 as sign · 2^(e - 1) · (1 + m / 2) (e > 0) or sign · m / 2 (e = 0), E8M0 as 2^(s - 127)
// (255: NaN), E4M3 ("fn": no infinities, S.1111.111 NaN) as sign · 2^(e - 7) · (1 + m / 8) or
// sign · 2^-6 · m / 8.
double E2m1(int code) {
  const int s = code >> 3, e = (code >> 1) & 3, m = code & 1;
  const double v = e == 0 ? m * 0.5 : std::ldexp(1.0 + m * 0.5, e - 1);
  return s ? -v : v;
}
double E8m0(int s) {
  return s == 255 ? std::numeric_limits<double>::quiet_NaN() : std::ldexp(1.0, s - 127);
}
double E4m3(int b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return std::numeric_limits<double>::quiet_NaN();
  const double v = e == 0 ? std::ldexp(m / 8.0, -6) : std::ldexp(1.0 + m / 8.0, e - 7);
  return s ? -v : v;
}

struct Mxfp4 {
  int64_t n, k;
  std::vector<uint8_t> data, scales;
  QuantMatrix View() const {
    QuantMatrix w;
    w.format = QuantFormat::kMxfp4;
    w.data = data.data();
    w.row_bytes = k / 2;
    w.n = n;
    w.k = k;
    w.e8m0 = scales.data();
    w.scale_stride = k / 32;
    return w;
  }
  double At(int64_t r, int64_t c) const {
    const uint8_t byte = data[r * (k / 2) + c / 2];
    return E2m1(c % 2 ? byte >> 4 : byte & 15) * E8m0(scales[r * (k / 32) + c / 32]);
  }
};

Mxfp4 RandomMxfp4(int64_t n, int64_t k, uint32_t seed, int scale_lo, int scale_hi) {
  std::mt19937 g(seed);
  Mxfp4 m{n, k, std::vector<uint8_t>(n * k / 2), std::vector<uint8_t>(n * k / 32)};
  for (auto& b : m.data) b = static_cast<uint8_t>(g());
  std::uniform_int_distribution<int> s(scale_lo, scale_hi);
  for (auto& b : m.scales) b = static_cast<uint8_t>(s(g));
  return m;
}

struct Fp8 {
  int64_t n, k, bn, bk;
  std::vector<uint8_t> data;
  std::vector<float> scales;
  QuantMatrix View() const {
    QuantMatrix w;
    w.format = QuantFormat::kFp8Block;
    w.data = data.data();
    w.row_bytes = k;
    w.n = n;
    w.k = k;
    w.block_scales = scales.data();
    w.scale_stride = (k + bk - 1) / bk;
    w.block_n = bn;
    w.block_k = bk;
    return w;
  }
  double At(int64_t r, int64_t c) const {
    return static_cast<double>(static_cast<float>(E4m3(data[r * k + c]) *
                                                  scales[(r / bn) * ((k + bk - 1) / bk) + c / bk]));
  }
};

Fp8 RandomFp8(int64_t n, int64_t k, int64_t bn, int64_t bk, uint32_t seed, bool nan_codes) {
  std::mt19937 g(seed);
  Fp8 f{n,
        k,
        bn,
        bk,
        std::vector<uint8_t>(n * k),
        std::vector<float>(((n + bn - 1) / bn) * ((k + bk - 1) / bk))};
  for (auto& b : f.data) {
    b = static_cast<uint8_t>(g());
    if (!nan_codes && (b & 0x7F) == 0x7F) b ^= 1;
  }
  std::uniform_real_distribution<float> s(1e-4f, 2e-2f);
  for (auto& v : f.scales) v = s(g);
  return f;
}

void ExpectSameValue(double want, float got, const char* what, int64_t r, int64_t c) {
  if (std::isnan(want)) {
    EXPECT_TRUE(std::isnan(got)) << what << " (" << r << ", " << c << ")";
  } else {
    EXPECT_EQ(static_cast<float>(want), got) << what << " (" << r << ", " << c << ")";
  }
}

// Every code in every position, with scales across E8M0's range (0: a subnormal power of two,
// 254: the largest, 255: NaN), on both paths, against the reference decoding.
TEST(QuantGemmTest, Mxfp4DequantizesAsTheFormatSays) {
  for (auto [lo, hi] : {std::pair{0, 255}, std::pair{118, 130}}) {
    const Mxfp4 m = RandomMxfp4(7, 96, 1 + lo, lo, hi);
    for (bool vec : {false, true}) {
      std::vector<float> out(m.n * 100, -1.0f);
      DequantizeRows(m.View(), 2, 7, out.data(), 100, vec);
      for (int64_t r = 2; r < 7; ++r) {
        for (int64_t c = 0; c < m.k; ++c) {
          ExpectSameValue(m.At(r, c), out[(r - 2) * 100 + c], vec ? "avx2" : "portable", r, c);
        }
        EXPECT_EQ(out[(r - 2) * 100 + m.k], -1.0f) << "wrote past k";
      }
    }
  }
}

// All 256 codes (subnormals, ±0, the largest, NaN), k not a multiple of 8 nor of the block,
// rows across two row blocks; both paths against the reference, bit for bit.
TEST(QuantGemmTest, Fp8BlockDequantizesAsTheFormatSays) {
  Fp8 f = RandomFp8(9, 203, 4, 64, 7, /*nan_codes=*/true);
  for (int b = 0; b < 256; ++b) f.data[b] = static_cast<uint8_t>(b);
  f.scales[0] = std::ldexp(1.0f, 120);  // 2^8 times it overflows: the table path
  for (bool vec : {false, true}) {
    std::vector<float> out(f.n * f.k);
    DequantizeRows(f.View(), 0, f.n, out.data(), f.k, vec);
    for (int64_t r = 0; r < f.n; ++r) {
      for (int64_t c = 0; c < f.k; ++c) {
        ExpectSameValue(f.At(r, c), out[r * f.k + c], vec ? "avx2" : "portable", r, c);
      }
    }
  }
}

// y = x · wᵀ over column ranges, m from 1 to beyond a tile, against a double-precision product
// of x and the reference-decoded w.
template <typename W>
void CheckProduct(const W& w, int64_t m, int64_t n0, int64_t n1, bool vec) {
  std::mt19937 g(static_cast<uint32_t>(m * 131 + n0));
  std::normal_distribution<float> d(0.0f, 1.0f);
  const int64_t ldx = w.k + 3, ldy = w.n + 5;
  std::vector<float> x(m * ldx), y(m * ldy, 7.0f);
  for (auto& v : x) v = d(g);
  QuantGemmArgs a;
  a.x = x.data();
  a.ldx = ldx;
  a.m = m;
  a.w = w.View();
  a.y = y.data();
  a.ldy = ldy;
  QuantGemmRows(a, n0, n1, vec);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t r = 0; r < w.n; ++r) {
      if (r < n0 || r >= n1) {
        EXPECT_EQ(y[i * ldy + r], 7.0f) << "wrote outside [n0, n1)";
        continue;
      }
      double want = 0, mag = 0;
      for (int64_t c = 0; c < w.k; ++c) {
        want += static_cast<double>(x[i * ldx + c]) * w.At(r, c);
        mag += std::fabs(static_cast<double>(x[i * ldx + c]) * w.At(r, c));
      }
      EXPECT_NEAR(y[i * ldy + r], want, 1e-5 * mag + 1e-30)
          << (vec ? "avx2" : "portable") << " m=" << m << " (" << i << ", " << r << ")";
    }
  }
}

TEST(QuantGemmTest, Mxfp4ProductMatchesAReference) {
  // k = 2880 (GPT-OSS's hidden size): a tile of 5 rows; k = 64: tiles of 16.
  for (int64_t k : {int64_t{64}, int64_t{2880}}) {
    const Mxfp4 w = RandomMxfp4(37, k, static_cast<uint32_t>(k), 120, 128);
    for (int64_t m : {1, 3, 6, 9, 40}) {
      for (bool vec : {false, true}) {
        CheckProduct(w, m, 0, w.n, vec);
        CheckProduct(w, m, 5, 22, vec);
      }
    }
  }
}

TEST(QuantGemmTest, Fp8BlockProductMatchesAReference) {
  const Fp8 w = RandomFp8(150, 300, 128, 128, 3, /*nan_codes=*/false);
  for (int64_t m : {1, 4, 8, 33}) {
    for (bool vec : {false, true}) {
      CheckProduct(w, m, 0, w.n, vec);
      CheckProduct(w, m, 120, 140, vec);
    }
  }
}

// What a caller can get wrong is named before anything is read.
TEST(QuantGemmTest, ValidateNamesBadArguments) {
  const Mxfp4 w = RandomMxfp4(4, 64, 5, 120, 128);
  std::vector<float> x(64), y(4);
  QuantGemmArgs a;
  a.x = x.data();
  a.ldx = 64;
  a.m = 1;
  a.w = w.View();
  a.y = y.data();
  a.ldy = 4;
  EXPECT_TRUE(ValidateQuantGemm(a).ok());
  QuantGemmArgs b = a;
  b.ldx = 63;
  EXPECT_NE(ValidateQuantGemm(b).message().find("strides"), absl::string_view::npos);
  b = a;
  b.w.k = 48;
  EXPECT_NE(ValidateQuantGemm(b).message().find("whole blocks of 32"), absl::string_view::npos);
  b = a;
  b.y = nullptr;
  EXPECT_EQ(ValidateQuantGemm(b).code(), absl::StatusCode::kInvalidArgument);
  const Fp8 f = RandomFp8(4, 64, 128, 128, 3, false);
  b = a;
  b.w = f.View();
  EXPECT_TRUE(ValidateQuantGemm(b).ok());
  b.w.block_k = 0;
  EXPECT_NE(ValidateQuantGemm(b).message().find("FP8 blocks"), absl::string_view::npos);
}

}  // namespace
}  // namespace moelora
