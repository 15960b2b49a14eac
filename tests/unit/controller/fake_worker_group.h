// A fake worker group for the controller's unit tests: it keeps each adapter's slot state as
// the workers would (staged, committed; at most max_loras in all), refuses what the workers
// refuse, and generates deterministic tokens. Faults are injected per call. Thread-safe.
#ifndef MOELORA_TESTS_UNIT_CONTROLLER_FAKE_WORKER_GROUP_H_
#define MOELORA_TESTS_UNIT_CONTROLLER_FAKE_WORKER_GROUP_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <set>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "controller/worker_group_interface.h"

namespace moelora::testing {

class FakeWorkerGroup : public WorkerGroupInterface {
 public:
  explicit FakeWorkerGroup(int max_loras) : max_loras_(max_loras) {}

  bool serving() const override { return serving_; }
  v1::WorkerInfoResponse info() const override {
    v1::WorkerInfoResponse i;
    i.set_vocab_size(384);
    i.set_max_model_len(64);
    i.set_max_loras(max_loras_);
    i.set_native_moe_format(v1::FORMAT_2D);
    return i;
  }
  [[nodiscard]] absl::StatusOr<v1::StageAdapterResponse> StageAll(
      const v1::StageAdapterRequest& req) override {
    std::lock_guard<std::mutex> l(mu_);
    ++stage_calls_;
    if (fail_stage_ > 0 && fail_stage_--) return absl::UnavailableError("fake: stage failed");
    if (committed_.count(req.adapter_id()) || staged_.count(req.adapter_id())) {
      return absl::AlreadyExistsError("fake: already staged or committed");
    }
    if (static_cast<int>(committed_.size() + staged_.size()) >= max_loras_) {
      return absl::ResourceExhaustedError(
          absl::StrCat("fake: all ", max_loras_, " slots are taken"));
    }
    staged_.insert(req.adapter_id());
    v1::StageAdapterResponse r;
    auto it = std::find(host_cache_.begin(), host_cache_.end(), req.adapter_id());
    if (it != host_cache_.end()) {
      host_cache_.erase(it);
      r.set_from_host_cache(true);
    }
    return r;
  }
  [[nodiscard]] absl::Status CommitAll(int64_t id) override {
    std::lock_guard<std::mutex> l(mu_);
    if (!staged_.erase(id)) return absl::NotFoundError("fake: not staged");
    if (fail_commit_ > 0 && fail_commit_--) {
      committed_.insert(id);  // as if one rank committed before another failed
      return absl::UnavailableError("fake: commit failed on one rank");
    }
    committed_.insert(id);
    return absl::OkStatus();
  }
  [[nodiscard]] absl::Status AbortAll(int64_t id) override {
    std::lock_guard<std::mutex> l(mu_);
    staged_.erase(id);
    return absl::OkStatus();
  }
  std::vector<int64_t> host_cache() const {
    std::lock_guard<std::mutex> l(mu_);
    return host_cache_;
  }
  [[nodiscard]] absl::StatusOr<std::vector<int64_t>> UnloadAll(int64_t id, bool keep) override {
    std::lock_guard<std::mutex> l(mu_);
    ++unload_calls_;
    if (fail_unload_ > 0 && fail_unload_--)
      return absl::UnavailableError("fake: unload failed on one rank");
    for (const auto& [seq, s] : running_) {
      if (s.adapter_id == id) {
        ++unload_refusals_;
        return absl::FailedPreconditionError("fake: a running sequence uses it");
      }
    }
    committed_.erase(id);
    // The host cache: unbounded here (the worker's LRU bound has its own test).
    host_cache_.erase(std::remove(host_cache_.begin(), host_cache_.end(), id), host_cache_.end());
    if (keep) host_cache_.insert(host_cache_.begin(), id);
    return host_cache_;
  }
  [[nodiscard]] absl::StatusOr<std::vector<int64_t>> CommittedAdapterIds() override {
    std::lock_guard<std::mutex> l(mu_);
    return std::vector<int64_t>(committed_.begin(), committed_.end());
  }
  [[nodiscard]] absl::StatusOr<v1::StepResponse> StepAll(const v1::StepRequest& req) override {
    // A call sent ahead waits for the call it names, as a worker does.
    std::unique_lock<std::mutex> l(mu_);
    if (req.after_step() != 0) {
      ++ahead_calls_;
      if (!order_cv_.wait_for(l, std::chrono::seconds(10),
                              [&] { return last_ended_ == req.after_step(); })) {
        return absl::DeadlineExceededError("fake: the call before never ended");
      }
    }
    struct MarkEnded {
      FakeWorkerGroup* g;
      int64_t step;
      ~MarkEnded() {
        g->last_ended_ = step;
        g->order_cv_.notify_all();
      }
    } mark{this, req.step()};
    if (step_delay_.count() > 0) {
      const std::chrono::milliseconds delay = step_delay_;
      l.unlock();
      std::this_thread::sleep_for(delay * std::max(1, req.decode_steps()));
      l.lock();
    }
    if (fail_step_ > 0 && fail_step_--) return absl::UnavailableError("fake: a rank died");
    for (int64_t id : req.remove()) running_.erase(id);
    for (const v1::SequenceSpec& s : req.add()) {  // all or nothing, as the workers
      if (s.adapter_id() != 0 && !committed_.count(s.adapter_id())) {
        return absl::NotFoundError(
            absl::StrCat("fake: adapter ", s.adapter_id(), " is not committed"));
      }
    }
    ++step_calls_;
    if (req.add_size() > 0) adds_per_step_.push_back(req.add_size());
    for (const v1::SequenceSpec& s : req.add()) {
      running_[s.sequence_id()] = {s.adapter_id(), s.max_tokens(), 0};
      admitted_.push_back(s.sequence_id());
      admitted_adapters_.push_back(s.adapter_id());
    }
    v1::StepResponse resp;
    std::set<int64_t> distinct;
    // Up to decode_steps steps, as the workers: each step's tokens after the previous step's.
    int steps = 0;
    for (; steps < std::max(1, req.decode_steps()) && (steps == 0 || !running_.empty()); ++steps) {
      for (auto it = running_.begin(); it != running_.end();) {
        Seq& s = it->second;
        v1::SequenceToken* t = resp.add_tokens();
        t->set_sequence_id(it->first);
        t->set_token_id(static_cast<int32_t>((it->first * 7 + s.generated) % 384));
        if (s.adapter_id) distinct.insert(s.adapter_id);
        if (++s.generated >= s.max_tokens) {
          t->set_finished(true);
          t->set_finish_reason("length");
          it = running_.erase(it);
        } else {
          ++it;
        }
      }
    }
    resp.set_distinct_adapters(static_cast<int>(distinct.size()));
    resp.set_steps(steps);
    return resp;
  }

