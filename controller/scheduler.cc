#include "controller/scheduler.h"

#include <array>
#include <map>
#include <set>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace moelora {
namespace {

double Seconds(Clock::Duration d) { return std::chrono::duration<double>(d).count(); }

// Why a request must leave: its deadline passed or its client cancelled (deadline first: gRPC
// also marks a call cancelled when its deadline passes). OK when it may stay.
absl::Status Expiry(const GenRequest& r, Clock::TimePoint now, const char* where) {
  if (now > r.deadline)
    return absl::DeadlineExceededError(absl::StrCat("deadline exceeded while ", where));
  if (now > r.timeout_at) {
    return absl::DeadlineExceededError(
        absl::StrCat("--request-timeout-s ", r.request_timeout_s, " exceeded while ", where));
  }
  if (r.cancelled) return absl::CancelledError("cancelled by the client");
  return absl::OkStatus();
}

}  // namespace

Scheduler::Scheduler(int max_num_seqs, int max_loras, AdapterManager* adapters,
                     WorkerGroupInterface* group, ControllerMetrics* metrics,
                     std::function<bool()> serving, std::chrono::milliseconds batch_window,
                     std::chrono::milliseconds batch_window_max, int decode_steps, bool call_ahead,
                     Clock* clock, int max_queued, std::chrono::milliseconds max_bypass)
    : max_num_seqs_(max_num_seqs),
      batch_window_(batch_window),
      batch_window_max_(std::max(batch_window, batch_window_max)),
      max_bypass_(max_bypass),
      decode_steps_(std::max(decode_steps, 1)),
      call_ahead_(call_ahead),
      clock_(clock),
      max_queued_(max_queued),
      max_loras_(max_loras),
      adapters_(adapters),
      group_(group),
      metrics_(metrics),
      serving_(std::move(serving)) {
  MutexLock lock(&mu_);
  UpdateLoraInfo();
}

Scheduler::~Scheduler() { Stop(absl::UnavailableError("the controller is shutting down")); }

void Scheduler::Start() {
  swap_pool_ = std::make_unique<WorkPool>(kMaxSwapsInFlight);
  loop_ = std::thread([this] { Loop(); });
}

void Scheduler::Stop(const absl::Status& why) {
  if (stop_.exchange(true)) return;
  Wake();
  if (loop_.joinable()) loop_.join();
  swap_pool_.reset();  // the swap-ins under way end first
  FailAll(why);
}

void Scheduler::SwapDone(const std::string& name, const absl::Status& s) {
  std::vector<std::shared_ptr<GenRequest>> failed;
  {
    MutexLock lock(&mu_);
    swapping_.erase(name);
    if (!s.ok()) {
      // The adapter is FAILED: its queued requests fail with the reason.
      for (auto p = pending_.begin(); p != pending_.end();) {
        if ((*p)->adapter == name) {
          failed.push_back(*p);
          p = pending_.erase(p);
        } else {
          ++p;
        }
      }
      metrics_->queue_depth.Set(static_cast<double>(pending_.size()));
      UpdateLoraInfo();
    }
  }
  for (auto& r : failed) Finish(r, s, "");
  Wake();
}

void Scheduler::Wake() {
  {
    MutexLock lock(&mu_);
    wake_ = true;
  }
  cv_.SignalAll();
}

int Scheduler::in_flight() const {
  MutexLock lock(&mu_);
  return static_cast<int>(pending_.size() + running_.size());
}

absl::Status Scheduler::Enqueue(const std::shared_ptr<GenRequest>& r) {
  MutexLock lock(&mu_);
  if (max_queued_ > 0 && static_cast<int>(pending_.size()) >= max_queued_) {
    return absl::ResourceExhaustedError(absl::StrCat(pending_.size(),
                                                     " requests wait to be admitted, the maximum "
                                                     "(--max-queued-requests); retry later"));
  }
  r->seq_id = next_seq_++;
  pending_.push_back(r);
  metrics_->queue_depth.Set(static_cast<double>(pending_.size()));
  UpdateLoraInfo();
  wake_ = true;
  cv_.SignalAll();
  return absl::OkStatus();
}

