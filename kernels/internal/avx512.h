// AVX-512 helpers shared by the hand-written CPU kernels (elementwise.cc, paged_attention.cc,
// sgmv.cc, skinny_gemm.cc, amx_gemm.cc): bf16 widening, exp, the horizontal sums of 16 vectors at
// once, and the target macros. Functions marked MOELORA_AVX512F / MOELORA_AVX512 are compiled for
// those sets whatever the build's -march, so callers must check the CPU first. Internal to
// kernels/.
#ifndef MOELORA_KERNELS_INTERNAL_AVX512_H_
#define MOELORA_KERNELS_INTERNAL_AVX512_H_

#include <immintrin.h>

#include <cstdint>

// gcc 12 warns inside its own AVX-512 headers wherever they are inlined (their "undefined"
// vectors are self-initialised: GCC bug 105593, fixed in gcc 13), so every kernel file that
// includes this one has the two uninitialised-use warnings off.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

#define MOELORA_AVX512F __attribute__((target("avx512f")))
// AVX-512 F, BW and VL with AVX2 + FMA: the skinny GEMM's and SGMV's 512-bit paths (16-bit
// masked loads, 256-bit helpers inlined into them).
#define MOELORA_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
// The same with AVX512-BF16 (vdpbf16ps, vcvtneps2bf16): the skinny and wide GEMMs' bf16 paths.
#define MOELORA_AVX512_BF16 __attribute__((target("avx512bf16,avx512f,avx512bw,avx512vl,avx2,fma")))

namespace moelora {
namespace avx512 {

// 16 bf16 -> 16 f32, exact (a bf16 is the top half of an f32).
MOELORA_AVX512F inline __m512 Widen16(const uint16_t* p) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}

MOELORA_AVX512F inline __m512 Load16(const float* p) { return _mm512_loadu_ps(p); }
MOELORA_AVX512F inline __m512 Load16(const uint16_t* p) { return Widen16(p); }

// exp(x) for 16 lanes: x = n ln2 + r (Cody–Waite split of ln2), |r| <= ln2 / 2, exp(r) by the
// Cephes expf polynomial, times 2^n (scalef: overflow to inf, underflow through denormals to 0).
// Within 2 ulp of f32 exp.
MOELORA_AVX512F inline __m512 Exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500E-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073E-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894E-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459E-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201E-1f));
  p = _mm512_fmadd_ps(_mm512_mul_ps(p, r), r, _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
  return _mm512_scalef_ps(p, n);
}

// The lane sums of 16 vectors as one vector (lane i: the sum of v[i]'s lanes), by a transposing
// tree: 45 shuffles and adds, against about 8 dependent ones per vector reduced alone. v is
// clobbered.
MOELORA_AVX512F inline __m512 Sums16(__m512* v) {
  // 16 -> 8: each 128-bit lane of v[i] holds two partial sums of the old v[2i] and v[2i + 1].
  for (int i = 0; i < 8; ++i) {
    v[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  // 8 -> 4: each 128-bit lane of v[i] holds one partial sum of the original v[4i .. 4i + 3].
  for (int i = 0; i < 4; ++i) {
    const __m512d a = _mm512_castps_pd(v[2 * i]), b = _mm512_castps_pd(v[2 * i + 1]);
    v[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // 4 -> 2: 128-bit lanes 0, 1 of v[i] hold halves of the sums of the original v[8i .. 8i + 3],
  // lanes 2, 3 those of the next four.
  for (int i = 0; i < 2; ++i) {
    v[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xDD));
  }
  // 2 -> 1: 128-bit lane q holds the sums of the original v[4q .. 4q + 3].
  return _mm512_add_ps(_mm512_shuffle_f32x4(v[0], v[1], 0x88),
                       _mm512_shuffle_f32x4(v[0], v[1], 0xDD));
}

// Transposes 16 rows of 16 floats (or any 32-bit elements) in place: r[j] becomes column j.
MOELORA_AVX512F inline void Transpose16(__m512* r) {
  __m512 t[16];
  for (int i = 0; i < 8; ++i) {
    t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
    t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
  }
  for (int i = 0; i < 4; ++i) {
    r[4 * i] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 1] = _mm512_shuffle_ps(t[4 * i], t[4 * i + 2], _MM_SHUFFLE(3, 2, 3, 2));
    r[4 * i + 2] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(1, 0, 1, 0));
    r[4 * i + 3] = _mm512_shuffle_ps(t[4 * i + 1], t[4 * i + 3], _MM_SHUFFLE(3, 2, 3, 2));
  }
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0x88);
    t[4 + i] = _mm512_shuffle_f32x4(r[i], r[4 + i], 0xdd);
    t[8 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0x88);
    t[12 + i] = _mm512_shuffle_f32x4(r[8 + i], r[12 + i], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0x88);
    r[8 + i] = _mm512_shuffle_f32x4(t[i], t[8 + i], 0xdd);
    r[4 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0x88);
    r[12 + i] = _mm512_shuffle_f32x4(t[4 + i], t[12 + i], 0xdd);
  }
}

}  // namespace avx512
}  // namespace moelora

#endif  // MOELORA_KERNELS_INTERNAL_AVX512_H_
