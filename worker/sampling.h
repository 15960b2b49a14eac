// Token sampling from one row of logits: greedy, or temperature + top-k + top-p with a seeded
// generator. Deterministic: the same logits, parameters and seed give the same tokens on every
// run and every rank (the generator is a std::mt19937_64, whose output the C++ standard fixes,
// mapped to [0, 1) by hand because std::uniform_real_distribution is implementation-defined).
// Thread-safety: a Sampler belongs to one sequence.
#ifndef MOELORA_WORKER_SAMPLING_H_
#define MOELORA_WORKER_SAMPLING_H_

#include <cstdint>
#include <random>
#include <vector>

namespace moelora {

struct SamplingParams {
  float temperature = 0;  // 0 = greedy
  float top_p = 0;        // (0, 1): nucleus; 0 or 1 = off (> 1 refused: common/request_rules.h)
  int top_k = 0;          // 0 = off
  uint64_t seed = 0;
};

class Sampler {
 public:
  explicit Sampler(const SamplingParams& p) : p_(p), rng_(p.seed) {}
  // Picks a token from `logits[0, vocab)`; `logprob`, when not null, gets its log-probability
  // under the model's unmodified distribution (log_softmax of the raw logits). The token does not
  // depend on whether `logprob` is asked for. A NaN logit is never drawn with a temperature (a
  // row with no finite logit gives its first entry).
  int32_t Sample(const float* logits, int64_t vocab, float* logprob);

  // Speculative decoding: the token at a position the draft proposed `draft` for, by rejection
  // sampling against a draft that is certain of its token (the head's argmax): `draft` is kept
  // with its probability p(draft) under the distribution Sample draws from, else a token is drawn
  // from that distribution without `draft` (renormalised). Each token then comes with Sample's
  // probability, p(d)·[x = d] + (1 − p(d))·p(x) / (1 − p(d))·[x ≠ d] = p(x). Greedy: the argmax,
  // kept when it is the draft. *accepted says whether `draft` was kept; `logprob` as Sample.
  int32_t Verify(const float* logits, int64_t vocab, int32_t draft, bool* accepted, float* logprob);

 private:
  double Uniform();
  // With a temperature: the tokens Sample may draw, most likely first, in scratch_[0, keep),
  // their unnormalised probabilities in probs_[0, keep) and their sum in *sum; 0 when no logit
  // is finite (then scratch_[0] is the token).
  size_t Distribution(const float* logits, int64_t vocab, double* sum);
  // A draw from scratch_[0, keep) by probs_, `skip` (a token id) left out (-1: none).
  int32_t Draw(size_t keep, double sum, int32_t skip);
  // `token`, with its log-probability when `logprob` is not null (mx: the largest logit).
  int32_t Finish(const float* logits, int64_t vocab, int32_t token, float mx, float* logprob) const;
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
  std::vector<double> probs_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_SAMPLING_H_
