// Element loads shared by the hand-written AVX2 + FMA CPU kernels (skinny_gemm.cc, sgmv.cc):
// f32 as is, bf16 widened exactly (a bf16 is the top half of an f32). Functions marked
// MOELORA_AVX2 are compiled for AVX2 + FMA whatever the build's -march, so callers must check
// the CPU first (SkinnyGemmAvailable). Internal to kernels/.
#ifndef MOELORA_KERNELS_INTERNAL_AVX2_H_
#define MOELORA_KERNELS_INTERNAL_AVX2_H_

#include <immintrin.h>

#include <cstdint>
#include <cstring>

#define MOELORA_AVX2 __attribute__((target("avx2,fma")))

namespace moelora {
namespace avx2 {

inline float ToF32(float v) { return v; }
inline float ToF32(uint16_t v) {
  const uint32_t u = static_cast<uint32_t>(v) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

MOELORA_AVX2 inline __m256 Load8(const float* p) { return _mm256_loadu_ps(p); }
// 8 bf16 -> 8 f32, exact.
MOELORA_AVX2 inline __m256 Load8(const uint16_t* p) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

}  // namespace avx2
}  // namespace moelora

#endif  // MOELORA_KERNELS_INTERNAL_AVX2_H_