void Scheduler::FailAll(const absl::Status& s) {
  std::vector<std::shared_ptr<GenRequest>> victims;
  {
    MutexLock lock(&mu_);
    for (auto& r : pending_) victims.push_back(r);
    for (auto& [id, r] : running_) victims.push_back(r);
    pending_.clear();
    running_.clear();
    metrics_->queue_depth.Set(0);
    metrics_->running.Set(0);
    UpdateLoraInfo();
  }
  for (auto& r : victims) Finish(r, s, "");
}

void Scheduler::Finish(const std::shared_ptr<GenRequest>& r, absl::Status s,
                       const std::string& reason) {
  if (!r->Finish(std::move(s), reason, clock_->Now())) return;
  if (!r->adapter.empty()) adapters_->Release(r->adapter);
  Wake();
}

void Scheduler::UpdateLoraInfo() {
  std::set<std::string> running, waiting;
  for (const auto& [id, r] : running_) {
    if (!r->adapter.empty()) running.insert(r->adapter);
  }
  for (const auto& r : pending_) {
    if (!r->adapter.empty()) waiting.insert(r->adapter);
  }
  const std::string run = absl::StrJoin(running, ","), wait = absl::StrJoin(waiting, ",");
  const std::string key = absl::StrCat(run, "|", wait);
  if (lora_info_ != nullptr && key == lora_info_key_) return;
  if (lora_info_ != nullptr) metrics_->lora_requests_info.Remove(lora_info_);
  lora_info_ = &metrics_->lora_requests_info.Add({{"running_lora_adapters", run},
                                                  {"waiting_lora_adapters", wait},
                                                  {"max_lora", std::to_string(max_loras_)}});
  lora_info_->Set(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  lora_info_key_ = key;
}

void Scheduler::Loop() {
  while (!stop_) {
    std::vector<std::pair<std::shared_ptr<GenRequest>, absl::Status>> ended;
    std::vector<std::shared_ptr<GenRequest>> admitted;
    std::vector<std::string> swap;  // adapters of waiting requests to swap in, oldest first
    std::set<std::string> in_use;   // adapters of running sequences (never swapped out)
    v1::StepRequest step;
    // A decode call sent ahead (--call-ahead) is this pass's call: nothing joins or leaves before
    // it returns (SendAheadAllowed saw nothing waiting to), so the pass skips to waiting for it.
    std::unique_ptr<PendingStep> call = std::move(ahead_);
    if (call != nullptr) {
      step = std::move(ahead_req_);
    } else {
      adapters_->ReconcileIfNeeded();
      {
        MutexLock lock(&mu_);
        auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
          return stop_ || wake_ || !pending_.empty() || !running_.empty();
        };
        // A 20 ms tick at most while idle, so deferred unloads and reconciliation still happen.
        if (!has_work()) clock_->WaitFor(&cv_, &mu_, std::chrono::milliseconds(20));
        wake_ = false;
        if (stop_) break;
        // An idle engine waits until no request has arrived for batch_window_ (at most
        // batch_window_max_ after the oldest arrival), so that a burst of requests starts as one
        // prefill step rather than a small one and a large one: each prefill step reads every
        // expert its tokens touch. A burst of concurrent clients arrives spread over a few ms (32
        // in bench/peer: 1.7-2.6 ms), so a fixed window after the first arrival split it.
        // Never while sequences run.
        if (batch_window_.count() > 0 && running_.empty() && !pending_.empty() &&
            static_cast<int>(pending_.size()) < max_num_seqs_) {
          Clock::TimePoint newest = pending_.front()->arrival;
          for (const auto& p : pending_) newest = std::max(newest, p->arrival);
          const auto due =
              std::min(newest + batch_window_, pending_.front()->arrival + batch_window_max_);
          if (clock_->Now() < due) {
            clock_->WaitUntil(&cv_, &mu_, due);
            continue;
          }
        }
      }
      // Deferred unloads whose last request has finished (calls the workers: no lock held).
      adapters_->RunDeferredUnloads();
      // The workers' KV cache, for admission: read (a copy of their Info) only while requests
      // wait to be admitted.
      bool waiting;
      {
        MutexLock lock(&mu_);
        waiting = !pending_.empty();
      }
      if (waiting) {
        const v1::WorkerInfoResponse info = group_->info();
        kv_blocks_ = info.num_blocks();
        kv_block_size_ = info.block_size();
      }
      {
        MutexLock lock(&mu_);
        if (!serving_() || awaiting_ready_) {
          // Queued requests wait for the group (a tick, or the Wake of its ready hook).
          clock_->WaitFor(&cv_, &mu_, std::chrono::milliseconds(20));
          continue;
        }
        const auto now = clock_->Now();
        for (auto it = running_.begin(); it != running_.end();) {
          const absl::Status s = Expiry(*it->second, now, "generating");
          if (!s.ok() || it->second->stop_string) {
            step.add_remove(it->first);
            ended.push_back({it->second, s});
            it = running_.erase(it);
          } else {
            ++it;
          }
        }
        for (auto it = pending_.begin(); it != pending_.end();) {
          const absl::Status s = Expiry(**it, now, "queued");
          if (!s.ok()) {
            ended.push_back({*it, s});
            it = pending_.erase(it);
          } else {
            ++it;
          }
        }
        // Admission in arrival order, while the workers' KV cache has blocks for the next
        // prompt next to what the running sequences hold (the workers preempt when decodes
        // outgrow it; with nothing running the first goes in: it fits the cache alone, checked
        // at submission). A request whose adapter is in no slot waits for a swap-in (the oldest
        // such one's, below) and the requests behind it go first while their adapters are
        // resident, until it has waited --max-bypass-ms: then nothing behind it goes first,
        // so running sequences end and free a slot for it.
        int64_t blocks_used = 0;
        bool passed_over = false;  // a request waiting for a swap-in was passed over
        for (const auto& [id, r] : running_) blocks_used += BlocksHeld(*r);
        for (auto it = pending_.begin();
             it != pending_.end() &&
             static_cast<int>(running_.size() + admitted.size()) < max_num_seqs_;) {
          std::shared_ptr<GenRequest> next = *it;
          const int64_t need = BlocksHeld(*next);
          if (kv_blocks_ > 0 && (!running_.empty() || !admitted.empty()) &&
              blocks_used + need > kv_blocks_) {
            break;
          }
          if (!next->adapter.empty()) {
            const AdapterManager::Residency res = adapters_->Admit(next->adapter, now);
            if (res == AdapterManager::Residency::kGone) {
              ended.push_back({next, absl::NotFoundError("adapter unloaded")});
              it = pending_.erase(it);
              continue;
            }
            if (res == AdapterManager::Residency::kNotResident) {
              if (swapping_.count(next->adapter) == 0 &&
                  static_cast<int>(swapping_.size() + swap.size()) < kMaxSwapsInFlight &&
                  std::find(swap.begin(), swap.end(), next->adapter) == swap.end()) {
                swap.push_back(next->adapter);
              }
              if (!passed_over) {
                passed_over = true;
                if (now - next->arrival >= max_bypass_) break;
              }
              ++it;
              continue;
            }
          }
          it = pending_.erase(it);
          next->SetQueueSeconds(Seconds(now - next->arrival));
          admitted.push_back(next);
          blocks_used += need;
        }
        metrics_->queue_depth.Set(static_cast<double>(pending_.size()));
        metrics_->running.Set(static_cast<double>(running_.size() + admitted.size()));
        for (auto& r : admitted) {
          v1::SequenceSpec* s = step.add_add();
          s->set_sequence_id(r->seq_id);
          s->set_adapter_id(r->adapter_id);
          s->mutable_prompt_token_ids()->CopyFrom(r->req.prompt_token_ids());
          s->set_temperature(r->req.temperature());
          s->set_top_p(r->req.top_p());
          s->set_top_k(r->req.top_k());
          s->set_seed(r->seed);
          s->set_return_logprobs(r->req.return_logprobs());
          s->set_max_tokens(r->req.max_tokens());
          s->mutable_stop_token_ids()->CopyFrom(r->req.stop_token_ids());
          for (v1::SequenceImage& im : r->images) *s->add_images() = std::move(im);
          r->images.clear();
          running_[r->seq_id] = r;
        }
        for (const auto& [id, r] : running_) {
          if (!r->adapter.empty()) in_use.insert(r->adapter);
        }
        if (!admitted.empty() || !ended.empty()) UpdateLoraInfo();  // the batch changed
      }
      for (auto& [r, s] : ended) Finish(r, s, s.ok() ? "stop" : "");
      // Waiting requests need slots: their swap-ins start here, where `in_use` is current, and
      // finish on swap_pool_ while steps go on (SwapDone wakes the loop).
      // Not while this step still has to remove sequences from the workers: a victim's slot can
      // only be freed once no worker sequence uses it (the swap starts on the next pass).
      if (step.remove().empty()) {
        for (const std::string& name : swap) {
          AdapterManager::SwapPlan plan;
          const AdapterManager::SwapStart st = adapters_->BeginSwapIn(name, in_use, &plan);
          if (st == AdapterManager::SwapStart::kWait) break;  // every slot is busy
          if (st != AdapterManager::SwapStart::kStarted) continue;
          {
            MutexLock lock(&mu_);
            swapping_.insert(name);
          }
          swap_pool_->Post([this, plan] { SwapDone(plan.name, adapters_->FinishSwapIn(plan)); });
        }
      }
      int nseq;
      bool queued;
      {
        MutexLock lock(&mu_);
        nseq = static_cast<int>(running_.size());
        queued = !pending_.empty();
      }
      // With nothing to run, a step is still sent when the workers must drop what they hold
      // (after a start or a group restart): sequences of a controller that died stay otherwise.
      if (nseq == 0 && step.remove().empty() && !sweep_) {
        // Nothing runs and what waits needs a swap-in under way (SwapDone wakes the loop) or a
        // slot (a leaked one that reconciliation frees): look again on a tick or a Wake, not in
        // a spin.
        MutexLock lock(&mu_);
        if (!wake_ && !stop_) {
          clock_->WaitFor(&cv_, &mu_, std::chrono::milliseconds(20));
        }
        continue;
      }
      step.set_step(++step_no_);
      sweep_ = false;
      SetEpochAndExpected(&step);
      // Several decode steps in one call while nobody waits to join: a joiner's prefill step then
      // returns its first token at once, and a queued request is not held back by up to
      // decode_steps_ steps. Stop strings and cancellations are seen between calls; the tokens a
      // sequence produced past them are dropped (GenRequest keeps the text up to the stop).
      if (decode_steps_ > 1 && admitted.empty() && !queued) step.set_decode_steps(decode_steps_);
    }
    // A call sent ahead starts on the workers when the call before it ends there: estimated when
    // it was sent (its predecessor's answer can come back late: the worker's compute thread goes
    // straight on to this call and the answer's thread waits for a core, up to a step).
    const bool sent_ahead = call != nullptr;
    const auto call_start = sent_ahead ? ahead_start_ : clock_->Now();
    if (!sent_ahead && ran_on_) metrics_->scheduler_gap.Observe(Seconds(call_start - last_return_));
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
      if (!call->WaitUntil(call_start + expected - lead) && SendAheadAllowed(step.decode_steps())) {
        ahead_start_ = std::max(clock_->Now(), call_start + expected);
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
    if (!resp.ok() && ahead_ != nullptr) {
      // The call sent after this one comes to nothing: cancelled while it waits (or its tokens,
      // for sequences failed below, dropped).
      ahead_->Cancel();
      (void)ahead_->Get();
      ahead_.reset();
    }
    if (!resp.ok()) {
      const absl::StatusCode c = resp.status().code();
      std::vector<std::shared_ptr<GenRequest>> victims;
      const bool refused =
          c == absl::StatusCode::kInvalidArgument || c == absl::StatusCode::kNotFound ||
          c == absl::StatusCode::kAlreadyExists || c == absl::StatusCode::kResourceExhausted;
      {
        MutexLock lock(&mu_);
        if (refused) {
          // The workers refused a joiner and did not step: fail the joiners only.
          for (auto& r : admitted) {
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
      LOG(WARNING) << "step failed: " << resp.status();
      // Not a refusal: the ranks may still hold the step's sequences (a rank that stepped while
      // another failed, a step that timed out here and runs on there). No new step until every
      // rank is checked again (OnGroupReady); the sweep step that follows has the ranks drop
      // every sequence the controller does not expect.
      if (!refused) {
        awaiting_ready_ = true;
        group_->Revalidate(std::string(resp.status().message()));
      }
      const absl::Status s =
          c == absl::StatusCode::kInvalidArgument || c == absl::StatusCode::kNotFound
              ? resp.status()
              : absl::UnavailableError(
                    absl::StrCat("worker step failed: ", resp.status().message()));
      for (auto& r : victims) Finish(r, s, "");
      continue;
    }
    {
      // Per step: a step's tokens run until a sequence comes again (not counting a sequence's
      // several tokens of one step, with speculative decoding: those come one after the other).
      std::set<int64_t> seen;
      for (const v1::SequenceToken& t : resp->tokens()) {
        if (t.same_step()) continue;
        if (!seen.insert(t.sequence_id()).second) {
          metrics_->batch_size.Observe(static_cast<double>(seen.size()));
          seen = {t.sequence_id()};
        }
      }
      metrics_->batch_size.Observe(static_cast<double>(seen.size()));
    }
    metrics_->batch_distinct_adapters.Observe(resp->distinct_adapters());
    if (kv_blocks_ > 0) {
      metrics_->kv_cache_usage.Set(1.0 - static_cast<double>(resp->kv_free_blocks()) /
                                             static_cast<double>(kv_blocks_));
    }
    if (resp->preempted() > 0) metrics_->preemptions.Increment(resp->preempted());
    if (resp->prefix_cache_queries() > 0) {
      metrics_->prefix_cache_queries.Increment(static_cast<double>(resp->prefix_cache_queries()));
      metrics_->prefix_cache_hits.Increment(static_cast<double>(resp->prefix_cache_hits()));
    }
    metrics_->steps_per_call.Observe(std::max(resp->steps(), 1));
    // The decode step's time (a prefill step, with joiners, says nothing of it).
    if (step.add().empty() && resp->steps() > 0 && resp->seconds() > 0) {
      step_seconds_ = resp->seconds() / resp->steps();
    }
    if (!sent_ahead) {
      // (A call sent ahead waited for its predecessor: its wall time says nothing of the RPCs.)
      const double overhead = std::max(0.0, Seconds(last_return_ - call_start) - resp->seconds());
      metrics_->worker_call_overhead.Observe(overhead);
      call_overhead_seconds_ = 0.8 * call_overhead_seconds_ + 0.2 * std::min(overhead, 0.05);
    }
    const auto now = clock_->Now();
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
    std::vector<SequenceTokens> by_sequence;
    {
      std::unordered_map<int64_t, size_t> index;
      for (const v1::SequenceToken& t : resp->tokens()) {
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
    }
    std::vector<std::pair<std::shared_ptr<GenRequest>, std::string>> finished;
    std::map<std::string, std::array<int64_t, 3>> speculation;  // verify steps, drafted, kept
    std::vector<std::pair<std::shared_ptr<GenRequest>, absl::Status>> failed;
    {
      MutexLock lock(&mu_);
      // Sequences the workers removed because they failed alone (out of memory in their prompt
      // chunk): only their requests end; the others run on.
      for (const v1::SequenceFailure& f : resp->failed()) {
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
  if (ahead_ != nullptr) {  // stopping: the call sent ahead is not waited for on the workers
    ahead_->Cancel();
    (void)ahead_->Get();
    ahead_.reset();
  }
}

void Scheduler::SetEpochAndExpected(v1::StepRequest* step) {
  step->set_epoch(epoch_);
  MutexLock lock(&mu_);
  step->mutable_expected()->Reserve(static_cast<int>(running_.size()));
  for (const auto& [id, r] : running_) step->add_expected(id);
}

int64_t Scheduler::BlocksHeld(const GenRequest& r) const {
  if (kv_block_size_ <= 0) return 0;
  const int64_t tokens = r.req.prompt_token_ids_size() + static_cast<int64_t>(r.num_tokens()) + 1;
  return (tokens + kv_block_size_ - 1) / kv_block_size_;
}

bool Scheduler::SendAheadAllowed(int steps) {
  if (stop_ || !serving_()) return false;
  const auto now = clock_->Now();
  MutexLock lock(&mu_);
  if (wake_ || !pending_.empty()) return false;
  bool more = false;
  for (const auto& [id, r] : running_) {
    if (!Expiry(*r, now, "generating").ok() || r->stop_string) return false;
    if (r->req.max_tokens() - static_cast<int64_t>(r->num_tokens()) > steps) more = true;
  }
  return more;
}

}  // namespace moelora
