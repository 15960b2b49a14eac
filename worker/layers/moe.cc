#include "worker/layers/moe.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <numeric>
#include <type_traits>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/elementwise.h"
#include "kernels/moe_lora.h"
#include "worker/layers/gather.h"
#include "worker/layers/gemm.h"
#include "worker/layers/lora_ops.h"

namespace moelora {

namespace {
constexpr int kW1 = 0, kW3 = 1, kW2 = 2;  // expert LoRA projections (3D wrapper: kW1 = w13)
const char* const kMixedFlag = "--enable-mixed-moe-lora-format";

bool CpuElementwise(const at::Tensor& t) {
  return t.device().is_cpu() && t.is_contiguous() &&
         (t.scalar_type() == at::kFloat || t.scalar_type() == at::kBFloat16);
}

// act = silu(g) · u for rows [g ; u] of h13 [N, 2 Ip], by hand (the ATen form is 2 ops with
// bf16 converted element by element): silu rounded to T, then the product (kernels/
// elementwise.h; its exp is within 2 ulp of ATen's).
template <typename T>
void SwiGluRows(const T* h13, T* act, int64_t N, int64_t Ip) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  at::parallel_for(0, N, ElementwiseGrain(2 * Ip), [&](int64_t r0, int64_t r1) {
    std::vector<float> f(kBf16 ? 3 * Ip : 0);
    for (int64_t r = r0; r < r1; ++r) {
      if constexpr (kBf16) {
        WidenBf16(reinterpret_cast<const uint16_t*>(h13 + r * 2 * Ip), f.data(), 2 * Ip);
        SiluMul(f.data(), f.data() + Ip, f.data() + 2 * Ip, Ip, /*round_silu=*/true);
        RoundToBf16(f.data() + 2 * Ip, reinterpret_cast<uint16_t*>(act + r * Ip), Ip);
      } else {
        SiluMul(h13 + r * 2 * Ip, h13 + r * 2 * Ip + Ip, act + r * Ip, Ip, false);
      }
    }
  });
}

// out[token[i]] += ys[i] · ws[i] over the sorted rows i, by hand: what ys.mul_(ws) and
// out.index_add_(0, token, ys) compute (each token's rows added in ascending i, the product and
// each sum rounded to T), in one pass, parallel over tokens.
template <typename T>
void CombineRows(const T* ys, const T* ws, const std::vector<int64_t>& token, int64_t tokens,
                 int64_t H, T* out) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  const int64_t N = static_cast<int64_t>(token.size());
  std::vector<int64_t> start(tokens + 1, 0), rows(N);
  for (int64_t i = 0; i < N; ++i) ++start[token[i] + 1];
  for (int64_t t = 0; t < tokens; ++t) start[t + 1] += start[t];
  std::vector<int64_t> fill(start.begin(), start.end() - 1);
  for (int64_t i = 0; i < N; ++i) rows[fill[token[i]]++] = i;  // ascending i per token
  at::parallel_for(0, tokens, ElementwiseGrain(H * 4), [&](int64_t t0, int64_t t1) {
    std::vector<float> acc(H), m(kBf16 ? H : 0);
    for (int64_t t = t0; t < t1; ++t) {
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t k = start[t]; k < start[t + 1]; ++k) {
        const int64_t i = rows[k];
        if constexpr (kBf16) {
          WidenBf16(reinterpret_cast<const uint16_t*>(ys + i * H), m.data(), H);
          AddScaledRow(m.data(), static_cast<float>(ws[i]), acc.data(), H, true);
        } else {
          AddScaledRow(ys + i * H, ws[i], acc.data(), H, false);
        }
      }
      if constexpr (kBf16) {
        RoundToBf16(acc.data(), reinterpret_cast<uint16_t*>(out + t * H), H);
      } else {
        std::copy(acc.begin(), acc.end(), out + t * H);
      }
    }
  });
}

}  // namespace

// By hand: at::softmax(·, kFloat), at::topk, the division, the scaling and the cast were 5-6 ATen
// ops a layer, each its own pass and dispatch (0.15-0.33 ms of a decode step of bench/peer's
// model); here one pass. p[e] = exp(l[e] - max) · (1 / Σ), as ATen's softmax computes it
// (SoftmaxRow: its exp within 2 ulp of ATen's Sleef one; bf16 logits read as they are).
void SoftmaxTopKCpu(const at::Tensor& logits, int k, bool norm, double scale, at::Tensor& wts,
                    at::Tensor& idx) {
  const int64_t T = logits.size(0), E = logits.size(1);
  // f32 or bf16 logits as they are (SoftmaxRow widens bf16); other types in f32.
  const bool bf16 = logits.scalar_type() == at::kBFloat16;
  const at::Tensor lt =
      (bf16 || logits.scalar_type() == at::kFloat ? logits : logits.to(at::kFloat)).contiguous();
  const char* lp = static_cast<const char*>(lt.data_ptr());
  const int64_t row_bytes = E * static_cast<int64_t>(lt.element_size());
  at::Tensor w32 = at::empty({T, k}, at::kFloat);
  idx = at::empty({T, k}, at::kLong);
  float* wp = w32.data_ptr<float>();
  int64_t* ip = idx.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, T, ElementwiseGrain(8 * E), [&](int64_t t0, int64_t t1) {
    std::vector<float> p(E), q(E);
    constexpr float kTaken = -std::numeric_limits<float>::infinity();
    for (int64_t t = t0; t < t1; ++t) {
      SoftmaxRow(lp + t * row_bytes, bf16, p.data(), E);
      // The k largest, each the first of its value among those not taken (ArgMax over a copy
      // whose taken entries are -inf: probabilities are >= 0). Where none is left above -inf
      // (NaN logits), the first not taken, as a scalar scan finds it.
      std::copy(p.begin(), p.end(), q.begin());
      float top_sum = 0.0f;
      for (int j = 0; j < k; ++j) {
        float v = 0.0f;
        int64_t best = ArgMax(q.data(), E, &v);
        if (!(v > kTaken)) {
          best = std::find_if(q.begin(), q.end(), [&](float x) { return x != kTaken; }) - q.begin();
        }
        q[best] = kTaken;
        ip[t * k + j] = best;
        wp[t * k + j] = p[best];
        top_sum += p[best];
      }
      for (int j = 0; j < k; ++j) {
        float w = wp[t * k + j];
        if (norm) w = w / top_sum;
        if (scale != 1.0) w = w * sc;
        wp[t * k + j] = w;
      }
    }
  });
  wts = w32;
}

