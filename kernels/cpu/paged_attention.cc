#include "kernels/paged_attention.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "kernels/internal/avx2.h"
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

void Finish(const PagedAttentionArgs& a, const float* mx, const float* l, const float* acc);

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
  Finish(a, mx, l, acc);
}

// The sinks join each denominator; then out = acc / l.
void Finish(const PagedAttentionArgs& a, const float* mx, const float* l, const float* acc) {
  const int64_t d = a.d;
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

// The vector path. Per chunk of 16 keys, once for all the task's query vectors: the keys
// transposed to [d][16] (so a head's 16 scores are d broadcast FMAs, no horizontal sums) and the
// values widened to f32 rows, both in scratch (L1). Then each visible row's heads in turn: scores,
// the online softmax update, and the weighted values added to its accumulator.
template <typename T>
MOELORA_AVX512F void VectorT(const PagedAttentionArgs& a, float* scratch) {
  const int64_t nv = a.rows * a.heads, d = a.d, bs = a.block_size, chunks = d / 16;
  float* mx = scratch;
  float* l = mx + nv;
  float* acc = l + nv;
  float* kt = acc + nv * d;  // [d][16]
  float* vf = kt + d * 16;   // [16][d]
  std::fill(mx, mx + nv, kNegInf);
  std::fill(l, l + nv, 0.0f);
  std::fill(acc, acc + nv * d, 0.0f);
  const int64_t last = a.pos0 + a.rows - 1;
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, a.pos0 - a.window + 1) : 0;
  const T* K = static_cast<const T*>(a.k);
  const T* V = static_cast<const T*>(a.v);
  const __m512 sv = _mm512_set1_ps(a.scale);
  for (int64_t b = first / bs; b <= last / bs; ++b) {
    const T* kb = K + a.blocks[b] * a.block_stride;
    const T* vb = V + a.blocks[b] * a.block_stride;
    for (int64_t sub = 0; sub < bs; sub += kChunk) {
      const int64_t p0 = b * bs + sub, cnt = std::min(kChunk, bs - sub);
      if (p0 > last) break;
      if (p0 + cnt - 1 < first) continue;
      // Keys transposed and values widened, 16 rows (missing rows as zeros).
      // Rows past the last query's position are not read (not written yet; masked anyway).
      const int64_t rows = std::min(cnt, last - p0 + 1);
      for (int64_t c = 0; c < chunks; ++c) {
        __m512 r[16];
        for (int64_t t = 0; t < 16; ++t) {
          r[t] = t < rows ? Load16(kb + (sub + t) * a.row_stride + 16 * c) : _mm512_setzero_ps();
        }
        avx512::Transpose16(r);
        for (int64_t i = 0; i < 16; ++i) _mm512_storeu_ps(kt + (16 * c + i) * 16, r[i]);
      }
      for (int64_t t = 0; t < rows; ++t) {
        for (int64_t c = 0; c < chunks; ++c) {
          _mm512_storeu_ps(vf + t * d + 16 * c, Load16(vb + (sub + t) * a.row_stride + 16 * c));
        }
      }
      for (int64_t i = 0; i < a.rows; ++i) {
        const int64_t qpos = a.pos0 + i;
        const int64_t lo = a.window > 0 ? qpos - a.window + 1 : 0;
        const int64_t j0 = std::max(p0, lo) - p0, j1 = std::min(p0 + cnt - 1, qpos) - p0;
        if (j0 > j1) continue;
        const __mmask16 valid =
            static_cast<__mmask16>(((1u << (j1 + 1)) - 1u) & ~((1u << j0) - 1u));
        for (int64_t h = 0; h < a.heads; ++h) {
          const int64_t u = i * a.heads + h;
          const float* q = a.q + i * a.q_row_stride + h * a.q_head_stride;
          __m512 s0 = _mm512_setzero_ps(), s1 = _mm512_setzero_ps();
          int64_t c = 0;
          for (; c + 2 <= d; c += 2) {
            s0 = _mm512_fmadd_ps(_mm512_set1_ps(q[c]), _mm512_loadu_ps(kt + c * 16), s0);
            s1 = _mm512_fmadd_ps(_mm512_set1_ps(q[c + 1]), _mm512_loadu_ps(kt + (c + 1) * 16), s1);
          }
          const __m512 s = _mm512_mask_blend_ps(valid, _mm512_set1_ps(kNegInf),
                                                _mm512_mul_ps(_mm512_add_ps(s0, s1), sv));
          const float m = std::max(mx[u], _mm512_reduce_max_ps(s));
          const float corr = std::exp(mx[u] - m);
          const __m512 p = _mm512_maskz_mov_ps(valid, Exp16(_mm512_sub_ps(s, _mm512_set1_ps(m))));
          l[u] = l[u] * corr + _mm512_reduce_add_ps(p);
          mx[u] = m;
          alignas(64) float pj[16];
          _mm512_store_ps(pj, p);
          float* o = acc + u * d;
          __m512 ov[kMaxDChunks];
          const __m512 cv = _mm512_set1_ps(corr);
          for (int64_t k = 0; k < chunks; ++k)
            ov[k] = _mm512_mul_ps(_mm512_loadu_ps(o + 16 * k), cv);
          for (int64_t t = j0; t <= j1; ++t) {
            const __m512 w = _mm512_set1_ps(pj[t]);
            for (int64_t k = 0; k < chunks; ++k) {
              ov[k] = _mm512_fmadd_ps(w, _mm512_loadu_ps(vf + t * d + 16 * k), ov[k]);
            }
          }
          for (int64_t k = 0; k < chunks; ++k) _mm512_storeu_ps(o + 16 * k, ov[k]);
        }
      }
    }
  }
  Finish(a, mx, l, acc);
}

