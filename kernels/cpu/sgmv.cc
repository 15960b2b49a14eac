// kernels/sgmv.h. Written by hand: ATen has no segmented LoRA op, and one small GEMM pair per
// (slot, expert) segment through libtorch 1.13 costs more in dispatch and packing than the
// arithmetic (a decode segment has 1–4 rows).
#include "kernels/sgmv.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/elementwise.h"
#include "kernels/internal/avx2.h"
#include "kernels/internal/avx512.h"
#include "kernels/skinny_gemm.h"

namespace moelora {

namespace {

using avx2::Load8;
using avx2::ToF32;

using Mid = float[kSgmvMaxRank];

// The next segment's A and B, fetched into the cache while this one's shrink runs: a decode
// step's slots arrive cold from memory (the base weights streamed through the caches since the
// last step), and one segment at a time left the memory idle while the arithmetic ran. The
// bytes are spread over the in_dim iterations of the shrink loop. The shrink calls At once per
// 2–4 iterations (its partial sums), so with rank 16 in bf16 (32 B of A an iteration) it touches
// every other line of A, whose pair the L2's adjacent-line prefetch brings; prefetching every
// line (each exactly once) measured slower: 32 segments of 1 / 4 rows from memory, 3.8–4.2 /
// 4.4–4.6 µs a segment against 4.9 / 6.6–6.9 (and 4.9–5.4 / 6.1–6.7 with no prefetch at all).
// Into L2, not L1: a MoE gate/up segment's next A and Bs are 96 KB in bf16 (192 in f32), more
// than an L1 (32 KB on Zen 4, 48 on the Xeon), so prefetched into L1 they evicted this segment's
// own A and each other before use. decode_step --only peer, batch 32 with two adapters (case
// (c)), the experts' LoRA sections over 20 steps (timers), L1 against L2, alternating, on a Zen 4
// EPYC: bf16 51.4, 50.4, 42.0, 47.3, 40.5, 43.7 -> 50.1, 41.7, 31.8, 36.2, 41.1, 41.2 ms; f32
// 70.5, 68.0, 74.6 -> 65.4, 61.0, 68.6 ms (not measured on the Xeon).
struct Prefetch {
  const char* a = nullptr;
  const char* b = nullptr;
  const char* b2 = nullptr;         // the second B, when the segment has one
  uint64_t a_step = 0, b_step = 0;  // bytes per shrink iteration, 16.16 fixed point

