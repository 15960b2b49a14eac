// Attention: paged KV writes and reads, the fused q/k norm and rotation, the layer.
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
#include "kernels/elementwise.h"
#include "kernels/paged_attention.h"
#include "worker/layers/gather.h"
#include "worker/layers/gemm.h"

namespace moelora {

namespace {

// Query rows per task of the paged attention on the CPU: a prompt's rows in tiles of this many
// (each tile reads its keys once for all its rows), a decode row alone.
constexpr int64_t kQueryTile = 32;

// The table a layer reads: its sliding-window one or the full-attention one.
const std::vector<int32_t>& TableOf(const ForwardBatch::Seq& s, bool windowed) {
  return windowed ? s.state->table.window_blocks : s.state->table.blocks;
}

// Writes the step's new keys and values (k, v: [T, hkv, d], contiguous) into each sequence's
// blocks at positions len .. len + count - 1.

void WriteKv(const at::Tensor& k, const at::Tensor& v, const ForwardBatch& b, const at::Tensor& kp,
             const at::Tensor& vp, int64_t bs, bool windowed) {
  const int64_t hkv = k.size(1), d = k.size(2);
  if (kp.device().is_cpu()) {
    const size_t row = static_cast<size_t>(hkv * d) * k.element_size();
    char* K = static_cast<char*>(kp.data_ptr());
    char* V = static_cast<char*>(vp.data_ptr());
    const char* ks = static_cast<const char*>(k.data_ptr());
    const char* vs = static_cast<const char*>(v.data_ptr());
    for (const auto& seq : b.seqs) {
      for (int64_t i = 0; i < seq.count; ++i) {
        const int64_t pos = seq.state->len + i;
        const int64_t at = TableOf(seq, windowed)[pos / bs] * bs + pos % bs;
        std::memcpy(K + at * row, ks + (seq.begin + i) * row, row);
        std::memcpy(V + at * row, vs + (seq.begin + i) * row, row);
      }
    }
    return;
  }
  std::vector<int64_t> rows;
  for (const auto& seq : b.seqs) {
    for (int64_t i = 0; i < seq.count; ++i) {
      const int64_t pos = seq.state->len + i;
      rows.push_back(TableOf(seq, windowed)[pos / bs] * bs + pos % bs);
    }
  }
  at::Tensor idx =
      at::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, at::kLong).to(kp.device());
  kp.view({-1, hkv, d}).index_copy_(0, idx, k);
  vp.view({-1, hkv, d}).index_copy_(0, idx, v);
}

// The CPU path: kernels/paged_attention.h over (sequence, query tile, KV head) tasks. q [T, hq, d]
// f32 contiguous; returns [T, hq, d] f32.
at::Tensor PagedAttentionCpu(const at::Tensor& q, const ForwardBatch& b, const at::Tensor& kp,
                             const at::Tensor& vp, int64_t bs, int64_t hkv, int64_t window,
                             bool windowed, double scale, const float* sinks) {
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2), groups = hq / hkv;
  at::Tensor out = at::empty({T, hq, d}, q.options());
  struct Task {
    const ForwardBatch::Seq* seq;
    int64_t row0, rows, g;
  };
  std::vector<Task> tasks;
  for (const auto& seq : b.seqs) {
    for (int64_t r = 0; r < seq.count; r += kQueryTile) {
      for (int64_t g = 0; g < hkv; ++g) {
        tasks.push_back({&seq, r, std::min(kQueryTile, seq.count - r), g});
      }
    }
  }
  const bool bf16 = kp.scalar_type() == at::kBFloat16;
  const int64_t elem = kp.element_size();
  const char* K = static_cast<const char*>(kp.data_ptr());
  const char* V = static_cast<const char*>(vp.data_ptr());
  const float* qd = q.data_ptr<float>();
  float* od = out.data_ptr<float>();
  const int64_t n = static_cast<int64_t>(tasks.size());
#pragma omp parallel if (n > 1)
  {
    std::vector<float> scratch;
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const Task& t = tasks[i];
      PagedAttentionArgs a;
      const int64_t row = t.seq->begin + t.row0;
      a.q = qd + (row * hq + t.g * groups) * d;
      a.q_row_stride = hq * d;
      a.q_head_stride = d;
      a.rows = t.rows;
      a.heads = groups;
      a.d = d;
      a.pos0 = t.seq->state->len + t.row0;
      a.window = window;
      a.blocks = TableOf(*t.seq, windowed).data();
      a.block_size = bs;
      a.k = K + t.g * d * elem;
      a.v = V + t.g * d * elem;
      a.kv_bf16 = bf16;
      a.block_stride = bs * hkv * d;
      a.row_stride = hkv * d;
      a.scale = static_cast<float>(scale);
      a.sinks = sinks != nullptr ? sinks + t.g * groups : nullptr;
      a.out = od + (row * hq + t.g * groups) * d;
      a.out_row_stride = hq * d;
      a.out_head_stride = d;
      scratch.resize(PagedAttentionScratchFloats(a));
      PagedAttention(a, scratch.data());
    }
  }
  return out;
}

