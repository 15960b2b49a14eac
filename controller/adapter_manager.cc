#include "controller/adapter_manager.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <regex>
#include <utility>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "common/path_policy.h"
#include "common/status_macros.h"
#include "controller/http_server.h"
#include "lora/adapter.h"
#include "proto/adapter_format.h"

namespace moelora {
namespace {

using Steady = std::chrono::steady_clock;

double Seconds(Steady::duration d) { return std::chrono::duration<double>(d).count(); }

// The metric label of a record's format ("2d", "3d", "dense").
std::string FormatLabel(int proto_format) {
  const auto f = AdapterFormatFromProto(proto_format);
  return f ? AdapterFormatName(*f) : "unspecified";
}

std::string Reason(absl::StatusCode c) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(c));
}

}  // namespace

AdapterManager::AdapterManager(AdapterManagerOptions options, Registry* registry,
                               WorkerGroupInterface* group, ControllerMetrics* metrics,
                               std::function<bool()> serving, std::function<void()> wake)
    : options_(std::move(options)),
      registry_(registry),
      group_(group),
      metrics_(metrics),
      serving_(std::move(serving)),
      wake_(std::move(wake)),
      slots_(options_.max_loras) {
  MutexLock lock(&mu_);
  for (const AdapterRecord& r : registry_->List()) {
    Entry e;
    e.record = r;
    e.state = v1::ADAPTER_STATE_LOADING;
    adapters_[r.name] = e;
  }
  UpdateGauges();
}

void AdapterManager::ResetResidency() {
  MutexLock lock(&mu_);
  for (auto& [name, e] : adapters_) e.resident = false;
  slots_.Reset();
  UpdateGauges();
}

absl::StatusOr<int64_t> AdapterManager::Acquire(const std::string& name) {
  MutexLock lock(&mu_);
  auto it = adapters_.find(name);
  if (it != adapters_.end() && it->second.state == v1::ADAPTER_STATE_FAILED) {
    return absl::FailedPreconditionError(
        absl::StrCat("adapter \"", name, "\" failed to load: ", it->second.failure,
                     " (LoadAdapter with the same name and path tries again)"));
  }
  if (it == adapters_.end() || it->second.state != v1::ADAPTER_STATE_READY) {
    return absl::NotFoundError(
        absl::StrCat("adapter \"", name, "\" is not loaded",
                     it == adapters_.end()
                         ? ""
                         : absl::StrCat(" (state ", v1::AdapterState_Name(it->second.state), ")")));
  }
  ++it->second.active;
  it->second.last_used = options_.clock->Now();
  return it->second.record.id;
}

void AdapterManager::Release(const std::string& name) {
  bool unload_due = false;
  {
    MutexLock lock(&mu_);
    auto it = adapters_.find(name);
    if (it == adapters_.end()) return;
    unload_due = --it->second.active == 0 && it->second.state == v1::ADAPTER_STATE_UNLOADING;
  }
  // Its deferred unload runs on the scheduler's next pass, not after an idle tick.
  if (unload_due) wake_();  // never under mu_: the scheduler's mutex comes first
}

AdapterManager::Residency AdapterManager::Admit(const std::string& name, Clock::TimePoint now) {
  MutexLock lock(&mu_);
  auto it = adapters_.find(name);
  if (it == adapters_.end()) return Residency::kGone;
  if (!it->second.resident) return Residency::kNotResident;
  it->second.last_used = now;
  return Residency::kResident;
}

void AdapterManager::RunDeferredUnloads() {
  std::vector<int64_t> unload_ids, forget_ids;
  {
    MutexLock lock(&mu_);
    bool erased = false;
    for (auto it = adapters_.begin(); it != adapters_.end();) {
      if (it->second.state == v1::ADAPTER_STATE_UNLOADING && it->second.active == 0) {
        erased = true;
        if (it->second.resident) {
          unload_ids.push_back(it->second.record.id);
          slots_.BeginRelease();
        } else if (it->second.host_cached) {
          forget_ids.push_back(it->second.record.id);
        }
        it = adapters_.erase(it);
      } else {
        ++it;
      }
    }
    if (erased) UpdateGauges();
  }
  for (int64_t id : unload_ids) ReleaseSlot(id, false);
  for (int64_t id : forget_ids) ForgetHostCached(id);
}

