#include "kernels/skinny_gemm.h"

#include "kernels/internal/avx2.h"

namespace moelora {

namespace {

using avx2::Load8;
using avx2::ToF32;

MOELORA_AVX2 inline float HSum(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// A tile of NW weight rows (w0 + j·k) against MX rows of x: NW·MX dot products of length k, in
// NW·MX accumulators (4 x 3 = 12 of the 16 ymm registers, plus 3 for x and 1 for w).
template <int NW, int MX, typename W>
MOELORA_AVX2 void Tile(const float* x, int64_t ldx, const W* w, int64_t k, float* y, int64_t ldy) {
  __m256 acc[NW][MX];
  for (int j = 0; j < NW; ++j) {
    for (int i = 0; i < MX; ++i) acc[j][i] = _mm256_setzero_ps();
  }
  const int64_t k8 = k & ~int64_t{7};
  for (int64_t c = 0; c < k8; c += 8) {
    __m256 xv[MX];
    for (int i = 0; i < MX; ++i) xv[i] = Load8(x + i * ldx + c);
    for (int j = 0; j < NW; ++j) {
      const __m256 wv = Load8(w + j * k + c);
      for (int i = 0; i < MX; ++i) acc[j][i] = _mm256_fmadd_ps(wv, xv[i], acc[j][i]);
    }
  }
  for (int j = 0; j < NW; ++j) {
    for (int i = 0; i < MX; ++i) {
      float s = HSum(acc[j][i]);
      for (int64_t c = k8; c < k; ++c) s += ToF32(w[j * k + c]) * x[i * ldx + c];
      y[i * ldy + j] = s;
    }
  }
}

// One pass over NW weight rows for up to MX rows of x at a time: the weight comes from memory
// once per MX rows, so MX is as large as the registers allow for the NW chosen (NW·MX <= 12
// accumulators; x is read from cache as the FMA's memory operand when MX > 3).
template <int NW, int MX, typename W>
MOELORA_AVX2 void RowsOfW(const SkinnyGemmArgs& a, const W* w, int64_t n) {
  int64_t i = 0;
  for (; i + MX <= a.m; i += MX) {
    Tile<NW, MX>(a.x + i * a.ldx, a.ldx, w, a.k, a.y + i * a.ldy + n, a.ldy);
  }
  switch (a.m - i) {
#define MOELORA_TAIL(R)                                                                            \
  case R:                                                                                          \
    if constexpr (R < MX) Tile<NW, R>(a.x + i * a.ldx, a.ldx, w, a.k, a.y + i * a.ldy + n, a.ldy); \
    break;
    MOELORA_TAIL(1)
    MOELORA_TAIL(2)
    MOELORA_TAIL(3)
    MOELORA_TAIL(4)
    MOELORA_TAIL(5)
    MOELORA_TAIL(6)
    MOELORA_TAIL(7)
    MOELORA_TAIL(8)
    MOELORA_TAIL(9)
    MOELORA_TAIL(10)
    MOELORA_TAIL(11)
#undef MOELORA_TAIL
    default:
      break;
  }
}

template <int NW, int MX, typename W>
MOELORA_AVX2 void RunTiles(const SkinnyGemmArgs& a, const W* w, int64_t n0, int64_t n1) {
  int64_t n = n0;
  for (; n + NW <= n1; n += NW) RowsOfW<NW, MX>(a, w + n * a.k, n);
  for (; n < n1; ++n) RowsOfW<1, 12>(a, w + n * a.k, n);
}

template <typename W>
MOELORA_AVX2 void Run(const SkinnyGemmArgs& a, int64_t n0, int64_t n1) {
  // 4 weight rows (4 streams from memory) stay in L1 while the x rows pass 3 at a time. For 4–6
  // rows this beat 2 x 6 tiles (one pass over the weight, but 2 streams): bench/skinny_gemm, 7
  // paired runs, 4 rows 16.8 ms against 19.6 ms on average, 6 rows 19.0 against 21.9; past 6
  // rows it beat 1 x 12 (x from L2).
  RunTiles<4, 3>(a, static_cast<const W*>(a.w), n0, n1);
}

}  // namespace

bool SkinnyGemmAvailable() {
  static const bool ok = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return ok;
}

void SkinnyGemmRows(const SkinnyGemmArgs& a, int64_t n0, int64_t n1) {
  if (a.w_type == SkinnyWeight::kF32) {
    Run<float>(a, n0, n1);
  } else {
    Run<uint16_t>(a, n0, n1);
  }
}

}  // namespace moelora
