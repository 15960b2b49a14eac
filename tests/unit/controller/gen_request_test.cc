// GenRequest: a streaming listener is told of each worker call's tokens; a unary one of the end.
#include "controller/gen_request.h"

#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moelora {
namespace {

using std::chrono::milliseconds;

// A listener that asked for tokens is called once per AddTokens and at the end; one that did not
// only at the end; one set late is called at once for what happened before.
TEST(GenRequestTest, ListenerIsCalledForTokensOnlyWhenItAskedForThem) {
  GenRequest streaming, unary;
  int streaming_calls = 0, unary_calls = 0;
  streaming.SetListener([&] { ++streaming_calls; }, /*on_tokens=*/true);
  unary.SetListener([&] { ++unary_calls; }, /*on_tokens=*/false);
  for (GenRequest* r : {&streaming, &unary}) {
    r->AddTokens({7, 8}, {-0.5f, -0.25f}, GenRequest::Clock::now());
    r->AddTokens({9}, {-1.0f}, GenRequest::Clock::now());
  }
  EXPECT_EQ(streaming_calls, 2);
  EXPECT_EQ(unary_calls, 0);
  for (GenRequest* r : {&streaming, &unary}) {
    EXPECT_TRUE(r->Finish(absl::OkStatus(), "length", GenRequest::Clock::now()));
    EXPECT_FALSE(r->Finish(absl::OkStatus(), "length", GenRequest::Clock::now()));
  }
  EXPECT_EQ(streaming_calls, 3);
  EXPECT_EQ(unary_calls, 1);

  GenRequest late;
  late.AddTokens({1}, {0.0f}, GenRequest::Clock::now());
  int late_calls = 0;
  late.SetListener([&] { ++late_calls; }, /*on_tokens=*/true);
  EXPECT_EQ(late_calls, 1);
  GenRequest late_unary;
  late_unary.AddTokens({1}, {0.0f}, GenRequest::Clock::now());
  late_unary.SetListener([&] { ++late_calls; }, /*on_tokens=*/false);
  EXPECT_EQ(late_calls, 1);
}

// A worker call's tokens for one request arrive in one AddTokens: Peek takes them together, each
// with its timing (the first one's time to first token, the others' time since the one before),
// and the log-probabilities when the request asked for them; `limit` cuts at a stop string.
TEST(GenRequestTest, AddTokensAppendsACallsTokensTogether) {
  GenRequest r;
  r.req.set_return_logprobs(true);
  r.arrival = GenRequest::Clock::now() - milliseconds(30);
  const auto now = GenRequest::Clock::now();
  const std::vector<GenRequest::TokenTiming> t = r.AddTokens({4, 5, 6}, {-1, -2, -3}, now);
  GenRequest::Progress p = r.Peek(0, SIZE_MAX);
  EXPECT_EQ(p.tokens, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(p.logprobs, (std::vector<float>{-1, -2, -3}));
  EXPECT_FALSE(p.done);
  ASSERT_EQ(t.size(), 3u);
  EXPECT_TRUE(t[0].first);
  EXPECT_GE(t[0].seconds, 0.03);
  EXPECT_FALSE(t[1].first);
  EXPECT_FALSE(t[2].first);
  EXPECT_EQ(t[1].seconds, 0.0);
  const auto later = now + milliseconds(20);
  const std::vector<GenRequest::TokenTiming> u = r.AddTokens({7}, {-4}, later);
  ASSERT_EQ(u.size(), 1u);
  EXPECT_FALSE(u[0].first);
  EXPECT_NEAR(u[0].seconds, 0.02, 1e-6);
  EXPECT_EQ(r.GetResult().tokens, (std::vector<int32_t>{4, 5, 6, 7}));
  EXPECT_EQ(r.Peek(1, 3).tokens, (std::vector<int32_t>{5, 6}));
  r.Finish(absl::OkStatus(), "length", later);
  p = r.Peek(4, SIZE_MAX);
  EXPECT_TRUE(p.tokens.empty());
  EXPECT_TRUE(p.done);
}

TEST(GenRequestTest, WaitDoneReturnsWhenTheRequestFinishes) {
  GenRequest r;
  bool done = false;
  std::thread waiter([&] { done = r.WaitDone(milliseconds(20000)); });
  std::this_thread::sleep_for(milliseconds(50));
  r.AddTokens({1}, {0.0f}, GenRequest::Clock::now());
  r.AddTokens({2}, {0.0f}, GenRequest::Clock::now());
  EXPECT_TRUE(r.Finish(absl::OkStatus(), "length", GenRequest::Clock::now()));
  waiter.join();
  EXPECT_TRUE(done);
  const GenRequest::Result res = r.GetResult();
  EXPECT_EQ(res.tokens, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(res.finish_reason, "length");
}

}  // namespace
}  // namespace moelora
