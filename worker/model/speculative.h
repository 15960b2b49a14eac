// Greedy decoding of one sequence with the model's MTP head drafting k tokens a step: the head
// drafts d1..dk (the first from the target's hidden state, the next ones from its own output),
// the target verifies [t, d1..dk] in one forward (keeping its recurrent states per token), the
// longest prefix of drafts equal to the target's own argmax is accepted with the target's next
// token, the rest rolled back (CausalLM::RollBack), and the head catches up over the accepted
// positions with the target's hidden states. Every token is the target's argmax: the output is
// greedy decoding's. The engine's batched speculation is built on these steps; this form serves
// the tests and the benchmark.
#ifndef MOELORA_WORKER_MODEL_SPECULATIVE_H_
#define MOELORA_WORKER_MODEL_SPECULATIVE_H_

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/causal_lm.h"

namespace moelora {

struct SpeculationStats {
  int64_t steps = 0;     // target verify forwards
  int64_t drafted = 0;   // draft tokens proposed
  int64_t accepted = 0;  // of them, accepted
};

// `max_tokens` new tokens after `prompt` (base model, no LoRA); k >= 1 drafts a step.
// FAILED_PRECONDITION for a model without an MTP head.
[[nodiscard]] absl::StatusOr<std::vector<int64_t>> GreedyWithMtp(
    CausalLM& m, const std::vector<int64_t>& prompt, int64_t max_tokens, int k,
    SpeculationStats* stats);

}  // namespace moelora

#endif  // MOELORA_WORKER_MODEL_SPECULATIVE_H_
