#include "worker/layers/gated_delta_net.h"

#include <cmath>
#include <limits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moelora {

GatedDeltaNet::GatedDeltaNet(const GatedDeltaNetSpec& spec, std::unique_ptr<LoraLinear> in_qkv,
                             std::unique_ptr<LoraLinear> in_z, std::unique_ptr<LoraLinear> in_b,
                             std::unique_ptr<LoraLinear> in_a, std::unique_ptr<LoraLinear> out,
                             at::Tensor conv_weight, at::Tensor dt_bias, at::Tensor a_log,
                             at::Tensor norm)
    : spec_(spec),
      in_qkv_(std::move(in_qkv)),
      in_z_(std::move(in_z)),
      in_b_(std::move(in_b)),
      in_a_(std::move(in_a)),
      out_(std::move(out)),
      conv_w_(conv_weight.to(at::kFloat).contiguous()),
      dt_bias_(dt_bias.to(at::kFloat)),
      // g = -exp(A_log) · softplus(a + dt_bias): the first factor is a constant.
      a_neg_exp_(-a_log.to(at::kFloat).exp()),
      norm_(std::move(norm)) {}

at::Tensor GatedDeltaNet::Recurrent(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                    const at::Tensor& g, const at::Tensor& beta, at::Tensor& S,
                                    at::Tensor* steps) const {
  const int64_t n = q.size(1);
  at::Tensor o = at::empty({v.size(0), n, v.size(2)}, v.options());
  at::Tensor decay = g.exp();
  for (int64_t t = 0; t < n; ++t) {
    at::Tensor kt = k.select(1, t), qt = q.select(1, t), vt = v.select(1, t);  // [nv, d]
    S.mul_(decay.select(1, t).unsqueeze(-1).unsqueeze(-1));
    at::Tensor kv = at::bmm(kt.unsqueeze(1), S).squeeze(1);          // [nv, dv]: Sᵀk
    at::Tensor delta = (vt - kv) * beta.select(1, t).unsqueeze(-1);  // [nv, dv]
    S.add_(at::bmm(kt.unsqueeze(2), delta.unsqueeze(1)));            // k δᵀ
    o.select(1, t).copy_(at::bmm(qt.unsqueeze(1), S).squeeze(1));    // Sᵀq (updated state)
    if (steps != nullptr) steps->select(0, t).copy_(S);
  }
  return o;
}

at::Tensor GatedDeltaNet::Chunked(const at::Tensor& q_in, const at::Tensor& k_in,
                                  const at::Tensor& v_in, const at::Tensor& g_in,
                                  const at::Tensor& beta_in, at::Tensor& S) const {
  const int64_t nv = q_in.size(0), n = q_in.size(1), dk = q_in.size(2), dv = v_in.size(2);
  const int64_t C = spec_.chunk, pad = (C - n % C) % C, L = n + pad, nc = L / C;
  auto pad_t = [&](const at::Tensor& x) {
    if (pad == 0) return x;
    std::vector<int64_t> shape = x.sizes().vec();
    shape[1] = pad;
    return at::cat({x, at::zeros(shape, x.options())}, 1);
  };
  // Padded positions have g = 0 and β = 0: they change neither the state nor earlier outputs.
  at::Tensor q = pad_t(q_in).view({nv, nc, C, dk});
  at::Tensor k = pad_t(k_in).view({nv, nc, C, dk});
  at::Tensor v = pad_t(v_in);
  at::Tensor beta = pad_t(beta_in);
  at::Tensor g = pad_t(g_in).view({nv, nc, C});
  at::Tensor v_beta = (v * beta.unsqueeze(-1)).view({nv, nc, C, dv});
  at::Tensor k_beta = (pad_t(k_in) * beta.unsqueeze(-1)).view({nv, nc, C, dk});
  at::Tensor cum = g.cumsum(-1);  // γ within each chunk
  const auto bopt = at::TensorOptions().dtype(at::kBool).device(q.device());
  at::Tensor upper = at::ones({C, C}, bopt).triu(1);
  // Γ[i, j] = exp(γ_i - γ_j) for j <= i, else 0.
  at::Tensor decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2))
                         .masked_fill(upper, -std::numeric_limits<float>::infinity())
                         .exp();
  at::Tensor kt = k.transpose(-1, -2);
  at::Tensor ut = at::matmul(k_beta, kt) * decay;  // strictly lower part is A (diagonal unused)
  at::Tensor intra = at::matmul(q, kt) * decay;    // causal within the chunk
  at::Tensor decayed_k_beta = k_beta * cum.exp().unsqueeze(-1);
  // (I + A) X = B, unit lower triangular.
  at::Tensor u = at::linalg_solve_triangular(ut, v_beta, /*upper=*/false, /*left=*/true,
                                             /*unitriangular=*/true);
  at::Tensor w = at::linalg_solve_triangular(ut, decayed_k_beta, false, true, true);
  at::Tensor qd = q * cum.exp().unsqueeze(-1);
  at::Tensor kd = k * (cum.narrow(-1, C - 1, 1) - cum).exp().unsqueeze(-1);
  at::Tensor chunk_decay = cum.select(-1, C - 1).exp();  // [nv, nc]
  at::Tensor o = at::empty({nv, nc, C, dv}, v.options());
  for (int64_t i = 0; i < nc; ++i) {
    at::Tensor v_new = u.select(1, i) - at::matmul(w.select(1, i), S);  // [nv, C, dv]
    o.select(1, i).copy_(at::matmul(qd.select(1, i), S) + at::matmul(intra.select(1, i), v_new));
    S = S * chunk_decay.select(1, i).unsqueeze(-1).unsqueeze(-1) +
        at::matmul(kd.select(1, i).transpose(-1, -2), v_new);
  }
  return o.view({nv, L, dv}).narrow(1, 0, n);
}

