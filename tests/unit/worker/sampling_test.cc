// Sampler: greedy is the argmax (the lowest id on ties), the logprob is log_softmax of the raw
// logits, and asking for the logprob never changes the token; verifying a speculative draft
// (rejection sampling) draws each token with the probability Sample draws it with.
#include "worker/sampling.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <random>
#include <vector>

namespace moelora {
namespace {

std::vector<float> Logits(int64_t vocab, uint32_t seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> d(0, 3);
  std::vector<float> v(vocab);
  for (auto& x : v) x = d(rng);
  return v;
}

TEST(SamplerTest, GreedyIsTheArgmaxWithItsLogSoftmax) {
  const std::vector<float> l = Logits(5000, 1);
  int32_t want = 0;
  for (int32_t i = 1; i < 5000; ++i) {
    if (l[i] > l[want]) want = i;
  }
  double z = 0;
  for (float x : l) z += std::exp(static_cast<double>(x));
  Sampler s(SamplingParams{});
  float lp = 1;
  EXPECT_EQ(s.Sample(l.data(), 5000, &lp), want);
  EXPECT_NEAR(lp, l[want] - std::log(z), 1e-5);
  EXPECT_EQ(s.Sample(l.data(), 5000, nullptr), want);
}

TEST(SamplerTest, GreedyTiesGoToTheLowestId) {
  const std::vector<float> l = {1.0f, 3.0f, -2.0f, 3.0f};
  Sampler s(SamplingParams{});
  float lp = 0;
  EXPECT_EQ(s.Sample(l.data(), 4, &lp), 1);
  EXPECT_NEAR(lp, 3.0 - std::log(std::exp(1.0) + 2 * std::exp(3.0) + std::exp(-2.0)), 1e-6);
}

// With a temperature, the same seed gives the same tokens whether or not the logprob is asked
// for (the logprob's pass must not touch the generator), and they are not all the argmax.
TEST(SamplerTest, SeededSamplingIgnoresWhetherTheLogprobIsAsked) {
  const std::vector<float> l = Logits(300, 2);
  SamplingParams p;
  p.temperature = 2.0f;
  p.top_p = 0.95f;
  p.seed = 42;
  Sampler with(p), without(p);
  int differs_from_argmax = 0;
  for (int t = 0; t < 50; ++t) {
    float lp = 0;
    const int32_t a = with.Sample(l.data(), 300, &lp);
    EXPECT_EQ(without.Sample(l.data(), 300, nullptr), a) << "draw " << t;
    EXPECT_LT(lp, 0.0f);
    differs_from_argmax += a != Sampler(SamplingParams{}).Sample(l.data(), 300, nullptr);
  }
  EXPECT_GT(differs_from_argmax, 0);
}

// NaN logits (a broken model) are never drawn and break nothing: the sort's comparator sees
// none of them.
TEST(SamplerTest, NanLogitsAreNeverDrawn) {
  std::vector<float> l = Logits(64, 3);
  for (int i = 0; i < 64; i += 3) l[i] = std::nanf("");
  SamplingParams p;
  p.temperature = 1.5f;
  p.top_k = 40;
  p.seed = 9;
  Sampler s(p);
  for (int t = 0; t < 200; ++t) {
    const int32_t tok = s.Sample(l.data(), 64, nullptr);
    ASSERT_GE(tok, 0);
    ASSERT_LT(tok, 64);
    EXPECT_NE(tok % 3, 0) << "drew a NaN entry";
  }
  // No finite logit at all: a token in range, no crash.
  std::vector<float> all(16, std::nanf(""));
  const int32_t tok = Sampler(p).Sample(all.data(), 16, nullptr);
  EXPECT_GE(tok, 0);
  EXPECT_LT(tok, 16);
}

// Greedy verification keeps the draft exactly when it is the argmax.
TEST(SamplerTest, GreedyVerifyKeepsTheDraftWhenItIsTheArgmax) {
  const std::vector<float> l = Logits(50, 3);
  Sampler s({});
  const int32_t top = s.Sample(l.data(), 50, nullptr);
  bool kept = false;
  float lp_verify = 0, lp_sample = 0;
  EXPECT_EQ(s.Verify(l.data(), 50, top, &kept, &lp_verify), top);
  EXPECT_TRUE(kept);
  (void)s.Sample(l.data(), 50, &lp_sample);
  EXPECT_EQ(lp_verify, lp_sample);
  EXPECT_EQ(s.Verify(l.data(), 50, (top + 1) % 50, &kept, nullptr), top);
  EXPECT_FALSE(kept);
}

// With a temperature, top-k and top-p: over 200,000 verifications of a likely draft and of an
// unlikely one, every token's frequency is its probability under Sample's distribution (within
// 5 standard deviations), the draft is kept at the rate p(draft), and a draft outside the top-k
// is never kept.
TEST(SamplerTest, VerifiedTokensComeWithSamplesProbabilities) {
  const int64_t V = 12;
  const std::vector<float> l = Logits(V, 11);
  SamplingParams p;
  p.temperature = 1.3f;
  p.top_k = 8;
  p.top_p = 0.97f;
  // Sample's distribution, measured: 400,000 draws.
  std::vector<double> prob(V, 0);
  {
    p.seed = 1;
    Sampler s(p);
    constexpr int kN = 400000;
    for (int i = 0; i < kN; ++i) prob[s.Sample(l.data(), V, nullptr)] += 1.0 / kN;
  }
  int32_t likely = 0, unlikely = -1, outside = -1;
  for (int32_t t = 0; t < V; ++t) {
    if (prob[t] > prob[likely]) likely = t;
    if (prob[t] > 0.02 && prob[t] < 0.2 && (unlikely < 0 || prob[t] < prob[unlikely])) unlikely = t;
    if (prob[t] == 0) outside = t;
  }
  ASSERT_GE(unlikely, 0);
  ASSERT_GE(outside, 0);
  for (int32_t draft : {likely, unlikely, outside}) {
    SCOPED_TRACE(draft);
    p.seed = 7 + static_cast<uint64_t>(draft);
    Sampler s(p);
    constexpr int kN = 200000;
    std::vector<double> freq(V, 0);
    int kept_count = 0;
    for (int i = 0; i < kN; ++i) {
      bool kept = false;
      const int32_t t = s.Verify(l.data(), V, draft, &kept, nullptr);
      EXPECT_EQ(kept, t == draft);
      kept_count += kept;
      freq[t] += 1.0 / kN;
    }
    for (int32_t t = 0; t < V; ++t) {
      const double sd =
          std::sqrt(std::max(prob[t], 1e-6) * (1 - prob[t]) * (1.0 / kN + 1.0 / 400000));
      EXPECT_NEAR(freq[t], prob[t], 5 * sd) << "token " << t;
    }
    EXPECT_NEAR(static_cast<double>(kept_count) / kN, prob[draft], 0.01);
    if (draft == outside) {
      EXPECT_EQ(kept_count, 0);
    }
  }
}

}  // namespace
}  // namespace moelora