MoeExperts::MoeExperts(std::string path, at::Tensor w13, at::Tensor w2, int64_t inter_full,
                       AdapterFormat wrapper, std::string architecture, const SlotShape& shape,
                       int64_t expert_offset, int64_t total_experts)
    : LoraModule(std::move(path)),
      w13_(std::move(w13)),
      w2_(std::move(w2)),
      E_(w13_.size(0)),
      H_(w13_.size(2)),
      I_(inter_full),
      Ip_(w13_.size(1) / 2),
      e0_(expert_offset),
      E_total_(total_experts > 0 ? total_experts : w13_.size(0)),
      wrapper_(wrapper),
      architecture_(std::move(architecture)),
      shape_(shape) {
  const int64_t S = shape.num_slots, R = shape.max_rank, E = E_, H = H_, Ip = Ip_;
  const auto& f = shape.slot_options;
  // --fully-sharded-loras (plain TP only: under expert parallelism a rank's experts are whole):
  // gate/up keep R / tp columns of lora_A, down H / tp columns of lora_B.
  fs_ = shape.fully_sharded && shape.tp_size > 1 && E_total_ == E_;
  const int64_t Ra = fs_ ? R / shape.tp_size : R, Hb = fs_ ? H / shape.tp_size : H;
  if (wrapper_ == AdapterFormat::k2D) {
    for (int k : {kW1, kW3}) {
      ea_[k] = SlotZeros({S, E, H, Ra}, f);
      eb_[k] = SlotZeros({S, E, R, Ip}, f);
    }
  } else {
    ea_[kW1] = SlotZeros({S, E, H, Ra}, f);
    eb_[kW1] = SlotZeros({S, E, R, 2 * Ip}, f);
  }
  ea_[kW2] = SlotZeros({S, E, Ip, R}, f);
  eb_[kW2] = SlotZeros({S, E, R, Hb}, f);
  const bool kernels = shape.kernels != LoraKernels::kCpuSgmv;
  for (int k = 0; k < 3; ++k) {
    erank_[k].assign(S * E, 0);
    if (kernels && ea_[k].defined()) erank_t_[k] = at::zeros({S * E}, shape.rank_options);
  }
  if (wrapper_ == AdapterFormat::k2D && !fs_ && !kernels) shared_a_.assign(S * E, 0);
  packed_ = !fs_ && !kernels;
  for (int k = 0; k < 3; ++k) pr_[k].assign(S, 0);
}

int64_t MoeExperts::AOffset(int k, int slot, int64_t e) const {
  const int64_t in = ea_[k].size(2), cols = ea_[k].size(3);
  const int64_t base = static_cast<int64_t>(slot) * E_ * in * cols;
  return base + e * in * (packed_ ? pr_[k][slot] : cols);
}

int64_t MoeExperts::BOffset(int k, int slot, int64_t e) const {
  const int64_t rows = eb_[k].size(2), out = eb_[k].size(3);
  const int64_t base = static_cast<int64_t>(slot) * E_ * rows * out;
  return base + e * out * (packed_ ? pr_[k][slot] : rows);
}

at::Tensor MoeExperts::AView(int k, int slot, int64_t e, const at::Tensor& slot_t) const {
  if (!packed_) return slot_t[e];
  const int64_t in = ea_[k].size(2), p = pr_[k][slot];
  return slot_t.view(-1).narrow(0, e * in * p, in * p).view({in, p});
}

at::Tensor MoeExperts::BView(int k, int slot, int64_t e, const at::Tensor& slot_t) const {
  if (!packed_) return slot_t[e];
  const int64_t out = eb_[k].size(3), p = pr_[k][slot];
  return slot_t.view(-1).narrow(0, e * p * out, p * out).view({p, out});
}

void MoeExperts::NoteSharedA(int slot) {
  if (shared_a_.empty()) return;
  const int64_t E = E_;
  const bool same_stride = AStride(kW1, slot) == AStride(kW3, slot);
  const int64_t bytes = H_ * AStride(kW1, slot) * static_cast<int64_t>(ea_[kW1].element_size());
  for (int64_t e = 0; e < E; ++e) {
    const int64_t se = slot * E + e;
    const int32_t r = erank_[kW1][se];
    shared_a_[se] =
        r > 0 && r == erank_[kW3][se] && same_stride &&
        std::memcmp(SlotElement(ea_[kW1], AOffset(kW1, slot, e)),
                    SlotElement(ea_[kW3], AOffset(kW3, slot, e)), static_cast<size_t>(bytes)) == 0;
  }
}

