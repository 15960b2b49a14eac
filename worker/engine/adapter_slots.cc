#include "worker/engine/adapter_slots.h"

#include <chrono>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "worker/torch_guard.h"

namespace moelora {

namespace {

[[nodiscard]] absl::Status ResetSlot(CausalLM& model, int slot) {
  return GuardTorch(absl::StrCat("clear LoRA slot ", slot), [&] {
    model.ResetSlot(slot);
    return absl::OkStatus();
  });
}

}  // namespace

AdapterSlots::AdapterSlots(CausalLM* model, const EngineOptions& options)
    : model_(model), options_(options) {
  for (int s = 0; s < options.max_loras; ++s) free_slots_.insert(s);
}

absl::StatusOr<StageResult> AdapterSlots::Stage(int64_t id, const std::string& path,
                                                std::optional<AdapterFormat> expected) {
  if (id <= 0) return absl::InvalidArgumentError(absl::StrCat("adapter id ", id, " must be > 0"));
  int slot = -1;
  std::optional<Cached> cached;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = adapters_.find(id);
    if (it != adapters_.end()) {
      if (it->second.path == path) return it->second.result;  // idempotent
      return absl::AlreadyExistsError(absl::StrCat("adapter id ", id, " is already ",
                                                   it->second.committed ? "loaded" : "staged",
                                                   " from ", it->second.path));
    }
    if (free_slots_.empty()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", options_.max_loras, " LoRA slots (--max-loras) are in use"));
    }
    slot = *free_slots_.begin();
    free_slots_.erase(free_slots_.begin());
    adapters_[id] = Entry{path, slot, false, {}};
    // The host cache first: a swap-in copies the slot's saved image back, reading no file.
    cached = TakeCached(id);
  }
  std::optional<StageResult> r;
  if (cached && cached->path == path) r = SwapIn(id, slot, *cached);
  if (!r) {
    absl::StatusOr<StageResult> read = ReadIntoSlot(slot, path, expected);
    if (!read.ok()) {
      Release(id, slot);
      return read.status();
    }
    r = *read;
  }
  std::lock_guard<std::mutex> lock(mu_);
  adapters_[id].result = *r;
  return *r;
}

absl::StatusOr<StageResult> AdapterSlots::ReadIntoSlot(int slot, const std::string& path,
                                                       std::optional<AdapterFormat> expected) {
  AdapterReadOptions ro;
  ro.model = model_->config().info;
  ro.max_rank = options_.max_lora_rank;
  ro.expected_format = expected;
  ro.convert_to_2d = options_.enable_mixed_moe_lora_format;
  AdapterLoadTimings t;
  MOELORA_ASSIGN_OR_RETURN(LoraAdapter a, ReadAdapter(path, ro, &t));
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status s =
          GuardTorch(absl::StrCat("load adapter ", path), [&] { return model_->SetSlot(slot, a); });
      !s.ok()) {
    // SetSlot left the slot clear unless libtorch threw half-way; clear it again either way.
    ResetSlot(*model_, slot).IgnoreError();
    return s;
  }
  StageResult r;
  r.detected_format = a.format;
  r.converted_to_2d = a.converted_to_2d;
  r.bytes = model_->SlotBytes(a);
  r.rank = a.max_rank;
  if (model_->has_mtp()) {
    for (const auto& [module, pair] : a.dense) r.adapts_draft |= model_->IsMtpModule(module);
    for (const auto& [prefix, moe] : a.moe) r.adapts_draft |= model_->IsMtpModule(prefix);
  }
  r.phase_seconds = {{"read", t.read},
                     {"validate", t.validate},
                     {"convert", t.convert},
                     {"copy", SecondsSince(t0)}};
  return r;
}

std::optional<StageResult> AdapterSlots::SwapIn(int64_t id, int slot, const Cached& cached) {
  const auto t0 = std::chrono::steady_clock::now();
  absl::Status s = GuardTorch(absl::StrCat("swap in adapter ", cached.path, " from the host cache"),
                              [&] { return model_->RestoreSlot(slot, cached.image); });
  if (!s.ok()) {
    // Read it from disk instead.
    LOG(WARNING) << "adapter id " << id << ": restoring from the host cache failed (" << s
                 << "); reading " << cached.path;
    ResetSlot(*model_, slot).IgnoreError();
    return std::nullopt;
  }
  StageResult r = cached.result;
  r.from_host_cache = true;
  r.phase_seconds = {{"swap_in", SecondsSince(t0)}};
  return r;
}

