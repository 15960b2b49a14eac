#include "worker/engine/engine.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <deque>
#include <limits>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/request_rules.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "kernels/device.h"
#include "schema/model_info.h"
#include "worker/architectures/vision_tower.h"
#include "worker/engine/adapter_slots.h"
#include "worker/engine/compute_thread.h"
#include "worker/engine/image_inputs.h"
#include "worker/engine/sequence.h"
#include "worker/engine/speculation.h"
#include "worker/engine/step_planner.h"
#include "worker/torch_guard.h"

namespace moelora {

namespace {

// The model's options from the engine's.
absl::StatusOr<ModelOptions> ModelOptionsFor(const EngineOptions& o, const Communicator& comm) {
  ModelOptions mo;
  mo.tp_rank = comm.rank();
  mo.tp_size = comm.world_size();
  mo.dtype = o.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  int cuda_index = -1;
  MOELORA_RETURN_IF_ERROR(ParseDevice(o.device, &cuda_index));
  if (o.device == "cpu-twins") {
    mo.kernels = LoraKernels::kCpuTwins;
  } else if (absl::StartsWith(o.device, "cuda")) {
    mo.kernels = LoraKernels::kCuda;
    const int n = CudaDeviceCount();
    mo.cuda_device = cuda_index >= 0 ? cuda_index : (n > 0 ? comm.rank() % n : 0);
  }
  mo.max_loras = o.max_loras;
  mo.max_lora_rank = o.max_lora_rank;
  mo.mixed_moe_lora_format = o.enable_mixed_moe_lora_format;
  mo.expert_parallel = o.enable_expert_parallel;
  mo.fully_sharded_loras = o.fully_sharded_loras;
  mo.dummy_weights = o.dummy_weights;
  mo.tower_connector_lora = o.enable_tower_connector_lora;
  if (o.num_speculative_tokens < 0) {
    return absl::InvalidArgumentError("num_speculative_tokens must be >= 0");
  }
  mo.mtp = o.num_speculative_tokens > 0;
  return mo;
}

// --speculative-config against the loaded model: FAILED_PRECONDITION without a head it can use.
absl::Status CheckSpeculation(const EngineOptions& o, const CausalLM& model) {
  if (o.num_speculative_tokens == 0) return absl::OkStatus();
  const std::string& arch = model.config().info.architecture;
  if (!model.has_mtp()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--speculative-config method mtp: ", arch, " from ", o.model_dir,
                     " has no MTP head this server can build (Qwen3.5/3.6-MoE checkpoints with "
                     "mtp_num_hidden_layers and mtp.* weights, Step3.5 with "
                     "num_nextn_predict_layers and its layers after num_hidden_layers)"));
  }
  if (model.mtp_chained() && o.num_speculative_tokens > model.mtp_heads()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "--speculative-config num_speculative_tokens ", o.num_speculative_tokens, ": ", arch,
        " from ", o.model_dir, " declares num_nextn_predict_layers ", model.mtp_heads(),
        " (one MTP layer per draft token, each reading the one before): at most ",
        model.mtp_heads(), " a step"));
  }
  return absl::OkStatus();
}

void LogMemory(const EngineOptions& o, CausalLM& model, const KvCache& kv) {
  LOG(INFO) << "KV cache: " << kv.num_blocks() << " blocks of " << o.block_size << " tokens, "
            << kv.bytes_per_block() << " bytes each (" << kv.num_blocks() * kv.bytes_per_block()
            << " bytes reserved)";
  if (kv.window_blocks() > 0) {
    LOG(INFO) << "KV cache, sliding-window layers: " << kv.window_blocks() << " blocks ("
              << kv.window_bytes() << " bytes of the budget)";
  }
  const int64_t slots = model.AllocatedSlotBytes(true) + model.AllocatedSlotBytes(false);
  LOG(INFO) << "LoRA slots: " << o.max_loras << " of up to " << slots / std::max(1, o.max_loras)
            << " bytes at rank " << o.max_lora_rank << " ("
            << (!absl::StartsWith(o.device, "cuda")
                    ? "host memory taken only while a slot holds an adapter"
                    : "allocated on the device")
            << ")";
  if (kv.state_entries() > 0) {
    LOG(INFO) << "Recurrent state: " << kv.state_entries() << " entries of "
              << kv.state_bytes_per_entry() << " bytes ("
              << kv.state_entries() * kv.state_bytes_per_entry()
              << " bytes reserved beside the budget)";
  }
}

