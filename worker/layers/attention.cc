// RmsNorm, Rotary and Attention.
#include "worker/layers/attention.h"

#include <ATen/Parallel.h>
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "common/status_macros.h"
#include "kernels/decode_attention.h"
#include "kernels/elementwise.h"
#include "worker/layers/gather.h"
#include "worker/layers/gemm.h"

namespace moelora {

namespace {

// RmsNorm rows on the CPU: the operations and roundings of the ATen expression in RmsNorm below,
// element by element (kernels/elementwise.h, RmsNormRow), in f32 rows (bf16 widened and rounded
// 16 at a time). The sum of squares runs in another order than ATen's mean. With `delta`, each
// row of x is first replaced by x + delta, rounded to T (ATen's add), and that sum written to
// `sum` too.
NormForm FormOf(NormKind kind) {
  return kind == NormKind::kPlain         ? NormForm::kPlain
         : kind == NormKind::kZeroCentred ? NormForm::kZeroCentred
                                          : NormForm::kF32Weight;
}

// A contiguous f32 or bf16 norm weight's values in f32: an f32 weight as it is, a bf16 one widened
// into `buf` (w.to(at::kFloat) was an ATen op and an allocation per norm, 4 per layer of a bf16
// step).
const float* NormWeightF32(const at::Tensor& w, std::vector<float>& buf) {
  if (w.scalar_type() != at::kBFloat16) return w.data_ptr<float>();
  buf.resize(w.numel());
  WidenBf16(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), buf.data(), buf.size());
  return buf.data();
}

template <typename T>
void RmsNormRows(const T* x, const T* delta, const at::Tensor& w, T* sum, T* out, int64_t rows,
                 int64_t n, float eps, NormKind kind) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  // NormByHand has checked that w is contiguous and of x's dtype.
  std::vector<float> widened;
  const float* wp = NormWeightF32(w, widened);
  const NormForm form = FormOf(kind);
  auto u16 = [](const T* p) { return reinterpret_cast<const uint16_t*>(p); };
  at::parallel_for(0, rows, ElementwiseGrain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if constexpr (kBf16) {
        auto* s = sum != nullptr ? reinterpret_cast<uint16_t*>(sum + r * n) : nullptr;
        RmsNormRowBf16(u16(x + r * n), delta != nullptr ? u16(delta + r * n) : nullptr, wp, s,
                       reinterpret_cast<uint16_t*>(out + r * n), n, eps, form);
      } else {
        const float* xr = x + r * n;
        if (delta != nullptr) {
          AddRows(x + r * n, delta + r * n, sum + r * n, n, false);
          xr = sum + r * n;
        }
        RmsNormRow(xr, wp, out + r * n, n, eps, form, false);
      }
    }
  });
}

bool NormByHand(const at::Tensor& x, const at::Tensor& w) {
  const at::ScalarType t = x.scalar_type();
  return x.device().is_cpu() && x.is_contiguous() && w.is_contiguous() && x.dim() >= 1 &&
         w.dim() == 1 && w.size(0) == x.size(-1) && x.numel() > 0 &&
         (t == at::kFloat || t == at::kBFloat16) && w.scalar_type() == t;
}

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& w, double eps, NormKind kind) {
  if (NormByHand(x, w)) {
    // By hand: the ATen form below is 7–9 ops per call (2 per layer, 2 more with q/k norms),
    // each a pass over the rows; this is one.
    const int64_t n = x.size(-1), rows = x.numel() / n;
    at::Tensor out = at::empty_like(x);
    const float e = static_cast<float>(eps);
    if (x.scalar_type() == at::kFloat) {
      RmsNormRows<float>(x.data_ptr<float>(), nullptr, w, nullptr, out.data_ptr<float>(), rows, n,
                         e, kind);
    } else {
      RmsNormRows<at::BFloat16>(x.data_ptr<at::BFloat16>(), nullptr, w, nullptr,
                                out.data_ptr<at::BFloat16>(), rows, n, e, kind);
    }
    return out;
  }
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  xf = xf * at::rsqrt(var + eps);
  if (kind == NormKind::kZeroCentred) return (xf * (1.0 + w.to(at::kFloat))).to(x.scalar_type());
  if (kind == NormKind::kPlainF32Weight) return (w.to(at::kFloat) * xf).to(x.scalar_type());
  return w * xf.to(x.scalar_type());
}