int64_t MoeExperts::SharedGateUpA(int slot) const {
  if (shared_a_.empty()) return 0;
  const auto first = shared_a_.begin() + slot * E_;
  return std::count(first, first + E_, 1);
}

absl::Status MoeExperts::CheckExperts(const LoraAdapter& a, const MoeLayerLora& ml) const {
  const bool is3d = ml.format == AdapterFormat::k3D;
  if (is3d && wrapper_ == AdapterFormat::k2D) {
    return absl::FailedPreconditionError(absl::StrCat(
        a.dir, ": 3D MoE LoRA adapter (fused experts.base_layer / experts pairs), but ",
        architecture_, " uses the 2D expert wrapper and ", kMixedFlag,
        " is off; start the worker with ", kMixedFlag, " to convert 3D adapters to 2D at load"));
  }
  if (!is3d && wrapper_ == AdapterFormat::k3D) {
    return absl::FailedPreconditionError(absl::StrCat(
        a.dir, ": 2D (per-expert) MoE LoRA adapter, but ", architecture_,
        " is a 3D-native model using the 3D expert wrapper and ", kMixedFlag,
        " is off; start the worker with ", kMixedFlag, " to serve 2D and 3D adapters together"));
  }
  if (ml.num_experts != E_total_) {
    return absl::InvalidArgumentError(absl::StrCat(a.safetensors_path, ": ", ml.prefix, " has ",
                                                   ml.num_experts, " experts, the model ",
                                                   E_total_));
  }
  return absl::OkStatus();
}

void MoeExperts::WriteExperts(const MoeLayerLora& ml, const SlotWrite& w) {
  const int64_t E = E_, I = I_, Et = E_total_, e0 = e0_, R = shape_.max_rank;
  const int slot = w.slot;
  // Aᵀ [in, r] of a gate/up projection into its slot [in, R (or R / tp, fully sharded)].
  auto write_gate_up_a = [&](at::Tensor dst, const at::Tensor& At) {
    if (!fs_) {
      dst.narrow(1, 0, At.size(1)).copy_(At);
      return;
    }
    at::Tensor padded = at::zeros({At.size(0), R}, At.options());
    padded.narrow(1, 0, At.size(1)).copy_(At);
    const int64_t n = R / shape_.tp_size;
    dst.copy_(padded.narrow(1, shape_.tp_rank * n, n));
  };
  // Bᵀ [r, H] of down into its slot [R, H (or H / tp, fully sharded)].
  auto write_down_b = [&](at::Tensor dst, const at::Tensor& Bt) {
    const int64_t n = dst.size(1);
    dst.narrow(0, 0, Bt.size(0)).copy_(fs_ ? Bt.narrow(1, shape_.tp_rank * n, n) : Bt);
  };
  // Every expert projection of a rank: gate/up keep A whole and their rows of B (column-
  // parallel over I, each of gate and up on its own); down keeps its columns of A (row-parallel).
  // With expert parallelism a rank holds whole experts: nothing is sliced.
  const int tp_rank = expert_parallel() ? 0 : w.tp_rank;
  const int tp_size = expert_parallel() ? 1 : w.tp_size;
  const auto gate_up_rows = ShardSections({I, I}, tp_rank, tp_size);
  const auto down_cols = ShardSections({I}, tp_rank, tp_size);
  // The model checked at load that I divides by the TP size, so these cannot fail.
  const std::vector<IndexRange> gu = gate_up_rows.value(), dn = down_cols.value();
  const std::vector<IndexRange> gate_rows = {gu[0]}, up_rows = {{gu[1].begin - I, gu[1].size}};
  if (ml.format == AdapterFormat::k3D) {
    // 3D wrapper: gate_up A [E*r, H], B [2I, r*E] (column j*E+e); down A [E*r, I], B [H, r*E].
    if (ml.gate_up) {
      const LoraPair& p = *ml.gate_up;
      const int r = p.rank;
      pr_[kW1][slot] = r;
      at::Tensor A = ToFloat(p.a).view({Et, r, -1});
      at::Tensor B = ToFloatScaled(p.b, p.scaling).view({2 * I, r, Et});
      for (int64_t e = 0; e < E; ++e) {
        at::Tensor Be = B.select(2, e0 + e);  // [2I, r]
        if (w.interleaved_gate_up) {
          Be = at::cat({Be.slice(0, 0, 2 * I, 2), Be.slice(0, 1, 2 * I, 2)}, 0);  // [gate ; up]
        }
        at::Tensor Bl = GatherRanges(Be, 0, gu);  // [2 I_p, r]
        write_gate_up_a(AView(kW1, slot, e, w.dst(ea_[kW1])), A[e0 + e].t());
        BView(kW1, slot, e, w.dst(eb_[kW1])).narrow(0, 0, r).copy_(Bl.t());
        erank_[kW1][slot * E + e] = r;
      }
    }
    if (ml.down) {
      const LoraPair& p = *ml.down;
      const int r = p.rank;
      pr_[kW2][slot] = r;
      at::Tensor A = ToFloat(p.a).view({Et, r, I});
      at::Tensor B = ToFloatScaled(p.b, p.scaling).view({-1, r, Et});
      for (int64_t e = 0; e < E; ++e) {
        AView(kW2, slot, e, w.dst(ea_[kW2]))
            .narrow(1, 0, r)
            .copy_(GatherRanges(A[e0 + e], 1, dn).t());
        write_down_b(BView(kW2, slot, e, w.dst(eb_[kW2])), B.select(2, e0 + e).t());
        erank_[kW2][slot * E + e] = r;
      }
    }
    return;  // the 3D wrapper: gate and up are one projection already
  }
  auto proj_of = [&](int64_t e, int k) -> const std::optional<LoraPair>& {
    return ml.experts[e0 + e][k == kW1   ? static_cast<int>(ExpertProj::kGate)
                              : k == kW3 ? static_cast<int>(ExpertProj::kUp)
                                         : static_cast<int>(ExpertProj::kDown)];
  };
  const int64_t held = std::min<int64_t>(E, static_cast<int64_t>(ml.experts.size()) - e0);
  for (int k : {kW1, kW3, kW2}) {  // the packing rank: the largest of this rank's experts
    for (int64_t e = 0; e < held; ++e) {
      if (proj_of(e, k)) pr_[k][slot] = std::max(pr_[k][slot], proj_of(e, k)->rank);
    }
  }
  for (int64_t e = 0; e < held; ++e) {
    for (int k : {kW1, kW3, kW2}) {
      const auto& opt = proj_of(e, k);
      if (!opt) continue;
      const int r = opt->rank;
      at::Tensor A = ToFloat(opt->a), B = ToFloatScaled(opt->b, opt->scaling);
      if (k == kW2) {
        A = GatherRanges(A, 1, dn);
      } else {
        B = GatherRanges(B, 0, k == kW1 ? gate_rows : up_rows);
      }
      at::Tensor da = AView(k, slot, e, w.dst(ea_[k])), db = BView(k, slot, e, w.dst(eb_[k]));
      if (k == kW2) {
        da.narrow(1, 0, r).copy_(A.t());
        write_down_b(db, B.t());
      } else {
        write_gate_up_a(da, A.t());
        db.narrow(0, 0, r).copy_(B.t());
      }
      erank_[k][slot * E + e] = r;
    }
  }
  NoteSharedA(slot);
}

