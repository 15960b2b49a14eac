#include "worker/model.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <mutex>
#include <numeric>
#include <regex>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/bgmv.h"
#include "kernels/device.h"
#include "kernels/moe_lora.h"
#include "kernels/sgmv.h"
#include "worker/checkpoint.h"
#include "worker/loaders/name_tables.h"

namespace moelora {

namespace {
constexpr int kQ = 0, kK = 1, kV = 2, kO = 3;  // dense LoRA modules
const char* const kDenseNames[] = {"q_proj", "k_proj", "v_proj", "o_proj"};
constexpr int kW1 = 0, kW3 = 1, kW2 = 2;  // expert LoRA projections (3D wrapper: kW1 = w13)

// A HostTensor as an f32 ATen tensor (copied).
at::Tensor ToFloat(const HostTensor& h) {
  std::vector<int64_t> shape(h.shape.begin(), h.shape.end());
  at::ScalarType st = h.dtype == DType::kBF16  ? at::kBFloat16
                      : h.dtype == DType::kF16 ? at::kHalf
                                               : at::kFloat;
  at::Tensor t = at::empty(shape, at::TensorOptions().dtype(st));
  std::memcpy(t.data_ptr(), h.data(), h.nbytes());
  return t.to(at::kFloat);
}

std::string TextModule(const std::string& module) {
  if (absl::StartsWith(module, "model.language_model.")) {
    return absl::StrCat("model.", module.substr(std::string("model.language_model.").size()));
  }
  return module;
}

}  // namespace

struct MoeModel::Layer {
  at::Tensor in_norm, post_norm, q_norm, k_norm, w[4], router, w13, w2;
  // Dense LoRA: a_t [S, in_l, R], b_t [S, R, out_l]; rank [S].
  at::Tensor la[4], lb[4];
  std::vector<int32_t> lrank[4];
  // Expert LoRA. 2D: [kW1], [kW3]: a_t [S, E, H, R], b_t [S, E, R, I_p]; 3D: [kW1] holds w13 with
  // b_t [S, E, R, 2 I_p]. [kW2]: a_t [S, E, I_p, R], b_t [S, E, R, H]. rank [S * E].
  at::Tensor ea[3], eb[3];
  std::vector<int32_t> erank[3];
  // Kernel paths: the ranks as int32 tensors on the model's device (the kernels read them there).
  at::Tensor lrank_t[4], erank_t[3];
};

std::vector<ParamSpec> Qwen3MoeParamSpecs(const ModelConfig& c, bool lw, bool with_lm_head) {
  const int64_t H = c.info.hidden_size, V = c.vocab_size, E = c.info.num_experts,
                I = c.info.moe_intermediate_size, d = c.info.head_dim,
                hq = c.info.num_attention_heads, hkv = c.info.num_key_value_heads;
  std::vector<ParamSpec> s = {{"model.embed_tokens.weight", {V, H}, TpSplit::kReplicated},
                              {"model.norm.weight", {H}, TpSplit::kReplicated}};
  if (with_lm_head) s.push_back({"lm_head.weight", {V, H}, TpSplit::kReplicated});
  const std::string bl = lw ? "base_layer." : "";
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    s.push_back({p + "input_layernorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "post_attention_layernorm.weight", {H}, TpSplit::kReplicated});
    s.push_back({p + "self_attn.q_proj." + bl + "weight", {hq * d, H}, TpSplit::kRows});
    s.push_back({p + "self_attn.k_proj." + bl + "weight", {hkv * d, H}, TpSplit::kRows});
    s.push_back({p + "self_attn.v_proj." + bl + "weight", {hkv * d, H}, TpSplit::kRows});
    s.push_back({p + "self_attn.o_proj." + bl + "weight", {H, hq * d}, TpSplit::kCols});
    s.push_back({p + "self_attn.q_norm.weight", {d}, TpSplit::kReplicated});
    s.push_back({p + "self_attn.k_norm.weight", {d}, TpSplit::kReplicated});
    s.push_back({p + "mlp.gate.weight", {E, H}, TpSplit::kReplicated});
    s.push_back({W13Name(p + "mlp.experts", lw), {E, 2 * I, H}, TpSplit::kExperts});
    s.push_back({W2Name(p + "mlp.experts", lw), {E, H, I}, TpSplit::kExperts});
  }
  return s;
}

MoeModel::~MoeModel() = default;

absl::StatusOr<std::unique_ptr<MoeModel>> MoeModel::Load(const std::string& dir,
                                                         const ModelOptions& o,
                                                         Communicator* comm) {
  // The architecture first, so that an unserved model is named before its config is parsed.
  if (auto info = ReadModelInfo(dir); info.ok()) {
    MOELORA_ASSIGN_OR_RETURN(const ArchTable* t, FindArchTable(info->architecture));
    if (!t->has_forward) {
      return absl::UnimplementedError(
          absl::StrCat(dir, ": ", info->architecture,
                       " has a weight-name table but no forward pass yet; served architectures: "
                       "Qwen3MoeForCausalLM, Qwen3VLMoeForConditionalGeneration"));
    }
  }
  MOELORA_ASSIGN_OR_RETURN(ModelConfig c, ReadModelConfig(dir));
  MOELORA_ASSIGN_OR_RETURN(const ArchTable* table, FindArchTable(c.info.architecture));
  if (!table->has_forward) {
    return absl::UnimplementedError(
        absl::StrCat(dir, ": ", c.info.architecture,
                     " has a weight-name table but no forward pass yet; served architectures: "
                     "Qwen3MoeForCausalLM, Qwen3VLMoeForConditionalGeneration"));
  }
  const std::string cfg = dir + "/config.json";
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(cfg, ": ", parts...));
  };
  if (!c.all_layers_moe)
    return bad("dense MLP layers (mlp_only_layers / decoder_sparse_step) are not served yet");
  if (c.info.num_experts <= 0 || c.num_experts_per_tok <= 0 ||
      c.num_experts_per_tok > c.info.num_experts || c.info.moe_intermediate_size <= 0) {
    return bad(
        "needs num_experts > 0, 0 < num_experts_per_tok <= num_experts and moe_intermediate_size");
  }
  if (c.info.num_layers <= 0 || c.info.num_attention_heads <= 0 || c.info.head_dim <= 0 ||
      c.info.head_dim % 2 != 0 || c.info.num_key_value_heads <= 0 ||
      c.info.num_attention_heads % c.info.num_key_value_heads != 0) {
    return bad("inconsistent attention dims (layers, heads, kv heads, even head_dim)");
  }
  const int tp = o.tp_size;
  if (c.info.num_key_value_heads % tp != 0 || c.info.num_attention_heads % tp != 0) {
    return bad("num_key_value_heads ", c.info.num_key_value_heads,
               " and num_attention_heads must divide by --tensor-parallel-size ", tp);
  }
  if (o.max_loras < 1 || o.max_lora_rank < 1 || o.max_lora_rank > kSgmvMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-loras must be >= 1 and --max-lora-rank in [1, ", kSgmvMaxRank, "]"));
  }
  const bool kernels = o.kernels != LoraKernels::kCpuSgmv;
  if (kernels && o.max_lora_rank > kBgmvCudaMaxRank) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-lora-rank ", o.max_lora_rank, " > ", kBgmvCudaMaxRank,
                     ": the GPU LoRA kernels take ranks up to ", kBgmvCudaMaxRank));
  }
  // The fused MoE kernel sorts its assignments by (expert, slot + 1) in one block's shared
  // counters; refuse a slot count it cannot sort now rather than fail every MoE step later.
  if (kernels && c.info.num_experts * (int64_t{o.max_loras} + 1) > kMoeLoraCudaMaxSortKeys) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-loras ", o.max_loras, " is too large for ", c.info.num_experts,
                     " experts on the GPU kernel path: num_experts x (max_loras + 1) = ",
                     c.info.num_experts * (int64_t{o.max_loras} + 1), " > ",
                     kMoeLoraCudaMaxSortKeys, " (the fused MoE kernel's sort); use --max-loras <= ",
                     kMoeLoraCudaMaxSortKeys / c.info.num_experts - 1));
  }
  if (o.kernels == LoraKernels::kCuda) {
    if (!at::hasCUDA()) {
      return absl::FailedPreconditionError(
          "--device cuda: this worker's libtorch has no CUDA; build against the PyTorch wheel's "
          "libtorch (README: GPU build)");
    }
    if (o.cuda_device < 0 || o.cuda_device >= CudaDeviceCount()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "--device cuda: device ", o.cuda_device, " does not exist (", CudaDeviceSummary(), ")"));
    }
    MOELORA_RETURN_IF_ERROR(CudaSetDevice(o.cuda_device));
  }
  MOELORA_ASSIGN_OR_RETURN(auto ckpt, Checkpoint::Open(dir));
  const bool has_lm_head = ckpt->tensors().count("lm_head.weight") > 0;
  if (!has_lm_head && !c.tie_word_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat(dir, ": no lm_head.weight and tie_word_embeddings is false"));
  }
  LoadOptions lo{o.tp_rank, o.tp_size, o.dtype, /*lora_wrapped=*/true};
  MOELORA_ASSIGN_OR_RETURN(
      LoadedWeights w, LoadWeights(*ckpt, *table, c, Qwen3MoeParamSpecs(c, true, has_lm_head), lo));

  auto m = std::unique_ptr<MoeModel>(new MoeModel());
  m->config_ = c;
  m->options_ = o;
  m->comm_ = comm;
  m->native_ = table->native_moe_format;
  m->wrapper_ = o.mixed_moe_lora_format ? AdapterFormat::k2D : m->native_;
  m->skipped_ = w.skipped;
  m->hq_ = c.info.num_attention_heads / tp;
  m->hkv_ = c.info.num_key_value_heads / tp;
  m->d_ = c.info.head_dim;
  m->ip_ = c.info.moe_intermediate_size / tp;
  auto& P = w.params;
  const at::Device dev = m->device();
  if (kernels) {
    for (auto& [name, t] : P) t = t.to(dev).contiguous();
  }
  if (o.kernels == LoraKernels::kCuda) {
    MOELORA_ASSIGN_OR_RETURN(m->uploader_, PinnedUploader::Create());
  }
  m->embed_ = P.at("model.embed_tokens.weight");
  m->final_norm_ = P.at("model.norm.weight");
  m->lm_head_ = has_lm_head ? P.at("lm_head.weight") : m->embed_;
  m->inv_freq_ = 1.0 / at::pow(c.rope_theta, at::arange(0, m->d_, 2, at::kLong).to(at::kFloat) /
                                                 static_cast<double>(m->d_));
  m->inv_freq_ = m->inv_freq_.to(dev);
  const int64_t S = o.max_loras, R = o.max_lora_rank, E = c.info.num_experts,
                H = c.info.hidden_size;
  // Slots: f32 on the CPU path; the compute dtype, on the model's device, for the kernel paths.
  const auto f32 = at::TensorOptions().dtype(kernels ? o.dtype : at::kFloat).device(dev);
  const auto i32 = at::TensorOptions().dtype(at::kInt).device(dev);
  for (int l = 0; l < c.info.num_layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    auto L = std::make_unique<Layer>();
    L->in_norm = P.at(p + "input_layernorm.weight");
    L->post_norm = P.at(p + "post_attention_layernorm.weight");
    L->q_norm = P.at(p + "self_attn.q_norm.weight");
    L->k_norm = P.at(p + "self_attn.k_norm.weight");
    for (int k = 0; k < 4; ++k) {
      L->w[k] = P.at(absl::StrCat(p, "self_attn.", kDenseNames[k], ".base_layer.weight"));
      const int64_t out = L->w[k].size(0), in = L->w[k].size(1);
      L->la[k] = at::zeros({S, in, R}, f32);
      L->lb[k] = at::zeros({S, R, out}, f32);
      L->lrank[k].assign(S, 0);
      if (kernels) L->lrank_t[k] = at::zeros({S}, i32);
    }
    L->router = P.at(p + "mlp.gate.weight");
    L->w13 = P.at(W13Name(p + "mlp.experts", true));
    L->w2 = P.at(W2Name(p + "mlp.experts", true));
    const int64_t Ip = m->ip_;
    if (m->wrapper_ == AdapterFormat::k2D) {
      for (int k : {kW1, kW3}) {
        L->ea[k] = at::zeros({S, E, H, R}, f32);
        L->eb[k] = at::zeros({S, E, R, Ip}, f32);
      }
    } else {
      L->ea[kW1] = at::zeros({S, E, H, R}, f32);
      L->eb[kW1] = at::zeros({S, E, R, 2 * Ip}, f32);
    }
    L->ea[kW2] = at::zeros({S, E, Ip, R}, f32);
    L->eb[kW2] = at::zeros({S, E, R, H}, f32);
    for (int k = 0; k < 3; ++k) {
      L->erank[k].assign(S * E, 0);
      if (kernels && L->ea[k].defined()) L->erank_t[k] = at::zeros({S * E}, i32);
    }
    m->layers_.push_back(std::move(L));
  }
  return m;
}

