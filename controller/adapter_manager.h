// The controller's adapters: their entries and states, per-name locks, the registry, the worker
// slots (SlotPool) and the workers' host caches, load / unload / get / list, reload after a
// group restart, swap-ins for the scheduler, and reconciliation with the workers' committed
// adapters after a failed unload.
//
// Adapters are validated here with lora/ before any worker is touched; then staged on every rank
// and committed only when all succeeded (rolled back otherwise). At most --max-loras are
// resident in worker slots; up to --max-cpu-loras are registered.
//
// Thread-safety: all public methods may be called from any thread; loads and unloads of one
// name are serialised by its name lock. Lock order: a caller may hold the scheduler's mutex
// while calling Admit / Acquire / Release; this class never calls the scheduler with its own
// mutex held (`wake` only signals a condition variable).
#ifndef MOELORA_CONTROLLER_ADAPTER_MANAGER_H_
#define MOELORA_CONTROLLER_ADAPTER_MANAGER_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/clock.h"
#include "common/mutex.h"
#include "controller/metrics.h"
#include "controller/registry.h"
#include "controller/slot_pool.h"
#include "controller/worker_group_interface.h"
#include "moelora/v1/controller.pb.h"
#include "schema/model_info.h"

namespace moelora {

struct AdapterManagerOptions {
  std::string adapter_root;
  int max_loras = 4;
  int max_cpu_loras = 8;
  // Registered adapters at most (the registry; beyond the host cache and the slots, each is
  // read from disk when a request needs it).
  int max_registered = 100000;
  int max_lora_rank = 16;
  bool mixed = false;
  ModelInfo model;  // dims for adapter validation
  // What LRU ages and the reconcile interval are read on (load latencies, figures rather than
  // decisions, always on the steady clock).
  Clock* clock = Clock::Real();
};

class AdapterManager {
 public:
  // Takes the registry's adapters as LOADING (ReloadAll loads them once the group is ready).
  // `serving`: whether the group is ready for loads; `wake`: the scheduler has work.
  AdapterManager(AdapterManagerOptions options, Registry* registry, WorkerGroupInterface* group,
                 ControllerMetrics* metrics, std::function<bool()> serving,
                 std::function<void()> wake);