absl::StatusOr<int> AdapterSlots::Commit(int64_t id) {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = adapters_.find(id);
  if (it == adapters_.end()) {
    return absl::NotFoundError(absl::StrCat("adapter id ", id, " was not staged"));
  }
  it->second.committed = true;
  return it->second.slot;
}

absl::Status AdapterSlots::Abort(int64_t id) {
  int slot = -1;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = adapters_.find(id);
    if (it == adapters_.end() || it->second.committed) return absl::OkStatus();
    slot = it->second.slot;
    adapters_.erase(it);
  }
  // A slot that could not be cleared is not handed out again.
  MOELORA_RETURN_IF_ERROR(ResetSlot(*model_, slot));
  std::lock_guard<std::mutex> lock(mu_);
  free_slots_.insert(slot);
  return absl::OkStatus();
}

absl::StatusOr<HostCacheStats> AdapterSlots::Unload(
    int64_t id, bool keep_in_host_cache, const std::function<absl::Status(int)>& check_unused) {
  int slot = -1;
  Cached saved;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = adapters_.find(id);
    if (it == adapters_.end() || !it->second.committed) {
      if (!keep_in_host_cache) TakeCached(id);  // an unload by the user forgets it entirely
      return absl::NotFoundError(absl::StrCat("adapter id ", id, " is not loaded"));
    }
    slot = it->second.slot;
    saved.id = id;
    saved.path = it->second.path;
    saved.result = it->second.result;
  }
  MOELORA_RETURN_IF_ERROR(check_unused(slot));
  // Steps are excluded (the caller's lock) and the slot is committed, so nothing writes it.
  bool keep = keep_in_host_cache && options_.max_cpu_loras > 0;
  if (keep) {
    absl::Status s = GuardTorch(absl::StrCat("keep adapter id ", id, " in the host cache"), [&] {
      saved.image = model_->SaveSlot(slot);
      return absl::OkStatus();
    });
    if (!s.ok()) {
      // Not cached: the next swap-in reads the file again.
      LOG(WARNING) << s;
      keep = false;
    }
  }
  MOELORA_RETURN_IF_ERROR(ResetSlot(*model_, slot));
  std::lock_guard<std::mutex> lock(mu_);
  adapters_.erase(id);
  free_slots_.insert(slot);
  TakeCached(id);
  if (keep) {
    host_cache_bytes_ += saved.image.bytes;
    host_cache_.push_front(std::move(saved));
    while (static_cast<int>(host_cache_.size()) > options_.max_cpu_loras) {
      host_cache_bytes_ -= host_cache_.back().image.bytes;
      host_cache_.pop_back();
    }
  }
  return CacheStats();
}

absl::Status AdapterSlots::Lookup(int64_t id, int32_t* slot, int32_t* head_slot) const {
  std::lock_guard<std::mutex> lock(mu_);
  auto it = adapters_.find(id);
  if (it == adapters_.end() || !it->second.committed) {
    return absl::NotFoundError(absl::StrCat("adapter id ", id, " is not loaded"));
  }
  *slot = it->second.slot;
  *head_slot = it->second.result.adapts_draft ? *slot : -1;
  return absl::OkStatus();
}

void AdapterSlots::Describe(EngineInfo* info) const {
  std::lock_guard<std::mutex> lock(mu_);
  for (const auto& [id, a] : adapters_) {
    info->committed_adapters += a.committed;
    info->staged_adapters += !a.committed;
    if (a.committed) info->committed_adapter_ids.push_back(id);
  }
  info->host_cache = CacheStats();
}

HostCacheStats AdapterSlots::CacheStats() const {
  HostCacheStats st;
  st.adapters = static_cast<int>(host_cache_.size());
  st.bytes = host_cache_bytes_;
  for (const Cached& c : host_cache_) st.adapter_ids.push_back(c.id);
  return st;
}

std::optional<AdapterSlots::Cached> AdapterSlots::TakeCached(int64_t id) {
  for (auto it = host_cache_.begin(); it != host_cache_.end(); ++it) {
    if (it->id != id) continue;
    Cached c = std::move(*it);
    host_cache_bytes_ -= c.image.bytes;
    host_cache_.erase(it);
    return c;
  }
  return std::nullopt;
}

void AdapterSlots::Release(int64_t id, int slot) {
  std::lock_guard<std::mutex> lock(mu_);
  adapters_.erase(id);
  free_slots_.insert(slot);
}

}  // namespace moelora
