// The worker's engine: the model of this rank, its LoRA slots, and the running sequences.
// Continuous batching: at every Step sequences may join (prefilled in the same forward pass as
// the decodes) and leave; each running sequence then yields one token (or, with speculative
// decoding, the drafts of the model's MTP head it verified and kept, then one). No libtorch in this
// header (pimpl), so the gRPC service and tests that only drive the engine compile fast.
//
// Adapters load in two phases so a controller can make a load atomic across ranks: Stage reads,
// validates, converts (mixed mode) and copies into a reserved slot; Commit makes it usable;
// Abort releases it. A staged adapter is invisible to Step.
//
// The engine's parts, one job each, in this folder: step_planner (tokens per sequence, preemption,
// prefix hits), speculation (MTP drafts and their verification), image_inputs (images, the
// encoder cache), adapter_slots (slots and the host cache), compute_thread (where tensor work
// runs); engine.cc joins them into a step: admit, plan, forward, sample, finish.
//
// Thread-safety: all methods may be called from any thread. Step calls are serialised; Stage
// runs concurrently with Step (it writes only its reserved slot).
#ifndef MOELORA_WORKER_ENGINE_ENGINE_H_
#define MOELORA_WORKER_ENGINE_ENGINE_H_

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "common/engine_flags.h"
#include "lora/adapter.h"
#include "worker/comm/communicator.h"
#include "worker/sampling.h"

