// The controller's view of its tensor-parallel worker group (TGI's router/shard split): every
// RPC goes to all ranks at once; rank 0's reply is the answer.
//
// Local mode (default) spawns the N moelora-worker processes (they die with the controller:
// PR_SET_PDEATHSIG) and, when any rank dies, restarts the whole group with a fresh rendezvous
// directory (a TP group cannot re-form around one new rank). Connect mode (--workers) only
// watches the given addresses. Either way a monitor thread polls Health; when every rank is
// ready it calls the on-ready hook (the controller reloads its adapters there) and only then
// reports serving.
//
// Thread-safety: all methods may be called from any thread.
#ifndef MOELORA_CONTROLLER_WORKER_GROUP_H_
#define MOELORA_CONTROLLER_WORKER_GROUP_H_

#include <sys/types.h>

#include <atomic>
#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"
#include "controller/worker_group_interface.h"
#include "controller/worker_settings.h"
#include "grpcpp/security/credentials.h"
#include "moelora/v1/worker.grpc.pb.h"

namespace moelora {

struct WorkerGroupOptions {
  std::string worker_bin;                 // local mode: the moelora-worker executable
  std::string model;                      // local mode: --model
  int tp = 1;                             // ranks
  std::vector<std::string> addresses;     // connect mode when not empty (one per rank, in order)
  std::vector<std::string> worker_flags;  // passed to spawned workers (engine flags)
  std::string run_dir;                    // local mode: port files, logs, rendezvous dirs
  std::chrono::milliseconds step_timeout{60000};
  std::chrono::milliseconds load_timeout{300000};
  std::chrono::milliseconds health_period{200};
  int dist_timeout_s = 120;  // local mode: the workers' --dist-timeout-s (rendezvous, collectives)
  // Checked against every rank's Info before the group serves (CheckWorkerSettings); a
  // disagreement keeps it out of service, named by not_serving_reason().
  std::optional<WorkerSettings> expected;
  // The channels' credentials (null: plaintext).
  std::shared_ptr<grpc::ChannelCredentials> credentials;
};

class WorkerGroup final : public WorkerGroupInterface {
 public:
  explicit WorkerGroup(WorkerGroupOptions options);
  ~WorkerGroup() override;

  // Called (on the monitor thread) each time the group becomes ready, before it serves.
  // A non-OK result keeps the group out of service and is retried on the next poll.
  void SetOnReady(std::function<absl::Status()> hook);
  // Called when a rank goes down (the group stops serving at once).
  void SetOnDown(std::function<void(const std::string& why)> hook);
  void Start();
  void Stop();  // stops the monitor and (local mode) terminates the workers

  bool serving() const override { return serving_.load(); }
  void Revalidate(const std::string& why) override;
  std::string not_serving_reason() const override;
  // Rank 0's Info from the last time the group became ready (empty before).
  v1::WorkerInfoResponse info() const override;
  int size() const { return options_.tp; }
  std::vector<bool> RanksUp() const;
  int restarts() const { return restarts_.load(); }
  // Waits until serving or the timeout passes.
  bool WaitServing(std::chrono::milliseconds timeout) const;
  // Local mode: worker process ids (tests kill them).
  std::vector<pid_t> pids() const;

  // All-rank RPCs. UNAVAILABLE when the group is not ready. Stage rolls back (Abort) on the ranks
  // that succeeded when any fails.
  [[nodiscard]] absl::StatusOr<v1::StageAdapterResponse> StageAll(
      const v1::StageAdapterRequest& req) override;
  [[nodiscard]] absl::Status CommitAll(int64_t adapter_id) override;
  [[nodiscard]] absl::Status AbortAll(int64_t adapter_id) override;
  // OK when every rank freed it (a rank that never had it counts as freed).
  [[nodiscard]] absl::StatusOr<std::vector<int64_t>> UnloadAll(int64_t adapter_id,
                                                               bool keep_in_host_cache) override;
  // The adapters committed on any rank (their Info), ascending.
  [[nodiscard]] absl::StatusOr<std::vector<int64_t>> CommittedAdapterIds() override;
  // Returns as soon as any rank fails (the others are cancelled) or when all have answered.
  [[nodiscard]] absl::StatusOr<v1::StepResponse> StepAll(const v1::StepRequest& req) override;
  // StepAll without a thread: the RPCs go out now, their answers come in through the result on
  // the caller's thread; Cancel cancels them. A call sent ahead (after_step) gets the timeout of
  // twice its steps: it may wait for a call of as many steps first.
  [[nodiscard]] std::unique_ptr<PendingStep> StartStepAll(const v1::StepRequest& req) override;

  template <typename Resp>
  class AllRankCall;
  using StepCall = AllRankCall<v1::StepResponse>;

 private:
  struct Rank;
  // The ranks' stubs; UNAVAILABLE when the group is not ready or a rank is not connected.
  absl::Status Stubs(std::vector<std::shared_ptr<v1::Worker::Stub>>* stubs) const;
  void Monitor();
  void SpawnAll();
  void KillAll();
  // Creates stubs for ranks that have none yet; false while a port file is missing.
  bool ConnectAll();
  template <typename Req, typename Resp>
  [[nodiscard]] absl::StatusOr<std::vector<Resp>> CallAll(
      std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> (v1::Worker::Stub::*prepare)(
          grpc::ClientContext*, const Req&, grpc::CompletionQueue*),
      const Req& req, std::chrono::milliseconds timeout, bool fail_fast, bool not_found_ok = false);

  WorkerGroupOptions options_;
  // Spawned workers' secret (proto/group_secret.h), sent with every call; empty in --workers
  // mode (mutual TLS there).
  const std::string secret_;
  void AddSecret(grpc::ClientContext* ctx) const;
  mutable Mutex mu_;
  std::vector<std::shared_ptr<Rank>> ranks_ ABSL_GUARDED_BY(mu_);
  v1::WorkerInfoResponse info_ ABSL_GUARDED_BY(mu_);
  std::string not_serving_reason_ ABSL_GUARDED_BY(mu_);  // a settings mismatch, or empty
  std::function<absl::Status()> on_ready_ ABSL_GUARDED_BY(mu_);
  std::function<void(const std::string&)> on_down_ ABSL_GUARDED_BY(mu_);
  std::atomic<bool> serving_{false};
  // Out of service after a failed step (Revalidate) until the monitor finds every rank ready
  // again; a rank found down meanwhile takes the group down as if it had been serving.
  std::atomic<bool> revalidating_{false};
  std::atomic<bool> stop_{false};
  std::atomic<int> restarts_{0};
  int epoch_ = 0;                   // the constructor, then the monitor thread only
  int failures_since_serving_ = 0;  // monitor thread only
  std::thread monitor_;
  // WaitServing waits on wait_cv_ for serving_ (an atomic: the monitor signals after it changes).
  mutable Mutex wait_mu_;
  mutable CondVar wait_cv_;
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_WORKER_GROUP_H_
