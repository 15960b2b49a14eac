// The client side of the chaos suite (chaos_test.sh): floods the controller with streams while
// watching its threads, memory and health, and checks the service's state after a fault.
//
//   chaos_client flood --target=HOST:PORT --streams=N [--max_tokens=M] [--prompt_tokens=L]
//       [--adapters=a,b] [--disconnect_after=K] [--deadline_s=D] [--controller_pid=P]
//       [--max_threads=T] [--health_max_ms=H] [--refusal_max_ms=R] [--forbid=CODE,...]
//       [--expect=CODE] [--health_may_be_down]
//     Opens N GenerateStream calls at once (a few client threads: gRPC's callback API), each with
//     a deadline of D s; with K > 0 each client goes away after K chunks. Every call must end
//     with a final status (none may outlive its deadline by more than a second); statuses named
//     in --forbid fail the run, and any other than --expect; RESOURCE_EXHAUSTED must come within
//     R ms; the controller's
//     threads (/proc/P/status) must stay at most T and health must answer within H ms, SERVING
//     (or, with --health_may_be_down, NOT_SERVING while a fault has the worker group out of
//     service: an answer all the same).
//   chaos_client check --target=HOST:PORT --metrics_port=M --workers=A,B [--within_s=S]
//       [--expect_adapters=a,b]
//     Within S s: health SERVING, every worker holding zero sequences, each worker's committed
//     adapters equal to the adapters the controller counts resident, and every expected
//     adapter registered and READY.
//   chaos_client load --target=HOST:PORT --name=N --path=P
//     LoadAdapter; prints "load N: OK" or "load N: CODE: message" (exit 0 either way).
// Prints one summary line; exits 1 when a check fails.
#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/flags/flag.h"
#include "absl/flags/parse.h"
#include "absl/flags/usage.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "grpc/health/v1/health.grpc.pb.h"
#include "grpcpp/grpcpp.h"
#include "moelora/v1/controller.grpc.pb.h"
#include "moelora/v1/worker.grpc.pb.h"
#include "proto/group_secret.h"

ABSL_FLAG(std::string, target, "127.0.0.1:50051", "the controller's public address");
ABSL_FLAG(int, streams, 100, "flood: concurrent GenerateStream calls");
ABSL_FLAG(int, max_tokens, 16, "flood: tokens each call asks for");
ABSL_FLAG(int, prompt_tokens, 8, "flood: prompt length (token ids)");
ABSL_FLAG(std::string, adapters, "", "flood: adapters the calls take in turn (empty: base)");
ABSL_FLAG(int, disconnect_after, 0, "flood: each client cancels after this many chunks (0: never)");
ABSL_FLAG(double, deadline_s, 60, "flood: each call's deadline");
ABSL_FLAG(int, controller_pid, 0, "flood: the controller process to watch (0: none)");
ABSL_FLAG(int, max_threads, 0, "flood: most controller threads allowed (0: not checked)");
ABSL_FLAG(int, health_max_ms, 1000, "flood: slowest health answer allowed");
ABSL_FLAG(bool, health_may_be_down, false,
          "flood: a NOT_SERVING answer is no failure (a fault takes the workers down meanwhile)");
ABSL_FLAG(int, refusal_max_ms, 1000, "flood: slowest RESOURCE_EXHAUSTED allowed");
ABSL_FLAG(std::string, forbid, "",
          "flood: status codes (e.g. DEADLINE_EXCEEDED) that fail the run");
ABSL_FLAG(int, metrics_port, 0, "check: the controller's metrics port");
ABSL_FLAG(std::string, workers, "", "check: worker addresses, comma-separated");
ABSL_FLAG(std::string, worker_secret_file, "",
          "check: the spawning controller's group secret (STATE/run/secret), sent to the workers");
ABSL_FLAG(double, within_s, 30, "check: how long the service may take to settle");
ABSL_FLAG(std::string, expect, "", "flood: the status code every call must end with (empty: any)");
ABSL_FLAG(std::string, expect_adapters, "", "check: adapters that must be registered and READY");
ABSL_FLAG(std::string, name, "", "load: the adapter's name");
ABSL_FLAG(std::string, path, "", "load: its path under --adapter-root");

