#include "kernels/wide_gemm.h"

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/internal/avx512.h"
#include "kernels/skinny_gemm.h"

namespace moelora {

namespace {
// Named apart from the other kernel files' helpers (Prefetch, Enabled, ...): CI's unity build
// compiles them into one translation unit.
namespace wide {

// f32: one column a step, its weight element broadcast, an FMA into 16 x rows' lanes.
struct Vec {
  using E = float;
  static constexpr int64_t kStep = 1;
  static constexpr int TileRows(int64_t m) { return WideTileRows(m); }
  MOELORA_AVX512 static __m512 Bcast(const float* w) { return _mm512_set1_ps(*w); }
  MOELORA_AVX512 static __m512 Fma(__m512 b, __m512 x, __m512 acc) {
    return _mm512_fmadd_ps(b, x, acc);
  }
  MOELORA_AVX512 static void StoreRow(const WideGemmArgs& a, int64_t row, int64_t col,
                                      __mmask16 mask, __m512 v) {
    _mm512_mask_storeu_ps(a.y + row * a.ldy + col, mask, v);
  }
};
using Args = WideGemmArgs;

#define MOELORA_TILE_TARGET MOELORA_AVX512
#include "kernels/internal/wide_tiles.inc"  // NOLINT(build/include)
#undef MOELORA_TILE_TARGET

MOELORA_AVX512 void PackX(const float* x, int64_t ldx, int64_t m, int64_t k, float* packed) {
  for (int64_t b = 0; b < (m + 15) / 16; ++b) {
    float* dst = packed + b * 16 * k;
    const int64_t rows = std::min<int64_t>(16, m - b * 16);
    for (int64_t c0 = 0; c0 < k; c0 += 16) {
      const int64_t cols = std::min<int64_t>(16, k - c0);
      const __mmask16 mask = static_cast<__mmask16>((1u << cols) - 1);
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = i < rows ? _mm512_maskz_loadu_ps(mask, x + (b * 16 + i) * ldx + c0)
                        : _mm512_setzero_ps();
      }
      avx512::Transpose16(r);
      for (int64_t i = 0; i < cols; ++i) _mm512_storeu_ps(dst + (c0 + i) * 16, r[i]);
    }
  }
}

// Block b, step s: packed[((b·steps + s)·16 + p)·32 + 2 r + q] = x[16 b + r][32 s + 2 p + q],
// zero for rows past m: per block, k / 2 lines of 16 rows' column pairs. As 32-bit pairs, a 16 x
// 16 transpose per (b, s): the 16 rows' 64 bytes loaded, transposed in registers, stored. It
// replaced one gather per pair p (16 a step), which took 36 µs of each bf16 expert product in a
// decode step at batch 32 (a 16-row block per expert), 1.6 % of the step (timers in RunJobs, a
// patch for the measurement); decode_step --only peer, bf16 batch 32 on a Xeon's AMX, three
// paired runs: 18.17, 18.17, 17.86 -> 17.93, 17.87, 17.68 ms.
MOELORA_AVX512 void PackXPairs(const uint16_t* x, int64_t ldx, int64_t m, int64_t k,
                               uint16_t* packed) {
  const int64_t steps = k / 32, blocks = (m + 15) / 16;
  for (int64_t b = 0; b < blocks; ++b) {
    const int64_t live = std::min<int64_t>(16, m - b * 16);
    const uint16_t* xb = x + b * 16 * ldx;
    for (int64_t s = 0; s < steps; ++s) {
      __m512 r[16];
      for (int i = 0; i < 16; ++i) {
        r[i] = i < live ? _mm512_loadu_ps(reinterpret_cast<const float*>(xb + i * ldx + s * 32))
                        : _mm512_setzero_ps();
      }
      avx512::Transpose16(r);
      uint16_t* dst = packed + (b * steps + s) * 512;
      for (int p = 0; p < 16; ++p) _mm512_storeu_ps(reinterpret_cast<float*>(dst + p * 32), r[p]);
    }
  }
}

bool Enabled() {
  const char* e = std::getenv("MOELORA_WIDE_GEMM");
  return e == nullptr || std::strcmp(e, "0") != 0;
}

}  // namespace wide

// bf16 x against bf16 weights: one column pair a step, the weight's pair (32 bits) broadcast,
// vdpbf16ps into 16 x rows' lanes (packed x lines hold each row's pair).
namespace wide_bf16 {

struct Vec {
  using E = uint16_t;
  static constexpr int64_t kStep = 2;
  static constexpr int TileRows(int64_t m) { return WideBf16TileRows(m); }
  MOELORA_AVX512_BF16 static __m512 Bcast(const uint16_t* w) {
    int32_t pair;
    std::memcpy(&pair, w, sizeof(pair));
    return _mm512_castsi512_ps(_mm512_set1_epi32(pair));
  }
  MOELORA_AVX512_BF16 static __m512 Fma(__m512 b, __m512 x, __m512 acc) {
    return _mm512_dpbf16_ps(acc, reinterpret_cast<__m512bh>(x), reinterpret_cast<__m512bh>(b));
  }
  MOELORA_AVX512_BF16 static void StoreRow(const WideBf16GemmArgs& a, int64_t row, int64_t col,
                                           __mmask16 mask, __m512 v) {
    if (a.y_bf16 != nullptr) {
      _mm256_mask_storeu_epi16(a.y_bf16 + row * a.ldy + col, mask,
                               reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    } else {
      _mm512_mask_storeu_ps(a.y + row * a.ldy + col, mask, v);
    }
  }
};
using Args = WideBf16GemmArgs;

#define MOELORA_TILE_TARGET MOELORA_AVX512_BF16
#include "kernels/internal/wide_tiles.inc"  // NOLINT(build/include)
#undef MOELORA_TILE_TARGET

}  // namespace wide_bf16
}  // namespace

bool WideGemmSupported() { return SkinnyGemmSupports(SkinnyIsa::kAvx512); }

bool WideGemmAvailable() {
  static const bool ok =
      WideGemmSupported() &&
      (SkinnyGemmIsa() == SkinnyIsa::kAvx512 || SkinnyGemmIsa() == SkinnyIsa::kAvx512Bf16) &&
      wide::Enabled();
  return ok;
}

void WidePackX(const float* x, int64_t ldx, int64_t m, int64_t k, float* packed) {
  wide::PackX(x, ldx, m, k, packed);
}

void WideGemmRows(const WideGemmArgs& a, int64_t n0, int64_t n1) { wide::Run(a, n0, n1); }

bool WideBf16GemmSupported() { return SkinnyGemmSupports(SkinnyIsa::kAvx512Bf16); }

bool WideBf16GemmAvailable() {
  static const bool ok =
      WideBf16GemmSupported() && SkinnyGemmIsa() == SkinnyIsa::kAvx512Bf16 && wide::Enabled();
  return ok;
}

void WidePackXBf16(const uint16_t* x, int64_t ldx, int64_t m, int64_t k, uint16_t* packed) {
  wide::PackXPairs(x, ldx, m, k, packed);
}

void WideBf16GemmRows(const WideBf16GemmArgs& a, int64_t n0, int64_t n1) {
  wide_bf16::Run(a, n0, n1);
}

}  // namespace moelora
