#include "controller/slot_pool.h"

#include <algorithm>

#include "common/logging.h"

namespace moelora {

bool SlotPool::TryReserve() {
  if (free() <= 0) return false;
  ++held_;
  return true;
}

void SlotPool::Unreserve() {
  MOELORA_CHECK(held_ > 0) << "SlotPool::Unreserve without a held slot";
  --held_;
}

void SlotPool::BeginRelease() {
  MOELORA_CHECK(held_ > 0) << "SlotPool::BeginRelease without a held slot";
  --held_;
  ++releasing_;
}

void SlotPool::EndRelease(bool freed) {
  MOELORA_CHECK(releasing_ > 0) << "SlotPool::EndRelease without a releasing slot";
  --releasing_;
  if (!freed) ++leaked_;
}

void SlotPool::Leak() {
  MOELORA_CHECK(held_ > 0) << "SlotPool::Leak without a held slot";
  --held_;
  ++leaked_;
}

void SlotPool::Reconcile(int orphans) { leaked_ = std::clamp(orphans, 0, capacity_); }

void SlotPool::Reset() { held_ = releasing_ = leaked_ = 0; }

std::optional<size_t> SlotPool::PickVictim(const std::vector<Candidate>& candidates) {
  std::optional<size_t> best;
  for (size_t i = 0; i < candidates.size(); ++i) {
    const Candidate& c = candidates[i];
    if (!c.resident || c.pinned || c.in_use) continue;
    if (!best || c.last_used < candidates[*best].last_used) best = i;
  }
  return best;
}

}  // namespace moelora
