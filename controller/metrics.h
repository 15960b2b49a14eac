// The controller's Prometheus metrics (README: "Operating it"). Thread-safe.
#ifndef MOELORA_CONTROLLER_METRICS_H_
#define MOELORA_CONTROLLER_METRICS_H_

#include <memory>
#include <string>

#include "prometheus/counter.h"
#include "prometheus/family.h"
#include "prometheus/gauge.h"
#include "prometheus/histogram.h"
#include "prometheus/registry.h"

namespace moelora {

class ControllerMetrics {
 private:
  std::shared_ptr<prometheus::Registry> registry_;  // first: the families below register in it

 public:
  ControllerMetrics();
  std::shared_ptr<prometheus::Registry> registry() const { return registry_; }

  prometheus::Family<prometheus::Histogram>& adapter_load_seconds;  // {format, converted, phase}
  prometheus::Family<prometheus::Counter>& adapter_load_failures;   // {reason}
  prometheus::Family<prometheus::Gauge>& adapters;                  // {state}
  prometheus::Family<prometheus::Counter>& requests;                // {adapter, code}
  prometheus::Family<prometheus::Counter>& auth_failures;           // {code}
  prometheus::Family<prometheus::Counter>& http_requests;           // {route, status}
  prometheus::Histogram& ttft;
  prometheus::Histogram& inter_token;
  prometheus::Histogram& batch_size;
  prometheus::Histogram& batch_distinct_adapters;
  prometheus::Histogram& steps_per_call;
  prometheus::Histogram& worker_call_overhead;
  prometheus::Histogram& scheduler_gap;
  prometheus::Counter& calls_ahead;
  prometheus::Gauge& queue_depth;
  prometheus::Gauge& running;
  prometheus::Family<prometheus::Gauge>& worker_up;  // {rank}
  prometheus::Counter& generated_tokens;
  prometheus::Gauge& serving;
  prometheus::Counter& worker_restarts;
  prometheus::Histogram& tokenize_seconds;
  prometheus::Histogram& image_seconds;  // decoding and resizing a request's images
  prometheus::Counter& images;           // images received in requests that were accepted
  prometheus::Counter& stop_strings;
  prometheus::Family<prometheus::Gauge>& adapter_resident;    // {adapter, tier}
  prometheus::Family<prometheus::Gauge>& lora_requests_info;  // vLLM's, for LoRA-affinity routing
  prometheus::Gauge& kv_cache_usage;  // 0..1, rank 0's blocks in use after the last step
  prometheus::Counter& preemptions;
  prometheus::Counter& prefix_cache_queries;  // prompt tokens looked up
  prometheus::Counter& prefix_cache_hits;     // of those, found cached
  // Speculative decoding (--speculative-config), by adapter ("base" for none): verify steps
  // with drafts, drafts, drafts kept; and from them, since the start, the acceptance rate
  // (kept / drafted) and the mean accepted length (tokens a verify step yields: 1 + kept / steps).
  prometheus::Family<prometheus::Counter>& spec_verify_steps;
  prometheus::Family<prometheus::Counter>& spec_draft_tokens;
  prometheus::Family<prometheus::Counter>& spec_accepted_tokens;
  prometheus::Family<prometheus::Gauge>& spec_acceptance_rate;
  prometheus::Family<prometheus::Gauge>& spec_mean_accepted_length;

  void ObserveLoad(const std::string& format, bool converted, const std::string& phase, double s);
  // Drops the series labelled with this adapter (requests, speculation): an unloaded adapter's
  // name leaves /metrics, so names that come and go do not grow it without bound.
  void ForgetAdapter(const std::string& adapter);
  // `steps` verify steps of sequences on `adapter` ("" = base) that drafted `drafted` tokens in
  // all and kept `accepted`.
  void ObserveSpeculation(const std::string& adapter, int64_t steps, int64_t drafted,
                          int64_t accepted);
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_METRICS_H_