at::Device MoeModel::device() const {
  return options_.kernels == LoraKernels::kCuda
             ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(options_.cuda_device))
             : at::Device(at::kCPU);
}

SeqCache MoeModel::NewCache() const {
  SeqCache c;
  c.k.resize(layers_.size());
  c.v.resize(layers_.size());
  return c;
}

absl::Status MoeModel::AllReduce(at::Tensor& t) {
  if (!comm_ || comm_->world_size() == 1) return absl::OkStatus();
  at::Tensor buf =
      t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
  MOELORA_RETURN_IF_ERROR(comm_->AllReduceSum(buf.data_ptr<float>(), buf.numel()));
  if (!buf.is_same(t)) t.copy_(buf);
  return absl::OkStatus();
}

namespace {

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& w, double eps) {
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  xf = xf * at::rsqrt(var + eps);
  return w * xf.to(x.scalar_type());
}

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

// Runs SGMV segments in parallel (segments write disjoint rows).
void RunSgmv(const SgmvParams& p, const std::vector<SgmvSegment>& segs) {
  if (segs.empty()) return;
  at::parallel_for(0, static_cast<int64_t>(segs.size()), 1,
                   [&](int64_t b, int64_t e) { SgmvCpu(p, segs.data(), b, e); });
}

// Accumulates LoRA into `out` (rows given by `rows` or all). When the compute dtype is not f32
// the LoRA sum is formed in f32 and added once.
void AddLora(const at::Tensor& x, at::Tensor& out, int64_t out_col, int64_t out_dim,
             const int64_t* rows, int64_t r_stride, const std::vector<SgmvSegment>& segs) {
  if (segs.empty()) return;
  if (x.scalar_type() == at::kFloat && out.scalar_type() == at::kFloat && x.is_contiguous() &&
      out.is_contiguous()) {
    SgmvParams p{x.data_ptr<float>(),
                 x.size(1),
                 out.data_ptr<float>() + out_col,
                 out.size(1),
                 rows,
                 x.size(1),
                 out_dim,
                 r_stride};
    RunSgmv(p, segs);
    return;
  }
  at::Tensor x32 = x.to(at::kFloat).contiguous();
  at::Tensor d32 = at::zeros({out.size(0), out_dim}, x32.options());
  SgmvParams p{x32.data_ptr<float>(),
               x32.size(1),
               d32.data_ptr<float>(),
               out_dim,
               rows,
               x32.size(1),
               out_dim,
               r_stride};
  RunSgmv(p, segs);
  out.narrow(1, out_col, out_dim).add_(d32.to(out.scalar_type()));
}

}  // namespace

