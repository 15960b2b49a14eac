// Time as the controller reads it: steady time and waiting on it, through one interface, so that
// unit tests can run the scheduler, the adapter manager and request deadlines on a simulated
// clock they move by hand (batch windows, call-ahead leads, reconcile intervals, deadlines and
// LRU ages then come out exact, whatever the machine's load), as leveldb's Env or abseil's Clock
// do. Production uses Clock::Real().
//
// Thread-safety: every method may be called from any thread.
#ifndef MOELORA_COMMON_CLOCK_H_
#define MOELORA_COMMON_CLOCK_H_

#include <atomic>
#include <chrono>
#include <cstdint>

#include "absl/base/thread_annotations.h"
#include "common/mutex.h"

namespace moelora {

class Clock {
 public:
  using TimePoint = std::chrono::steady_clock::time_point;
  using Duration = std::chrono::steady_clock::duration;

  virtual ~Clock() = default;
  virtual TimePoint Now() const = 0;
  // Waits on `cv` (`mu` held; released while waiting) until it is signalled or this clock reaches
  // `until`. False when `until` passed; true when signalled (or woken spuriously: callers
  // re-check their condition).
  virtual bool WaitUntil(CondVar* cv, Mutex* mu, TimePoint until)
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) = 0;
  bool WaitFor(CondVar* cv, Mutex* mu, Duration d) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    return WaitUntil(cv, mu, Now() + d);
  }
  // std::chrono::steady_clock.
  static Clock* Real();
};

// A clock that moves only when told to (Advance, AdvanceTo). It starts an hour after the steady
// clock's epoch, so that "a millisecond ago" is a valid time. WaitUntil returns within a real
// millisecond (a spurious wake-up when neither signalled nor due), so its callers look at the
// simulated time again about every millisecond: moving the clock never needs to wake anyone.
class SimulatedClock final : public Clock {
 public:
  SimulatedClock() = default;
  TimePoint Now() const override { return TimePoint(Duration(now_.load())); }
  bool WaitUntil(CondVar* cv, Mutex* mu, TimePoint until) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu);
  void Advance(Duration d) { now_ += d.count(); }
  // Moves the clock to `t`, never backwards.
  void AdvanceTo(TimePoint t);
  // Threads in WaitUntil now, and WaitUntil calls so far: a test that moved the clock knows its
  // waiters have seen the new time once one has waited again.
  int waiters() const { return waiters_.load(); }
  int64_t waits() const { return waits_.load(); }

 private:
  std::atomic<Duration::rep> now_{
      std::chrono::duration_cast<Duration>(std::chrono::hours(1)).count()};
  std::atomic<int> waiters_{0};
  std::atomic<int64_t> waits_{0};
};

// Seconds from `t0` to now on the steady clock (for measured phases, not for waiting: see Clock).
inline double SecondsSince(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace moelora

#endif  // MOELORA_COMMON_CLOCK_H_
