#include "kernels/elementwise.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "kernels/internal/avx2.h"
#include "kernels/internal/avx512.h"

namespace moelora {

namespace {

using avx512::Exp16;
using avx512::Widen16;

bool HasAvx512() {
  static const bool ok = __builtin_cpu_supports("avx512f");
  return ok;
}

uint16_t Round1(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  if (std::isnan(f)) return 0x7FC0;
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// 16 floats to bf16 bits in the low halves of 32-bit lanes (Round1, 16 at a time).
MOELORA_AVX512F __m512i Round16(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_set1_epi32(0x7FC0));
}

MOELORA_AVX512F void WidenAvx512(const uint16_t* src, float* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(dst + i, Widen16(src + i));
  for (; i < n; ++i) dst[i] = avx2::ToF32(src[i]);
}

MOELORA_AVX512F void RoundAvx512(const float* src, uint16_t* dst, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtepi32_epi16(Round16(_mm512_loadu_ps(src + i))));
  }
  for (; i < n; ++i) dst[i] = Round1(src[i]);
}

MOELORA_AVX512F void RoundTripAvx512(float* v, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    const __m512i r = Round16(_mm512_loadu_ps(v + i));
    _mm512_storeu_ps(v + i, _mm512_castsi512_ps(_mm512_slli_epi32(r, 16)));
  }
  for (; i < n; ++i) v[i] = avx2::ToF32(Round1(v[i]));
}

MOELORA_AVX512F void SiluMulAvx512(const float* g, const float* u, float* out, int64_t n,
                                   bool round_silu) {
  int64_t i = 0;
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i + 16 <= n; i += 16) {
    const __m512 x = _mm512_loadu_ps(g + i);
    __m512 s = _mm512_div_ps(x, _mm512_add_ps(one, Exp16(_mm512_sub_ps(_mm512_setzero_ps(), x))));
    if (round_silu) s = _mm512_castsi512_ps(_mm512_slli_epi32(Round16(s), 16));
    _mm512_storeu_ps(out + i, _mm512_mul_ps(s, _mm512_loadu_ps(u + i)));
  }
  for (; i < n; ++i) {
    float s = g[i] / (1.0f + std::exp(-g[i]));
    if (round_silu) s = avx2::ToF32(Round1(s));
    out[i] = s * u[i];
  }
}

// The 16 lanes added in order, lane 0 first (Dot's final sum).
MOELORA_AVX512F float LaneSumInOrder(__m512 acc) {
  alignas(64) float lanes[16];
  _mm512_store_ps(lanes, acc);
  float s = 0;
  for (float v : lanes) s += v;
  return s;
}

// acc += v · v in lanes, Dot's order (a lane per column modulo 16), then the lanes in order.
MOELORA_AVX512F float SumSquaresAvx512(const float* x, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    const __m512 v = _mm512_loadu_ps(x + c);
    acc = _mm512_add_ps(acc, _mm512_mul_ps(v, v));
  }
  if (c < n) {
    const __mmask16 m = static_cast<__mmask16>((1u << (n - c)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(m, x + c);
    acc = _mm512_mask_add_ps(acc, m, acc, _mm512_mul_ps(v, v));
  }
  return LaneSumInOrder(acc);
}

// Lanes [0, n - c) of a row's 16 from c (all 16 when n - c >= 16).
MOELORA_AVX512F __mmask16 TailMask(int64_t n, int64_t c) {
  return n - c >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>((1u << (n - c)) - 1u);
}

MOELORA_AVX512F __m512 RoundTrip16(__m512 v) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(Round16(v), 16));
}

// The norm's output from xr = x · r and the weight, in `form` (RmsNormRow's header).
MOELORA_AVX512F __m512 NormOut(__m512 xr, __m512 wv, NormForm form, bool round_bf16) {
  if (form == NormForm::kPlain) return _mm512_mul_ps(wv, round_bf16 ? RoundTrip16(xr) : xr);
  if (form == NormForm::kZeroCentred) {
    return _mm512_mul_ps(xr, _mm512_add_ps(_mm512_set1_ps(1.0f), wv));
  }
  return _mm512_mul_ps(wv, xr);
}

