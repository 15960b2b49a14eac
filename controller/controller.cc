#include "controller/controller.h"

#include <algorithm>
#include <cmath>
#include <random>
#include <regex>
#include <set>

#include "absl/strings/ascii.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"
#include "common/status_macros.h"
#include "controller/path_policy.h"
#include "lora/adapter.h"
#include "proto/adapter_format.h"

namespace moelora {
namespace {

using Clock = std::chrono::steady_clock;

double Seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// Why a request must leave: its deadline passed or its client cancelled (deadline first: gRPC also
// marks a call cancelled when its deadline passes). OK when it may stay.
// Stop strings per request, and their length: the RPC thread scans each new token's text for
// them, so the bounds keep that scan short.
constexpr int kMaxStopStrings = 16;
constexpr size_t kMaxStopBytes = 256;

[[nodiscard]] absl::Status Expiry(const GenRequest& r, Clock::time_point now, const char* where) {
  if (now > r.deadline)
    return absl::DeadlineExceededError(absl::StrCat("deadline exceeded while ", where));
  if (r.cancelled) return absl::CancelledError("cancelled by the client");
  return absl::OkStatus();
}

// The metric label of a record's format ("2d", "3d", "dense").
std::string FormatLabel(int proto_format) {
  const auto f = AdapterFormatFromProto(proto_format);
  return f ? AdapterFormatName(*f) : "unspecified";
}

std::string Reason(absl::StatusCode c) {
  return absl::AsciiStrToLower(absl::StatusCodeToString(c));
}

}  // namespace

Controller::Controller(ControllerOptions options, Registry* registry, WorkerGroupInterface* group,
                       ControllerMetrics* metrics)
    : options_(std::move(options)),
      registry_(registry),
      group_(group),
      metrics_(metrics),
      slots_(options_.max_loras) {
  for (const AdapterRecord& r : registry_->List()) {
    Entry e;
    e.record = r;
    e.state = v1::ADAPTER_STATE_LOADING;
    adapters_[r.name] = e;
  }
  std::lock_guard<std::mutex> lock(mu_);
  UpdateAdapterGauges();
}

Controller::~Controller() { Stop(); }

void Controller::Start() {
  loop_ = std::thread([this] { Loop(); });
}

void Controller::Stop() {
  if (stop_.exchange(true)) return;
  cv_.notify_all();
  if (loop_.joinable()) loop_.join();
  FailAll(absl::UnavailableError("the controller is shutting down"));
}

int Controller::in_flight() const {
  std::lock_guard<std::mutex> lock(mu_);
  return static_cast<int>(pending_.size() + running_.size());
}

std::shared_ptr<std::mutex> Controller::NameLock(const std::string& name) {
  std::lock_guard<std::mutex> lock(mu_);
  auto& m = name_locks_[name];
  if (!m) m = std::make_shared<std::mutex>();
  return m;
}

void Controller::UpdateAdapterGauges() {
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
  for (auto it = resident_series_.begin(); it != resident_series_.end();) {
    if (adapters_.count(*it)) {
      ++it;
      continue;
    }
    for (const char* tier : {"slot", "host"}) {
      metrics_->adapter_resident.Remove(
          &metrics_->adapter_resident.Add({{"adapter", *it}, {"tier", tier}}));
    }
    it = resident_series_.erase(it);
  }
  for (const auto& [name, e] : adapters_) {
    metrics_->adapter_resident.Add({{"adapter", name}, {"tier", "slot"}}).Set(e.resident ? 1 : 0);
    metrics_->adapter_resident.Add({{"adapter", name}, {"tier", "host"}})
        .Set(e.host_cached ? 1 : 0);
    resident_series_.insert(name);
  }
  UpdateLoraInfo();
}

void Controller::UpdateLoraInfo() {
  std::set<std::string> running, waiting;
  for (const auto& [id, r] : running_) {
    if (!r->adapter.empty()) running.insert(r->adapter);
  }
  for (const auto& r : pending_) {
    if (!r->adapter.empty()) waiting.insert(r->adapter);
  }
  const std::string run = absl::StrJoin(running, ","), wait = absl::StrJoin(waiting, ",");
  const std::string key = absl::StrCat(run, "|", wait);
  if (lora_info_ != nullptr && key == lora_info_key_) return;
  if (lora_info_ != nullptr) metrics_->lora_requests_info.Remove(lora_info_);
  lora_info_ =
      &metrics_->lora_requests_info.Add({{"running_lora_adapters", run},
                                         {"waiting_lora_adapters", wait},
                                         {"max_lora", std::to_string(options_.max_loras)}});
  lora_info_->Set(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  lora_info_key_ = key;
}

v1::Adapter Controller::ToProto(const Entry& e) const {
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
  a.set_num_experts(r.num_experts);
  a.set_max_rank(r.max_rank);
  return a;
}

absl::Status Controller::StageAndCommit(const AdapterRecord& r, bool* clean) {
  *clean = true;
  v1::StageAdapterRequest req;
  req.set_adapter_id(r.id);
  req.set_name(r.name);
  req.set_path(r.resolved_path);
  req.set_format(static_cast<v1::AdapterFormat>(r.requested_format));
  const auto t0 = Clock::now();
  auto staged = group_->StageAll(req);
  if (!staged.ok()) return staged.status();  // StageAll aborted it on the ranks that staged it
  const std::string fmt = FormatLabel(r.detected_format);
  metrics_->ObserveLoad(fmt, r.converted_to_2d, staged->from_host_cache() ? "swap_in" : "stage",
                        Seconds(Clock::now() - t0));
  const auto t1 = Clock::now();
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
  metrics_->ObserveLoad(fmt, r.converted_to_2d, "commit", Seconds(Clock::now() - t1));
  return absl::OkStatus();
}

absl::Status Controller::OnGroupReady() {
  ready_ = false;
  std::vector<std::string> order;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
      std::lock_guard<std::mutex> lock(mu_);
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
    std::lock_guard<std::mutex> lock(mu_);
    auto it = adapters_.find(name);
    if (it == adapters_.end()) continue;
    if (s.ok()) {
      it->second.state = v1::ADAPTER_STATE_READY;
      it->second.resident = load;
    } else {
      LOG(WARNING) << "re-loading adapter " << name << " failed: " << s;
      if (clean) {
        slots_.Unreserve();
      } else {
        slots_.Leak();
        reconcile_ = true;
      }
      it->second.state = v1::ADAPTER_STATE_FAILED;
    }
  }
  {
    std::lock_guard<std::mutex> lock(mu_);
    UpdateAdapterGauges();
  }
  ready_ = true;
  metrics_->serving.Set(1);
  cv_.notify_all();
  return absl::OkStatus();
}

void Controller::OnGroupDown(const std::string& why) {
  ready_ = false;
  metrics_->serving.Set(0);
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& [name, e] : adapters_) e.resident = false;
    slots_.Reset();
  }
  FailAll(absl::UnavailableError(absl::StrCat("worker group went down: ", why)));
}

