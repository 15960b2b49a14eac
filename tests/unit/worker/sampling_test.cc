// Sampler: greedy is the argmax (the lowest id on ties), the logprob is log_softmax of the raw
// logits, and asking for the logprob never changes the token.
#include "worker/sampling.h"

#include <gtest/gtest.h>

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

}  // namespace
}  // namespace moelora
