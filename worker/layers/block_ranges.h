// Blocks [0, blocks) shared out among threads by range stealing: each thread starts on its own
// contiguous share and takes it a few blocks at a time from the front; a thread whose share is
// done takes the back half of what is left of the largest other share, and goes on from there.
//
// Why not an OpenMP schedule: static leaves a thread idle whenever the other is slowed (a
// descheduled vCPU, a share with heavier experts); guided (what RunJobs used before) hands the
// first thread half the blocks in one piece that nobody can take over; dynamic interleaves the
// threads' blocks, so no thread streams one contiguous stretch of the weights (the hardware
// prefetcher and the kernels' prefetch past a call's last row both follow a thread's stretch).
// Range stealing keeps each thread on contiguous stretches and ends within a chunk of balance.
// libgomp has no such schedule and TBB (which does) is not among our dependencies; it is about
// 40 lines on one atomic per thread.
#ifndef MOELORA_WORKER_LAYERS_BLOCK_RANGES_H_
#define MOELORA_WORKER_LAYERS_BLOCK_RANGES_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <utility>

namespace moelora {

class BlockRanges {
 public:
  // `threads` shares of [0, blocks), as equal as can be; a thread takes `chunk` blocks at a time
  // from its own share. blocks < 2^32.
  BlockRanges(int64_t blocks, int threads, int64_t chunk)
      : threads_(std::max(1, threads)),
        chunk_(std::max<int64_t>(1, chunk)),
        shares_(new Share[static_cast<size_t>(threads_)]) {
    for (int t = 0; t < threads_; ++t) {
      shares_[t].range.store(Pack(blocks * t / threads_, blocks * (t + 1) / threads_),
                             std::memory_order_relaxed);
    }
  }

  // The next blocks [first, second) for thread `me` (0 <= me < threads), or an empty pair when
  // every block has been taken. Each block is handed out exactly once over all calls.
  std::pair<int64_t, int64_t> Next(int me) {
    for (;;) {
      std::atomic<uint64_t>& own = shares_[me].range;
      uint64_t r = own.load(std::memory_order_relaxed);
      while (Lo(r) < Hi(r)) {
        const int64_t b0 = Lo(r), b1 = std::min(Hi(r), b0 + chunk_);
        if (own.compare_exchange_weak(r, Pack(b1, Hi(r)), std::memory_order_relaxed)) {
          return {b0, b1};
        }
      }
      if (!Steal(me)) return {0, 0};
    }
  }

 private:
  struct alignas(64) Share {
    std::atomic<uint64_t> range{0};  // (first << 32) | end of the blocks not yet taken
  };
  static uint64_t Pack(int64_t lo, int64_t hi) {
    return static_cast<uint64_t>(lo) << 32 | static_cast<uint64_t>(hi);
  }
  static int64_t Lo(uint64_t r) { return static_cast<int64_t>(r >> 32); }
  static int64_t Hi(uint64_t r) { return static_cast<int64_t>(r & 0xffffffffu); }

  // Moves the back half (rounded up) of the largest other share into thread me's (empty) share.
  // False when every other share is empty.
  bool Steal(int me) {
    for (;;) {
      int victim = -1;
      uint64_t vr = 0;
      for (int t = 0; t < threads_; ++t) {
        if (t == me) continue;
        const uint64_t r = shares_[t].range.load(std::memory_order_relaxed);
        if (Hi(r) - Lo(r) > (victim < 0 ? 0 : Hi(vr) - Lo(vr))) victim = t, vr = r;
      }
      if (victim < 0) return false;
      const int64_t mid = Hi(vr) - (Hi(vr) - Lo(vr) + 1) / 2;
      if (shares_[victim].range.compare_exchange_strong(vr, Pack(Lo(vr), mid),
                                                        std::memory_order_relaxed)) {
        shares_[me].range.store(Pack(mid, Hi(vr)), std::memory_order_relaxed);
        return true;
      }
    }
  }

  const int threads_;
  const int64_t chunk_;
  std::unique_ptr<Share[]> shares_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_BLOCK_RANGES_H_
