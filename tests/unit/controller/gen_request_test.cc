// GenRequest: a streaming waiter is woken by each token; a unary one by the end.
#include "controller/gen_request.h"

#include <chrono>
#include <thread>

#include "gtest/gtest.h"

namespace moelora {
namespace {

using std::chrono::milliseconds;

// AddToken wakes a thread in WaitForProgress at once, not at its timeout (the scheduler only
// signals per token while such a waiter exists).
TEST(GenRequestTest, AddTokenWakesAStreamingWaiterPromptly) {
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
  r.AddToken(7, -0.5f, GenRequest::Clock::now());
  waiter.join();
  ASSERT_EQ(p.tokens.size(), 1u);
  EXPECT_EQ(p.tokens[0], 7);
  EXPECT_FALSE(p.done);
  EXPECT_LT(waited.count(), 10.0) << "woken by the timeout, not by the token";
}

TEST(GenRequestTest, WaitDoneReturnsWhenTheRequestFinishes) {
  GenRequest r;
  bool done = false;
  std::thread waiter([&] { done = r.WaitDone(milliseconds(20000)); });
  std::this_thread::sleep_for(milliseconds(50));
  r.AddToken(1, 0, GenRequest::Clock::now());
  r.AddToken(2, 0, GenRequest::Clock::now());
  EXPECT_TRUE(r.Finish(absl::OkStatus(), "length", GenRequest::Clock::now()));
  waiter.join();
  EXPECT_TRUE(done);
  const GenRequest::Result res = r.GetResult();
  EXPECT_EQ(res.tokens, (std::vector<int32_t>{1, 2}));
  EXPECT_EQ(res.finish_reason, "length");
}

}  // namespace
}  // namespace moelora