void AdapterManager::ReconcileIfNeeded() {
  if (!reconcile_ || !group_->serving()) return;
  const Clock::TimePoint now = options_.clock->Now();
  if (now - last_reconcile_ < std::chrono::seconds(1)) return;
  last_reconcile_ = now;
  Reconcile();
}

v1::Adapter AdapterManager::ToProto(const Entry& e) const {
  const AdapterRecord& r = e.record;
  v1::Adapter a;
  a.set_name(r.name);
  a.set_id(r.id);
  a.set_path(r.path);
  a.set_format(static_cast<v1::AdapterFormat>(r.requested_format));
  a.set_detected_format(static_cast<v1::AdapterFormat>(r.detected_format));
  a.set_converted_to_2d(r.converted_to_2d);
  a.set_rank(r.rank);
  a.set_alpha(r.alpha);
  a.set_scaling(r.scaling);
  for (const auto& m : r.target_modules) a.add_target_modules(m);
  a.set_bytes(r.bytes);
  a.set_load_seconds(r.load_seconds);
  a.set_state(e.state);
  a.set_failure(e.failure);
  a.set_num_experts(r.num_experts);
  a.set_max_rank(r.max_rank);
  return a;
}

absl::Status AdapterManager::StageAndCommit(const AdapterRecord& r, bool* clean) {
  *clean = true;
  v1::StageAdapterRequest req;
  req.set_adapter_id(r.id);
  req.set_name(r.name);
  req.set_path(r.resolved_path);
  req.set_format(static_cast<v1::AdapterFormat>(r.requested_format));
  const auto t0 = Steady::now();
  auto staged = group_->StageAll(req);
  if (!staged.ok()) return staged.status();  // StageAll aborted it on the ranks that staged it
  const std::string fmt = FormatLabel(r.detected_format);
  metrics_->ObserveLoad(fmt, r.converted_to_2d, staged->from_host_cache() ? "swap_in" : "stage",
                        Seconds(Steady::now() - t0));
  const auto t1 = Steady::now();
  if (absl::Status s = group_->CommitAll(r.id); !s.ok()) {
    // Some ranks may have committed: undo everywhere. If that fails too, a rank may still hold
    // the slot: the caller counts it leaked until Reconcile() sees the workers again.
    const absl::Status aborted = group_->AbortAll(r.id);
    const absl::Status unloaded = group_->UnloadAll(r.id, false).status();
    if (!unloaded.ok()) {
      *clean = false;
      LOG(WARNING) << "rolling back adapter " << r.name << " failed (abort: " << aborted
                   << ", unload: " << unloaded << "); its slot counts as taken until reconciled";
    }
    return s;
  }
  metrics_->ObserveLoad(fmt, r.converted_to_2d, "commit", Seconds(Steady::now() - t1));
  return absl::OkStatus();
}

void AdapterManager::ReloadAll() {
  std::vector<std::string> order;
  {
    MutexLock lock(&mu_);
    slots_.Reset();  // a group that just became ready holds no adapter
    reconcile_ = false;
    std::vector<std::pair<int64_t, std::string>> ids;
    for (auto& [name, e] : adapters_) {
      e.resident = false;
      e.host_cached = false;  // fresh workers: empty host caches
      ids.push_back({e.record.id, name});
    }
    std::sort(ids.begin(), ids.end());
    for (auto& [id, name] : ids) order.push_back(name);
  }
  for (const std::string& name : order) {
    AdapterRecord rec;
    bool load = false;
    {
      MutexLock lock(&mu_);
      auto it = adapters_.find(name);
      if (it == adapters_.end() || it->second.state == v1::ADAPTER_STATE_UNLOADING) {
        if (it != adapters_.end() && it->second.active == 0) adapters_.erase(it);
        continue;
      }
      rec = it->second.record;
      load = slots_.TryReserve();
    }
    bool clean = true;
    absl::Status s = load ? StageAndCommit(rec, &clean) : absl::OkStatus();
    MutexLock lock(&mu_);
    auto it = adapters_.find(name);
    if (it == adapters_.end()) continue;
    if (s.ok()) {
      it->second.state = v1::ADAPTER_STATE_READY;
      it->second.failure.clear();
      it->second.resident = load;
    } else {
      LOG(WARNING) << "re-loading adapter " << name << " failed: " << s;
      ReturnReservation(clean);
      it->second.state = v1::ADAPTER_STATE_FAILED;
      it->second.failure = std::string(s.message());
    }
  }
  MutexLock lock(&mu_);
  UpdateGauges();
}

