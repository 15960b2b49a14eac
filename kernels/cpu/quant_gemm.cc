#include "kernels/quant_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/skinny_gemm.h"

#define MOELORA_AVX2_F16C __attribute__((target("avx2,fma,f16c")))

namespace moelora {
namespace {

// E2M1 codes times 2 (0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives), so that they are integers:
// a block's values are these times half its scale. -0 reads as +0 on both paths.
constexpr int8_t kE2m1Twice[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

// E8M0: 2^(s - 127); 255 is NaN (OCP Microscaling Formats v1.0, §5.4.1). Halved, to go with
// kE2m1Twice: 2^(s - 128), exact in f32 down to s = 0 (a subnormal).
const std::array<float, 256>& HalfScales() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int s = 0; s < 255; ++s) a[s] = std::ldexp(1.0f, s - 128);
    a[255] = std::numeric_limits<float>::quiet_NaN();
    return a;
  }();
  return t;
}

// float8_e4m3fn: 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, S.1111.111 is NaN.
const std::array<float, 256>& E4m3Values() {
  static const std::array<float, 256> t = [] {
    std::array<float, 256> a{};
    for (int b = 0; b < 256; ++b) {
      const int e = (b >> 3) & 15, m = b & 7;
      float v = e == 0 ? std::ldexp(static_cast<float>(m), -9)
                       : std::ldexp(1.0f + static_cast<float>(m) / 8.0f, e - 7);
      if ((b & 0x7F) == 0x7F) v = std::numeric_limits<float>::quiet_NaN();
      a[b] = (b & 0x80) ? -v : v;
    }
    return a;
  }();
  return t;
}

void Mxfp4RowPortable(const QuantMatrix& w, int64_t r, float* out) {
  const uint8_t* q = w.data + r * w.row_bytes;
  const uint8_t* s = w.e8m0 + r * w.scale_stride;
  const auto& half = HalfScales();
  for (int64_t b = 0; b < w.k / kMxfp4Block; ++b) {
    const float h = half[s[b]];
    for (int64_t i = 0; i < kMxfp4BlockBytes; ++i) {
      const uint8_t byte = q[b * kMxfp4BlockBytes + i];
      out[b * kMxfp4Block + 2 * i] = static_cast<float>(kE2m1Twice[byte & 15]) * h;
      out[b * kMxfp4Block + 2 * i + 1] = static_cast<float>(kE2m1Twice[byte >> 4]) * h;
    }
  }
}

void Fp8RowPortable(const QuantMatrix& w, int64_t r, float* out) {
  const uint8_t* q = w.data + r * w.row_bytes;
  const float* s = w.block_scales + (r / w.block_n) * w.scale_stride;
  const auto& v = E4m3Values();
  for (int64_t c = 0; c < w.k; ++c) out[c] = v[q[c]] * s[c / w.block_k];
}

// The low 8 int8 values of v8 times h, stored at dst.
MOELORA_AVX2_F16C inline void Store8(__m128i v8, __m256 h, float* dst) {
  _mm256_storeu_ps(dst, _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v8)), h));
}

MOELORA_AVX2_F16C void Mxfp4RowAvx2(const QuantMatrix& w, int64_t r, float* out) {
  const uint8_t* q = w.data + r * w.row_bytes;
  const uint8_t* s = w.e8m0 + r * w.scale_stride;
  const auto& half = HalfScales();
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Twice));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  for (int64_t b = 0; b < w.k / kMxfp4Block; ++b) {
    const __m256 h = _mm256_set1_ps(half[s[b]]);
    const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
    const __m128i lo = _mm_and_si128(bytes, low4);
    const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
    // Codes in element order (low nibble first), then their doubled values as int8.
    const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
    const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
    float* o = out + b * kMxfp4Block;
    Store8(v0, h, o);
    Store8(_mm_srli_si128(v0, 8), h, o + 8);
    Store8(v1, h, o + 16);
    Store8(_mm_srli_si128(v1, 8), h, o + 24);
  }
}

