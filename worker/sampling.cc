#include "worker/sampling.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "kernels/elementwise.h"

namespace moelora {

double Sampler::Uniform() { return static_cast<double>(rng_() >> 11) * 0x1.0p-53; }

int32_t Sampler::Sample(const float* logits, int64_t vocab, float* logprob) {
  // The first largest logit (kernels/elementwise.h: vectorised; the scalar loop's answer).
  float mx = 0;
  int32_t token = static_cast<int32_t>(ArgMax(logits, vocab, &mx));
  if (p_.temperature > 0) {
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
    if (!std::isfinite(top)) return Finish(logits, vocab, scratch_[0].second, mx, logprob);
    std::vector<double> probs(keep);
    double sum = 0;
    for (size_t i = 0; i < keep; ++i) sum += probs[i] = std::exp(scratch_[i].first - top);
    if (p_.top_p > 0 && p_.top_p < 1) {
      double cum = 0;
      size_t n = 0;
      while (n < keep) {
        cum += probs[n] / sum;
        ++n;
        if (cum >= p_.top_p) break;
      }
      keep = n;
      sum = 0;
      for (size_t i = 0; i < keep; ++i) sum += probs[i];
    }
    double u = Uniform() * sum;
    token = scratch_[keep - 1].second;
    for (size_t i = 0; i < keep; ++i) {
      u -= probs[i];
      if (u < 0) {
        token = scratch_[i].second;
        break;
      }
    }
  }
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