void Controller::FailAll(const absl::Status& s) {
  std::vector<std::shared_ptr<GenRequest>> victims;
  {
    std::lock_guard<std::mutex> lock(mu_);
    for (auto& r : pending_) victims.push_back(r);
    for (auto& [id, r] : running_) victims.push_back(r);
    pending_.clear();
    running_.clear();
    metrics_->queue_depth.Set(0);
    metrics_->running.Set(0);
  }
  for (auto& r : victims) Finish(r, s, "");
}

void Controller::Finish(const std::shared_ptr<GenRequest>& r, absl::Status s,
                        const std::string& reason) {
  {
    std::lock_guard<std::mutex> lock(r->mu);
    if (r->done) return;
    r->done = true;
    r->status = std::move(s);
    r->finish_reason = reason;
    r->total_seconds = Seconds(Clock::now() - r->arrival);
  }
  r->cv.notify_all();
  if (!r->adapter.empty()) {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = adapters_.find(r->adapter);
    if (it != adapters_.end()) --it->second.active;
  }
  cv_.notify_all();
}

void Controller::RecordRequest(const GenRequest& r, absl::StatusCode code) {
  metrics_->requests
      .Add({{"adapter", r.adapter.empty() ? "base" : r.adapter}, {"code", Reason(code)}})
      .Increment();
}

