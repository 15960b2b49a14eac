#include "common/clock.h"

#include <algorithm>

namespace moelora {
namespace {

class RealClock final : public Clock {
 public:
  TimePoint Now() const override { return std::chrono::steady_clock::now(); }
  bool WaitUntil(CondVar* cv, Mutex* mu, TimePoint until) override
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu) {
    const TimePoint now = Now();
    if (until <= now) return false;
    // A far `until` (time_point::max) would overflow the wait's own arithmetic: a day at a time.
    const Duration d = std::min<Duration>(until - now, std::chrono::hours(24));
    return cv->WaitFor(mu, d);
  }
};

}  // namespace

Clock* Clock::Real() {
  static RealClock* const c = new RealClock();
  return c;
}

bool SimulatedClock::WaitUntil(CondVar* cv, Mutex* mu, TimePoint until) {
  ++waits_;
  if (Now() >= until) return false;
  // One real millisecond at most, then back to the caller as a spurious wake-up: a signal that
  // races the slice's timeout would otherwise be lost, and the clock may have moved meanwhile.
  ++waiters_;
  cv->WaitFor(mu, std::chrono::milliseconds(1));
  --waiters_;
  return Now() < until;
}

void SimulatedClock::AdvanceTo(TimePoint t) {
  Duration::rep cur = now_.load();
  const Duration::rep want = t.time_since_epoch().count();
  while (cur < want && !now_.compare_exchange_weak(cur, want)) {
  }
}

}  // namespace moelora
