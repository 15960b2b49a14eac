#include "kernels/decode_attention.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>

#include "kernels/internal/avx512.h"

namespace moelora {

namespace {

using avx512::Exp16;
using avx512::Load16;
using avx512::Sums16;

constexpr int64_t kMaxChunks = 16;  // d up to 256

// How far ahead of the row read the whole cache row is prefetched (DecodeAttentionArgs::k_rows):
// 8 rows, 4 KB of bench/peer's bf16 rows (4 KV heads of 64). Timers around the kernel's calls
// at 16-616 keys (decode_step --only peer, bf16 batch 32, 600 steps): 4 / 8 / 16 rows 327 / 347
// / 348 µs a layer, against 544-554 without (the VM's stretch moved by about as much).
constexpr int64_t kRowsAhead = 8;

// Row j + kRowsAhead of `rows` (stride bytes apart, row_bytes each) into L2, when there is one.
inline void PrefetchRowAhead(const void* rows, int64_t j, int64_t n, int64_t stride,
                             int64_t row_bytes) {
  if (rows == nullptr || j + kRowsAhead >= n) return;
  const char* r = static_cast<const char*>(rows) + (j + kRowsAhead) * stride;
  for (int64_t b = 0; b < row_bytes; b += 64) _mm_prefetch(r + b, _MM_HINT_T1);
}

std::atomic<bool>& RowPrefetchFlag() {
  static std::atomic<bool> on{true};
  return on;
}

// scores[j] = scale · q · k[j] for j < n: each key's d products in one 16-lane vector, then 16
// keys' vectors summed at once.
// pf_rows, row_bytes: DecodeAttentionArgs::k_rows and row_bytes, or null.
template <typename T>
MOELORA_AVX512F void Scores(const float* q, const T* k, int64_t stride, int64_t n, int64_t d,
                            float scale, float* scores, const void* pf_rows, int64_t row_bytes) {
  const int64_t chunks = d / 16;
  __m512 qv[kMaxChunks];
  for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
  const __m512 sv = _mm512_set1_ps(scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - j0);
    __m512 part[16];
    for (int64_t t = 0; t < cnt; ++t) {
      const T* kr = k + (j0 + t) * stride;
      PrefetchRowAhead(pf_rows, j0 + t, n, stride * static_cast<int64_t>(sizeof(T)), row_bytes);
      // Two accumulators: the chain of d / 16 dependent FMAs halved.
      __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 2 <= chunks; c += 2) {
        a0 = _mm512_fmadd_ps(qv[c], Load16(kr + 16 * c), a0);
        a1 = _mm512_fmadd_ps(qv[c + 1], Load16(kr + 16 * (c + 1)), a1);
      }
      if (c < chunks) a0 = _mm512_fmadd_ps(qv[c], Load16(kr + 16 * c), a0);
      part[t] = _mm512_add_ps(a0, a1);
    }
    for (int64_t t = cnt; t < 16; ++t) part[t] = _mm512_setzero_ps();
    const __m512 s = _mm512_mul_ps(Sums16(part), sv);
    _mm512_mask_storeu_ps(scores + j0, static_cast<__mmask16>((1u << cnt) - 1u), s);
  }
}

// scores[j] <- exp(scores[j] - max), over n; returns their sum plus the sink's share.
MOELORA_AVX512F float Softmax(float* scores, int64_t n, const float* sink) {
  __m512 mv = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(scores + j));
  float mx = _mm512_reduce_max_ps(mv);
  for (; j < n; ++j) mx = std::max(mx, scores[j]);
  if (sink != nullptr) mx = std::max(mx, *sink);
  const __m512 m = _mm512_set1_ps(mx);
  __m512 sum = _mm512_setzero_ps();
  for (j = 0; j + 16 <= n; j += 16) {
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), m));
    _mm512_storeu_ps(scores + j, e);
    sum = _mm512_add_ps(sum, e);
  }
  if (j < n) {
    const __mmask16 rest = static_cast<__mmask16>((1u << (n - j)) - 1u);
    const __m512 e = Exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(rest, scores + j), m));
    _mm512_mask_storeu_ps(scores + j, rest, e);
    sum = _mm512_add_ps(sum, _mm512_maskz_mov_ps(rest, e));
  }
  float denom = _mm512_reduce_add_ps(sum);
  if (sink != nullptr) denom += std::exp(*sink - mx);
  return denom;
}

