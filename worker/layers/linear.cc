// LoraLinear and SlotShape.
#include "worker/layers/linear.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/bgmv.h"
#include "worker/layers/gemm.h"
#include "worker/layers/lora_ops.h"

namespace moelora {

// ---- SlotShape ----

SlotShape SlotShape::For(const ModelOptions& o, const at::Device& device, Communicator* comm) {
  SlotShape s;
  s.fully_sharded = o.fully_sharded_loras;
  s.comm = comm;
  s.num_slots = o.max_loras;
  s.max_rank = o.max_lora_rank;
  s.kernels = o.kernels;
  const bool kernels = o.kernels != LoraKernels::kCpuSgmv;
  s.slot_options =
      at::TensorOptions().dtype(kernels ? o.dtype : CpuSlotDType(o.dtype)).device(device);
  s.rank_options = at::TensorOptions().dtype(at::kInt).device(device);
  s.tp_rank = o.tp_rank;
  s.tp_size = o.tp_size;
  return s;
}

// ---- LoraLinear ----

absl::StatusOr<std::unique_ptr<LoraLinear>> LoraLinear::Create(
    std::string path, at::Tensor weight, at::Tensor bias, TpMode mode, int64_t in_full,
    std::vector<int64_t> out_sections, const SlotShape& shape, QuantizedWeight quantized) {
  auto shard = PlanLoraShard(mode, in_full, out_sections, shape.tp_rank, shape.tp_size);
  if (!shard.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", shard.status().message()));
  }
  if (quantized.defined()) {
    if (shape.kernels != LoraKernels::kCpuSgmv) return QuantizedNeedsCpuPath(path);
    if (quantized.codes.dim() != 2 || quantized.n() != shard->out_local ||
        quantized.k() != shard->in_local) {
      return absl::InternalError(absl::StrCat(path, ": quantized weight shard [", quantized.n(),
                                              ", ", quantized.k(), "], expected [",
                                              shard->out_local, ", ", shard->in_local, "]"));
    }
    weight = at::empty({shard->out_local, shard->in_local},
                       at::TensorOptions().dtype(at::kFloat).device(at::kMeta));  // its shape only
  } else if (weight.scalar_type() == at::kByte) {
    return absl::InvalidArgumentError(
        absl::StrCat(path, ": its weight is stored quantized, which this module does not read"));
  }
  if (weight.dim() != 2 || weight.size(0) != shard->out_local ||
      weight.size(1) != shard->in_local) {
    return absl::InternalError(absl::StrCat(path, ": weight shard [", weight.size(0), ", ",
                                            weight.dim() > 1 ? weight.size(1) : 0, "], expected [",
                                            shard->out_local, ", ", shard->in_local, "]"));
  }
  auto m = std::unique_ptr<LoraLinear>(new LoraLinear(std::move(path)));
  m->w_ = std::move(weight);
  m->q_ = std::move(quantized);
  m->bias_ = std::move(bias);
  m->mode_ = mode;
  m->in_full_ = in_full;
  m->out_full_ = 0;
  for (int64_t n : out_sections) m->out_full_ += n;
  m->shard_ = *std::move(shard);
  m->shape_ = shape;
  const int64_t S = shape.num_slots, R = shape.max_rank, tp = shape.tp_size;
  m->fs_ = shape.fully_sharded && tp > 1 && mode != TpMode::kReplicated;
  int64_t a_cols = R, b_cols = m->shard_.out_local;
  if (m->fs_ && mode == TpMode::kColumn) a_cols = R / tp;
  if (m->fs_ && mode == TpMode::kRow) {
    auto cols = ShardSections({m->out_full_}, shape.tp_rank, shape.tp_size);
    if (!cols.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat(m->path(), ": --fully-sharded-loras: ", cols.status().message()));
    }
    m->fs_out_ = *cols;
    b_cols = TotalSize(m->fs_out_);
  }
  m->la_ = SlotZeros({S, m->shard_.in_local, a_cols}, shape.slot_options);
  m->lb_ = SlotZeros({S, R, b_cols}, shape.slot_options);
  m->rank_.assign(S, 0);
  if (shape.kernels != LoraKernels::kCpuSgmv) m->rank_t_ = at::zeros({S}, shape.rank_options);
  m->packed_ = shape.kernels == LoraKernels::kCpuSgmv && !m->fs_;
  return m;
}

absl::StatusOr<at::Tensor> LoraLinear::Forward(const at::Tensor& x, const LoraBatch& lb) const {
  return Finish(x, q_.defined() ? QuantizedMatmulWt(x, q_) : MatmulWt(x, w_), lb);
}