AddNormed AddRmsNorm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps,
                     NormKind kind) {
  if (!NormByHand(x, w) || !delta.is_contiguous() || delta.sizes() != x.sizes() ||
      delta.scalar_type() != x.scalar_type() || !delta.device().is_cpu()) {
    at::Tensor sum = x + delta;
    return {sum, RmsNorm(sum, w, eps, kind)};
  }
  // One pass where x + delta and RmsNorm were two ops (a bf16 decode step at batch 32 spent
  // about 23 µs on each ATen add of [32, 1024]).
  const int64_t n = x.size(-1), rows = x.numel() / n;
  AddNormed r{at::empty_like(x), at::empty_like(x)};
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    RmsNormRows<float>(x.data_ptr<float>(), delta.data_ptr<float>(), w, r.sum.data_ptr<float>(),
                       r.normed.data_ptr<float>(), rows, n, e, kind);
  } else {
    RmsNormRows<at::BFloat16>(x.data_ptr<at::BFloat16>(), delta.data_ptr<at::BFloat16>(), w,
                              r.sum.data_ptr<at::BFloat16>(), r.normed.data_ptr<at::BFloat16>(),
                              rows, n, e, kind);
  }
  return r;
}

at::Tensor ResidualStream::Norm(const at::Tensor& w, double eps, NormKind kind) {
  if (!pending_.defined()) return RmsNorm(x_, w, eps, kind);
  AddNormed r = AddRmsNorm(x_, pending_, w, eps, kind);
  x_ = std::move(r.sum);
  pending_ = at::Tensor();
  return r.normed;
}

const at::Tensor& ResidualStream::Sum() {
  if (pending_.defined()) {
    x_ = x_ + pending_;
    pending_ = at::Tensor();
  }
  return x_;
}

Rotary::Rotary(const RopeSpec& spec, const at::Device& device)
    : rotary_dim_(spec.rotary_dim()), head_dim_(spec.head_dim), device_(device) {
  const std::vector<double> inv = RopeInvFreq(spec, &scaling_);
  std::vector<float> f(inv.begin(), inv.end());
  inv_freq_ =
      at::from_blob(f.data(), {static_cast<int64_t>(f.size())}, at::kFloat).clone().to(device);
}

Rotary::Table Rotary::ComputeRows(const at::Tensor& pos, at::ScalarType dtype) const {
  at::Tensor freqs = pos.unsqueeze(1) * inv_freq_.unsqueeze(0);  // [T, rd/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor c = emb.cos(), s = emb.sin();
  if (scaling_ != 1.0) {
    c = c * scaling_;
    s = s * scaling_;
  }
  return {c.to(dtype).contiguous(), s.to(dtype).contiguous()};
}

Rotary::Table Rotary::Compute(const std::vector<int64_t>& positions, at::ScalarType dtype) const {
  const int64_t T = static_cast<int64_t>(positions.size());
  if (!device_.is_cpu() || T == 0) {
    at::Tensor pos = at::from_blob(const_cast<int64_t*>(positions.data()), {T}, at::kLong)
                         .to(at::kFloat)
                         .to(device_);
    return ComputeRows(pos, dtype);
  }
  // The CPU: rows of a table of every position so far (grown by doubling), copied out. Each
  // element is the same elementwise computation of its position either way.
  const int64_t need = *std::max_element(positions.begin(), positions.end()) + 1;
  CpuTable& t = *cpu_table_;
  std::lock_guard<std::mutex> lock(t.mu);
  if (t.rows < need || t.dtype != dtype || !t.cos.defined()) {
    const int64_t rows = std::max<int64_t>({need, 2 * (t.dtype == dtype ? t.rows : 0), 256});
    Table all = ComputeRows(at::arange(rows, at::TensorOptions().dtype(at::kFloat)), dtype);
    t.cos = all.cos;
    t.sin = all.sin;
    t.rows = rows;
    t.dtype = dtype;
  }
  return {GatherRows(t.cos, positions), GatherRows(t.sin, positions)};
}