// out = (Σ_j p[j] · v[j]) / denom. pf_rows, row_bytes: DecodeAttentionArgs::v_rows and
// row_bytes, or null.
template <typename T>
MOELORA_AVX512F void Weighted(const float* p, const T* v, int64_t stride, int64_t n, int64_t d,
                              float denom, float* out, const void* pf_rows, int64_t row_bytes) {
  const int64_t chunks = d / 16;
  __m512 acc[kMaxChunks];
  for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    const __m512 pj = _mm512_set1_ps(p[j]);
    const T* vr = v + j * stride;
    PrefetchRowAhead(pf_rows, j, n, stride * static_cast<int64_t>(sizeof(T)), row_bytes);
    for (int64_t c = 0; c < chunks; ++c) acc[c] = _mm512_fmadd_ps(pj, Load16(vr + 16 * c), acc[c]);
  }
  const __m512 inv = _mm512_set1_ps(1.0f / denom);
  for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[c], inv));
}

// Scores and Weighted for HB query heads at once (heads h0 .. h0 + HB - 1 of a, rows of C
// chunks of 16): each key and value row is loaded (and widened from bf16) once for all of them
// rather than once a head, which halves the loads and widenings a (key, head) pair takes. Each
// head's sums run in the same order as in Scores and Weighted, so the results are the same bits.
// The block of the call's first heads (h0 0) prefetches the whole rows (a.k_rows, a.v_rows).
template <typename T, int HB, int C>
MOELORA_AVX512F void ScoresHeads(const DecodeAttentionArgs& a, int64_t h0, float* scratch) {
  const T* k = static_cast<const T*>(a.k);
  constexpr int64_t chunks = C;
  const int64_t n = a.n;
  __m512 qv[HB][C];
  for (int h = 0; h < HB; ++h) {
    for (int64_t c = 0; c < chunks; ++c)
      qv[h][c] = _mm512_loadu_ps(a.q + (h0 + h) * a.q_stride + 16 * c);
  }
  const __m512 sv = _mm512_set1_ps(a.scale);
  for (int64_t j0 = 0; j0 < n; j0 += 16) {
    const int64_t cnt = std::min<int64_t>(16, n - j0);
    __m512 part[HB][16];
    for (int64_t t = 0; t < cnt; ++t) {
      const T* kr = k + (j0 + t) * a.kv_stride;
      if (h0 == 0) {
        PrefetchRowAhead(a.k_rows, j0 + t, n, a.kv_stride * static_cast<int64_t>(sizeof(T)),
                         a.row_bytes);
      }
      __m512 a0[HB], a1[HB];
      for (int h = 0; h < HB; ++h) a0[h] = a1[h] = _mm512_setzero_ps();
      int64_t c = 0;
      for (; c + 2 <= chunks; c += 2) {
        const __m512 k0 = Load16(kr + 16 * c), k1 = Load16(kr + 16 * (c + 1));
        for (int h = 0; h < HB; ++h) {
          a0[h] = _mm512_fmadd_ps(qv[h][c], k0, a0[h]);
          a1[h] = _mm512_fmadd_ps(qv[h][c + 1], k1, a1[h]);
        }
      }
      if (c < chunks) {
        const __m512 k0 = Load16(kr + 16 * c);
        for (int h = 0; h < HB; ++h) a0[h] = _mm512_fmadd_ps(qv[h][c], k0, a0[h]);
      }
      for (int h = 0; h < HB; ++h) part[h][t] = _mm512_add_ps(a0[h], a1[h]);
    }
    for (int h = 0; h < HB; ++h) {
      for (int64_t t = cnt; t < 16; ++t) part[h][t] = _mm512_setzero_ps();
      const __m512 s = _mm512_mul_ps(Sums16(part[h]), sv);
      _mm512_mask_storeu_ps(scratch + (h0 + h) * (n + 16) + j0,
                            static_cast<__mmask16>((1u << cnt) - 1u), s);
    }
  }
}