// On a CUDA device: kernels/paged_attention.h's device kernel for every row at once (the block
// tables, each row's sequence and position uploaded per call). q [T, hq, d] f32 on the device.
absl::StatusOr<at::Tensor> PagedAttentionDevice(const at::Tensor& q, const ForwardBatch& b,
                                                const at::Tensor& kp, const at::Tensor& vp,
                                                int64_t bs, int64_t window, bool windowed,
                                                double scale, const at::Tensor& sinks) {
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2), hkv = kp.size(2);
  size_t max_blocks = 1;
  for (const auto& seq : b.seqs) max_blocks = std::max(max_blocks, TableOf(seq, windowed).size());
  std::vector<int32_t> tables(b.seqs.size() * max_blocks, 0), seq_of_row(T);
  std::vector<int64_t> pos_of_row(T);
  for (size_t i = 0; i < b.seqs.size(); ++i) {
    const auto& seq = b.seqs[i];
    // Given-back sliding-window blocks (-1) lie before every row's window: never read.
    const std::vector<int32_t>& t = TableOf(seq, windowed);
    std::copy(t.begin(), t.end(), tables.begin() + static_cast<int64_t>(i * max_blocks));
    for (int64_t r = 0; r < seq.count; ++r) {
      seq_of_row[seq.begin + r] = static_cast<int32_t>(i);
      pos_of_row[seq.begin + r] = seq.state->len + r;
    }
  }
  auto up = [&](auto& v, at::ScalarType t) {
    return at::from_blob(v.data(), {static_cast<int64_t>(v.size())}, t).to(q.device());
  };
  at::Tensor tt = up(tables, at::kInt), st = up(seq_of_row, at::kInt),
             pt = up(pos_of_row, at::kLong);
  at::Tensor sk = sinks.defined() ? sinks.to(q.device(), at::kFloat).contiguous() : at::Tensor();
  at::Tensor out = at::empty_like(q);
  PagedAttentionBatch a;
  a.q = q.data_ptr<float>();
  a.out = out.data_ptr<float>();
  a.k = kp.data_ptr();
  a.v = vp.data_ptr();
  a.kv_bf16 = kp.scalar_type() == at::kBFloat16;
  a.rows = T;
  a.hq = hq;
  a.hkv = hkv;
  a.d = d;
  a.block_size = bs;
  a.block_tables = tt.data_ptr<int32_t>();
  a.max_blocks = static_cast<int64_t>(max_blocks);
  a.seq_of_row = st.data_ptr<int32_t>();
  a.pos_of_row = pt.data_ptr<int64_t>();
  a.window = window;
  a.scale = static_cast<float>(scale);
  a.sinks = sk.defined() ? sk.data_ptr<float>() : nullptr;
  MOELORA_RETURN_IF_ERROR(PagedAttentionCuda(a, nullptr));
  return out;
}

// Any device and dtype, in ATen ops: each sequence's keys and values gathered from its blocks,
// its queries in chunks of kAtenQueryChunk rows, so the scores take [hq, chunk, keys].
constexpr int64_t kAtenQueryChunk = 256;

