// A reference for the engine's speculation (worker/engine/speculation.h), written apart from it:
// greedy speculative decoding with the model's MTP head, as steps over a batch of sequences:
// the head drafts d1..dk for each (the first from the target's hidden state, the next ones from
// its own output), the target verifies [t, d1..dk] of every sequence in one forward, with each
// sequence's LoRA slot and its recurrent states kept per token, the longest prefix of drafts
// equal to the target's own argmax is accepted with the target's next token, the rest rolled
// back (CausalLM::RollBack), and the head catches up over the accepted positions with the
// target's hidden states. Every token is the target's argmax: the output is greedy decoding's.
// The head runs unadapted. Only tests call these (mtp_test, against greedy decoding without
// drafts).
#ifndef MOELORA_TESTS_UNIT_WORKER_SPECULATIVE_REFERENCE_H_
#define MOELORA_TESTS_UNIT_WORKER_SPECULATIVE_REFERENCE_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "absl/status/statusor.h"
#include "worker/model/causal_lm.h"

namespace moelora {

struct SpeculationStats {
  int64_t steps = 0;     // verify forwards (one per sequence and step)
  int64_t drafted = 0;   // draft tokens proposed
  int64_t accepted = 0;  // of them, accepted
};

// A sequence that decodes with drafts: `next` is the token the target chose last (not yet
// forwarded), `draft` the head's draft of the token after it and `head_out` [hidden] the head's
// output there (the input of its next draft).
struct DraftingSeq {
  SeqState* state = nullptr;
  int32_t slot = -1;  // the target's LoRA slot (-1: the base model)
  int64_t next = -1;
  int64_t draft = -1;
  at::Tensor head_out;
  std::vector<int64_t> emitted;  // what the last step produced: accepted drafts, then next
};

// After the target's Forward over `prefill` (whole prompts, one ForwardBatch::Seq per entry of
// `seqs`, in order; m.last_hidden() from it) and each sequence's `next` set from its logits: the
// head over each prompt's positions (its tokens 1 .. n - 1, then next), which gives `draft` and
// `head_out`. Each state's mtp_len must be where the prompt began.
[[nodiscard]] absl::Status StartDrafting(CausalLM& m, const ForwardBatch& prefill,
                                         std::vector<DraftingSeq>& seqs);

// One step of every sequence with k >= 1 drafts each; fills `emitted` (1 .. k + 1 tokens) and
// moves next, draft and head_out on.
[[nodiscard]] absl::Status SpeculativeGreedyStep(CausalLM& m, std::vector<DraftingSeq>& seqs, int k,
                                                 SpeculationStats* stats);

// `max_tokens` new tokens after `prompt` for one sequence on `slot` through the steps above.
// FAILED_PRECONDITION for a model without an MTP head.
[[nodiscard]] absl::StatusOr<std::vector<int64_t>> GreedyWithMtp(CausalLM& m,
                                                                 const std::vector<int64_t>& prompt,
                                                                 int64_t max_tokens, int k,
                                                                 SpeculationStats* stats,
                                                                 int32_t slot = -1);

}  // namespace moelora

#endif  // MOELORA_TESTS_UNIT_WORKER_SPECULATIVE_REFERENCE_H_
