// A fake worker group for the controller's unit tests: it keeps each adapter's slot state as
// the workers would (staged, committed; at most max_loras in all), refuses what the workers
// refuse, and generates deterministic tokens. Faults are injected per call. Thread-safe.
//
// Time: a step takes set_step_delay() per decode step of the test's SimulatedClock, which the
// fake moves itself (a step call advances it by its steps; a call started with StartStepAll is
// due at its start, or its predecessor's end, plus its steps, and waiting for it moves the clock
// there), so nothing in a test waits for real time to pass. To act while sequences run, a test
// holds the steps (Hold, Release, Resume): a held step has done its work and waits at its end,
// so the scheduler cannot go on until the test lets it.
#ifndef MOELORA_TESTS_UNIT_CONTROLLER_FAKE_WORKER_GROUP_H_
#define MOELORA_TESTS_UNIT_CONTROLLER_FAKE_WORKER_GROUP_H_

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/clock.h"
#include "controller/worker_group_interface.h"

namespace moelora::testing {

class FakeWorkerGroup : public WorkerGroupInterface {
 public:
  FakeWorkerGroup(int max_loras, SimulatedClock* clock, int max_model_len = 64)
      : max_loras_(max_loras), max_model_len_(max_model_len), clock_(clock) {}

  bool serving() const override { return serving_; }
  v1::WorkerInfoResponse info() const override {
    v1::WorkerInfoResponse i;
    i.set_vocab_size(384);
    i.set_max_model_len(max_model_len_);
    i.set_max_loras(max_loras_);
    i.set_native_moe_format(v1::FORMAT_2D);
    return i;
  }
  [[nodiscard]] absl::StatusOr<v1::StageAdapterResponse> StageAll(
      const v1::StageAdapterRequest& req) override {
    std::unique_lock<std::mutex> l(mu_);
    if (stages_held_) {  // HoldStages: as a worker reading a large adapter
      ++stages_waiting_;
      changed_.notify_all();
      changed_.wait(l, [&] { return !stages_held_; });
      --stages_waiting_;
    }
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
    clock_->Advance(StepTime(req));
    return Step(req);
  }
  // The call's work is done when the scheduler first finds it due (WaitUntil) or takes it
  // (Get), in the order the scheduler takes the calls, as the workers run them.
  [[nodiscard]] std::unique_ptr<PendingStep> StartStepAll(const v1::StepRequest& req) override {
    std::lock_guard<std::mutex> l(mu_);
    if (req.after_step() != 0) ++ahead_calls_;
    const Clock::TimePoint start =
        req.after_step() != 0 ? std::max(clock_->Now(), last_due_) : clock_->Now();
    last_due_ = start + StepTime(req);
    return std::make_unique<Pending>(this, req, last_due_);
  }

