// CausalLM's shared parts: the LoRA module registry and slot protocol, the all-reduce, and
// LoadCausalLM (the checks every architecture shares, then its factory).
#include "worker/model/causal_lm.h"

#include <filesystem>
#include <fstream>
#include <regex>
#include <set>
#include <sstream>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "kernels/bgmv.h"
#include "kernels/device.h"
#include "kernels/moe_lora.h"
#include "kernels/sgmv.h"
#include "schema/config_defaults.h"
#include "schema/name_tables.h"
#include "worker/layers/lora_module.h"
#include "worker/layers/lora_ops.h"
#include "worker/model/model_context.h"
#include "worker/model/registry.h"
#include "worker/torch_guard.h"

namespace moelora {

namespace {
// Adapter module names of multimodal wrappers (`model.language_model.layers...`) name the same
// modules as the text model's (`model.layers...`).
std::string TextModule(const std::string& module) {
  if (absl::StartsWith(module, "model.language_model.")) {
    return absl::StrCat("model.", module.substr(std::string("model.language_model.").size()));
  }
  return module;
}
}  // namespace

CausalLM::~CausalLM() = default;

absl::StatusOr<VisionEncoding> CausalLM::EncodeImages(const std::vector<VisionImage>&) {
  return absl::InvalidArgumentError(
      absl::StrCat(config_.info.architecture, " has no vision tower: images are not accepted"));
}

at::Device CausalLM::device() const {
  return options_.kernels == LoraKernels::kCuda
             ? at::Device(at::kCUDA, static_cast<c10::DeviceIndex>(options_.cuda_device))
             : at::Device(at::kCPU);
}

absl::Status CausalLM::InitKvCache(const KvCacheOptions& o) {
  if (kv_ != nullptr) return absl::FailedPreconditionError("the KV cache exists already");
  MOELORA_ASSIGN_OR_RETURN(
      kv_, KvCache::Create(KvShapes(), StateShapes(), num_layers_, o, options_.dtype, device()));
  return absl::OkStatus();
}

absl::Status CausalLM::RollBack(SeqState& st, int64_t count, int64_t keep) {
  auto steps = std::move(st.steps);
  st.steps.clear();
  if (count < 1 || keep < 1 || keep > count || count > st.len) {
    return absl::InvalidArgumentError(absl::StrCat("cannot keep ", keep, " of the last ", count,
                                                   " tokens of a sequence of ", st.len));
  }
  if (st.kv == nullptr) return absl::FailedPreconditionError("the sequence has no KV cache");
  if (steps.size() != StateShapes().size()) {
    return absl::FailedPreconditionError(
        "the last forward kept no per-token recurrent states (ForwardBatch::Seq::keep_states)");
  }
  for (const auto& [layer, s] : steps) {  // every check before anything changes
    if (s.first.size(0) != count) {
      return absl::InvalidArgumentError(
          absl::StrCat("layer ", layer, " kept ", s.first.size(0), " states, not ", count));
    }
  }
  for (auto& [layer, s] : steps) {
    st.kv->ssm(layer, st.table.state).copy_(s.first[keep - 1]);
    at::Tensor conv = st.kv->conv(layer, st.table.state);
    conv.copy_(s.second.narrow(0, keep, conv.size(0)));
  }
  st.len -= count - keep;
  for (int64_t& l : st.mtp_len) l = std::min(l, std::max<int64_t>(st.len - 1, 0));
  st.kv->Shrink(st.table, st.len);
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> CausalLM::ForwardMtp(const ForwardBatch&, const at::Tensor&, at::Tensor*,
                                                int, bool) {
  return absl::FailedPreconditionError("this model was built without an MTP head");
}

bool CausalLM::IsMtpModule(const std::string& module) const {
  if (absl::StartsWith(module, "mtp.")) return true;
  return mtp_layers_follow_ && CheckpointLayerIndex(module) >= config_.info.num_layers;
}

SeqState CausalLM::NewState() {
  if (kv_ == nullptr) {
    // Direct users (tests, benchmarks): a budget of 256 MiB.
    KvCacheOptions o;
    o.memory_bytes = int64_t{256} << 20;
    absl::StatusOr<std::unique_ptr<KvCache>> c =
        KvCache::Create(KvShapes(), StateShapes(), num_layers_, o, options_.dtype, device());
    if (c.ok()) kv_ = std::move(*c);
  }
  SeqState s;
  s.kv = kv_.get();
  return s;
}

void CausalLM::RegisterLora(LoraModule* m, const std::vector<std::string>& aliases) {
  lora_order_.push_back(m);
  lora_by_name_[m->path()] = m;
  for (const std::string& a : aliases) lora_by_name_[a] = m;
}

LoraModule* CausalLM::FindLora(const std::string& module) const {
  auto it = lora_by_name_.find(TextModule(module));
  return it == lora_by_name_.end() ? nullptr : it->second;
}

std::vector<std::string> CausalLM::lora_modules() const {
  std::vector<std::string> out;
  for (const LoraModule* m : lora_order_) out.push_back(m->path());
  return out;
}

absl::Status CausalLM::Adopt(const ModelContext& ctx, const ModelConfig& c,
                             std::vector<std::string> skipped,
                             std::map<std::string, at::Tensor>& params) {
  config_ = c;
  options_ = ctx.options;
  comm_ = ctx.comm;
  native_ = ctx.arch->native_moe_format();
  wrapper_ = options_.mixed_moe_lora_format ? AdapterFormat::k2D : native_;
  skipped_ = std::move(skipped);
  num_layers_ = c.info.num_layers;
  mtp_layers_follow_ = ctx.arch->facts->mtp_layers_follow;
  if (kernel_path()) {
    const at::Device dev = device();
    for (auto& [name, t] : params) t = t.to(dev).contiguous();
  }
  if (options_.kernels == LoraKernels::kCuda) {
    MOELORA_ASSIGN_OR_RETURN(uploader_, PinnedUploader::Create());
  }
  return absl::OkStatus();
}

absl::Status CausalLM::AllReduce(at::Tensor& t) {
  if (!comm_ || comm_->world_size() == 1) return absl::OkStatus();
  at::Tensor buf =
      t.scalar_type() == at::kFloat && t.is_contiguous() ? t : t.to(at::kFloat).contiguous();
  MOELORA_RETURN_IF_ERROR(comm_->AllReduceSum(buf.data_ptr<float>(), buf.numel()));
  if (!buf.is_same(t)) t.copy_(buf);
  return absl::OkStatus();
}

int64_t CausalLM::SlotBytes(const LoraAdapter& a) const {
  // Bytes this rank holds: the compute dtype on the kernel paths; on the CPU path bf16 for a
  // bf16 model, f32 otherwise (CpuSlotDType).
  const int64_t elem = static_cast<int64_t>(
      c10::elementSize(kernel_path() ? options_.dtype : CpuSlotDType(options_.dtype)));
  int64_t total = 0;
  for (const auto& [module, p] : a.dense) {
    if (const LoraModule* m = FindLora(module)) total += m->DenseBytes(p, elem);
  }
  for (const auto& [prefix, ml] : a.moe) {
    if (const LoraModule* m = FindLora(prefix)) total += m->ExpertBytes(ml, elem);
  }
  return total;
}

int64_t CausalLM::AllocatedSlotBytes(bool experts) const {
  int64_t n = 0;
  for (const LoraModule* m : lora_order_) {
    if (m->takes_experts() == experts) n += m->AllocatedSlotBytes();
  }
  return n;
}

int64_t CausalLM::ResidentSlotBytes() const {
  int64_t n = 0;
  for (const LoraModule* m : lora_order_) n += m->ResidentSlotBytes();
  return n;
}

void CausalLM::ResetSlot(int slot) {
  for (LoraModule* m : lora_order_) m->Reset(slot);
}

absl::Status CausalLM::SetSlot(int slot, const LoraAdapter& a) {
  if (slot < 0 || slot >= options_.max_loras) {
    return absl::OutOfRangeError(
        absl::StrCat("slot ", slot, " outside [0, ", options_.max_loras, ")"));
  }
  const int R = options_.max_lora_rank;
  if (a.max_rank > R) {
    return absl::ResourceExhaustedError(
        absl::StrCat(a.dir, ": LoRA rank ", a.max_rank, " is greater than --max-lora-rank ", R));
  }
  // The LoRA-capable modules by their path within a layer ("self_attn.q_proj"), for messages.
  auto capable = [&]() {
    static const std::regex layer_re(R"(^model\.layers\.\d+\.)");
    std::set<std::string> kinds;
    for (const LoraModule* m : lora_order_)
      kinds.insert(std::regex_replace(m->path(), layer_re, ""));
    return absl::StrJoin(kinds, ", ");
  };
  // Resolve and check everything before touching the slot. Two names of one module (a module's
  // alias next to its path) would overwrite each other: refused.
  std::map<const LoraModule*, std::string> named;
  auto once = [&](const LoraModule* m, const std::string& name) -> absl::Status {
    auto [it, fresh] = named.emplace(m, name);
    if (fresh) return absl::OkStatus();
    return absl::InvalidArgumentError(absl::StrCat(a.safetensors_path, ": ", it->second, " and ",
                                                   name, " both name module ", m->path()));
  };
  // LoRA for an MTP head this model was built without (no speculative decoding): not needed.
  auto unbuilt_head = [&](const std::string& module) { return !has_mtp() && IsMtpModule(module); };
  std::vector<std::pair<LoraModule*, const LoraPair*>> dense;
  for (const auto& [module, pair] : a.dense) {
    if (unbuilt_head(module)) continue;
    LoraModule* m = FindLora(module);
    if (m == nullptr && vision() != nullptr && !options_.tower_connector_lora &&
        (absl::StartsWith(module, "model.visual.") || absl::StartsWith(module, "visual."))) {
      return absl::InvalidArgumentError(absl::StrCat(
          a.safetensors_path, ": tensor ", pair.a_name, " targets the vision tower module ", module,
          ": start the workers with --enable-tower-connector-lora to serve LoRA on the "
          "tower and its mergers"));
    }
    if (m == nullptr || m->takes_experts()) {
      return absl::InvalidArgumentError(absl::StrCat(
          a.safetensors_path, ": tensor ", pair.a_name, " targets module ", module, ", which ",
          config_.info.architecture,
          " does not have as a LoRA-capable linear; its LoRA-capable modules are ", capable()));
    }
    MOELORA_RETURN_IF_ERROR(m->CheckDense(a, pair));
    MOELORA_RETURN_IF_ERROR(once(m, module));
    dense.push_back({m, &pair});
  }
  std::vector<std::pair<LoraModule*, const MoeLayerLora*>> experts;
  for (const auto& [prefix, ml] : a.moe) {
    if (unbuilt_head(prefix)) continue;
    LoraModule* m = FindLora(prefix);
    if (m == nullptr || !m->takes_experts()) {
      return absl::InvalidArgumentError(
          absl::StrCat(a.safetensors_path, ": expert LoRA for ", prefix, " names no MoE layer of ",
                       config_.info.architecture, " (", config_.info.num_layers, " layers)"));
    }
    MOELORA_RETURN_IF_ERROR(m->CheckExperts(a, ml));
    MOELORA_RETURN_IF_ERROR(once(m, prefix));
    experts.push_back({m, &ml});
  }
  ResetSlot(slot);
  std::map<at::Tensor*, at::Tensor> staged;
  SlotWrite w = MakeSlotWrite(slot, &staged);
  w.interleaved_gate_up = a.interleaved_gate_up;
  for (auto& [m, pair] : dense) m->WriteDense(*pair, w);
  for (auto& [m, ml] : experts) m->WriteExperts(*ml, w);
  return FinishSlotWrite(slot, staged);
}

absl::Status CausalLM::FinishSlotWrite(int slot, std::map<at::Tensor*, at::Tensor>& staged) {
  if (!kernel_path()) return absl::OkStatus();  // written in place
  absl::Status s = UploadSlot(slot, staged);
  if (!s.ok()) ResetSlot(slot);
  return s;
}

SlotWrite CausalLM::MakeSlotWrite(int slot, std::map<at::Tensor*, at::Tensor>* staged) {
  // Where the slot's tensors are written: the slot itself on the CPU path; on the kernel paths a
  // host f32 image of each touched tensor, converted and uploaded once everything is in place.
  SlotWrite w;
  w.slot = slot;
  w.tp_rank = options_.tp_rank;
  w.tp_size = options_.tp_size;
  const bool kernels = kernel_path();
  w.dst = [slot, staged, kernels](at::Tensor& full) -> at::Tensor {
    if (!kernels) return full[slot];
    auto it = staged->find(&full);
    if (it == staged->end()) {
      it = staged->emplace(&full, at::zeros(full[slot].sizes(), at::kFloat)).first;
    }
    return it->second;
  };
  return w;
}

CausalLM::SlotImage CausalLM::SaveSlot(int slot) const {
  SlotImage im;
  for (LoraModule* m : lora_order_) {
    ModuleSlotImage part;
    if (!m->SaveSlot(slot, &part)) continue;
    im.bytes += part.bytes();
    im.modules.emplace_back(m, std::move(part));
  }
  return im;
}

absl::Status CausalLM::RestoreSlot(int slot, const SlotImage& image) {
  if (slot < 0 || slot >= options_.max_loras) {
    return absl::OutOfRangeError(
        absl::StrCat("slot ", slot, " outside [0, ", options_.max_loras, ")"));
  }
  ResetSlot(slot);
  std::map<at::Tensor*, at::Tensor> staged;
  const SlotWrite w = MakeSlotWrite(slot, &staged);
  for (const auto& [m, part] : image.modules) m->RestoreSlot(part, w);
  return FinishSlotWrite(slot, staged);
}

absl::Status CausalLM::UploadSlot(int slot, std::map<at::Tensor*, at::Tensor>& staged) {
  std::lock_guard<std::mutex> lock(upload_mu_);  // one uploader; stages may run concurrently
  if (options_.kernels == LoraKernels::kCuda) {
    // This thread's current device, and ResetSlot's zeroing (compute stream) finished before
    // the uploader's own stream writes the slot.
    MOELORA_RETURN_IF_ERROR(CudaSetDevice(options_.cuda_device));
    MOELORA_RETURN_IF_ERROR(DeviceSynchronize());
  }
  for (auto& [full, image] : staged) {
    at::Tensor d = full->select(0, slot);
    if (!d.is_cuda()) {
      d.copy_(image);
      continue;
    }
    at::Tensor host = image.to(d.scalar_type()).contiguous();
    MOELORA_RETURN_IF_ERROR(uploader_->Copy(d.data_ptr(), host.data_ptr(), host.nbytes()));
  }
  if (uploader_) MOELORA_RETURN_IF_ERROR(uploader_->Finish());
  // Ranks last, this slot's only: its kernels see rank 0 (no LoRA) until its weights are in
  // place.
  for (LoraModule* m : lora_order_) m->SyncRanks(slot);
  return absl::OkStatus();
}

// ---- LoadCausalLM ----

namespace {

[[nodiscard]] absl::StatusOr<std::string> ReadText(const std::string& path) {
  std::ifstream in(path);
  if (!in) {
    return absl::NotFoundError(
        absl::StrCat(path, ": cannot open (is --model an HF model directory?)"));
  }
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Checks every architecture shares: dims, TP divisibility, slot and rank limits, the device.
[[nodiscard]] absl::Status CheckShared(const std::string& dir, const ModelConfig& c,
                                       const ModelOptions& o, const ArchTable& arch) {
  const std::string cfg = dir + "/config.json";
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(cfg, ": ", parts...));
  };
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
  if ((!arch.facts->kv_replicated && c.info.num_key_value_heads % tp != 0) ||
      c.info.num_attention_heads % tp != 0) {
    return bad("num_key_value_heads ", c.info.num_key_value_heads,
               " and num_attention_heads must divide by --tensor-parallel-size ", tp);
  }
  if (o.fully_sharded_loras) {
    if (o.max_lora_rank % tp != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "--fully-sharded-loras: --max-lora-rank ", o.max_lora_rank,
          " must divide by --tensor-parallel-size ", tp, " (each rank holds R / tp of lora_A)"));
    }
    if (o.kernels != LoraKernels::kCpuSgmv) {
      return absl::FailedPreconditionError(
          "--fully-sharded-loras runs on the CPU path only for now (--device cpu)");
    }
    if (c.info.hidden_size % tp != 0) {
      return bad("hidden_size ", c.info.hidden_size, " must divide by --tensor-parallel-size ", tp,
                 " with --fully-sharded-loras (each rank holds H / tp columns of the experts' "
                 "down lora_B)");
    }
  }
  if (o.expert_parallel) {
    if (c.info.num_experts % tp != 0) {
      return bad("num_experts ", c.info.num_experts, " must divide by --tensor-parallel-size ", tp,
                 " with --enable-expert-parallel");
    }
  } else if (c.info.moe_intermediate_size % tp != 0) {
    return bad("moe_intermediate_size ", c.info.moe_intermediate_size,
               " must divide by --tensor-parallel-size ", tp);
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
  const int64_t keys = c.info.num_experts * (int64_t{o.max_loras} + 1);
  if (kernels && keys > kMoeLoraCudaMaxSortKeys) {
    return absl::InvalidArgumentError(absl::StrCat(
        "--max-loras ", o.max_loras, " is too large for ", c.info.num_experts,
        " experts on the GPU kernel path: num_experts x (max_loras + 1) = ", keys, " > ",
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
  return absl::OkStatus();
}

}  // namespace

[[nodiscard]] absl::StatusOr<std::unique_ptr<CausalLM>> LoadCausalLM(const std::string& dir,
                                                                     const ModelOptions& o,
                                                                     Communicator* comm) {
  std::error_code ec;
  if (!std::filesystem::is_directory(dir, ec)) {
    return absl::NotFoundError(absl::StrCat(dir, ": model directory does not exist"));
  }
  // The architecture first, so that an unserved model is named before its config is parsed.
  MOELORA_ASSIGN_OR_RETURN(ModelInfo info, ReadModelInfo(dir));
  MOELORA_ASSIGN_OR_RETURN(const ArchTable* arch, FindArchTable(info.architecture));
  if (!arch->has_forward()) {
    return absl::UnimplementedError(
        absl::StrCat(dir, ": ", info.architecture,
                     " has a weight-name table but no forward pass yet; served architectures: ",
                     absl::StrJoin(ServedArchitectures(), ", ")));
  }
  const std::string cfg = dir + "/config.json";
  MOELORA_ASSIGN_OR_RETURN(std::string text, ReadText(cfg));
  MOELORA_ASSIGN_OR_RETURN(ModelConfig c, ParseModelConfig(text, cfg));
  MOELORA_RETURN_IF_ERROR(
      CheckConfigKeys(text, cfg, info.architecture,
                      arch->config_keys ? *arch->config_keys : std::vector<std::string>{}));
  MOELORA_RETURN_IF_ERROR(CheckRequiredConfigKeys(text, cfg));
  MOELORA_RETURN_IF_ERROR(CheckShared(dir, c, o, *arch));
  std::unique_ptr<Checkpoint> ckpt;
  if (!o.dummy_weights) {
    MOELORA_ASSIGN_OR_RETURN(ckpt, Checkpoint::Open(dir));
  }
  ModelContext ctx;
  ctx.dir = dir;
  ctx.config = c;
  ctx.options = o;
  ctx.comm = comm;
  ctx.arch = arch;
  ctx.checkpoint = ckpt.get();
  auto loaded = GuardTorch(absl::StrCat("load ", dir), [&]() { return arch->factory(ctx); });
  // Weights read from a shard that changed under the load are not served.
  if (loaded.ok() && ckpt != nullptr) MOELORA_RETURN_IF_ERROR(ckpt->CheckIntact());
  return loaded;
}

}  // namespace moelora