namespace {

// Attention on the CPU for query rows whose K/V rows are already in their sequence's cache:
// every decode token, and the prompt tokens of sequences with short contexts (a query at
// position p sees keys up to p, from p - window + 1 with a window). Written by hand, not with
// ATen ops per sequence: those were ~15 ops per sequence and layer (2000 op dispatches a decode
// step at batch 32, as many in a prefill of 32 prompts), and libtorch 1.13 has no fused
// scaled_dot_product_attention. One OpenMP loop over (query, head); f32 accumulation, the
// softmax in f32 as on the ATen path; with `sinks` the sink joins the denominator only.
// Prompt tokens go through that loop while their sequence's keys (past + new) are at most this
// many; longer prompts through ATen GEMMs per sequence, whose BLAS beats the scalar dot products
// once each query has many keys to read.
constexpr int64_t kCachedAttentionMaxKeys = 256;

struct QueryRow {
  const ForwardBatch::Seq* seq;
  int64_t row;  // in the batch
  int64_t pos;  // its position: the last key it sees
};

// Per (query, KV head): the KV head's key and value rows are widened to f32 once (bf16) and
// serve the hq / hkv query heads that share them.
template <typename T>
void CachedAttentionCpu(const T* q, const std::vector<QueryRow>& rows, int layer, int64_t hq,
                        int64_t hkv, int64_t d, int64_t window, double scale, const float* sinks,
                        T* out) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  const int64_t groups = hq / hkv, Q = static_cast<int64_t>(rows.size());
  // kernels/decode_attention.h where the CPU has AVX-512, the loop below elsewhere. Decode step
  // of bench/peer's model (decode_step --only peer, two runs each): bf16 batch 32 20.4 / 20.3 ->
  // 19.8 / 19.6 ms, f32 batch 32 40.9 / 40.9 -> 40.3 / 40.2.
  const bool fast = DecodeAttentionAvailable(d);
  // One task per query row, its KV heads one after the other (from 4 rows a thread on): the row's
  // keys and values are one contiguous stretch of its cache ([position, KV head, d]), which the
  // first head brings into the caches for the others. One task per (query, KV head) read that
  // stretch as hkv strided streams, on both threads at once: the attention's time over a
  // decode_step --only peer run (276 calls, batch 32), three runs each: bf16 56.7, 53.0, 54.4
  // -> 44.9, 47.5, 45.5 ms; f32, two runs, 60.5, 59.2 -> 48.2, 49.9 ms (batch 8: 15.7, 15.2
  // -> 13.4, 13.2 ms). With fewer than 4 query rows a thread (a decode at batch 1-7 on 2 threads),
  // one task per (query, KV head) as before, so that every thread has work.
  const int64_t span = Q >= 4 * static_cast<int64_t>(omp_get_max_threads()) ? hkv : 1;
  // Where a task takes all of a row's KV heads, its first head's call prefetches the whole cache
  // rows (every KV head's part, a few rows ahead: DecodeAttentionArgs::k_rows) for the calls on
  // the other heads after it: each of those had read its part of every row from memory again, a
  // stream with a stride of a whole row. Timers around this function, decode_step --only peer
  // (bf16, batch 32, 600 steps: 16-616 keys, 316 on average), two runs each: 544, 554 -> 344,
  // 334 µs a layer; steps 10.55, 10.77 -> 9.86, 9.67 ms.
  const bool row_prefetch = span == hkv && DecodeAttentionRowPrefetch();
#pragma omp parallel
  {
    std::vector<float> kf, vf, scores, acc(d), qf(d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t task = 0; task < Q * hkv / span; ++task) {
      for (int64_t u = task * span; u < (task + 1) * span; ++u) {
        const QueryRow& qr = rows[u / hkv];
        const int64_t g = u % hkv;
        const LayerState& st = qr.seq->state->layers[layer];
        const int64_t total = qr.pos + 1;
        const int64_t k0 = window > 0 ? std::max<int64_t>(0, qr.pos - window + 1) : 0;
        const int64_t n = total - k0, stride = hkv * d;
        const T* K = st.k.data_ptr<T>() + (k0 * hkv + g) * d;
        const T* V = st.v.data_ptr<T>() + (k0 * hkv + g) * d;
        if (fast) {
          // The group's query heads (widened from bf16) against the rows in place.
          DecodeAttentionArgs a;
          const T* q0 = q + (qr.row * hq + g * groups) * d;
          if constexpr (kBf16) {
            qf.resize(groups * d);
            WidenBf16(reinterpret_cast<const uint16_t*>(q0), qf.data(), groups * d);
            a.q = qf.data();
            acc.resize(groups * d);
            a.out = acc.data();
          } else {
            a.q = q0;
            a.out = out + (qr.row * hq + g * groups) * d;
          }
          a.q_stride = a.out_stride = d;
          a.k = K;
          a.v = V;
          a.kv_bf16 = kBf16;
          a.kv_stride = stride;
          a.n = n;
          a.d = d;
          a.heads = groups;
          a.scale = static_cast<float>(scale);
          a.sinks = sinks != nullptr ? sinks + g * groups : nullptr;
          if (row_prefetch && g == 0) {
            a.k_rows = K;
            a.v_rows = V;
            a.row_bytes = stride * static_cast<int64_t>(sizeof(T));
          }
          scores.resize(groups * (n + 16));
          DecodeAttention(a, scores.data());
          if constexpr (kBf16) {
            RoundToBf16(acc.data(),
                        reinterpret_cast<uint16_t*>(out + (qr.row * hq + g * groups) * d),
                        groups * d);
          }
          continue;
        }
        const float *kb, *vb;
        int64_t kstride;
        if constexpr (kBf16) {
          kf.resize(n * d);
          vf.resize(n * d);
          for (int64_t j = 0; j < n; ++j) {
            WidenBf16(reinterpret_cast<const uint16_t*>(K + j * stride), kf.data() + j * d, d);
            WidenBf16(reinterpret_cast<const uint16_t*>(V + j * stride), vf.data() + j * d, d);
          }
          kb = kf.data();
          vb = vf.data();
          kstride = d;
        } else {
          kb = K;
          vb = V;
          kstride = stride;
        }
        scores.resize(n);
        for (int64_t h = g * groups; h < (g + 1) * groups; ++h) {
          const T* qh = q + (qr.row * hq + h) * d;
          if constexpr (kBf16) {
            WidenBf16(reinterpret_cast<const uint16_t*>(qh), qf.data(), d);
          } else {
            std::copy(qh, qh + d, qf.begin());
          }
          float mx = -std::numeric_limits<float>::infinity();
          for (int64_t j = 0; j < n; ++j) {
            const float s = static_cast<float>(Dot(qf.data(), kb + j * kstride, d) * scale);
            scores[j] = s;
            mx = std::max(mx, s);
          }
          if (sinks) mx = std::max(mx, sinks[h]);
          float denom = sinks ? std::exp(sinks[h] - mx) : 0.0f;
          for (float& s : scores) {
            s = std::exp(s - mx);
            denom += s;
          }
          std::fill(acc.begin(), acc.end(), 0.0f);
          for (int64_t j = 0; j < n; ++j) {
            const float* vr = vb + j * kstride;
            const float p = scores[j];
            for (int64_t c = 0; c < d; ++c) acc[c] += p * vr[c];
          }
          const float inv = 1.0f / denom;
          for (int64_t c = 0; c < d; ++c) acc[c] *= inv;
          T* o = out + (qr.row * hq + h) * d;
          if constexpr (kBf16) {
            RoundToBf16(acc.data(), reinterpret_cast<uint16_t*>(o), d);
          } else {
            std::copy(acc.begin(), acc.end(), o);
          }
        }
      }
    }
  }
}

