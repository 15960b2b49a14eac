#include "worker/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/elementwise.h"

namespace moelora {

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

size_t Sampler::Distribution(const float* logits, int64_t vocab, double* sum) {
  scratch_.clear();
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < vocab; ++i) {
    // NaN never drawn (and never compared: the sort needs a strict weak order).
    const float v = logits[i] / p_.temperature;
    scratch_.push_back({std::isnan(v) ? kNegInf : v, static_cast<int32_t>(i)});
  }
  // Highest first; ties by lower id so the order is total and reproducible.
  std::sort(scratch_.begin(), scratch_.end(), [](const auto& a, const auto& b) {
    return a.first != b.first ? a.first > b.first : a.second < b.second;
  });
  size_t keep = scratch_.size();
  if (p_.top_k > 0) keep = std::min<size_t>(keep, p_.top_k);
  const double top = scratch_[0].first;
  if (!std::isfinite(top)) return 0;
  probs_.resize(keep);
  *sum = 0;
  for (size_t i = 0; i < keep; ++i) *sum += probs_[i] = std::exp(scratch_[i].first - top);
  if (p_.top_p > 0 && p_.top_p < 1) {
    double cum = 0;
    size_t n = 0;
    while (n < keep) {
      cum += probs_[n] / *sum;
      ++n;
      if (cum >= p_.top_p) break;
    }
    keep = n;
    *sum = 0;
    for (size_t i = 0; i < keep; ++i) *sum += probs_[i];
  }
  return keep;
}

int32_t Sampler::Draw(size_t keep, double sum, int32_t skip) {
  double u = Uniform() * sum;
  int32_t token = -1;
  for (size_t i = 0; i < keep; ++i) {
    if (scratch_[i].second == skip) continue;
    token = scratch_[i].second;  // the last one left when rounding leaves u >= 0
    u -= probs_[i];
    if (u < 0) break;
  }
  return token;
}

int32_t Sampler::Sample(const float* logits, int64_t vocab, float* logprob) {
  // The first largest logit (kernels/elementwise.h: vectorised; the scalar loop's answer).
  float mx = 0;
  int32_t token = static_cast<int32_t>(ArgMax(logits, vocab, &mx));
  if (p_.temperature > 0) {
    double sum = 0;
    const size_t keep = Distribution(logits, vocab, &sum);
    token = keep == 0 ? scratch_[0].second : Draw(keep, sum, -1);
  }
  return Finish(logits, vocab, token, mx, logprob);
}

int32_t Sampler::Verify(const float* logits, int64_t vocab, int32_t draft, bool* accepted,
                        float* logprob) {
  float mx = 0;
  int32_t token = static_cast<int32_t>(ArgMax(logits, vocab, &mx));
  if (p_.temperature > 0) {
    double sum = 0;
    const size_t keep = Distribution(logits, vocab, &sum);
    if (keep == 0) {
      token = scratch_[0].second;
    } else {
      double pd = 0;  // the draft's share of the distribution (0 when it may not be drawn)
      for (size_t i = 0; i < keep; ++i) {
        if (scratch_[i].second == draft) pd = probs_[i];
      }
      // Kept with probability p(d) = pd / sum; otherwise drawn from the rest, which has mass
      // sum - pd > 0 (were it 0, u · sum < pd = sum would have kept the draft).
      token = Uniform() * sum < pd ? draft : Draw(keep, sum - pd, draft);
    }
  }
  *accepted = token == draft;
  return Finish(logits, vocab, token, mx, logprob);
}

int32_t Sampler::Finish(const float* logits, int64_t vocab, int32_t token, float mx,
                        float* logprob) const {
  if (logprob) {
    // log-sum-exp of the raw logits, only when asked: one exp per vocabulary entry, which at
    // batch 32 and a 4096-token vocabulary was about 0.4 ms of a decode step (2 %), and grows
    // with the vocabulary.
    double z = 0;
    for (int64_t i = 0; i < vocab; ++i) z += std::exp(static_cast<double>(logits[i]) - mx);
    const double lse = mx + std::log(z);
    *logprob = static_cast<float>(logits[token] - lse);
  }
  return token;
}

}  // namespace moelora
