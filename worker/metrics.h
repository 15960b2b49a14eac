// The worker's Prometheus metrics (README: "Operating it"; base units, `moelora_` prefix, a
// constant `rank` label). Thread-safe: prometheus-cpp metrics are.
#ifndef MOELORA_WORKER_METRICS_H_
#define MOELORA_WORKER_METRICS_H_

#include <map>
#include <memory>
#include <mutex>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace moelora {

class WorkerMetrics {
 public:
  explicit WorkerMetrics(int rank);
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  // One successful stage: a sample per phase (read, validate, convert, copy) and the total; a
  // swap-in from the host cache is its one phase, swap_in, and no total (which stays the time
  // of loads from disk).
  void SetSlotBytes(int64_t bytes);
  void AdapterStaged(const std::string& format, bool converted,
                     const std::map<std::string, double>& phase_seconds, bool from_host_cache);
  void AdapterLoadFailed(const std::string& reason);
  void SetAdapters(int staged, int loaded);
  void SetHostCache(int adapters, int64_t bytes);
  void StepDone(int batch_tokens, int distinct_adapters, double seconds, int generated,
                int running);
  // The compute thread's wait between two step calls while sequences ran.
  void StepIdle(double seconds);
  void SetReady(bool ready);
  // After each Step call: the KV cache's blocks (in all and free), the call's preemptions and
  // its prefix-cache lookups (prompt tokens looked up, found).
  void KvCache(int64_t num_blocks, int64_t free_blocks, int block_size, int preempted,
               int64_t prefix_queries, int64_t prefix_hits);

 private:
  std::shared_ptr<prometheus::Registry> registry_;
  prometheus::Family<prometheus::Histogram>* load_seconds_;
  prometheus::Family<prometheus::Counter>* load_failures_;
  prometheus::Family<prometheus::Gauge>* adapters_;
  prometheus::Gauge* host_cache_bytes_;
  prometheus::Gauge* slot_bytes_;
  prometheus::Histogram* step_seconds_;
  prometheus::Histogram* step_idle_seconds_;
  prometheus::Histogram* batch_size_;
  prometheus::Histogram* batch_distinct_;
  prometheus::Counter* generated_;
  prometheus::Gauge* running_;
  prometheus::Gauge* ready_;
  prometheus::Gauge* kv_usage_;
  prometheus::Family<prometheus::Gauge>* kv_info_;
  std::once_flag kv_info_once_;
  prometheus::Counter* preemptions_;
  prometheus::Counter* prefix_queries_;
  prometheus::Counter* prefix_hits_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_METRICS_H_
