// A fixed set of threads running posted closures in order of posting.
//
// Written here rather than taken from a library: gRPC and abseil expose no thread pool, and the
// one need (a few threads that serve many gRPC calls without one thread per call) is this small.
// Thread-safety: Post from any thread; the destructor runs what was posted, then joins.
#ifndef MOELORA_COMMON_WORK_POOL_H_
#define MOELORA_COMMON_WORK_POOL_H_

#include <deque>
#include <functional>
#include <thread>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace moelora {

class WorkPool {
 public:
  explicit WorkPool(int threads);
  ~WorkPool();
  WorkPool(const WorkPool&) = delete;
  WorkPool& operator=(const WorkPool&) = delete;

  void Post(std::function<void()> fn) ABSL_LOCKS_EXCLUDED(mu_);
  int size() const { return static_cast<int>(threads_.size()); }

 private:
  void Loop() ABSL_LOCKS_EXCLUDED(mu_);
  Mutex mu_;
  CondVar cv_;
  std::deque<std::function<void()>> queue_ ABSL_GUARDED_BY(mu_);
  bool stopping_ ABSL_GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace moelora

#endif  // MOELORA_COMMON_WORK_POOL_H_