absl::StatusOr<v1::Adapter> Controller::LoadAdapter(const v1::LoadAdapterRequest& req) {
  const auto t0 = Clock::now();
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
  std::shared_ptr<std::mutex> name_lock = NameLock(req.name());
  std::lock_guard<std::mutex> serialize(*name_lock);
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = adapters_.find(req.name());
    if (it != adapters_.end()) {
      if (it->second.state == v1::ADAPTER_STATE_UNLOADING) {
        return fail(absl::AbortedError(
            absl::StrCat("adapter \"", req.name(), "\" is being unloaded; retry when it is gone")));
      }
      if (it->second.record.resolved_path == *resolved) return ToProto(it->second);  // idempotent
      return fail(absl::AlreadyExistsError(absl::StrCat(
          "adapter \"", req.name(), "\" is already loaded from ", it->second.record.path)));
    }
    if (static_cast<int>(adapters_.size()) >= options_.max_cpu_loras) {
      return fail(absl::ResourceExhaustedError(absl::StrCat(
          adapters_.size(), " adapters are registered, the maximum (--max-cpu-loras)")));
    }
  }
  if (!serving()) return fail(absl::UnavailableError("the worker group is not ready"));
  // Validate here, before any worker is touched.
  AdapterReadOptions ro;
  ro.model = options_.model;
  ro.max_rank = options_.max_lora_rank;
  ro.expected_format = AdapterFormatFromProto(req.format());
  AdapterLoadTimings timings;
  absl::StatusOr<LoraAdapter> a = ReadAdapter(*resolved, ro, &timings);
  if (!a.ok()) return fail(a.status());
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
  metrics_->ObserveLoad(fmt, rec.converted_to_2d, "validate", Seconds(Clock::now() - t0));
  absl::StatusOr<int64_t> id = registry_->Insert(rec);
  if (!id.ok()) return fail(id.status());
  rec.id = *id;
  bool reserve = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    Entry e;
    e.record = rec;
    e.state = v1::ADAPTER_STATE_LOADING;
    e.last_used = Clock::now();
    adapters_[rec.name] = e;
    reserve = slots_.TryReserve();
    UpdateAdapterGauges();
  }
  if (reserve) {
    bool clean = true;
    if (absl::Status s = StageAndCommit(rec, &clean); !s.ok()) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (clean) {
          slots_.Unreserve();
        } else {
          slots_.Leak();
          reconcile_ = true;
        }
        adapters_.erase(rec.name);
        UpdateAdapterGauges();
      }
      // The registry must not bring it back after a restart; if it cannot forget it, say so
      // (a restart would then try to load it again, and mark it FAILED if that fails again).
      if (absl::Status r = registry_->Remove(rec.name); !r.ok()) {
        LOG(ERROR) << "adapter " << rec.name << " failed to load and the registry kept it: " << r;
        return fail(absl::Status(
            s.code(), absl::StrCat(s.message(), " (and removing it from the registry failed: ",
                                   r.message(), ")")));
      }
      cv_.notify_all();
      return fail(s);
    }
  }
  rec.load_seconds = Seconds(Clock::now() - t0);
  if (absl::Status s = registry_->Update(rec); !s.ok()) {
    // Only load_seconds changed since the insert: the record stays valid.
    LOG(WARNING) << "adapter " << rec.name << ": recording its load time failed: " << s;
  }
  metrics_->ObserveLoad(fmt, rec.converted_to_2d, "total", rec.load_seconds);
  std::lock_guard<std::mutex> lock(mu_);
  Entry& e = adapters_[rec.name];
  e.record = rec;
  e.state = v1::ADAPTER_STATE_READY;
  e.resident = reserve;
  UpdateAdapterGauges();
  cv_.notify_all();
  return ToProto(e);
}

absl::StatusOr<v1::Adapter> Controller::UnloadAdapter(const std::string& name) {
  std::shared_ptr<std::mutex> name_lock = NameLock(name);
  std::lock_guard<std::mutex> serialize(*name_lock);
  bool first = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
    std::lock_guard<std::mutex> lock(mu_);
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
    UpdateAdapterGauges();
  }
  // In-flight requests keep it until they finish; the scheduler unloads it then. The slot counts
  // as taken until the workers have really freed it.
  if (now && resident) ReleaseSlot(id, false);
  if (now && host_cached) ForgetHostCached(id);
  cv_.notify_all();
  return out;
}

void Controller::ForgetHostCached(int64_t id) {
  // Not a slot: a failure costs host memory until the workers' LRU evicts it, nothing else.
  if (auto s = group_->UnloadAll(id, false); !s.ok()) {
    LOG(WARNING) << "dropping adapter id " << id
                 << " from the workers' host caches failed: " << s.status();
  }
}