absl::StatusOr<at::Tensor> MoeModel::Attention(Layer& L, int layer_idx, const at::Tensor& h,
                                               const ForwardBatch& b, const at::Tensor& cos,
                                               const at::Tensor& sin, const at::Tensor& slots) {
  const int64_t T = h.size(0), R = options_.max_lora_rank;
  // CPU path: tokens grouped by slot for the dense LoRA (stable: rows keep their order within a
  // slot). The kernel paths take the per-token slots as they are.
  std::vector<int64_t> rows;
  std::vector<std::pair<int64_t, int32_t>> runs;  // (end index into rows, slot)
  if (!kernel_path()) {
    std::vector<int64_t> idx;
    for (int64_t t = 0; t < T; ++t) {
      if (b.slots[t] >= 0) idx.push_back(t);
    }
    std::stable_sort(idx.begin(), idx.end(),
                     [&](int64_t x, int64_t y) { return b.slots[x] < b.slots[y]; });
    rows = std::move(idx);
    for (size_t i = 0; i < rows.size(); ++i) {
      if (i + 1 == rows.size() || b.slots[rows[i + 1]] != b.slots[rows[i]]) {
        runs.push_back({static_cast<int64_t>(i + 1), b.slots[rows[i]]});
      }
    }
  }
  auto segments = [&](int k) {
    std::vector<SgmvSegment> segs;
    int64_t begin = 0;
    const int64_t in = L.la[k].size(1), out = L.lb[k].size(2);
    for (auto [end, slot] : runs) {
      const int32_t r = L.lrank[k][slot];
      if (r > 0) {
        segs.push_back({begin, end, L.la[k].data_ptr<float>() + slot * in * R,
                        L.lb[k].data_ptr<float>() + slot * R * out, r});
      }
      begin = end;
    }
    return segs;
  };
  absl::Status lora_status;
  auto linear = [&](const at::Tensor& x, int k) {
    at::Tensor y = at::matmul(x, L.w[k].t()).contiguous();
    if (!kernel_path()) {
      AddLora(x, y, 0, y.size(1), rows.data(), R, segments(k));
    } else if (slots.defined() && lora_status.ok()) {
      lora_status = AddDenseLora(L, k, x.contiguous(), y, slots);
    }
    return y;
  };
  const double eps = config_.rms_norm_eps;
  at::Tensor q = linear(h, kQ).view({T, hq_, d_});
  at::Tensor k = linear(h, kK).view({T, hkv_, d_});
  at::Tensor v = linear(h, kV).view({T, hkv_, d_});
  MOELORA_RETURN_IF_ERROR(lora_status);
  q = RmsNorm(q, L.q_norm, eps);
  k = RmsNorm(k, L.k_norm, eps);
  // cos/sin: [T, d] -> broadcast over heads.
  at::Tensor c = cos.unsqueeze(1), s = sin.unsqueeze(1);
  q = q * c + RotateHalf(q) * s;
  k = k * c + RotateHalf(k) * s;
  at::Tensor attn = at::empty({T, hq_ * d_}, h.options());
  const double scale = 1.0 / std::sqrt(static_cast<double>(d_));
  const int64_t groups = hq_ / hkv_;
  for (const auto& seq : b.seqs) {
    SeqCache& cache = *seq.cache;
    const int64_t n = seq.count, past = cache.len, total = past + n;
    at::Tensor& kc = cache.k[layer_idx];
    at::Tensor& vc = cache.v[layer_idx];
    if (!kc.defined() || kc.size(0) < total) {
      const int64_t cap = std::max<int64_t>({total, kc.defined() ? 2 * kc.size(0) : 0, 16});
      at::Tensor nk = at::empty({cap, hkv_, d_}, h.options());
      at::Tensor nv = at::empty({cap, hkv_, d_}, h.options());
      if (past > 0) {
        nk.narrow(0, 0, past).copy_(kc.narrow(0, 0, past));
        nv.narrow(0, 0, past).copy_(vc.narrow(0, 0, past));
      }
      kc = nk;
      vc = nv;
    }
    kc.narrow(0, past, n).copy_(k.narrow(0, seq.begin, n));
    vc.narrow(0, past, n).copy_(v.narrow(0, seq.begin, n));
    at::Tensor K = kc.narrow(0, 0, total).permute({1, 0, 2});  // [hkv, total, d]
    at::Tensor Vv = vc.narrow(0, 0, total).permute({1, 0, 2});
    if (groups > 1) {
      K = K.repeat_interleave(groups, 0);
      Vv = Vv.repeat_interleave(groups, 0);
    }
    at::Tensor qs = q.narrow(0, seq.begin, n).permute({1, 0, 2});   // [hq, n, d]
    at::Tensor scores = at::matmul(qs, K.transpose(1, 2)) * scale;  // [hq, n, total]
    if (n > 1) {
      // Query i (position past + i) sees keys 0..past + i.
      const auto lopt = at::TensorOptions().dtype(at::kLong).device(h.device());
      at::Tensor qpos = at::arange(past, total, lopt).unsqueeze(1);
      at::Tensor kpos = at::arange(0, total, lopt).unsqueeze(0);
      scores = scores.masked_fill(kpos > qpos, -std::numeric_limits<float>::infinity());
    }
    at::Tensor probs = at::softmax(scores, -1, at::kFloat).to(h.scalar_type());
    at::Tensor o = at::matmul(probs, Vv);  // [hq, n, d]
    attn.narrow(0, seq.begin, n).copy_(o.permute({1, 0, 2}).reshape({n, hq_ * d_}));
  }
  at::Tensor out = linear(attn, kO);
  MOELORA_RETURN_IF_ERROR(lora_status);
  return out;
}