namespace moelora {

// The engine's settings: the flags both binaries take (EngineFlags), and what only the worker
// process knows.
struct EngineOptions : EngineFlags {
  std::string model_dir;
  bool dummy_weights = false;  // --load-format dummy
  // Intra-op CPU threads (process-wide); 0: the machine's hardware threads / tensor-parallel size.
  int num_threads = 0;
  // Testing (the worker's --debug-fail-prompt-chunk-tokens): a step with a prompt chunk of at
  // least this many tokens asks libtorch for an impossible tensor, a real allocation failure
  // (0: never).
  int debug_fail_prompt_chunk_tokens = 0;
};

// An image of a multimodal prompt, as the controller prepared it (vision/image_processor.h):
// resized RGB pixels, and where its tokens are in the prompt (merged patches: height / patch ·
// width / patch / merge² image tokens from `offset`).
struct ImageInput {
  int64_t offset = 0;
  int height = 0, width = 0;
  std::string rgb;  // height · width · 3 bytes
};

struct NewSequence {
  int64_t id = 0;
  int64_t adapter_id = 0;  // 0 = base model
  std::vector<int32_t> prompt;
  SamplingParams sampling;
  int max_tokens = 0;  // 1 .. max_model_len - prompt (common/request_rules.h)
  std::vector<int32_t> stop_token_ids;
  bool return_logprobs = false;
  bool return_logits = false;         // full logits row of every sampled position (tests, debug)
  bool return_prompt_logits = false;  // logits of every prompt position, at the prefill step
  std::vector<ImageInput> images;     // models with a vision tower; in prompt order
};

struct TokenOut {
  int64_t sequence_id = 0;
  int32_t token = 0;
  float logprob = 0;
  bool finished = false;
  std::string finish_reason;         // "stop" | "length" when finished
  std::vector<float> logits;         // [vocab] when requested
  std::vector<float> prompt_logits;  // [prompt_len * vocab] at prefill when requested
  // Speculative decoding, on a sequence's first token of a step: drafts the step verified and
  // how many of them it kept (the step's tokens are the kept drafts, then the target's own).
  int32_t drafted = 0, accepted = 0;
  bool same_step = false;  // a further token of the sequence in this step
};

struct StepOutput {
  // The tokens of each sequence that sampled, in admission order, a sequence's one after the
  // other: one, or with speculative decoding up to 1 + num_speculative_tokens (a sequence whose
  // prompt is still being read in chunks, or recomputed after a preemption, has none).
  std::vector<TokenOut> tokens;
  int sequences = 0;  // sequences with tokens above
  int batch_tokens = 0;
  int preempted = 0;  // sequences preempted by this step (blocks freed, to recompute)
  // Prefix cache: prompt tokens looked up and found in this step.
  int64_t prefix_queries = 0, prefix_hits = 0;
  int64_t kv_free_blocks = 0;  // after the step
  int distinct_adapters = 0;   // adapters in the batch (base model not counted)
  double seconds = 0;
  // The first step of a Steps call that continued sequences left running by the call before
  // it: how long the compute thread waited between the two (the round trip to the controller;
  // -1 otherwise).
  double idle_before_seconds = -1;
  // Sequences removed because they failed alone (an allocation failure in their prompt chunk,
  // with no other sequence changed: the step computed nothing and the next one goes on), with
  // the message for their request.
  std::vector<std::pair<int64_t, std::string>> failed;
};

// What the controller says of the whole batch beside a call's joiners and leavers
// (StepRequest's drop_all, epoch and expected).
struct StepControl {
  bool drop_all = false;  // every running sequence leaves first
  // 0: nothing below is checked. A newer epoch than the engine has seen drops every sequence
  // first; an older one is refused with FAILED_PRECONDITION.
  uint64_t epoch = 0;
  // With an epoch: the sequences running once the call's removes and adds are applied; any other
  // leaves first.
  std::vector<int64_t> expected;
};

struct StageResult {
  AdapterFormat detected_format = AdapterFormat::kDense;
  bool converted_to_2d = false;
  int64_t bytes = 0;
  int rank = 0;
  // read, validate, convert, copy; or swap_in alone when the slot came from the host cache
  std::map<std::string, double> phase_seconds;
  bool from_host_cache = false;
  // The adapter has modules of the MTP head (under `mtp.`): its sequences' drafts are adapted
  // too (otherwise the head drafts for them unadapted).
  bool adapts_draft = false;
};

struct HostCacheStats {
  int adapters = 0;
  int64_t bytes = 0;
  std::vector<int64_t> adapter_ids;  // most recently used first
};

struct EngineInfo {
  int rank = 0, world_size = 1;
  std::string architecture;
  int vocab_size = 0, max_model_len = 0, max_loras = 0, max_lora_rank = 0;
  bool mixed = false;
  AdapterFormat native_format = AdapterFormat::k2D;
  std::vector<std::string> skipped_tensors;
  int running = 0;
  int committed_adapters = 0;
  int staged_adapters = 0;
  std::vector<int64_t> committed_adapter_ids;  // ascending
  HostCacheStats host_cache;
  // The options the engine runs with, as Info reports them to the controller.
  std::string dtype, model_dir, config_fingerprint;
  bool expert_parallel = false, fully_sharded_loras = false;
  int max_num_seqs = 0, max_cpu_loras = 0;
  // The KV cache: block size (tokens), blocks in all and free now; the step's token budget.
  int block_size = 0;
  int64_t num_blocks = 0, free_blocks = 0, bytes_per_block = 0;
  int64_t window_bytes = 0;  // of the KV budget, the sliding-window layers' own blocks
  int max_num_batched_tokens = 0;
  bool prefix_caching = false;     // on and supported by the model
  int num_speculative_tokens = 0;  // MTP drafts per decode step (0: no speculation)
  int prefill_tokens_beside_decodes = 0;
  // The vision tower: loaded, its image pad token, adapters may adapt it.
  bool vision = false;
  int64_t image_token_id = -1;
  bool tower_connector_lora = false;
  // Images whose tower output came from the encoder cache / was computed, since the start.
  int64_t encoder_cache_hits = 0, images_encoded = 0;
};

class Engine {
 public:
  // Loads the model. `comm` (this rank's communicator) must outlive the engine.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Engine>> Create(const EngineOptions& options,
                                                                      Communicator* comm);
  ~Engine();