  // Test controls and observations.
  void set_serving(bool s) { serving_ = s; }
  // Each decode step takes this long on the clock.
  void set_step_delay(std::chrono::milliseconds d) { step_delay_ms_ = d.count(); }
  // The next step call to end waits at its end (its tokens made) until Release or Resume.
  void Hold() { SetGate(0); }
  // The held call ends, and `calls` - 1 more after it; the one after those is held.
  void Release(int calls) { SetGate(calls); }
  // No call is held any more.
  void Resume() { SetGate(-1); }
  // Stages wait from now until ReleaseStages; stages_waiting() counts those waiting.
  void HoldStages() {
    std::lock_guard<std::mutex> l(mu_);
    stages_held_ = true;
  }
  void ReleaseStages() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stages_held_ = false;
    }
    changed_.notify_all();
  }
  int stages_waiting() const {
    std::lock_guard<std::mutex> l(mu_);
    return stages_waiting_;
  }
  // Waits (up to 10 s) until `n` calls in all have been held.
  [[nodiscard]] bool WaitHolds(int n) {
    std::unique_lock<std::mutex> l(mu_);
    return changed_.wait_for(l, std::chrono::seconds(10), [&] { return holds_ >= n; });
  }
  // Waits (up to 10 s) until `cond` holds, looking again whenever the fake's state changes (and
  // every millisecond: conditions on the controller's side change without telling the fake).
  template <typename F>
  [[nodiscard]] bool WaitFor(F cond) {
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (!cond()) {
      std::unique_lock<std::mutex> l(mu_);
      if (std::chrono::steady_clock::now() > until) return false;
      changed_.wait_for(l, std::chrono::milliseconds(1));
    }
    return true;
  }

 private:
  // A call started by StartStepAll: its work happens when it is first found due or taken.
  class Pending final : public PendingStep {
   public:
    Pending(FakeWorkerGroup* g, v1::StepRequest req, Clock::TimePoint due)
        : g_(g), req_(std::move(req)), due_(due) {}
    bool WaitUntil(Clock::TimePoint until) override {
      if (until < due_) {
        g_->clock_->AdvanceTo(until);
        return false;
      }
      g_->clock_->AdvanceTo(due_);
      Run();
      return true;
    }
    absl::StatusOr<v1::StepResponse> Get() override {
      g_->clock_->AdvanceTo(due_);
      Run();
      return std::move(*result_);
    }
    // Before its work: it never steps, as a call still waiting for its predecessor.
    void Cancel() override { cancelled_ = true; }

   private:
    void Run() {
      if (result_.has_value()) return;
      result_ = cancelled_ ? absl::StatusOr<v1::StepResponse>(
                                 absl::CancelledError("fake: cancelled before it stepped"))
                           : g_->Step(req_);
    }
    FakeWorkerGroup* const g_;
    const v1::StepRequest req_;
    const Clock::TimePoint due_;
    bool cancelled_ = false;
    std::optional<absl::StatusOr<v1::StepResponse>> result_;
  };

  Clock::Duration StepTime(const v1::StepRequest& req) const {
    return std::chrono::milliseconds(step_delay_ms_.load()) * std::max(1, req.decode_steps());
  }
  void SetGate(int gate) {
    std::lock_guard<std::mutex> l(mu_);
    gate_ = gate;
    changed_.notify_all();
  }
  // One call's work, then the gate: a held call waits here, its work done.
  absl::StatusOr<v1::StepResponse> Step(const v1::StepRequest& req) {
    std::unique_lock<std::mutex> l(mu_);
    absl::StatusOr<v1::StepResponse> r = StepLocked(req);
    if (gate_ == 0) {
      ++holds_;
      changed_.notify_all();
      changed_.wait(l, [&] { return gate_ != 0; });
    }
    if (gate_ > 0) --gate_;
    changed_.notify_all();
    return r;
  }
  absl::StatusOr<v1::StepResponse> StepLocked(const v1::StepRequest& req) {
    if (fail_step_ > 0 && fail_step_--) return absl::UnavailableError("fake: a rank died");
    if (req.add().empty() && req.remove().empty() && req.expected().empty()) ++sweeps_;
    if (req.drop_all()) {
      running_.clear();
    } else if (req.epoch() != 0) {  // strays: neither expected nor leaving
      const std::set<int64_t> keep(req.expected().begin(), req.expected().end());
      const std::set<int64_t> leaving(req.remove().begin(), req.remove().end());
      for (auto it = running_.begin(); it != running_.end();) {
        it = keep.count(it->first) || leaving.count(it->first) ? std::next(it) : running_.erase(it);
      }
    }
    for (int64_t id : req.remove()) running_.erase(id);
    for (const v1::SequenceSpec& s : req.add()) {  // all or nothing, as the workers
      if (s.adapter_id() != 0 && !committed_.count(s.adapter_id())) {
        return absl::NotFoundError(
            absl::StrCat("fake: adapter ", s.adapter_id(), " is not committed"));
      }
      if (running_.count(s.sequence_id())) {
        return absl::AlreadyExistsError(
            absl::StrCat("fake: sequence ", s.sequence_id(), " is already running"));
      }
    }
    ++step_calls_;
    if (req.add_size() > 0) adds_per_step_.push_back(req.add_size());
    for (const v1::SequenceSpec& s : req.add()) {
      running_[s.sequence_id()] = {s.adapter_id(), s.max_tokens(), 0};
      last_prompt_.assign(s.prompt_token_ids().begin(), s.prompt_token_ids().end());
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
        const bool scripted = !script_.empty();
        t->set_token_id(scripted ? script_[std::min<size_t>(s.generated, script_.size() - 1)]
                                 : static_cast<int32_t>((it->first * 7 + s.generated) % 384));
        if (s.adapter_id) distinct.insert(s.adapter_id);
        if (scripted && static_cast<size_t>(s.generated) + 1 >= script_.size() &&
            s.generated + 1 < s.max_tokens) {
          t->set_finished(true);
          t->set_finish_reason("stop");
          it = running_.erase(it);
          continue;
        }
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
    resp.set_seconds(step_delay_ms_.load() * 1e-3 * steps);
    return resp;
  }

 public:
  // The prompt of the last sequence admitted.
  std::vector<int32_t> last_prompt() const {
    std::lock_guard<std::mutex> l(mu_);
    return last_prompt_;
  }
  // Every sequence admitted from now on emits these tokens in order and ends after the last
  // ("stop"); empty: the deterministic tokens again.
  void ScriptTokens(std::vector<int32_t> tokens) {
    std::lock_guard<std::mutex> l(mu_);
    script_ = std::move(tokens);
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
  // A sequence no controller knows of (left by an earlier controller).
  void AddStray(int64_t id, int max_tokens) {
    std::lock_guard<std::mutex> l(mu_);
    running_[id] = {0, max_tokens, 0};
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
  // Steps that added, removed and expected nothing (the controller's sweeps).
  int sweeps() const {
    std::lock_guard<std::mutex> l(mu_);
    return sweeps_;
  }
  // As WorkerGroup: out of service until the test finds the group ready (OnGroupReady).
  void Revalidate(const std::string& why) override {
    std::lock_guard<std::mutex> l(mu_);
    serving_ = false;
    revalidated_.push_back(why);
  }
  std::vector<std::string> revalidated() const {
    std::lock_guard<std::mutex> l(mu_);
    return revalidated_;
  }
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
  const int max_model_len_;
  SimulatedClock* const clock_;
  std::atomic<int64_t> step_delay_ms_{0};
  std::atomic<bool> serving_{true};
  mutable std::mutex mu_;
  std::set<int64_t> staged_, committed_;
  std::vector<int32_t> script_, last_prompt_;
  std::vector<int64_t> host_cache_;  // most recently used first
  std::map<int64_t, Seq> running_;
  std::vector<int64_t> admitted_, admitted_adapters_;
  std::vector<int> adds_per_step_;  // sequences added by each step that added any
  int fail_unload_ = 0, fail_stage_ = 0, fail_commit_ = 0, fail_step_ = 0;
  int stage_calls_ = 0, unload_calls_ = 0, unload_refusals_ = 0, step_calls_ = 0;
  int sweeps_ = 0;
  std::vector<std::string> revalidated_;
  int ahead_calls_ = 0;
  Clock::TimePoint last_due_{};  // when the last call started by StartStepAll ends
  int gate_ = -1;                // Hold / Release / Resume
  bool stages_held_ = false;     // HoldStages / ReleaseStages
  int stages_waiting_ = 0;
  int holds_ = 0;  // calls held so far
  std::condition_variable changed_;
};

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_UNIT_CONTROLLER_FAKE_WORKER_GROUP_H_