// The AVX2 path: VectorT's scheme with 8-key chunks (keys transposed to [d][8], values widened),
// the accumulators in memory.
template <typename T>
MOELORA_AVX2 void Avx2T(const PagedAttentionArgs& a, float* scratch) {
  constexpr int64_t kKeys = 8;
  const int64_t nv = a.rows * a.heads, d = a.d, bs = a.block_size, chunks = d / 8;
  float* mx = scratch;
  float* l = mx + nv;
  float* acc = l + nv;
  float* kt = acc + nv * d;  // [d][8]
  float* vf = kt + d * 16;   // [8][d]
  std::fill(mx, mx + nv, kNegInf);
  std::fill(l, l + nv, 0.0f);
  std::fill(acc, acc + nv * d, 0.0f);
  const int64_t last = a.pos0 + a.rows - 1;
  const int64_t first = a.window > 0 ? std::max<int64_t>(0, a.pos0 - a.window + 1) : 0;
  const T* K = static_cast<const T*>(a.k);
  const T* V = static_cast<const T*>(a.v);
  const __m256 sv = _mm256_set1_ps(a.scale);
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t b = first / bs; b <= last / bs; ++b) {
    const T* kb = K + a.blocks[b] * a.block_stride;
    const T* vb = V + a.blocks[b] * a.block_stride;
    for (int64_t sub = 0; sub < bs; sub += kKeys) {
      const int64_t p0 = b * bs + sub, cnt = std::min(kKeys, bs - sub);
      if (p0 > last) break;
      if (p0 + cnt - 1 < first) continue;
      const int64_t rows = std::min(cnt, last - p0 + 1);  // as in VectorT
      for (int64_t c = 0; c < chunks; ++c) {
        __m256 r[8];
        for (int64_t t = 0; t < 8; ++t) {
          r[t] =
              t < rows ? avx2::Load8(kb + (sub + t) * a.row_stride + 8 * c) : _mm256_setzero_ps();
        }
        avx2::Transpose8(r);
        for (int64_t i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (8 * c + i) * 8, r[i]);
      }
      for (int64_t t = 0; t < rows; ++t) {
        for (int64_t c = 0; c < chunks; ++c) {
          _mm256_storeu_ps(vf + t * d + 8 * c, avx2::Load8(vb + (sub + t) * a.row_stride + 8 * c));
        }
      }
      for (int64_t i = 0; i < a.rows; ++i) {
        const int64_t qpos = a.pos0 + i;
        const int64_t lo = a.window > 0 ? qpos - a.window + 1 : 0;
        const int64_t j0 = std::max(p0, lo) - p0, j1 = std::min(p0 + cnt - 1, qpos) - p0;
        if (j0 > j1) continue;
        const __m256 valid = _mm256_castsi256_ps(_mm256_andnot_si256(
            _mm256_or_si256(_mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(j0)), lane),
                            _mm256_cmpgt_epi32(lane, _mm256_set1_epi32(static_cast<int>(j1)))),
            _mm256_set1_epi32(-1)));
        for (int64_t h = 0; h < a.heads; ++h) {
          const int64_t u = i * a.heads + h;
          const float* q = a.q + i * a.q_row_stride + h * a.q_head_stride;
          __m256 s0 = _mm256_setzero_ps(), s1 = _mm256_setzero_ps();
          int64_t c = 0;
          for (; c + 2 <= d; c += 2) {
            s0 = _mm256_fmadd_ps(_mm256_set1_ps(q[c]), _mm256_loadu_ps(kt + c * 8), s0);
            s1 = _mm256_fmadd_ps(_mm256_set1_ps(q[c + 1]), _mm256_loadu_ps(kt + (c + 1) * 8), s1);
          }
          const __m256 s = _mm256_blendv_ps(_mm256_set1_ps(kNegInf),
                                            _mm256_mul_ps(_mm256_add_ps(s0, s1), sv), valid);
          const float m = std::max(mx[u], avx2::Max8(s));
          const float corr = std::exp(mx[u] - m);
          const __m256 p = _mm256_and_ps(valid, avx2::Exp8(_mm256_sub_ps(s, _mm256_set1_ps(m))));
          l[u] = l[u] * corr + avx2::Sum8(p);
          mx[u] = m;
          alignas(32) float pj[8];
          _mm256_store_ps(pj, p);
          float* o = acc + u * d;
          const __m256 cv = _mm256_set1_ps(corr);
          for (int64_t k = 0; k < chunks; ++k) {
            __m256 ov = _mm256_mul_ps(_mm256_loadu_ps(o + 8 * k), cv);
            for (int64_t t = j0; t <= j1; ++t) {
              ov = _mm256_fmadd_ps(_mm256_set1_ps(pj[t]), _mm256_loadu_ps(vf + t * d + 8 * k), ov);
            }
            _mm256_storeu_ps(o + 8 * k, ov);
          }
        }
      }
    }
  }
  Finish(a, mx, l, acc);
}

