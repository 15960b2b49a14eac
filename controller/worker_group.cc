#include "controller/worker_group.h"

#include <fcntl.h>
#include <grpcpp/grpcpp.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "nlohmann/json.hpp"
#include "proto/group_secret.h"
#include "proto/grpc_status.h"

namespace moelora {

struct WorkerGroup::Rank {
  int index = 0;
  std::string address;
  pid_t pid = -1;  // local mode
  std::shared_ptr<grpc::Channel> channel;
  // Shared: an all-rank call keeps the stub it started with even if the group restarts meanwhile.
  std::shared_ptr<v1::Worker::Stub> stub;
  bool up = false;
};

WorkerGroup::WorkerGroup(WorkerGroupOptions options)
    : options_(std::move(options)),
      secret_(options_.addresses.empty() ? NewGroupSecret() : std::string()) {
  if (!options_.addresses.empty()) options_.tp = static_cast<int>(options_.addresses.size());
  for (int r = 0; r < options_.tp; ++r) {
    auto rank = std::make_shared<Rank>();
    rank->index = r;
    if (!options_.addresses.empty()) rank->address = options_.addresses[r];
    ranks_.push_back(rank);
  }
}

WorkerGroup::~WorkerGroup() { Stop(); }

void WorkerGroup::AddSecret(grpc::ClientContext* ctx) const {
  if (!secret_.empty()) ctx->AddMetadata(kGroupSecretMetadata, secret_);
}

void WorkerGroup::SetOnReady(std::function<absl::Status()> hook) {
  MutexLock lock(&mu_);
  on_ready_ = std::move(hook);
}

void WorkerGroup::SetOnDown(std::function<void(const std::string&)> hook) {
  MutexLock lock(&mu_);
  on_down_ = std::move(hook);
}

void WorkerGroup::Start() {
  if (options_.addresses.empty()) SpawnAll();
  monitor_ = std::thread([this] { Monitor(); });
}

void WorkerGroup::Stop() {
  if (stop_.exchange(true)) return;
  if (monitor_.joinable()) monitor_.join();
  serving_ = false;
  if (options_.addresses.empty()) KillAll();
}

void WorkerGroup::Revalidate(const std::string& why) {
  if (!serving_.exchange(false)) return;
  revalidating_ = true;
  LOG(WARNING) << "worker group out of service until every rank is ready again: " << why;
}

std::string WorkerGroup::not_serving_reason() const {
  MutexLock lock(&mu_);
  return not_serving_reason_;
}

v1::WorkerInfoResponse WorkerGroup::info() const {
  MutexLock lock(&mu_);
  return info_;
}

std::vector<bool> WorkerGroup::RanksUp() const {
  MutexLock lock(&mu_);
  std::vector<bool> up;
  for (const auto& r : ranks_) up.push_back(r->up);
  return up;
}

std::vector<pid_t> WorkerGroup::pids() const {
  MutexLock lock(&mu_);
  std::vector<pid_t> p;
  for (const auto& r : ranks_) p.push_back(r->pid);
  return p;
}

bool WorkerGroup::WaitServing(std::chrono::milliseconds timeout) const {
  const auto until = std::chrono::steady_clock::now() + timeout;
  MutexLock lock(&wait_mu_);
  while (!serving_.load()) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) return false;
    wait_cv_.WaitFor(&wait_mu_, until - now);
  }
  return true;
}

