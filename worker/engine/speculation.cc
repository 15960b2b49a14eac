#include "worker/engine/speculation.h"

#include <algorithm>
#include <array>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"

namespace moelora {

namespace {

// A head batch's multimodal inputs: each token's RoPE streams (those of its position in its
// sequence) and, where its input is an image token, the tower's embedding of that token, as
// the target read it.
struct HeadInputs {
  std::vector<std::array<int64_t, 3>> pos;
  bool mm = false;
  std::vector<int64_t> rows;
  std::vector<at::Tensor> embeds;
  // The batch's next token: position p of `s`, its input the token at position q.
  absl::Status Add(const RunningSequence& s, int64_t p, int64_t q) {
    const auto row = static_cast<int64_t>(pos.size());
    pos.push_back(s.Position(p));
    mm = mm || !s.pos3.empty();
    for (const RunningSequence::Image& im : s.images) {
      if (q < im.offset || q >= im.offset + im.tokens) continue;
      if (!im.encoded.embeds.defined()) {
        return absl::InternalError("the MTP head reads an image the tower has not encoded");
      }
      rows.push_back(row);
      embeds.push_back(im.encoded.embeds[q - im.offset]);
    }
    return absl::OkStatus();
  }
  void Into(ForwardBatch& h) const {
    if (mm) {
      const auto T = static_cast<int64_t>(pos.size());
      h.positions3.resize(3 * T);
      for (int64_t i = 0; i < T; ++i) {
        for (int r = 0; r < 3; ++r) h.positions3[r * T + i] = pos[i][r];
      }
    }
    if (!rows.empty()) {
      h.visual_rows = rows;
      h.visual_embeds = at::stack(embeds, 0);
    }
  }
};

// The forward kept the target's hidden states of every token of `b` (the heads' input).
absl::StatusOr<at::Tensor> TargetHidden(const CausalLM& model, const ForwardBatch& b) {
  at::Tensor hidden = model.last_hidden();
  if (!hidden.defined() || hidden.size(0) != static_cast<int64_t>(b.tokens.size())) {
    return absl::InternalError("the forward kept no hidden states for the MTP head");
  }
  return hidden;
}

}  // namespace

int Speculation::HeadsRun() const {
  if (k_ == 0) return 0;
  return model_->mtp_chained() ? std::min(k_, model_->mtp_heads()) : 1;
}

int64_t Speculation::HeadsFrom(const RunningSequence& s) const {
  int64_t from = s.state.len;
  for (int h = 0; h < HeadsRun(); ++h) {
    from = std::min(from, s.state.mtp_len[static_cast<size_t>(h)]);
  }
  return from;
}

int64_t Speculation::DraftsFor(const RunningSequence& s, int64_t spare,
                               int64_t max_model_len) const {
  if (s.draft < 0) return 0;
  int64_t d = std::min<int64_t>(
      {k_, spare, max_model_len - 2 - s.state.len,
       s.spec.max_tokens > 0 ? s.spec.max_tokens - s.generated - 1 : int64_t{k_}});
  if (model_->mtp_chained())
    d = std::min<int64_t>(d, 1 + static_cast<int64_t>(s.more_drafts.size()));
  return std::max<int64_t>(d, 0);
}

void Speculation::Forget(RunningSequence& s) {
  s.draft = -1;
  s.head_out = at::Tensor();
  s.more_drafts.clear();
  s.chain_out.clear();
}

void Speculation::AppendDrafts(const RunningSequence& s, int64_t d,
                               std::vector<int64_t>* tokens) const {
  tokens->push_back(s.draft);
  if (model_->mtp_chained()) {
    tokens->insert(tokens->end(), s.more_drafts.begin(), s.more_drafts.begin() + (d - 1));
  } else {
    tokens->insert(tokens->end(), d - 1, -1);
  }
}

absl::Status Speculation::DraftMore(ForwardBatch& b, const std::vector<RunningSequence*>& seqs,
                                    const std::vector<int64_t>& drafts,
                                    const std::vector<int64_t>& head_len) {
  std::vector<size_t> who;  // b.seqs entries still drafting
  std::vector<at::Tensor> rows;
  for (size_t k = 0; k < b.seqs.size(); ++k) {
    if (drafts[k] < 2) continue;
    if (b.seqs[k].state->mtp_len[0] != head_len[k]) {
      return absl::InternalError("head out of step");
    }
    who.push_back(k);
    rows.push_back(seqs[k]->head_out);
  }
  if (who.empty()) return absl::OkStatus();
  at::Tensor z = at::stack(rows, 0);
  for (int64_t j = 1; !who.empty(); ++j) {
    ForwardBatch h;
    HeadInputs mm;
    for (size_t k : who) {
      h.seqs.push_back({b.seqs[k].state, static_cast<int64_t>(h.tokens.size()), 1, false, false});
      h.tokens.push_back(b.tokens[b.seqs[k].begin + j]);
      h.slots.push_back(seqs[k]->head_slot);
      const int64_t p = b.seqs[k].state->mtp_len[0];  // a draft (text) after the prompt
      MOELORA_RETURN_IF_ERROR(mm.Add(*seqs[k], p, p + 1));
    }
    mm.Into(h);
    at::Tensor z2;
    MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, model_->ForwardMtp(h, z, &z2));
    std::vector<size_t> more;
    std::vector<int64_t> keep;
    for (size_t i = 0; i < who.size(); ++i) {
      const size_t k = who[i];
      b.tokens[b.seqs[k].begin + j + 1] = logits[static_cast<int64_t>(i)].argmax().item<int64_t>();
      if (drafts[k] > j + 1) {
        more.push_back(k);
        keep.push_back(static_cast<int64_t>(i));
      }
    }
    if (!more.empty()) z = z2.index_select(0, at::tensor(keep, at::kLong).to(z2.device()));
    who = std::move(more);
  }
  return absl::OkStatus();
}