int64_t MoeExperts::ExpertBytes(const MoeLayerLora& ml, int64_t elem) const {
  // Column-parallel gate/up keep A whole and 1/tp of B; row-parallel down 1/tp of A, B whole.
  const int64_t tp = shape_.tp_size;
  auto pair = [&](const LoraPair& p, bool row) {
    // Expert parallelism: this rank's experts' share of everything.
    if (expert_parallel()) return elem * (p.a.numel() + p.b.numel()) / E_total_ * E_;
    if (fs_) return elem * (p.a.numel() + p.b.numel()) / tp;  // both halves sharded
    return elem * (row ? p.a.numel() / tp + p.b.numel() : p.a.numel() + p.b.numel() / tp);
  };
  int64_t total = 0;
  if (ml.gate_up) total += pair(*ml.gate_up, false);
  if (ml.down) total += pair(*ml.down, true);
  for (const auto& e : ml.experts) {
    for (int k = 0; k < 3; ++k) {
      if (e[k]) total += pair(*e[k], k == static_cast<int>(ExpertProj::kDown));
    }
  }
  return total;
}

// Per projection k: A [E, in, R] keeps its first r_max columns (all of them for gate/up when
// fully sharded: this rank's slice of the rank dim), B [E, R, out] its first r_max rows, where
// r_max is the largest rank of the slot's experts; tensors are {a0, b0, a1, b1, a2, b2} and
// ranks the slot's E ranks of each projection.
bool MoeExperts::SaveSlot(int slot, ModuleSlotImage* out) const {
  bool used = false;
  out->tensors.assign(6, at::Tensor());
  out->ranks.assign(3 * E_, 0);
  for (int k = 0; k < 3; ++k) {
    if (!ea_[k].defined()) continue;
    const auto first = erank_[k].begin() + slot * E_;
    std::copy(first, first + E_, out->ranks.begin() + k * E_);
    const int r = *std::max_element(first, first + E_);
    if (r == 0) continue;
    used = true;
    if (packed_) {
      // The packed prefix: every expert's [in, p] A and [p, out] B (p = pr_[k][slot]).
      const int64_t p = pr_[k][slot];
      out->tensors[2 * k] = HostCopy(ea_[k][slot].view(-1).narrow(0, 0, E_ * ea_[k].size(2) * p));
      out->tensors[2 * k + 1] =
          HostCopy(eb_[k][slot].view(-1).narrow(0, 0, E_ * eb_[k].size(3) * p));
      continue;
    }
    const bool whole_a = fs_ && k != kW2;
    out->tensors[2 * k] = HostCopy(whole_a ? ea_[k][slot] : ea_[k][slot].narrow(2, 0, r));
    out->tensors[2 * k + 1] = HostCopy(eb_[k][slot].narrow(1, 0, r));
  }
  return used;
}

