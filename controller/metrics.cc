#include "controller/metrics.h"

#include <map>
#include <string>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"

namespace moelora {
namespace {
prometheus::Histogram::BucketBoundaries Seconds() {
  return {0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60};
}
// The controller/worker round trip's pieces: 50 us to 50 ms.
prometheus::Histogram::BucketBoundaries RoundTripBuckets() {
  return {0.00005, 0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.05};
}
}  // namespace

ControllerMetrics::ControllerMetrics()
    : registry_(std::make_shared<prometheus::Registry>()),
      adapter_load_seconds(prometheus::BuildHistogram()
                               .Name("moelora_adapter_load_seconds")
                               .Help("LoadAdapter latency through the controller by phase "
                                     "(validate, stage, commit, total)")
                               .Register(*registry_)),
      adapter_load_failures(prometheus::BuildCounter()
                                .Name("moelora_adapter_load_failures_total")
                                .Help("LoadAdapter calls refused, by reason (status code)")
                                .Register(*registry_)),
      adapters(prometheus::BuildGauge()
                   .Name("moelora_adapters")
                   .Help("Registered adapters by state (loading, ready, unloading, failed)")
                   .Register(*registry_)),
      requests(prometheus::BuildCounter()
                   .Name("moelora_requests_total")
                   .Help("Generate / GenerateStream calls by adapter and status code")
                   .Register(*registry_)),
      auth_failures(prometheus::BuildCounter()
                        .Name("moelora_auth_failures_total")
                        .Help("Calls refused for their token (--auth-tokens-file), by status code")
                        .Register(*registry_)),
      http_requests(prometheus::BuildCounter()
                        .Name("moelora_http_requests_total")
                        .Help("HTTP API requests (--http-port) by route and HTTP status")
                        .Register(*registry_)),
      ttft(prometheus::BuildHistogram()
               .Name("moelora_time_to_first_token_seconds")
               .Help("From arrival to the first generated token")
               .Register(*registry_)
               .Add({}, Seconds())),
      inter_token(prometheus::BuildHistogram()
                      .Name("moelora_inter_token_seconds")
                      .Help("Between consecutive tokens of one request")
                      .Register(*registry_)
                      .Add({}, Seconds())),
      batch_size(
          prometheus::BuildHistogram()
              .Name("moelora_batch_size")
              .Help("Sequences in one continuous-batching step")
              .Register(*registry_)
              .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16, 32, 64, 128, 256})),
      batch_distinct_adapters(
          prometheus::BuildHistogram()
              .Name("moelora_batch_distinct_adapters")
              .Help("Distinct adapters in one step (base not counted)")
              .Register(*registry_)
              .Add({}, prometheus::Histogram::BucketBoundaries{0, 1, 2, 4, 8, 16, 32})),
      steps_per_call(prometheus::BuildHistogram()
                         .Name("moelora_steps_per_call")
                         .Help("Steps the workers ran in one call (--decode-steps)")
                         .Register(*registry_)
                         .Add({}, prometheus::Histogram::BucketBoundaries{1, 2, 4, 8, 16})),
      worker_call_overhead(
          prometheus::BuildHistogram()
              .Name("moelora_worker_call_overhead_seconds")
              .Help("A step call's time beyond the steps rank 0 reports: the RPCs and the "
                    "workers' hand-offs to and from their compute threads")
              .Register(*registry_)
              .Add({}, RoundTripBuckets())),
      scheduler_gap(
          prometheus::BuildHistogram()
              .Name("moelora_scheduler_gap_seconds")
              .Help("From a step call's return to the next call while sequences run: the "
                    "scheduler's handling of the tokens and its admission pass (the workers idle)")
              .Register(*registry_)
              .Add({}, RoundTripBuckets())),
      calls_ahead(prometheus::BuildCounter()
                      .Name("moelora_worker_calls_ahead_total")
                      .Help("Decode calls sent before the call in flight ended (--call-ahead)")
                      .Register(*registry_)
                      .Add({})),
      queue_depth(prometheus::BuildGauge()
                      .Name("moelora_queue_depth")
                      .Help("Requests waiting for a batch slot")
                      .Register(*registry_)
                      .Add({})),
      running(prometheus::BuildGauge()
                  .Name("moelora_running_sequences")
                  .Help("Sequences in the running batch")
                  .Register(*registry_)
                  .Add({})),
      worker_up(prometheus::BuildGauge()
                    .Name("moelora_worker_up")
                    .Help("1 when the worker rank answers Health ready")
                    .Register(*registry_)),
      generated_tokens(prometheus::BuildCounter()
                           .Name("moelora_generated_tokens_total")
                           .Help("Tokens returned to clients")
                           .Register(*registry_)
                           .Add({})),
      serving(prometheus::BuildGauge()
                  .Name("moelora_serving")
                  .Help("1 when the controller reports SERVING")
                  .Register(*registry_)
                  .Add({})),
      worker_restarts(prometheus::BuildCounter()
                          .Name("moelora_worker_group_restarts_total")
                          .Help("Times the local worker group was restarted after a rank died")
                          .Register(*registry_)
                          .Add({})),
      tokenize_seconds(
          prometheus::BuildHistogram()
              .Name("moelora_tokenize_seconds")
              .Help("Encoding a text prompt (in the RPC thread, before admission)")
              .Register(*registry_)
              .Add({}, prometheus::Histogram::BucketBoundaries{1e-5, 1e-4, 2.5e-4, 5e-4, 0.001,
                                                               0.0025, 0.005, 0.01, 0.025, 0.05,
                                                               0.1, 0.25, 1})),
      image_seconds(prometheus::BuildHistogram()
                        .Name("moelora_image_preprocess_seconds")
                        .Help("Decoding and resizing a request's images (before admission)")
                        .Register(*registry_)
                        .Add({}, prometheus::Histogram::BucketBoundaries{1e-4, 5e-4, 0.001, 0.0025,
                                                                         0.005, 0.01, 0.025, 0.05,
                                                                         0.1, 0.25, 0.5, 1, 2.5})),
      images(prometheus::BuildCounter()
                 .Name("moelora_images_total")
                 .Help("Images in accepted requests")
                 .Register(*registry_)
                 .Add({})),
      stop_strings(prometheus::BuildCounter()
                       .Name("moelora_stop_string_matches_total")
                       .Help("Requests ended by a stop string")
                       .Register(*registry_)
                       .Add({})),
      adapter_resident(
          prometheus::BuildGauge()
              .Name("moelora_adapter_resident")
              .Help("1 while the adapter is in the tier: slot = a worker LoRA slot, host = "
                    "the workers' host cache (series only while it is in one)")
              .Register(*registry_)),
      lora_requests_info(
          prometheus::BuildGauge()
              .Name("moelora_lora_requests_info")
              .Help("Adapters of running and waiting requests (comma-separated) and max_lora, as "
                    "vLLM's vllm:lora_requests_info; the value is when it last changed (Unix "
                    "seconds). For the Gateway API inference extension's --lora-info-metric")
              .Register(*registry_)),
      kv_cache_usage(prometheus::BuildGauge()
                         .Name("moelora_kv_cache_usage_ratio")
                         .Help("Fraction of the workers' KV cache blocks in use (0..1), after the "
                               "last step. For the Gateway API inference extension's "
                               "--kv-cache-usage-percentage-metric")
                         .Register(*registry_)
                         .Add({})),
      preemptions(prometheus::BuildCounter()
                      .Name("moelora_preemptions_total")
                      .Help("Sequences preempted by the workers (KV blocks freed, recomputed "
                            "later with the same output)")
                      .Register(*registry_)
                      .Add({})),
      prefix_cache_queries(prometheus::BuildCounter()
                               .Name("moelora_prefix_cache_queries_total")
                               .Help("Prompt tokens looked up in the workers' prefix cache")
                               .Register(*registry_)
                               .Add({})),
      prefix_cache_hits(prometheus::BuildCounter()
                            .Name("moelora_prefix_cache_hits_total")
                            .Help("Prompt tokens found in the prefix cache (not computed again)")
                            .Register(*registry_)
                            .Add({})),
      spec_verify_steps(prometheus::BuildCounter()
                            .Name("moelora_spec_decode_verify_steps_total")
                            .Help("Speculative decoding: decode steps that verified MTP drafts, "
                                  "by adapter")
                            .Register(*registry_)),
      spec_draft_tokens(prometheus::BuildCounter()
                            .Name("moelora_spec_decode_draft_tokens_total")
                            .Help("Speculative decoding: draft tokens proposed, by adapter")
                            .Register(*registry_)),
      spec_accepted_tokens(prometheus::BuildCounter()
                               .Name("moelora_spec_decode_accepted_tokens_total")
                               .Help("Speculative decoding: draft tokens the target kept, by "
                                     "adapter")
                               .Register(*registry_)),
      spec_acceptance_rate(prometheus::BuildGauge()
                               .Name("moelora_spec_decode_acceptance_rate")
                               .Help("Speculative decoding: drafts kept / drafts proposed since "
                                     "the start, by adapter")
                               .Register(*registry_)),
      spec_mean_accepted_length(prometheus::BuildGauge()
                                    .Name("moelora_spec_decode_mean_accepted_length")
                                    .Help("Speculative decoding: tokens per verify step (1 + "
                                          "drafts kept / verify steps) since the start, by "
                                          "adapter")
                                    .Register(*registry_)) {}