template <typename T, int HB, int C>
MOELORA_AVX512F void WeightedHeads(const DecodeAttentionArgs& a, int64_t h0, const float* scratch,
                                   const float* denom) {
  const T* v = static_cast<const T*>(a.v);
  constexpr int64_t chunks = C;
  const int64_t n = a.n;
  __m512 acc[HB][C];
  for (int h = 0; h < HB; ++h) {
    for (int64_t c = 0; c < chunks; ++c) acc[h][c] = _mm512_setzero_ps();
  }
  for (int64_t j = 0; j < n; ++j) {
    __m512 pj[HB];
    for (int h = 0; h < HB; ++h) pj[h] = _mm512_set1_ps(scratch[(h0 + h) * (n + 16) + j]);
    const T* vr = v + j * a.kv_stride;
    if (h0 == 0) {
      PrefetchRowAhead(a.v_rows, j, n, a.kv_stride * static_cast<int64_t>(sizeof(T)), a.row_bytes);
    }
    for (int64_t c = 0; c < chunks; ++c) {
      const __m512 vv = Load16(vr + 16 * c);
      for (int h = 0; h < HB; ++h) acc[h][c] = _mm512_fmadd_ps(pj[h], vv, acc[h][c]);
    }
  }
  for (int h = 0; h < HB; ++h) {
    const __m512 inv = _mm512_set1_ps(1.0f / denom[h]);
    float* out = a.out + (h0 + h) * a.out_stride;
    for (int64_t c = 0; c < chunks; ++c) {
      _mm512_storeu_ps(out + 16 * c, _mm512_mul_ps(acc[h][c], inv));
    }
  }
}

// HB heads from h0 (d = 16 C): their scores, softmaxes and weighted sums.
template <typename T, int HB, int C>
MOELORA_AVX512F void AttendHeads(const DecodeAttentionArgs& a, int64_t h0, float* scratch) {
  ScoresHeads<T, HB, C>(a, h0, scratch);
  float denom[HB];
  for (int h = 0; h < HB; ++h) {
    denom[h] = Softmax(scratch + (h0 + h) * (a.n + 16), a.n,
                       a.sinks != nullptr ? a.sinks + h0 + h : nullptr);
  }
  WeightedHeads<T, HB, C>(a, h0, scratch, denom);
}

template <typename T>
MOELORA_AVX512F void AttendGroup(const DecodeAttentionArgs& a, float* scratch) {
  // Heads in blocks where d is 32, 64 or 128 (the chunks a row a compile-time count, so that q and
  // the accumulators stay in registers; with a run-time count they lived on the stack and the
  // blocks ran 40 % slower than one head at a time): 4 a block at d <= 64 (at 64: 16 zmm of q, 8
  // accumulators), 2 at 128; the rest one at a time (Scores and Weighted). decode_step --only
  // peer, batch 32, layers alternating between the two in one run, ms per 80 calls of the
  // attention (CachedAttentionCpu), two runs: bf16 14.13, 14.36 -> 11.07, 11.35; f32 16.02,
  // 19.91 -> 14.29, 14.59 (batch 8: bf16 4.81 -> 3.89, f32 4.61, 4.85 -> 4.24, 4.74).
  int64_t h = 0;
  if (a.d == 64) {
    for (; h + 4 <= a.heads; h += 4) AttendHeads<T, 4, 4>(a, h, scratch);
  } else if (a.d == 32) {
    for (; h + 4 <= a.heads; h += 4) AttendHeads<T, 4, 2>(a, h, scratch);
  } else if (a.d == 128) {
    for (; h + 2 <= a.heads; h += 2) AttendHeads<T, 2, 8>(a, h, scratch);
  }
  const T* k = static_cast<const T*>(a.k);
  const T* v = static_cast<const T*>(a.v);
  for (; h < a.heads; ++h) {
    float* scores = scratch + h * (a.n + 16);
    // The first head prefetches the whole rows, as the first block does.
    Scores(a.q + h * a.q_stride, k, a.kv_stride, a.n, a.d, a.scale, scores,
           h == 0 ? a.k_rows : nullptr, a.row_bytes);
    const float denom = Softmax(scores, a.n, a.sinks != nullptr ? a.sinks + h : nullptr);
    Weighted(scores, v, a.kv_stride, a.n, a.d, denom, a.out + h * a.out_stride,
             h == 0 ? a.v_rows : nullptr, a.row_bytes);
  }
}

}  // namespace

bool DecodeAttentionRowPrefetch() { return RowPrefetchFlag().load(std::memory_order_relaxed); }

void SetDecodeAttentionRowPrefetch(bool on) {
  RowPrefetchFlag().store(on, std::memory_order_relaxed);
}

bool DecodeAttentionAvailable(int64_t d) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512 && d > 0 && d % 16 == 0 && d <= 16 * kMaxChunks;
}

void DecodeAttention(const DecodeAttentionArgs& a, float* scratch) {
  if (a.n <= 0) {  // no keys: nothing to attend to
    for (int64_t h = 0; h < a.heads; ++h)
      std::fill(a.out + h * a.out_stride, a.out + h * a.out_stride + a.d, 0.0f);
    return;
  }
  if (a.kv_bf16) {
    AttendGroup<uint16_t>(a, scratch);
  } else {
    AttendGroup<float>(a, scratch);
  }
}

}  // namespace moelora
