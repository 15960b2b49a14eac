#include "kernels/internal/parallel_copy.h"

#include <algorithm>
#include <cstring>

namespace moelora {
namespace kernels_internal {

ParallelCopier::ParallelCopier(int threads, size_t min_split_bytes)
    : min_split_(std::max<size_t>(min_split_bytes, 1)) {
  for (int i = 1; i < std::max(threads, 1); ++i) helpers_.emplace_back([this, i] { Helper(i); });
}

ParallelCopier::~ParallelCopier() {
  {
    std::lock_guard<std::mutex> l(mu_);
    stop_ = true;
  }
  start_cv_.notify_all();
  for (auto& t : helpers_) t.join();
}

void ParallelCopier::CopyPart(int index, int parts) const {
  // 64-byte aligned part boundaries (cache lines), the last part takes the rest.
  const size_t per = (bytes_ / parts + 63) & ~size_t{63};
  const size_t b = std::min(bytes_, per * index);
  const size_t e = index + 1 == parts ? bytes_ : std::min(bytes_, b + per);
  if (e > b) std::memcpy(dst_ + b, src_ + b, e - b);
}

void ParallelCopier::Helper(int index) {
  uint64_t seen = 0;
  for (;;) {
    int parts;
    {
      std::unique_lock<std::mutex> l(mu_);
      start_cv_.wait(l, [&] { return stop_ || generation_ != seen; });
      if (stop_) return;
      seen = generation_;
      parts = parts_;
      if (index >= parts) continue;  // this job is split into fewer parts
    }
    CopyPart(index, parts);
    std::lock_guard<std::mutex> l(mu_);
    if (--pending_ == 0) done_cv_.notify_one();
  }
}

void ParallelCopier::Copy(void* dst, const void* src, size_t bytes) {
  const int parts =
      static_cast<int>(std::min<size_t>(threads(), std::max<size_t>(bytes / min_split_, 1)));
  if (parts <= 1) {
    if (bytes) std::memcpy(dst, src, bytes);
    return;
  }
  {
    std::lock_guard<std::mutex> l(mu_);
    dst_ = static_cast<uint8_t*>(dst);
    src_ = static_cast<const uint8_t*>(src);
    bytes_ = bytes;
    parts_ = parts;
    pending_ = parts - 1;
    ++generation_;
  }
  start_cv_.notify_all();
  CopyPart(0, parts);
  std::unique_lock<std::mutex> l(mu_);
  done_cv_.wait(l, [&] { return pending_ == 0; });
}

}  // namespace kernels_internal
}  // namespace moelora
