#include "worker/engine/step_planner.h"

#include <algorithm>

namespace moelora {

// One Plan call: the running sequences, the plan so far and the token budget left.
struct StepPlanner::Pass {
  std::deque<RunningSequence>& running;
  StepPlan& plan;
  int64_t budget;
  size_t size() const { return running.size(); }
  // The latest admitted sequence holding blocks, after `after` (or `after` itself).
  size_t Victim(size_t after) const {
    for (size_t j = size(); j-- > after + 1;) {
      if (running[j].state.table.Holds()) return j;
    }
    return after;
  }
  // Recomputed from the start: the prompt and every token sampled, the last of which (the
  // pending one) is fed last, so the next sample is the one its decode step would have made.
  void Preempt(size_t j, CausalLM& model) {
    RunningSequence& v = running[j];
    v.feed = v.history;
    v.fed = 0;
    v.recompute = true;
    v.state = model.NewState();  // frees its blocks
    Speculation::Forget(v);      // the head runs over the recomputed feed again
    plan.take[j] = 0;
    plan.drafts[j] = 0;
    ++plan.preempted;
  }
};

absl::StatusOr<StepPlan> StepPlanner::Plan(std::deque<RunningSequence>& running) const {
  StepPlan plan;
  plan.take.assign(running.size(), 0);
  plan.drafts.assign(running.size(), 0);
  Pass p{running, plan, settings_.max_num_batched_tokens};
  for (;;) {
    PlanDecodes(p);
    PlanPrompts(p);
    if (std::any_of(plan.take.begin(), plan.take.end(), [](int64_t t) { return t > 0; })) break;
    // Nothing could run: every block is held by prompts still being read. The latest admitted
    // one gives its blocks back (each sequence fits the cache alone: checked at admission).
    const size_t j = p.Victim(0);
    if (!running[j].state.table.Holds()) {
      // Should it happen, drop the batch as a failed forward does, so no sequence is left behind.
      running.clear();
      return absl::InternalError("the KV cache is full and no sequence holds a block");
    }
    p.Preempt(j, *model_);
  }
  return plan;
}

// With speculation, a decode also verifies its drafts, out of what the budget holds beyond one
// token per decode and the prompt tokens waiting (up to what a step reads beside decodes: drafts
// may be rejected, prompt tokens are progress), in admission order, where free blocks allow
// (drafts never preempt).
void StepPlanner::PlanDecodes(Pass& p) const {
  int64_t spare = p.budget, waiting = 0;
  for (size_t i = 0; i < p.size(); ++i) {
    const RunningSequence& s = p.running[i];
    if (p.plan.take[i] > 0) continue;
    if (s.Prefilling()) {
      waiting += static_cast<int64_t>(s.feed.size() - s.fed);
    } else {
      --spare;
    }
  }
  if (settings_.prefill_tokens_beside_decodes > 0) {
    waiting = std::min<int64_t>(waiting, settings_.prefill_tokens_beside_decodes);
  }
  spare -= waiting;
  for (size_t i = 0; i < p.size() && p.budget > 0; ++i) {
    RunningSequence& s = p.running[i];
    if (s.Prefilling() || p.plan.take[i] > 0) continue;
    int64_t d = spec_->DraftsFor(s, spare, settings_.max_model_len);
    if (d > 0 && !kv_->Reserve(s.state.table, s.state.len + 1 + d)) d = 0;
    bool self = false;
    while (!kv_->Reserve(s.state.table, s.state.len + 1)) {
      const size_t j = p.Victim(i);
      p.Preempt(j, *model_);
      if (j == i) {
        self = true;
        break;
      }
    }
    if (self) continue;
    p.plan.take[i] = 1 + d;
    p.plan.drafts[i] = d;
    spare -= d;
    p.budget -= 1 + d;
  }
}

void StepPlanner::PlanPrompts(Pass& p) const {
  // While sequences decode, a step reads at most --prefill-tokens-beside-decodes prompt tokens,
  // so a long prompt cannot stretch their inter-token time to its chunk's.
  int64_t decodes = 0;
  for (int64_t t : p.plan.take) decodes += t;
  if (decodes > 0 && settings_.prefill_tokens_beside_decodes > 0) {
    p.budget = std::min<int64_t>(p.budget, settings_.prefill_tokens_beside_decodes);
  }
  for (size_t i = 0; i < p.size() && p.budget > 0; ++i) {
    RunningSequence& s = p.running[i];
    if (!s.Prefilling() || p.plan.take[i] > 0) continue;
    // (Not for prompts with images: their image tokens are all the same id.)
    if (settings_.prefix_caching && s.fed == 0 && !s.state.table.Holds() && s.images.empty() &&
        !(s.spec.return_prompt_logits && !s.recompute)) {
      const int64_t hit = MatchPrefix(s);
      s.state.len = hit;
      s.fed = static_cast<size_t>(hit);
      p.plan.prefix_queries += static_cast<int64_t>(s.feed.size());
      p.plan.prefix_hits += hit;
    }
    const int64_t fits = (static_cast<int64_t>(s.state.table.blocks.size()) + kv_->free_blocks()) *
                             kv_->block_size() -
                         s.state.len;
    const int64_t n =
        std::min<int64_t>({static_cast<int64_t>(s.feed.size() - s.fed), p.budget, fits});
    if (n <= 0) break;  // later sequences wait for this one's blocks
    if (!kv_->Reserve(s.state.table, s.state.len + n)) break;
    p.plan.take[i] = n;
    p.budget -= n;
  }
}

int64_t StepPlanner::MatchPrefix(RunningSequence& s) const {
  int64_t hit = kv_->Match(s.spec.adapter_id, s.feed, s.state.table);
  if (const int heads = spec_->HeadsRun(); heads > 0 && hit > 0) {
    // Head j's keys and values at position p came from token p + 1 + j: a cached block serves
    // the heads only where the prompt matches `heads` tokens past it too.
    const int64_t B = kv_->block_size();
    const int64_t usable = std::max<int64_t>(0, (hit - heads) / B * B);
    if (usable < hit) {
      kv_->Release(s.state.table);
      hit = usable == 0
                ? 0
                : kv_->Match(s.spec.adapter_id,
                             std::vector<int32_t>(s.feed.begin(), s.feed.begin() + usable + 1),
                             s.state.table);
    }
    for (int h = 0; h < heads; ++h) s.state.mtp_len[static_cast<size_t>(h)] = hit;
  }
  return hit;
}

}  // namespace moelora