void Controller::ReleaseSlot(int64_t id, bool keep_in_host_cache) {
  const absl::StatusOr<std::vector<int64_t>> cached = group_->UnloadAll(id, keep_in_host_cache);
  if (!cached.ok()) {
    LOG(WARNING) << "unloading adapter id " << id << " from the workers failed: " << cached.status()
                 << "; its slot counts as taken until reconciled";
  }
  std::lock_guard<std::mutex> lock(mu_);
  slots_.EndRelease(cached.ok());
  if (!cached.ok()) reconcile_ = true;
  if (cached.ok()) SetHostCached(*cached);
  UpdateAdapterGauges();
}

void Controller::SetHostCached(const std::vector<int64_t>& ids) {
  const std::set<int64_t> in(ids.begin(), ids.end());
  for (auto& [name, e] : adapters_) e.host_cached = !e.resident && in.count(e.record.id) > 0;
}

void Controller::Reconcile() {
  auto committed = group_->CommittedAdapterIds();
  if (!committed.ok()) {
    LOG(WARNING) << "reconciling slots: the workers' Info failed: " << committed.status();
    return;
  }
  std::vector<int64_t> orphans;
  {
    std::lock_guard<std::mutex> lock(mu_);
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
  std::lock_guard<std::mutex> lock(mu_);
  slots_.Reconcile(still);
  if (still == 0) reconcile_ = false;
  LOG(INFO) << "reconciled slots with the workers: " << committed->size() << " committed, "
            << orphans.size() << " not held by the controller, " << still << " still taken";
  cv_.notify_all();
}

absl::StatusOr<v1::Adapter> Controller::GetAdapter(const std::string& name) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = adapters_.find(name);
  if (it == adapters_.end())
    return absl::NotFoundError(absl::StrCat("adapter \"", name, "\" is not loaded"));
  return ToProto(it->second);
}

std::vector<v1::Adapter> Controller::ListAdapters() const {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<v1::Adapter> out;
  for (const auto& [name, e] : adapters_) out.push_back(ToProto(e));
  return out;
}