// 8 e4m3 codes at p times `scale`: each code's bits moved into an f16 (sign to bit 15, exponent
// and mantissa to bits 7..13: an f16 2^8 times smaller than the e4m3 value, subnormals too),
// widened by F16C and multiplied by 2^8 · scale (exact: a power of two), NaN codes kept NaN.
MOELORA_AVX2_F16C inline __m256 Fp8x8(const uint8_t* p, __m256 scale256) {
  const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)));
  const __m128i mag = _mm_and_si128(b, _mm_set1_epi16(0x7F));
  const __m128i h = _mm_or_si128(_mm_slli_epi16(mag, 7),
                                 _mm_slli_epi16(_mm_and_si128(b, _mm_set1_epi16(0x80)), 8));
  const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), scale256);
  const __m128i nan16 = _mm_cmpeq_epi16(mag, _mm_set1_epi16(0x7F));
  const __m256 nan = _mm256_castsi256_ps(_mm256_cvtepi16_epi32(nan16));
  return _mm256_blendv_ps(v, _mm256_set1_ps(std::numeric_limits<float>::quiet_NaN()), nan);
}

MOELORA_AVX2_F16C void Fp8RowAvx2(const QuantMatrix& w, int64_t r, float* out) {
  const uint8_t* q = w.data + r * w.row_bytes;
  const float* s = w.block_scales + (r / w.block_n) * w.scale_stride;
  const auto& v = E4m3Values();
  for (int64_t c0 = 0; c0 < w.k; c0 += w.block_k) {
    const int64_t c1 = std::min(w.k, c0 + w.block_k);
    const float sc = s[c0 / w.block_k];
    const __m256 sc256 = _mm256_set1_ps(sc * 256.0f);
    int64_t c = c0;
    // sc · 256 overflows for scales above 2^119: those blocks take the table.
    if (std::isfinite(sc * 256.0f)) {
      for (; c + 8 <= c1; c += 8) _mm256_storeu_ps(out + c, Fp8x8(q + c, sc256));
    }
    for (; c < c1; ++c) out[c] = v[q[c]] * sc;
  }
}

bool HasAvx2F16c() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("f16c");
  return ok;
}

// ---- Fused rows: up to kQuantFusedRows x rows, each weight row dequantized in registers ----

MOELORA_AVX2_F16C inline float HorizontalSum(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_shuffle_ps(t, t, 1)));
}

// y[i][r] for r in [n0, n1), i < M: each block's 32 codes widened to f32 once and multiplied
// into every x row's block sum, which the block's scale then weights.
template <int M>
MOELORA_AVX2_F16C void Mxfp4FusedRows(const QuantGemmArgs& a, int64_t n0, int64_t n1) {
  const QuantMatrix& w = a.w;
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(kE2m1Twice));
  const __m128i low4 = _mm_set1_epi8(0x0F);
  const auto& half = HalfScales();
  for (int64_t r = n0; r < n1; ++r) {
    const uint8_t* q = w.data + r * w.row_bytes;
    const uint8_t* s = w.e8m0 + r * w.scale_stride;
    __m256 acc[M];
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t b = 0; b < w.k / kMxfp4Block; ++b) {
      const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + b * 16));
      const __m128i lo = _mm_and_si128(bytes, low4);
      const __m128i hi = _mm_and_si128(_mm_srli_epi16(bytes, 4), low4);
      const __m128i v0 = _mm_shuffle_epi8(lut, _mm_unpacklo_epi8(lo, hi));
      const __m128i v1 = _mm_shuffle_epi8(lut, _mm_unpackhi_epi8(lo, hi));
      const __m256 w0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v0));
      const __m256 w1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v0, 8)));
      const __m256 w2 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v1));
      const __m256 w3 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v1, 8)));
      const __m256 h = _mm256_set1_ps(half[s[b]]);
      for (int i = 0; i < M; ++i) {
        const float* x = a.x + i * a.ldx + b * kMxfp4Block;
        __m256 t = _mm256_mul_ps(w0, _mm256_loadu_ps(x));
        t = _mm256_fmadd_ps(w1, _mm256_loadu_ps(x + 8), t);
        t = _mm256_fmadd_ps(w2, _mm256_loadu_ps(x + 16), t);
        t = _mm256_fmadd_ps(w3, _mm256_loadu_ps(x + 24), t);
        acc[i] = _mm256_fmadd_ps(t, h, acc[i]);
      }
    }
    for (int i = 0; i < M; ++i) a.y[i * a.ldy + r] = HorizontalSum(acc[i]);
  }
}

