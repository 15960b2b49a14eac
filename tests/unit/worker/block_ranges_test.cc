#include "worker/layers/block_ranges.h"

#include <gtest/gtest.h>

#include <atomic>
#include <thread>
#include <vector>

namespace moelora {
namespace {

// Every block handed out exactly once and no chunk longer than asked, however many threads take
// part and however the steals fall.
TEST(BlockRangesTest, EachBlockOnceAcrossThreads) {
  for (int64_t blocks : {0, 1, 2, 7, 64, 1000}) {
    for (int threads : {1, 2, 3, 8}) {
      for (int64_t chunk : {1, 4, 100}) {
        BlockRanges ranges(blocks, threads, chunk);
        std::vector<std::atomic<int>> seen(static_cast<size_t>(blocks));
        std::vector<std::thread> ts;
        for (int t = 0; t < threads; ++t) {
          ts.emplace_back([&, t] {
            for (;;) {
              const auto [b0, b1] = ranges.Next(t);
              if (b0 >= b1) break;
              EXPECT_LE(b1 - b0, chunk);
              for (int64_t b = b0; b < b1; ++b) seen[b].fetch_add(1);
            }
          });
        }
        for (auto& t : ts) t.join();
        for (int64_t b = 0; b < blocks; ++b) {
          ASSERT_EQ(seen[b].load(), 1) << "block " << b << " of " << blocks << ", " << threads
                                       << " threads, chunk " << chunk;
        }
      }
    }
  }
}

// A thread that never comes (the runtime started fewer threads): the others take its share.
TEST(BlockRangesTest, AbsentThreadsShareIsTakenOver) {
  BlockRanges ranges(100, 4, 3);
  std::vector<int> seen(100, 0);
  for (;;) {  // only thread 1 takes part
    const auto [b0, b1] = ranges.Next(1);
    if (b0 >= b1) break;
    for (int64_t b = b0; b < b1; ++b) ++seen[b];
  }
  for (int b = 0; b < 100; ++b) EXPECT_EQ(seen[b], 1) << b;
}

// The order one thread sees: its own share front to back in chunks, then the back half of the
// largest share left (thread 0 of 2 over 20 blocks, chunk 4, thread 1 never taking any).
TEST(BlockRangesTest, OwnShareThenBackHalfOfTheLargest) {
  BlockRanges ranges(20, 2, 4);
  std::vector<std::pair<int64_t, int64_t>> got;
  for (;;) {
    const auto r = ranges.Next(0);
    if (r.first >= r.second) break;
    got.push_back(r);
  }
  const std::vector<std::pair<int64_t, int64_t>> want = {
      {0, 4},   {4, 8},   {8, 10},  // own share [0, 10)
      {15, 19}, {19, 20},           // back half of [10, 20)
      {12, 15},                     // back half of [10, 15)
      {11, 12}, {10, 11}};          // then [10, 12) halved, then the last block
  EXPECT_EQ(got, want);
}

}  // namespace
}  // namespace moelora