MOELORA_AVX512F void RmsNormRowAvx512(const float* x, const float* w, float* out, int64_t n,
                                      float eps, NormForm form, bool round_bf16) {
  const float r = 1.0f / std::sqrt(SumSquaresAvx512(x, n) / static_cast<float>(n) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = TailMask(n, c);
    const __m512 xv = _mm512_maskz_loadu_ps(m, x + c), wv = _mm512_maskz_loadu_ps(m, w + c);
    _mm512_mask_storeu_ps(out + c, m, NormOut(_mm512_mul_ps(xv, rv), wv, form, round_bf16));
  }
}

// 16 bf16 (fewer at a row's tail, the rest read as 0) widened; rounded and stored. AVX-512F
// alone has no masked 16-bit loads and stores: the tail goes through a 16-element copy.
MOELORA_AVX512F __m512 LoadBf16(const uint16_t* p, int64_t left) {
  if (left >= 16) return Widen16(p);
  uint16_t t[16] = {};
  std::memcpy(t, p, static_cast<size_t>(left) * sizeof(uint16_t));
  return Widen16(t);
}

MOELORA_AVX512F void StoreBf16(uint16_t* p, int64_t left, __m512 v) {
  const __m256i h = _mm512_cvtepi32_epi16(Round16(v));
  if (left >= 16) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
    return;
  }
  uint16_t t[16];
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(t), h);
  std::memcpy(p, t, static_cast<size_t>(left) * sizeof(uint16_t));
}

// Two passes over the row where the composition takes six: widen (and add the residual, rounded
// and stored) while summing squares in Dot's lane order; then widen again from L1 and normalise.
MOELORA_AVX512F void RmsNormRowBf16Avx512(const uint16_t* x, const uint16_t* delta, const float* w,
                                          uint16_t* sum, uint16_t* out, int64_t n, float eps,
                                          NormForm form) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t c = 0; c < n; c += 16) {
    __m512 v = LoadBf16(x + c, n - c);
    if (delta != nullptr) {
      v = RoundTrip16(_mm512_add_ps(v, LoadBf16(delta + c, n - c)));
      StoreBf16(sum + c, n - c, v);
    }
    const __mmask16 m = TailMask(n, c);
    acc = _mm512_mask_add_ps(acc, m, acc, _mm512_mul_ps(v, v));
  }
  const float r = 1.0f / std::sqrt(LaneSumInOrder(acc) / static_cast<float>(n) + eps);
  const __m512 rv = _mm512_set1_ps(r);
  const uint16_t* src = delta != nullptr ? sum : x;
  for (int64_t c = 0; c < n; c += 16) {
    const __m512 wv = _mm512_maskz_loadu_ps(TailMask(n, c), w + c);
    StoreBf16(out + c, n - c, NormOut(_mm512_mul_ps(LoadBf16(src + c, n - c), rv), wv, form, true));
  }
}

MOELORA_AVX512F void AddScaledRowAvx512(const float* y, float w, float* acc, int64_t n,
                                        bool round_bf16) {
  const __m512 wv = _mm512_set1_ps(w);
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = TailMask(n, c);
    __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, y + c), wv);
    if (round_bf16) p = RoundTrip16(p);
    __m512 s = _mm512_add_ps(_mm512_maskz_loadu_ps(m, acc + c), p);
    if (round_bf16) s = RoundTrip16(s);
    _mm512_mask_storeu_ps(acc + c, m, s);
  }
}

