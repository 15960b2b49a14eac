// The continuous-batching scheduler: the pending FIFO and the running sequences, and its thread:
// deferred unloads → expire / cancel / stop strings → admission in arrival order (a request whose
// adapter is in no slot has it swapped in beside the steps and is passed over meanwhile by
// requests whose adapters are resident, for --max-bypass-ms at most, so none starves) → one
// StepAll → tokens to the requests; a failed step fails the joiners (a refused joiner) or every
// running request (a dead rank).
//
// With --call-ahead, while nothing waits to join or leave, the next decode call goes out shortly
// before the one in flight ends (StepRequest.after_step): the workers run it without waiting for
// the round trip, and the pass that takes its outcome skips admission.
//
// Thread-safety: all public methods may be called from any thread. Lock order: the scheduler's
// mutex before the adapter manager's and before a request's (AddTokens, num_tokens); a request's
// mutex is never held while taking the others.
#ifndef MOELORA_CONTROLLER_SCHEDULER_H_
#define MOELORA_CONTROLLER_SCHEDULER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/status.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "common/work_pool.h"
#include "controller/adapter_manager.h"
#include "controller/gen_request.h"
#include "controller/metrics.h"
#include "controller/worker_group_interface.h"

namespace moelora {

class Scheduler {
 public:
  // `serving`: whether steps may run (the group is ready and its adapters reloaded).
  // `batch_window`: an idle engine starts its first step once no request has arrived for this
  // long (0: at once), and at the latest `batch_window_max` after the first of them arrived.
  // `decode_steps`: steps per worker call (StepRequest.decode_steps) while no request is queued
  // and none joins; 1 otherwise. `call_ahead`: send such a call's successor before it ends.
  // `clock`: every time the scheduler reads or waits for (arrivals, windows, deadlines, the
  // call-ahead lead). `max_queued`: requests waiting to be admitted at most (0: no bound).
  // `max_bypass`: how long a request whose adapter waits for a slot may be passed over by later
  // requests whose adapters are resident (then nothing behind it is admitted until it runs).
  Scheduler(int max_num_seqs, int max_loras, AdapterManager* adapters, WorkerGroupInterface* group,
            ControllerMetrics* metrics, std::function<bool()> serving,
            std::chrono::milliseconds batch_window = std::chrono::milliseconds(0),
            std::chrono::milliseconds batch_window_max = std::chrono::milliseconds(0),
            int decode_steps = 1, bool call_ahead = false, Clock* clock = Clock::Real(),
            int max_queued = 0,
            std::chrono::milliseconds max_bypass = std::chrono::milliseconds(2000));
  ~Scheduler();

  void Start();
  // Stops the thread and fails what is still queued or running with `why`.
  void Stop(const absl::Status& why);
  // Queues a validated request (its adapter already acquired); assigns its sequence id.
  // RESOURCE_EXHAUSTED, with nothing queued, when `max_queued` requests wait already.
  [[nodiscard]] absl::Status Enqueue(const std::shared_ptr<GenRequest>& r) ABSL_LOCKS_EXCLUDED(mu_);
  // Fails every queued and running request with `s`.
  void FailAll(const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu_);
  int in_flight() const ABSL_LOCKS_EXCLUDED(mu_);
  // Something changed (a stop string, an unload, the group): look again now.
  void Wake() ABSL_LOCKS_EXCLUDED(mu_);
  // The group is ready (again, its adapters reloaded): steps may run, and the next goes out even
  // with nothing to run, so the workers drop every sequence this controller does not expect.
  void GroupReady() {
    awaiting_ready_ = false;
    sweep_ = true;
  }

 private:
  // One pass of the loop: what the plan decided, the call that carries it, and its outcome.
  struct Pass {
    v1::StepRequest step;
    std::vector<std::shared_ptr<GenRequest>> admitted;  // joiners of this step
    std::vector<std::pair<std::shared_ptr<GenRequest>, absl::Status>> ended;  // before the step
    std::vector<std::string> swap;  // adapters of waiting requests to swap in, oldest first
    std::set<std::string> in_use;   // adapters of running sequences (never swapped out)
    bool queued = false;            // requests still wait after admission
  };
  enum class Next { kStep, kAgain, kStop };

  // The loop: plan → send → deliver, or recover from a failed call.
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);

  // Plan (scheduler_plan.cc): the next step's joiners and leavers, the swap-ins to start.
  // kAgain: nothing to send yet (the loop looks again); kStop: stopping.
  Next Plan(Pass* pass) ABSL_LOCKS_EXCLUDED(mu_);
  // Waits for work, and while the engine is idle for the batch window to close.
  Next WaitForWork() ABSL_LOCKS_EXCLUDED(mu_);
  // Running and queued requests whose deadline passed, cancelled, or stopped by a stop string.
  void Expire(Clock::TimePoint now, Pass* pass) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Admission in arrival order while the KV cache and the adapters' slots allow.
  void Admit(Clock::TimePoint now, Pass* pass) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // The joiners' SequenceSpecs in the step; they run from now on.
  void AddJoiners(Pass* pass) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  void StartSwapIns(const Pass& pass) ABSL_LOCKS_EXCLUDED(mu_);