  // Test controls and observations.
  void set_serving(bool s) { serving_ = s; }
  // Each step takes this long (so that a test can act while a sequence runs).
  void set_step_delay(std::chrono::milliseconds d) {
    std::lock_guard<std::mutex> l(mu_);
    step_delay_ = d;
  }
  void FailNextUnloads(int n) {
    std::lock_guard<std::mutex> l(mu_);
    fail_unload_ = n;
  }
  void FailNextStages(int n) {
    std::lock_guard<std::mutex> l(mu_);
    fail_stage_ = n;
  }
  void FailNextCommits(int n) {
    std::lock_guard<std::mutex> l(mu_);
    fail_commit_ = n;
  }
  void FailNextSteps(int n) {
    std::lock_guard<std::mutex> l(mu_);
    fail_step_ = n;
  }
  // A restarted group holds nothing.
  void Restart() {
    std::lock_guard<std::mutex> l(mu_);
    staged_.clear();
    committed_.clear();
    running_.clear();
  }
  std::set<int64_t> committed() const {
    std::lock_guard<std::mutex> l(mu_);
    return committed_;
  }
  std::vector<int64_t> admitted() const {
    std::lock_guard<std::mutex> l(mu_);
    return admitted_;
  }
  // How many sequences each step that added any added, in step order.
  std::vector<int> adds_per_step() const {
    std::lock_guard<std::mutex> l(mu_);
    return adds_per_step_;
  }
  std::vector<int64_t> admitted_adapters() const {
    std::lock_guard<std::mutex> l(mu_);
    return admitted_adapters_;
  }
  // Calls sent ahead (after_step set).
  int ahead_calls() const {
    std::lock_guard<std::mutex> l(mu_);
    return ahead_calls_;
  }
  // StepAll calls that stepped.
  int step_calls() const {
    std::lock_guard<std::mutex> l(mu_);
    return step_calls_;
  }
  int running() const {
    std::lock_guard<std::mutex> l(mu_);
    return static_cast<int>(running_.size());
  }
  int unload_calls() const {
    std::lock_guard<std::mutex> l(mu_);
    return unload_calls_;
  }
  // Unloads refused because a running sequence still used the adapter (a controller bug).
  int unload_refusals() const {
    std::lock_guard<std::mutex> l(mu_);
    return unload_refusals_;
  }

 private:
  struct Seq {
    int64_t adapter_id;
    int max_tokens;
    int generated;
  };
  const int max_loras_;
  std::chrono::milliseconds step_delay_{0};
  std::atomic<bool> serving_{true};
  mutable std::mutex mu_;
  std::set<int64_t> staged_, committed_;
  std::vector<int64_t> host_cache_;  // most recently used first
  std::map<int64_t, Seq> running_;
  std::vector<int64_t> admitted_, admitted_adapters_;
  std::vector<int> adds_per_step_;  // sequences added by each step that added any
  int fail_unload_ = 0, fail_stage_ = 0, fail_commit_ = 0, fail_step_ = 0;
  int stage_calls_ = 0, unload_calls_ = 0, unload_refusals_ = 0, step_calls_ = 0;
  int ahead_calls_ = 0;
  int64_t last_ended_ = 0;  // the step of the last StepAll that returned
  std::condition_variable order_cv_;
};

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_UNIT_CONTROLLER_FAKE_WORKER_GROUP_H_