// Rows a sequence's cache gets past its prompt when first allocated: room for that many decode
// tokens before the first growth. With the prompt's length exactly (and 16 at least) the first
// decode token of every sequence grew every layer's cache (a new tensor and a copy of the
// prompt's rows); at bench/peer's 32 sequences of 16 + 32 tokens the two growths a sequence
// meets cost a bf16 step 7-10 µs a layer on average (timers).
constexpr int64_t kCacheHeadroomRows = 64;

// Capacity for `total` rows (the prompt plus kCacheHeadroomRows at first, then doubling), keeping
// the rows held so far.
void GrowCache(LayerState& st, int64_t total, int64_t hkv, int64_t d, const at::TensorOptions& o) {
  if (st.k.defined() && st.k.size(0) >= total) return;
  const int64_t cap =
      st.k.defined() ? std::max<int64_t>(total, 2 * st.k.size(0)) : total + kCacheHeadroomRows;
  at::Tensor nk = at::empty({cap, hkv, d}, o), nv = at::empty({cap, hkv, d}, o);
  if (st.k.defined()) {
    // Every row of the old cache (fewer than `total`; rows past the sequence's length are
    // unused and copied along).
    const int64_t held = std::min(st.k.size(0), total);
    nk.narrow(0, 0, held).copy_(st.k.narrow(0, 0, held));
    nv.narrow(0, 0, held).copy_(st.v.narrow(0, 0, held));
  }
  st.k = nk;
  st.v = nv;
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}
}  // namespace