void MoeExperts::RestoreSlot(const ModuleSlotImage& in, const SlotWrite& w) {
  for (int k = 0; k < 3; ++k) {
    if (!ea_[k].defined()) continue;
    std::copy_n(in.ranks.begin() + k * E_, E_, erank_[k].begin() + w.slot * E_);
    const at::Tensor& a = in.tensors.at(2 * k);
    if (!a.defined()) continue;
    const at::Tensor& b = in.tensors.at(2 * k + 1);
    if (packed_) {
      pr_[k][w.slot] = static_cast<int32_t>(a.numel() / (E_ * ea_[k].size(2)));
      w.dst(ea_[k]).view(-1).narrow(0, 0, a.numel()).copy_(a);
      w.dst(eb_[k]).view(-1).narrow(0, 0, b.numel()).copy_(b);
      continue;
    }
    const int64_t r = b.size(1);
    at::Tensor da = w.dst(ea_[k]);
    (fs_ && k != kW2 ? da : da.narrow(2, 0, r)).copy_(a);
    w.dst(eb_[k]).narrow(1, 0, r).copy_(b);
  }
  NoteSharedA(w.slot);
}

int64_t MoeExperts::ResidentSlotBytes() const {
  int64_t n = 0;
  for (int k = 0; k < 3; ++k) {
    n += ea_[k].defined() ? ResidentBytes(ea_[k]) + ResidentBytes(eb_[k]) : 0;
  }
  return n;
}

void MoeExperts::Reset(int slot) {
  for (int k = 0; k < 3; ++k) {
    if (!ea_[k].defined()) continue;
    ZeroSlot(ea_[k][slot]);
    ZeroSlot(eb_[k][slot]);
    std::fill_n(erank_[k].begin() + slot * E_, E_, 0);
    pr_[k][slot] = 0;
    if (erank_t_[k].defined()) erank_t_[k].narrow(0, slot * E_, E_).zero_();
  }
  if (!shared_a_.empty()) std::fill_n(shared_a_.begin() + slot * E_, E_, 0);
}

void MoeExperts::SyncRanks(int slot) {
  for (int k = 0; k < 3; ++k) {
    if (!erank_t_[k].defined()) continue;
    erank_t_[k]
        .narrow(0, slot * E_, E_)
        .copy_(at::from_blob(erank_[k].data() + slot * E_, {E_}, at::kInt));
  }
}

absl::StatusOr<at::Tensor> MoeExperts::Forward(const at::Tensor& h, const at::Tensor& ids,
                                               const at::Tensor& weights,
                                               const LoraBatch& lb) const {
  return lb.kernel_path() ? FusedForward(h, ids, weights, lb) : CpuForward(h, ids, weights, lb);
}

