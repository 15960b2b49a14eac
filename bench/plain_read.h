// The read probe the benchmarks judge their steps against: `threads` threads each summing their
// contiguous share of 64-bit words, best of `reps` passes, in GB/s. A plain sum, no conversion:
// what a kernel that streams those bytes once can reach at most (bench/peer's bound,
// bench/skinny_gemm's comparison).
#ifndef MOELORA_BENCH_PLAIN_READ_H_
#define MOELORA_BENCH_PLAIN_READ_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <thread>
#include <vector>

namespace moelora {

inline double PlainReadGBs(const uint64_t* words, int64_t n, int threads, int reps) {
  double best = 0;
  std::atomic<uint64_t> sink{0};
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    std::vector<std::thread> ts;
    for (int t = 0; t < threads; ++t) {
      ts.emplace_back([&, t] {
        const int64_t b = n / threads * t, e = t + 1 == threads ? n : n / threads * (t + 1);
        uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
        for (int64_t i = b; i + 4 <= e; i += 4) {
          s0 += words[i];
          s1 += words[i + 1];
          s2 += words[i + 2];
          s3 += words[i + 3];
        }
        sink += s0 + s1 + s2 + s3;
      });
    }
    for (auto& t : ts) t.join();
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::max(best, static_cast<double>(n) * sizeof(uint64_t) / s / 1e9);
  }
  if (sink.load() == 42) std::printf(" ");  // keeps the sums
  return best;
}

}  // namespace moelora

#endif  // MOELORA_BENCH_PLAIN_READ_H_
