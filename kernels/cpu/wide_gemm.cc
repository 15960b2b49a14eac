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

constexpr int kRows = 8;  // weight rows per register tile

// Prefetch of `rows` weight rows of k floats at pf, spread over one pass of k columns: line g of
// it is line g / 8 of row g % 8 (the order the next tile reads them: all rows advance together).
struct Prefetch {
  const float* pf = nullptr;
  int64_t rows = 0;
};

// Rows [n, n + NR) of the weight against x blocks [0, V) (16 rows each, packed, xs floats
// apart), written into y rows row0 .. row0 + 16 V (those below m).
template <int NR, int V>
MOELORA_AVX512 void Tile(const float* w, int64_t k, const float* xt, int64_t xs, float* y,
                         int64_t ldy, int64_t n, int64_t row0, int64_t m, Prefetch p) {
  __m512 acc[NR][V];
  for (int r = 0; r < NR; ++r) {
    for (int v = 0; v < V; ++v) acc[r][v] = _mm512_setzero_ps();
  }
  const float* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = w + r * k;
  for (int64_t c = 0; c < k; ++c) {
    if (p.pf != nullptr && (c & 1) == 0) {
      const int64_t g = c >> 1, r = g % kRows;
      if (r < p.rows) {
        _mm_prefetch(reinterpret_cast<const char*>(p.pf + r * k + g / kRows * 16), _MM_HINT_T0);
      }
    }
    __m512 xv[V];
    for (int v = 0; v < V; ++v) xv[v] = _mm512_loadu_ps(xt + v * xs + c * 16);
    for (int r = 0; r < NR; ++r) {
      const __m512 b = _mm512_set1_ps(wr[r][c]);
      for (int v = 0; v < V; ++v) acc[r][v] = _mm512_fmadd_ps(b, xv[v], acc[r][v]);
    }
  }
  // acc[r][v] holds y[row0 + 16 v + i, n + r] in lane i: out through a small buffer, one row of
  // NR values at a time (scattering columns of y straight into rows 4 KB apart thrashed one L1
  // set: 40 % of the time at 96 rows).
  alignas(64) float buf[NR][16];
  for (int v = 0; v < V; ++v) {
    for (int r = 0; r < NR; ++r) _mm512_store_ps(buf[r], acc[r][v]);
    const int64_t rows = std::min<int64_t>(16, m - (row0 + v * 16));
    const __mmask16 cols = static_cast<__mmask16>((1u << NR) - 1);
    const __m512i idx = _mm512_setr_epi32(0, 16, 32, 48, 64, 80, 96, 112, 128, 144, 160, 176, 192,
                                          208, 224, 240);  // buf[lane][i]
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 row = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), cols, idx, &buf[0][i], 4);
      _mm512_mask_storeu_ps(y + (row0 + v * 16 + i) * ldy + n, cols, row);
    }
  }
}

template <int NR>
MOELORA_AVX512 void RowsOfW(const WideGemmArgs& a, int64_t n, const Prefetch& p) {
  const int64_t blocks = (a.m + 15) / 16, xs = a.k * 16;
  const float* w = a.w + n * a.k;
  for (int64_t b = 0; b < blocks;) {
    // The first x block's pass reads the weight rows from memory and prefetches the next ones.
    const Prefetch q = b == 0 ? p : Prefetch{};
    const float* xt = a.x_packed + b * xs;
    switch (std::min<int64_t>(blocks - b, 3)) {
      case 3:
        Tile<NR, 3>(w, a.k, xt, xs, a.y, a.ldy, n, b * 16, a.m, q);
        b += 3;
        break;
      case 2:
        Tile<NR, 2>(w, a.k, xt, xs, a.y, a.ldy, n, b * 16, a.m, q);
        b += 2;
        break;
      default:
        Tile<NR, 1>(w, a.k, xt, xs, a.y, a.ldy, n, b * 16, a.m, q);
        b += 1;
        break;
    }
  }
}

MOELORA_AVX512 void Run(const WideGemmArgs& a, int64_t n0, int64_t n1) {
  for (int64_t n = n0; n < n1; n += kRows) {
    // The rows after these: the next ones of this weight, or the next weight's first.
    Prefetch p;
    if (n + kRows < a.n) {
      p = Prefetch{a.w + (n + kRows) * a.k, std::min<int64_t>(kRows, a.n - n - kRows)};
    } else if (a.next_w != nullptr) {
      p = Prefetch{a.next_w, kRows};
    }
    switch (std::min<int64_t>(kRows, n1 - n)) {
      case 8:
        RowsOfW<8>(a, n, p);
        break;
      case 7:
        RowsOfW<7>(a, n, p);
        break;
      case 6:
        RowsOfW<6>(a, n, p);
        break;
      case 5:
        RowsOfW<5>(a, n, p);
        break;
      case 4:
        RowsOfW<4>(a, n, p);
        break;
      case 3:
        RowsOfW<3>(a, n, p);
        break;
      case 2:
        RowsOfW<2>(a, n, p);
        break;
      default:
        RowsOfW<1>(a, n, p);
        break;
    }
  }
}

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

bool Enabled() {
  const char* e = std::getenv("MOELORA_WIDE_GEMM");
  return e == nullptr || std::strcmp(e, "0") != 0;
}

}  // namespace wide
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

}  // namespace moelora
