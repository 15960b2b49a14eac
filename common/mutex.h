// A std::mutex and std::condition_variable with clang's thread-safety annotations, so that
// -Wthread-safety can check ABSL_GUARDED_BY / ABSL_LOCKS_EXCLUDED on code that uses them.
//
// Why not absl::Mutex, which is annotated already: Debian's abseil is not built with
// ThreadSanitizer, and absl::Mutex synchronises through its own futex code in that uninstrumented
// library, so TSan sees none of its happens-before edges and reports every guarded access as a
// race (seen on the controller's tests). std::mutex goes through pthread, which TSan intercepts.
// libstdc++'s std::mutex carries no annotations, hence this thin wrapper.
#ifndef MOELORA_COMMON_MUTEX_H_
#define MOELORA_COMMON_MUTEX_H_

#include <chrono>
#include <condition_variable>
#include <mutex>

#include "absl/base/thread_annotations.h"

namespace moelora {

class ABSL_LOCKABLE Mutex {
 public:
  Mutex() = default;
  Mutex(const Mutex&) = delete;
  Mutex& operator=(const Mutex&) = delete;

  void Lock() ABSL_EXCLUSIVE_LOCK_FUNCTION() { mu_.lock(); }
  void Unlock() ABSL_UNLOCK_FUNCTION() { mu_.unlock(); }

 private:
  friend class CondVar;
  std::mutex mu_;
};

class ABSL_SCOPED_LOCKABLE MutexLock {
 public:
  explicit MutexLock(Mutex* mu) ABSL_EXCLUSIVE_LOCK_FUNCTION(mu) : mu_(mu) { mu_->Lock(); }
  ~MutexLock() ABSL_UNLOCK_FUNCTION() { mu_->Unlock(); }
  MutexLock(const MutexLock&) = delete;
  MutexLock& operator=(const MutexLock&) = delete;

 private:
  Mutex* const mu_;
};

class CondVar {
 public:
  // Releases `mu` while waiting, holds it again on return; false when `timeout` passed.
  // Spurious wake-ups happen: callers re-check their condition.
  template <typename Rep, typename Period>
  bool WaitFor(Mutex* mu, std::chrono::duration<Rep, Period> timeout)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    const bool woken = cv_.wait_for(lock, timeout) == std::cv_status::no_timeout;
    lock.release();  // `mu` stays locked, owned by the caller's MutexLock
    return woken;
  }
  void Wait(Mutex* mu) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    std::unique_lock<std::mutex> lock(mu->mu_, std::adopt_lock);
    cv_.wait(lock);
    lock.release();
  }
  void Signal() { cv_.notify_one(); }
  void SignalAll() { cv_.notify_all(); }

 private:
  std::condition_variable cv_;
};

}  // namespace moelora

#endif  // MOELORA_COMMON_MUTEX_H_
