// The engine's one compute thread: everything that computes on tensors (the model load, adapter
// staging and unloads, every step) runs on it, one task at a time, in the order queued.
//
// Why one thread: libgomp keeps one OpenMP team per thread that opens a parallel region, and a
// team's idle threads spin after each region.
// - With steps on whichever gRPC thread took the call, several teams spun on the same cores, and
//   most of a decode step's samples were in libgomp's spin loop.
// - With only steps here, the model load and adapter staging still left teams behind; once libgomp
//   manages more threads than there are CPUs it sleeps almost at once, so every parallel region of
//   a step woke a sleeping thread.
// One compute thread means one team, of --cpu-threads threads (the OpenMP thread count is set on
// it: the setting is per thread). The price: a step waits while an adapter is staged.
// (Measurements: docs/decisions/all-tensor-work-on-the-compute-thread.md.)
#ifndef MOELORA_WORKER_ENGINE_COMPUTE_THREAD_H_
#define MOELORA_WORKER_ENGINE_COMPUTE_THREAD_H_

#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <mutex>
#include <thread>
#include <utility>

namespace moelora {

class ComputeThread {
 public:
  explicit ComputeThread(int threads) : thread_([this, threads] { Loop(threads); }) {}
  ~ComputeThread() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  ComputeThread(const ComputeThread&) = delete;
  ComputeThread& operator=(const ComputeThread&) = delete;

  // The reply of the last task run with `replied` is on its way.
  void Replied() {
    {
      std::lock_guard<std::mutex> l(mu_);
      awaiting_reply_ = false;
    }
    cv_.notify_all();
  }
  // Runs f there and waits for it (at once when called from there). Tasks run in the order they
  // were queued; `queued` (if any) is called once f is queued, before the wait.
  // `replied`: after f the thread waits (up to kReplyWait) for Replied(), before the next task:
  // the caller's gRPC thread then sends its reply on a free core instead of waiting for one
  // while the next call (sent ahead) keeps both busy (replies came up to two steps late).
  template <typename F>
  auto Run(F&& f, const std::function<void()>& queued = nullptr, bool replied = false)
      -> decltype(f()) {
    if (std::this_thread::get_id() == thread_.get_id()) {
      if (queued) queued();
      return f();
    }
    std::packaged_task<decltype(f())()> task(std::forward<F>(f));
    auto result = task.get_future();
    {
      std::lock_guard<std::mutex> l(mu_);
      tasks_.push_back([this, &task, replied] {
        if (replied) {
          std::lock_guard<std::mutex> l(mu_);
          awaiting_reply_ = true;
        }
        task();
      });
    }
    cv_.notify_all();
    if (queued) queued();
    return result.get();
  }

 private:
  // Sets the OpenMP thread count of this thread, then runs tasks until stopped (defined in
  // compute_thread.cc: libtorch stays out of this header).
  void Loop(int threads);

  static constexpr std::chrono::microseconds kReplyWait{1000};
  std::mutex mu_;
  bool awaiting_reply_ = false;  // under mu_
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_ENGINE_COMPUTE_THREAD_H_