// A step's batch: the forward's input, and for each of its entries the running sequence, its
// index in the running queue and the drafts it verifies.
struct Batch {
  ForwardBatch b;
  std::vector<RunningSequence*> seqs;
  std::vector<size_t> index;
  std::vector<int64_t> drafts;
  // Speculation: where the head's positions were before the step's drafts (they are drafted
  // again from the target's hidden states once the verify has spoken).
  std::vector<int64_t> head_len;
  int distinct_adapters = 0;
};

// What the step's logits gave: VerifiedStep (the tokens), and per batch entry its last row of
// logits, whether it sampled, and its tokens' log-probabilities.
struct StepTokens {
  VerifiedStep v;
  std::vector<int64_t> last_row;
  std::vector<char> samples;
  std::vector<std::vector<float>> logprobs;
};

}  // namespace

[[nodiscard]] absl::Status ParseDevice(const std::string& device, int* cuda_index) {
  *cuda_index = -1;
  if (device == "cpu" || device == "cpu-twins" || device == "cuda") return absl::OkStatus();
  if (absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), cuda_index) &&
      *cuda_index >= 0) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device ", device, ": expected cpu, cuda, cuda:N or cpu-twins"));
}

[[nodiscard]] absl::Status ValidateDType(const std::string& dtype) {
  if (dtype == "float32" || dtype == "bfloat16") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype \"", dtype, "\": use float32 or bfloat16"));
}

// The engine's parts (each in its own file) and the running sequences. A step reads as
// Admit → StepPlanner::Plan → BuildBatch → Forward → ReadLogits → Emit → (speculation) → Finish.
struct Engine::Impl {
  EngineOptions options;
  Communicator* comm = nullptr;
  std::unique_ptr<CausalLM> model;
  int max_model_len = 0;
  std::string config_fingerprint;  // of the model's config.json (ConfigFingerprint)
  KvCache* kv = nullptr;           // the model's
  bool prefix_caching = false;
  std::unique_ptr<Speculation> spec;
  std::unique_ptr<ImageInputs> images;
  std::unique_ptr<AdapterSlots> slots;
  std::unique_ptr<StepPlanner> planner;

  mutable std::mutex step_mu;  // serialises steps, Unload's in-use check, Info
  // When the last Steps call's work ended (compute thread; under step_mu).
  std::optional<std::chrono::steady_clock::time_point> last_steps_end;
  uint64_t epoch = 0;  // the newest controller epoch seen (under step_mu)
  std::deque<RunningSequence> running;

  // The controller's word on the whole batch (StepControl), before a Steps call's first step.
  absl::Status ApplyControl(const StepControl& control, const std::vector<int64_t>& remove);
  // Removes `remove` and adds `add`, all or nothing: an invalid joiner changes nothing.
  absl::Status Admit(const std::vector<NewSequence>& add, const std::vector<int64_t>& remove);
  // A joiner against the model, its adapter and the rules the controller applies too
  // (common/request_rules.h); its slots when valid.
  absl::Status CheckJoiner(const NewSequence& n, int32_t* slot, int32_t* head_slot) const;
  Batch BuildBatch(const StepPlan& plan);
  absl::StatusOr<at::Tensor> Forward(Batch& batch);
  // A failed forward: the one sequence that failed alone (an allocation failure in its prompt
  // chunk, on one rank), or ABORTED with every sequence dropped.
  absl::StatusOr<StepOutput> ForwardFailed(const Batch& batch, const absl::Status& error,
                                           StepOutput out);
  // ABORTED for a step that failed after its forward began: the ranks' states may differ now.
  absl::Status DropAll(const absl::Status& error);
  StepTokens ReadLogits(Batch& batch, const float* L);
  void Emit(const Batch& batch, const float* L, StepTokens& st, StepOutput* out);
  // The blocks the step completed published (prefix caching) and trimmed; finished sequences go.
  void Finish(const Batch& batch, const std::set<int64_t>& finished);
  int64_t vocab() const { return model->config().vocab_size; }

