// The engine's step planner: how many tokens each running sequence computes in the next step,
// within --max-num-batched-tokens and the KV cache's free blocks. Decodes first, in admission
// order (with speculation, each with the drafts it verifies); a decode that finds no free block
// preempts the latest admitted sequence, which gives its blocks back and is recomputed later.
// Then chunks of prompts, in admission order, after their cached prefix (prefix caching), at most
// --prefill-tokens-beside-decodes tokens while sequences decode. Compute thread only.
#ifndef MOELORA_WORKER_ENGINE_STEP_PLANNER_H_
#define MOELORA_WORKER_ENGINE_STEP_PLANNER_H_

#include <cstdint>
#include <deque>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/engine/sequence.h"
#include "worker/engine/speculation.h"
#include "worker/layers/kv_cache.h"

namespace moelora {

struct StepPlan {
  std::vector<int64_t> take;    // per running sequence: tokens it computes (0: none this step)
  std::vector<int64_t> drafts;  // per running sequence: drafts its decode verifies
  int preempted = 0;
  // Prefix cache: prompt tokens looked up and found.
  int64_t prefix_queries = 0, prefix_hits = 0;
};

class StepPlanner {
 public:
  struct Settings {
    int64_t max_num_batched_tokens = 0;
    int64_t prefill_tokens_beside_decodes = 0;  // 0: the whole budget
    int64_t max_model_len = 0;
    bool prefix_caching = false;
  };
  StepPlanner(CausalLM* model, KvCache* kv, const Speculation* spec, const Settings& settings)
      : model_(model), kv_(kv), spec_(spec), settings_(settings) {}

  // Reserves the plan's blocks. INTERNAL, with `running` emptied, when no sequence can run and
  // none holds a block (unreachable while admission checks each sequence against the whole cache).
  [[nodiscard]] absl::StatusOr<StepPlan> Plan(std::deque<RunningSequence>& running) const;

 private:
  struct Pass;
  void PlanDecodes(Pass& p) const;
  void PlanPrompts(Pass& p) const;
  // Blocks of a prefix computed before under the same adapter, taken into the sequence's table;
  // returns the positions they hold.
  int64_t MatchPrefix(RunningSequence& s) const;

  CausalLM* model_;
  KvCache* kv_;
  const Speculation* spec_;
  Settings settings_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_ENGINE_STEP_PLANNER_H_
