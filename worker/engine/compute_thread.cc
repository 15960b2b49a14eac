#include "worker/engine/compute_thread.h"

#include <ATen/Parallel.h>

namespace moelora {

void ComputeThread::Loop(int threads) {
  at::set_num_threads(threads);
  for (;;) {
    std::function<void()> t;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [this] { return stop_ || !tasks_.empty(); });
      if (tasks_.empty()) return;
      t = std::move(tasks_.front());
      tasks_.pop_front();
    }
    t();
    std::unique_lock<std::mutex> l(mu_);
    if (awaiting_reply_) {
      cv_.wait_for(l, kReplyWait, [this] { return !awaiting_reply_ || stop_; });
      awaiting_reply_ = false;
    }
  }
}

}  // namespace moelora
