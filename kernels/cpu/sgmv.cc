// kernels/sgmv.h. Written by hand: ATen has no segmented LoRA op, and one small GEMM pair per
// (slot, expert) segment through libtorch 1.13 costs more in dispatch and packing than the
// arithmetic (a decode segment has 1–4 rows).
#include "kernels/sgmv.h"

#include <algorithm>
#include <cstring>
#include <vector>

#include "kernels/elementwise.h"
#include "kernels/internal/avx2.h"
#include "kernels/skinny_gemm.h"

namespace moelora {

namespace {

using avx2::Load8;
using avx2::ToF32;

using Mid = float[kSgmvMaxRank];

// The next segment's A and B, fetched into the cache while this one's shrink runs: a decode
// step's slots arrive cold from memory (the base weights streamed through the caches since the
// last step), and one segment at a time left the memory idle while the arithmetic ran. The
// bytes are spread over the in_dim iterations of the shrink loop (a line whenever the share of
// the iteration crosses into a new one).
struct Prefetch {
  const char* a = nullptr;
  const char* b = nullptr;
  uint64_t a_step = 0, b_step = 0;  // bytes per shrink iteration, 16.16 fixed point

  Prefetch() = default;
  Prefetch(const void* next_a, int64_t a_bytes, const void* next_b, int64_t b_bytes,
           int64_t iterations)
      : a(static_cast<const char*>(next_a)),
        b(static_cast<const char*>(next_b)),
        a_step((static_cast<uint64_t>(a_bytes) << 16) / static_cast<uint64_t>(iterations)),
        b_step((static_cast<uint64_t>(b_bytes) << 16) / static_cast<uint64_t>(iterations)) {}
  void At(int64_t k) const {
    if (a == nullptr) return;
    _mm_prefetch(a + ((static_cast<uint64_t>(k) * a_step) >> 16), _MM_HINT_T0);
    _mm_prefetch(b + ((static_cast<uint64_t>(k) * b_step) >> 16), _MM_HINT_T0);
  }
};

// y[b][j] = Σ_k a[k, j] · x[b][k] for NB rows, j < r: 16 (then 8) rank columns at a time, the
// NB rows' sums in registers, so each row of A is read once for all NB rows.
template <int NB, typename W>
MOELORA_AVX2 void Shrink(const float* const* x, const W* a, int64_t in_dim, int64_t rs, int64_t r,
                         Mid* y, const Prefetch& pf) {
  int64_t j0 = 0;
  for (; j0 + 16 <= r; j0 += 16) {
    __m256 acc[NB][2];
    for (int b = 0; b < NB; ++b) acc[b][0] = acc[b][1] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in_dim; ++k) {
      if (j0 == 0) pf.At(k);
      const W* ak = a + k * rs + j0;
      const __m256 a0 = Load8(ak), a1 = Load8(ak + 8);
      for (int b = 0; b < NB; ++b) {
        const __m256 xb = _mm256_broadcast_ss(x[b] + k);
        acc[b][0] = _mm256_fmadd_ps(a0, xb, acc[b][0]);
        acc[b][1] = _mm256_fmadd_ps(a1, xb, acc[b][1]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      _mm256_storeu_ps(y[b] + j0, acc[b][0]);
      _mm256_storeu_ps(y[b] + j0 + 8, acc[b][1]);
    }
  }
  if (j0 + 8 <= r) {
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_setzero_ps();
    for (int64_t k = 0; k < in_dim; ++k) {
      if (j0 == 0) pf.At(k);
      const __m256 a0 = Load8(a + k * rs + j0);
      for (int b = 0; b < NB; ++b)
        acc[b] = _mm256_fmadd_ps(a0, _mm256_broadcast_ss(x[b] + k), acc[b]);
    }
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(y[b] + j0, acc[b]);
    j0 += 8;
  }
  for (; j0 < r; ++j0) {  // a rank that is not a multiple of 8
    for (int b = 0; b < NB; ++b) {
      float s = 0.0f;
      for (int64_t k = 0; k < in_dim; ++k) s += ToF32(a[k * rs + j0]) * x[b][k];
      y[b][j0] = s;
    }
  }
}

// o[b][c] += Σ_j bm[j, c] · y[b][j] for NB rows: 16 (then 8) output columns at a time, the NB
// rows' columns in registers, so each row of B is read once for all NB rows.
template <int NB, typename W>
MOELORA_AVX2 void Expand(float* const* o, const W* bm, int64_t out_dim, int64_t r, const Mid* y) {
  int64_t c = 0;
  for (; c + 16 <= out_dim; c += 16) {
    __m256 acc[NB][2];
    for (int b = 0; b < NB; ++b) {
      acc[b][0] = _mm256_loadu_ps(o[b] + c);
      acc[b][1] = _mm256_loadu_ps(o[b] + c + 8);
    }
    for (int64_t j = 0; j < r; ++j) {
      const W* bj = bm + j * out_dim + c;
      const __m256 b0 = Load8(bj), b1 = Load8(bj + 8);
      for (int b = 0; b < NB; ++b) {
        const __m256 yb = _mm256_set1_ps(y[b][j]);
        acc[b][0] = _mm256_fmadd_ps(b0, yb, acc[b][0]);
        acc[b][1] = _mm256_fmadd_ps(b1, yb, acc[b][1]);
      }
    }
    for (int b = 0; b < NB; ++b) {
      _mm256_storeu_ps(o[b] + c, acc[b][0]);
      _mm256_storeu_ps(o[b] + c + 8, acc[b][1]);
    }
  }
  for (; c + 8 <= out_dim; c += 8) {
    __m256 acc[NB];
    for (int b = 0; b < NB; ++b) acc[b] = _mm256_loadu_ps(o[b] + c);
    for (int64_t j = 0; j < r; ++j) {
      const __m256 b0 = Load8(bm + j * out_dim + c);
      for (int b = 0; b < NB; ++b) acc[b] = _mm256_fmadd_ps(b0, _mm256_set1_ps(y[b][j]), acc[b]);
    }
    for (int b = 0; b < NB; ++b) _mm256_storeu_ps(o[b] + c, acc[b]);
  }
  for (; c < out_dim; ++c) {
    for (int b = 0; b < NB; ++b) {
      float s = o[b][c];
      for (int64_t j = 0; j < r; ++j) s += ToF32(bm[j * out_dim + c]) * y[b][j];
      o[b][c] = s;
    }
  }
}

template <int NB, typename W>
MOELORA_AVX2 void Block(const SgmvParams& p, const W* a, const W* b, int64_t r,
                        const float* const* x, float* const* o, Mid* y, const Prefetch& pf) {
  Shrink<NB>(x, a, p.in_dim, p.r_stride, r, y, pf);
  Expand<NB>(o, b, p.out_dim, r, y);
}

// The f32 rows a block reads and writes: p.x / p.out in place, or bf16 rows widened into `buf`
// (4 x rows of in_dim, then 4 out rows of out_dim), written back by Finish.
struct Rows {
  const float* x[4];
  float* o[4];
  uint16_t* o_bf16[4];
};

void Gather(const SgmvParams& p, int64_t i, int nb, std::vector<float>& buf, Rows* r) {
  const size_t need = static_cast<size_t>(4 * (p.in_dim + p.out_dim));
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
      float* of = buf.data() + 4 * p.in_dim + t * p.out_dim;
      r->o_bf16[t] = p.out_bf16 + row * p.out_stride;
      WidenBf16(r->o_bf16[t], of, p.out_dim);
      r->o[t] = of;
    } else {
      r->o[t] = p.out + row * p.out_stride;
    }
  }
}

void Finish(const SgmvParams& p, int nb, const Rows& r) {
  if (!p.out_bf16) return;
  for (int t = 0; t < nb; ++t) RoundToBf16(r.o[t], r.o_bf16[t], p.out_dim);
}

// `next`: the segment this thread runs after this one (nullptr: none), whose weights the first
// block's shrink prefetches.
template <typename W>
MOELORA_AVX2 void SegmentAvx2(const SgmvParams& p, const SgmvSegment& s, const SgmvSegment* next) {
  const W* a = static_cast<const W*>(s.a_t);
  const W* b = static_cast<const W*>(s.b_t);
  const int64_t r = s.rank;
  Mid y[4];
  thread_local std::vector<float> buf;
  Prefetch pf;
  if (next != nullptr && next->a_t != s.a_t && p.in_dim > 0) {
    const int64_t nr = next->rank;
    pf = Prefetch(next->a_t, p.in_dim * p.r_stride * static_cast<int64_t>(sizeof(W)), next->b_t,
                  nr * p.out_dim * static_cast<int64_t>(sizeof(W)), p.in_dim);
  }
  for (int64_t i = s.begin; i < s.end; i += 4) {
    const int nb = static_cast<int>(std::min<int64_t>(4, s.end - i));
    Rows rows;
    Gather(p, i, nb, buf, &rows);
    const float* const* x = rows.x;
    float* const* o = rows.o;
    switch (nb) {
      case 4:
        Block<4>(p, a, b, r, x, o, y, pf);
        break;
      case 3:
        Block<3>(p, a, b, r, x, o, y, pf);
        break;
      case 2:
        Block<2>(p, a, b, r, x, o, y, pf);
        break;
      default:
        Block<1>(p, a, b, r, x, o, y, pf);
        break;
    }
    Finish(p, nb, rows);
    pf = Prefetch();  // the next segment's weights are on their way after the first block
  }
}

// One row at a time, for CPUs without AVX2 + FMA.
template <typename W>
void SegmentPortable(const SgmvParams& p, const SgmvSegment& s) {
  const W* a_t = static_cast<const W*>(s.a_t);
  const W* b_t = static_cast<const W*>(s.b_t);
  const int64_t r = s.rank;
  float y[kSgmvMaxRank];
  std::vector<float> buf;
  for (int64_t i = s.begin; i < s.end; ++i) {
    Rows rows;
    Gather(p, i, 1, buf, &rows);
    const float* x = rows.x[0];
    for (int64_t j = 0; j < r; ++j) y[j] = 0.0f;
    for (int64_t k = 0; k < p.in_dim; ++k) {
      const float xk = x[k];
      const W* a = a_t + k * p.r_stride;
      for (int64_t j = 0; j < r; ++j) y[j] += ToF32(a[j]) * xk;
    }
    float* o = rows.o[0];
    for (int64_t j = 0; j < r; ++j) {
      const float yj = y[j];
      const W* b = b_t + j * p.out_dim;
      for (int64_t c = 0; c < p.out_dim; ++c) o[c] += ToF32(b[c]) * yj;
    }
    Finish(p, 1, rows);
  }
}

template <typename W>
void Run(const SgmvParams& p, const SgmvSegment* segs, int64_t first, int64_t last) {
  const bool avx2 = SkinnyGemmAvailable();  // the same AVX2 + FMA check
  for (int64_t s = first; s < last; ++s) {
    if (segs[s].rank <= 0 || segs[s].end <= segs[s].begin) continue;
    if (avx2) {
      const SgmvSegment* next = nullptr;
      for (int64_t t = s + 1; t < last && next == nullptr; ++t) {
        if (segs[t].rank > 0 && segs[t].end > segs[t].begin) next = &segs[t];
      }
      SegmentAvx2<W>(p, segs[s], next);
    } else {
      SegmentPortable<W>(p, segs[s]);
    }
  }
}

}  // namespace

void SgmvCpu(const SgmvParams& p, const SgmvSegment* segs, int64_t first, int64_t last) {
  if (p.w_type == SgmvWeight::kBF16) {
    Run<uint16_t>(p, segs, first, last);
  } else {
    Run<float>(p, segs, first, last);
  }
}

}  // namespace moelora
