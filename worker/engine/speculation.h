// The engine's speculative decoding with the checkpoint's MTP head(s) (--speculative-config):
// drafts before the step's forward, and after it the rejected drafts' positions given back and
// the heads run over what the target kept, to draft the next step's tokens. The step planner
// decides how many drafts each decode verifies; the sampler verifies them (Sampler::Verify).
// Compute thread only.
#ifndef MOELORA_WORKER_ENGINE_SPECULATION_H_
#define MOELORA_WORKER_ENGINE_SPECULATION_H_

#include <cstdint>
#include <set>
#include <vector>

#include "absl/status/status.h"
#include "worker/engine/sequence.h"

namespace moelora {

// What the step computed for the sequences of its batch (one entry per b.seqs entry), as the
// speculation needs it after the forward.
struct VerifiedStep {
  std::vector<int64_t> drafts;               // drafts each entry verified (0: prompt chunk or none)
  std::vector<char> was_prefilling;          // the entry read a prompt chunk
  std::vector<std::vector<int32_t>> tokens;  // the entry's tokens: kept drafts, then its own
  std::vector<int64_t> head_len;             // the head's positions before the step
  std::set<int64_t> finished;                // sequence ids that finished in the step
};

class Speculation {
 public:
  // `k`: drafts per decode step (0: off).
  Speculation(CausalLM* model, int k) : model_(model), k_(k) {}

  int k() const { return k_; }
  // The MTP heads a sequence runs (0: none).
  int HeadsRun() const;
  // The first position any head computes next (else the sequence's length): their keys and
  // values before it are final, and their queries from it reach back a sliding window.
  int64_t HeadsFrom(const RunningSequence& s) const;
  // How many drafts a decode may verify this step, within `spare` tokens of the step's budget
  // and what max_tokens and `max_model_len` leave room for (before the KV cache is asked).
  int64_t DraftsFor(const RunningSequence& s, int64_t spare, int64_t max_model_len) const;
  // A preempted sequence drafts again once the head has run over its recomputed feed.
  static void Forget(RunningSequence& s);

  // The decode's tokens after `pending`: the head's first draft, then the chained heads' drafts
  // or placeholders that DraftMore fills.
  void AppendDrafts(const RunningSequence& s, int64_t d, std::vector<int64_t>* tokens) const;
  // Before the forward (a reused head): drafts 2 .. d of the batch's decodes with d drafts, each
  // sequence's last draft through the head from the head's own last output, the sequences
  // batched, while any needs more.
  [[nodiscard]] absl::Status DraftMore(ForwardBatch& b, const std::vector<RunningSequence*>& seqs,
                                       const std::vector<int64_t>& drafts,
                                       const std::vector<int64_t>& head_len);
  // After the step's tokens: every sequence of the batch that drafts gives back the positions of
  // its rejected drafts (recurrent states included), and the head runs over the positions the
  // target computed and kept with the target's hidden states there, its inputs the tokens one
  // position on. A sequence past its feed gets its next draft and head output.
  [[nodiscard]] absl::Status AfterVerify(const ForwardBatch& b,
                                         const std::vector<RunningSequence*>& seqs,
                                         const VerifiedStep& v);

 private:
  absl::Status AfterVerifyChained(const ForwardBatch& b, const std::vector<RunningSequence*>& seqs,
                                  const VerifiedStep& v);
  CausalLM* model_;
  int k_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_ENGINE_SPECULATION_H_