void WorkerGroup::SpawnAll() {
  const int epoch = ++epoch_;
  const std::string dir = absl::StrCat(options_.run_dir, "/group.", epoch);
  std::filesystem::remove_all(dir);
  std::filesystem::create_directories(dir + "/dist");
  // The secret for tools of this account that inspect the workers (the chaos suite's checks):
  // readable by the owner only, who could read it from the workers' environment anyway.
  const std::string secret_file = options_.run_dir + "/secret";
  if (const int fd = open(secret_file.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
      fd >= 0) {
    fchmod(fd, 0600);
    if (write(fd, secret_.data(), secret_.size()) != static_cast<ssize_t>(secret_.size())) {
      LOG(WARNING) << secret_file << ": could not be written";
    }
    close(fd);
  }
  std::vector<std::shared_ptr<Rank>> ranks;
  {
    MutexLock lock(&mu_);
    ranks = ranks_;
  }
  for (auto& rank : ranks) {
    const std::string r = std::to_string(rank->index);
    std::vector<std::string> args = {options_.worker_bin,
                                     "--model",
                                     options_.model,
                                     "--rank",
                                     r,
                                     "--tensor-parallel-size",
                                     std::to_string(options_.tp),
                                     "--dist-init-dir",
                                     dir + "/dist",
                                     "--port-file",
                                     dir + "/port." + r,
                                     "--dist-timeout-s",
                                     std::to_string(options_.dist_timeout_s)};
    args.insert(args.end(), options_.worker_flags.begin(), options_.worker_flags.end());
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    // The environment, with the group's secret (built here: the child may only exec).
    std::vector<std::string> env_strings;
    for (char** e = environ; *e != nullptr; ++e) {
      if (std::string_view(*e).rfind(std::string(kGroupSecretEnv) + "=", 0) != 0) {
        env_strings.emplace_back(*e);
      }
    }
    env_strings.push_back(absl::StrCat(kGroupSecretEnv, "=", secret_));
    std::vector<char*> envp;
    for (auto& e : env_strings) envp.push_back(e.data());
    envp.push_back(nullptr);
    const std::string log = dir + "/worker." + r + ".log";
    const pid_t parent = getpid();
    const pid_t pid = fork();
    if (pid == 0) {
      // Child: only async-signal-safe calls until exec.
      prctl(PR_SET_PDEATHSIG, SIGTERM);
      if (getppid() != parent) _exit(1);  // the controller died before prctl
      const int fd = open(log.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (fd >= 0) {
        dup2(fd, 1);
        dup2(fd, 2);
        close(fd);
      }
      sigset_t none;
      sigemptyset(&none);
      sigprocmask(SIG_SETMASK, &none, nullptr);
      execve(argv[0], argv.data(), envp.data());
      _exit(127);
    }
    MutexLock lock(&mu_);
    rank->pid = pid;
    rank->up = false;
    rank->stub.reset();
    rank->address.clear();
    LOG(INFO) << "spawned worker rank " << r << " pid " << pid << " (log " << log << ")";
  }
}

void WorkerGroup::KillAll() {
  std::vector<pid_t> pids;
  {
    MutexLock lock(&mu_);
    for (auto& r : ranks_) {
      if (r->pid > 0) pids.push_back(r->pid);
      r->pid = -1;
      r->up = false;
    }
  }
  for (pid_t p : pids) kill(p, SIGTERM);
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  for (pid_t p : pids) {
    while (waitpid(p, nullptr, WNOHANG) == 0) {
      if (std::chrono::steady_clock::now() > deadline) {
        kill(p, SIGKILL);
        waitpid(p, nullptr, 0);
        break;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
}

// Local mode: reads the port files of the current epoch; connect mode: the given addresses.
bool WorkerGroup::ConnectAll() {
  std::vector<std::shared_ptr<Rank>> ranks;
  {
    MutexLock lock(&mu_);
    ranks = ranks_;
  }
  for (auto& rank : ranks) {
    std::string address;
    {
      MutexLock lock(&mu_);
      if (rank->stub) continue;
      address = rank->address;
    }
    if (address.empty()) {
      const std::string pf =
          absl::StrCat(options_.run_dir, "/group.", epoch_, "/port.", rank->index);
      std::ifstream in(pf);
      if (!in) return false;  // not written yet: retried on the next poll
      std::stringstream ss;
      ss << in.rdbuf();
      const auto j = nlohmann::json::parse(ss.str(), nullptr, false);
      if (!j.is_object() || !j.contains("port")) return false;
      address = absl::StrCat("127.0.0.1:", j["port"].get<int>());
    }
    grpc::ChannelArguments args;
    args.SetMaxReceiveMessageSize(256 << 20);
    args.SetInt(GRPC_ARG_MAX_RECONNECT_BACKOFF_MS, 500);
    auto channel = grpc::CreateCustomChannel(
        address, options_.credentials ? options_.credentials : grpc::InsecureChannelCredentials(),
        args);
    MutexLock lock(&mu_);
    rank->address = address;
    rank->channel = channel;
    rank->stub = std::shared_ptr<v1::Worker::Stub>(v1::Worker::NewStub(channel));
  }
  return true;
}

void WorkerGroup::Monitor() {
  while (!stop_) {
    std::this_thread::sleep_for(options_.health_period);
    if (stop_) break;
    // Local mode: a dead rank restarts the whole group.
    if (options_.addresses.empty()) {
      std::string dead;
      {
        MutexLock lock(&mu_);
        for (auto& r : ranks_) {
          int st = 0;
          if (r->pid > 0 && waitpid(r->pid, &st, WNOHANG) == r->pid) {
            dead = absl::StrCat("worker rank ", r->index, " (pid ", r->pid, ") exited with ",
                                WIFEXITED(st) ? absl::StrCat("status ", WEXITSTATUS(st))
                                              : absl::StrCat("signal ", WTERMSIG(st)));
            // The worker prints its reason last: show it here too.
            std::ifstream log(
                absl::StrCat(options_.run_dir, "/group.", epoch_, "/worker.", r->index, ".log"));
            std::string line, last;
            while (std::getline(log, line)) {
              if (!line.empty()) last = line;
            }
            if (!last.empty()) absl::StrAppend(&dead, " (last log line: ", last, ")");
            r->pid = -1;
          }
        }
      }
      if (!dead.empty()) {
        // Back off when the group keeps dying before it ever serves (a model that cannot load):
        // 0.5 s, 1 s, 2 s, ... up to 30 s.
        const int k = failures_since_serving_++;
        const auto backoff = std::chrono::milliseconds(std::min(30000, 500 << std::min(k, 6)));
        LOG(WARNING) << dead << "; restarting the worker group in " << backoff.count()
                     << " ms (see the worker logs under " << options_.run_dir << ")";
        const bool revalidating = revalidating_.exchange(false);
        const bool was_serving = serving_.exchange(false) || revalidating;
        std::function<void(const std::string&)> down;
        {
          MutexLock lock(&mu_);
          down = on_down_;
        }
        if (down && was_serving) down(dead);
        KillAll();
        ++restarts_;
        for (auto waited = std::chrono::milliseconds(0); waited < backoff && !stop_;
             waited += std::chrono::milliseconds(100)) {
          std::this_thread::sleep_for(std::chrono::milliseconds(100));
        }
        if (stop_) break;
        SpawnAll();
        continue;
      }
    }
    ConnectAll();
    std::vector<std::shared_ptr<Rank>> ranks;
    {
      MutexLock lock(&mu_);
      ranks = ranks_;
    }
    bool all_up = true;
    std::string why;
    for (auto& r : ranks) {
      bool up = false;
      std::shared_ptr<v1::Worker::Stub> stub;
      {
        MutexLock lock(&mu_);
        stub = r->stub;
      }
      if (stub) {
        grpc::ClientContext ctx;
        AddSecret(&ctx);
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(1));
        v1::WorkerHealthResponse resp;
        grpc::Status s = stub->Health(&ctx, {}, &resp);
        up = s.ok() && resp.ready();
        if (!up)
          why = absl::StrCat("rank ", r->index, ": ", s.ok() ? resp.detail() : s.error_message());
      }
      {
        MutexLock lock(&mu_);
        r->up = up;
      }
      all_up &= up;
    }
    if (!all_up) {
      const bool revalidating = revalidating_.exchange(false);
      if (serving_.exchange(false) || revalidating) {
        LOG(WARNING) << "worker group out of service: " << why;
        std::function<void(const std::string&)> down;
        {
          MutexLock lock(&mu_);
          down = on_down_;
        }
        if (down) down(why);
      }
      continue;
    }
    if (serving_) continue;
    // Every rank is ready: fetch every rank's Info, check their settings, run the hook (adapter
    // reload), then serve.
    std::vector<v1::WorkerInfoResponse> infos(ranks.size());
    bool got_all = true;
    for (size_t r = 0; r < ranks.size() && got_all; ++r) {
      std::shared_ptr<v1::Worker::Stub> stub;
      {
        MutexLock lock(&mu_);
        stub = ranks[r]->stub;
      }
      grpc::ClientContext ctx;
      AddSecret(&ctx);
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(5));
      got_all = stub && stub->Info(&ctx, {}, &infos[r]).ok();
    }
    if (!got_all) continue;
    if (options_.expected) {
      absl::Status s = CheckWorkerSettings(*options_.expected, infos);
      MutexLock lock(&mu_);
      const std::string reason = s.ok() ? "" : std::string(s.message());
      if (reason != not_serving_reason_ && !reason.empty()) LOG(ERROR) << reason;
      not_serving_reason_ = reason;
      if (!s.ok()) continue;
    }
    std::function<absl::Status()> hook;
    {
      MutexLock lock(&mu_);
      info_ = infos[0];
      hook = on_ready_;
    }
    serving_ = true;  // the hook's RPCs need it; requests are gated by the controller
    if (hook) {
      if (absl::Status s = hook(); !s.ok()) {
        LOG(WARNING) << "worker group ready but the on-ready hook failed: " << s;
        serving_ = false;
        continue;
      }
    }
    failures_since_serving_ = 0;
    revalidating_ = false;
    LOG(INFO) << "worker group serving (" << ranks.size() << " ranks)";
    MutexLock lock(&wait_mu_);
    wait_cv_.SignalAll();
  }
}

// One RPC to every rank, in flight on a completion queue of its own: started by the
// constructor, answered through WaitUntil / Result on the owner's thread (no thread of its own).
// `fail_fast`: the first failure cancels the other ranks' calls.
template <typename Resp>
class WorkerGroup::AllRankCall {
 public:
  template <typename Req>
  AllRankCall(const std::vector<std::shared_ptr<v1::Worker::Stub>>& stubs,
              std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> (v1::Worker::Stub::*prepare)(
                  grpc::ClientContext*, const Req&, grpc::CompletionQueue*),
              const Req& req, std::chrono::milliseconds timeout, bool fail_fast,
              const std::string& secret)
      : stubs_(stubs),
        n_(static_cast<int>(stubs.size())),
        fail_fast_(fail_fast),
        ctx_(n_),
        resp_(n_),
        status_(n_),
        readers_(n_),
        pending_(n_) {
    const auto deadline = std::chrono::system_clock::now() + timeout;
    for (int r = 0; r < n_; ++r) {
      ctx_[r] = std::make_unique<grpc::ClientContext>();
      if (!secret.empty()) ctx_[r]->AddMetadata(kGroupSecretMetadata, secret);
      ctx_[r]->set_deadline(deadline);
      readers_[r] = ((*stubs[r]).*prepare)(ctx_[r].get(), req, &cq_);
      readers_[r]->StartCall();
      readers_[r]->Finish(&resp_[r], &status_[r],
                          reinterpret_cast<void*>(static_cast<intptr_t>(r)));
    }
  }
  ~AllRankCall() {
    if (pending_ > 0) {
      Cancel();
      WaitUntil(std::chrono::system_clock::time_point::max());
    }
    cq_.Shutdown();
    void* tag;
    bool ok;
    while (cq_.Next(&tag, &ok)) {
    }
  }
  // Whether every rank has answered by `until`.
  bool WaitUntil(std::chrono::system_clock::time_point until) {
    while (pending_ > 0) {
      void* tag = nullptr;
      bool ok = false;
      if (until == std::chrono::system_clock::time_point::max()) {
        if (!cq_.Next(&tag, &ok)) break;
      } else {
        const auto next = cq_.AsyncNext(&tag, &ok, until);
        if (next == grpc::CompletionQueue::TIMEOUT) return false;
        if (next == grpc::CompletionQueue::SHUTDOWN) break;
      }
      --pending_;
      const int r = static_cast<int>(reinterpret_cast<intptr_t>(tag));
      if (fail_fast_ && !cancelled_ && !status_[r].ok()) Cancel();
    }
    return true;
  }
  void Cancel() {
    cancelled_ = true;
    for (auto& c : ctx_) c->TryCancel();  // the others complete promptly as CANCELLED
  }
  // Every rank's answer (waits for them), or the first rank's error.
  absl::StatusOr<std::vector<Resp>> Result(bool not_found_ok) {
    WaitUntil(std::chrono::system_clock::time_point::max());
    for (int r = 0; r < n_; ++r) {
      if (not_found_ok && status_[r].error_code() == grpc::StatusCode::NOT_FOUND)
        status_[r] = grpc::Status::OK;
      if (!status_[r].ok() && status_[r].error_code() != grpc::StatusCode::CANCELLED) {
        absl::Status s = FromGrpc(status_[r]);
        return absl::Status(s.code(), absl::StrCat("worker rank ", r, ": ", s.message()));
      }
    }
    for (int r = 0; r < n_; ++r) {
      if (!status_[r].ok())
        return absl::UnavailableError(absl::StrCat("worker rank ", r, " cancelled"));
    }
    return std::move(resp_);
  }

 private:
  // Kept for the calls' lifetime (a group restart replaces the ranks' stubs meanwhile).
  const std::vector<std::shared_ptr<v1::Worker::Stub>> stubs_;
  const int n_;
  const bool fail_fast_;
  grpc::CompletionQueue cq_;
  std::vector<std::unique_ptr<grpc::ClientContext>> ctx_;
  std::vector<Resp> resp_;
  std::vector<grpc::Status> status_;
  std::vector<std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>>> readers_;
  int pending_;
  bool cancelled_ = false;
};

absl::Status WorkerGroup::Stubs(std::vector<std::shared_ptr<v1::Worker::Stub>>* stubs) const {
  if (!serving_) return absl::UnavailableError("worker group is not ready");
  {
    MutexLock lock(&mu_);
    for (const auto& r : ranks_) stubs->push_back(r->stub);
  }
  for (size_t r = 0; r < stubs->size(); ++r) {
    if (!(*stubs)[r])
      return absl::UnavailableError(absl::StrCat("worker rank ", r, " not connected"));
  }
  return absl::OkStatus();
}

template <typename Req, typename Resp>
absl::StatusOr<std::vector<Resp>> WorkerGroup::CallAll(
    std::unique_ptr<grpc::ClientAsyncResponseReader<Resp>> (v1::Worker::Stub::*prepare)(
        grpc::ClientContext*, const Req&, grpc::CompletionQueue*),
    const Req& req, std::chrono::milliseconds timeout, bool fail_fast, bool not_found_ok) {
  // Asynchronous calls on one completion queue, from this thread: no thread per call, and the
  // first failure can cancel the others (fail fast) without waiting for a stuck rank.
  std::vector<std::shared_ptr<v1::Worker::Stub>> stubs;
  if (absl::Status s = Stubs(&stubs); !s.ok()) return s;
  AllRankCall<Resp> call(stubs, prepare, req, timeout, fail_fast, secret_);
  return call.Result(not_found_ok);
}

absl::StatusOr<v1::StageAdapterResponse> WorkerGroup::StageAll(const v1::StageAdapterRequest& req) {
  auto r = CallAll(&v1::Worker::Stub::PrepareAsyncStageAdapter, req, options_.load_timeout, false);
  if (!r.ok()) {
    AbortAll(req.adapter_id()).IgnoreError();
    return r.status();
  }
  return (*r)[0];
}

absl::Status WorkerGroup::CommitAll(int64_t id) {
  v1::CommitAdapterRequest req;
  req.set_adapter_id(id);
  return CallAll(&v1::Worker::Stub::PrepareAsyncCommitAdapter, req, options_.load_timeout, false)
      .status();
}

absl::Status WorkerGroup::AbortAll(int64_t id) {
  v1::AbortAdapterRequest req;
  req.set_adapter_id(id);
  return CallAll(&v1::Worker::Stub::PrepareAsyncAbortAdapter, req, options_.load_timeout, false)
      .status();
}

absl::StatusOr<std::vector<int64_t>> WorkerGroup::UnloadAll(int64_t id, bool keep_in_host_cache) {
  v1::WorkerUnloadAdapterRequest req;
  req.set_adapter_id(id);
  req.set_keep_in_host_cache(keep_in_host_cache);
  // A rank that does not have it (NOT_FOUND) has freed it too.
  auto r = CallAll(&v1::Worker::Stub::PrepareAsyncUnloadAdapter, req, options_.load_timeout, false,
                   /*not_found_ok=*/true);
  if (!r.ok()) return r.status();
  const auto& ids = (*r)[0].host_cache_adapter_ids();
  return std::vector<int64_t>(ids.begin(), ids.end());
}

absl::StatusOr<std::vector<int64_t>> WorkerGroup::CommittedAdapterIds() {
  auto infos = CallAll(&v1::Worker::Stub::PrepareAsyncInfo, v1::WorkerInfoRequest(),
                       options_.step_timeout, false);
  if (!infos.ok()) return infos.status();
  std::vector<int64_t> ids;
  for (const v1::WorkerInfoResponse& i : *infos)
    ids.insert(ids.end(), i.committed_adapter_ids().begin(), i.committed_adapter_ids().end());
  std::sort(ids.begin(), ids.end());
  ids.erase(std::unique(ids.begin(), ids.end()), ids.end());
  return ids;
}

namespace {

// A step call in flight on the scheduler's thread (WorkerGroup::StartStepAll).
class StepInFlight final : public PendingStep {
 public:
  explicit StepInFlight(absl::Status failed) : failed_(std::move(failed)) {}
  explicit StepInFlight(std::unique_ptr<WorkerGroup::StepCall> call) : call_(std::move(call)) {}
  bool WaitUntil(std::chrono::steady_clock::time_point until) override {
    if (call_ == nullptr) return true;
    return call_->WaitUntil(std::chrono::system_clock::now() +
                            std::chrono::duration_cast<std::chrono::system_clock::duration>(
                                until - std::chrono::steady_clock::now()));
  }
  absl::StatusOr<v1::StepResponse> Get() override {
    if (call_ == nullptr) return failed_;
    auto r = call_->Result(false);
    if (!r.ok()) return r.status();
    return std::move((*r)[0]);
  }
  void Cancel() override {
    if (call_ != nullptr) call_->Cancel();
  }

 private:
  absl::Status failed_;
  std::unique_ptr<WorkerGroup::StepCall> call_;
};

}  // namespace

std::unique_ptr<PendingStep> WorkerGroup::StartStepAll(const v1::StepRequest& req) {
  std::vector<std::shared_ptr<v1::Worker::Stub>> stubs;
  if (absl::Status s = Stubs(&stubs); !s.ok()) return std::make_unique<StepInFlight>(s);
  const int steps = std::max(1, req.decode_steps()) * (req.after_step() != 0 ? 2 : 1);
  return std::make_unique<StepInFlight>(
      std::make_unique<StepCall>(stubs, &v1::Worker::Stub::PrepareAsyncStep, req,
                                 options_.step_timeout * steps, true, secret_));
}

absl::StatusOr<v1::StepResponse> WorkerGroup::StepAll(const v1::StepRequest& req) {
  // A call of several decode steps gets the timeout once per step.
  auto r = CallAll(&v1::Worker::Stub::PrepareAsyncStep, req,
                   options_.step_timeout * std::max(1, req.decode_steps()), true);
  if (!r.ok()) return r.status();
  return (*r)[0];
}

}  // namespace moelora