  // Last: destroyed first, so no step runs while the rest goes.
  std::unique_ptr<ComputeThread> compute;
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& o, Communicator* comm) {
  MOELORA_RETURN_IF_ERROR(ValidateDType(o.dtype));
  if (o.max_num_seqs < 1) return absl::InvalidArgumentError("--max-num-seqs must be >= 1");
  if (o.num_threads < 0) return absl::InvalidArgumentError("--num-threads must be >= 0");
  if (o.max_cpu_loras < 0) return absl::InvalidArgumentError("--max-cpu-loras must be >= 0");
  // libgomp may report one thread under a CPU quota; set the pool size explicitly.
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.num_threads > 0 ? o.num_threads : std::max(1, hw / comm->world_size());
  at::set_num_threads(threads);
  auto impl = std::make_unique<Impl>();
  impl->compute = std::make_unique<ComputeThread>(threads);
  impl->options = o;
  impl->comm = comm;
  MOELORA_ASSIGN_OR_RETURN(const ModelOptions mo, ModelOptionsFor(o, *comm));
  MOELORA_ASSIGN_OR_RETURN(impl->model,
                           impl->compute->Run([&] { return LoadCausalLM(o.model_dir, mo, comm); }));
  CausalLM* model = impl->model.get();
  MOELORA_RETURN_IF_ERROR(CheckSpeculation(o, *model));
  impl->spec = std::make_unique<Speculation>(model, o.num_speculative_tokens);
  const int cfg_len = model->config().max_position_embeddings;
  impl->max_model_len = o.max_model_len > 0 ? o.max_model_len : cfg_len;
  MOELORA_ASSIGN_OR_RETURN(impl->config_fingerprint, ConfigFingerprint(o.model_dir));
  if (impl->max_model_len <= 1) {
    return absl::InvalidArgumentError(
        "--max-model-len must be > 1 (config has no max_position_embeddings)");
  }
  if (o.max_num_batched_tokens < o.max_num_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-num-batched-tokens ", o.max_num_batched_tokens,
                     " must be >= --max-num-seqs ", o.max_num_seqs, " (every decode in one step)"));
  }
  KvCacheOptions ko;
  ko.block_size = o.block_size;
  ko.memory_bytes = o.kv_cache_memory_bytes;
  // No more blocks than --max-num-seqs sequences of max_model_len tokens can hold.
  ko.max_blocks = static_cast<int64_t>(o.max_num_seqs) *
                  ((impl->max_model_len + o.block_size - 1) / o.block_size);
  ko.max_model_len = impl->max_model_len;
  ko.max_num_seqs = o.max_num_seqs;
  ko.max_num_batched_tokens = o.max_num_batched_tokens;
  ko.head_lag = impl->spec->HeadsRun();  // MTP heads query from up to this many positions back
  MOELORA_RETURN_IF_ERROR(impl->compute->Run([&] { return model->InitKvCache(ko); }));
  impl->kv = model->kv_cache();
  // With speculation only for chained heads (Step3.5): a reused head's cached blocks would lack
  // its keys and values (and Qwen3.5 has recurrent layers anyway).
  impl->prefix_caching = o.enable_prefix_caching && !model->has_recurrent_layers() &&
                         (o.num_speculative_tokens == 0 || model->mtp_chained());
  MOELORA_ASSIGN_OR_RETURN(impl->images, ImageInputs::Create(model, o));
  impl->slots = std::make_unique<AdapterSlots>(model, o);
  StepPlanner::Settings ps;
  ps.max_num_batched_tokens = o.max_num_batched_tokens;
  ps.prefill_tokens_beside_decodes = o.prefill_tokens_beside_decodes;
  ps.max_model_len = impl->max_model_len;
  ps.prefix_caching = impl->prefix_caching;
  impl->planner = std::make_unique<StepPlanner>(model, impl->kv, impl->spec.get(), ps);
  LogMemory(o, *model, *impl->kv);
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

absl::StatusOr<StageResult> Engine::StageAdapter(int64_t id, const std::string& path,
                                                 std::optional<AdapterFormat> expected) {
  return impl_->compute->Run([&] { return impl_->slots->Stage(id, path, expected); });
}

absl::StatusOr<int> Engine::CommitAdapter(int64_t id) { return impl_->slots->Commit(id); }

absl::Status Engine::AbortAdapter(int64_t id) {
  return impl_->compute->Run([&] { return impl_->slots->Abort(id); });
}

absl::StatusOr<HostCacheStats> Engine::UnloadAdapter(int64_t id, bool keep_in_host_cache) {
  return impl_->compute->Run([&] {
    Impl& m = *impl_;
    std::lock_guard<std::mutex> step_lock(m.step_mu);
    return m.slots->Unload(id, keep_in_host_cache, [&](int slot) {
      for (const RunningSequence& s : m.running) {
        if (s.slot != slot) continue;
        return absl::FailedPreconditionError(absl::StrCat("adapter id ", id,
                                                          " is used by running sequence ",
                                                          s.spec.id, "; unload it when done"));
      }
      return absl::OkStatus();
    });
  });
}

