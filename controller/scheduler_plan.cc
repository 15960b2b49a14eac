// The scheduler's plan: what the next step call carries (joiners, leavers, the number of decode
// steps) and the adapter swap-ins that waiting requests need.
#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "controller/scheduler.h"

namespace moelora {

Scheduler::Next Scheduler::Plan(Pass* pass) {
  if (const Next n = WaitForWork(); n != Next::kStep) return n;
  // Deferred unloads whose last request has finished (calls the workers: no lock held).
  adapters_->RunDeferredUnloads();
  // The workers' KV cache, for admission: read (a copy of their Info) only while requests wait
  // to be admitted.
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
      return Next::kAgain;
    }
    const auto now = clock_->Now();
    Expire(now, pass);
    Admit(now, pass);
    metrics_->queue_depth.Set(static_cast<double>(pending_.size()));
    metrics_->running.Set(static_cast<double>(running_.size() + pass->admitted.size()));
    AddJoiners(pass);
    for (const auto& [id, r] : running_) {
      if (!r->adapter.empty()) pass->in_use.insert(r->adapter);
    }
    if (!pass->admitted.empty() || !pass->ended.empty()) UpdateLoraInfo();  // the batch changed
  }
  for (auto& [r, s] : pass->ended) Finish(r, s, s.ok() ? "stop" : "");
  StartSwapIns(*pass);
  int nseq;
  {
    MutexLock lock(&mu_);
    nseq = static_cast<int>(running_.size());
    pass->queued = !pending_.empty();
  }
  v1::StepRequest& step = pass->step;
  // With nothing to run, a step is still sent when the workers must drop what they hold (after a
  // start or a group restart): sequences of a controller that died stay otherwise.
  if (nseq == 0 && step.remove().empty() && !sweep_) {
    // Nothing runs and what waits needs a swap-in under way (SwapDone wakes the loop) or a slot
    // (a leaked one that reconciliation frees): look again on a tick or a Wake, not in a spin.
    MutexLock lock(&mu_);
    if (!wake_ && !stop_) clock_->WaitFor(&cv_, &mu_, std::chrono::milliseconds(20));
    return Next::kAgain;
  }
  step.set_step(++step_no_);
  sweep_ = false;
  SetEpochAndExpected(&step);
  // Several decode steps in one call while nobody waits to join: a joiner's prefill step then
  // returns its first token at once, and a queued request is not held back by up to
  // decode_steps_ steps. Stop strings and cancellations are seen between calls; the tokens a
  // sequence produced past them are dropped (GenRequest keeps the text up to the stop).
  if (decode_steps_ > 1 && pass->admitted.empty() && !pass->queued) {
    step.set_decode_steps(decode_steps_);
  }
  return Next::kStep;
}

Scheduler::Next Scheduler::WaitForWork() {
  adapters_->ReconcileIfNeeded();
  MutexLock lock(&mu_);
  auto has_work = [this]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    return stop_ || wake_ || !pending_.empty() || !running_.empty();
  };
  // A 20 ms tick at most while idle, so deferred unloads and reconciliation still happen.
  if (!has_work()) clock_->WaitFor(&cv_, &mu_, std::chrono::milliseconds(20));
  wake_ = false;
  if (stop_) return Next::kStop;
  // An idle engine waits until no request has arrived for batch_window_ (at most
  // batch_window_max_ after the oldest arrival), so that a burst of requests starts as one
  // prefill step rather than a small one and a large one: each prefill step reads every expert
  // its tokens touch. A burst of concurrent clients arrives spread over a few ms, so a fixed
  // window after the first arrival split it. Never while sequences run.
  if (batch_window_.count() > 0 && running_.empty() && !pending_.empty() &&
      static_cast<int>(pending_.size()) < max_num_seqs_) {
    Clock::TimePoint newest = pending_.front()->arrival;
    for (const auto& p : pending_) newest = std::max(newest, p->arrival);
    const auto due =
        std::min(newest + batch_window_, pending_.front()->arrival + batch_window_max_);
    if (clock_->Now() < due) {
      clock_->WaitUntil(&cv_, &mu_, due);
      return Next::kAgain;
    }
  }
  return Next::kStep;
}

void Scheduler::Expire(Clock::TimePoint now, Pass* pass) {
  for (auto it = running_.begin(); it != running_.end();) {
    const absl::Status s = it->second->Expiry(now, "generating");
    if (!s.ok() || it->second->stop_string) {
      pass->step.add_remove(it->first);
      pass->ended.push_back({it->second, s});
      it = running_.erase(it);
    } else {
      ++it;
    }
  }
  for (auto it = pending_.begin(); it != pending_.end();) {
    const absl::Status s = (*it)->Expiry(now, "queued");
    if (!s.ok()) {
      pass->ended.push_back({*it, s});
      it = pending_.erase(it);
    } else {
      ++it;
    }
  }
}

// Admission in arrival order, while the workers' KV cache has blocks for the next prompt next to
// what the running sequences hold (the workers preempt when decodes outgrow it; with nothing
// running the first goes in: it fits the cache alone, checked at submission). A request whose
// adapter is in no slot waits for a swap-in (the oldest such one's, below) and the requests
// behind it go first while their adapters are resident, until it has waited --max-bypass-ms:
// then nothing behind it goes first, so running sequences end and free a slot for it.
void Scheduler::Admit(Clock::TimePoint now, Pass* pass) {
  std::vector<std::shared_ptr<GenRequest>>& admitted = pass->admitted;
  std::vector<std::string>& swap = pass->swap;
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
        pass->ended.push_back({next, absl::NotFoundError("adapter unloaded")});
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
}

void Scheduler::AddJoiners(Pass* pass) {
  for (auto& r : pass->admitted) {
    v1::SequenceSpec* s = pass->step.add_add();
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
}

// Waiting requests need slots: their swap-ins start here, where `in_use` is current, and finish
// on swap_pool_ while steps go on (SwapDone wakes the loop). Not while this step still has to
// remove sequences from the workers: a victim's slot can only be freed once no worker sequence
// uses it (the swap starts on the next pass).
void Scheduler::StartSwapIns(const Pass& pass) {
  if (!pass.step.remove().empty()) return;
  for (const std::string& name : pass.swap) {
    AdapterManager::SwapPlan plan;
    const AdapterManager::SwapStart st = adapters_->BeginSwapIn(name, pass.in_use, &plan);
    if (st == AdapterManager::SwapStart::kWait) break;  // every slot is busy
    if (st != AdapterManager::SwapStart::kStarted) continue;
    {
      MutexLock lock(&mu_);
      swapping_.insert(name);
    }
    swap_pool_->Post([this, plan] { SwapDone(plan.name, adapters_->FinishSwapIn(plan)); });
  }
}

}  // namespace moelora
