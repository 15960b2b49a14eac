// What the controller needs of its worker group: the all-rank RPCs and the group's state.
// WorkerGroup (worker_group.h) implements it over the generated stubs; unit tests implement it
// with a fake (tests/unit/controller/fake_worker_group.h).
//
// Thread-safety: implementations must allow calls from any thread.
#ifndef MOELORA_CONTROLLER_WORKER_GROUP_INTERFACE_H_
#define MOELORA_CONTROLLER_WORKER_GROUP_INTERFACE_H_

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "moelora/v1/worker.pb.h"

namespace moelora {

// A step call in flight (WorkerGroupInterface::StartStepAll). Thread-compatible: one owner.
class PendingStep {
 public:
  virtual ~PendingStep() = default;
  // Whether the outcome is there by `until` (waits until then at most).
  virtual bool WaitUntil(std::chrono::steady_clock::time_point until) = 0;
  // The outcome (waits for it); once.
  [[nodiscard]] virtual absl::StatusOr<v1::StepResponse> Get() = 0;
  // Asks the ranks to give the call up: one sent ahead (after_step) and still waiting for its
  // predecessor ends CANCELLED without stepping; one already stepping runs to its end.
  virtual void Cancel() = 0;
};

class WorkerGroupInterface {
 public:
  virtual ~WorkerGroupInterface() = default;

  virtual bool serving() const = 0;
  // Why the group does not serve when the reason is not just "not ready yet" (a worker whose
  // settings disagree with the controller's); empty otherwise.
  virtual std::string not_serving_reason() const { return {}; }
  // A step failed (a rank died, timed out or could not run it): stop serving until every rank
  // answers health and Info again and the on-ready hook ran (which makes the ranks drop every
  // sequence). Queued requests wait meanwhile.
  virtual void Revalidate(const std::string& why) = 0;
  // Rank 0's Info from the last time the group became ready.
  virtual v1::WorkerInfoResponse info() const = 0;
  // Stages on every rank; rolls back (Abort) the ranks that staged it when any fails.
  [[nodiscard]] virtual absl::StatusOr<v1::StageAdapterResponse> StageAll(
      const v1::StageAdapterRequest& req) = 0;
  [[nodiscard]] virtual absl::Status CommitAll(int64_t adapter_id) = 0;
  [[nodiscard]] virtual absl::Status AbortAll(int64_t adapter_id) = 0;
  // OK when every rank freed it (a rank that never had it counts as freed). `keep_in_host_cache`:
  // a swap-out, the ranks keep its slot contents in their host caches. Returns rank 0's host
  // cache after the call (adapter ids, most recently used first).
  [[nodiscard]] virtual absl::StatusOr<std::vector<int64_t>> UnloadAll(int64_t adapter_id,
                                                                       bool keep_in_host_cache) = 0;
  // The adapters committed on any rank, ascending.
  [[nodiscard]] virtual absl::StatusOr<std::vector<int64_t>> CommittedAdapterIds() = 0;
  [[nodiscard]] virtual absl::StatusOr<v1::StepResponse> StepAll(const v1::StepRequest& req) = 0;
  // StepAll without waiting: the call goes out now and its outcome comes through the result.
  // This default runs StepAll on a thread of its own and cannot cancel.
  [[nodiscard]] virtual std::unique_ptr<PendingStep> StartStepAll(const v1::StepRequest& req);
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_WORKER_GROUP_INTERFACE_H_