absl::StatusOr<at::Tensor> MoeModel::Moe(Layer& L, const at::Tensor& h, const ForwardBatch& b,
                                         const at::Tensor& slots) {
  if (kernel_path()) return FusedMoe(L, h, slots);
  const int64_t T = h.size(0), topk = config_.num_experts_per_tok, E = config_.info.num_experts,
                H = config_.info.hidden_size, R = options_.max_lora_rank, Ip = ip_;
  at::Tensor logits = at::matmul(h, L.router.t());
  at::Tensor probs = at::softmax(logits, 1, at::kFloat);
  auto [wts, idx] = at::topk(probs, topk, -1);
  if (config_.norm_topk_prob) wts = wts / wts.sum(-1, true);
  wts = wts.to(h.scalar_type());
  // Assignments sorted by (expert, slot): one run per expert for the base GEMMs, one segment per
  // (expert, slot) for LoRA.
  const int64_t N = T * topk;
  at::Tensor idx_c = idx.contiguous();
  const int64_t* ip = idx_c.data_ptr<int64_t>();
  std::vector<int64_t> order(N);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    if (ip[x] != ip[y]) return ip[x] < ip[y];
    return b.slots[x / topk] < b.slots[y / topk];
  });
  std::vector<int64_t> token(N);
  for (int64_t i = 0; i < N; ++i) token[i] = order[i] / topk;
  at::Tensor order_t = at::from_blob(order.data(), {N}, at::kLong);
  at::Tensor token_t = at::from_blob(token.data(), {N}, at::kLong);
  at::Tensor xs = h.index_select(0, token_t);
  at::Tensor ws = wts.reshape({N}).index_select(0, order_t);
  std::vector<std::pair<int64_t, int64_t>> expert_runs;  // (begin, end) per expert present
  std::vector<int64_t> run_expert;
  for (int64_t i = 0; i < N;) {
    int64_t j = i;
    while (j < N && ip[order[j]] == ip[order[i]]) ++j;
    expert_runs.push_back({i, j});
    run_expert.push_back(ip[order[i]]);
    i = j;
  }
  auto lora_segments = [&](int k, int64_t in_dim, int64_t out_dim) {
    std::vector<SgmvSegment> segs;
    if (!L.ea[k].defined()) return segs;
    const float* A = L.ea[k].data_ptr<float>();
    const float* B = L.eb[k].data_ptr<float>();
    for (int64_t i = 0; i < N;) {
      const int64_t e = ip[order[i]];
      const int32_t slot = b.slots[token[i]];
      int64_t j = i;
      while (j < N && ip[order[j]] == e && b.slots[token[j]] == slot) ++j;
      if (slot >= 0) {
        const int32_t r = L.erank[k][slot * E + e];
        if (r > 0) {
          segs.push_back(
              {i, j, A + (slot * E + e) * in_dim * R, B + (slot * E + e) * R * out_dim, r});
        }
      }
      i = j;
    }
    return segs;
  };
  at::Tensor h13 = at::empty({N, 2 * Ip}, h.options());
  for (size_t r = 0; r < expert_runs.size(); ++r) {
    auto [i, j] = expert_runs[r];
    at::Tensor dst = h13.narrow(0, i, j - i);
    at::mm_out(dst, xs.narrow(0, i, j - i), L.w13[run_expert[r]].t());
  }
  if (wrapper_ == AdapterFormat::k2D) {
    AddLora(xs, h13, 0, Ip, nullptr, R, lora_segments(kW1, H, Ip));
    AddLora(xs, h13, Ip, Ip, nullptr, R, lora_segments(kW3, H, Ip));
  } else {
    AddLora(xs, h13, 0, 2 * Ip, nullptr, R, lora_segments(kW1, H, 2 * Ip));
  }
  at::Tensor act = (at::silu(h13.narrow(1, 0, Ip)) * h13.narrow(1, Ip, Ip)).contiguous();
  at::Tensor ys = at::empty({N, H}, h.options());
  for (size_t r = 0; r < expert_runs.size(); ++r) {
    auto [i, j] = expert_runs[r];
    at::Tensor dst = ys.narrow(0, i, j - i);
    at::mm_out(dst, act.narrow(0, i, j - i), L.w2[run_expert[r]].t());
  }
  AddLora(act, ys, 0, H, nullptr, R, lora_segments(kW2, Ip, H));
  ys.mul_(ws.unsqueeze(1));
  at::Tensor out = at::zeros({T, H}, h.options());
  out.index_add_(0, token_t, ys);
  return out;
}

