#include "kernels/amx_gemm.h"

#include <immintrin.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>

#include "kernels/internal/avx512.h"  // also: gcc 12's AVX-512 header warnings off

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

// AMX CPUs (Sapphire Rapids and later) all have AVX-512 with BF16, used for packing and stores.
#define MOELORA_AMX \
  __attribute__((target("amx-tile,amx-bf16,avx512f,avx512bw,avx512vl,avx512bf16")))

namespace moelora {

namespace {

#if defined(__linux__) && defined(__x86_64__)
// Linux hands out the 8 KB of tile state only to processes that ask (arch_prctl, since 5.16);
// until then the first tile instruction faults.
constexpr int kArchGetXcompPerm = 0x1022, kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;

// AMX-TILE and AMX-BF16, and the AVX-512 (F, BW, VL, BF16) that the packing and the stores use
// (every AMX CPU has it, but a virtual machine may hide it).
bool CpuHasAmx() {
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
  if ((d & (1u << 24)) == 0 || (d & (1u << 22)) == 0) return false;
  return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
         __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bf16");
}

bool GrantTiles() {
  if (!CpuHasAmx()) return false;
  if (syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) != 0) return false;
  unsigned long perm = 0;  // NOLINT(runtime/int): the syscall's type
  if (syscall(SYS_arch_prctl, kArchGetXcompPerm, &perm) != 0) return false;
  return (perm & (1ul << kXfeatureXtiledata)) != 0;
}
#else
bool GrantTiles() { return false; }
#endif

// Palette 1: every tile 16 rows of 64 bytes (A: 16 weight rows x 32 bf16; B: 16 column pairs x
// 16 x rows x 2 bf16; C: 16 weight rows x 16 x rows f32).
struct alignas(64) TileConfig {
  uint8_t palette = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// NB weight blocks of 16 rows against MB x blocks of 16 rows, k / 32 steps, yᵀ into c[nb + 2 mb].
// Tiles: accumulator C(nb, mb) = tmm(nb + 2 mb), B(mb) = tmm(4 + mb), A(nb) = tmm(6 + nb).
// next (optional): `next_bytes` of weights read next, prefetched into L2 over the steps, in
// address order. Written by hand for the same reason as the kernel: no library prefetches for a
// product it does not run. Measured on the Xeon (decode_step --only peer --dtype bfloat16, two
// paired runs): batch 32 16.69, 16.63 -> 15.12, 15.13 ms; batch 8 10.47, 10.56 -> 9.46, 9.58
// ms. The same lines in the order the next block reads them (every row's first line, then every
// row's second) were slower than none (17.95, 18.05 ms at batch 32), where the skinny kernel's
// tiles gain from that order (skinny_tiles.inc).
template <int NB, int MB>
MOELORA_AMX void Block(const uint16_t* w, int64_t k, const uint16_t* xp, float (*c)[256],
                       const char* next = nullptr, int64_t next_bytes = 0) {
  const int64_t steps = k / 32, wstride = k * 2, xblock = 16 * k;
  const int64_t lines = next != nullptr ? next_bytes / 64 : 0;
  const int64_t per_step = (lines + steps - 1) / steps;
  int64_t pl = 0;
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (MB > 1) _tile_zero(2);
  if constexpr (NB > 1 && MB > 1) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    for (int64_t q = 0; q < per_step && pl < lines; ++q, ++pl) {
      _mm_prefetch(next + pl * 64, _MM_HINT_T1);
    }
    _tile_loadd(4, xp + s * 512, 64);
    if constexpr (MB > 1) _tile_loadd(5, xp + xblock + s * 512, 64);
    _tile_loadd(6, w + s * 32, wstride);
    _tile_dpbf16ps(0, 6, 4);
    if constexpr (MB > 1) _tile_dpbf16ps(2, 6, 5);
    if constexpr (NB > 1) {
      _tile_loadd(7, w + 16 * k + s * 32, wstride);
      _tile_dpbf16ps(1, 7, 4);
      if constexpr (MB > 1) _tile_dpbf16ps(3, 7, 5);
    }
  }
  _tile_stored(0, c[0], 64);
  if constexpr (NB > 1) _tile_stored(1, c[1], 64);
  if constexpr (MB > 1) _tile_stored(2, c[2], 64);
  if constexpr (NB > 1 && MB > 1) _tile_stored(3, c[3], 64);
}

MOELORA_AMX void Run(const AmxGemmArgs& a, int64_t n0, int64_t n1) {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
  alignas(64) float c[4][256];
  const int64_t k = a.k, mblocks = (a.m + 15) / 16;
  for (int64_t n = n0; n < n1; n += 32) {
    const int nb = n + 32 <= n1 ? 2 : 1;
    const uint16_t* w = a.w + n * k;
    // The weight rows after this block's: up to 32 more of w, else the first of next_w.
    const uint16_t* nw = n + 32 < a.n ? w + 32 * k : a.next_w;
    const int64_t nrows = n + 32 < a.n
                              ? std::min<int64_t>(32, a.n - n - 32)
                              : (a.next_w != nullptr ? std::min<int64_t>(32, a.next_rows) : 0);
    const char* next = reinterpret_cast<const char*>(nw);
    const int64_t next_bytes = nrows * k * 2;
    for (int64_t mb = 0; mb < mblocks; mb += 2) {
      const int nmb = mb + 2 <= mblocks ? 2 : 1;
      const uint16_t* xp = a.x_packed + mb * 16 * k;
      // The first pass over this weight block reads it from memory; the prefetch runs with it.
      const char* pf = mb == 0 && nrows > 0 ? next : nullptr;
      if (nb == 2) {
        nmb == 2 ? Block<2, 2>(w, k, xp, c, pf, next_bytes)
                 : Block<2, 1>(w, k, xp, c, pf, next_bytes);
      } else {
        nmb == 2 ? Block<1, 2>(w, k, xp, c, pf, next_bytes)
                 : Block<1, 1>(w, k, xp, c, pf, next_bytes);
      }
      // c[j + 2 i] holds yᵀ of weight block j, x block i: element [row of w][row of x]. Row r
      // of y is column r of the tile: one gather of 16 lanes 16 floats apart.
      const __m512i column = _mm512_mullo_epi32(
          _mm512_set1_epi32(16),
          _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15));
      for (int i = 0; i < nmb; ++i) {
        const int64_t r0 = (mb + i) * 16, rows = std::min<int64_t>(16, a.m - r0);
        for (int j = 0; j < nb; ++j) {
          const float* t = c[j + 2 * i];
          for (int64_t r = 0; r < rows; ++r) {
            const __m512 v = _mm512_i32gather_ps(column, t + r, 4);
            const int64_t at = (r0 + r) * a.ldy + n + j * 16;
            if (a.y_bf16 != nullptr) {
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(a.y_bf16 + at),
                                  reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
            } else {
              _mm512_storeu_ps(a.y + at, v);
            }
          }
        }
      }
    }
  }
  _tile_release();
}

bool Enabled() {
  const char* e = std::getenv("MOELORA_AMX");
  return e == nullptr || std::strcmp(e, "0") != 0;
}

}  // namespace

bool AmxGemmSupported() {
  static const bool ok = GrantTiles();
  return ok;
}

bool AmxGemmAvailable() {
  static const bool ok = AmxGemmSupported() && Enabled();
  return ok;
}

void AmxGemmRows(const AmxGemmArgs& a, int64_t n0, int64_t n1) {
  if (n0 < n1) Run(a, n0, n1);
}

}  // namespace moelora
