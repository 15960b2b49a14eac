#include "kernels/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "kernels/internal/avx512.h"

namespace moelora {

namespace {

constexpr float kNegInf = -std::numeric_limits<float>::infinity();
constexpr int64_t kChunk = 16;       // keys scored at once
constexpr int64_t kMaxDChunks = 16;  // d up to 256 on the vector path

// The running state of one query vector: its maximum score, denominator and weighted sum.
struct Running {
  float* mx;
  float* l;
  float* acc;  // d
};

// Visits the keys of the query rows block by block, chunk by chunk: for each (row, head) whose
// visible range meets the chunk, calls update(state, q, keys, values, first, last), first..last
// the visible key indices within the chunk (the keys and values point at the chunk's first row).
template <typename T, typename Update>
void Visit(const PagedAttentionArgs& a, float* scratch, Update update) {
  const int64_t nv = a.rows * a.heads, d = a.d, bs = a.block_size;
  float* mx = scratch;
  float* l = mx + nv;
  float* acc = l + nv;
  std::fill(mx, mx + nv, kNegInf);
  std::fill(l, l + nv, 0.0f);
  std::fill(acc, acc + nv * d, 0.0f);
  const int64_t last = a.pos0 + a.rows - 1;
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, a.pos0 - a.window + 1) : 0;
  const T* K = static_cast<const T*>(a.k);
  const T* V = static_cast<const T*>(a.v);
  for (int64_t b = first / bs; b <= last / bs; ++b) {
    const T* kb = K + a.blocks[b] * a.block_stride;
    const T* vb = V + a.blocks[b] * a.block_stride;
    for (int64_t sub = 0; sub < bs; sub += kChunk) {
      const int64_t p0 = b * bs + sub, cnt = std::min(kChunk, bs - sub);
      if (p0 > last) break;
      for (int64_t i = 0; i < a.rows; ++i) {
        const int64_t qpos = a.pos0 + i;
        const int64_t lo = a.window > 0 ? qpos - a.window + 1 : 0;
        const int64_t kl = std::max(p0, lo), kh = std::min(p0 + cnt - 1, qpos);
        if (kl > kh) continue;
        for (int64_t h = 0; h < a.heads; ++h) {
          const int64_t u = i * a.heads + h;
          update(Running{mx + u, l + u, acc + u * d},
                 a.q + i * a.q_row_stride + h * a.q_head_stride, kb + sub * a.row_stride,
                 vb + sub * a.row_stride, kl - p0, kh - p0);
        }
      }
    }
  }
  // The sinks join each denominator; then out = acc / l.
  for (int64_t i = 0; i < a.rows; ++i) {
    for (int64_t h = 0; h < a.heads; ++h) {
      const int64_t u = i * a.heads + h;
      float m = mx[u], den = l[u], corr = 1.0f;
      if (a.sinks != nullptr) {
        const float s = a.sinks[h], m2 = std::max(m, s);
        corr = std::exp(m - m2);
        den = den * corr + std::exp(s - m2);
      }
      const float inv = corr / den;
      float* o = a.out + i * a.out_row_stride + h * a.out_head_stride;
      for (int64_t c = 0; c < d; ++c) o[c] = acc[u * d + c] * inv;
    }
  }
}

inline float Widened(float x) { return x; }
inline float Widened(uint16_t x) {
  const uint32_t b = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &b, sizeof f);
  return f;
}

template <typename T>
void PortableT(const PagedAttentionArgs& a, float* scratch) {
  const int64_t d = a.d, rs = a.row_stride;
  float s[kChunk];
  Visit<T>(a, scratch,
           [&](Running r, const float* q, const T* k, const T* v, int64_t j0, int64_t j1) {
             float m = *r.mx;
             for (int64_t j = j0; j <= j1; ++j) {
               float dot = 0.0f;
               for (int64_t c = 0; c < d; ++c) dot += q[c] * Widened(k[j * rs + c]);
               s[j] = dot * a.scale;
               m = std::max(m, s[j]);
             }
             const float corr = std::exp(*r.mx - m);  // 0 when nothing was seen yet
             float sum = 0.0f;
             for (int64_t j = j0; j <= j1; ++j) {
               s[j] = std::exp(s[j] - m);
               sum += s[j];
             }
             *r.l = *r.l * corr + sum;
             *r.mx = m;
             for (int64_t c = 0; c < d; ++c) r.acc[c] *= corr;
             for (int64_t j = j0; j <= j1; ++j) {
               for (int64_t c = 0; c < d; ++c) r.acc[c] += s[j] * Widened(v[j * rs + c]);
             }
           });
}