namespace {

using Clock = std::chrono::steady_clock;
using grpc::health::v1::HealthCheckRequest;
using grpc::health::v1::HealthCheckResponse;

std::string CodeName(grpc::StatusCode c) {
  static const std::map<int, std::string> kNames = {{0, "OK"},
                                                    {1, "CANCELLED"},
                                                    {2, "UNKNOWN"},
                                                    {3, "INVALID_ARGUMENT"},
                                                    {4, "DEADLINE_EXCEEDED"},
                                                    {5, "NOT_FOUND"},
                                                    {6, "ALREADY_EXISTS"},
                                                    {7, "PERMISSION_DENIED"},
                                                    {8, "RESOURCE_EXHAUSTED"},
                                                    {9, "FAILED_PRECONDITION"},
                                                    {10, "ABORTED"},
                                                    {13, "INTERNAL"},
                                                    {14, "UNAVAILABLE"},
                                                    {16, "UNAUTHENTICATED"}};
  auto it = kNames.find(static_cast<int>(c));
  return it != kNames.end() ? it->second : absl::StrCat(static_cast<int>(c));
}

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

// One field of /proc/PID/status (Threads, VmRSS in kB); -1 when unreadable.
long ProcStatus(int pid, const std::string& field) {
  std::ifstream in(absl::StrCat("/proc/", pid, "/status"));
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      std::istringstream v(line.substr(field.size() + 1));
      long x = -1;
      v >> x;
      return x;
    }
  }
  return -1;
}

// Health Check latency in ms, or -1 when it failed or was not SERVING (NOT_SERVING accepted
// with `not_serving_ok`: the call was answered).
double HealthMs(grpc::health::v1::Health::Stub* stub, int timeout_ms, bool not_serving_ok = false) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(timeout_ms));
  HealthCheckRequest req;
  HealthCheckResponse resp;
  const auto t0 = Clock::now();
  grpc::Status s = stub->Check(&ctx, req, &resp);
  if (!s.ok()) return -1;
  if (resp.status() != HealthCheckResponse::SERVING &&
      !(not_serving_ok && resp.status() == HealthCheckResponse::NOT_SERVING))
    return -1;
  return Ms(Clock::now() - t0);
}

// One streaming call of the flood.
class StreamCall final : public grpc::ClientReadReactor<moelora::v1::GenerateResponse> {
 public:
  struct Tally {
    std::mutex mu;
    std::condition_variable cv;
    int outstanding = 0;
    std::map<std::string, int> codes;
    std::map<std::string, std::string> messages;  // one per code
    double slowest_refusal_ms = 0;
    double latest_end_over_deadline_ms = -1e9;
    long chunks = 0;
  };
  StreamCall(moelora::v1::Controller::Stub* stub, const moelora::v1::GenerateRequest& req,
             double deadline_s, int disconnect_after, Tally* tally)
      : req_(req), disconnect_after_(disconnect_after), tally_(tally) {
    start_ = Clock::now();
    deadline_ = start_ + std::chrono::duration_cast<Clock::duration>(
                             std::chrono::duration<double>(deadline_s));
    ctx_.set_deadline(std::chrono::system_clock::now() +
                      std::chrono::duration_cast<std::chrono::system_clock::duration>(
                          std::chrono::duration<double>(deadline_s)));
    stub->async()->GenerateStream(&ctx_, &req_, this);
    StartRead(&resp_);
    StartCall();
  }
  void OnReadDone(bool ok) override {
    if (!ok) return;
    ++chunks_;
    if (disconnect_after_ > 0 && chunks_ >= disconnect_after_) {
      ctx_.TryCancel();
      return;
    }
    StartRead(&resp_);
  }
  void OnDone(const grpc::Status& s) override {
    const auto now = Clock::now();
    {
      std::lock_guard<std::mutex> lock(tally_->mu);
      ++tally_->codes[CodeName(s.error_code())];
      if (!s.ok()) tally_->messages.emplace(CodeName(s.error_code()), s.error_message());
      tally_->chunks += chunks_;
      if (s.error_code() == grpc::StatusCode::RESOURCE_EXHAUSTED) {
        tally_->slowest_refusal_ms = std::max(tally_->slowest_refusal_ms, Ms(now - start_));
      }
      tally_->latest_end_over_deadline_ms =
          std::max(tally_->latest_end_over_deadline_ms, Ms(now - deadline_));
      --tally_->outstanding;
    }
    tally_->cv.notify_all();
    delete this;
  }