namespace {
// Rotary::Apply on the CPU with the roundings of its ATen form (x·c and rotate_half(x)·s each
// rounded to T, then their sum), a token (all its heads) per row: x [T, heads, hd], cos/sin
// [T, rd].
template <typename T>
void RotaryRows(const T* x, const T* cs, const T* sn, T* out, int64_t tokens, int64_t heads,
                int64_t hd, int64_t rd) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  const int64_t row = heads * hd;
  at::parallel_for(0, tokens, ElementwiseGrain(row), [&](int64_t t0, int64_t t1) {
    std::vector<float> f(kBf16 ? row + 2 * rd : 0), o32(rd);
    for (int64_t t = t0; t < t1; ++t) {
      const float *xr, *c, *s;
      if constexpr (kBf16) {
        WidenBf16(reinterpret_cast<const uint16_t*>(x + t * row), f.data(), row);
        WidenBf16(reinterpret_cast<const uint16_t*>(cs + t * rd), f.data() + row, rd);
        WidenBf16(reinterpret_cast<const uint16_t*>(sn + t * rd), f.data() + row + rd, rd);
        xr = f.data();
        c = f.data() + row;
        s = c + rd;
      } else {
        xr = x + t * row;
        c = cs + t * rd;
        s = sn + t * rd;
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* o = out + t * row + h * hd;
        if constexpr (kBf16) {
          RotaryRow(xr + h * hd, c, s, o32.data(), rd, true);
          RoundToBf16(o32.data(), reinterpret_cast<uint16_t*>(o), rd);
        } else {
          RotaryRow(xr + h * hd, c, s, o, rd, false);
        }
        for (int64_t i = rd; i < hd; ++i) o[i] = x[t * row + h * hd + i];
      }
    }
  });
}
}  // namespace

at::Tensor Rotary::Apply(const at::Tensor& x, const Table& t) const {
  const at::ScalarType st = x.scalar_type();
  if (x.device().is_cpu() && x.dim() == 3 && x.is_contiguous() && t.cos.is_contiguous() &&
      t.sin.is_contiguous() && (st == at::kFloat || st == at::kBFloat16) &&
      t.cos.scalar_type() == st && t.sin.scalar_type() == st && t.cos.size(0) == x.size(0) &&
      t.cos.size(1) == rotary_dim_ && rotary_dim_ <= x.size(2) && rotary_dim_ % 2 == 0) {
    // By hand: the ATen form is 6–8 ops on q and on k per layer.
    at::Tensor out = at::empty_like(x);
    if (st == at::kFloat) {
      RotaryRows(x.data_ptr<float>(), t.cos.data_ptr<float>(), t.sin.data_ptr<float>(),
                 out.data_ptr<float>(), x.size(0), x.size(1), x.size(2), rotary_dim_);
    } else {
      RotaryRows(x.data_ptr<at::BFloat16>(), t.cos.data_ptr<at::BFloat16>(),
                 t.sin.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), x.size(0), x.size(1),
                 x.size(2), rotary_dim_);
    }
    return out;
  }
  at::Tensor c = t.cos.unsqueeze(1), s = t.sin.unsqueeze(1);  // [T, 1, rd]
  if (rotary_dim_ == x.size(-1)) return x * c + RotateHalf(x) * s;
  at::Tensor rot = x.narrow(-1, 0, rotary_dim_);
  at::Tensor pass = x.narrow(-1, rotary_dim_, x.size(-1) - rotary_dim_);
  return at::cat({rot * c + RotateHalf(rot) * s, pass}, -1);
}

namespace {
// NormRotaryQk's pass over one token's heads of x (head h at x + h · hs, d contiguous values):
// RmsNormRows' and RotaryRows' arithmetic on each head in turn, with the normed heads kept in f32
// (rounded to bf16 where the model is bf16, as the tensor between the two ops was) rather than
// written out and read back. Whole-token calls where the heads are contiguous (hs == d), so that
// a 64-value head costs two calls (the norm and the rotation), not six. xr, nr, o32: heads · d
// floats each. out: the token's heads, contiguous.
template <typename T>
void NormRotaryToken(const T* x, int64_t hs, int64_t heads, int64_t d, const float* w,
                     NormForm form, float eps, const float* c, const float* s, int64_t rd,
                     float* xr, float* nr, float* o32, T* out) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  // x's heads in f32: xr (bf16 widened; f32 heads gathered where they are not contiguous) or x.
  const float* xf = nullptr;
  if constexpr (kBf16) {
    const auto* xb = reinterpret_cast<const uint16_t*>(x);
    if (hs == d) {
      WidenBf16(xb, xr, heads * d);
    } else {
      for (int64_t h = 0; h < heads; ++h) WidenBf16(xb + h * hs, xr + h * d, d);
    }
    xf = xr;
  } else {
    if (hs != d) {
      for (int64_t h = 0; h < heads; ++h) std::copy(x + h * hs, x + h * hs + d, xr + h * d);
    }
    xf = hs == d ? x : xr;
  }
  for (int64_t h = 0; h < heads; ++h) RmsNormRow(xf + h * d, w, nr + h * d, d, eps, form, kBf16);
  if constexpr (kBf16) RoundTripBf16(nr, heads * d);
  // Rotated dims into `rot` (bf16: o32, rounded into out at the end; f32: out), the rest of each
  // head as normed.
  float* rot = o32;
  if constexpr (!kBf16) rot = out;
  for (int64_t h = 0; h < heads; ++h) {
    RotaryRow(nr + h * d, c, s, rot + h * d, rd, kBf16);
    std::copy(nr + h * d + rd, nr + (h + 1) * d, rot + h * d + rd);
  }
  if constexpr (kBf16) {
    RoundToBf16(o32, reinterpret_cast<uint16_t*>(out), heads * d);  // the pass-through: exact
  }
}

}  // namespace