  // Every call below that touches tensors (Create's load, StageAdapter, AbortAdapter,
  // UnloadAdapter, Step) runs on the engine's one compute thread, whatever thread calls, one at a
  // time (worker/engine/compute_thread.h).
  // Phase 1. Errors change nothing: NOT_FOUND / INVALID_ARGUMENT / RESOURCE_EXHAUSTED (rank or
  // no free slot) / FAILED_PRECONDITION (layout vs wrapper, see MoeModel::SetSlot).
  // ALREADY_EXISTS when the id is staged or committed with a different path. An adapter in the
  // host cache under the same (id, path) is copied from there (no file is read) and leaves it.
  [[nodiscard]] absl::StatusOr<StageResult> StageAdapter(int64_t id, const std::string& path,
                                                         std::optional<AdapterFormat> expected);
  // Phase 2: returns the slot. NOT_FOUND when the id was not staged.
  [[nodiscard]] absl::StatusOr<int> CommitAdapter(int64_t id);
  // Drops a staged adapter; a no-op when unknown.
  [[nodiscard]] absl::Status AbortAdapter(int64_t id);
  // NOT_FOUND when not committed; FAILED_PRECONDITION while a running sequence uses it.
  // `keep_in_host_cache` (a swap-out): the slot's contents go to the host cache first, evicting
  // the least recently used beyond max_cpu_loras; otherwise the id also leaves the host cache.
  // Returns the host cache after the call.
  [[nodiscard]] absl::StatusOr<HostCacheStats> UnloadAdapter(int64_t id,
                                                             bool keep_in_host_cache = false);

  // Removes `remove`, adds `add` (all or nothing: an invalid joiner fails the step before any
  // state changes), runs one forward pass and samples one token per sequence (with speculation,
  // a sequence's drafts are verified in that forward and it may yield several). Finished sequences
  // leave the batch by themselves. The work runs on the engine's one compute thread, whatever
  // thread calls (worker/engine/compute_thread.h).
  [[nodiscard]] absl::StatusOr<StepOutput> Step(const std::vector<NewSequence>& add,
                                                const std::vector<int64_t>& remove);
  // Step(add, remove), then further decode steps of the same batch, back to back on the compute
  // thread, while a sequence runs, up to `steps` in all: one StepOutput per step run. A step
  // that fails ends the call with its error (the earlier steps' tokens are lost: the caller
  // fails the batch, as for one failed step). `before_step` (optional) runs on the compute thread
  // before each step (the worker's --debug-step-delay-ms). `queued` (optional) is called once
  // the call is queued on the compute thread, whose calls run in the order they were queued.
  // After a Steps call the compute thread waits (1 ms at most) for StepsReplied(), which the
  // caller calls once it has built its reply, before it runs the next task. `control`: the
  // controller's word on the whole batch, applied first.
  [[nodiscard]] absl::StatusOr<std::vector<StepOutput>> Steps(
      const std::vector<NewSequence>& add, const std::vector<int64_t>& remove, int steps,
      const std::function<void()>& before_step = nullptr,
      const std::function<void()>& queued = nullptr, const StepControl& control = {});
  void StepsReplied();

  EngineInfo Info() const;
  // Bytes of the LoRA slots in memory now (CPU: taken as adapters are written into slots, about
  // rank / --max-lora-rank of a slot for an adapter's experts; given back when a slot is cleared).
  int64_t SlotResidentBytes() const;

 private:
  struct Impl;
  explicit Engine(std::unique_ptr<Impl> impl);
  absl::StatusOr<StepOutput> StepOnComputeThread(const std::vector<NewSequence>& add,
                                                 const std::vector<int64_t>& remove);
  absl::StatusOr<StageResult> StageOnComputeThread(int64_t id, const std::string& path,
                                                   std::optional<AdapterFormat> expected);
  absl::Status AbortOnComputeThread(int64_t id);
  absl::StatusOr<HostCacheStats> UnloadOnComputeThread(int64_t id, bool keep_in_host_cache);
  std::unique_ptr<Impl> impl_;
};

// "float32" / "bfloat16" are accepted.
[[nodiscard]] absl::Status ValidateDType(const std::string& dtype);
// INVALID_ARGUMENT unless `device` is cpu, cpu-twins, cuda or cuda:N; sets the CUDA device index
// (-1: choose by rank) when given.
[[nodiscard]] absl::Status ParseDevice(const std::string& device, int* cuda_index);

}  // namespace moelora

#endif  // MOELORA_WORKER_ENGINE_ENGINE_H_