MOELORA_AVX512F void AddRowsAvx512(const float* a, const float* b, float* out, int64_t n,
                                   bool round_bf16) {
  for (int64_t c = 0; c < n; c += 16) {
    const __mmask16 m = TailMask(n, c);
    __m512 s = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a + c), _mm512_maskz_loadu_ps(m, b + c));
    if (round_bf16) s = RoundTrip16(s);
    _mm512_mask_storeu_ps(out + c, m, s);
  }
}

MOELORA_AVX512F void RotaryRowAvx512(const float* x, const float* c, const float* s, float* out,
                                     int64_t rd, bool round_bf16) {
  const int64_t h = rd / 2;
  auto r = [round_bf16](__m512 v) MOELORA_AVX512F { return round_bf16 ? RoundTrip16(v) : v; };
  const __m512 sign = _mm512_set1_ps(-0.0f);
  for (int64_t i = 0; i < h; i += 16) {
    const __mmask16 m = TailMask(h, i);
    const __m512 xa = _mm512_maskz_loadu_ps(m, x + i), xb = _mm512_maskz_loadu_ps(m, x + h + i);
    const __m512 neg_xb =
        _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(xb), _mm512_castps_si512(sign)));
    const __m512 lo = r(_mm512_add_ps(r(_mm512_mul_ps(xa, _mm512_maskz_loadu_ps(m, c + i))),
                                      r(_mm512_mul_ps(neg_xb, _mm512_maskz_loadu_ps(m, s + i)))));
    const __m512 hi = r(_mm512_add_ps(r(_mm512_mul_ps(xb, _mm512_maskz_loadu_ps(m, c + h + i))),
                                      r(_mm512_mul_ps(xa, _mm512_maskz_loadu_ps(m, s + h + i)))));
    _mm512_mask_storeu_ps(out + i, m, lo);
    _mm512_mask_storeu_ps(out + h + i, m, hi);
  }
}

float RoundTrip1(float v) { return avx2::ToF32(Round1(v)); }

// Per lane, the first index of that lane's largest value (strict >, so NaN and later ties never
// replace it); then the largest lane value, and among the lanes holding it the lowest index.
MOELORA_AVX512F int64_t ArgMaxAvx512(const float* x, int64_t n, float* max) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512i at = _mm512_setzero_si512();
  __m512i idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i step = _mm512_set1_epi32(16);
  int64_t i = 0;
  // 32-bit lane indices: rows of up to 2^31 values (vocabularies are far below).
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
    idx = _mm512_add_epi32(idx, step);
  }
  if (i < n) {
    const __mmask16 live = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 v = _mm512_maskz_loadu_ps(live, x + i);
    const __mmask16 gt = _mm512_mask_cmp_ps_mask(live, v, best, _CMP_GT_OQ);
    best = _mm512_mask_mov_ps(best, gt, v);
    at = _mm512_mask_mov_epi32(at, gt, idx);
  }
  const float mx = _mm512_reduce_max_ps(best);
  if (!(mx > -std::numeric_limits<float>::infinity())) {
    *max = mx;
    return 0;
  }
  const __mmask16 holders = _mm512_cmp_ps_mask(best, _mm512_set1_ps(mx), _CMP_EQ_OQ);
  const int64_t first = _mm512_mask_reduce_min_epi32(holders, at);
  *max = x[first];  // the value itself: max of +0 and -0 may come out as either
  return first;
}

MOELORA_AVX512F void SoftmaxRowAvx512(const void* l, bool bf16, float* p, int64_t n) {
  const auto* lf = static_cast<const float*>(l);
  const auto* lb = static_cast<const uint16_t*>(l);
  auto load = [&](int64_t i, __mmask16 m) MOELORA_AVX512F {
    return bf16 ? LoadBf16(lb + i, n - i) : _mm512_maskz_loadu_ps(m, lf + i);
  };
  const float ninf = -std::numeric_limits<float>::infinity();
  __m512 mv = _mm512_set1_ps(ninf);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n, i);
    mv = _mm512_mask_max_ps(mv, m, mv, load(i, m));
  }
  const __m512 mx = _mm512_set1_ps(_mm512_reduce_max_ps(mv));
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n, i);
    const __m512 e = Exp16(_mm512_sub_ps(load(i, m), mx));
    _mm512_mask_storeu_ps(p + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / _mm512_reduce_add_ps(sum));
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n, i);
    _mm512_mask_storeu_ps(p + i, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, p + i), inv));
  }
}