namespace {

DType KernelDType(at::ScalarType t) {
  return t == at::kBFloat16 ? DType::kBF16 : t == at::kHalf ? DType::kF16 : DType::kF32;
}

// Device scratch for a kernel, from the tensor allocator (cached on CUDA).
at::Tensor Scratch(size_t bytes, const at::Device& dev) {
  return at::empty({static_cast<int64_t>(std::max<size_t>(bytes, 1))},
                   at::TensorOptions().dtype(at::kByte).device(dev));
}

}  // namespace

absl::Status MoeModel::AddDenseLora(Layer& L, int k, const at::Tensor& x, at::Tensor& y,
                                    const at::Tensor& slots) {
  BgmvParams p;
  p.dtype = KernelDType(x.scalar_type());
  p.x = x.data_ptr();
  p.x_stride = x.size(1);
  p.out = y.data_ptr();
  p.out_stride = y.size(1);
  p.a_t = L.la[k].data_ptr();
  p.b_t = L.lb[k].data_ptr();
  p.rank = L.lrank_t[k].data_ptr<int32_t>();
  p.slot_of_token = slots.data_ptr<int32_t>();
  p.num_tokens = x.size(0);
  p.in_dim = x.size(1);
  p.out_dim = y.size(1);
  p.max_rank = options_.max_lora_rank;
  p.num_slots = options_.max_loras;
  if (options_.kernels == LoraKernels::kCuda) {
    at::Tensor ws = Scratch(BgmvWorkspaceBytes(p), x.device());
    p.workspace = ws.data_ptr();
    return BgmvCuda(p, nullptr);
  }
  return BgmvCpu(p);
}