// The positions the head runs over: a prompt chunk's, or a decode's kept drafts and the
// target's own token, with the target's hidden states there, its inputs the tokens one position
// on (the next chunk's first, or the sampled token).
absl::Status Speculation::AfterVerify(const ForwardBatch& b,
                                      const std::vector<RunningSequence*>& seqs,
                                      const VerifiedStep& v) {
  if (model_->mtp_chained()) return AfterVerifyChained(b, seqs, v);
  MOELORA_ASSIGN_OR_RETURN(const at::Tensor hidden, TargetHidden(*model_, b));
  ForwardBatch h;
  HeadInputs mm;
  std::vector<at::Tensor> rows;
  std::vector<RunningSequence*> heads;
  for (size_t k = 0; k < b.seqs.size(); ++k) {
    RunningSequence& s = *seqs[k];
    if (v.finished.count(s.spec.id)) continue;
    const ForwardBatch::Seq& f = b.seqs[k];
    std::vector<int64_t> in;
    int64_t count = f.count;
    if (v.was_prefilling[k]) {
      in.assign(b.tokens.begin() + f.begin + 1, b.tokens.begin() + f.begin + f.count);
      in.push_back(s.Prefilling() ? s.feed[s.fed] : v.tokens[k].front());
    } else {
      count = static_cast<int64_t>(v.tokens[k].size());
      if (v.drafts[k] > 0) {
        MOELORA_RETURN_IF_ERROR(model_->RollBack(s.state, v.drafts[k] + 1, count));
      }
      in.assign(v.tokens[k].begin(), v.tokens[k].end());
    }
    s.state.mtp_len[0] = v.head_len[k];
    if (v.head_len[k] != s.state.len - count) return absl::InternalError("head out of step");
    h.seqs.push_back({&s.state, static_cast<int64_t>(h.tokens.size()), count, false, false});
    h.tokens.insert(h.tokens.end(), in.begin(), in.end());
    h.slots.insert(h.slots.end(), count, s.head_slot);
    for (int64_t i = 0; i < count; ++i) {
      MOELORA_RETURN_IF_ERROR(mm.Add(s, v.head_len[k] + i, v.head_len[k] + i + 1));
    }
    rows.push_back(hidden.narrow(0, f.begin, count));
    heads.push_back(&s);
  }
  if (heads.empty()) return absl::OkStatus();
  mm.Into(h);
  at::Tensor z;
  MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, model_->ForwardMtp(h, at::cat(rows, 0), &z));
  for (size_t i = 0; i < heads.size(); ++i) {
    RunningSequence& s = *heads[i];
    if (s.Prefilling()) continue;
    s.draft = logits[static_cast<int64_t>(i)].argmax().item<int64_t>();
    s.head_out = z[static_cast<int64_t>(i)];
  }
  return absl::OkStatus();
}