absl::StatusOr<at::Tensor> MoeExperts::CpuForward(const at::Tensor& h, const at::Tensor& idx,
                                                  const at::Tensor& wts,
                                                  const LoraBatch& lb) const {
  const int64_t T = h.size(0), topk = idx.size(1), E = E_, H = H_, R = shape_.max_rank, Ip = Ip_;
  const std::vector<int32_t>& slots = *lb.slots;
  // Assignments sorted by (expert, slot): one run per expert for the base GEMMs, one segment per
  // (expert, slot) for LoRA.
  // Local expert ids, by a loop: (idx - e0_).contiguous() was two ATen ops, 18 µs a layer of a
  // decode step (timers).
  std::vector<int64_t> local(T * topk);
  {
    const at::Tensor ic = idx.device().is_cpu() && idx.scalar_type() == at::kLong
                              ? idx.contiguous()
                              : idx.to(at::kCPU, at::kLong).contiguous();
    const int64_t* raw = ic.data_ptr<int64_t>();
    for (int64_t i = 0; i < T * topk; ++i) local[i] = raw[i] - e0_;
  }
  const int64_t* ip = local.data();
  // The assignments to experts held here (all of them without expert parallelism).
  std::vector<int64_t> order;
  order.reserve(T * topk);
  for (int64_t i = 0; i < T * topk; ++i) {
    if (ip[i] >= 0 && ip[i] < E) order.push_back(i);
  }
  const int64_t N = static_cast<int64_t>(order.size());
  if (N == 0) return at::zeros({T, H}, h.options());
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    if (ip[x] != ip[y]) return ip[x] < ip[y];
    return slots[x / topk] < slots[y / topk];
  });
  std::vector<int64_t> token(N);
  for (int64_t i = 0; i < N; ++i) token[i] = order[i] / topk;
  at::Tensor xs = GatherRows(h, token);
  at::Tensor ws = GatherRows(wts.reshape({T * topk}), order);
  std::vector<std::pair<int64_t, int64_t>> expert_runs;  // (begin, end) per expert present
  std::vector<int64_t> run_expert;
  for (int64_t i = 0; i < N;) {
    int64_t j = i;
    while (j < N && ip[order[j]] == ip[order[i]]) ++j;
    expert_runs.push_back({i, j});
    run_expert.push_back(ip[order[i]]);
    i = j;
  }
  // fn(begin, end, slot * E + expert) for each (expert, slot) run of the sorted assignments
  // that carries a slot.
  auto for_each_lora_run = [&](auto&& fn) {
    for (int64_t i = 0; i < N;) {
      const int64_t e = ip[order[i]];
      const int32_t slot = slots[token[i]];
      int64_t j = i;
      while (j < N && ip[order[j]] == e && slots[token[j]] == slot) ++j;
      if (slot >= 0) fn(i, j, slot * E + e);
      i = j;
    }
  };
  auto lora_segments = [&](int k) {
    std::vector<SgmvSegment> segs;
    if (!ea_[k].defined() || !lb.any) return segs;
    for_each_lora_run([&](int64_t i, int64_t j, int64_t se) {
      const int32_t r = erank_[k][se];
      if (r > 0) {
        const int slot = static_cast<int>(se / E);
        const int64_t e = se % E;
        segs.push_back({i, j, SlotElement(ea_[k], AOffset(k, slot, e)),
                        SlotElement(eb_[k], BOffset(k, slot, e)), r});
        segs.back().a_stride = AStride(k, slot);
      }
    });
    return segs;
  };
  // 2D wrapper: gate into h13's columns [0, I_p), up into [I_p, 2 I_p), one call; where the two
  // share A, one segment with up's B as the second B.
  auto gate_up_segments = [&]() {
    std::vector<SgmvSegment> segs;
    if (!lb.any) return segs;
    for_each_lora_run([&](int64_t i, int64_t j, int64_t se) {
      const int32_t r1 = erank_[kW1][se], r3 = erank_[kW3][se];
      const int slot = static_cast<int>(se / E);
      const int64_t e = se % E;
      const void* a1 = SlotElement(ea_[kW1], AOffset(kW1, slot, e));
      const void* b1 = SlotElement(eb_[kW1], BOffset(kW1, slot, e));
      const void* b3 = SlotElement(eb_[kW3], BOffset(kW3, slot, e));
      if (!shared_a_.empty() && shared_a_[se]) {
        segs.push_back({i, j, a1, b1, r1, b3, 0});
        segs.back().a_stride = AStride(kW1, slot);
        return;
      }
      if (r1 > 0) {
        segs.push_back({i, j, a1, b1, r1});
        segs.back().a_stride = AStride(kW1, slot);
      }
      if (r3 > 0) {
        segs.push_back({i, j, SlotElement(ea_[kW3], AOffset(kW3, slot, e)), b3, r3, nullptr, Ip});
        segs.back().a_stride = AStride(kW3, slot);
      }
    });
    return segs;
  };
  at::Tensor h13 = at::empty({N, 2 * Ip}, h.options());
  if (quantized()) {
    GroupedQuantizedMatmulWt(xs, q13_, expert_runs, run_expert, h13);
  } else {
    GroupedMatmulWt(xs, w13_, expert_runs, run_expert, h13);
  }
  // Fully sharded: (begin, end, slot, expert) of every LoRA segment, for ATen GEMMs around the
  // collectives (the same list on every rank: routing and slots are replicated).
  std::vector<FsSegment> fs_segs;
  if (fs_ && lb.any) {
    for (int64_t i = 0; i < N;) {
      const int64_t e = ip[order[i]];
      const int32_t slot = slots[token[i]];
      int64_t j = i;
      while (j < N && ip[order[j]] == e && slots[token[j]] == slot) ++j;
      if (slot >= 0) fs_segs.push_back({i, j, slot, e});
      i = j;
    }
  }
  // (lb.any is the same on every rank: they all skip the collectives together.)
  if (fs_ && lb.any) {
    if (wrapper_ == AdapterFormat::k2D) {
      MOELORA_RETURN_IF_ERROR(AddFullyShardedLora(kW1, xs, h13, 0, false, fs_segs));
      MOELORA_RETURN_IF_ERROR(AddFullyShardedLora(kW3, xs, h13, Ip, false, fs_segs));
    } else {
      MOELORA_RETURN_IF_ERROR(AddFullyShardedLora(kW1, xs, h13, 0, false, fs_segs));
    }
  } else if (wrapper_ == AdapterFormat::k2D) {
    AddLora(xs, h13, 0, Ip, nullptr, R, SgmvWeightOf(ea_[kW1]), gate_up_segments());
  } else {
    AddLora(xs, h13, 0, 2 * Ip, nullptr, R, SgmvWeightOf(ea_[kW1]), lora_segments(kW1));
  }
  // Each sorted row's (local) expert, for the biases.
  at::Tensor row_expert;
  if (w13_bias_.defined() || (w2_bias_.defined() && add_w2_bias_)) {
    std::vector<int64_t> re(N);
    for (int64_t i = 0; i < N; ++i) re[i] = ip[order[i]];
    row_expert = at::from_blob(re.data(), {N}, at::kLong).clone();
  }
  if (w13_bias_.defined()) h13.add_(w13_bias_.index_select(0, row_expert));
  at::Tensor act;
  if (act_.kind == ExpertActivation::Kind::kClampedSwiGlu) {
    at::Tensor g = h13.narrow(1, 0, Ip).clamp_max(act_.limit);
    at::Tensor u = h13.narrow(1, Ip, Ip).clamp(-act_.limit, act_.limit);
    act = ((u + 1) * (g * at::sigmoid(g * act_.alpha))).contiguous();
  } else if (act_.kind == ExpertActivation::Kind::kSwiGluStep) {
    act = (at::silu(h13.narrow(1, 0, Ip)).clamp_max(act_.limit) *
           h13.narrow(1, Ip, Ip).clamp(-act_.limit, act_.limit))
              .contiguous();
  } else if (CpuElementwise(h13) && ElementwiseVectorised()) {
    act = at::empty({N, Ip}, h13.options());
    if (h13.scalar_type() == at::kFloat) {
      SwiGluRows(h13.data_ptr<float>(), act.data_ptr<float>(), N, Ip);
    } else {
      SwiGluRows(h13.data_ptr<at::BFloat16>(), act.data_ptr<at::BFloat16>(), N, Ip);
    }
  } else {
    act = (at::silu(h13.narrow(1, 0, Ip)) * h13.narrow(1, Ip, Ip)).contiguous();
  }
  at::Tensor ys = at::empty({N, H}, h.options());
  if (quantized()) {
    GroupedQuantizedMatmulWt(act, q2_, expert_runs, run_expert, ys);
  } else {
    GroupedMatmulWt(act, w2_, expert_runs, run_expert, ys);
  }
  if (fs_ && lb.any) {
    MOELORA_RETURN_IF_ERROR(
        AddFullyShardedLora(kW2, act, ys, shape_.tp_rank * (H / shape_.tp_size), true, fs_segs));
  } else {
    AddLora(act, ys, 0, H, nullptr, R, SgmvWeightOf(ea_[kW2]), lora_segments(kW2));
  }
  if (w2_bias_.defined() && add_w2_bias_) {
    ys.add_(w2_bias_.narrow(0, e0_, E).index_select(0, row_expert));
  }
  if (CpuElementwise(ys) && ws.is_contiguous() && ws.scalar_type() == ys.scalar_type()) {
    at::Tensor out = at::empty({T, H}, h.options());
    if (ys.scalar_type() == at::kFloat) {
      CombineRows(ys.data_ptr<float>(), ws.data_ptr<float>(), token, T, H, out.data_ptr<float>());
    } else {
      CombineRows(ys.data_ptr<at::BFloat16>(), ws.data_ptr<at::BFloat16>(), token, T, H,
                  out.data_ptr<at::BFloat16>());
    }
    return out;
  }
  ys.mul_(ws.unsqueeze(1));
  at::Tensor out = at::zeros({T, H}, h.options());
  out.index_add_(0, at::from_blob(token.data(), {N}, at::kLong).to(h.device()), ys);
  return out;
}

