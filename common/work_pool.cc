#include "common/work_pool.h"

#include <exception>
#include <utility>

#include "common/logging.h"

namespace moelora {

WorkPool::WorkPool(int threads, size_t max_queued) : max_queued_(max_queued) {
  threads_.reserve(threads);
  for (int i = 0; i < threads; ++i) threads_.emplace_back([this] { Loop(); });
}

WorkPool::~WorkPool() {
  {
    MutexLock lock(&mu_);
    stopping_ = true;
  }
  cv_.SignalAll();
  for (std::thread& t : threads_) t.join();
}

void WorkPool::Post(std::function<void()> fn) {
  {
    MutexLock lock(&mu_);
    queue_.push_back(std::move(fn));
  }
  cv_.Signal();
}

bool WorkPool::TryPost(std::function<void()> fn) {
  {
    MutexLock lock(&mu_);
    if (queue_.size() >= max_queued_) return false;
    queue_.push_back(std::move(fn));
  }
  cv_.Signal();
  return true;
}

void WorkPool::Loop() {
  while (true) {
    std::function<void()> fn;
    {
      MutexLock lock(&mu_);
      while (queue_.empty() && !stopping_) cv_.Wait(&mu_);
      if (queue_.empty()) return;  // stopping, and everything posted has run
      fn = std::move(queue_.front());
      queue_.pop_front();
    }
    try {
      fn();
    } catch (const std::exception& e) {
      LOG(ERROR) << "work pool: a task threw (dropped): " << e.what();
    } catch (...) {
      LOG(ERROR) << "work pool: a task threw (dropped)";
    }
  }
}

}  // namespace moelora