int64_t Engine::SlotResidentBytes() const { return impl_->model->ResidentSlotBytes(); }

absl::StatusOr<StepOutput> Engine::Step(const std::vector<NewSequence>& add,
                                        const std::vector<int64_t>& remove) {
  return impl_->compute->Run([&] { return StepOnComputeThread(add, remove); });
}

absl::Status Engine::Impl::ApplyControl(const StepControl& control,
                                        const std::vector<int64_t>& remove) {
  std::lock_guard<std::mutex> lock(step_mu);
  if (control.epoch != 0 && control.epoch < epoch) {
    return absl::FailedPreconditionError(absl::StrCat(
        "a newer controller (epoch ", epoch, ") drives this worker; this call's epoch ",
        control.epoch, " is older: the controller that sent it should stop"));
  }
  bool drop_all = control.drop_all;
  if (control.epoch > epoch) {
    if (epoch != 0) LOG(WARNING) << "a new controller (epoch " << control.epoch << ")";
    epoch = control.epoch;
    drop_all = true;
  }
  if (drop_all) {
    if (!running.empty()) {
      LOG(WARNING) << "dropping " << running.size() << " sequences no controller knows of";
    }
    running.clear();
  } else if (control.epoch != 0) {
    // Strays: held, neither expected after this call nor leaving in it.
    const std::set<int64_t> keep(control.expected.begin(), control.expected.end());
    const std::set<int64_t> leaving(remove.begin(), remove.end());
    for (auto it = running.begin(); it != running.end();) {
      const int64_t id = it->spec.id;
      if (keep.count(id) || leaving.count(id)) {
        ++it;
        continue;
      }
      LOG(WARNING) << "dropping sequence " << id << ": the controller does not expect it";
      it = running.erase(it);
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<StepOutput>> Engine::Steps(const std::vector<NewSequence>& add,
                                                      const std::vector<int64_t>& remove, int steps,
                                                      const std::function<void()>& before_step,
                                                      const std::function<void()>& queued,
                                                      const StepControl& control) {
  Impl& m = *impl_;
  auto run = [&]() -> absl::StatusOr<std::vector<StepOutput>> {
    MOELORA_RETURN_IF_ERROR(m.ApplyControl(control, remove));
    const auto start = std::chrono::steady_clock::now();
    double idle = -1;
    {
      std::lock_guard<std::mutex> lock(m.step_mu);
      if (!m.running.empty() && m.last_steps_end) {
        idle = std::chrono::duration<double>(start - *m.last_steps_end).count();
      }
    }
    std::vector<StepOutput> outs;
    for (int i = 0; i < std::max(steps, 1); ++i) {
      if (i > 0) {
        std::lock_guard<std::mutex> lock(m.step_mu);
        if (m.running.empty()) break;
      }
      if (before_step) before_step();
      absl::StatusOr<StepOutput> out =
          i == 0 ? StepOnComputeThread(add, remove) : StepOnComputeThread({}, {});
      if (!out.ok()) return out.status();
      const bool failed = !out->failed.empty();
      outs.push_back(std::move(*out));
      if (failed) break;  // the controller ends those requests before the next step
    }
    if (!outs.empty()) outs.front().idle_before_seconds = idle;
    std::lock_guard<std::mutex> lock(m.step_mu);
    m.last_steps_end = std::chrono::steady_clock::now();
    return outs;
  };
  return m.compute->Run(run, queued, /*replied=*/true);
}

void Engine::StepsReplied() { impl_->compute->Replied(); }

absl::StatusOr<StepOutput> Engine::StepOnComputeThread(const std::vector<NewSequence>& add,
                                                       const std::vector<int64_t>& remove) {
  Impl& m = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> step_lock(m.step_mu);
  MOELORA_RETURN_IF_ERROR(m.Admit(add, remove));
  StepOutput out;
  if (m.running.empty()) return out;
  MOELORA_ASSIGN_OR_RETURN(const StepPlan plan, m.planner->Plan(m.running));
  out.preempted = plan.preempted;
  out.prefix_queries = plan.prefix_queries;
  out.prefix_hits = plan.prefix_hits;
  Batch batch = m.BuildBatch(plan);
  absl::StatusOr<at::Tensor> logits = m.Forward(batch);
  if (!logits.ok()) {
    absl::StatusOr<StepOutput> failed = m.ForwardFailed(batch, logits.status(), std::move(out));
    if (failed.ok()) failed->seconds = SecondsSince(t0);
    return failed;
  }
  const float* L = logits->data_ptr<float>();
  StepTokens st = m.ReadLogits(batch, L);
  m.Emit(batch, L, st, &out);
  if (m.spec->k() > 0) {
    if (absl::Status s = GuardTorch("speculation",
                                    [&] { return m.spec->AfterVerify(batch.b, batch.seqs, st.v); });
        !s.ok()) {
      return m.DropAll(s);
    }
  }
  out.batch_tokens = static_cast<int>(batch.b.tokens.size());
  out.distinct_adapters = batch.distinct_adapters;
  m.Finish(batch, st.v.finished);
  out.kv_free_blocks = m.kv->free_blocks();
  out.seconds = SecondsSince(t0);
  return out;
}

absl::Status Engine::Impl::CheckJoiner(const NewSequence& n, int32_t* slot,
                                       int32_t* head_slot) const {
  const int64_t V = vocab();
  if (n.prompt.empty()) return absl::InvalidArgumentError("empty prompt");
  if (const int i = FirstTokenOutsideVocabulary(n.prompt, V); i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt token ", n.prompt[i], " at position ", i, " is outside [0, ", V, ")"));
  }
  if (static_cast<int>(n.prompt.size()) >= max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat("prompt of ", n.prompt.size(),
                                                   " tokens leaves no room under max_model_len ",
                                                   max_model_len));
  }
  MOELORA_RETURN_IF_ERROR(images->Check(n));
  *slot = *head_slot = -1;
  if (n.adapter_id != 0) MOELORA_RETURN_IF_ERROR(slots->Lookup(n.adapter_id, slot, head_slot));
  for (absl::Status st :
       {CheckMaxTokens(n.max_tokens, static_cast<int64_t>(n.prompt.size()), max_model_len),
        CheckSampling(n.sampling.temperature, n.sampling.top_p, n.sampling.top_k),
        CheckStopTokenIds(n.stop_token_ids, V),
        CheckFitsKvCache(static_cast<int64_t>(n.prompt.size()), n.max_tokens, kv->num_blocks(),
                         kv->block_size())}) {
    MOELORA_RETURN_IF_ERROR(st);
  }
  return absl::OkStatus();
}

absl::Status Engine::Impl::Admit(const std::vector<NewSequence>& add,
                                 const std::vector<int64_t>& remove) {
  const std::set<int64_t> remove_set(remove.begin(), remove.end());
  std::set<int64_t> ids;
  for (const RunningSequence& s : running) {
    if (!remove_set.count(s.spec.id)) ids.insert(s.spec.id);
  }
  std::vector<int32_t> slot(add.size()), head_slot(add.size());
  for (size_t i = 0; i < add.size(); ++i) {
    const NewSequence& n = add[i];
    if (!ids.insert(n.id).second) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", n.id, " is already running"));
    }
    if (absl::Status st = CheckJoiner(n, &slot[i], &head_slot[i]); !st.ok()) {
      return absl::Status(st.code(), absl::StrCat("sequence ", n.id, ": ", st.message()));
    }
  }
  if (static_cast<int>(ids.size()) > options.max_num_seqs) {
    return absl::ResourceExhaustedError(
        absl::StrCat(ids.size(), " sequences exceed --max-num-seqs ", options.max_num_seqs));
  }
  for (auto it = running.begin(); it != running.end();) {
    it = remove_set.count(it->spec.id) ? running.erase(it) : std::next(it);
  }
  for (size_t i = 0; i < add.size(); ++i) {
    RunningSequence s;
    s.spec = add[i];
    s.slot = slot[i];
    s.head_slot = head_slot[i];
    s.state = model->NewState();
    s.sampler = std::make_unique<Sampler>(add[i].sampling);
    s.feed = add[i].prompt;
    s.history = add[i].prompt;
    images->Add(s);
    running.push_back(std::move(s));
  }
  return absl::OkStatus();
}

Batch Engine::Impl::BuildBatch(const StepPlan& plan) {
  Batch batch;
  ForwardBatch& b = batch.b;
  std::set<int32_t> distinct;
  bool mm = false;  // a sequence of the batch has images: multimodal positions
  for (size_t i = 0; i < running.size(); ++i) {
    if (plan.take[i] == 0) continue;
    RunningSequence& s = running[i];
    ForwardBatch::Seq fs;
    fs.state = &s.state;
    fs.begin = static_cast<int64_t>(b.tokens.size());
    fs.count = plan.take[i];
    if (s.Prefilling()) {
      b.tokens.insert(b.tokens.end(), s.feed.begin() + s.fed, s.feed.begin() + s.fed + fs.count);
      fs.all_logits = s.spec.return_prompt_logits && !s.recompute;
    } else {
      b.tokens.push_back(s.pending);
      if (plan.drafts[i] > 0) {
        spec->AppendDrafts(s, plan.drafts[i], &b.tokens);
        fs.all_logits = true;
        fs.keep_states = true;  // rolled back past the first rejected draft
      }
    }
    b.slots.insert(b.slots.end(), fs.count, s.slot);
    if (s.slot >= 0) distinct.insert(s.slot);
    b.seqs.push_back(fs);
    batch.seqs.push_back(&s);
    batch.index.push_back(i);
    batch.drafts.push_back(plan.drafts[i]);
    batch.head_len.push_back(s.state.mtp_len[0]);
    mm = mm || !s.pos3.empty();
  }
  batch.distinct_adapters = static_cast<int>(distinct.size());
  if (mm) {
    const int64_t T = static_cast<int64_t>(b.tokens.size());
    b.positions3.resize(3 * T);
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      const RunningSequence& s = *batch.seqs[k];
      for (int64_t i = 0; i < b.seqs[k].count; ++i) {
        const std::array<int64_t, 3> p = s.Position(s.state.len + i);
        for (int r = 0; r < 3; ++r) b.positions3[r * T + b.seqs[k].begin + i] = p[r];
      }
    }
  }
  return batch;
}

