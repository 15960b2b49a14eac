#include "controller/scheduler.h"

#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/logging.h"

namespace moelora {

Scheduler::Scheduler(int max_num_seqs, int max_loras, AdapterManager* adapters,
                     WorkerGroupInterface* group, ControllerMetrics* metrics,
                     std::function<bool()> serving, std::chrono::milliseconds batch_window,
                     std::chrono::milliseconds batch_window_max, int decode_steps, bool call_ahead,
                     Clock* clock, int max_queued, std::chrono::milliseconds max_bypass)
    : max_num_seqs_(max_num_seqs),
      batch_window_(batch_window),
      batch_window_max_(std::max(batch_window, batch_window_max)),
      max_bypass_(max_bypass),
      decode_steps_(std::max(decode_steps, 1)),
      call_ahead_(call_ahead),
      clock_(clock),
      max_queued_(max_queued),
      max_loras_(max_loras),
      adapters_(adapters),
      group_(group),
      metrics_(metrics),
      serving_(std::move(serving)) {
  MutexLock lock(&mu_);
  UpdateLoraInfo();
}

Scheduler::~Scheduler() { Stop(absl::UnavailableError("the controller is shutting down")); }

void Scheduler::Start() {
  swap_pool_ = std::make_unique<WorkPool>(kMaxSwapsInFlight);
  loop_ = std::thread([this] { Loop(); });
}

void Scheduler::Stop(const absl::Status& why) {
  if (stop_.exchange(true)) return;
  Wake();
  if (loop_.joinable()) loop_.join();
  swap_pool_.reset();  // the swap-ins under way end first
  FailAll(why);
}

void Scheduler::SwapDone(const std::string& name, const absl::Status& s) {
  std::vector<std::shared_ptr<GenRequest>> failed;
  {
    MutexLock lock(&mu_);
    swapping_.erase(name);
    if (!s.ok()) {
      // The adapter is FAILED: its queued requests fail with the reason.
      for (auto p = pending_.begin(); p != pending_.end();) {
        if ((*p)->adapter == name) {
          failed.push_back(*p);
          p = pending_.erase(p);
        } else {
          ++p;
        }
      }
      metrics_->queue_depth.Set(static_cast<double>(pending_.size()));
      UpdateLoraInfo();
    }
  }
  for (auto& r : failed) Finish(r, s, "");
  Wake();
}

void Scheduler::Wake() {
  {
    MutexLock lock(&mu_);
    wake_ = true;
  }
  cv_.SignalAll();
}

int Scheduler::in_flight() const {
  MutexLock lock(&mu_);
  return static_cast<int>(pending_.size() + running_.size());
}

absl::Status Scheduler::Enqueue(const std::shared_ptr<GenRequest>& r) {
  MutexLock lock(&mu_);
  if (max_queued_ > 0 && static_cast<int>(pending_.size()) >= max_queued_) {
    return absl::ResourceExhaustedError(absl::StrCat(pending_.size(),
                                                     " requests wait to be admitted, the maximum "
                                                     "(--max-queued-requests); retry later"));
  }
  r->seq_id = next_seq_++;
  pending_.push_back(r);
  metrics_->queue_depth.Set(static_cast<double>(pending_.size()));
  UpdateLoraInfo();
  wake_ = true;
  cv_.SignalAll();
  return absl::OkStatus();
}

void Scheduler::FailAll(const absl::Status& s) {
  std::vector<std::shared_ptr<GenRequest>> victims;
  {
    MutexLock lock(&mu_);
    for (auto& r : pending_) victims.push_back(r);
    for (auto& [id, r] : running_) victims.push_back(r);
    pending_.clear();
    running_.clear();
    metrics_->queue_depth.Set(0);
    metrics_->running.Set(0);
    UpdateLoraInfo();
  }
  for (auto& r : victims) Finish(r, s, "");
}

void Scheduler::Finish(const std::shared_ptr<GenRequest>& r, absl::Status s,
                       const std::string& reason) {
  if (!r->Finish(std::move(s), reason, clock_->Now())) return;
  if (!r->adapter.empty()) adapters_->Release(r->adapter);
  Wake();
}

void Scheduler::UpdateLoraInfo() {
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
  lora_info_ = &metrics_->lora_requests_info.Add({{"running_lora_adapters", run},
                                                  {"waiting_lora_adapters", wait},
                                                  {"max_lora", std::to_string(max_loras_)}});
  lora_info_->Set(
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count());
  lora_info_key_ = key;
}

void Scheduler::Loop() {
  while (!stop_) {
    Pass pass;
    // A decode call sent ahead (--call-ahead) is this pass's call: nothing joins or leaves before
    // it returns (SendAheadAllowed saw nothing waiting to), so the pass skips to waiting for it.
    std::unique_ptr<PendingStep> call = std::move(ahead_);
    const bool sent_ahead = call != nullptr;
    if (sent_ahead) {
      pass.step = std::move(ahead_req_);
    } else {
      const Next next = Plan(&pass);
      if (next == Next::kStop) break;
      if (next == Next::kAgain) continue;
    }
    const absl::StatusOr<v1::StepResponse> resp = Send(pass.step, std::move(call));
    if (!resp.ok()) {
      Recover(pass, resp.status());
      continue;
    }
    RecordStep(pass.step, *resp, sent_ahead);
    Deliver(*resp);
  }
  CancelAhead();  // stopping: the call sent ahead is not waited for on the workers
}

int64_t Scheduler::BlocksHeld(const GenRequest& r) const {
  if (kv_block_size_ <= 0) return 0;
  const int64_t tokens = r.req.prompt_token_ids_size() + static_cast<int64_t>(r.num_tokens()) + 1;
  return (tokens + kv_block_size_ - 1) / kv_block_size_;
}

}  // namespace moelora
