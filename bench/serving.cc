// bench/serving: the controller's cost, measured against the same work in the same run.
//   1. N concurrent clients x M Generate requests (adapters a2d, a3d and base in turn, greedy,
//      16 new tokens) through moelora-controller (TP=1, mixed mode): throughput and p50/p99
//      latency; then the same sequences driven straight into a moelora-worker with Step RPCs
//      (N sequences joined at once, stepped to the end, M rounds): the baseline without the
//      controller. Prints the throughput ratio.
//   2. LoadAdapter + UnloadAdapter latency through the controller at TP=2 vs TP=1 (the fan-out
//      to ranks runs in parallel, so TP=2 should cost about one rank, not two).
//
//   serving [--clients N] [--requests M] [--loads K]
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "tests/integration/controller_process.h"
#include "tests/integration/worker_group.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using Clock = std::chrono::steady_clock;
double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, static_cast<size_t>(p * (v.size() - 1) + 0.5))];
}

const std::vector<int32_t> kPrompt = {1, 17, 42, 5, 88, 3, 9, 27};
constexpr int kNewTokens = 16;

}  // namespace
}  // namespace moelora

int main(int argc, char** argv) {
  using namespace moelora;
  int clients = 8, requests = 20, loads = 10;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string f = argv[i];
    if (f == "--clients")
      clients = std::atoi(argv[i + 1]);
    else if (f == "--requests")
      requests = std::atoi(argv[i + 1]);
    else if (f == "--loads")
      loads = std::atoi(argv[i + 1]);
    else {
      std::fprintf(stderr, "usage: serving [--clients N] [--requests M] [--loads K]\n");
      return 2;
    }
  }
  if (argc == 2) {
    std::printf("usage: serving [--clients N] [--requests M] [--loads K]\n");
    return std::string(argv[1]) == "--help" ? 0 : 2;
  }
  const std::string data = MOELORA_TEST_DATA_DIR;
  const std::vector<std::string> adapters = {"a2d", "a3d", ""};
  // 1a. Through the controller.
  double ctl_rps = 0, ctl_p50 = 0, ctl_p99 = 0;
  {
    moelora::testing::TempDir state;
    moelora::testing::ControllerProcess c(
        state.path(), data, {"--enable-mixed-moe-lora-format", "--max-num-seqs", "64"});
    if (!c.WaitServing()) {
      std::fprintf(stderr, "controller did not start:\n%s\n", c.Log().c_str());
      return 1;
    }
    if (!c.Load("a2d", "qwen3_moe/adapter_2d").ok() || !c.Load("a3d", "qwen3_moe/adapter_3d").ok())
      return 1;
    std::vector<std::future<std::vector<double>>> fs;
    const auto t0 = Clock::now();
    for (int k = 0; k < clients; ++k) {
      fs.push_back(std::async(std::launch::async, [&, k] {
        std::vector<double> lat;
        for (int i = 0; i < requests; ++i) {
          v1::GenerateResponse r;
          const auto s0 = Clock::now();
          if (!c.Generate(adapters[(k + i) % 3], kPrompt, kNewTokens, &r).ok()) std::abort();
          lat.push_back(Sec(Clock::now() - s0));
        }
        return lat;
      }));
    }
    std::vector<double> all;
    for (auto& f : fs) {
      auto v = f.get();
      all.insert(all.end(), v.begin(), v.end());
    }
    const double wall = Sec(Clock::now() - t0);
    ctl_rps = all.size() / wall;
    ctl_p50 = Percentile(all, 0.5);
    ctl_p99 = Percentile(all, 0.99);
  }
  // 1b. The same sequences straight into a worker (no controller).
  double dir_rps = 0, dir_round = 0;
  {
    moelora::testing::WorkerGroup g(data + "/qwen3_moe/model", 1,
                                    {"--enable-mixed-moe-lora-format"});
    if (!g.WaitReady()) return 1;
    if (!g.Load(1, data + "/qwen3_moe/adapter_2d").ok() ||
        !g.Load(2, data + "/qwen3_moe/adapter_3d").ok())
      return 1;
    const std::vector<int64_t> ids = {1, 2, 0};
    int64_t seq = 1;
    std::vector<double> rounds;
    const auto t0 = Clock::now();
    for (int i = 0; i < requests; ++i) {
      v1::StepRequest req;
      for (int k = 0; k < clients; ++k) {
        auto* s = req.add_add();
        s->set_sequence_id(seq++);
        s->set_adapter_id(ids[(k + i) % 3]);
        s->mutable_prompt_token_ids()->Add(kPrompt.begin(), kPrompt.end());
        s->set_max_tokens(kNewTokens);
      }
      const auto r0 = Clock::now();
      for (int step = 0;; ++step) {
        v1::StepResponse resp;
        if (!g.Step(req, &resp).ok()) return 1;
        req.clear_add();
        if (resp.tokens_size() == 0) break;
      }
      rounds.push_back(Sec(Clock::now() - r0));
    }
    dir_rps = static_cast<double>(clients) * requests / Sec(Clock::now() - t0);
    dir_round = Percentile(rounds, 0.5);
  }
  std::printf(
      "serving: %d clients x %d requests, %d new tokens each, adapters a2d/a3d/base, TP=1\n",
      clients, requests, kNewTokens);
  std::printf(
      "  through the controller: %7.1f req/s (%7.0f tok/s)   latency p50 %6.1f ms  p99 %6.1f ms\n",
      ctl_rps, ctl_rps * kNewTokens, ctl_p50 * 1e3, ctl_p99 * 1e3);
  std::printf(
      "  straight to the worker: %7.1f req/s (%7.0f tok/s)   batch of %d to completion p50 %6.1f "
      "ms\n",
      dir_rps, dir_rps * kNewTokens, clients, dir_round * 1e3);
  std::printf("  controller throughput / direct = %.3f\n", ctl_rps / dir_rps);
  // 2. LoadAdapter fan-out.
  double load_ms[3] = {0, 0, 0};
  for (int tp : {1, 2}) {
    moelora::testing::TempDir state;
    moelora::testing::ControllerProcess c(
        state.path(), data,
        {"--enable-mixed-moe-lora-format", "--tensor-parallel-size", std::to_string(tp)});
    if (!c.WaitServing()) return 1;
    std::vector<double> t;
    for (int i = 0; i < loads; ++i) {
      const auto s0 = Clock::now();
      if (!c.Load("x", i % 2 ? "qwen3_moe/adapter_3d" : "qwen3_moe/adapter_2d").ok()) return 1;
      t.push_back(Sec(Clock::now() - s0));
      if (!c.Unload("x").ok()) return 1;
    }
    load_ms[tp] = Percentile(t, 0.5) * 1e3;
  }
  std::printf(
      "LoadAdapter (tiny adapters, p50 of %d): TP=1 %.2f ms, TP=2 %.2f ms, TP=2/TP=1 = %.2f "
      "(2.0 would mean ranks loaded one after the other)\n",
      loads, load_ms[1], load_ms[2], load_ms[2] / load_ms[1]);
  return 0;
}