absl::Status MoeExperts::AddFullyShardedLora(int k, const at::Tensor& in, at::Tensor& out,
                                             int64_t col, bool row_parallel,
                                             const std::vector<FsSegment>& segs) const {
  // mid [N, R] = in·A per segment: gate/up ranks fill their R / tp columns, down ranks their
  // partial sums over the I shard; the all-reduce completes it on every rank; then each rank
  // expands with its B (gate/up: its I rows; down: its H columns, which the block's all-reduce
  // joins). Every rank calls the collective, with or without segments.
  const int64_t N = in.size(0), R = shape_.max_rank, tp = shape_.tp_size, E = E_;
  at::Tensor mid = at::zeros({N, R}, in.options().dtype(at::kFloat));
  std::vector<const FsSegment*> live;
  for (const FsSegment& g : segs) {
    if (erank_[k][g.slot * E + g.expert] == 0) continue;
    at::Tensor part = at::matmul(in.narrow(0, g.begin, g.end - g.begin).to(at::kFloat),
                                 ea_[k][g.slot][g.expert].to(at::kFloat));
    if (row_parallel) {
      mid.narrow(0, g.begin, g.end - g.begin).copy_(part);
    } else {
      mid.narrow(0, g.begin, g.end - g.begin)
          .narrow(1, shape_.tp_rank * (R / tp), R / tp)
          .copy_(part);
    }
    live.push_back(&g);
  }
  MOELORA_RETURN_IF_ERROR(shape_.comm->AllReduceSum(mid.data_ptr<float>(), mid.numel()));
  for (const FsSegment* g : live) {
    at::Tensor b = eb_[k][g->slot][g->expert].to(at::kFloat);  // [R, width]
    at::Tensor d = at::matmul(mid.narrow(0, g->begin, g->end - g->begin), b);
    out.narrow(0, g->begin, g->end - g->begin)
        .narrow(1, col, b.size(1))
        .add_(d.to(out.scalar_type()));
  }
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> MoeExperts::FusedForward(const at::Tensor& h, const at::Tensor& idx,
                                                    const at::Tensor& wts_in,
                                                    const LoraBatch& lb) const {
  if (quantized()) {
    return absl::InternalError(
        absl::StrCat(path(), ": the fused MoE kernel does not read quantized experts"));
  }
  const int64_t T = h.size(0), K = idx.size(1), H = H_;
  at::Tensor ids = idx.to(at::kInt);
  at::Tensor wts = wts_in.to(at::kFloat);
  if (expert_parallel()) {
    // The kernel takes local expert ids: an assignment to another rank's expert points at local
    // expert 0 with weight 0, so it adds nothing here (the all-reduce brings it from its rank).
    ids = ids - static_cast<int32_t>(e0_);
    at::Tensor elsewhere = ids.lt(0).logical_or(ids.ge(E_));
    ids = ids.masked_fill(elsewhere, 0);
    wts = wts.masked_fill(elsewhere, 0.0);
  }
  ids = ids.contiguous();
  wts = wts.contiguous();
  at::Tensor x = h.contiguous();
  at::Tensor out = at::empty({T, H}, h.options());
  MoeLoraParams p;
  p.dtype = KernelDType(h.scalar_type());
  p.x = x.data_ptr();
  p.topk_ids = ids.data_ptr<int32_t>();
  p.topk_weights = wts.data_ptr<float>();
  p.w13 = w13_.data_ptr();
  p.w2 = w2_.data_ptr();
  p.out = out.data_ptr();
  p.num_tokens = T;
  p.hidden = H;
  p.inter = Ip_;
  p.num_experts = E_;
  p.top_k = K;
  p.num_slots = shape_.num_slots;
  p.max_rank = shape_.max_rank;
  if (act_.kind == ExpertActivation::Kind::kClampedSwiGlu || w13_bias_.defined()) {
    return absl::InternalError(
        absl::StrCat(path(), ": the fused MoE kernel has no GPT-OSS activation or expert biases"));
  }
  if (act_.kind == ExpertActivation::Kind::kSwiGluStep) {
    p.swiglu_limit = static_cast<float>(act_.limit);
  }
  if (lb.any) {
    p.slot_of_token = lb.slots_t.data_ptr<int32_t>();
    auto proj = [&](int k, int64_t col, int64_t dim) {
      return MoeLoraProj{ea_[k].data_ptr(), eb_[k].data_ptr(), erank_t_[k].data_ptr<int32_t>(), col,
                         dim};
    };
    if (wrapper_ == AdapterFormat::k2D) {
      p.gate_up[0] = proj(kW1, 0, Ip_);
      p.gate_up[1] = proj(kW3, Ip_, Ip_);
      p.num_gate_up = 2;
    } else {
      p.gate_up[0] = proj(kW1, 0, 2 * Ip_);
      p.num_gate_up = 1;
    }
    p.down = proj(kW2, 0, H);
    p.has_down = true;
  }
  if (lb.kernels == LoraKernels::kCuda) {
    at::Tensor ws = Scratch(MoeLoraWorkspaceBytes(p), h.device());
    p.workspace = ws.data_ptr();
    MOELORA_RETURN_IF_ERROR(MoeLoraCuda(p, nullptr));
  } else {
    MOELORA_RETURN_IF_ERROR(MoeLoraCpu(p));
  }
  return out;
}

MoeBlock::MoeBlock(at::Tensor router, RouterKind kind, int top_k, bool norm_topk_prob,
                   std::unique_ptr<MoeExperts> experts, std::unique_ptr<SharedExpert> shared,
                   at::Tensor router_bias, double routed_scaling)
    : router_(std::move(router)),
      router_bias_(std::move(router_bias)),
      kind_(kind),
      top_k_(top_k),
      routed_scaling_(routed_scaling),
      norm_topk_prob_(norm_topk_prob),
      experts_(std::move(experts)),
      shared_(std::move(shared)) {}

absl::StatusOr<at::Tensor> MoeBlock::Forward(const at::Tensor& h, const LoraBatch& lb) const {
  at::Tensor wts, idx;
  bool scaled = false;  // wts already carry routed_scaling_
  switch (kind_) {
    case RouterKind::kSigmoidBiasTopK: {
      // In f32 (vLLM's need_fp32_gate; transformers computes the logits in the weight dtype,
      // the same for f32 checkpoints).
      at::Tensor s = at::sigmoid(at::matmul(h.to(at::kFloat), router_.to(at::kFloat).t()));
      at::Tensor choice = router_bias_.defined() ? s + router_bias_.to(at::kFloat) : s;
      idx = std::get<1>(at::topk(choice, top_k_, -1));
      wts = s.gather(1, idx);
      if (norm_topk_prob_) wts = wts / wts.sum(-1, true);
      break;
    }
    case RouterKind::kSoftmaxTopK: {
      at::Tensor logits = MatmulWt(h, router_);
      if (!lb.kernel_path() && logits.device().is_cpu() && logits.dim() == 2 &&
          logits.size(1) >= top_k_) {
        SoftmaxTopKCpu(logits.contiguous(), top_k_, norm_topk_prob_, routed_scaling_, wts, idx);
        scaled = true;
        break;
      }
      at::Tensor probs = at::softmax(logits, 1, at::kFloat);
      std::tie(wts, idx) = at::topk(probs, top_k_, -1);
      if (norm_topk_prob_) wts = wts / wts.sum(-1, true);
      break;
    }
    case RouterKind::kTopKSoftmax: {
      at::Tensor logits = MatmulWt(h, router_);
      if (router_bias_.defined()) logits = logits + router_bias_;
      at::Tensor top;
      std::tie(top, idx) = at::topk(logits, top_k_, -1);
      wts = at::softmax(top, -1, top.scalar_type()).to(at::kFloat);
      break;
    }
  }
  if (routed_scaling_ != 1.0 && !scaled) wts = wts * routed_scaling_;
  // The CPU path scales in the activation dtype (as transformers does); the fused kernel takes
  // f32 weights.
  if (!lb.kernel_path()) wts = wts.to(h.scalar_type());
  MOELORA_ASSIGN_OR_RETURN(at::Tensor out, experts_->Forward(h, idx, wts, lb));
  if (shared_) {
    MOELORA_ASSIGN_OR_RETURN(at::Tensor s, shared_->Forward(h, lb));
    out = out + s;
  }
  return out;
}

absl::StatusOr<at::Tensor> SwiGluMlp::Forward(const at::Tensor& h, const LoraBatch& lb) const {
  MOELORA_ASSIGN_OR_RETURN(at::Tensor g, gate->Forward(h, lb));
  MOELORA_ASSIGN_OR_RETURN(at::Tensor u, up->Forward(h, lb));
  at::Tensor a = at::silu(g);
  if (limit > 0) {
    a = a.clamp_max(limit);
    u = u.clamp(-limit, limit);
  }
  MOELORA_ASSIGN_OR_RETURN(at::Tensor s, down->Forward(a * u, lb));
  if (gate_weight.defined()) s = s * at::sigmoid(MatmulWt(h, gate_weight));
  return s;
}

}  // namespace moelora
