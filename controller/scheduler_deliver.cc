// The scheduler's outcomes: a step's tokens delivered to their requests and its figures recorded,
// or a failed call recovered from.
#include <algorithm>
#include <array>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "controller/scheduler.h"

namespace moelora {

namespace {

// The call's tokens by sequence, in order, up to its finished one: each request takes them in
// one AddTokens, so a streaming request's thread wakes once a call rather than once a token
// (at batch 32 and 4 steps a call, 128 wakeups on the cores the worker computes on).
struct SequenceTokens {
  int64_t id = 0;
  std::vector<int32_t> tokens;
  std::vector<float> logprobs;
  const v1::SequenceToken* finished = nullptr;
  int64_t verify_steps = 0, drafted = 0, kept = 0;  // speculative decoding
};

std::vector<SequenceTokens> BySequence(const v1::StepResponse& resp) {
  std::vector<SequenceTokens> by_sequence;
  std::unordered_map<int64_t, size_t> index;
  for (const v1::SequenceToken& t : resp.tokens()) {
    const auto [it, fresh] = index.emplace(t.sequence_id(), by_sequence.size());
    if (fresh) by_sequence.push_back({t.sequence_id(), {}, {}, nullptr, 0, 0, 0});
    SequenceTokens& q = by_sequence[it->second];
    if (q.finished != nullptr) continue;  // nothing comes after a sequence's last token
    q.tokens.push_back(t.token_id());
    q.logprobs.push_back(t.logprob());
    if (t.drafted() > 0) {
      ++q.verify_steps;
      q.drafted += t.drafted();
      q.kept += t.accepted();
    }
    if (t.finished()) q.finished = &t;
  }
  return by_sequence;
}

}  // namespace

void Scheduler::RecordStep(const v1::StepRequest& step, const v1::StepResponse& resp,
                           bool sent_ahead) {
  {
    // Per step: a step's tokens run until a sequence comes again (not counting a sequence's
    // several tokens of one step, with speculative decoding: those come one after the other).
    std::set<int64_t> seen;
    for (const v1::SequenceToken& t : resp.tokens()) {
      if (t.same_step()) continue;
      if (!seen.insert(t.sequence_id()).second) {
        metrics_->batch_size.Observe(static_cast<double>(seen.size()));
        seen = {t.sequence_id()};
      }
    }
    metrics_->batch_size.Observe(static_cast<double>(seen.size()));
  }
  metrics_->batch_distinct_adapters.Observe(resp.distinct_adapters());
  if (kv_blocks_ > 0) {
    metrics_->kv_cache_usage.Set(1.0 - static_cast<double>(resp.kv_free_blocks()) /
                                           static_cast<double>(kv_blocks_));
  }
  if (resp.preempted() > 0) metrics_->preemptions.Increment(resp.preempted());
  if (resp.prefix_cache_queries() > 0) {
    metrics_->prefix_cache_queries.Increment(static_cast<double>(resp.prefix_cache_queries()));
    metrics_->prefix_cache_hits.Increment(static_cast<double>(resp.prefix_cache_hits()));
  }
  metrics_->steps_per_call.Observe(std::max(resp.steps(), 1));
  // The decode step's time (a prefill step, with joiners, says nothing of it).
  if (step.add().empty() && resp.steps() > 0 && resp.seconds() > 0) {
    step_seconds_ = resp.seconds() / resp.steps();
  }
  if (!sent_ahead) {
    // (A call sent ahead waited for its predecessor: its wall time says nothing of the RPCs.)
    const double overhead = std::max(0.0, Seconds(last_return_ - call_start_) - resp.seconds());
    metrics_->worker_call_overhead.Observe(overhead);
    call_overhead_seconds_ = 0.8 * call_overhead_seconds_ + 0.2 * std::min(overhead, 0.05);
  }
}

void Scheduler::Deliver(const v1::StepResponse& resp) {
  const auto now = clock_->Now();
  const std::vector<SequenceTokens> by_sequence = BySequence(resp);
  std::vector<std::pair<std::shared_ptr<GenRequest>, std::string>> finished;
  std::map<std::string, std::array<int64_t, 3>> speculation;  // verify steps, drafted, kept
  std::vector<std::pair<std::shared_ptr<GenRequest>, absl::Status>> failed;
  {
    MutexLock lock(&mu_);
    // Sequences the workers removed because they failed alone (out of memory in their prompt
    // chunk): only their requests end; the others run on.
    for (const v1::SequenceFailure& f : resp.failed()) {
      auto it = running_.find(f.sequence_id());
      if (it == running_.end()) continue;
      failed.push_back({it->second, absl::ResourceExhaustedError(f.message())});
      running_.erase(it);
    }
    for (const SequenceTokens& q : by_sequence) {
      auto it = running_.find(q.id);
      if (it == running_.end()) continue;
      std::shared_ptr<GenRequest> r = it->second;
      for (const GenRequest::TokenTiming& timing : r->AddTokens(q.tokens, q.logprobs, now)) {
        (timing.first ? metrics_->ttft : metrics_->inter_token).Observe(timing.seconds);
      }
      metrics_->generated_tokens.Increment(static_cast<double>(q.tokens.size()));
      // By adapter, once per call (the families' lookups are not free on this thread).
      if (q.verify_steps > 0) {
        auto& a = speculation[r->adapter];
        a[0] += q.verify_steps;
        a[1] += q.drafted;
        a[2] += q.kept;
      }
      if (q.finished != nullptr) {
        finished.push_back({r, q.finished->finish_reason()});
        running_.erase(it);
      }
    }
    metrics_->running.Set(static_cast<double>(running_.size()));
    if (!finished.empty() || !failed.empty()) UpdateLoraInfo();
    ran_on_ = !running_.empty();
  }
  for (const auto& [adapter, a] : speculation) {
    metrics_->ObserveSpeculation(adapter, a[0], a[1], a[2]);
  }
  for (auto& [r, reason] : finished) Finish(r, absl::OkStatus(), reason);
  for (auto& [r, status] : failed) Finish(r, status, "");
}

void Scheduler::Recover(const Pass& pass, const absl::Status& error) {
  const absl::StatusCode c = error.code();
  std::vector<std::shared_ptr<GenRequest>> victims;
  const bool refused = c == absl::StatusCode::kInvalidArgument ||
                       c == absl::StatusCode::kNotFound || c == absl::StatusCode::kAlreadyExists ||
                       c == absl::StatusCode::kResourceExhausted;
  {
    MutexLock lock(&mu_);
    if (refused) {
      // The workers refused a joiner and did not step: fail the joiners only.
      for (auto& r : pass.admitted) {
        running_.erase(r->seq_id);
        victims.push_back(r);
      }
    } else {
      for (auto& [id, r] : running_) victims.push_back(r);
      running_.clear();
    }
    metrics_->running.Set(static_cast<double>(running_.size()));
    UpdateLoraInfo();
  }
  LOG(WARNING) << "step failed: " << error;
  // Not a refusal: the ranks may still hold the step's sequences (a rank that stepped while
  // another failed, a step that timed out here and runs on there). No new step until every rank
  // is checked again (OnGroupReady); the sweep step that follows has the ranks drop every
  // sequence the controller does not expect.
  if (!refused) {
    awaiting_ready_ = true;
    group_->Revalidate(std::string(error.message()));
  }
  const absl::Status s =
      c == absl::StatusCode::kInvalidArgument || c == absl::StatusCode::kNotFound
          ? error
          : absl::UnavailableError(absl::StrCat("worker step failed: ", error.message()));
  for (auto& r : victims) Finish(r, s, "");
}

}  // namespace moelora