// max over the row, 16 lanes at a time.
MOELORA_AVX512F float RowMaxAvx512(const float* s, int64_t n) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n, i);
    mv = _mm512_mask_max_ps(mv, m, mv, _mm512_maskz_loadu_ps(m, s + i));
  }
  return _mm512_reduce_max_ps(mv);
}

// s[i] = exp(s[i] - mx) in place; returns their sum.
MOELORA_AVX512F float ExpSumAvx512(float* s, int64_t n, float mx) {
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 m = TailMask(n, i);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + i), mv));
    _mm512_mask_storeu_ps(s + i, m, e);
    sum = _mm512_mask_add_ps(sum, m, sum, e);
  }
  return _mm512_reduce_add_ps(sum);
}

}  // namespace

bool ElementwiseVectorised() { return HasAvx512(); }

float OnlineSoftmaxRow(float* s, int64_t n, float* m, float* l) {
  const float ninf = -std::numeric_limits<float>::infinity();
  const bool v = HasAvx512();
  float top = *m;
  if (v) {
    top = std::max(top, RowMaxAvx512(s, n));
  } else {
    for (int64_t i = 0; i < n; ++i) top = std::max(top, s[i]);
  }
  if (top == ninf) {
    std::fill(s, s + n, 0.0f);
    return 1.0f;
  }
  float sum = 0.0f;
  if (v) {
    sum = ExpSumAvx512(s, n, top);
  } else {
    for (int64_t i = 0; i < n; ++i) {
      s[i] = std::exp(s[i] - top);
      sum += s[i];
    }
  }
  const float c = *m == ninf ? 0.0f : std::exp(*m - top);
  *l = *l * c + sum;
  *m = top;
  return c;
}

void SoftmaxRow(const void* l, bool bf16_logits, float* p, int64_t n) {
  if (n <= 0) return;
  if (HasAvx512()) return SoftmaxRowAvx512(l, bf16_logits, p, n);
  auto at = [&](int64_t i) {
    return bf16_logits ? avx2::ToF32(static_cast<const uint16_t*>(l)[i])
                       : static_cast<const float*>(l)[i];
  };
  float mx = at(0);
  for (int64_t i = 1; i < n; ++i) mx = std::max(mx, at(i));
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    p[i] = std::exp(at(i) - mx);
    sum += p[i];
  }
  const float inv = 1.0f / sum;
  for (int64_t i = 0; i < n; ++i) p[i] *= inv;
}

void RmsNormRow(const float* x, const float* w, float* out, int64_t n, float eps, NormForm form,
                bool round_bf16) {
  if (HasAvx512()) return RmsNormRowAvx512(x, w, out, n, eps, form, round_bf16);
  const float r = 1.0f / std::sqrt(SumSquares(x, n) / static_cast<float>(n) + eps);
  for (int64_t c = 0; c < n; ++c) {
    float o = x[c] * r;
    if (form == NormForm::kPlain) {
      if (round_bf16) o = RoundTrip1(o);
      o = w[c] * o;
    } else if (form == NormForm::kZeroCentred) {
      o = o * (1.0f + w[c]);
    } else {
      o = w[c] * o;
    }
    out[c] = o;
  }
}