absl::StatusOr<v1::Adapter> AdapterManager::Load(const v1::LoadAdapterRequest& req) {
  const auto t0 = Steady::now();
  auto fail = [&](absl::Status s) {
    metrics_->adapter_load_failures.Add({{"reason", Reason(s.code())}}).Increment();
    return s;
  };
  static const std::regex kName("^[A-Za-z0-9._-]{1,128}$");
  if (!std::regex_match(req.name(), kName)) {
    return fail(absl::InvalidArgumentError(
        "adapter name must be 1-128 characters of letters, digits, '.', '_' or '-'"));
  }
  absl::StatusOr<std::string> resolved = ResolveAdapterPath(options_.adapter_root, req.path());
  if (!resolved.ok()) return fail(resolved.status());
  std::shared_ptr<Mutex> name_lock = NameLock(req.name());
  MutexLock serialize(name_lock.get());
  bool retry = false;
  {
    MutexLock lock(&mu_);
    auto it = adapters_.find(req.name());
    if (it != adapters_.end()) {
      if (it->second.state == v1::ADAPTER_STATE_UNLOADING) {
        return fail(absl::AbortedError(
            absl::StrCat("adapter \"", req.name(), "\" is being unloaded; retry when it is gone")));
      }
      if (it->second.record.resolved_path != *resolved) {
        return fail(absl::AlreadyExistsError(absl::StrCat(
            "adapter \"", req.name(), "\" is already loaded from ", it->second.record.path)));
      }
      if (it->second.state != v1::ADAPTER_STATE_FAILED) return ToProto(it->second);  // idempotent
      retry = true;
    } else if (req.pinned() && PinnedCount() + 1 >= options_.max_loras) {
      // A pinned adapter never leaves its slot: with every slot pinned, no other adapter could
      // ever run, and the strict FIFO queue would stall behind the first request for one.
      return fail(absl::FailedPreconditionError(absl::StrCat(
          "pinning \"", req.name(), "\" would leave no slot for the other adapters: ",
          PinnedCount(), " of --max-loras ", options_.max_loras, " slots are pinned already")));
    } else if (static_cast<int>(adapters_.size()) + loads_in_progress_ >= options_.max_registered) {
      return fail(absl::ResourceExhaustedError(
          absl::StrCat(adapters_.size(), " adapters are registered and ", loads_in_progress_,
                       " being loaded, the maximum (--max-registered-adapters)")));
    } else {
      ++loads_in_progress_;
    }
  }
  if (retry) {
    absl::StatusOr<v1::Adapter> a = RetryFailed(req.name());
    return a.ok() ? a : fail(a.status());
  }
  // Counted against --max-registered-adapters from the check above until its entry is in adapters_
  // (the validation in between runs unlocked, beside other loads).
  struct InProgress {
    AdapterManager* m;
    bool counted = true;  // until the entry below takes over
    ~InProgress() {
      if (!counted) return;
      MutexLock lock(&m->mu_);
      --m->loads_in_progress_;
    }
  } in_progress{this};
  if (!serving_()) return fail(absl::UnavailableError("the worker group is not ready"));
  // Validate here, before any worker is touched.
  AdapterReadOptions ro;
  ro.model = options_.model;
  ro.max_rank = options_.max_lora_rank;
  ro.expected_format = AdapterFormatFromProto(req.format());
  ro.parallel = false;
  AdapterLoadTimings timings;
  absl::StatusOr<LoraAdapter> a = ReadAdapter(*resolved, ro, &timings);
  // Whatever its code (a rank above --max-lora-rank is RESOURCE_EXHAUSTED), a bad adapter stays
  // bad: HTTP answers 400, which clients do not retry.
  if (!a.ok()) return fail(MarkFinal(a.status()));
  const v1::AdapterFormat native = group_->info().native_moe_format();
  const std::string flag = "--enable-mixed-moe-lora-format";
  if (!options_.mixed && a->format == AdapterFormat::k3D && native == v1::FORMAT_2D) {
    return fail(absl::FailedPreconditionError(
        absl::StrCat(req.path(), ": 3D MoE LoRA adapter, but ", options_.model.architecture,
                     " uses the 2D expert wrapper and ", flag, " is off; restart with ", flag)));
  }
  if (!options_.mixed && a->format == AdapterFormat::k2D && native == v1::FORMAT_3D) {
    return fail(absl::FailedPreconditionError(absl::StrCat(
        req.path(), ": 2D MoE LoRA adapter, but ", options_.model.architecture,
        " is 3D-native (3D expert wrapper) and ", flag, " is off; restart with ", flag)));
  }
  AdapterRecord rec;
  rec.name = req.name();
  rec.path = req.path();
  rec.resolved_path = *resolved;
  rec.requested_format = req.format();
  rec.detected_format = AdapterFormatToProto(a->format);
  rec.converted_to_2d = options_.mixed && a->format == AdapterFormat::k3D;
  rec.rank = a->config.r;
  rec.max_rank = a->max_rank;
  rec.alpha = a->config.lora_alpha;
  rec.scaling = a->config.use_rslora
                    ? a->config.lora_alpha / std::sqrt(static_cast<double>(a->config.r))
                    : a->config.lora_alpha / std::max(1, a->config.r);
  rec.target_modules = a->TargetModules();
  rec.num_experts = a->num_experts;
  rec.bytes = static_cast<int64_t>(a->bytes);
  rec.pinned = req.pinned();
  const std::string fmt = FormatLabel(rec.detected_format);
  metrics_->ObserveLoad(fmt, rec.converted_to_2d, "validate", Seconds(Steady::now() - t0));
  absl::StatusOr<int64_t> id = registry_->Insert(rec);
  if (!id.ok()) return fail(id.status());
  rec.id = *id;
  bool reserve = false;
  {
    MutexLock lock(&mu_);
    Entry e;
    e.record = rec;
    e.state = v1::ADAPTER_STATE_LOADING;
    e.last_used = options_.clock->Now();
    adapters_[rec.name] = e;
    --loads_in_progress_;
    in_progress.counted = false;
    reserve = slots_.TryReserve();
    UpdateGauges();
  }
  if (reserve) {
    bool clean = true;
    if (absl::Status s = StageAndCommit(rec, &clean); !s.ok()) {
      {
        MutexLock lock(&mu_);
        ReturnReservation(clean);
        adapters_.erase(rec.name);
        UpdateGauges();
      }
      // The registry must not bring it back after a restart; if it cannot forget it, say so
      // (a restart would then try to load it again, and mark it FAILED if that fails again).
      if (absl::Status r = registry_->Remove(rec.name); !r.ok()) {
        LOG(ERROR) << "adapter " << rec.name << " failed to load and the registry kept it: " << r;
        return fail(absl::Status(
            s.code(), absl::StrCat(s.message(), " (and removing it from the registry failed: ",
                                   r.message(), ")")));
      }
      wake_();
      return fail(s);
    }
  }
  rec.load_seconds = Seconds(Steady::now() - t0);
  if (absl::Status s = registry_->Update(rec); !s.ok()) {
    // Only load_seconds changed since the insert: the record stays valid.
    LOG(WARNING) << "adapter " << rec.name << ": recording its load time failed: " << s;
  }
  metrics_->ObserveLoad(fmt, rec.converted_to_2d, "total", rec.load_seconds);
  v1::Adapter out;
  {
    MutexLock lock(&mu_);
    Entry& e = adapters_[rec.name];
    e.record = rec;
    e.state = v1::ADAPTER_STATE_READY;
    e.resident = reserve;
    UpdateGauges();
    out = ToProto(e);
  }
  wake_();  // never under mu_: the scheduler's mutex comes first
  return out;
}

