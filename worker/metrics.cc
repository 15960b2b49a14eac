#include "worker/metrics.h"

#include <mutex>

namespace moelora {
namespace {
prometheus::Histogram::BucketBoundaries SecondsBuckets() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}
}  // namespace

WorkerMetrics::WorkerMetrics(int rank) : registry_(std::make_shared<prometheus::Registry>()) {
  const std::map<std::string, std::string> rl = {{"rank", std::to_string(rank)}};
  load_seconds_ = &prometheus::BuildHistogram()
                       .Name("moelora_adapter_load_seconds")
                       .Help(
                           "Adapter load time on this worker by phase (read, validate, "
                           "convert, copy) and in total (phase=\"total\"); a swap-in from the "
                           "host cache: phase=\"swap_in\"")
                       .Labels(rl)
                       .Register(*registry_);
  load_failures_ = &prometheus::BuildCounter()
                        .Name("moelora_adapter_load_failures_total")
                        .Help("Adapter stages refused on this worker, by reason (status code)")
                        .Labels(rl)
                        .Register(*registry_);
  adapters_ = &prometheus::BuildGauge()
                   .Name("moelora_adapters")
                   .Help("Adapters held by this worker, by state (staged, loaded, host_cached)")
                   .Labels(rl)
                   .Register(*registry_);
  slot_bytes_ = &prometheus::BuildGauge()
                     .Name("moelora_lora_slot_bytes")
                     .Help(
                         "Bytes of this worker's LoRA slots in memory (on the CPU taken as "
                         "adapters are written, about their rank's share of a slot)")
                     .Labels(rl)
                     .Register(*registry_)
                     .Add({});
  host_cache_bytes_ = &prometheus::BuildGauge()
                           .Name("moelora_adapter_host_cache_bytes")
                           .Help(
                               "Bytes of swapped-out adapters kept in host memory "
                               "(--max-cpu-loras), converted and TP-sliced")
                           .Labels(rl)
                           .Register(*registry_)
                           .Add({});
  step_seconds_ = &prometheus::BuildHistogram()
                       .Name("moelora_step_seconds")
                       .Help("Wall time of one continuous-batching step (forward + sampling)")
                       .Labels(rl)
                       .Register(*registry_)
                       .Add({}, SecondsBuckets());
  step_idle_seconds_ =
      &prometheus::BuildHistogram()
           .Name("moelora_step_idle_seconds")
           .Help(
               "Time the compute thread waited between two step calls while sequences ran "
               "(the round trip to the controller; --call-ahead hides it)")
           .Labels(rl)
           .Register(*registry_)
           .Add({}, prometheus::Histogram::BucketBoundaries{0.00005, 0.0001, 0.0002, 0.0005, 0.001,
                                                            0.002, 0.005, 0.01, 0.05, 0.5});
  batch_size_ = &prometheus::BuildHistogram()
                     .Name("moelora_batch_size")
                     .Help("Tokens in one step's forward pass")
                     .Labels(rl)
                     .Register(*registry_)
                     .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128,
                                                                      256, 512, 1024, 4096});
  batch_distinct_ = &prometheus::BuildHistogram()
                         .Name("moelora_batch_distinct_adapters")
                         .Help("Distinct adapters in one step's batch (base model not counted)")
                         .Labels(rl)
                         .Register(*registry_)
                         .Add({}, prometheus::Histogram::BucketBoundaries{0, 1, 2, 4, 8, 16, 32});
  generated_ = &prometheus::BuildCounter()
                    .Name("moelora_generated_tokens_total")
                    .Help("Tokens sampled on this worker")
                    .Labels(rl)
                    .Register(*registry_)
                    .Add({});
  running_ = &prometheus::BuildGauge()
                  .Name("moelora_running_sequences")
                  .Help("Sequences in the running batch")
                  .Labels(rl)
                  .Register(*registry_)
                  .Add({});
  kv_usage_ = &prometheus::BuildGauge()
                   .Name("moelora_kv_cache_usage_ratio")
                   .Help("Fraction of the KV cache's blocks in use (0..1)")
                   .Labels(rl)
                   .Register(*registry_)
                   .Add({});
  kv_info_ = &prometheus::BuildGauge()
                  .Name("moelora_kv_cache_config_info")
                  .Help("The KV cache's block size and block count, as labels (value 1)")
                  .Labels(rl)
                  .Register(*registry_);
  preemptions_ = &prometheus::BuildCounter()
                      .Name("moelora_preemptions_total")
                      .Help("Sequences preempted (KV blocks freed, recomputed later)")
                      .Labels(rl)
                      .Register(*registry_)
                      .Add({});
  prefix_queries_ = &prometheus::BuildCounter()
                         .Name("moelora_prefix_cache_queries_total")
                         .Help("Prompt tokens looked up in the prefix cache")
                         .Labels(rl)
                         .Register(*registry_)
                         .Add({});
  prefix_hits_ = &prometheus::BuildCounter()
                      .Name("moelora_prefix_cache_hits_total")
                      .Help("Prompt tokens found in the prefix cache (not computed again)")
                      .Labels(rl)
                      .Register(*registry_)
                      .Add({});
  ready_ = &prometheus::BuildGauge()
                .Name("moelora_worker_ready")
                .Help("1 once the model is loaded and the communicator is up")
                .Labels(rl)
                .Register(*registry_)
                .Add({});
}