absl::StatusOr<at::Tensor> Engine::Impl::Forward(Batch& batch) {
  return GuardTorch("forward", [&]() -> absl::StatusOr<at::Tensor> {
    if (const int f = options.debug_fail_prompt_chunk_tokens; f > 0) {
      for (const ForwardBatch::Seq& fs : batch.b.seqs) {
        if (fs.count >= f) (void)at::empty({int64_t{1} << 62}, at::kByte);  // throws
      }
    }
    MOELORA_RETURN_IF_ERROR(images->Prepare(batch.b, batch.seqs, spec->HeadsRun() > 0));
    if (spec->k() > 0 && !model->mtp_chained()) {
      MOELORA_RETURN_IF_ERROR(spec->DraftMore(batch.b, batch.seqs, batch.drafts, batch.head_len));
    }
    return model->Forward(batch.b);
  });
}

absl::StatusOr<StepOutput> Engine::Impl::ForwardFailed(const Batch& batch,
                                                       const absl::Status& error, StepOutput out) {
  // Out of memory on the only rank, in a model without recurrent state: nothing this step did
  // stays (a state's length grows only at the forward's end, and its K/V rows are written
  // again), so the sequence with the largest prompt chunk fails alone and the others step on
  // next time. With recurrent layers (their states change layer by layer) or other ranks
  // (which wait in a collective), the step is dropped.
  if (error.code() != absl::StatusCode::kResourceExhausted || comm->world_size() != 1 ||
      model->has_recurrent_layers() || spec->k() != 0) {
    return DropAll(error);
  }
  const ForwardBatch& b = batch.b;
  int64_t worst = -1;
  for (size_t k = 0; k < b.seqs.size(); ++k) {
    if (batch.seqs[k]->Prefilling() &&
        (worst < 0 || b.seqs[k].count > b.seqs[static_cast<size_t>(worst)].count)) {
      worst = static_cast<int64_t>(k);
    }
  }
  if (worst < 0) return DropAll(error);
  const auto w = static_cast<size_t>(worst);
  const int64_t id = batch.seqs[w]->spec.id;
  out.failed.push_back(
      {id,
       absl::StrCat(
           "out of memory computing ", b.seqs[w].count, " tokens of this prompt (", b.tokens.size(),
           " tokens in the step; --max-num-batched-tokens bounds it): ", error.message())});
  LOG(WARNING) << "sequence " << id << " removed: " << out.failed.back().second;
  running.erase(running.begin() + static_cast<std::ptrdiff_t>(batch.index[w]));  // frees blocks
  out.kv_free_blocks = kv->free_blocks();
  return out;
}