absl::StatusOr<v1::Adapter> AdapterManager::Unload(const std::string& name) {
  std::shared_ptr<Mutex> name_lock = NameLock(name);
  MutexLock serialize(name_lock.get());
  bool first = false;
  {
    MutexLock lock(&mu_);
    auto it = adapters_.find(name);
    if (it == adapters_.end()) {
      return absl::NotFoundError(absl::StrCat("adapter \"", name, "\" is not loaded"));
    }
    first = it->second.state != v1::ADAPTER_STATE_UNLOADING;
  }
  // Forget it on disk first (an fsync: outside mu_, so the scheduler never waits on it). If the
  // registry cannot, the unload fails and nothing changes; otherwise a restart would bring the
  // adapter back.
  if (first) {
    if (absl::Status s = registry_->Remove(name); !s.ok()) {
      return absl::Status(s.code(),
                          absl::StrCat("unloading adapter \"", name,
                                       "\": the registry could not remove it: ", s.message()));
    }
  }
  v1::Adapter out;
  int64_t id = 0;
  bool now = false, resident = false, host_cached = false;
  {
    MutexLock lock(&mu_);
    auto it = adapters_.find(name);
    if (it == adapters_.end()) {
      return absl::NotFoundError(absl::StrCat("adapter \"", name, "\" is not loaded"));
    }
    Entry& e = it->second;
    e.state = v1::ADAPTER_STATE_UNLOADING;
    out = ToProto(e);
    id = e.record.id;
    resident = e.resident;
    host_cached = e.host_cached;
    now = e.active == 0;
    if (now) {
      if (resident) slots_.BeginRelease();
      adapters_.erase(it);
    }
    UpdateGauges();
  }
  // In-flight requests keep it until they finish; the scheduler unloads it then. The slot counts
  // as taken until the workers have really freed it.
  if (now && resident) ReleaseSlot(id, false);
  if (now && host_cached) ForgetHostCached(id);
  metrics_->ForgetAdapter(name);
  wake_();
  return out;
}