absl::StatusOr<std::shared_ptr<GenRequest>> Controller::Submit(const v1::GenerateRequest& request,
                                                               Clock::time_point deadline) {
  if (!serving()) return absl::UnavailableError("not serving: the worker group is not ready");
  const v1::WorkerInfoResponse info = group_->info();
  v1::GenerateRequest req = request;
  double tokenize_seconds = 0;
  if (!req.prompt().empty()) {
    if (!req.prompt_token_ids().empty()) {
      return absl::InvalidArgumentError("set prompt or prompt_token_ids, not both");
    }
    if (options_.tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "this model directory has no tokenizer.json: send prompt_token_ids instead of prompt");
    }
    // Tokenized here, in the RPC thread: the scheduler and the workers never wait on it.
    const auto t0 = Clock::now();
    auto ids = options_.tokenizer->Encode(req.prompt());
    tokenize_seconds = Seconds(Clock::now() - t0);
    metrics_->tokenize_seconds.Observe(tokenize_seconds);
    if (!ids.ok())
      return absl::InvalidArgumentError(absl::StrCat("prompt: ", ids.status().message()));
    if (ids->empty()) return absl::InvalidArgumentError("prompt encodes to no tokens");
    if (static_cast<int64_t>(ids->size()) >= info.max_model_len()) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt is ", ids->size(), " tokens; max_model_len ", info.max_model_len(),
                       " leaves no room to generate"));
    }
    req.clear_prompt();
    req.mutable_prompt_token_ids()->Add(ids->begin(), ids->end());
  }
  if (req.prompt_token_ids().empty()) return absl::InvalidArgumentError("empty prompt");
  if (req.stop_size() > 0) {
    if (options_.tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "stop strings need a tokenizer: this model directory has no tokenizer.json");
    }
    if (req.stop_size() > kMaxStopStrings) {
      return absl::InvalidArgumentError(
          absl::StrCat("at most ", kMaxStopStrings, " stop strings, not ", req.stop_size()));
    }
    for (int i = 0; i < req.stop_size(); ++i) {
      if (req.stop(i).empty() || req.stop(i).size() > kMaxStopBytes) {
        return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] must be 1..", kMaxStopBytes,
                                                       " bytes, not ", req.stop(i).size()));
      }
    }
  }
  for (int i = 0; i < req.prompt_token_ids_size(); ++i) {
    const int32_t t = req.prompt_token_ids(i);
    if (t < 0 || t >= info.vocab_size()) {
      return absl::InvalidArgumentError(absl::StrCat("prompt_token_ids[", i, "] = ", t,
                                                     " is outside the vocabulary [0, ",
                                                     info.vocab_size(), ")"));
    }
  }
  const int64_t room = static_cast<int64_t>(info.max_model_len()) - req.prompt_token_ids_size();
  if (req.max_tokens() <= 0 || req.max_tokens() > room) {
    return absl::InvalidArgumentError(absl::StrCat(
        "max_tokens ", req.max_tokens(), " must be in [1, ", std::max<int64_t>(room, 0),
        "] (max_model_len ", info.max_model_len(), " minus the prompt)"));
  }
  if (!(req.temperature() >= 0) || !(req.top_p() >= 0 && req.top_p() <= 1) || req.top_k() < 0) {
    return absl::InvalidArgumentError("temperature must be >= 0, top_p in [0, 1], top_k >= 0");
  }
  for (int32_t t : req.stop_token_ids()) {
    if (t < 0 || t >= info.vocab_size()) {
      return absl::InvalidArgumentError(
          absl::StrCat("stop token ", t, " is outside the vocabulary"));
    }
  }
  if (!req.ignore_eos()) {
    for (int32_t id : options_.eos_token_ids) {
      if (id >= 0 && id < info.vocab_size() &&
          std::find(req.stop_token_ids().begin(), req.stop_token_ids().end(), id) ==
              req.stop_token_ids().end()) {
        req.add_stop_token_ids(id);
      }
    }
  }
  auto r = std::make_shared<GenRequest>();
  r->req = std::move(req);
  r->tokenize_seconds = tokenize_seconds;
  r->adapter = r->req.adapter();
  r->arrival = Clock::now();
  r->deadline = deadline;
  r->seed = r->req.seed();
  if (r->seed == 0)
    r->seed = std::random_device{}() | (static_cast<uint64_t>(std::random_device{}()) << 32);
  std::lock_guard<std::mutex> lock(mu_);
  if (!r->adapter.empty()) {
    auto it = adapters_.find(r->adapter);
    if (it == adapters_.end() || it->second.state != v1::ADAPTER_STATE_READY) {
      return absl::NotFoundError(absl::StrCat(
          "adapter \"", r->adapter, "\" is not loaded",
          it == adapters_.end()
              ? ""
              : absl::StrCat(" (state ", v1::AdapterState_Name(it->second.state), ")")));
    }
    ++it->second.active;
    it->second.last_used = Clock::now();
    r->adapter_id = it->second.record.id;
  }
  r->seq_id = next_seq_++;
  pending_.push_back(r);
  metrics_->queue_depth.Set(static_cast<double>(pending_.size()));
  UpdateLoraInfo();
  cv_.notify_all();
  return r;
}

