// GenRequest: a streaming waiter is woken by each worker call's tokens; a unary one by the end.
#include "controller/gen_request.h"

#include <chrono>
#include <thread>
#include <vector>

#include "gtest/gtest.h"

namespace moelora {
namespace {

using std::chrono::milliseconds;

// AddTokens wakes a thread in WaitForProgress at once, not at its timeout (the scheduler only
// signals while such a waiter exists).
TEST(GenRequestTest, AddTokensWakesAStreamingWaiterPromptly) {
  GenRequest r;
  GenRequest::Progress p;
  std::chrono::duration<double> waited{};
  std::thread waiter([&] {
    const auto t0 = GenRequest::Clock::now();
    p = r.WaitForProgress(0, SIZE_MAX, milliseconds(20000));
    waited = GenRequest::Clock::now() - t0;
  });
  // Let the waiter block first (if it has not, WaitForProgress returns the token at once).
  std::this_thread::sleep_for(milliseconds(100));
  r.AddTokens({7}, {-0.5f}, GenRequest::Clock::now());
  waiter.join();
  ASSERT_EQ(p.tokens.size(), 1u);
  EXPECT_EQ(p.tokens[0], 7);
  EXPECT_FALSE(p.done);
  EXPECT_LT(waited.count(), 10.0) << "woken by the timeout, not by the token";
}

// A worker call's tokens for one request arrive in one AddTokens: a waiter takes them together,
// each with its timing (the first one's time to first token, the others' time since the one
// before), and the log-probabilities when the request asked for them.
TEST(GenRequestTest, AddTokensAppendsACallsTokensTogether) {
  GenRequest r;
  r.req.set_return_logprobs(true);
  r.arrival = GenRequest::Clock::now() - milliseconds(30);
  GenRequest::Progress p;
  std::thread waiter([&] { p = r.WaitForProgress(0, SIZE_MAX, milliseconds(20000)); });
  std::this_thread::sleep_for(milliseconds(50));
  const auto now = GenRequest::Clock::now();
  const std::vector<GenRequest::TokenTiming> t = r.AddTokens({4, 5, 6}, {-1, -2, -3}, now);
  waiter.join();
  EXPECT_EQ(p.tokens, (std::vector<int32_t>{4, 5, 6}));
  EXPECT_EQ(p.logprobs, (std::vector<float>{-1, -2, -3}));
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