using avx512::Exp16;
using avx512::Load16;
using avx512::Sums16;

template <typename T>
MOELORA_AVX512F void VectorT(const PagedAttentionArgs& a, float* scratch) {
  const int64_t chunks = a.d / 16, rs = a.row_stride;
  const __m512 sv = _mm512_set1_ps(a.scale);
  Visit<T>(a, scratch,
           [&](Running r, const float* q, const T* k, const T* v, int64_t j0, int64_t j1)
               MOELORA_AVX512F {
                 __m512 qv[kMaxDChunks];
                 for (int64_t c = 0; c < chunks; ++c) qv[c] = _mm512_loadu_ps(q + 16 * c);
                 __m512 part[16];
                 for (int64_t t = 0; t < 16; ++t) {
                   if (t < j0 || t > j1) {
                     part[t] = _mm512_setzero_ps();
                     continue;
                   }
                   const T* kr = k + t * rs;
                   __m512 a0 = _mm512_setzero_ps(), a1 = _mm512_setzero_ps();
                   int64_t c = 0;
                   for (; c + 2 <= chunks; c += 2) {
                     a0 = _mm512_fmadd_ps(qv[c], Load16(kr + 16 * c), a0);
                     a1 = _mm512_fmadd_ps(qv[c + 1], Load16(kr + 16 * (c + 1)), a1);
                   }
                   if (c < chunks) a0 = _mm512_fmadd_ps(qv[c], Load16(kr + 16 * c), a0);
                   part[t] = _mm512_add_ps(a0, a1);
                 }
                 const __mmask16 valid =
                     static_cast<__mmask16>(((1u << (j1 + 1)) - 1u) & ~((1u << j0) - 1u));
                 const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf),
                                                       _mm512_mul_ps(Sums16(part), sv));
                 const float m = std::max(*r.mx, _mm512_reduce_max_ps(s));
                 const float corr = std::exp(*r.mx - m);
                 const __m512 p =
                     _mm512_maskz_mov_ps(valid, Exp16(_mm512_sub_ps(s, _mm512_set1_ps(m))));
                 *r.l = *r.l * corr + _mm512_reduce_add_ps(p);
                 *r.mx = m;
                 alignas(64) float pj[16];
                 _mm512_store_ps(pj, p);
                 __m512 o[kMaxDChunks];
                 const __m512 cv = _mm512_set1_ps(corr);
                 for (int64_t c = 0; c < chunks; ++c)
                   o[c] = _mm512_mul_ps(_mm512_loadu_ps(r.acc + 16 * c), cv);
                 for (int64_t t = j0; t <= j1; ++t) {
                   const __m512 w = _mm512_set1_ps(pj[t]);
                   const T* vr = v + t * rs;
                   for (int64_t c = 0; c < chunks; ++c)
                     o[c] = _mm512_fmadd_ps(w, Load16(vr + 16 * c), o[c]);
                 }
                 for (int64_t c = 0; c < chunks; ++c) _mm512_storeu_ps(r.acc + 16 * c, o[c]);
               });
}

}  // namespace

int64_t PagedAttentionScratchFloats(const PagedAttentionArgs& a) {
  return a.rows * a.heads * (a.d + 2);
}

bool PagedAttentionVectorized(int64_t d) {
  static const bool avx512 = __builtin_cpu_supports("avx512f");
  return avx512 && d > 0 && d % 16 == 0 && d <= 16 * kMaxDChunks;
}

void PagedAttentionPortable(const PagedAttentionArgs& a, float* scratch) {
  if (a.kv_bf16) {
    PortableT<uint16_t>(a, scratch);
  } else {
    PortableT<float>(a, scratch);
  }
}

void PagedAttention(const PagedAttentionArgs& a, float* scratch) {
  if (!PagedAttentionVectorized(a.d)) return PagedAttentionPortable(a, scratch);
  if (a.kv_bf16) {
    VectorT<uint16_t>(a, scratch);
  } else {
    VectorT<float>(a, scratch);
  }
}

}  // namespace moelora
