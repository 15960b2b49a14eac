#include "tests/unit/worker/speculative_reference.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moelora {

namespace {

int64_t ArgMaxRow(const at::Tensor& logits, int64_t row) {
  return logits[row].argmax().item<int64_t>();
}

// A batch of one run of tokens per sequence (the head's or the target's), each run with its
// slot.
struct Runs {
  ForwardBatch b;
  void Add(SeqState* st, const std::vector<int64_t>& tokens, int32_t slot, bool all_logits,
           bool keep) {
    const auto begin = static_cast<int64_t>(b.tokens.size());
    const auto n = static_cast<int64_t>(tokens.size());
    b.tokens.insert(b.tokens.end(), tokens.begin(), tokens.end());
    b.slots.insert(b.slots.end(), n, slot);
    b.seqs.push_back({st, begin, n, all_logits, keep});
  }
};

}  // namespace

absl::Status StartDrafting(CausalLM& m, const ForwardBatch& prefill,
                           std::vector<DraftingSeq>& seqs) {
  if (!m.has_mtp()) return absl::FailedPreconditionError("the model has no MTP head");
  if (m.mtp_chained()) {
    return absl::FailedPreconditionError(
        "chained MTP heads (Step3.5) draft through the engine, not these steps");
  }
  if (prefill.seqs.size() != seqs.size()) {
    return absl::InvalidArgumentError("one prefill sequence per drafting sequence");
  }
  const at::Tensor hidden = m.last_hidden();
  if (!hidden.defined() || hidden.size(0) != static_cast<int64_t>(prefill.tokens.size())) {
    return absl::FailedPreconditionError("the last Forward was not this prefill");
  }
  Runs head;
  std::vector<at::Tensor> rows;
  for (size_t i = 0; i < seqs.size(); ++i) {
    const ForwardBatch::Seq& p = prefill.seqs[i];
    std::vector<int64_t> in(prefill.tokens.begin() + p.begin + 1,
                            prefill.tokens.begin() + p.begin + p.count);
    in.push_back(seqs[i].next);
    head.Add(seqs[i].state, in, -1, false, false);
    rows.push_back(hidden.narrow(0, p.begin, p.count));
  }
  at::Tensor out;
  MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, m.ForwardMtp(head.b, at::cat(rows, 0), &out));
  for (size_t i = 0; i < seqs.size(); ++i) {
    seqs[i].draft = ArgMaxRow(logits, static_cast<int64_t>(i));
    seqs[i].head_out = out[static_cast<int64_t>(i)];
  }
  return absl::OkStatus();
}

absl::Status SpeculativeGreedyStep(CausalLM& m, std::vector<DraftingSeq>& seqs, int k,
                                   SpeculationStats* stats) {
  if (k < 1) return absl::InvalidArgumentError(absl::StrCat("k ", k, ": at least one draft"));
  const auto S = static_cast<int64_t>(seqs.size());
  if (S == 0) return absl::OkStatus();
  std::vector<int64_t> head_len;
  std::vector<std::vector<int64_t>> drafts;
  std::vector<at::Tensor> outs;
  for (DraftingSeq& s : seqs) {
    head_len.push_back(s.state->mtp_len[0]);
    drafts.push_back({s.draft});
    outs.push_back(s.head_out);
  }
  // Drafts 2 .. k: every sequence's last draft through the head, from the head's own output.
  at::Tensor z = at::stack(outs, 0);
  for (int j = 1; j < k; ++j) {
    Runs head;
    for (int64_t i = 0; i < S; ++i) head.Add(seqs[i].state, {drafts[i].back()}, -1, false, false);
    at::Tensor z2;
    MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, m.ForwardMtp(head.b, z, &z2));
    for (int64_t i = 0; i < S; ++i) drafts[i].push_back(ArgMaxRow(logits, i));
    z = z2;
  }
  // Verify [next, d1 .. dk] of every sequence in one target forward.
  Runs verify;
  for (int64_t i = 0; i < S; ++i) {
    std::vector<int64_t> in = {seqs[i].next};
    in.insert(in.end(), drafts[i].begin(), drafts[i].end());
    verify.Add(seqs[i].state, in, seqs[i].slot, /*all_logits=*/true, /*keep=*/true);
  }
  MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, m.Forward(verify.b));
  const at::Tensor hidden = m.last_hidden();
  Runs head;
  std::vector<at::Tensor> rows;
  for (int64_t i = 0; i < S; ++i) {
    DraftingSeq& s = seqs[i];
    const int64_t base = i * (k + 1);
    int64_t a = 0;
    while (a < k && ArgMaxRow(logits, base + a) == drafts[i][a]) ++a;
    const int64_t bonus = ArgMaxRow(logits, base + a);
    if (stats != nullptr) {
      ++stats->steps;
      stats->drafted += k;
      stats->accepted += a;
    }
    MOELORA_RETURN_IF_ERROR(m.RollBack(*s.state, k + 1, a + 1));
    // The head's positions past head_len came from its own outputs: recompute them from the
    // target's hidden states of the accepted positions.
    s.state->mtp_len[0] = head_len[i];
    s.emitted.assign(drafts[i].begin(), drafts[i].begin() + a);
    s.emitted.push_back(bonus);
    s.next = bonus;
    head.Add(s.state, s.emitted, -1, false, false);
    rows.push_back(hidden.narrow(0, base, a + 1));
  }
  at::Tensor out;
  MOELORA_ASSIGN_OR_RETURN(at::Tensor dl, m.ForwardMtp(head.b, at::cat(rows, 0), &out));
  for (int64_t i = 0; i < S; ++i) {
    seqs[i].draft = ArgMaxRow(dl, i);
    seqs[i].head_out = out[i];
  }
  return absl::OkStatus();
}

absl::StatusOr<std::vector<int64_t>> GreedyWithMtp(CausalLM& m, const std::vector<int64_t>& prompt,
                                                   int64_t max_tokens, int k,
                                                   SpeculationStats* stats, int32_t slot) {
  if (!m.has_mtp()) return absl::FailedPreconditionError("the model has no MTP head");
  if (prompt.empty() || max_tokens < 1 || k < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("a prompt, max_tokens >= 1 and k >= 1 (k ", k, ")"));
  }
  SeqState st = m.NewState();
  Runs pre;
  pre.Add(&st, prompt, slot, /*all_logits=*/false, false);
  MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, m.Forward(pre.b));
  std::vector<DraftingSeq> seqs(1);
  seqs[0].state = &st;
  seqs[0].slot = slot;
  seqs[0].next = ArgMaxRow(logits, 0);
  std::vector<int64_t> out = {seqs[0].next};
  MOELORA_RETURN_IF_ERROR(StartDrafting(m, pre.b, seqs));
  while (static_cast<int64_t>(out.size()) < max_tokens) {
    MOELORA_RETURN_IF_ERROR(SpeculativeGreedyStep(m, seqs, k, stats));
    out.insert(out.end(), seqs[0].emitted.begin(), seqs[0].emitted.end());
  }
  out.resize(max_tokens);
  return out;
}

}  // namespace moelora