 private:
  grpc::ClientContext ctx_;
  moelora::v1::GenerateRequest req_;
  moelora::v1::GenerateResponse resp_;
  int disconnect_after_;
  int chunks_ = 0;
  Tally* tally_;
  Clock::time_point start_, deadline_;
};

int Flood() {
  const std::string target = absl::GetFlag(FLAGS_target);
  const int n = absl::GetFlag(FLAGS_streams);
  const int pid = absl::GetFlag(FLAGS_controller_pid);
  const double deadline_s = absl::GetFlag(FLAGS_deadline_s);
  std::vector<std::string> adapters;
  for (absl::string_view a : absl::StrSplit(absl::GetFlag(FLAGS_adapters), ',', absl::SkipEmpty()))
    adapters.emplace_back(a);
  // Several connections, as many clients would open (one HTTP/2 connection may cap its streams).
  std::vector<std::unique_ptr<moelora::v1::Controller::Stub>> stubs;
  for (int i = 0; i < 8; ++i) {
    grpc::ChannelArguments args;
    args.SetInt("moelora.chaos_channel", i);  // a distinct connection per channel
    stubs.push_back(moelora::v1::Controller::NewStub(
        grpc::CreateCustomChannel(target, grpc::InsecureChannelCredentials(), args)));
  }
  auto health_stub = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  StreamCall::Tally tally;
  tally.outstanding = n;
  const long threads_before = pid > 0 ? ProcStatus(pid, "Threads") : -1;
  std::atomic<bool> done{false};
  long max_threads = threads_before, max_rss_kb = pid > 0 ? ProcStatus(pid, "VmRSS") : -1;
  double health_max_ms = 0;
  int health_failures = 0, health_probes = 0;
  const bool health_may_be_down = absl::GetFlag(FLAGS_health_may_be_down);
  std::thread watcher([&] {
    while (!done) {
      if (pid > 0) {
        max_threads = std::max(max_threads, ProcStatus(pid, "Threads"));
        max_rss_kb = std::max(max_rss_kb, ProcStatus(pid, "VmRSS"));
      }
      const double h = HealthMs(health_stub.get(), 5000, health_may_be_down);
      ++health_probes;
      if (h < 0) {
        ++health_failures;
      } else {
        health_max_ms = std::max(health_max_ms, h);
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  });
  const auto t0 = Clock::now();
  for (int i = 0; i < n; ++i) {
    moelora::v1::GenerateRequest req;
    for (int t = 0; t < absl::GetFlag(FLAGS_prompt_tokens); ++t)
      req.add_prompt_token_ids(1 + (i + t) % 50);
    req.set_max_tokens(absl::GetFlag(FLAGS_max_tokens));
    req.set_ignore_eos(true);
    if (!adapters.empty()) req.set_adapter(adapters[i % adapters.size()]);
    new StreamCall(stubs[i % stubs.size()].get(), req, deadline_s,
                   absl::GetFlag(FLAGS_disconnect_after), &tally);
  }
  bool hung = false;
  {
    std::unique_lock<std::mutex> lock(tally.mu);
    hung = !tally.cv.wait_for(lock, std::chrono::duration<double>(deadline_s + 10),
                              [&] { return tally.outstanding == 0; });
  }
  done = true;
  watcher.join();
  std::lock_guard<std::mutex> lock(tally.mu);
  std::vector<std::string> codes;
  for (const auto& [c, k] : tally.codes) codes.push_back(absl::StrCat(c, "=", k));
  std::cout << "flood: " << n << " streams in " << Ms(Clock::now() - t0) / 1000
            << " s: " << absl::StrJoin(codes, " ") << "; " << tally.chunks
            << " chunks; controller threads " << threads_before << " -> max " << max_threads
            << ", RSS max " << max_rss_kb / 1024 << " MB; health slowest " << health_max_ms
            << " ms (" << health_failures << " of " << health_probes << " failed); slowest refusal "
            << tally.slowest_refusal_ms << " ms" << std::endl;
  for (const auto& [c, m] : tally.messages) std::cout << "  " << c << ": " << m << std::endl;
  int failures = 0;
  auto fail = [&](const std::string& why) {
    std::cout << "FAIL: " << why << std::endl;
    ++failures;
  };
  if (hung) fail(absl::StrCat(tally.outstanding, " calls never ended"));
  if (tally.latest_end_over_deadline_ms > 1000)
    fail(
        absl::StrCat("a call ended ", tally.latest_end_over_deadline_ms, " ms after its deadline"));
  for (absl::string_view c : absl::StrSplit(absl::GetFlag(FLAGS_forbid), ',', absl::SkipEmpty())) {
    if (auto it = tally.codes.find(std::string(c)); it != tally.codes.end())
      fail(absl::StrCat(it->second, " calls ended ", c));
  }
  if (const std::string e = absl::GetFlag(FLAGS_expect); !e.empty()) {
    for (const auto& [c, k] : tally.codes) {
      if (c != e) fail(absl::StrCat(k, " calls ended ", c, ", not ", e));
    }
  }
  if (const int t = absl::GetFlag(FLAGS_max_threads); t > 0 && max_threads > t)
    fail(absl::StrCat("controller threads reached ", max_threads, " (allowed ", t, ")"));
  if (health_failures > 0) fail(absl::StrCat(health_failures, " health checks failed"));
  if (health_max_ms > absl::GetFlag(FLAGS_health_max_ms))
    fail(absl::StrCat("health took ", health_max_ms, " ms"));
  if (tally.slowest_refusal_ms > absl::GetFlag(FLAGS_refusal_max_ms))
    fail(absl::StrCat("a refusal took ", tally.slowest_refusal_ms, " ms"));
  return failures == 0 ? 0 : 1;
}

// The body of GET /metrics on 127.0.0.1:PORT ("" when it cannot be read). A raw socket: the
// test needs one plain HTTP/1.0 request and no HTTP client library.
std::string FetchMetrics(int port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(static_cast<uint16_t>(port));
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string out;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = "GET /metrics HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[65536];
      ssize_t k;
      while ((k = read(fd, buf, sizeof(buf))) > 0) out.append(buf, static_cast<size_t>(k));
    }
  }
  close(fd);
  const size_t body = out.find("\r\n\r\n");
  return body == std::string::npos ? "" : out.substr(body + 4);
}