bool Controller::TrySwapIn(const std::string& name) {
  AdapterRecord rec;
  int64_t victim = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = adapters_.find(name);
    if (it == adapters_.end()) return true;  // gone: its requests were failed
    if (it->second.resident) return true;
    if (!slots_.TryReserve()) {
      // A victim must not be used by a running sequence (queued requests for it are fine: they
      // swap it back in when their turn comes).
      std::set<std::string> in_use;
      for (const auto& [id, r] : running_) in_use.insert(r->adapter);
      std::vector<Entry*> entries;
      std::vector<SlotPool::Candidate> candidates;
      for (auto& [n, e] : adapters_) {
        entries.push_back(&e);
        candidates.push_back({e.resident, e.record.pinned, in_use.count(n) > 0, e.last_used});
      }
      const std::optional<size_t> best = SlotPool::PickVictim(candidates);
      if (!best) return false;  // every slot is busy: wait for running requests to finish
      entries[*best]->resident = false;
      victim = entries[*best]->record.id;
      slots_.BeginRelease();
    }
    rec = it->second.record;
  }
  if (victim != 0) {
    ReleaseSlot(victim, /*keep_in_host_cache=*/true);
    std::lock_guard<std::mutex> lock(mu_);
    // The victim's slot, unless its unload failed (then it is leaked until reconciled) or a
    // concurrent load took it first: try again on a later pass.
    if (!slots_.TryReserve()) return false;
  }
  bool clean = true;
  absl::Status s = StageAndCommit(rec, &clean);
  std::vector<std::shared_ptr<GenRequest>> failed;
  bool orphaned = false;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = adapters_.find(name);
    if (s.ok() && it != adapters_.end()) {
      it->second.resident = true;
      it->second.host_cached = false;
    } else if (s.ok()) {
      // Unloaded while it was being swapped in: the workers hold it; give the slot back.
      slots_.BeginRelease();
      orphaned = true;
    } else {
      if (clean) {
        slots_.Unreserve();
      } else {
        slots_.Leak();
        reconcile_ = true;
      }
      if (it != adapters_.end()) it->second.state = v1::ADAPTER_STATE_FAILED;
      for (auto p = pending_.begin(); p != pending_.end();) {
        if ((*p)->adapter == name) {
          failed.push_back(*p);
          p = pending_.erase(p);
        } else {
          ++p;
        }
      }
    }
    UpdateAdapterGauges();
  }
  if (orphaned) ReleaseSlot(rec.id, false);
  for (auto& r : failed) {
    Finish(r,
           absl::Status(s.code(),
                        absl::StrCat("adapter \"", name, "\" could not be loaded: ", s.message())),
           "");
  }
  return true;
}