absl::Status Engine::Impl::DropAll(const absl::Status& error) {
  // The other ranks fail their collective by its deadline. ABORTED whatever the cause (out of
  // memory included): the controller reads RESOURCE_EXHAUSTED and INVALID_ARGUMENT as "a joiner
  // was refused, nothing stepped", and must instead end every sequence this step dropped.
  const size_t dropped = running.size();
  running.clear();
  return absl::AbortedError(absl::StrCat(
      "the step failed and its ", dropped,
      " sequences were dropped: ", absl::StatusCodeToString(error.code()), ": ", error.message()));
}

// Each sequence's rows of logits: its last; all_logits sequences have one per new token before
// it; a decode with d drafts has d + 1, one per position it verifies. Prompt chunks move on;
// sequences that finish reading their feed (or decode) sample, in parallel (each has its own
// sampler), a task at least 32768 logits, so a small vocabulary stays on this thread.
StepTokens Engine::Impl::ReadLogits(Batch& batch, const float* L) {
  const ForwardBatch& b = batch.b;
  const int64_t V = vocab();
  const auto n = static_cast<int64_t>(b.seqs.size());
  StepTokens st;
  st.v.drafts = batch.drafts;
  st.v.head_len = batch.head_len;
  st.v.was_prefilling.assign(n, 0);
  st.v.tokens.resize(n);
  st.last_row.assign(n, 0);
  st.samples.assign(n, 0);
  st.logprobs.resize(n);
  for (int64_t k = 0, row = 0; k < n; ++k) {
    RunningSequence& s = *batch.seqs[k];
    row += b.seqs[k].all_logits ? b.seqs[k].count : 1;
    st.last_row[k] = row - 1;
    if (!s.Prefilling()) {
      st.samples[k] = 1;
      // Past its prompt: the head read every image token at the step that finished it.
      ImageInputs::DropBefore(s, std::numeric_limits<int64_t>::max());
      continue;
    }
    st.v.was_prefilling[k] = 1;
    if (b.seqs[k].all_logits) {
      const float* r = L + st.last_row[k] * V;
      s.prompt_logits.insert(s.prompt_logits.end(), r - (b.seqs[k].count - 1) * V, r + V);
    }
    s.fed += b.seqs[k].count;
    st.samples[k] = !s.Prefilling();
    // An image's tower output goes once the prompt is past it; with an MTP head, once the
    // head is too (it reads the tokens up to the chunk's end + 1 after this step).
    ImageInputs::DropBefore(
        s, static_cast<int64_t>(s.fed) - (spec->HeadsRun() > 0 ? b.seqs[k].count - 1 : 0));
  }
  // Per sequence: its tokens (the drafts kept, in order, then the target's own) and their
  // logprobs; the first from row last_row - drafts.
  at::parallel_for(
      0, n, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, V)), [&](int64_t i0, int64_t i1) {
        for (int64_t k = i0; k < i1; ++k) {
          if (!st.samples[k]) continue;
          RunningSequence& s = *batch.seqs[k];
          const int64_t nd = st.v.drafts[k];
          for (int64_t j = 0; j <= nd; ++j) {
            const float* r = L + (st.last_row[k] - nd + j) * V;
            float lp = 0;
            float* want = s.spec.return_logprobs ? &lp : nullptr;
            bool kept = false;
            if (j < nd) {  // the draft at position j + 1 of the sequence's tokens
              const auto draft = static_cast<int32_t>(b.tokens[b.seqs[k].begin + 1 + j]);
              st.v.tokens[k].push_back(s.sampler->Verify(r, V, draft, &kept, want));
            } else {
              st.v.tokens[k].push_back(s.sampler->Sample(r, V, want));
            }
            st.logprobs[k].push_back(lp);
            if (j < nd && !kept) break;
          }
        }
      });
  return st;
}

