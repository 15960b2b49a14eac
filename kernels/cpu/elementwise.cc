#include "kernels/elementwise.h"

#include <immintrin.h>

#include <cmath>
#include <cstring>

#include "kernels/internal/avx2.h"
#include "kernels/internal/avx512.h"

// gcc 12 warns inside its own AVX-512 headers (GCC bug 105593, as in skinny_gemm.cc).
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

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

}  // namespace

bool ElementwiseVectorised() { return HasAvx512(); }

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

}  // namespace moelora