void AdapterManager::ForgetHostCached(int64_t id) {
  // Not a slot: a failure costs host memory until the workers' LRU evicts it, nothing else.
  if (auto s = group_->UnloadAll(id, false); !s.ok()) {
    LOG(WARNING) << "dropping adapter id " << id
                 << " from the workers' host caches failed: " << s.status();
  }
}

void AdapterManager::ReleaseSlot(int64_t id, bool keep_in_host_cache) {
  const absl::StatusOr<std::vector<int64_t>> cached = group_->UnloadAll(id, keep_in_host_cache);
  if (!cached.ok()) {
    LOG(WARNING) << "unloading adapter id " << id << " from the workers failed: " << cached.status()
                 << "; its slot counts as taken until reconciled";
  }
  MutexLock lock(&mu_);
  slots_.EndRelease(cached.ok());
  if (!cached.ok()) reconcile_ = true;
  if (cached.ok()) SetHostCached(*cached);
  UpdateGauges();
}

void AdapterManager::SetHostCached(const std::vector<int64_t>& ids) {
  const std::set<int64_t> in(ids.begin(), ids.end());
  for (auto& [name, e] : adapters_) e.host_cached = !e.resident && in.count(e.record.id) > 0;
}

void AdapterManager::Reconcile() {
  auto committed = group_->CommittedAdapterIds();
  if (!committed.ok()) {
    LOG(WARNING) << "reconciling slots: the workers' Info failed: " << committed.status();
    return;
  }
  std::vector<int64_t> orphans;
  {
    MutexLock lock(&mu_);
    std::set<int64_t> held;
    for (const auto& [name, e] : adapters_) {
      // A load in progress holds a reservation for its slot.
      if (e.resident || e.state == v1::ADAPTER_STATE_LOADING) held.insert(e.record.id);
    }
    for (int64_t id : *committed) {
      if (!held.count(id)) orphans.push_back(id);
    }
  }
  int still = 0;
  for (int64_t id : orphans) {
    if (absl::Status s = group_->UnloadAll(id, false).status(); !s.ok()) {
      LOG(WARNING) << "reconciling slots: adapter id " << id << " is still on a worker: " << s;
      ++still;
    }
  }
  {
    MutexLock lock(&mu_);
    slots_.Reconcile(still);
    if (still == 0) reconcile_ = false;
  }
  LOG(INFO) << "reconciled slots with the workers: " << committed->size() << " committed, "
            << orphans.size() << " not held by the controller, " << still << " still taken";
  wake_();
}

