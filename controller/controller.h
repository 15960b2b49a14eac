// The controller's core, as the service sees it: the adapter manager (adapter_manager.h), the
// scheduler (scheduler.h) and request validation (request_validation.h) over one worker group.
// No gRPC server here (service.h maps it), no libtorch.
//
// Thread-safety: all public methods may be called from any thread.
#ifndef MOELORA_CONTROLLER_CONTROLLER_H_
#define MOELORA_CONTROLLER_CONTROLLER_H_

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/work_pool.h"
#include "controller/adapter_manager.h"
#include "controller/gen_request.h"
#include "controller/metrics.h"
#include "controller/registry.h"
#include "controller/request_validation.h"
#include "controller/scheduler.h"
#include "controller/worker_group_interface.h"
#include "moelora/v1/controller.pb.h"
#include "schema/model_info.h"
#include "tokenizer/tokenizer.h"
#include "vision/image_processor.h"

namespace moelora {

struct ControllerOptions {
  std::string adapter_root;
  // --adapter-resolver=filesystem: a request may name an unregistered adapter by its directory
  // directly under adapter_root; it is loaded (validated, registered) on first use.
  bool resolve_from_filesystem = false;
  int max_loras = 4;
  int max_cpu_loras = 8;
  int max_registered_adapters = 100000;
  int max_lora_rank = 16;
  bool mixed = false;
  int max_num_seqs = 256;
  // An idle engine's wait for a burst to gather into one first step (Scheduler): a quiet gap,
  // and its cap after the first arrival.
  int batch_window_ms = 0;
  int batch_window_max_ms = 0;
  // Decode steps per worker call while no request waits to join (Scheduler).
  int decode_steps = 1;
  // Send a decode call before the one in flight ends, to run right after it (Scheduler).
  bool call_ahead = false;
  // Requests waiting to be admitted at most; beyond it RESOURCE_EXHAUSTED at once (0: no bound).
  int max_queued_requests = 0;
  // How long a request waiting for its adapter's slot may be passed over (Scheduler).
  int max_bypass_ms = 2000;
  // A request ends with DEADLINE_EXCEEDED this long after it arrived, whatever its client's
  // deadline (0: no bound).
  int request_timeout_s = 0;
  ModelInfo model;  // from --model's config.json: dims for adapter validation
  // The model's tokenizer (null: none; text prompts and stop strings are then refused).
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  // The model's image processor (preprocessor_config.json; null: images refused) and
  // --limit-mm-per-prompt's image count.
  std::shared_ptr<const vision::ImageProcessorConfig> image_processor;
  int limit_images_per_prompt = 999;
  // What one request may carry (both APIs).
  RequestCaps caps;
  // Requests being prepared (parsed, rendered, tokenized, images decoded, adapters resolved) at
  // once, and waiting to be: Prepare's pool, apart from the threads that write answers.
  int prepare_threads = 2;
  int max_preparing = 256;
  // Added to every request's stop tokens unless it sets ignore_eos.
  std::vector<int32_t> eos_token_ids;
  // The time the scheduler and the adapter manager decide by (common/clock.h); tests pass a
  // simulated one.
  Clock* clock = Clock::Real();
};

class Controller {
 public:
  Controller(ControllerOptions options, Registry* registry, WorkerGroupInterface* group,
             ControllerMetrics* metrics);
  ~Controller();

  // Hooks for the worker group.
  [[nodiscard]] absl::Status OnGroupReady();
  void OnGroupDown(const std::string& why);

  void Start();  // scheduler thread
  void Stop();   // fails what is still queued or running with UNAVAILABLE

  [[nodiscard]] absl::StatusOr<v1::Adapter> LoadAdapter(const v1::LoadAdapterRequest& req) {
    return adapters_.Load(req);
  }
  [[nodiscard]] absl::StatusOr<v1::Adapter> UnloadAdapter(const std::string& name) {
    return adapters_.Unload(name);
  }
  [[nodiscard]] absl::StatusOr<v1::Adapter> GetAdapter(const std::string& name) const {
    return adapters_.Get(name);
  }
  std::vector<v1::Adapter> ListAdapters() const { return adapters_.List(); }

  // Runs `fn` (a request's preparation: parsing, templates, tokenizing, images, Submit with the
  // resolver's adapter loads) on the preparation threads, at most prepare_threads at once, so that
  // no heavy request delays the threads that write other requests' tokens. RESOURCE_EXHAUSTED (and
  // `fn` dropped) when max_preparing wait already.
  [[nodiscard]] absl::Status Prepare(std::function<void()> fn);

  // Validates and queues. INVALID_ARGUMENT / NOT_FOUND / UNAVAILABLE.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<GenRequest>> Submit(
      const v1::GenerateRequest& req, std::chrono::steady_clock::time_point deadline);
  // Counts a finished request in moelora_requests_total: `admitted`, one Submit took (its adapter
  // was registered then); else one it refused, whose adapter name is counted under
  // "unregistered" unless an adapter has it.
  void RecordRequest(const std::string& adapter, bool admitted, absl::StatusCode code);

  bool serving() const { return group_->serving() && ready_.load(); }
  const tok::Tokenizer* tokenizer() const { return options_.tokenizer.get(); }
  const RequestCaps& caps() const { return options_.caps; }
  int limit_images_per_prompt() const { return options_.limit_images_per_prompt; }
  // The workers' max_model_len (0 until the group has served once).
  int max_model_len() const { return group_->info().max_model_len(); }
  // Wakes the scheduler (a request's stop string was reached).
  void Wake() { scheduler_.Wake(); }
  int in_flight() const { return scheduler_.in_flight(); }

 private:
  const ControllerOptions options_;
  WorkerGroupInterface* const group_;
  ControllerMetrics* const metrics_;
  std::atomic<bool> ready_{false};
  AdapterManager adapters_;
  Scheduler scheduler_;  // after adapters_: it uses them until it stops
  WorkPool prepare_;     // last: its tasks use the rest until it is joined
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_CONTROLLER_H_