absl::StatusOr<at::Tensor> MoeModel::FusedMoe(Layer& L, const at::Tensor& h,
                                              const at::Tensor& slots) {
  const int64_t T = h.size(0), K = config_.num_experts_per_tok, H = config_.info.hidden_size;
  at::Tensor logits = at::matmul(h, L.router.t());
  at::Tensor probs = at::softmax(logits, 1, at::kFloat);
  auto [wts, idx] = at::topk(probs, K, -1);
  if (config_.norm_topk_prob) wts = wts / wts.sum(-1, true);
  at::Tensor ids = idx.to(at::kInt).contiguous();
  wts = wts.to(at::kFloat).contiguous();
  at::Tensor x = h.contiguous();
  at::Tensor out = at::empty({T, H}, h.options());
  MoeLoraParams p;
  p.dtype = KernelDType(h.scalar_type());
  p.x = x.data_ptr();
  p.topk_ids = ids.data_ptr<int32_t>();
  p.topk_weights = wts.data_ptr<float>();
  p.w13 = L.w13.data_ptr();
  p.w2 = L.w2.data_ptr();
  p.out = out.data_ptr();
  p.num_tokens = T;
  p.hidden = H;
  p.inter = ip_;
  p.num_experts = config_.info.num_experts;
  p.top_k = K;
  p.num_slots = options_.max_loras;
  p.max_rank = options_.max_lora_rank;
  if (slots.defined()) {
    p.slot_of_token = slots.data_ptr<int32_t>();
    auto proj = [&](int k, int64_t col, int64_t dim) {
      return MoeLoraProj{L.ea[k].data_ptr(), L.eb[k].data_ptr(), L.erank_t[k].data_ptr<int32_t>(),
                         col, dim};
    };
    if (wrapper_ == AdapterFormat::k2D) {
      p.gate_up[0] = proj(kW1, 0, ip_);
      p.gate_up[1] = proj(kW3, ip_, ip_);
      p.num_gate_up = 2;
    } else {
      p.gate_up[0] = proj(kW1, 0, 2 * ip_);
      p.num_gate_up = 1;
    }
    p.down = proj(kW2, 0, H);
    p.has_down = true;
  }
  if (options_.kernels == LoraKernels::kCuda) {
    at::Tensor ws = Scratch(MoeLoraWorkspaceBytes(p), h.device());
    p.workspace = ws.data_ptr();
    MOELORA_RETURN_IF_ERROR(MoeLoraCuda(p, nullptr));
  } else {
    MOELORA_RETURN_IF_ERROR(MoeLoraCpu(p));
  }
  return out;
}

absl::Status MoeModel::Upload(at::Tensor& dst, const at::Tensor& src) {
  if (!dst.is_cuda()) {
    dst.copy_(src);
    return absl::OkStatus();
  }
  at::Tensor host = src.to(dst.scalar_type()).contiguous();
  return uploader_->Copy(dst.data_ptr(), host.data_ptr(), host.nbytes());
}

absl::StatusOr<at::Tensor> MoeModel::Forward(const ForwardBatch& b) {
  const int64_t T = static_cast<int64_t>(b.tokens.size());
  if (T == 0 || b.slots.size() != b.tokens.size()) {
    return absl::InvalidArgumentError("empty batch or slots/tokens size mismatch");
  }
  // The raw kernel launches use this thread's current device.
  if (options_.kernels == LoraKernels::kCuda) {
    MOELORA_RETURN_IF_ERROR(CudaSetDevice(options_.cuda_device));
  }
  std::vector<int64_t> positions(T);
  for (const auto& s : b.seqs) {
    for (int64_t i = 0; i < s.count; ++i) positions[s.begin + i] = s.cache->len + i;
  }
  const at::Device dev = device();
  at::Tensor tok = at::from_blob(const_cast<int64_t*>(b.tokens.data()), {T}, at::kLong).to(dev);
  at::Tensor pos = at::from_blob(positions.data(), {T}, at::kLong).to(at::kFloat).to(dev);
  at::Tensor slots;  // kernel paths, when some token carries an adapter
  if (kernel_path() &&
      std::any_of(b.slots.begin(), b.slots.end(), [](int32_t s) { return s >= 0; })) {
    slots = at::from_blob(const_cast<int32_t*>(b.slots.data()), {T}, at::kInt)
                .to(dev, at::kInt, false, /*copy=*/true);
  }
  at::Tensor freqs = pos.unsqueeze(1) * inv_freq_.unsqueeze(0);  // [T, d/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor cos = emb.cos().to(options_.dtype), sin = emb.sin().to(options_.dtype);
  at::Tensor x = embed_.index_select(0, tok);
  const double eps = config_.rms_norm_eps;
  for (size_t l = 0; l < layers_.size(); ++l) {
    Layer& L = *layers_[l];
    MOELORA_ASSIGN_OR_RETURN(
        at::Tensor a,
        Attention(L, static_cast<int>(l), RmsNorm(x, L.in_norm, eps), b, cos, sin, slots));
    MOELORA_RETURN_IF_ERROR(AllReduce(a));
    x = x + a;
    MOELORA_ASSIGN_OR_RETURN(at::Tensor m, Moe(L, RmsNorm(x, L.post_norm, eps), b, slots));
    MOELORA_RETURN_IF_ERROR(AllReduce(m));
    x = x + m;
  }
  for (const auto& s : b.seqs) s.cache->len += s.count;
  std::vector<int64_t> rows;
  for (const auto& s : b.seqs) {
    for (int64_t i = s.all_logits ? 0 : s.count - 1; i < s.count; ++i) rows.push_back(s.begin + i);
  }
  at::Tensor sel = x.index_select(
      0, at::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, at::kLong).to(dev));
  sel = RmsNorm(sel, final_norm_, eps);
  return at::matmul(sel, lm_head_.t()).to(at::kFloat).to(at::kCPU).contiguous();
}

// ---- LoRA slots ----