absl::StatusOr<at::Tensor> GatedDeltaNet::Forward(const at::Tensor& h, const ForwardBatch& b,
                                                  int layer, const LoraBatch& lb) {
  const int64_t T = h.size(0), nk = spec_.num_key_heads, nv = spec_.num_value_heads,
                dk = spec_.key_head_dim, dv = spec_.value_head_dim, K = spec_.conv_kernel;
  const int64_t kd = nk * dk, vd = nv * dv;
  MOELORA_ASSIGN_OR_RETURN(at::Tensor qkv, in_qkv_->Forward(h, lb));  // [T, C]
  MOELORA_ASSIGN_OR_RETURN(at::Tensor z, in_z_->Forward(h, lb));      // [T, vd]
  MOELORA_ASSIGN_OR_RETURN(at::Tensor bb, in_b_->Forward(h, lb));     // [T, nv]
  MOELORA_ASSIGN_OR_RETURN(at::Tensor aa, in_a_->Forward(h, lb));     // [T, nv]
  at::Tensor beta_all = at::sigmoid(bb).to(at::kFloat);
  at::Tensor g_all = a_neg_exp_ * at::softplus(aa.to(at::kFloat) + dt_bias_);
  at::Tensor y = at::empty({T, vd}, h.options());
  const int64_t rep = nv / nk;
  for (const auto& seq : b.seqs) {
    const KvCache* kv = seq.state->kv;
    if (kv == nullptr || seq.state->table.state < 0) {
      return absl::FailedPreconditionError(absl::StrCat(
          "linear-attention layer ", layer, ": the sequence has no recurrent-state entry"));
    }
    at::Tensor conv_state = kv->conv(layer, seq.state->table.state);  // views into the pool
    at::Tensor ssm = kv->ssm(layer, seq.state->table.state);
    const int64_t n = seq.count;
    // Causal depthwise conv over [the last K - 1 inputs | the new ones], then SiLU.
    at::Tensor xcat = at::cat({conv_state, qkv.narrow(0, seq.begin, n)}, 0);  // [K - 1 + n, C]
    conv_state.copy_(xcat.narrow(0, n, K - 1));
    at::Tensor conv = (xcat.to(at::kFloat).unfold(0, K, 1) * conv_w_.unsqueeze(0)).sum(-1);
    conv = at::silu(conv).to(h.scalar_type()).to(at::kFloat);  // [n, C]
    at::Tensor q = conv.narrow(1, 0, kd).view({n, nk, dk});
    at::Tensor k = conv.narrow(1, kd, kd).view({n, nk, dk});
    at::Tensor v = conv.narrow(1, 2 * kd, vd).view({n, nv, dv});
    if (rep > 1) {
      q = q.repeat_interleave(rep, 1);
      k = k.repeat_interleave(rep, 1);
    }
    auto l2 = [](const at::Tensor& x) { return x * at::rsqrt((x * x).sum(-1, true) + 1e-6); };
    q = l2(q) * (1.0 / std::sqrt(static_cast<double>(dk)));
    k = l2(k);
    // [heads, n, d] for the delta rule.
    q = q.permute({1, 0, 2}).contiguous();
    k = k.permute({1, 0, 2}).contiguous();
    v = v.permute({1, 0, 2}).contiguous();
    at::Tensor g = g_all.narrow(0, seq.begin, n).t().contiguous();  // [nv, n]
    at::Tensor beta = beta_all.narrow(0, seq.begin, n).t().contiguous();
    // A speculative verify keeps the state after each token (RollBack returns to one): the
    // recurrent form, which passes through each.
    const bool chunked =
        !seq.keep_states && (spec_.form == GatedDeltaNetSpec::Form::kChunked ||
                             (spec_.form == GatedDeltaNetSpec::Form::kAuto && n > 1));
    at::Tensor S = ssm;  // Recurrent updates it in place; Chunked computes a new one
    at::Tensor steps;
    if (seq.keep_states) {
      std::vector<int64_t> shape = {n};
      for (int64_t x : ssm.sizes()) shape.push_back(x);
      steps = at::empty(shape, ssm.options());
      seq.state->steps[layer] = {steps, xcat};
    } else {
      seq.state->steps.erase(layer);  // states kept by an earlier forward are stale now
    }
    at::Tensor o = chunked ? Chunked(q, k, v, g, beta, S)
                           : Recurrent(q, k, v, g, beta, S, seq.keep_states ? &steps : nullptr);
    if (!S.is_same(ssm)) ssm.copy_(S);
    // Gated RMSNorm per value head (norm before gate), as transformers computes it.
    at::Tensor of = o.permute({1, 0, 2}).to(h.scalar_type()).to(at::kFloat);  // [n, nv, dv]
    of = of * at::rsqrt(of.pow(2).mean(-1, true) + spec_.eps);
    at::Tensor zz = z.narrow(0, seq.begin, n).view({n, nv, dv}).to(at::kFloat);
    at::Tensor out = (norm_ * of.to(h.scalar_type())) * at::silu(zz);
    y.narrow(0, seq.begin, n).copy_(out.reshape({n, vd}));
  }
  return out_->Forward(y, lb);
}

}  // namespace moelora