absl::StatusOr<std::vector<at::Tensor>> LoraLinear::ForwardEach(
    const std::vector<const LoraLinear*>& layers, const at::Tensor& x, const LoraBatch& lb) {
  std::vector<at::Tensor> ws;
  bool quantized = false;
  for (const LoraLinear* l : layers) {
    ws.push_back(l->w_);
    quantized = quantized || l->quantized();
  }
  std::vector<at::Tensor> ys;
  if (quantized) {
    for (const LoraLinear* l : layers) {
      ys.push_back(l->quantized() ? QuantizedMatmulWt(x, l->q_) : MatmulWt(x, l->w_));
    }
  } else {
    ys = MatmulWtEach(x, ws);
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    MOELORA_ASSIGN_OR_RETURN(ys[i], layers[i]->Finish(x, std::move(ys[i]), lb));
  }
  return ys;
}

absl::StatusOr<at::Tensor> LoraLinear::Finish(const at::Tensor& x, at::Tensor y,
                                              const LoraBatch& lb) const {
  if (bias_.defined() && (mode_ != TpMode::kRow || shape_.tp_rank == 0)) y.add_(bias_);
  y = y.contiguous();
  if (!lb.any) return y;
  const int64_t R = shape_.max_rank;
  if (fs_) {
    absl::Status s = AddFullyShardedLora(x, y, lb);
    if (!s.ok()) return s;
    return y;
  }
  if (!lb.kernel_path()) {
    std::vector<SgmvSegment> segs;
    int64_t begin = 0;
    const int64_t in = shard_.in_local, out = shard_.out_local;
    for (auto [end, slot] : lb.runs) {
      const int32_t r = rank_[slot];
      if (r > 0) {
        segs.push_back(
            {begin, end, SlotElement(la_, slot * in * R), SlotElement(lb_, slot * R * out), r});
        if (packed_) segs.back().a_stride = r;
      }
      begin = end;
    }
    AddLora(x, y, 0, out, lb.rows.data(), R, SgmvWeightOf(la_), segs);
    return y;
  }
  at::Tensor xc = x.contiguous();
  BgmvParams p;
  p.dtype = KernelDType(xc.scalar_type());
  p.x = xc.data_ptr();
  p.x_stride = xc.size(1);
  p.out = y.data_ptr();
  p.out_stride = y.size(1);
  p.a_t = la_.data_ptr();
  p.b_t = lb_.data_ptr();
  p.rank = rank_t_.data_ptr<int32_t>();
  p.slot_of_token = lb.slots_t.data_ptr<int32_t>();
  p.num_tokens = xc.size(0);
  p.in_dim = xc.size(1);
  p.out_dim = y.size(1);
  p.max_rank = R;
  p.num_slots = shape_.num_slots;
  absl::Status s;
  if (lb.kernels == LoraKernels::kCuda) {
    at::Tensor ws = Scratch(BgmvWorkspaceBytes(p), xc.device());
    p.workspace = ws.data_ptr();
    s = BgmvCuda(p, nullptr);
  } else {
    s = BgmvCpu(p);
  }
  if (!s.ok()) return s;
  return y;
}

absl::Status LoraLinear::CheckDense(const LoraAdapter& a, const LoraPair& p) const {
  if (p.a.shape.size() != 2 || p.b.shape.size() != 2 || p.a.dim(1) != in_full_ ||
      p.b.dim(0) != out_full_ || p.a.dim(0) != p.rank || p.b.dim(1) != p.rank) {
    return absl::InvalidArgumentError(absl::StrCat(
        a.safetensors_path, ": ", p.a_name, " ", p.a.ShapeString(), " / ", p.b_name, " ",
        p.b.ShapeString(), " do not fit ", path(), " (in ", in_full_, ", out ", out_full_, ")"));
  }
  return absl::OkStatus();
}

void LoraLinear::WriteDense(const LoraPair& p, const SlotWrite& w) {
  at::Tensor A = GatherRanges(ToFloat(p.a), 1, shard_.a_cols);                   // [r, in_local]
  at::Tensor B = GatherRanges(ToFloatScaled(p.b, p.scaling), 0, shard_.b_rows);  // [out_local, r]
  const int r = p.rank;
  if (fs_ && mode_ == TpMode::kColumn) {
    // This rank's R / tp columns of Aᵀ padded to the slot's rank capacity.
    const int64_t R = shape_.max_rank, Rl = R / shape_.tp_size;
    at::Tensor at_full = at::zeros({A.size(1), R}, at::kFloat);
    at_full.narrow(1, 0, r).copy_(A.t());
    w.dst(la_).copy_(at_full.narrow(1, shape_.tp_rank * Rl, Rl));
    w.dst(lb_).narrow(0, 0, r).copy_(B.t());
    rank_[w.slot] = r;
    return;
  }
  if (fs_ && mode_ == TpMode::kRow) B = GatherRanges(ToFloatScaled(p.b, p.scaling), 0, fs_out_);
  (packed_ ? PackedA(w.dst(la_), r) : w.dst(la_).narrow(1, 0, r)).copy_(A.t());
  w.dst(lb_).narrow(0, 0, r).copy_(B.t());
  rank_[w.slot] = r;
}