// Chained heads (Step3.5): after the rejected drafts' positions are given back, each head j in
// turn runs over its positions from where it stopped up to the target's last, batched over the
// sequences. Head j at position p reads token p + 1 + j (known, or for the last j positions of a
// decode the drafts of the heads before it) and head j - 1's output at p (head 0: the target's
// hidden state). It keeps its positions up to the last one whose token is known (the others are
// computed again next step) and its output there (the next step's input of head j + 1 one
// position back). A sequence past its feed gets drafts 1 .. k: each head's argmax at the target's
// last position.
absl::Status Speculation::AfterVerifyChained(const ForwardBatch& b,
                                             const std::vector<RunningSequence*>& batch,
                                             const VerifiedStep& v) {
  MOELORA_ASSIGN_OR_RETURN(const at::Tensor hidden, TargetHidden(*model_, b));
  std::vector<RunningSequence*> seqs;
  // Per sequence: the previous head's outputs of this pass (the target's hidden states for
  // head 0), over positions prev_at .. prev_at + rows - 1.
  std::vector<at::Tensor> prev;
  std::vector<int64_t> prev_at;
  for (size_t k = 0; k < b.seqs.size(); ++k) {
    RunningSequence& s = *batch[k];
    if (!s.images.empty() || v.finished.count(s.spec.id)) continue;
    const ForwardBatch::Seq& f = b.seqs[k];
    int64_t count = f.count;
    if (!v.was_prefilling[k]) {
      count = static_cast<int64_t>(v.tokens[k].size());
      if (v.drafts[k] > 0) {
        MOELORA_RETURN_IF_ERROR(model_->RollBack(s.state, v.drafts[k] + 1, count));
      }
    }
    if (s.state.mtp_len[0] != s.state.len - count) {
      return absl::InternalError("head out of step");
    }
    seqs.push_back(&s);
    prev.push_back(hidden.narrow(0, f.begin, count));
    prev_at.push_back(s.state.len - count);
  }
  const int heads = std::min(k_, model_->mtp_heads());
  std::vector<std::vector<int64_t>> drafts(seqs.size());
  for (int j = 0; j < heads; ++j) {
    const auto J = static_cast<size_t>(j);
    ForwardBatch h;
    std::vector<at::Tensor> rows;
    std::vector<size_t> who;
    std::vector<int64_t> from, real;
    for (size_t i = 0; i < seqs.size(); ++i) {
      RunningSequence& s = *seqs[i];
      s.chain_out.resize(static_cast<size_t>(heads));
      const int64_t H = s.state.len, K = static_cast<int64_t>(s.history.size());
      const int64_t a = s.state.mtp_len[J];
      const int64_t real_end = std::min(H, K - 1 - j);
      const int64_t end = s.Prefilling() ? real_end : H;
      if (end <= a) {
        prev[i] = at::Tensor();
        prev_at[i] = a;
        continue;
      }
      if (real_end < a || a < prev_at[i] - 1 || (a < prev_at[i] && j == 0) ||
          (a < prev_at[i] && !s.chain_out[J - 1].defined())) {
        return absl::InternalError(absl::StrCat("MTP head ", j, " out of step"));
      }
      std::vector<at::Tensor> in;
      if (a < prev_at[i]) in.push_back(s.chain_out[J - 1].unsqueeze(0));
      if (end > prev_at[i]) in.push_back(prev[i].narrow(0, 0, end - prev_at[i]));
      rows.push_back(in.size() == 1 ? in[0] : at::cat(in, 0));
      h.seqs.push_back({&s.state, static_cast<int64_t>(h.tokens.size()), end - a, false, false});
      for (int64_t p = a; p < end; ++p) {
        const int64_t q = p + 1 + j;
        h.tokens.push_back(q < K ? s.history[static_cast<size_t>(q)]
                                 : drafts[i][static_cast<size_t>(q - K)]);
      }
      h.slots.insert(h.slots.end(), end - a, s.head_slot);
      who.push_back(i);
      from.push_back(a);
      real.push_back(real_end);
    }
    if (who.empty()) break;
    at::Tensor z;
    MOELORA_ASSIGN_OR_RETURN(at::Tensor logits,
                             model_->ForwardMtp(h, at::cat(rows, 0), &z, j, /*every_row=*/true));
    for (size_t w = 0; w < who.size(); ++w) {
      const size_t i = who[w];
      RunningSequence& s = *seqs[i];
      const ForwardBatch::Seq& hs = h.seqs[w];
      prev[i] = z.narrow(0, hs.begin, hs.count);
      prev_at[i] = from[w];
      s.state.mtp_len[J] = real[w];
      if (real[w] - 1 >= from[w]) s.chain_out[J] = prev[i][real[w] - 1 - from[w]];
      if (!s.Prefilling()) {
        drafts[i].push_back(logits[static_cast<int64_t>(w)].argmax().item<int64_t>());
      }
    }
  }
  for (size_t i = 0; i < seqs.size(); ++i) {
    RunningSequence& s = *seqs[i];
    if (s.Prefilling()) continue;
    if (static_cast<int>(drafts[i].size()) != heads) {
      return absl::InternalError("a chained MTP head drafted nothing");
    }
    s.draft = drafts[i][0];
    s.more_drafts.assign(drafts[i].begin() + 1, drafts[i].end());
  }
  return absl::OkStatus();
}

}  // namespace moelora
