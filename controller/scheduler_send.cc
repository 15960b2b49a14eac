// The scheduler's calls to the workers: one step call a pass, and with --call-ahead the next
// decode call sent shortly before the one in flight ends.
#include <algorithm>
#include <utility>

#include "controller/scheduler.h"

namespace moelora {

absl::StatusOr<v1::StepResponse> Scheduler::Send(const v1::StepRequest& step,
                                                 std::unique_ptr<PendingStep> call) {
  // A call sent ahead starts on the workers when the call before it ends there: estimated when
  // it was sent (its predecessor's answer can come back late: the worker's compute thread goes
  // straight on to this call and the answer's thread waits for a core, up to a step).
  const bool sent_ahead = call != nullptr;
  call_start_ = sent_ahead ? ahead_start_ : clock_->Now();
  if (!sent_ahead && ran_on_) metrics_->scheduler_gap.Observe(Seconds(call_start_ - last_return_));
  absl::StatusOr<v1::StepResponse> resp;
  if (call_ahead_ && step.decode_steps() > 1 && step.add().empty() && step.remove().empty()) {
    // A decode-only call: shortly before it should end, the next one goes out, to run on the
    // workers right after it (after_step) instead of after the round trip. The lead covers the
    // request's way to the workers; a request that arrives within it waits one call more.
    if (call == nullptr) call = group_->StartStepAll(step);
    const auto expected = std::chrono::duration_cast<Clock::Duration>(
        std::chrono::duration<double>(step_seconds_ * step.decode_steps()));
    const auto lead = std::chrono::duration_cast<Clock::Duration>(
        std::chrono::duration<double>(kAheadLeadSeconds + 2 * call_overhead_seconds_));
    if (!call->WaitUntil(call_start_ + expected - lead) && SendAheadAllowed(step.decode_steps())) {
      ahead_start_ = std::max(clock_->Now(), call_start_ + expected);
      ahead_req_.Clear();
      ahead_req_.set_step(++step_no_);
      ahead_req_.set_decode_steps(decode_steps_);
      ahead_req_.set_after_step(step.step());
      SetEpochAndExpected(&ahead_req_);
      ahead_ = group_->StartStepAll(ahead_req_);
      metrics_->calls_ahead.Increment();
    }
    resp = call->Get();
  } else {
    resp = group_->StepAll(step);
  }
  last_return_ = clock_->Now();
  ran_on_ = false;
  // The call sent after a failed one comes to nothing: cancelled while it waits (or its tokens,
  // for sequences failed by Recover, dropped).
  if (!resp.ok()) CancelAhead();
  return resp;
}

void Scheduler::CancelAhead() {
  if (ahead_ == nullptr) return;
  ahead_->Cancel();
  (void)ahead_->Get();
  ahead_.reset();
}

bool Scheduler::SendAheadAllowed(int steps) {
  if (stop_ || !serving_()) return false;
  const auto now = clock_->Now();
  MutexLock lock(&mu_);
  if (wake_ || !pending_.empty()) return false;
  bool more = false;
  for (const auto& [id, r] : running_) {
    if (!r->Expiry(now, "generating").ok() || r->stop_string) return false;
    if (r->req.max_tokens() - static_cast<int64_t>(r->num_tokens()) > steps) more = true;
  }
  return more;
}

void Scheduler::SetEpochAndExpected(v1::StepRequest* step) {
  step->set_epoch(epoch_);
  MutexLock lock(&mu_);
  step->mutable_expected()->Reserve(static_cast<int>(running_.size()));
  for (const auto& [id, r] : running_) step->add_expected(id);
}

}  // namespace moelora