int64_t LoraLinear::DenseBytes(const LoraPair& p, int64_t elem) const {
  if (fs_) {
    const int64_t tp = shape_.tp_size;
    if (mode_ == TpMode::kColumn) return elem * (p.a.numel() / tp + p.b.numel() / tp);
    return elem * (p.a.numel() / in_full_ * shard_.in_local + p.b.numel() / tp);
  }
  return elem *
         (p.a.numel() / in_full_ * shard_.in_local + p.b.numel() / out_full_ * shard_.out_local);
}

absl::Status LoraLinear::AddFullyShardedLora(const at::Tensor& x, at::Tensor& y,
                                             const LoraBatch& lb) const {
  // mid [T, R] = x·Aᵀ for every token with a slot: column-parallel ranks each fill their R / tp
  // columns (A sharded along the rank), row-parallel ranks their partial sums over the input
  // shard; the all-reduce completes it on every rank. Then each rank expands with its B.
  const int64_t T = x.size(0), R = shape_.max_rank, tp = shape_.tp_size;
  const bool column = mode_ == TpMode::kColumn;
  at::Tensor x32 = x.to(at::kFloat);
  at::Tensor mid = at::zeros({T, R}, x32.options());
  std::vector<std::pair<at::Tensor, int32_t>> runs;  // (rows, slot)
  int64_t begin = 0;
  for (auto [end, slot] : lb.runs) {
    at::Tensor rows =
        at::from_blob(const_cast<int64_t*>(lb.rows.data()) + begin, {end - begin}, at::kLong)
            .clone();
    begin = end;
    if (rank_[slot] == 0) continue;
    at::Tensor part = at::matmul(x32.index_select(0, rows), la_[slot].to(at::kFloat));
    if (column) {
      mid.narrow(1, shape_.tp_rank * (R / tp), R / tp).index_copy_(0, rows, part);
    } else {
      mid.index_copy_(0, rows, part);
    }
    runs.push_back({rows, slot});
  }
  // Every rank calls the collective (the batch's slots are the same on all of them).
  if (auto s = shape_.comm->AllReduceSum(mid.data_ptr<float>(), mid.numel()); !s.ok()) return s;
  for (const auto& [rows, slot] : runs) {
    at::Tensor d =
        at::matmul(mid.index_select(0, rows), lb_[slot].to(at::kFloat)).to(y.scalar_type());
    if (column) {
      y.index_add_(0, rows, d);
    } else {
      at::Tensor cols = GatherRanges(y, 1, fs_out_);  // a view: one range
      cols.index_add_(0, rows, d);
    }
  }
  return absl::OkStatus();
}

// What WriteDense wrote: Aᵀ's first r columns (all of this rank's columns when fully sharded
// column-parallel: they are a slice of the rank dim) and Bᵀ's first r rows.
bool LoraLinear::SaveSlot(int slot, ModuleSlotImage* out) const {
  const int r = rank_[slot];
  if (r == 0) return false;
  const bool whole_a = fs_ && mode_ == TpMode::kColumn;
  out->tensors = {HostCopy(whole_a   ? la_[slot]
                           : packed_ ? PackedA(la_[slot], r)
                                     : la_[slot].narrow(1, 0, r)),
                  HostCopy(lb_[slot].narrow(0, 0, r))};
  out->ranks = {r};
  return true;
}

void LoraLinear::RestoreSlot(const ModuleSlotImage& in, const SlotWrite& w) {
  const int r = in.ranks.at(0);
  const bool whole_a = fs_ && mode_ == TpMode::kColumn;
  at::Tensor a = w.dst(la_);
  (whole_a ? a : packed_ ? PackedA(a, r) : a.narrow(1, 0, r)).copy_(in.tensors.at(0));
  w.dst(lb_).narrow(0, 0, r).copy_(in.tensors.at(1));
  rank_[w.slot] = r;
}

int64_t LoraLinear::ResidentSlotBytes() const { return ResidentBytes(la_) + ResidentBytes(lb_); }

void LoraLinear::Reset(int slot) {
  ZeroSlot(la_[slot]);
  ZeroSlot(lb_[slot]);
  rank_[slot] = 0;
  if (rank_t_.defined()) rank_t_[slot].zero_();
}

void LoraLinear::SyncRanks(int slot) {
  if (rank_t_.defined()) rank_t_[slot].fill_(rank_[slot]);
}

}  // namespace moelora