bool NormRotaryQk(at::Tensor& q, at::Tensor& k, const at::Tensor& q_norm, const at::Tensor& k_norm,
                  double eps, NormKind kind, const Rotary& rope, const Rotary::Table& table) {
  if (!q.defined() || !k.defined() || q.dim() != 3 || k.dim() != 3) return false;
  const at::ScalarType st = q.scalar_type();
  const int64_t T = q.size(0), hq = q.size(1), hkv = k.size(1), d = q.size(2);
  const int64_t rd = rope.rotary_dim();
  auto norm_ok = [&](const at::Tensor& w) {
    return w.defined() && w.device().is_cpu() && w.dim() == 1 && w.size(0) == d &&
           w.is_contiguous() && w.scalar_type() == st;
  };
  if (!q.device().is_cpu() || !k.device().is_cpu() || (st != at::kFloat && st != at::kBFloat16) ||
      k.scalar_type() != st || k.size(0) != T || k.size(2) != d || q.stride(2) != 1 ||
      k.stride(2) != 1 || q.stride(0) < hq * q.stride(1) || k.stride(0) < hkv * k.stride(1) ||
      q.stride(1) < d || k.stride(1) < d || !norm_ok(q_norm) || !norm_ok(k_norm) ||
      !table.cos.is_contiguous() || !table.sin.is_contiguous() || table.cos.scalar_type() != st ||
      table.sin.scalar_type() != st || table.cos.dim() != 2 || table.cos.size(0) != T ||
      table.cos.size(1) != rd || rd > d || rd % 2 != 0 || T == 0) {
    return false;
  }
  std::vector<float> wq_buf, wk_buf;
  const float* wq = NormWeightF32(q_norm, wq_buf);
  const float* wk = NormWeightF32(k_norm, wk_buf);
  const NormForm form = FormOf(kind);
  const float e = static_cast<float>(eps);
  at::Tensor qo = at::empty({T, hq, d}, q.options().memory_format(at::MemoryFormat::Contiguous));
  at::Tensor ko = at::empty({T, hkv, d}, k.options().memory_format(at::MemoryFormat::Contiguous));
  auto run = [&](auto tag) {
    using U = decltype(tag);
    constexpr bool kBf16 = std::is_same_v<U, at::BFloat16>;
    const U* qx = q.data_ptr<U>();
    const U* kx = k.data_ptr<U>();
    const U* cs = table.cos.data_ptr<U>();
    const U* sn = table.sin.data_ptr<U>();
    U* qd = qo.data_ptr<U>();
    U* kd = ko.data_ptr<U>();
    at::parallel_for(0, T, ElementwiseGrain((hq + hkv) * d), [&](int64_t t0, int64_t t1) {
      const int64_t most = std::max(hq, hkv) * d;
      std::vector<float> xr(most), nr(most), o32(kBf16 ? most : 0), cf(kBf16 ? 2 * rd : 0);
      for (int64_t t = t0; t < t1; ++t) {
        const float *c, *s;
        if constexpr (kBf16) {
          WidenBf16(reinterpret_cast<const uint16_t*>(cs + t * rd), cf.data(), rd);
          WidenBf16(reinterpret_cast<const uint16_t*>(sn + t * rd), cf.data() + rd, rd);
          c = cf.data();
          s = c + rd;
        } else {
          c = cs + t * rd;
          s = sn + t * rd;
        }
        NormRotaryToken(qx + t * q.stride(0), q.stride(1), hq, d, wq, form, e, c, s, rd, xr.data(),
                        nr.data(), o32.data(), qd + t * hq * d);
        NormRotaryToken(kx + t * k.stride(0), k.stride(1), hkv, d, wk, form, e, c, s, rd, xr.data(),
                        nr.data(), o32.data(), kd + t * hkv * d);
      }
    });
  };
  if (st == at::kFloat) {
    run(float{});
  } else {
    run(at::BFloat16{});
  }
  q = qo;
  k = ko;
  return true;
}