at::Tensor PagedAttentionAten(const at::Tensor& q, const ForwardBatch& b, const at::Tensor& kp,
                              const at::Tensor& vp, int64_t bs, int64_t W, bool windowed,
                              double scale, const at::Tensor& sinks, at::ScalarType dtype) {
  const int64_t T = q.size(0), hq = q.size(1), d = q.size(2), hkv = kp.size(2);
  const int64_t groups = hq / hkv;
  at::Tensor attn = at::empty({T, hq * d}, q.options().dtype(dtype));
  const auto lopt = at::TensorOptions().dtype(at::kLong).device(q.device());
  for (const auto& seq : b.seqs) {
    const int64_t past = seq.state->len, total = past + seq.count;
    // From the block of the first key any of its queries sees (given-back sliding-window blocks
    // lie before it).
    const int64_t b0 = (W > 0 ? std::max<int64_t>(0, past - W + 1) : 0) / bs;
    const std::vector<int32_t>& t = TableOf(seq, windowed);
    std::vector<int64_t> ids(t.begin() + b0, t.end());
    at::Tensor idx =
        at::from_blob(ids.data(), {static_cast<int64_t>(ids.size())}, at::kLong).to(q.device());
    at::Tensor kc = kp.index_select(0, idx).view({-1, hkv, d}).narrow(0, 0, total - b0 * bs);
    at::Tensor vc = vp.index_select(0, idx).view({-1, hkv, d}).narrow(0, 0, total - b0 * bs);
    for (int64_t c0 = 0; c0 < seq.count; c0 += kAtenQueryChunk) {
      const int64_t n = std::min(kAtenQueryChunk, seq.count - c0);
      const int64_t first = past + c0, last = first + n - 1;
      // Keys a query can see: causal, and with a window only positions > p - W.
      const int64_t k0 = W > 0 ? std::max<int64_t>(0, first - W + 1) : 0;
      at::Tensor K = kc.narrow(0, k0 - b0 * bs, last + 1 - k0).permute({1, 0, 2}).to(dtype);
      at::Tensor Vv = vc.narrow(0, k0 - b0 * bs, last + 1 - k0).permute({1, 0, 2}).to(dtype);
      if (groups > 1) {
        K = K.repeat_interleave(groups, 0);
        Vv = Vv.repeat_interleave(groups, 0);
      }
      at::Tensor qs = q.narrow(0, seq.begin + c0, n).permute({1, 0, 2}).to(dtype);  // [hq, n, d]
      at::Tensor scores = CpuMatmul(qs, K.transpose(1, 2)) * scale;                 // [hq, n, keys]
      at::Tensor qpos = at::arange(first, last + 1, lopt).unsqueeze(1);
      at::Tensor kpos = at::arange(k0, last + 1, lopt).unsqueeze(0);
      at::Tensor masked = kpos > qpos;
      if (W > 0) masked = masked.logical_or(kpos <= qpos - W);
      scores = scores.masked_fill(masked, -std::numeric_limits<float>::infinity());
      at::Tensor probs;
      if (sinks.defined()) {
        // The sink joins the denominator as one more column, then is dropped.
        const int64_t keys = scores.size(2);
        at::Tensor sink = sinks.to(scores.scalar_type()).view({hq, 1, 1}).expand({hq, n, 1});
        probs = at::softmax(at::cat({scores, sink}, -1), -1, scores.scalar_type())
                    .narrow(-1, 0, keys)
                    .to(dtype);
      } else {
        probs = at::softmax(scores, -1, at::kFloat).to(dtype);
      }
      at::Tensor o = CpuMatmul(probs, Vv);  // [hq, n, d]
      attn.narrow(0, seq.begin + c0, n).copy_(o.permute({1, 0, 2}).reshape({n, hq * d}));
    }
  }
  return attn;
}
}  // namespace

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
  KvCache* kv = b.seqs.empty() ? nullptr : b.seqs.front().state->kv;
  if (kv == nullptr || !kv->k(layer).defined()) {
    return absl::FailedPreconditionError(
        absl::StrCat("attention layer ", layer, ": the sequence has no KV cache"));
  }
  const at::Tensor& kp = kv->k(layer);
  const at::Tensor& vp = kv->v(layer);
  const int64_t bs = kv->block_size();
  const bool windowed = kv->windowed(layer);
  if (windowed) {
    // Every sliding-window block a query of the batch sees (or writes) must still be held: the
    // kernels read a given-back one (-1) out of the pool's bounds.
    for (const auto& seq : b.seqs) {
      const int64_t len = seq.state->len;
      const std::vector<int32_t>& t = seq.state->table.window_blocks;
      const int64_t first = std::max<int64_t>(0, len - spec_.sliding_window + 1) / bs;
      const int64_t last = (len + seq.count - 1) / bs;
      for (int64_t blk = first; blk <= last; ++blk) {
        if (blk >= static_cast<int64_t>(t.size()) || t[static_cast<size_t>(blk)] < 0) {
          return absl::InternalError(absl::StrCat("attention layer ", layer,
                                                  ": sliding-window block ", blk,
                                                  " of a sequence is not "
                                                  "held, but queries at positions ",
                                                  len, " .. ", len + seq.count - 1, " see it"));
        }
      }
    }
  }
  WriteKv(k.contiguous().to(kp.scalar_type()), v.contiguous().to(kp.scalar_type()), b, kp, vp, bs,
          windowed);
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  at::Tensor attn;
  if (h.device().is_cpu() &&
      (kp.scalar_type() == at::kFloat || kp.scalar_type() == at::kBFloat16)) {
    at::Tensor sk = sinks_.defined() ? sinks_.to(at::kFloat).contiguous() : at::Tensor();
    at::Tensor o =
        PagedAttentionCpu(q.to(at::kFloat).contiguous(), b, kp, vp, bs, hkv, spec_.sliding_window,
                          windowed, scale, sk.defined() ? sk.data_ptr<float>() : nullptr);
    attn = o.view({T, hq * d}).to(h.scalar_type());
  } else if (h.device().is_cuda() && d <= 256 &&
             (kp.scalar_type() == at::kFloat || kp.scalar_type() == at::kBFloat16)) {
    MOELORA_ASSIGN_OR_RETURN(at::Tensor o,
                             PagedAttentionDevice(q.to(at::kFloat).contiguous(), b, kp, vp, bs,
                                                  spec_.sliding_window, windowed, scale, sinks_));
    attn = o.view({T, hq * d}).to(h.scalar_type());
  } else {
    attn = PagedAttentionAten(q, b, kp, vp, bs, spec_.sliding_window, windowed, scale, sinks_,
                              h.scalar_type());
  }
  if (spec_.output_gate) attn = attn * at::sigmoid(gate);
  if (g_) {
    MOELORA_ASSIGN_OR_RETURN(at::Tensor hg, g_->Forward(h, lb));  // [T, hq]
    attn = (attn.view({T, hq, d}) * at::sigmoid(hg).unsqueeze(-1)).view({T, hq * d});
  }
  return o_->Forward(attn, lb);
}

}  // namespace moelora