absl::StatusOr<v1::Adapter> AdapterManager::Get(const std::string& name) const {
  MutexLock lock(&mu_);
  auto it = adapters_.find(name);
  if (it == adapters_.end())
    return absl::NotFoundError(absl::StrCat("adapter \"", name, "\" is not loaded"));
  return ToProto(it->second);
}

std::vector<v1::Adapter> AdapterManager::List() const {
  MutexLock lock(&mu_);
  std::vector<v1::Adapter> out;
  for (const auto& [name, e] : adapters_) out.push_back(ToProto(e));
  return out;
}

std::shared_ptr<Mutex> AdapterManager::NameLock(const std::string& name) {
  MutexLock lock(&mu_);
  auto& m = name_locks_[name];
  if (!m) m = std::make_shared<Mutex>();
  return m;
}

void AdapterManager::UpdateGauges() {
  std::map<v1::AdapterState, int> n = {{v1::ADAPTER_STATE_LOADING, 0},
                                       {v1::ADAPTER_STATE_READY, 0},
                                       {v1::ADAPTER_STATE_UNLOADING, 0},
                                       {v1::ADAPTER_STATE_FAILED, 0}};
  int resident = 0;
  for (const auto& [name, e] : adapters_) {
    ++n[e.state];
    resident += e.resident;
  }
  metrics_->adapters.Add({{"state", "loading"}}).Set(n[v1::ADAPTER_STATE_LOADING]);
  metrics_->adapters.Add({{"state", "ready"}}).Set(n[v1::ADAPTER_STATE_READY]);
  metrics_->adapters.Add({{"state", "unloading"}}).Set(n[v1::ADAPTER_STATE_UNLOADING]);
  metrics_->adapters.Add({{"state", "failed"}}).Set(n[v1::ADAPTER_STATE_FAILED]);
  metrics_->adapters.Add({{"state", "resident"}}).Set(resident);
  // Series only for adapters in a tier (a slot or the workers' host cache), each kept once made:
  // with a pair for every registered adapter, set on every change, the controller spent most of
  // a core hashing label maps at 1,000 adapters, and --max-registered-adapters bounded the
  // series.
  for (auto it = resident_series_.begin(); it != resident_series_.end();) {
    auto e = adapters_.find(it->first);
    if (e != adapters_.end() && (e->second.resident || e->second.host_cached)) {
      ++it;
      continue;
    }
    metrics_->adapter_resident.Remove(it->second.first);
    metrics_->adapter_resident.Remove(it->second.second);
    it = resident_series_.erase(it);
  }
  for (const auto& [name, e] : adapters_) {
    if (!e.resident && !e.host_cached) continue;
    auto [it, fresh] = resident_series_.try_emplace(name);
    if (fresh) {
      it->second = {&metrics_->adapter_resident.Add({{"adapter", name}, {"tier", "slot"}}),
                    &metrics_->adapter_resident.Add({{"adapter", name}, {"tier", "host"}})};
    }
    it->second.first->Set(e.resident ? 1 : 0);
    it->second.second->Set(e.host_cached ? 1 : 0);
  }
}

AdapterManager::SwapStart AdapterManager::BeginSwapIn(const std::string& name,
                                                      const std::set<std::string>& in_use,
                                                      SwapPlan* plan) {
  MutexLock lock(&mu_);
  auto it = adapters_.find(name);
  // Gone: its requests were failed.
  if (it == adapters_.end() || it->second.resident || it->second.swapping) {
    return SwapStart::kNothing;
  }
  int64_t victim = 0;
  if (!slots_.TryReserve()) {
    // A victim must not be used by a running sequence (queued requests for it are fine: they
    // swap it back in when their turn comes).
    std::vector<Entry*> entries;
    std::vector<SlotPool::Candidate> candidates;
    for (auto& [n, e] : adapters_) {
      entries.push_back(&e);
      candidates.push_back({e.resident, e.record.pinned, in_use.count(n) > 0, e.last_used});
    }
    const std::optional<size_t> best = SlotPool::PickVictim(candidates);
    if (!best) return SwapStart::kWait;  // every slot is busy: running requests must finish
    entries[*best]->resident = false;
    victim = entries[*best]->record.id;
    slots_.BeginRelease();
  }
  it->second.swapping = true;
  *plan = SwapPlan{name, it->second.record, victim};
  return SwapStart::kStarted;
}

