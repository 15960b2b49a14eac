// The controller's core: adapter management over the registry and the worker group, and the
// continuous-batching scheduler. No gRPC server here (service.h maps it), no libtorch.
//
// Adapters: validated here with lora/ before any worker is touched; then staged on every rank
// and committed only when all succeeded (rolled back otherwise). At most --max-loras adapters
// are resident in worker slots; up to --max-cpu-loras are registered. A request for a registered
// adapter that is not resident waits until a slot can be freed (an idle, unpinned adapter is
// swapped out between steps). Admission is strict FIFO, so no request starves.
//
// Thread-safety: all public methods may be called from any thread.
#ifndef MOELORA_CONTROLLER_CONTROLLER_H_
#define MOELORA_CONTROLLER_CONTROLLER_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/status/statusor.h"
#include "controller/metrics.h"
#include "controller/registry.h"
#include "controller/slot_pool.h"
#include "controller/worker_group_interface.h"
#include "lora/model_info.h"
#include "moelora/v1/controller.pb.h"
#include "tokenizer/tokenizer.h"

namespace moelora {

struct ControllerOptions {
  std::string adapter_root;
  int max_loras = 4;
  int max_cpu_loras = 8;
  int max_lora_rank = 16;
  bool mixed = false;
  int max_num_seqs = 256;
  ModelInfo model;  // from --model's config.json: dims for adapter validation
  // The model's tokenizer (null: none; text prompts and stop strings are then refused).
  std::shared_ptr<const tok::Tokenizer> tokenizer;
  // Added to every request's stop tokens unless it sets ignore_eos.
  std::vector<int32_t> eos_token_ids;
};

// One Generate call in flight. The scheduler fills the results; the RPC thread waits on `cv`.
struct GenRequest {
  int64_t seq_id = 0;
  int64_t adapter_id = 0;
  std::string adapter;  // "" = base
  v1::GenerateRequest req;
  uint64_t seed = 0;
  std::chrono::steady_clock::time_point arrival, last_token;
  std::chrono::steady_clock::time_point deadline = std::chrono::steady_clock::time_point::max();
  std::atomic<bool> cancelled{false};
  // Set by the RPC thread when the text reached a stop string: the scheduler then ends the
  // sequence (finish_reason "stop"); tokens generated after it are dropped.
  std::atomic<bool> stop_string{false};
  double tokenize_seconds = 0;

  std::mutex mu;
  std::condition_variable cv;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  bool done = false;
  absl::Status status;
  std::string finish_reason;
  double queue_seconds = 0, ttft_seconds = 0, total_seconds = 0;
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

  [[nodiscard]] absl::StatusOr<v1::Adapter> LoadAdapter(const v1::LoadAdapterRequest& req);
  absl::StatusOr<v1::Adapter> UnloadAdapter(const std::string& name);
  [[nodiscard]] absl::StatusOr<v1::Adapter> GetAdapter(const std::string& name) const;
  std::vector<v1::Adapter> ListAdapters() const;

  // Validates and queues. INVALID_ARGUMENT / NOT_FOUND / UNAVAILABLE.
  [[nodiscard]] absl::StatusOr<std::shared_ptr<GenRequest>> Submit(
      const v1::GenerateRequest& req, std::chrono::steady_clock::time_point deadline);
  // Counts the finished request in moelora_requests_total.
  void RecordRequest(const GenRequest& r, absl::StatusCode code);

  bool serving() const { return group_->serving() && ready_.load(); }
  const tok::Tokenizer* tokenizer() const { return options_.tokenizer.get(); }
  // Wakes the scheduler (a request's stop string was reached).
  void Wake() { cv_.notify_all(); }
  int in_flight() const;

 private:
  struct Entry {
    AdapterRecord record;
    v1::AdapterState state = v1::ADAPTER_STATE_LOADING;
    bool resident = false;
    bool host_cached = false;  // in the workers' host cache (rank 0's word), while not resident
    int active = 0;            // queued or running requests
    std::chrono::steady_clock::time_point last_used;
  };
  v1::Adapter ToProto(const Entry& e) const;
  // On failure *clean says whether every rank is back to not holding it (else its slot leaked).
  [[nodiscard]] absl::Status StageAndCommit(const AdapterRecord& r, bool* clean);
  // Counts the workers' committed adapters again and retries unloading the ones the controller
  // does not hold (scheduler thread, mu_ NOT held). Runs after any failed unload or rollback.
  void Reconcile();
  // Sends a released slot's unload to the workers and ends the release (mu_ NOT held);
  // `keep_in_host_cache` for a swap-out.
  void ReleaseSlot(int64_t id, bool keep_in_host_cache);
  // The host tier from rank 0's host cache (mu_ held).
  void SetHostCached(const std::vector<int64_t>& ids);
  // An unloaded adapter that was not in a slot: drop it from the workers' host caches (mu_ NOT
  // held).
  void ForgetHostCached(int64_t id);
  std::shared_ptr<std::mutex> NameLock(const std::string& name);
  void Loop();
  void Finish(const std::shared_ptr<GenRequest>& r, absl::Status s, const std::string& reason);
  void FailAll(const absl::Status& s);
  bool TrySwapIn(const std::string& name);  // scheduler thread, mu_ NOT held
  void UpdateAdapterGauges();               // mu_ held
  void UpdateLoraInfo();                    // mu_ held: the lora_requests_info series

  ControllerOptions options_;
  Registry* registry_;
  WorkerGroupInterface* group_;
  ControllerMetrics* metrics_;

  mutable std::mutex mu_;  // adapters_, resident_, queue state
  std::map<std::string, Entry> adapters_;
  SlotPool slots_;                          // worker slots: held, releasing, leaked, free
  std::atomic<bool> reconcile_{false};      // a failed unload or rollback: Reconcile() next loop
  int64_t step_no_ = 0;                     // scheduler thread only
  std::set<std::string> resident_series_;   // mu_: adapters with a moelora_adapter_resident series
  prometheus::Gauge* lora_info_ = nullptr;  // mu_: the current lora_requests_info series
  std::string lora_info_key_;               // mu_: its labels
  std::map<std::string, std::shared_ptr<std::mutex>> name_locks_;
  std::deque<std::shared_ptr<GenRequest>> pending_;
  std::map<int64_t, std::shared_ptr<GenRequest>> running_;
  int64_t next_seq_ = 1;
  std::condition_variable cv_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> ready_{false};
  std::thread loop_;
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_CONTROLLER_H_
