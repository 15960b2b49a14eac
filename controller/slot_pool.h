// The controller's count of worker LoRA slots (--max-loras), kept so that it never counts a
// slot free that a worker may still hold. Pure: no threads, no locks (the controller calls it
// under its mutex), so it is tested on its own in microseconds.
//
// A slot is in one of four states, and only "free" ones can be reserved:
//   held       an adapter is committed there, or a load into it is in progress;
//   releasing  its adapter's unload has been sent to the workers, with no answer yet;
//   leaked     an unload or a rollback failed on some rank: the workers may still hold it, so it
//              stays taken until Reconcile() counts the workers' committed adapters again;
//   free       the rest.
#ifndef MOELORA_CONTROLLER_SLOT_POOL_H_
#define MOELORA_CONTROLLER_SLOT_POOL_H_

#include <chrono>
#include <cstddef>
#include <optional>
#include <vector>

namespace moelora {

class SlotPool {
 public:
  explicit SlotPool(int capacity) : capacity_(capacity) {}

  // free -> held. False when none is free.
  bool TryReserve();
  // held -> free: a load that never reached a worker's slot, or was rolled back everywhere.
  void Unreserve();
  // held -> releasing: its unload goes to the workers now.
  void BeginRelease();
  // releasing -> free when every rank freed it (`freed`), else releasing -> leaked.
  void EndRelease(bool freed);
  // held -> leaked: a rollback or an unload failed on some rank.
  void Leak();
  // The workers hold `orphans` slots the controller has no adapter for (their committed
  // adapters minus the held ones): those are the leaked ones from now on.
  void Reconcile(int orphans);
  // A fresh worker group holds nothing.
  void Reset();

  int capacity() const { return capacity_; }
  int held() const { return held_; }
  int releasing() const { return releasing_; }
  int leaked() const { return leaked_; }
  int free() const { return capacity_ - held_ - releasing_ - leaked_; }

  struct Candidate {
    bool resident = false;  // its adapter holds a slot
    bool pinned = false;    // never evicted
    bool in_use = false;    // a running sequence uses it
    std::chrono::steady_clock::time_point last_used;
  };
  // The least recently used resident, unpinned, unused candidate (its index), or none.
  static std::optional<size_t> PickVictim(const std::vector<Candidate>& candidates);

 private:
  int capacity_;
  int held_ = 0, releasing_ = 0, leaked_ = 0;
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_SLOT_POOL_H_