namespace {

struct DenseTarget {
  int layer = -1;
  int module = -1;  // kQ..kO
};

bool ParseDense(const std::string& module, int num_layers, DenseTarget* t) {
  static const std::regex re(R"(^model\.layers\.(\d+)\.self_attn\.(q|k|v|o)_proj$)");
  std::smatch m;
  const std::string name = TextModule(module);
  if (!std::regex_match(name, m, re)) return false;
  const int layer = std::atoi(m[1].str().c_str());
  if (layer < 0 || layer >= num_layers || m[1].str().size() > 6) return false;
  t->layer = layer;
  t->module = std::string("qkvo").find(m[2].str()[0]);
  return true;
}

}  // namespace

int64_t MoeModel::SlotBytes(const LoraAdapter& a) const {
  // Bytes this rank holds (f32 on the CPU path, the compute dtype on the kernel paths):
  // column-parallel modules (q/k/v, gate/up) keep A whole and 1/tp of B; row-parallel ones (o,
  // down) 1/tp of A and B whole.
  const int64_t tp = options_.tp_size;
  const int64_t bytes = kernel_path() ? static_cast<int64_t>(c10::elementSize(options_.dtype)) : 4;
  auto pair = [&](const LoraPair& p, bool row_parallel) {
    return bytes * (row_parallel ? p.a.numel() / tp + p.b.numel() : p.a.numel() + p.b.numel() / tp);
  };
  int64_t total = 0;
  for (const auto& [module, p] : a.dense) total += pair(p, absl::EndsWith(module, "o_proj"));
  for (const auto& [prefix, ml] : a.moe) {
    if (ml.gate_up) total += pair(*ml.gate_up, false);
    if (ml.down) total += pair(*ml.down, true);
    for (const auto& e : ml.experts) {
      for (int k = 0; k < 3; ++k) {
        if (e[k]) total += pair(*e[k], k == static_cast<int>(ExpertProj::kDown));
      }
    }
  }
  return total;
}

void MoeModel::ResetSlot(int slot) {
  for (auto& L : layers_) {
    for (int k = 0; k < 4; ++k) {
      L->la[k][slot].zero_();
      L->lb[k][slot].zero_();
      L->lrank[k][slot] = 0;
      if (L->lrank_t[k].defined()) L->lrank_t[k][slot].zero_();
    }
    const int64_t E = config_.info.num_experts;
    for (int k = 0; k < 3; ++k) {
      if (!L->ea[k].defined()) continue;
      L->ea[k][slot].zero_();
      L->eb[k][slot].zero_();
      for (int64_t e = 0; e < E; ++e) L->erank[k][slot * E + e] = 0;
      if (L->erank_t[k].defined()) L->erank_t[k].narrow(0, slot * E, E).zero_();
    }
  }
}

