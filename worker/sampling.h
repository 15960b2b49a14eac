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

 private:
  double Uniform();
  // `token`, with its log-probability when `logprob` is not null (mx: the largest logit).
  int32_t Finish(const float* logits, int64_t vocab, int32_t token, float mx, float* logprob) const;
  SamplingParams p_;
  std::mt19937_64 rng_;
  std::vector<std::pair<float, int32_t>> scratch_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_SAMPLING_H_