bool Avx2Available(int64_t d) {
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  return avx2 && d > 0 && d % 8 == 0 && d <= 256;
}

}  // namespace

bool PagedAttentionAvx2(const PagedAttentionArgs& a, float* scratch) {
  if (!Avx2Available(a.d)) return false;
  if (a.kv_bf16) {
    Avx2T<uint16_t>(a, scratch);
  } else {
    Avx2T<float>(a, scratch);
  }
  return true;
}

int64_t PagedAttentionScratchFloats(const PagedAttentionArgs& a) {
  return a.rows * a.heads * (a.d + 2) + 2 * 16 * a.d;  // the vector path's key and value chunk
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
  if (!PagedAttentionVectorized(a.d)) {
    if (!PagedAttentionAvx2(a, scratch)) PagedAttentionPortable(a, scratch);
    return;
  }
  if (a.kv_bf16) {
    VectorT<uint16_t>(a, scratch);
  } else {
    VectorT<float>(a, scratch);
  }
}

absl::Status PagedAttentionBatch::Validate() const {
  auto bad = [](const char* what) {
    return absl::InvalidArgumentError(std::string("paged_attention: ") + what);
  };
  if (q == nullptr || out == nullptr || k == nullptr || v == nullptr) return bad("null q/out/k/v");
  if (block_tables == nullptr || seq_of_row == nullptr || pos_of_row == nullptr) {
    return bad("null block_tables/seq_of_row/pos_of_row");
  }
  if (rows < 0 || hq < 1 || hkv < 1 || hq % hkv != 0) return bad("hq must be a multiple of hkv");
  if (d < 1 || block_size < 1 || max_blocks < 1)
    return bad("d, block_size, max_blocks must be > 0");
  if (window < 0) return bad("window must be >= 0");
  return absl::OkStatus();
}

absl::Status PagedAttentionBatchCpu(const PagedAttentionBatch& b) {
  if (absl::Status s = b.Validate(); !s.ok()) return s;
  const int64_t groups = b.hq / b.hkv;
  const int64_t elem = b.kv_bf16 ? 2 : 4;
  std::vector<float> scratch;
  for (int64_t t = 0; t < b.rows; ++t) {
    if (b.pos_of_row[t] >= b.max_blocks * b.block_size) {
      return absl::InvalidArgumentError("paged_attention: a position beyond its block table");
    }
    for (int64_t g = 0; g < b.hkv; ++g) {
      PagedAttentionArgs a;
      a.q = b.q + (t * b.hq + g * groups) * b.d;
      a.q_row_stride = b.hq * b.d;
      a.q_head_stride = b.d;
      a.rows = 1;
      a.heads = groups;
      a.d = b.d;
      a.pos0 = b.pos_of_row[t];
      a.window = b.window;
      a.blocks = b.block_tables + b.seq_of_row[t] * b.max_blocks;
      a.block_size = b.block_size;
      a.k = static_cast<const char*>(b.k) + g * b.d * elem;
      a.v = static_cast<const char*>(b.v) + g * b.d * elem;
      a.kv_bf16 = b.kv_bf16;
      a.block_stride = b.block_size * b.hkv * b.d;
      a.row_stride = b.hkv * b.d;
      a.scale = b.scale;
      a.sinks = b.sinks != nullptr ? b.sinks + g * groups : nullptr;
      a.out = b.out + (t * b.hq + g * groups) * b.d;
      a.out_row_stride = b.hq * b.d;
      a.out_head_stride = b.d;
      scratch.resize(PagedAttentionScratchFloats(a));
      PagedAttentionPortable(a, scratch.data());
    }
  }
  return absl::OkStatus();
}

}  // namespace moelora
