#include "worker/model/speculative.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moelora {

namespace {

ForwardBatch OneSeq(SeqState* st, std::vector<int64_t> tokens, bool all_logits, bool keep) {
  ForwardBatch b;
  const auto n = static_cast<int64_t>(tokens.size());
  b.tokens = std::move(tokens);
  b.slots.assign(n, -1);
  b.seqs.push_back({st, 0, n, all_logits, keep});
  return b;
}

int64_t ArgMaxRow(const at::Tensor& logits, int64_t row) {
  return logits[row].argmax().item<int64_t>();
}

}  // namespace

absl::StatusOr<std::vector<int64_t>> GreedyWithMtp(CausalLM& m, const std::vector<int64_t>& prompt,
                                                   int64_t max_tokens, int k,
                                                   SpeculationStats* stats) {
  if (!m.has_mtp()) return absl::FailedPreconditionError("the model has no MTP head");
  if (prompt.empty() || max_tokens < 1 || k < 1) {
    return absl::InvalidArgumentError(absl::StrCat("a prompt, max_tokens >= 1 and k >= 1 (k ", k,
                                                   ")"));
  }
  SpeculationStats local;
  SpeculationStats& s = stats != nullptr ? *stats : local;
  SeqState st = m.NewState();
  const auto n = static_cast<int64_t>(prompt.size());
  // Prefill: the target over the prompt, its first token, then the head over positions
  // 0 .. n - 1 (tokens 1 .. n, the last the token just chosen): the first draft.
  ForwardBatch pre = OneSeq(&st, prompt, /*all_logits=*/true, false);
  MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, m.Forward(pre));
  at::Tensor hidden = m.last_hidden();
  int64_t t = ArgMaxRow(logits, n - 1);
  std::vector<int64_t> out = {t};
  std::vector<int64_t> head_in(prompt.begin() + 1, prompt.end());
  head_in.push_back(t);
  at::Tensor z;
  ForwardBatch hb = OneSeq(&st, head_in, false, false);
  MOELORA_ASSIGN_OR_RETURN(at::Tensor draft, m.ForwardMtp(hb, hidden, &z));
  while (static_cast<int64_t>(out.size()) < max_tokens) {
    // Drafts: d1 from the target's hidden state, d2.. from the head's own output.
    const int64_t head_len = st.mtp_len;
    std::vector<int64_t> d = {ArgMaxRow(draft, 0)};
    for (int i = 1; i < k; ++i) {
      ForwardBatch b = OneSeq(&st, {d.back()}, false, false);
      at::Tensor z2;
      MOELORA_ASSIGN_OR_RETURN(at::Tensor dl, m.ForwardMtp(b, z, &z2));
      d.push_back(ArgMaxRow(dl, 0));
      z = z2;
    }
    // Verify [t, d1 .. dk] in one target forward, every row's logits, states kept per token.
    std::vector<int64_t> verify = {t};
    verify.insert(verify.end(), d.begin(), d.end());
    ForwardBatch vb = OneSeq(&st, verify, /*all_logits=*/true, /*keep=*/true);
    MOELORA_ASSIGN_OR_RETURN(at::Tensor vl, m.Forward(vb));
    const at::Tensor vh = m.last_hidden();
    int64_t a = 0;
    while (a < k && ArgMaxRow(vl, a) == d[a]) ++a;
    const int64_t bonus = ArgMaxRow(vl, a);
    ++s.steps;
    s.drafted += k;
    s.accepted += a;
    MOELORA_RETURN_IF_ERROR(m.RollBack(st, k + 1, a + 1));
    // The head's positions past head_len were computed from its own outputs: recompute them
    // from the target's hidden states of the accepted positions.
    st.mtp_len = head_len;
    std::vector<int64_t> accepted(d.begin(), d.begin() + a);
    accepted.push_back(bonus);
    out.insert(out.end(), accepted.begin(), accepted.end());
    ForwardBatch cb = OneSeq(&st, accepted, false, false);
    MOELORA_ASSIGN_OR_RETURN(draft, m.ForwardMtp(cb, vh.narrow(0, 0, a + 1), &z));
    t = bonus;
  }
  out.resize(max_tokens);
  return out;
}

}  // namespace moelora