void Engine::Impl::Emit(const Batch& batch, const float* L, StepTokens& st, StepOutput* out) {
  const int64_t V = vocab();
  for (size_t k = 0; k < batch.seqs.size(); ++k) {
    if (!st.samples[k]) continue;
    RunningSequence& s = *batch.seqs[k];
    const int64_t nd = st.v.drafts[k];
    const std::vector<int32_t>& tokens = st.v.tokens[k];
    ++out->sequences;
    for (size_t j = 0; j < tokens.size(); ++j) {
      TokenOut t;
      t.sequence_id = s.spec.id;
      const float* r = L + (st.last_row[k] - nd + static_cast<int64_t>(j)) * V;
      if (j == 0) {
        if (!s.prompt_logits.empty()) t.prompt_logits = std::move(s.prompt_logits);
        s.prompt_logits.clear();
        s.recompute = false;
        t.drafted = static_cast<int32_t>(nd);
        t.accepted = static_cast<int32_t>(tokens.size() - 1);
      }
      t.same_step = j > 0;
      t.token = tokens[j];
      if (s.spec.return_logprobs) t.logprob = st.logprobs[k][j];
      if (s.spec.return_logits) t.logits.assign(r, r + V);
      s.pending = t.token;
      s.history.push_back(t.token);
      ++s.generated;
      // The length once this token's position is computed (the state holds every verified one).
      const int64_t len = s.state.len - (nd + 1) + static_cast<int64_t>(j) + 1;
      const auto& stop = s.spec.stop_token_ids;
      if (std::find(stop.begin(), stop.end(), t.token) != stop.end()) {
        t.finished = true, t.finish_reason = "stop";
      } else if ((s.spec.max_tokens > 0 && s.generated >= s.spec.max_tokens) ||
                 len + 1 >= max_model_len) {
        t.finished = true, t.finish_reason = "length";
      }
      out->tokens.push_back(std::move(t));
      if (out->tokens.back().finished) {
        st.v.finished.insert(s.spec.id);
        break;  // the rest of its kept drafts are not emitted
      }
    }
  }
}