Attention::Attention(const AttentionSpec& spec, std::unique_ptr<LoraLinear> q,
                     std::unique_ptr<LoraLinear> k, std::unique_ptr<LoraLinear> v,
                     std::unique_ptr<LoraLinear> o, at::Tensor q_norm, at::Tensor k_norm,
                     at::Tensor sinks)
    : spec_(spec),
      q_(std::move(q)),
      k_(std::move(k)),
      v_(std::move(v)),
      o_(std::move(o)),
      q_norm_(std::move(q_norm)),
      k_norm_(std::move(k_norm)),
      sinks_(std::move(sinks)) {}

absl::StatusOr<at::Tensor> Attention::Forward(const at::Tensor& h, const ForwardBatch& b, int layer,
                                              const Rotary& rope, const Rotary::Table& table,
                                              const LoraBatch& lb) {
  const int64_t T = h.size(0), hq = spec_.heads, hkv = spec_.kv_heads, d = spec_.head_dim;
  // The projections of h in one grouped GEMM: q (or Step3's q_down), k and v.
  MOELORA_ASSIGN_OR_RETURN(
      std::vector<at::Tensor> hp,
      LoraLinear::ForwardEach({q_down_ ? q_down_.get() : q_.get(), k_.get(), v_.get()}, h, lb));
  at::Tensor qg = hp[0], k = hp[1], v = hp[2];
  if (q_down_) {
    at::Tensor qin = RmsNorm(hp[0], latent_norm_, spec_.eps, NormKind::kPlain);
    MOELORA_ASSIGN_OR_RETURN(qg, q_->Forward(qin, lb));
  }
  at::Tensor q, gate;
  if (spec_.output_gate) {
    // Per head [q_h ; gate_h] (Qwen3.5: q_proj emits heads · 2 · head_dim).
    at::Tensor g = qg.view({T, hq, 2 * d});
    q = g.narrow(2, 0, d);
    gate = g.narrow(2, d, d).reshape({T, hq * d});
  } else {
    q = qg.view({T, hq, d});
  }
  k = k.view({T, hkv, d});
  v = v.view({T, hkv, d});
  // q/k norms and rotary: one pass over the tokens where NormRotaryQk takes them, else 4 passes.
  // decode_step --only peer, bf16 batch 32, timers over 160 layer calls: 11.1-12.6 -> 6.5 ms.
  if (!NormRotaryQk(q, k, q_norm_, k_norm_, spec_.eps, spec_.qk_norm_kind, rope, table)) {
    if (q_norm_.defined()) q = RmsNorm(q, q_norm_, spec_.eps, spec_.qk_norm_kind);
    if (k_norm_.defined()) k = RmsNorm(k, k_norm_, spec_.eps, spec_.qk_norm_kind);
    q = rope.Apply(q, table);
    k = rope.Apply(k, table);
  }
  at::Tensor attn = at::empty({T, hq * d}, h.options());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  const int64_t groups = hq / hkv, W = spec_.sliding_window;
  // Sequences the hand-written loop takes (below), the rest one by one through ATen GEMMs.
  const bool cached_cpu =
      h.device().is_cpu() && (h.scalar_type() == at::kFloat || h.scalar_type() == at::kBFloat16);
  std::vector<const ForwardBatch::Seq*> by_aten;
  std::vector<QueryRow> rows;
  if (cached_cpu) {
    // Append each sequence's K/V rows (growing the cache as below), then all queries at once.
    at::Tensor kn = k.contiguous(), vn = v.contiguous();
    const size_t row = static_cast<size_t>(hkv * d) * kn.element_size();
    for (const auto& seq : b.seqs) {
      const int64_t past = seq.state->len, n = seq.count;
      if (n > 1 && past + n > kCachedAttentionMaxKeys) {
        by_aten.push_back(&seq);
        continue;
      }
      LayerState& st = seq.state->layers[layer];
      GrowCache(st, past + n, hkv, d, h.options());
      std::memcpy(static_cast<char*>(st.k.data_ptr()) + past * row,
                  static_cast<const char*>(kn.data_ptr()) + seq.begin * row, n * row);
      std::memcpy(static_cast<char*>(st.v.data_ptr()) + past * row,
                  static_cast<const char*>(vn.data_ptr()) + seq.begin * row, n * row);
      for (int64_t i = 0; i < n; ++i) rows.push_back({&seq, seq.begin + i, past + i});
    }
    at::Tensor qc = q.contiguous();
    at::Tensor sk = sinks_.defined() ? sinks_.to(at::kFloat).contiguous() : at::Tensor();
    const float* sp = sk.defined() ? sk.data_ptr<float>() : nullptr;
    if (rows.empty()) {
      // Every sequence is a long prompt.
    } else if (h.scalar_type() == at::kFloat) {
      CachedAttentionCpu(qc.data_ptr<float>(), rows, layer, hq, hkv, d, W, scale, sp,
                         attn.data_ptr<float>());
    } else {
      CachedAttentionCpu(qc.data_ptr<at::BFloat16>(), rows, layer, hq, hkv, d, W, scale, sp,
                         attn.data_ptr<at::BFloat16>());
    }
  } else {
    for (const auto& seq : b.seqs) by_aten.push_back(&seq);
  }
  for (const ForwardBatch::Seq* sq : by_aten) {
    const ForwardBatch::Seq& seq = *sq;
    LayerState& st = seq.state->layers[layer];
    const int64_t n = seq.count, past = seq.state->len, total = past + n;
    GrowCache(st, total, hkv, d, h.options());
    at::Tensor& kc = st.k;
    at::Tensor& vc = st.v;
    kc.narrow(0, past, n).copy_(k.narrow(0, seq.begin, n));
    vc.narrow(0, past, n).copy_(v.narrow(0, seq.begin, n));
    // Keys a query can see: causal, and with a window only positions > p - W. The first query
    // (position `past`) sees from past - W + 1 on: older keys are skipped outright.
    const int64_t k0 = W > 0 ? std::max<int64_t>(0, past - W + 1) : 0;
    at::Tensor K = kc.narrow(0, k0, total - k0).permute({1, 0, 2});  // [hkv, keys, d]
    at::Tensor Vv = vc.narrow(0, k0, total - k0).permute({1, 0, 2});
    if (groups > 1) {
      K = K.repeat_interleave(groups, 0);
      Vv = Vv.repeat_interleave(groups, 0);
    }
    at::Tensor qs = q.narrow(0, seq.begin, n).permute({1, 0, 2});  // [hq, n, d]
    at::Tensor scores = CpuMatmul(qs, K.transpose(1, 2)) * scale;  // [hq, n, keys]
    if (n > 1 || (W > 0 && total - k0 > W)) {
      const auto lopt = at::TensorOptions().dtype(at::kLong).device(h.device());
      at::Tensor qpos = at::arange(past, total, lopt).unsqueeze(1);
      at::Tensor kpos = at::arange(k0, total, lopt).unsqueeze(0);
      at::Tensor masked = kpos > qpos;
      if (W > 0) masked = masked.logical_or(kpos <= qpos - W);
      scores = scores.masked_fill(masked, -std::numeric_limits<float>::infinity());
    }
    at::Tensor probs;
    if (sinks_.defined()) {
      // The sink joins the denominator as one more column, then is dropped (transformers: the
      // row max is subtracted first; softmax does that anyway).
      const int64_t keys = scores.size(2);
      at::Tensor sink = sinks_.to(scores.scalar_type()).view({hq, 1, 1}).expand({hq, n, 1});
      probs = at::softmax(at::cat({scores, sink}, -1), -1, scores.scalar_type())
                  .narrow(-1, 0, keys)
                  .to(h.scalar_type());
    } else {
      probs = at::softmax(scores, -1, at::kFloat).to(h.scalar_type());
    }
    at::Tensor o = CpuMatmul(probs, Vv);  // [hq, n, d]
    attn.narrow(0, seq.begin, n).copy_(o.permute({1, 0, 2}).reshape({n, hq * d}));
  }
  if (spec_.output_gate) attn = attn * at::sigmoid(gate);
  if (g_) {
    MOELORA_ASSIGN_OR_RETURN(at::Tensor hg, g_->Forward(h, lb));  // [T, hq]
    attn = (attn.view({T, hq, d}) * at::sigmoid(hg).unsqueeze(-1)).view({T, hq * d});
  }
  return o_->Forward(attn, lb);
}

}  // namespace moelora