void Controller::Loop() {
  Clock::time_point last_reconcile{};
  while (!stop_) {
    // After a failed unload or rollback, count the workers' slots again (at most once a second
    // while the workers keep failing).
    if (reconcile_ && group_->serving() &&
        Clock::now() - last_reconcile >= std::chrono::seconds(1)) {
      last_reconcile = Clock::now();
      Reconcile();
    }
    std::vector<std::pair<std::shared_ptr<GenRequest>, absl::Status>> ended;
    std::vector<std::shared_ptr<GenRequest>> admitted;
    std::vector<int64_t> unload_ids, forget_ids;
    std::string swap;
    v1::StepRequest step;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait_for(lock, std::chrono::milliseconds(20),
                   [&] { return stop_ || !pending_.empty() || !running_.empty(); });
      if (stop_) break;
      // Deferred unloads whose last request has finished.
      for (auto it = adapters_.begin(); it != adapters_.end();) {
        if (it->second.state == v1::ADAPTER_STATE_UNLOADING && it->second.active == 0) {
          if (it->second.resident) {
            unload_ids.push_back(it->second.record.id);
            slots_.BeginRelease();
          } else if (it->second.host_cached) {
            forget_ids.push_back(it->second.record.id);
          }
          it = adapters_.erase(it);
          UpdateAdapterGauges();
        } else {
          ++it;
        }
      }
      if (!serving()) continue;
      const auto now = Clock::now();
      for (auto it = running_.begin(); it != running_.end();) {
        const absl::Status s = Expiry(*it->second, now, "generating");
        if (!s.ok() || it->second->stop_string) {
          step.add_remove(it->first);
          ended.push_back({it->second, s});
          it = running_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto it = pending_.begin(); it != pending_.end();) {
        const absl::Status s = Expiry(**it, now, "queued");
        if (!s.ok()) {
          ended.push_back({*it, s});
          it = pending_.erase(it);
        } else {
          ++it;
        }
      }
      // Strict FIFO admission.
      while (!pending_.empty() &&
             static_cast<int>(running_.size() + admitted.size()) < options_.max_num_seqs) {
        std::shared_ptr<GenRequest> head = pending_.front();
        if (!head->adapter.empty()) {
          auto it = adapters_.find(head->adapter);
          if (it == adapters_.end()) {
            ended.push_back({head, absl::NotFoundError("adapter unloaded")});
            pending_.pop_front();
            continue;
          }
          if (!it->second.resident) {
            swap = head->adapter;
            break;
          }
          it->second.last_used = now;
        }
        pending_.pop_front();
        head->queue_seconds = Seconds(now - head->arrival);
        admitted.push_back(head);
      }
      metrics_->queue_depth.Set(static_cast<double>(pending_.size()));
      metrics_->running.Set(static_cast<double>(running_.size() + admitted.size()));
      for (auto& r : admitted) {
        v1::SequenceSpec* s = step.add_add();
        s->set_sequence_id(r->seq_id);
        s->set_adapter_id(r->adapter_id);
        s->mutable_prompt_token_ids()->CopyFrom(r->req.prompt_token_ids());
        s->set_temperature(r->req.temperature());
        s->set_top_p(r->req.top_p());
        s->set_top_k(r->req.top_k());
        s->set_seed(r->seed);
        s->set_return_logprobs(r->req.return_logprobs());
        s->set_max_tokens(r->req.max_tokens());
        s->mutable_stop_token_ids()->CopyFrom(r->req.stop_token_ids());
        running_[r->seq_id] = r;
      }
      if (!admitted.empty() || !ended.empty()) UpdateLoraInfo();  // the batch changed
    }
    for (int64_t id : unload_ids) ReleaseSlot(id, false);
    for (int64_t id : forget_ids) ForgetHostCached(id);
    for (auto& [r, s] : ended) Finish(r, s, s.ok() ? "stop" : "");
    // The head of the queue needs a slot: swap it in between steps (waits while all slots are
    // busy; nothing behind it is admitted meanwhile, so it cannot starve).
    // Not while this step still has to remove sequences from the workers: a victim's slot can
    // only be freed once no worker sequence uses it (the swap happens on the next pass).
    if (!swap.empty() && step.remove().empty()) TrySwapIn(swap);
    int nseq;
    {
      std::lock_guard<std::mutex> lock(mu_);
      nseq = static_cast<int>(running_.size());
    }
    if (nseq == 0 && step.remove().empty()) continue;
    step.set_step(++step_no_);
    absl::StatusOr<v1::StepResponse> resp = group_->StepAll(step);
    if (!resp.ok()) {
      const absl::StatusCode c = resp.status().code();
      std::vector<std::shared_ptr<GenRequest>> victims;
      {
        std::lock_guard<std::mutex> lock(mu_);
        if (c == absl::StatusCode::kInvalidArgument || c == absl::StatusCode::kNotFound ||
            c == absl::StatusCode::kAlreadyExists || c == absl::StatusCode::kResourceExhausted) {
          // The workers refused a joiner and did not step: fail the joiners only.
          for (auto& r : admitted) {
            running_.erase(r->seq_id);
            victims.push_back(r);
          }
        } else {
          for (auto& [id, r] : running_) victims.push_back(r);
          running_.clear();
        }
      }
      LOG(WARNING) << "step failed: " << resp.status();
      const absl::Status s =
          c == absl::StatusCode::kInvalidArgument || c == absl::StatusCode::kNotFound
              ? resp.status()
              : absl::UnavailableError(
                    absl::StrCat("worker step failed: ", resp.status().message()));
      for (auto& r : victims) Finish(r, s, "");
      continue;
    }
    metrics_->batch_size.Observe(resp->tokens_size());
    metrics_->batch_distinct_adapters.Observe(resp->distinct_adapters());
    const auto now = Clock::now();
    std::vector<std::pair<std::shared_ptr<GenRequest>, std::string>> finished;
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const v1::SequenceToken& t : resp->tokens()) {
        auto it = running_.find(t.sequence_id());
        if (it == running_.end()) continue;
        std::shared_ptr<GenRequest> r = it->second;
        {
          std::lock_guard<std::mutex> rl(r->mu);
          if (r->tokens.empty()) {
            r->ttft_seconds = Seconds(now - r->arrival);
            metrics_->ttft.Observe(r->ttft_seconds);
          } else {
            metrics_->inter_token.Observe(Seconds(now - r->last_token));
          }
          r->last_token = now;
          r->tokens.push_back(t.token_id());
          if (r->req.return_logprobs()) r->logprobs.push_back(t.logprob());
        }
        r->cv.notify_all();
        metrics_->generated_tokens.Increment();
        if (t.finished()) {
          finished.push_back({r, t.finish_reason()});
          running_.erase(it);
        }
      }
    }
    for (auto& [r, reason] : finished) Finish(r, absl::OkStatus(), reason);
    std::lock_guard<std::mutex> lock(mu_);
    metrics_->running.Set(static_cast<double>(running_.size()));
    if (!finished.empty()) UpdateLoraInfo();
  }
}

}  // namespace moelora
