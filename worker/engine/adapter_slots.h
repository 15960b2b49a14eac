// The engine's LoRA slots: adapters staged into a reserved slot (read, validated, converted in
// mixed mode, copied), committed, aborted or unloaded, and the host cache of swapped-out slots
// (--max-cpu-loras) that a later swap-in copies back without reading a file.
// Stage, Abort and Unload run on the compute thread (they write slots); Commit, Lookup and
// Describe may run on any thread (adapters_mu guards the bookkeeping).
#ifndef MOELORA_WORKER_ENGINE_ADAPTER_SLOTS_H_
#define MOELORA_WORKER_ENGINE_ADAPTER_SLOTS_H_

#include <cstdint>
#include <functional>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <string>

#include "absl/status/statusor.h"
#include "worker/engine/engine.h"
#include "worker/model/causal_lm.h"

namespace moelora {

class AdapterSlots {
 public:
  AdapterSlots(CausalLM* model, const EngineOptions& options);

  // Engine::StageAdapter, CommitAdapter and AbortAdapter.
  [[nodiscard]] absl::StatusOr<StageResult> Stage(int64_t id, const std::string& path,
                                                  std::optional<AdapterFormat> expected);
  [[nodiscard]] absl::StatusOr<int> Commit(int64_t id);
  [[nodiscard]] absl::Status Abort(int64_t id);
  // Engine::UnloadAdapter; `check_unused(slot)` (the caller holds the step lock) refuses while a
  // running sequence uses the slot.
  [[nodiscard]] absl::StatusOr<HostCacheStats> Unload(
      int64_t id, bool keep_in_host_cache, const std::function<absl::Status(int)>& check_unused);
  // A joiner's committed adapter: its slot, and the slot its MTP head drafts with (-1 when the
  // adapter does not adapt the head). NOT_FOUND when not committed.
  [[nodiscard]] absl::Status Lookup(int64_t id, int32_t* slot, int32_t* head_slot) const;
  // The adapters and the host cache, as Info reports them.
  void Describe(EngineInfo* info) const;

 private:
  struct Entry {
    std::string path;
    int slot = -1;
    bool committed = false;
    StageResult result;
  };
  // A swapped-out adapter, as its slot held it.
  struct Cached {
    int64_t id = 0;
    std::string path;
    StageResult result;
    CausalLM::SlotImage image;
  };
  // Copies a cached slot image back into `slot`; nullopt (the slot cleared) when that fails.
  std::optional<StageResult> SwapIn(int64_t id, int slot, const Cached& cached);
  // Reads the adapter's file into `slot`; on an error the slot is clear.
  absl::StatusOr<StageResult> ReadIntoSlot(int slot, const std::string& path,
                                           std::optional<AdapterFormat> expected);
  // Under mu_.
  HostCacheStats CacheStats() const;
  std::optional<Cached> TakeCached(int64_t id);
  void Release(int64_t id, int slot);

  CausalLM* model_;
  const EngineOptions options_;
  mutable std::mutex mu_;  // guards everything below
  std::map<int64_t, Entry> adapters_;
  std::set<int> free_slots_;
  std::list<Cached> host_cache_;  // most recently used first
  int64_t host_cache_bytes_ = 0;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_ENGINE_ADAPTER_SLOTS_H_