// 8 e4m3 codes (the low or high half of `bytes`, as interleaved with zero bytes: code << 8 per
// 16-bit lane) as f32 2^-8 times their value: an arithmetic shift by one puts the exponent and
// mantissa at an f16's bits 7..13 and copies the sign into bit 14, which the mask clears.
MOELORA_AVX2_F16C inline __m256 Fp8HalfToF32(__m128i code_hi_bytes) {
  const __m128i h = _mm_and_si128(_mm_srai_epi16(code_hi_bytes, 1), _mm_set1_epi16(-16385));
  return _mm256_cvtph_ps(h);
}

// The same for block FP8 with block_k a multiple of 16 and no NaN codes (the loader refuses
// them): 16 codes at a time, each block_k run summed per x row and then weighted by its scale
// (times 2^8, which the codes' f16 form is short of).
template <int M>
MOELORA_AVX2_F16C void Fp8FusedRows(const QuantGemmArgs& a, int64_t n0, int64_t n1) {
  const QuantMatrix& w = a.w;
  const __m128i zero = _mm_setzero_si128();
  const auto& v = E4m3Values();
  for (int64_t r = n0; r < n1; ++r) {
    const uint8_t* q = w.data + r * w.row_bytes;
    const float* s = w.block_scales + (r / w.block_n) * w.scale_stride;
    __m256 acc[M];
    float tail[M] = {};
    for (int i = 0; i < M; ++i) acc[i] = _mm256_setzero_ps();
    for (int64_t c0 = 0; c0 < w.k; c0 += w.block_k) {
      const int64_t c1 = std::min(w.k, c0 + w.block_k);
      const float sc = s[c0 / w.block_k];
      __m256 t[M];
      for (int i = 0; i < M; ++i) t[i] = _mm256_setzero_ps();
      int64_t c = c0;
      for (; c + 16 <= c1; c += 16) {
        const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(q + c));
        const __m256 lo = Fp8HalfToF32(_mm_unpacklo_epi8(zero, bytes));
        const __m256 hi = Fp8HalfToF32(_mm_unpackhi_epi8(zero, bytes));
        for (int i = 0; i < M; ++i) {
          const float* x = a.x + i * a.ldx + c;
          t[i] = _mm256_fmadd_ps(lo, _mm256_loadu_ps(x), t[i]);
          t[i] = _mm256_fmadd_ps(hi, _mm256_loadu_ps(x + 8), t[i]);
        }
      }
      const __m256 sc256 = _mm256_set1_ps(sc * 256.0f);
      for (int i = 0; i < M; ++i) acc[i] = _mm256_fmadd_ps(t[i], sc256, acc[i]);
      for (; c < c1; ++c) {
        for (int i = 0; i < M; ++i) tail[i] += v[q[c]] * sc * a.x[i * a.ldx + c];
      }
    }
    for (int i = 0; i < M; ++i) a.y[i * a.ldy + r] = HorizontalSum(acc[i]) + tail[i];
  }
}

template <int M>
void FusedRows(const QuantGemmArgs& a, int64_t n0, int64_t n1) {
  if (a.w.format == QuantFormat::kMxfp4) {
    Mxfp4FusedRows<M>(a, n0, n1);
  } else {
    Fp8FusedRows<M>(a, n0, n1);
  }
}

// Whether the fused rows serve this product: AVX2, few x rows, and (FP8) whole 16-code runs in
// each block with scales that stay finite times 2^8.
bool Fused(const QuantGemmArgs& a, bool vectorized) {
  if (!vectorized || !HasAvx2F16c() || a.m > kQuantFusedRows) return false;
  return a.w.format == QuantFormat::kMxfp4 || a.w.block_k % 16 == 0;
}

}  // namespace

bool QuantVectorized() { return HasAvx2F16c(); }