// Adapters the controller counts resident (moelora_adapter_resident{adapter="X"} 1).
std::set<std::string> ResidentAdapters(const std::string& metrics) {
  std::set<std::string> names;
  for (absl::string_view line : absl::StrSplit(metrics, '\n')) {
    constexpr absl::string_view kPrefix = "moelora_adapter_resident{adapter=\"";
    if (line.substr(0, kPrefix.size()) != kPrefix) continue;
    const size_t end = line.find('"', kPrefix.size());
    if (end == absl::string_view::npos) continue;
    double v = 0;
    if (absl::SimpleAtod(line.substr(line.rfind(' ') + 1), &v) && v == 1) {
      names.emplace(line.substr(kPrefix.size(), end - kPrefix.size()));
    }
  }
  return names;
}

int Check() {
  const std::string target = absl::GetFlag(FLAGS_target);
  const auto t0 = Clock::now();
  const auto until = t0 + std::chrono::duration_cast<Clock::duration>(
                              std::chrono::duration<double>(absl::GetFlag(FLAGS_within_s)));
  auto health = grpc::health::v1::Health::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  auto controller = moelora::v1::Controller::NewStub(
      grpc::CreateChannel(target, grpc::InsecureChannelCredentials()));
  std::vector<std::unique_ptr<moelora::v1::Worker::Stub>> workers;
  for (absl::string_view w : absl::StrSplit(absl::GetFlag(FLAGS_workers), ',', absl::SkipEmpty()))
    workers.push_back(moelora::v1::Worker::NewStub(
        grpc::CreateChannel(std::string(w), grpc::InsecureChannelCredentials())));
  std::set<std::string> expected;
  for (absl::string_view a :
       absl::StrSplit(absl::GetFlag(FLAGS_expect_adapters), ',', absl::SkipEmpty()))
    expected.emplace(a);
  std::string why;
  double serving_s = -1;
  while (true) {
    why.clear();
    if (serving_s < 0 && HealthMs(health.get(), 1000) >= 0)
      serving_s = Ms(Clock::now() - t0) / 1000;
    if (serving_s < 0) why = "health is not SERVING";
    std::map<std::string, int64_t> ids;  // registered name -> id
    // Health only (a --health-port) when there is nothing else to check.
    if (why.empty() && (!expected.empty() || !workers.empty())) {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      moelora::v1::ListAdaptersResponse list;
      grpc::Status s = controller->ListAdapters(&ctx, {}, &list);
      if (!s.ok()) why = absl::StrCat("ListAdapters: ", s.error_message());
      std::set<std::string> ready;
      for (const auto& a : list.adapters()) {
        ids[a.name()] = a.id();
        if (a.state() == moelora::v1::ADAPTER_STATE_READY) ready.insert(a.name());
      }
      for (const std::string& e : expected) {
        if (why.empty() && !ready.count(e)) why = absl::StrCat("adapter ", e, " is not READY");
      }
    }
    std::set<int64_t> resident;
    if (why.empty()) {
      for (const std::string& name :
           ResidentAdapters(FetchMetrics(absl::GetFlag(FLAGS_metrics_port))))
        if (ids.count(name)) resident.insert(ids[name]);
    }
    std::string secret;
    if (const std::string f = absl::GetFlag(FLAGS_worker_secret_file); !f.empty()) {
      std::ifstream in(f);
      std::getline(in, secret);
    }
    for (size_t i = 0; why.empty() && i < workers.size(); ++i) {
      grpc::ClientContext ctx;
      if (!secret.empty()) ctx.AddMetadata(moelora::kGroupSecretMetadata, secret);
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
      moelora::v1::WorkerInfoResponse info;
      grpc::Status s = workers[i]->Info(&ctx, {}, &info);
      if (!s.ok()) {
        why = absl::StrCat("worker ", i, " Info: ", s.error_message());
      } else if (info.running_sequences() != 0) {
        why = absl::StrCat("worker ", i, " holds ", info.running_sequences(), " sequences");
      } else if (std::set<int64_t>(info.committed_adapter_ids().begin(),
                                   info.committed_adapter_ids().end()) != resident) {
        why = absl::StrCat("worker ", i, " holds adapters {",
                           absl::StrJoin(info.committed_adapter_ids(), ","),
                           "} but the controller counts {", absl::StrJoin(resident, ","), "}");
      }
    }
    if (why.empty() || Clock::now() > until) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  const double settled_s = Ms(Clock::now() - t0) / 1000;
  if (!why.empty()) {
    std::cout << "FAIL: after " << settled_s << " s: " << why << std::endl;
    return 1;
  }
  std::cout << "check: serving after " << serving_s << " s, settled after " << settled_s
            << " s: zero sequences on " << workers.size() << " workers, slots equal, adapters READY"
            << std::endl;
  return 0;
}

int Load() {
  auto controller = moelora::v1::Controller::NewStub(
      grpc::CreateChannel(absl::GetFlag(FLAGS_target), grpc::InsecureChannelCredentials()));
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
  moelora::v1::LoadAdapterRequest req;
  req.set_name(absl::GetFlag(FLAGS_name));
  req.set_path(absl::GetFlag(FLAGS_path));
  moelora::v1::Adapter resp;
  grpc::Status s = controller->LoadAdapter(&ctx, req, &resp);
  std::cout << "load " << req.name() << ": " << CodeName(s.error_code())
            << (s.ok() ? "" : ": " + s.error_message()) << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  absl::SetProgramUsageMessage(
      "chaos_client flood|check|load [flags]: the chaos suite's client (see "
      "tests/chaos/chaos_test.sh)");
  std::vector<char*> args = absl::ParseCommandLine(argc, argv);
  if (args.size() != 2) {
    std::cerr << "usage: chaos_client flood|check|load [flags] (--help)" << std::endl;
    return 2;
  }
  const std::string cmd = args[1];
  if (cmd == "flood") return Flood();
  if (cmd == "check") return Check();
  if (cmd == "load") return Load();
  std::cerr << "unknown command " << cmd << std::endl;
  return 2;
}