absl::Status AdapterManager::FinishSwapIn(const SwapPlan& plan) {
  auto end_swap = [&]() ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_) {
    auto it = adapters_.find(plan.name);
    if (it != adapters_.end() && it->second.record.id == plan.record.id) {
      it->second.swapping = false;
    }
  };
  if (plan.victim != 0) {
    ReleaseSlot(plan.victim, /*keep_in_host_cache=*/true);
    MutexLock lock(&mu_);
    // The victim's slot, unless its unload failed (then it is leaked until reconciled) or a
    // concurrent load took it first: try again on a later pass.
    if (!slots_.TryReserve()) {
      end_swap();
      return absl::OkStatus();
    }
  }
  bool clean = true;
  absl::Status s = StageAndCommit(plan.record, &clean);
  bool orphaned = false;
  {
    MutexLock lock(&mu_);
    auto it = adapters_.find(plan.name);
    const bool same = it != adapters_.end() && it->second.record.id == plan.record.id;
    if (s.ok() && same) {
      it->second.resident = true;
      it->second.host_cached = false;
    } else if (s.ok()) {
      // Unloaded while it was being swapped in: the workers hold it; give the slot back.
      slots_.BeginRelease();
      orphaned = true;
    } else {
      ReturnReservation(clean);
      if (same) {
        it->second.state = v1::ADAPTER_STATE_FAILED;
        it->second.failure = std::string(s.message());
      }
    }
    end_swap();
    UpdateGauges();
  }
  if (orphaned) ReleaseSlot(plan.record.id, false);
  if (!s.ok()) {
    return absl::Status(
        s.code(), absl::StrCat("adapter \"", plan.name, "\" could not be loaded: ", s.message()));
  }
  return absl::OkStatus();
}

void AdapterManager::ReturnReservation(bool clean) {
  if (clean) {
    slots_.Unreserve();
  } else {
    slots_.Leak();  // a rank may hold it: taken until a reconcile has seen it freed
    reconcile_ = true;
  }
}

int AdapterManager::PinnedCount() const {
  int n = 0;
  for (const auto& [name, e] : adapters_) n += e.record.pinned ? 1 : 0;
  return n;
}

absl::StatusOr<v1::Adapter> AdapterManager::RetryFailed(const std::string& name) {
  AdapterRecord rec;
  bool reserve = false;
  {
    MutexLock lock(&mu_);
    auto it = adapters_.find(name);
    if (it == adapters_.end())
      return absl::NotFoundError(absl::StrCat("adapter \"", name, "\" is gone"));
    if (it->second.state != v1::ADAPTER_STATE_FAILED) return ToProto(it->second);
    if (!serving_()) return absl::UnavailableError("the worker group is not ready");
    it->second.state = v1::ADAPTER_STATE_LOADING;
    rec = it->second.record;
    reserve = slots_.TryReserve();
    UpdateGauges();
  }
  // Into a slot if one is free; otherwise READY and swapped in on demand, as after a restart.
  bool clean = true;
  const absl::Status s = reserve ? StageAndCommit(rec, &clean) : absl::OkStatus();
  v1::Adapter out;
  {
    MutexLock lock(&mu_);
    auto it = adapters_.find(name);  // still there: Unload of this name waits for this Load
    if (s.ok()) {
      it->second.state = v1::ADAPTER_STATE_READY;
      it->second.resident = reserve;
      it->second.failure.clear();
    } else {
      ReturnReservation(clean);
      it->second.state = v1::ADAPTER_STATE_FAILED;
      it->second.failure = std::string(s.message());
    }
    out = ToProto(it->second);
    UpdateGauges();
  }
  wake_();  // never under mu_: the scheduler's mutex comes first
  if (!s.ok()) {
    return absl::Status(s.code(),
                        absl::StrCat("adapter \"", name, "\" could not be loaded: ", s.message()));
  }
  return out;
}

}  // namespace moelora