absl::Status MoeModel::SetSlot(int slot, const LoraAdapter& a) {
  if (slot < 0 || slot >= options_.max_loras) {
    return absl::OutOfRangeError(
        absl::StrCat("slot ", slot, " outside [0, ", options_.max_loras, ")"));
  }
  const int R = options_.max_lora_rank;
  const std::string flag = "--enable-mixed-moe-lora-format";
  // Check everything before touching the slot.
  if (a.max_rank > R) {
    return absl::ResourceExhaustedError(
        absl::StrCat(a.dir, ": LoRA rank ", a.max_rank, " is greater than --max-lora-rank ", R));
  }
  std::vector<std::pair<DenseTarget, const LoraPair*>> dense;
  for (const auto& [module, pair] : a.dense) {
    DenseTarget t;
    if (!ParseDense(module, config_.info.num_layers, &t)) {
      return absl::InvalidArgumentError(absl::StrCat(
          a.safetensors_path, ": tensor ", pair.a_name, " targets module ", module,
          "; this engine applies LoRA to self_attn.{q,k,v,o}_proj and mlp.experts only"));
    }
    dense.push_back({t, &pair});
  }
  for (const auto& [prefix, ml] : a.moe) {
    if (ml.layer < 0 || ml.layer >= config_.info.num_layers) {
      return absl::InvalidArgumentError(absl::StrCat(a.safetensors_path, ": expert LoRA for ",
                                                     prefix, " names no layer of the model"));
    }
    const bool is3d = ml.format == AdapterFormat::k3D;
    if (is3d && wrapper_ == AdapterFormat::k2D) {
      return absl::FailedPreconditionError(absl::StrCat(
          a.dir, ": 3D MoE LoRA adapter (fused experts.base_layer / experts pairs), but ",
          config_.info.architecture, " uses the 2D expert wrapper and ", flag,
          " is off; start the worker with ", flag, " to convert 3D adapters to 2D at load"));
    }
    if (!is3d && wrapper_ == AdapterFormat::k3D) {
      return absl::FailedPreconditionError(absl::StrCat(
          a.dir, ": 2D (per-expert) MoE LoRA adapter, but ", config_.info.architecture,
          " is a 3D-native model using the 3D expert wrapper and ", flag,
          " is off; start the worker with ", flag, " to serve 2D and 3D adapters together"));
    }
    if (ml.num_experts != config_.info.num_experts) {
      return absl::InvalidArgumentError(absl::StrCat(a.safetensors_path, ": ", prefix, " has ",
                                                     ml.num_experts, " experts, the model ",
                                                     config_.info.num_experts));
    }
  }
  ResetSlot(slot);
  // Where the slot's tensors are written: the slot itself on the CPU path; on the kernel paths a
  // host f32 image of each touched tensor, converted and uploaded once everything is in place.
  std::map<at::Tensor*, at::Tensor> staged;
  auto dst = [&](at::Tensor& full) -> at::Tensor {
    if (!kernel_path()) return full[slot];
    auto it = staged.find(&full);
    if (it == staged.end()) {
      it = staged.emplace(&full, at::zeros(full[slot].sizes(), at::kFloat)).first;
    }
    return it->second;
  };
  const int rk = options_.tp_rank;
  for (const auto& [t, pair] : dense) {
    Layer& L = *layers_[t.layer];
    at::Tensor A = ToFloat(pair->a), B = ToFloat(pair->b) * pair->scaling;  // [r, in], [out, r]
    const int r = pair->rank;
    const int64_t in_l = L.la[t.module].size(1), out_l = L.lb[t.module].size(2);
    if (t.module == kO) {
      A = A.narrow(1, rk * in_l, in_l);
    } else {
      B = B.narrow(0, rk * out_l, out_l);
    }
    if (A.size(1) != in_l || B.size(0) != out_l) {
      ResetSlot(slot);
      return absl::InvalidArgumentError(absl::StrCat(a.safetensors_path, ": ", pair->a_name,
                                                     " does not fit the model's ",
                                                     kDenseNames[t.module]));
    }
    dst(L.la[t.module]).narrow(1, 0, r).copy_(A.t());
    dst(L.lb[t.module]).narrow(0, 0, r).copy_(B.t());
    L.lrank[t.module][slot] = r;
  }
  const int64_t E = config_.info.num_experts, I = config_.info.moe_intermediate_size, Ip = ip_;
  for (const auto& [prefix, ml] : a.moe) {
    Layer& L = *layers_[ml.layer];
    if (ml.format == AdapterFormat::k3D) {
      // 3D wrapper: gate_up A [E*r, H], B [2I, r*E] (column j*E+e); down A [E*r, I], B [H, r*E].
      if (ml.gate_up) {
        const LoraPair& p = *ml.gate_up;
        const int r = p.rank;
        at::Tensor A = ToFloat(p.a).view({E, r, -1});
        at::Tensor B = (ToFloat(p.b) * p.scaling).view({2 * I, r, E});
        for (int64_t e = 0; e < E; ++e) {
          at::Tensor Be = B.select(2, e);  // [2I, r]
          at::Tensor Bl = at::cat({Be.narrow(0, rk * Ip, Ip), Be.narrow(0, I + rk * Ip, Ip)}, 0);
          dst(L.ea[kW1])[e].narrow(1, 0, r).copy_(A[e].t());
          dst(L.eb[kW1])[e].narrow(0, 0, r).copy_(Bl.t());
          L.erank[kW1][slot * E + e] = r;
        }
      }
      if (ml.down) {
        const LoraPair& p = *ml.down;
        const int r = p.rank;
        at::Tensor A = ToFloat(p.a).view({E, r, I});
        at::Tensor B = (ToFloat(p.b) * p.scaling).view({-1, r, E});
        for (int64_t e = 0; e < E; ++e) {
          dst(L.ea[kW2])[e].narrow(1, 0, r).copy_(A[e].narrow(1, rk * Ip, Ip).t());
          dst(L.eb[kW2])[e].narrow(0, 0, r).copy_(B.select(2, e).t());
          L.erank[kW2][slot * E + e] = r;
        }
      }
      continue;
    }
    for (int64_t e = 0; e < static_cast<int64_t>(ml.experts.size()); ++e) {
      for (int k : {kW1, kW3, kW2}) {
        const auto& opt = ml.experts[e][k == kW1   ? static_cast<int>(ExpertProj::kGate)
                                        : k == kW3 ? static_cast<int>(ExpertProj::kUp)
                                                   : static_cast<int>(ExpertProj::kDown)];
        if (!opt) continue;
        const int r = opt->rank;
        at::Tensor A = ToFloat(opt->a), B = ToFloat(opt->b) * opt->scaling;
        if (k == kW2) {
          A = A.narrow(1, rk * Ip, Ip);
        } else {
          B = B.narrow(0, rk * Ip, Ip);
        }
        dst(L.ea[k])[e].narrow(1, 0, r).copy_(A.t());
        dst(L.eb[k])[e].narrow(0, 0, r).copy_(B.t());
        L.erank[k][slot * E + e] = r;
      }
    }
  }
  if (kernel_path()) {
    absl::Status s = UploadSlot(slot, staged);
    if (!s.ok()) {
      ResetSlot(slot);
      return s;
    }
  }
  return absl::OkStatus();
}

absl::Status MoeModel::UploadSlot(int slot, std::map<at::Tensor*, at::Tensor>& staged) {
  std::lock_guard<std::mutex> lock(upload_mu_);  // one uploader; stages may run concurrently
  if (options_.kernels == LoraKernels::kCuda) {
    // This thread's current device, and ResetSlot's zeroing (compute stream) finished before
    // the uploader's own stream writes the slot.
    MOELORA_RETURN_IF_ERROR(CudaSetDevice(options_.cuda_device));
    MOELORA_RETURN_IF_ERROR(DeviceSynchronize());
  }
  for (auto& [full, image] : staged) {
    at::Tensor d = full->select(0, slot);
    MOELORA_RETURN_IF_ERROR(Upload(d, image));
  }
  if (uploader_) MOELORA_RETURN_IF_ERROR(uploader_->Finish());
  // Ranks last, this slot's only: its kernels see rank 0 (no LoRA) until its weights are in
  // place.
  const int64_t E = config_.info.num_experts;
  for (auto& L : layers_) {
    for (int k = 0; k < 4; ++k) L->lrank_t[k][slot].fill_(L->lrank[k][slot]);
    for (int k = 0; k < 3; ++k) {
      if (!L->erank_t[k].defined()) continue;
      L->erank_t[k]
          .narrow(0, slot * E, E)
          .copy_(at::from_blob(L->erank[k].data() + slot * E, {E}, at::kInt));
    }
  }
  return absl::OkStatus();
}

}  // namespace moelora