void ControllerMetrics::ObserveSpeculation(const std::string& adapter, int64_t steps_done,
                                           int64_t drafted, int64_t accepted) {
  const std::map<std::string, std::string> label = {
      {"adapter", adapter.empty() ? "base" : adapter}};
  prometheus::Counter& steps = spec_verify_steps.Add(label);
  prometheus::Counter& draft = spec_draft_tokens.Add(label);
  prometheus::Counter& kept = spec_accepted_tokens.Add(label);
  steps.Increment(static_cast<double>(steps_done));
  draft.Increment(static_cast<double>(drafted));
  kept.Increment(static_cast<double>(accepted));
  spec_acceptance_rate.Add(label).Set(kept.Value() / draft.Value());
  spec_mean_accepted_length.Add(label).Set(1 + kept.Value() / steps.Value());
}

void ControllerMetrics::ForgetAdapter(const std::string& adapter) {
  if (adapter.empty()) return;
  for (int c = 0; c <= static_cast<int>(absl::StatusCode::kUnauthenticated); ++c) {
    const prometheus::Labels l = {
        {"adapter", adapter},
        {"code",
         absl::AsciiStrToLower(absl::StatusCodeToString(static_cast<absl::StatusCode>(c)))}};
    if (requests.Has(l)) requests.Remove(&requests.Add(l));
  }
  const prometheus::Labels l = {{"adapter", adapter}};
  for (auto* f : {&spec_verify_steps, &spec_draft_tokens, &spec_accepted_tokens}) {
    if (f->Has(l)) f->Remove(&f->Add(l));
  }
  for (auto* f : {&spec_acceptance_rate, &spec_mean_accepted_length}) {
    if (f->Has(l)) f->Remove(&f->Add(l));
  }
}

void ControllerMetrics::ObserveLoad(const std::string& format, bool converted,
                                    const std::string& phase, double s) {
  adapter_load_seconds
      .Add({{"format", format}, {"converted", converted ? "true" : "false"}, {"phase", phase}},
           Seconds())
      .Observe(s);
}

}  // namespace moelora