  Prefetch() = default;
  // B and the second B (b2 may be null) are b_bytes each.
  Prefetch(const void* next_a, int64_t a_bytes, const void* next_b, const void* next_b2,
           int64_t b_bytes, int64_t iterations)
      : a(static_cast<const char*>(next_a)),
        b(static_cast<const char*>(next_b)),
        b2(static_cast<const char*>(next_b2)),
        a_step((static_cast<uint64_t>(a_bytes) << 16) / static_cast<uint64_t>(iterations)),
        b_step((static_cast<uint64_t>(b_bytes) << 16) / static_cast<uint64_t>(iterations)) {}
  void At(int64_t k) const {
    if (a == nullptr) return;
    const uint64_t bo = (static_cast<uint64_t>(k) * b_step) >> 16;
    _mm_prefetch(a + ((static_cast<uint64_t>(k) * a_step) >> 16), _MM_HINT_T1);
    _mm_prefetch(b + bo, _MM_HINT_T1);
    if (b2 != nullptr) _mm_prefetch(b2 + bo, _MM_HINT_T1);
  }
};

// The f32 rows a block reads and writes: p.x / p.out in place, or bf16 rows widened into `buf`
// (4 x rows of in_dim, then 4 out rows of the segment's columns), written back by Finish.
struct Rows {
  const float* x[4];
  float* o[4];  // at the segment's first column
  uint16_t* o_bf16[4];
};

// The columns of out a segment writes.
int64_t OutCols(const SgmvParams& p, const SgmvSegment& s) {
  return s.b2_t != nullptr ? 2 * p.out_dim : p.out_dim;
}

void Gather(const SgmvParams& p, const SgmvSegment& s, int64_t i, int nb, std::vector<float>& buf,
            Rows* r) {
  const int64_t cols = OutCols(p, s);
  const size_t need = static_cast<size_t>(4 * (p.in_dim + 2 * p.out_dim));
  if ((p.x_bf16 || p.out_bf16) && buf.size() < need) buf.resize(need);
  for (int t = 0; t < nb; ++t) {
    const int64_t row = p.rows ? p.rows[i + t] : i + t;
    if (p.x_bf16) {
      float* xf = buf.data() + t * p.in_dim;
      WidenBf16(p.x_bf16 + row * p.x_stride, xf, p.in_dim);
      r->x[t] = xf;
    } else {
      r->x[t] = p.x + row * p.x_stride;
    }
    if (p.out_bf16) {
      float* of = buf.data() + 4 * p.in_dim + t * cols;
      r->o_bf16[t] = p.out_bf16 + row * p.out_stride + s.out_col;
      WidenBf16(r->o_bf16[t], of, cols);
      r->o[t] = of;
    } else {
      r->o[t] = p.out + row * p.out_stride + s.out_col;
    }
  }
}

void Finish(const SgmvParams& p, const SgmvSegment& s, int nb, const Rows& r) {
  if (!p.out_bf16) return;
  for (int t = 0; t < nb; ++t) RoundToBf16(r.o[t], r.o_bf16[t], OutCols(p, s));
}

#define MOELORA_SEGMENT_TARGET MOELORA_AVX2
namespace sgmv_avx2 {
// 8 f32 lanes.
struct Vec {
  using V = __m256;
  static constexpr int64_t kWidth = 8;
  static constexpr bool kMasked = false;  // tails of fewer than 8 columns go one by one
  MOELORA_AVX2 static V Zero() { return _mm256_setzero_ps(); }
  MOELORA_AVX2 static V Load(const float* p) { return Load8(p); }
  MOELORA_AVX2 static V Load(const uint16_t* p) { return Load8(p); }
  MOELORA_AVX2 static V Set1(float v) { return _mm256_set1_ps(v); }
  MOELORA_AVX2 static void Store(float* p, V v) { _mm256_storeu_ps(p, v); }
  MOELORA_AVX2 static V Fma(V a, V b, V c) { return _mm256_fmadd_ps(a, b, c); }
  MOELORA_AVX2 static V Add(V a, V b) { return _mm256_add_ps(a, b); }
};
#include "kernels/internal/sgmv_segment.inc"  // NOLINT(build/include)
}  // namespace sgmv_avx2
#undef MOELORA_SEGMENT_TARGET

#define MOELORA_SEGMENT_TARGET MOELORA_AVX512
namespace sgmv_avx512 {
// 16 f32 lanes; tails of fewer than 16 columns under a mask.
struct Vec {
  using V = __m512;
  static constexpr int64_t kWidth = 16;
  static constexpr bool kMasked = true;
  MOELORA_AVX512 static V Zero() { return _mm512_setzero_ps(); }
  MOELORA_AVX512 static V Load(const float* p) { return _mm512_loadu_ps(p); }
  MOELORA_AVX512 static V Load(const uint16_t* p) { return avx512::Widen16(p); }
  MOELORA_AVX512 static V Set1(float v) { return _mm512_set1_ps(v); }
  MOELORA_AVX512 static void Store(float* p, V v) { _mm512_storeu_ps(p, v); }
  MOELORA_AVX512 static V Fma(V a, V b, V c) { return _mm512_fmadd_ps(a, b, c); }
  MOELORA_AVX512 static V Add(V a, V b) { return _mm512_add_ps(a, b); }
  // The first n (< 16) lanes; the rest zero (loads) or untouched (stores).
  MOELORA_AVX512 static __mmask16 Mask(int64_t n) { return static_cast<__mmask16>((1u << n) - 1u); }
  MOELORA_AVX512 static V Load(const float* p, int64_t n) {
    return _mm512_maskz_loadu_ps(Mask(n), p);
  }
  MOELORA_AVX512 static V Load(const uint16_t* p, int64_t n) {
    const __m256i h = _mm256_maskz_loadu_epi16(Mask(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  MOELORA_AVX512 static void Store(float* p, V v, int64_t n) {
    _mm512_mask_storeu_ps(p, Mask(n), v);
  }
};
#include "kernels/internal/sgmv_segment.inc"  // NOLINT(build/include)
}  // namespace sgmv_avx512
#undef MOELORA_SEGMENT_TARGET

// One row at a time, for CPUs without AVX2 + FMA.
template <typename W>
void SegmentPortable(const SgmvParams& p, const SgmvSegment& s) {
  const W* a_t = static_cast<const W*>(s.a_t);
  const int64_t r = s.rank, a_stride = s.a_stride > 0 ? s.a_stride : p.r_stride;
  float y[kSgmvMaxRank];
  std::vector<float> buf;
  for (int64_t i = s.begin; i < s.end; ++i) {
    Rows rows;
    Gather(p, s, i, 1, buf, &rows);
    const float* x = rows.x[0];
    for (int64_t j = 0; j < r; ++j) y[j] = 0.0f;
    for (int64_t k = 0; k < p.in_dim; ++k) {
      const float xk = x[k];
      const W* a = a_t + k * a_stride;
      for (int64_t j = 0; j < r; ++j) y[j] += ToF32(a[j]) * xk;
    }
    for (int h = 0; h < 2; ++h) {  // B, then the second B into the next out_dim columns
      const W* b_t = static_cast<const W*>(h == 0 ? s.b_t : s.b2_t);
      if (b_t == nullptr) break;
      float* o = rows.o[0] + h * p.out_dim;
      for (int64_t j = 0; j < r; ++j) {
        const float yj = y[j];
        const W* b = b_t + j * p.out_dim;
        for (int64_t c = 0; c < p.out_dim; ++c) o[c] += ToF32(b[c]) * yj;
      }
    }
    Finish(p, s, 1, rows);
  }
}

template <typename W>
void RunSegments(SgmvIsa isa, const SgmvParams& p, const SgmvSegment* segs, int64_t first,
                 int64_t last) {
  for (int64_t s = first; s < last; ++s) {
    if (segs[s].rank <= 0 || segs[s].end <= segs[s].begin) continue;
    if (isa == SgmvIsa::kPortable) {
      SegmentPortable<W>(p, segs[s]);
      continue;
    }
    const SgmvSegment* next = nullptr;
    for (int64_t t = s + 1; t < last && next == nullptr; ++t) {
      if (segs[t].rank > 0 && segs[t].end > segs[t].begin) next = &segs[t];
    }
    if (isa == SgmvIsa::kAvx512) {
      sgmv_avx512::Segment<W>(p, segs[s], next);
    } else {
      sgmv_avx2::Segment<W>(p, segs[s], next);
    }
  }
}

}  // namespace

SgmvIsa SgmvBestIsa() {
  // AVX-512 F, BW and VL: the masked 16-bit loads of the bf16 tails need all three.
  static const SgmvIsa isa = __builtin_cpu_supports("avx512f") &&
                                     __builtin_cpu_supports("avx512bw") &&
                                     __builtin_cpu_supports("avx512vl")
                                 ? SgmvIsa::kAvx512
                             : SkinnyGemmAvailable() ? SgmvIsa::kAvx2  // the same AVX2 + FMA check
                                                     : SgmvIsa::kPortable;
  return isa;
}

void SgmvCpuWith(SgmvIsa isa, const SgmvParams& p, const SgmvSegment* segs, int64_t first,
                 int64_t last) {
  if (p.w_type == SgmvWeight::kBF16) {
    RunSegments<uint16_t>(isa, p, segs, first, last);
  } else {
    RunSegments<float>(isa, p, segs, first, last);
  }
}

void SgmvCpu(const SgmvParams& p, const SgmvSegment* segs, int64_t first, int64_t last) {
  SgmvCpuWith(SgmvBestIsa(), p, segs, first, last);
}

}  // namespace moelora