void RmsNormRowBf16(const uint16_t* x, const uint16_t* delta, const float* w, uint16_t* sum,
                    uint16_t* out, int64_t n, float eps, NormForm form) {
  if (HasAvx512()) return RmsNormRowBf16Avx512(x, delta, w, sum, out, n, eps, form);
  std::vector<float> f(2 * n);
  WidenBf16(x, f.data(), n);
  if (delta != nullptr) {
    WidenBf16(delta, f.data() + n, n);
    AddRows(f.data(), f.data() + n, f.data(), n, true);
    RoundToBf16(f.data(), sum, n);
  }
  RmsNormRow(f.data(), w, f.data(), n, eps, form, true);
  RoundToBf16(f.data(), out, n);
}

void AddScaledRow(const float* y, float w, float* acc, int64_t n, bool round_bf16) {
  if (HasAvx512()) return AddScaledRowAvx512(y, w, acc, n, round_bf16);
  for (int64_t c = 0; c < n; ++c) {
    float p = y[c] * w;
    if (round_bf16) p = RoundTrip1(p);
    float s = acc[c] + p;
    if (round_bf16) s = RoundTrip1(s);
    acc[c] = s;
  }
}

void RotaryRow(const float* x, const float* c, const float* s, float* out, int64_t rd,
               bool round_bf16) {
  if (HasAvx512()) return RotaryRowAvx512(x, c, s, out, rd, round_bf16);
  auto r = [round_bf16](float v) { return round_bf16 ? RoundTrip1(v) : v; };
  const int64_t h = rd / 2;
  for (int64_t i = 0; i < h; ++i) {
    out[i] = r(r(x[i] * c[i]) + r(-x[i + h] * s[i]));
    out[i + h] = r(r(x[i + h] * c[i + h]) + r(x[i] * s[i + h]));
  }
}

void AddRows(const float* a, const float* b, float* out, int64_t n, bool round_bf16) {
  if (HasAvx512()) return AddRowsAvx512(a, b, out, n, round_bf16);
  for (int64_t c = 0; c < n; ++c) {
    const float s = a[c] + b[c];
    out[c] = round_bf16 ? RoundTrip1(s) : s;
  }
}

void WidenBf16(const uint16_t* src, float* dst, int64_t n) {
  if (HasAvx512()) return WidenAvx512(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = avx2::ToF32(src[i]);
}

void RoundToBf16(const float* src, uint16_t* dst, int64_t n) {
  if (HasAvx512()) return RoundAvx512(src, dst, n);
  for (int64_t i = 0; i < n; ++i) dst[i] = Round1(src[i]);
}

void RoundTripBf16(float* v, int64_t n) {
  if (HasAvx512()) return RoundTripAvx512(v, n);
  for (int64_t i = 0; i < n; ++i) v[i] = avx2::ToF32(Round1(v[i]));
}

void SiluMul(const float* g, const float* u, float* out, int64_t n, bool round_silu) {
  if (HasAvx512()) return SiluMulAvx512(g, u, out, n, round_silu);
  for (int64_t i = 0; i < n; ++i) {
    float s = g[i] / (1.0f + std::exp(-g[i]));
    if (round_silu) s = avx2::ToF32(Round1(s));
    out[i] = s * u[i];
  }
}

float Dot(const float* a, const float* b, int64_t n) {
  // Plain loops over 16 lanes: the compiler vectorises them (SSE2 at least) without changing the
  // order of the f32 additions.
  float acc[16] = {};
  int64_t c = 0;
  for (; c + 16 <= n; c += 16) {
    for (int j = 0; j < 16; ++j) acc[j] += a[c + j] * b[c + j];
  }
  for (; c < n; ++c) acc[c % 16] += a[c] * b[c];
  float s = 0;
  for (float v : acc) s += v;
  return s;
}

float SumSquares(const float* x, int64_t n) { return Dot(x, x, n); }

int64_t ArgMax(const float* x, int64_t n, float* max) {
  if (HasAvx512()) return ArgMaxAvx512(x, n, max);
  float mx = -std::numeric_limits<float>::infinity();
  int64_t best = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (x[i] > mx) mx = x[i], best = i;
  }
  *max = mx;
  return best;
}

}  // namespace moelora