  // Send (scheduler_send.cc): the step call, with --call-ahead its successor sent before it
  // ends. `call`: a call sent ahead by the previous pass, which carries this pass's step.
  absl::StatusOr<v1::StepResponse> Send(const v1::StepRequest& step,
                                        std::unique_ptr<PendingStep> call);
  // Whether a decode call may go out ahead of the one in flight (of `steps` steps): serving,
  // nothing queued or woken for, no running request expired, cancelled or stopped by a stop
  // string, and one of them still to run after the call in flight.
  bool SendAheadAllowed(int steps) ABSL_LOCKS_EXCLUDED(mu_);
  // The call sent ahead comes to nothing: cancelled while it waits on the workers.
  void CancelAhead();
  // StepRequest.epoch, and the running sequences as `expected` (takes mu_).
  void SetEpochAndExpected(v1::StepRequest* step) ABSL_LOCKS_EXCLUDED(mu_);

  // Deliver (scheduler_deliver.cc): the step's figures into the metrics, and its tokens to
  // their requests; finished and failed requests end.
  void RecordStep(const v1::StepRequest& step, const v1::StepResponse& resp, bool sent_ahead);
  void Deliver(const v1::StepResponse& resp) ABSL_LOCKS_EXCLUDED(mu_);

  // Recover (scheduler_deliver.cc): a failed call. A refused joiner fails the joiners alone;
  // anything else fails every running request and waits for the group to be checked again.
  void Recover(const Pass& pass, const absl::Status& error) ABSL_LOCKS_EXCLUDED(mu_);

  // KV cache blocks a request holds on the workers once admitted (prompt, tokens so far and the
  // next one); 0 while the block size is not known.
  int64_t BlocksHeld(const GenRequest& r) const;
  // Ends a request and releases its adapter.
  void Finish(const std::shared_ptr<GenRequest>& r, absl::Status s, const std::string& reason)
      ABSL_LOCKS_EXCLUDED(mu_);
  void UpdateLoraInfo() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);  // the lora_requests_info series
  static double Seconds(Clock::Duration d) { return std::chrono::duration<double>(d).count(); }

  const int max_num_seqs_;
  const std::chrono::milliseconds batch_window_;
  const std::chrono::milliseconds batch_window_max_;  // at least batch_window_
  const std::chrono::milliseconds max_bypass_;
  const int decode_steps_;
  const bool call_ahead_;
  Clock* const clock_;
  const int max_queued_;
  const int max_loras_;
  // The workers' KV cache, from their Info when requests wait (the loop thread only).
  int64_t kv_blocks_ = 0;
  int64_t kv_block_size_ = 0;
  AdapterManager* const adapters_;
  WorkerGroupInterface* const group_;
  ControllerMetrics* const metrics_;
  const std::function<bool()> serving_;

  mutable Mutex mu_;
  std::deque<std::shared_ptr<GenRequest>> pending_ ABSL_GUARDED_BY(mu_);
  std::map<int64_t, std::shared_ptr<GenRequest>> running_ ABSL_GUARDED_BY(mu_);
  int64_t next_seq_ ABSL_GUARDED_BY(mu_) = 1;
  CondVar cv_;                              // the loop waits on it for work
  bool wake_ ABSL_GUARDED_BY(mu_) = false;  // Wake() since the loop last looked
  prometheus::Gauge* lora_info_ ABSL_GUARDED_BY(mu_) = nullptr;  // the current series
  std::string lora_info_key_ ABSL_GUARDED_BY(mu_);               // its labels
  int64_t step_no_ = 0;                                          // the loop's thread only
  // The loop's thread only: when the last step call returned, and whether sequences were left
  // running after it (then the time to the next call is the scheduler's gap).
  std::chrono::steady_clock::time_point last_return_;
  bool ran_on_ = false;
  // The loop's thread only: the decode call sent ahead and its request; the last worker step's
  // seconds and a running mean of the calls' overhead (when to send the next one ahead); when
  // the call in flight started on the workers.
  std::unique_ptr<PendingStep> ahead_;
  v1::StepRequest ahead_req_;
  std::chrono::steady_clock::time_point ahead_start_;  // when it should start on the workers
  std::chrono::steady_clock::time_point call_start_;
  double step_seconds_ = 0;
  double call_overhead_seconds_ = 0;
  // The part of the lead that does not scale with the measured overhead (seconds).
  static constexpr double kAheadLeadSeconds = 0.001;
  // Swap-ins under way (adapter names; FinishSwapIn on swap_pool_), kMaxSwapsInFlight at most:
  // the workers read one adapter while the next one's RPCs go out.
  std::set<std::string> swapping_ ABSL_GUARDED_BY(mu_);
  static constexpr int kMaxSwapsInFlight = 2;
  // A swap-in ended: its requests fail with `s` when it failed; the loop looks again.
  void SwapDone(const std::string& name, const absl::Status& s) ABSL_LOCKS_EXCLUDED(mu_);
  std::atomic<bool> stop_{false};
  // The next step goes out even with nothing to run (at start and after GroupReady), so that
  // the workers drop the sequences no request owns (StepRequest.expected) without waiting for
  // traffic.
  std::atomic<bool> sweep_{true};
  // A failed step asked the group to re-check its ranks: no step until GroupReady.
  std::atomic<bool> awaiting_ready_{false};
  // This controller's start in microseconds since the Unix epoch (StepRequest.epoch): workers
  // refuse calls from an older controller and drop what one left when a newer one calls.
  const uint64_t epoch_ =
      static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::microseconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count());
  std::thread loop_;
  std::unique_ptr<WorkPool> swap_pool_;  // created by Start, emptied and joined by Stop
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_SCHEDULER_H_
