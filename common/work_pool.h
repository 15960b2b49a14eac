// A fixed set of threads running posted closures in order of posting.
//
// Written here rather than taken from a library: gRPC and abseil expose no thread pool, and the
// one need (a few threads that serve many gRPC calls without one thread per call) is this small.
// A closure that throws is logged and dropped: no exception ends a pool thread (or the process).
// Thread-safety: Post from any thread; the destructor runs what was posted, then joins.
#ifndef MOELORA_COMMON_WORK_POOL_H_
#define MOELORA_COMMON_WORK_POOL_H_

#include <cstddef>
#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace moelora {

class WorkPool {
 public:
  // `max_queued`: closures waiting at most (TryPost refuses beyond; Post never does).
  explicit WorkPool(int threads, size_t max_queued = SIZE_MAX);
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  void Post(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);
  // Post unless max_queued closures wait already (then false, and `fn` is dropped).
  [[nodiscard]] bool TryPost(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  const size_t max_queued_;
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace moelora

#endif  // MOELORA_COMMON_WORK_POOL_H_
