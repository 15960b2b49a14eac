// moelora.v1.Worker over an Engine. The server starts before the model is loaded (Health says
// why it is not ready yet); every other RPC is UNAVAILABLE until then.
// Thread-safety: gRPC calls handlers from many threads; the Engine serialises what must be.
#ifndef MOELORA_WORKER_SERVICE_H_
#define MOELORA_WORKER_SERVICE_H_

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "moelora/v1/worker.grpc.pb.h"
#include "worker/comm/communicator.h"
#include "worker/engine/engine.h"
#include "worker/metrics.h"

namespace moelora {

class WorkerService final : public moelora::v1::Worker::Service {
 public:
  WorkerService(WorkerMetrics* metrics, std::string device)
      : metrics_(metrics), device_(std::move(device)) {}

  // Called once the model is loaded; the service owns both from then on.
  void SetReady(std::unique_ptr<Communicator> comm, std::unique_ptr<Engine> engine);
  void SetLoadingDetail(const std::string& detail);
  void set_step_delay(std::chrono::milliseconds d) { step_delay_ = d; }
  // The only directory StageAdapter reads from (--adapter-root; empty: none, every stage
  // refused). Set before serving.
  void set_adapter_root(std::string root) { adapter_root_ = std::move(root); }
  // Calls other than Health must carry this secret (proto/group_secret.h; empty: none asked).
  // Set before serving.
  void set_group_secret(std::string secret) { group_secret_ = std::move(secret); }

  grpc::Status StageAdapter(grpc::ServerContext*, const v1::StageAdapterRequest*,
                            v1::StageAdapterResponse*) override;
  grpc::Status CommitAdapter(grpc::ServerContext*, const v1::CommitAdapterRequest*,
                             v1::CommitAdapterResponse*) override;
  grpc::Status AbortAdapter(grpc::ServerContext*, const v1::AbortAdapterRequest*,
                            v1::AbortAdapterResponse*) override;
  grpc::Status UnloadAdapter(grpc::ServerContext*, const v1::WorkerUnloadAdapterRequest*,
                             v1::WorkerUnloadAdapterResponse*) override;
  grpc::Status Step(grpc::ServerContext*, const v1::StepRequest*, v1::StepResponse*) override;
  grpc::Status Health(grpc::ServerContext*, const v1::WorkerHealthRequest*,
                      v1::WorkerHealthResponse*) override;
  grpc::Status Info(grpc::ServerContext*, const v1::WorkerInfoRequest*,
                    v1::WorkerInfoResponse*) override;

 private:
  Engine* engine() const { return engine_.load(std::memory_order_acquire); }
  grpc::Status NotReady() const;
  // OK when no secret is asked or the call carries it; else UNAUTHENTICATED.
  grpc::Status CheckCaller(const grpc::ServerContext* ctx) const;
  void UpdateAdapterGauges();

  WorkerMetrics* metrics_;
  std::string device_;
  std::unique_ptr<Communicator> comm_;
  std::unique_ptr<Engine> owned_engine_;
  std::atomic<Engine*> engine_{nullptr};
  std::chrono::milliseconds step_delay_{0};
  std::string adapter_root_;
  std::string group_secret_;
  // The `step` of the last Step call that queued its work on the compute thread (or returned
  // without): a call sent ahead (after_step) waits for its predecessor's, then queues behind it.
  std::mutex order_mu_;
  std::condition_variable order_cv_;
  int64_t passed_step_ = 0;
  mutable std::mutex detail_mu_;
  std::string detail_ = "loading the model";
};

}  // namespace moelora

#endif  // MOELORA_WORKER_SERVICE_H_