absl::Status ValidateQuantGemm(const QuantGemmArgs& a) {
  const QuantMatrix& w = a.w;
  const bool mx = w.format == QuantFormat::kMxfp4;
  if (a.m < 0 || w.n < 0 || w.k < 1 || a.x == nullptr || a.y == nullptr || w.data == nullptr) {
    return absl::InvalidArgumentError("quantized GEMM: empty sizes or null pointers");
  }
  if (a.ldx < w.k || a.ldy < w.n || w.row_bytes < (mx ? w.k / 2 : w.k)) {
    return absl::InvalidArgumentError(
        absl::StrCat("quantized GEMM: strides ldx ", a.ldx, ", ldy ", a.ldy, ", row_bytes ",
                     w.row_bytes, " shorter than the rows (k ", w.k, ", n ", w.n, ")"));
  }
  if (mx && (w.k % kMxfp4Block != 0 || w.e8m0 == nullptr || w.scale_stride < w.k / kMxfp4Block)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "quantized GEMM: MXFP4 rows of ", w.k, " values need whole blocks of 32 and their scales"));
  }
  if (!mx && (w.block_n < 1 || w.block_k < 1 || w.block_scales == nullptr ||
              w.scale_stride < (w.k + w.block_k - 1) / w.block_k)) {
    return absl::InvalidArgumentError("quantized GEMM: FP8 blocks must be positive, with scales");
  }
  return absl::OkStatus();
}

void DequantizeRows(const QuantMatrix& w, int64_t r0, int64_t r1, float* out, int64_t ld,
                    bool vectorized) {
  const bool avx2 = vectorized && HasAvx2F16c();
  for (int64_t r = r0; r < r1; ++r) {
    float* o = out + (r - r0) * ld;
    if (w.format == QuantFormat::kMxfp4) {
      avx2 ? Mxfp4RowAvx2(w, r, o) : Mxfp4RowPortable(w, r, o);
    } else {
      avx2 ? Fp8RowAvx2(w, r, o) : Fp8RowPortable(w, r, o);
    }
  }
}

void QuantGemmRows(const QuantGemmArgs& a, int64_t n0, int64_t n1, bool vectorized) {
  const int64_t k = a.w.k;
  if (n1 <= n0 || a.m <= 0) return;
  if (Fused(a, vectorized)) {
    switch (a.m) {
      case 1:
        return FusedRows<1>(a, n0, n1);
      case 2:
        return FusedRows<2>(a, n0, n1);
      case 3:
        return FusedRows<3>(a, n0, n1);
      case 4:
        return FusedRows<4>(a, n0, n1);
      case 5:
        return FusedRows<5>(a, n0, n1);
      case 6:
        return FusedRows<6>(a, n0, n1);
      case 7:
        return FusedRows<7>(a, n0, n1);
      default:
        return FusedRows<8>(a, n0, n1);
    }
  }
  // Whole groups of 4 weight rows where they fit (the skinny kernel's tiles take 4 at a time).
  int64_t tile_rows =
      std::max<int64_t>(1, std::min<int64_t>(16, kQuantTileBytes / (4 * std::max<int64_t>(k, 1))));
  if (tile_rows > 4) tile_rows -= tile_rows % 4;
  // The tile buffer of this thread: sized by the largest tile it has held (bounded by
  // kQuantTileBytes, or one row of the widest k).
  thread_local std::vector<float> tile;
  if (static_cast<int64_t>(tile.size()) < tile_rows * k) tile.resize(tile_rows * k);
  const bool skinny = vectorized && SkinnyGemmAvailable();
  for (int64_t r0 = n0; r0 < n1; r0 += tile_rows) {
    const int64_t r1 = std::min(n1, r0 + tile_rows), rows = r1 - r0;
    DequantizeRows(a.w, r0, r1, tile.data(), k, vectorized);
    if (skinny) {
      SkinnyGemmArgs s;
      s.x = a.x;
      s.ldx = a.ldx;
      s.w = tile.data();
      s.w_type = SkinnyWeight::kF32;
      s.y = a.y + r0;
      s.ldy = a.ldy;
      s.m = a.m;
      s.n = rows;
      s.k = k;
      SkinnyGemmRows(s, 0, rows);
      continue;
    }
    for (int64_t i = 0; i < a.m; ++i) {
      const float* x = a.x + i * a.ldx;
      for (int64_t r = 0; r < rows; ++r) {
        const float* t = tile.data() + r * k;
        float acc = 0.0f;
        for (int64_t c = 0; c < k; ++c) acc += x[c] * t[c];
        a.y[i * a.ldy + r0 + r] = acc;
      }
    }
  }
}

}  // namespace moelora