void WorkerMetrics::AdapterStaged(const std::string& format, bool converted,
                                  const std::map<std::string, double>& phase_seconds,
                                  bool from_host_cache) {
  double total = 0;
  const std::string conv = converted ? "true" : "false";
  for (const auto& [phase, s] : phase_seconds) {
    load_seconds_
        ->Add({{"format", format}, {"converted", conv}, {"phase", phase}}, SecondsBuckets())
        .Observe(s);
    total += s;
  }
  if (from_host_cache) return;
  load_seconds_
      ->Add({{"format", format}, {"converted", conv}, {"phase", "total"}}, SecondsBuckets())
      .Observe(total);
}

void WorkerMetrics::AdapterLoadFailed(const std::string& reason) {
  load_failures_->Add({{"reason", reason}}).Increment();
}

void WorkerMetrics::SetAdapters(int staged, int loaded) {
  adapters_->Add({{"state", "staged"}}).Set(staged);
  adapters_->Add({{"state", "loaded"}}).Set(loaded);
}

void WorkerMetrics::SetHostCache(int adapters, int64_t bytes) {
  adapters_->Add({{"state", "host_cached"}}).Set(adapters);
  host_cache_bytes_->Set(static_cast<double>(bytes));
}

void WorkerMetrics::SetSlotBytes(int64_t bytes) { slot_bytes_->Set(static_cast<double>(bytes)); }

void WorkerMetrics::StepIdle(double seconds) { step_idle_seconds_->Observe(seconds); }

void WorkerMetrics::StepDone(int batch_tokens, int distinct, double seconds, int generated,
                             int running) {
  step_seconds_->Observe(seconds);
  batch_size_->Observe(batch_tokens);
  batch_distinct_->Observe(distinct);
  generated_->Increment(generated);
  running_->Set(running);
}

void WorkerMetrics::SetReady(bool ready) { ready_->Set(ready ? 1 : 0); }

void WorkerMetrics::KvCache(int64_t num_blocks, int64_t free_blocks, int block_size, int preempted,
                            int64_t prefix_queries, int64_t prefix_hits) {
  if (prefix_queries > 0) prefix_queries_->Increment(static_cast<double>(prefix_queries));
  if (prefix_hits > 0) prefix_hits_->Increment(static_cast<double>(prefix_hits));
  if (num_blocks > 0) {
    kv_usage_->Set(static_cast<double>(num_blocks - free_blocks) / static_cast<double>(num_blocks));
  }
  if (num_blocks > 0) {
    std::call_once(kv_info_once_, [&] {
      kv_info_
          ->Add({{"block_size", std::to_string(block_size)},
                 {"num_gpu_blocks", std::to_string(num_blocks)}})
          .Set(1);
    });
  }
  if (preempted > 0) preemptions_->Increment(preempted);
}

}  // namespace moelora