  [[nodiscard]] absl::StatusOr<v1::Adapter> Load(const v1::LoadAdapterRequest& req)
      ABSL_LOCKS_EXCLUDED(mu_);
  // New requests for it get NOT_FOUND at once; queued and running ones keep it until they end
  // (then RunDeferredUnloads drops it).
  [[nodiscard]] absl::StatusOr<v1::Adapter> Unload(const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::StatusOr<v1::Adapter> Get(const std::string& name) const
      ABSL_LOCKS_EXCLUDED(mu_);
  std::vector<v1::Adapter> List() const ABSL_LOCKS_EXCLUDED(mu_);

  // The group just became ready (fresh workers): every adapter is loaded again, by id, into as
  // many slots as there are; the rest stay registered (swapped in on demand).
  void ReloadAll() ABSL_LOCKS_EXCLUDED(mu_);
  // The group went down: nothing is resident any more.
  void ResetResidency() ABSL_LOCKS_EXCLUDED(mu_);

  // For requests. Acquire: a READY adapter's id, counting one more request on it (NOT_FOUND
  // otherwise); Release ends that count.
  [[nodiscard]] absl::StatusOr<int64_t> Acquire(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  void Release(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  enum class Residency { kGone, kResident, kNotResident };
  // At admission: whether the adapter holds a slot (then it counts as used `now`).
  Residency Admit(const std::string& name, Clock::TimePoint now) ABSL_LOCKS_EXCLUDED(mu_);

  // Scheduler thread, no scheduler lock held (these call the workers).
  // Adapters being unloaded whose last request has ended leave the workers and the entries.
  void RunDeferredUnloads() ABSL_LOCKS_EXCLUDED(mu_);
  // A swap-in in two parts, so that steps go on while the workers read the adapter.
  // BeginSwapIn (the scheduler thread, where `in_use` is current) takes a free slot, or picks the
  // least recently used resident adapter that no running sequence uses (`in_use`) and that is
  // not pinned, and takes it out of residency (no request for it is admitted from here on).
  // kNothing: gone, resident or already being swapped in; kWait: every slot is busy (try
  // again later). FinishSwapIn (any thread, once per kStarted) swaps the victim out into the
  // workers' host cache and stages and commits `name`: OK when it is resident now, gone, or
  // still not resident because its slot went to a concurrent load first (the scheduler tries
  // again); an error when staging it failed (the adapter is then FAILED and its queued requests
  // must fail with that error).
  struct SwapPlan {
    std::string name;
    AdapterRecord record;
    int64_t victim = 0;  // the adapter id swapped out for it; 0: a free slot was reserved
  };
  enum class SwapStart { kStarted, kNothing, kWait };
  SwapStart BeginSwapIn(const std::string& name, const std::set<std::string>& in_use,
                        SwapPlan* plan) ABSL_LOCKS_EXCLUDED(mu_);
  [[nodiscard]] absl::Status FinishSwapIn(const SwapPlan& plan) ABSL_LOCKS_EXCLUDED(mu_);
  // After a failed unload or rollback: counts the workers' committed adapters again (at most
  // once a second while they keep failing).
  void ReconcileIfNeeded() ABSL_LOCKS_EXCLUDED(mu_);

 private:
  struct Entry {
    AdapterRecord record;
    v1::AdapterState state = v1::ADAPTER_STATE_LOADING;
    bool resident = false;
    bool host_cached = false;  // in the workers' host cache (rank 0's word), while not resident
    bool swapping = false;     // between BeginSwapIn and the end of FinishSwapIn
    int active = 0;            // queued or running requests
    Clock::TimePoint last_used;
    std::string failure;  // why it is FAILED
  };
  v1::Adapter ToProto(const Entry& e) const;
  // On failure *clean says whether every rank is back to not holding it (else its slot leaked).
  [[nodiscard]] absl::Status StageAndCommit(const AdapterRecord& r, bool* clean)
      ABSL_LOCKS_EXCLUDED(mu_);
  void Reconcile() ABSL_LOCKS_EXCLUDED(mu_);
  // Sends a released slot's unload to the workers and ends the release; `keep_in_host_cache`
  // for a swap-out.
  void ReleaseSlot(int64_t id, bool keep_in_host_cache) ABSL_LOCKS_EXCLUDED(mu_);
  // The host tier from rank 0's host cache.
  void SetHostCached(const std::vector<int64_t>& ids) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // An unloaded adapter that was not in a slot: drop it from the workers' host caches.
  void ForgetHostCached(int64_t id) ABSL_LOCKS_EXCLUDED(mu_);
  std::shared_ptr<Mutex> NameLock(const std::string& name) ABSL_LOCKS_EXCLUDED(mu_);
  void UpdateGauges() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);

  const AdapterManagerOptions options_;
  Registry* const registry_;
  WorkerGroupInterface* const group_;
  ControllerMetrics* const metrics_;
  const std::function<bool()> serving_;
  const std::function<void()> wake_;

  mutable Mutex mu_;
  // A slot reserved for a load that failed: free again when `clean` (no rank holds it), else
  // leaked until a reconcile sees the workers free it.
  void ReturnReservation(bool clean) ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // Registered adapters that are pinned.
  int PinnedCount() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  // LoadAdapter of an adapter that FAILED, with the same name and path: into a slot again.
  [[nodiscard]] absl::StatusOr<v1::Adapter> RetryFailed(const std::string& name)
      ABSL_LOCKS_EXCLUDED(mu_);

  std::map<std::string, Entry> adapters_ ABSL_GUARDED_BY(mu_);
  // Loads between their --max-cpu-loras check and their entry: counted against the limit too.
  int loads_in_progress_ ABSL_GUARDED_BY(mu_) = 0;
  SlotPool slots_ ABSL_GUARDED_BY(mu_);  // worker slots: held, releasing, leaked, free
  std::map<std::string, std::shared_ptr<Mutex>> name_locks_ ABSL_GUARDED_BY(mu_);
  // Adapters with moelora_adapter_resident series: their slot and host tier series.
  std::map<std::string, std::pair<prometheus::Gauge*, prometheus::Gauge*>> resident_series_
      ABSL_GUARDED_BY(mu_);
  std::atomic<bool> reconcile_{false};  // a failed unload or rollback: Reconcile() next pass
  Clock::TimePoint last_reconcile_{};   // scheduler thread only
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_ADAPTER_MANAGER_H_