void Engine::Impl::Finish(const Batch& batch, const std::set<int64_t>& finished) {
  for (RunningSequence* s : batch.seqs) {
    // The full blocks this step completed become findable (before finished sequences release
    // theirs, which then stay cached until evicted), then the sliding-window blocks no later
    // query sees go back. With MTP heads, only as far as every head's keys and values are final,
    // and the window blocks the heads' next queries still see stay.
    const int64_t done = spec->HeadsFrom(*s);
    if (prefix_caching && s->images.empty()) {
      kv->Publish(s->spec.adapter_id, s->history, done, s->state.table);
    }
    kv->Trim(s->state.table, done);
  }
  for (auto it = running.begin(); it != running.end();) {
    it = finished.count(it->spec.id) ? running.erase(it) : std::next(it);
  }
}

EngineInfo Engine::Info() const {
  const Impl& m = *impl_;
  EngineInfo i;
  i.rank = m.comm->rank();
  i.world_size = m.comm->world_size();
  i.architecture = m.model->config().info.architecture;
  i.vocab_size = m.model->config().vocab_size;
  i.max_model_len = m.max_model_len;
  i.max_loras = m.options.max_loras;
  i.max_lora_rank = m.options.max_lora_rank;
  i.mixed = m.options.enable_mixed_moe_lora_format;
  i.native_format = m.model->native_format();
  i.skipped_tensors = m.model->skipped_tensors();
  i.dtype = m.options.dtype;
  i.model_dir = m.options.model_dir;
  i.config_fingerprint = m.config_fingerprint;
  i.expert_parallel = m.options.enable_expert_parallel;
  i.fully_sharded_loras = m.options.fully_sharded_loras;
  i.max_num_seqs = m.options.max_num_seqs;
  i.max_cpu_loras = m.options.max_cpu_loras;
  m.slots->Describe(&i);
  i.block_size = static_cast<int>(m.kv->block_size());
  i.num_blocks = m.kv->num_blocks();
  i.free_blocks = m.kv->free_blocks();
  i.bytes_per_block = m.kv->bytes_per_block();
  i.window_bytes = m.kv->window_bytes();
  i.max_num_batched_tokens = m.options.max_num_batched_tokens;
  i.prefix_caching = m.prefix_caching;
  i.prefill_tokens_beside_decodes = m.options.prefill_tokens_beside_decodes;
  i.num_speculative_tokens = m.spec->k();
  if (const VisionConfig* v = m.model->vision()) {
    i.vision = true;
    i.image_token_id = v->image_token_id;
  }
  i.tower_connector_lora = m.options.enable_tower_connector_lora;
  i.encoder_cache_hits = m.images->cache_hits();
  i.images_encoded = m.images->images_encoded();
  std::lock_guard<std::mutex> step_lock(m.step_mu);
  i.running = static_cast<int>(m.running.size());
  return i;
}

}  // namespace moelora
