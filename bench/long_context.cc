// bench/long_context: the engine's memory model through the public API, each figure next to a
// baseline from the same run.
//   1. Time to first token of one N-token prompt (max_tokens 1), best of --repeat, and the
//      worker's peak RSS over its RSS after loading; with --llama-bench and --gguf, llama.cpp's
//      `llama-bench -p N -n 0` on the same model and threads (the ratio is ours / theirs).
//   2. --concurrent C prompts of --concurrent-len tokens, each generating --concurrent-new, at
//      once under a KV budget smaller than their total (the controller admits what the prompts'
//      blocks allow; the workers preempt when decodes outgrow the cache): all complete, greedy
//      outputs equal to each prompt run alone (the first --check of them), preemptions counted,
//      peak RSS.
//   3. 8 streams decoding while --joiners prompts of --concurrent-len tokens arrive: their median
//      inter-token time against the same streams' with nothing else running.
//   4. Prefix caching: a second request sharing a --prefix-len prefix, against the first; the
//      same prefix under an adapter (--model's sibling adapter_2d) is not reused and gives a cold
//      run's tokens.
//   long_context --model DIR [--dtype D] [--lens 512,2048,8192] [--repeat R] [--threads T]
//                [--llama-bench BIN --gguf FILE] [--concurrent C] [--concurrent-len N]
//                [--concurrent-new G] [--kv-blocks B] [--check K] [--joiners J] [--only
//                ttft|preempt|stream|prefix] [--prefix-len N]
//                [--extra-flags "--max-num-batched-tokens 512 ..."]
// MOELORA_CONTROLLER_BIN / MOELORA_WORKER_BIN run other binaries (an older build: figure 1 passes
// only flags every build takes).
#include <dirent.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/numbers.h"
#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "tests/integration/controller_process.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using Clock = std::chrono::steady_clock;
double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// A /proc/PID/status field in bytes (VmRSS, VmHWM), 0 when absent.
int64_t ProcBytes(int pid, const std::string& field) {
  std::ifstream f("/proc/" + std::to_string(pid) + "/status");
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind(field + ":", 0) == 0) {
      int64_t kb = 0;
      std::istringstream(line.substr(field.size() + 1)) >> kb;
      return kb * 1024;
    }
  }
  return 0;
}

// Resets the process's peak RSS (VmHWM) to its current RSS, so a later peak is the work's, not
// the load's.
void ResetPeak(int pid) { std::ofstream("/proc/" + std::to_string(pid) + "/clear_refs") << "5"; }

// The controller's first child process (its rank-0 worker), or -1.
int WorkerPid(int controller) {
  DIR* d = opendir("/proc");
  int found = -1;
  while (dirent* e = d ? readdir(d) : nullptr) {
    int pid = 0;
    if (!absl::SimpleAtoi(e->d_name, &pid)) continue;
    std::ifstream f(std::string("/proc/") + e->d_name + "/stat");
    std::string s;
    std::getline(f, s);
    const size_t close = s.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(s.substr(close + 2));
    std::string state;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid == controller) found = pid;
  }
  if (d) closedir(d);
  return found;
}

std::vector<int32_t> Prompt(int n, int seed, int vocab) {
  std::vector<int32_t> p(n);
  uint64_t x = 0x9E3779B97F4A7C15ull * (seed + 1);
  for (int i = 0; i < n; ++i) {
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    p[i] = static_cast<int32_t>((x * 2685821657736338717ull) >> 33) % (vocab - 2) + 2;
  }
  return p;
}

struct Flags {
  std::string model, dtype = "bfloat16", llama_bench, gguf, only, extra;
  std::vector<int> lens = {512, 2048, 8192};
  int repeat = 2, threads = 2, concurrent = 16, concurrent_len = 8192, check = 2, joiners = 4;
  int concurrent_new = 8;  // tokens each concurrent prompt generates
  int prefix_len = 4096;
  int64_t kv_blocks = 0;  // 0: half of what the concurrent prompts need
};

std::vector<std::string> BaseFlags(const Flags& f, int max_len) {
  std::vector<std::string> v = {"--dtype",         f.dtype,
                                "--max-model-len", std::to_string(max_len),
                                "--worker-args",   "--cpu-threads=" + std::to_string(f.threads)};
  for (auto& x : absl::StrSplit(f.extra, ' ', absl::SkipEmpty())) v.emplace_back(x);
  return v;
}

int Vocab(const std::string& model) {
  std::ifstream in(model + "/config.json");
  return nlohmann::json::parse(in).value("vocab_size", 1000);
}

// llama-bench's prompt-processing time for n tokens (seconds), or -1.
double LlamaPrefill(const Flags& f, int n) {
  const std::string cmd = f.llama_bench + " -m " + f.gguf + " -p " + std::to_string(n) +
                          " -n 0 -r " + std::to_string(f.repeat) + " -t " +
                          std::to_string(f.threads) + " -o json 2>/dev/null";
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) return -1;
  std::string out;
  char buf[4096];
  while (size_t k = fread(buf, 1, sizeof buf, p)) out.append(buf, k);
  pclose(p);
  try {
    auto j = nlohmann::json::parse(out);
    return n / j.at(0).at("avg_ts").get<double>();
  } catch (...) {
    return -1;
  }
}

void Ttft(const Flags& f) {
  const int vocab = Vocab(f.model);
  std::printf("== time to first token, one prompt (%s, %d threads)\n", f.dtype.c_str(), f.threads);
  for (int n : f.lens) {
    testing::TempDir state;
    testing::ControllerProcess c(state.path(), f.model, BaseFlags(f, n + 64), f.model);
    if (!c.WaitServing()) {
      std::printf("controller did not serve:\n%s\n", c.Log().c_str());
      return;
    }
    const int worker = WorkerPid(c.process().pid());
    ResetPeak(worker);
    const int64_t loaded = ProcBytes(worker, "VmRSS");
    double best = 1e30;
    for (int r = 0; r < f.repeat; ++r) {
      v1::GenerateResponse out;
      const auto t0 = Clock::now();
      const grpc::Status s =
          c.Generate("", Prompt(n, r, vocab), 1, &out, false, std::chrono::seconds(3600));
      const double t = Sec(Clock::now() - t0);
      if (!s.ok()) {
        std::printf("  %d tokens: %s\n", n, s.error_message().c_str());
        return;
      }
      best = std::min(best, t);
    }
    const int64_t peak = ProcBytes(worker, "VmHWM");
    std::printf("  %5d tokens: TTFT %.3f s (%.0f tok/s)  worker RSS loaded %.0f MB, peak +%.0f MB",
                n, best, n / best, loaded / 1e6, (peak - loaded) / 1e6);
    if (!f.llama_bench.empty() && !f.gguf.empty()) {
      const double theirs = LlamaPrefill(f, n);
      std::printf("  llama.cpp %.3f s  ratio %.2f", theirs, best / theirs);
    }
    std::printf("\n");
    std::fflush(stdout);
  }
}

void Preempt(const Flags& f) {
  const int vocab = Vocab(f.model), n = f.concurrent_len, C = f.concurrent;
  const int max_new = f.concurrent_new, block = 16;
  const int64_t blocks = f.kv_blocks > 0 ? f.kv_blocks : int64_t{C} * (n + max_new) / block / 2;
  std::printf(
      "== %d concurrent %d-token prompts, KV cache of %lld blocks of %d (%.0f%% of their "
      "total)\n",
      C, n, static_cast<long long>(blocks), block,
      100.0 * blocks * block / (static_cast<double>(C) * (n + max_new)));
  // The budget in blocks needs the bytes of one block: asked of a worker started with the
  // default budget (its Info via the controller's log line is not public; the bytes follow from
  // config.json instead).
  std::ifstream in(f.model + "/config.json");
  auto cfg = nlohmann::json::parse(in);
  const int64_t layers = cfg.value("num_hidden_layers", 0),
                kvh = cfg.value("num_key_value_heads", 0);
  const int64_t hd =
      cfg.value("head_dim", cfg.value("hidden_size", 0) / cfg.value("num_attention_heads", 1));
  const int64_t bytes = blocks * 2 * block * layers * kvh * hd * (f.dtype == "bfloat16" ? 2 : 4);
  testing::TempDir state;
  std::vector<std::string> flags = BaseFlags(f, n + max_new + 64);
  // Without prefix caching: each prompt's run alone below recomputes it.
  flags.insert(flags.end(), {"--kv-cache-memory-bytes", std::to_string(bytes), "--max-num-seqs",
                             std::to_string(C), "--noenable-prefix-caching"});
  testing::ControllerProcess c(state.path(), f.model, flags, f.model);
  if (!c.WaitServing()) {
    std::printf("controller did not serve:\n%s\n", c.Log().c_str());
    return;
  }
  const int worker = WorkerPid(c.process().pid());
  ResetPeak(worker);
  const int64_t loaded = ProcBytes(worker, "VmRSS");
  std::vector<std::future<std::pair<grpc::Status, std::vector<int32_t>>>> calls;
  const auto t0 = Clock::now();
  for (int i = 0; i < C; ++i) {
    calls.push_back(std::async(std::launch::async, [&, i] {
      v1::GenerateResponse out;
      v1::GenerateRequest req;
      auto p = Prompt(n, 100 + i, vocab);
      req.mutable_prompt_token_ids()->Add(p.begin(), p.end());
      req.set_max_tokens(max_new);
      req.set_ignore_eos(true);
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(2));
      grpc::Status s = c.stub().Generate(&ctx, req, &out);
      return std::make_pair(s,
                            std::vector<int32_t>(out.token_ids().begin(), out.token_ids().end()));
    }));
  }
  std::vector<std::vector<int32_t>> got;
  int ok = 0;
  for (auto& call : calls) {
    auto [s, toks] = call.get();
    ok += s.ok();
    if (!s.ok()) std::printf("  failed: %s\n", s.error_message().c_str());
    got.push_back(toks);
  }
  const double wall = Sec(Clock::now() - t0);
  const int64_t peak = ProcBytes(worker, "VmHWM");
  const std::string m = c.Metrics();
  const size_t at = m.find("\nmoelora_preemptions_total ");
  const std::string preempted =
      at == std::string::npos ? "?" : m.substr(at + 27, m.find('\n', at + 1) - at - 27);
  int same = 0;
  for (int i = 0; i < std::min(f.check, C); ++i) {
    v1::GenerateResponse out;
    v1::GenerateRequest req;
    auto p = Prompt(n, 100 + i, vocab);
    req.mutable_prompt_token_ids()->Add(p.begin(), p.end());
    req.set_max_tokens(max_new);
    req.set_ignore_eos(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(1));
    if (c.stub().Generate(&ctx, req, &out).ok()) {
      same += std::vector<int32_t>(out.token_ids().begin(), out.token_ids().end()) == got[i];
    }
  }
  std::printf(
      "  %d of %d completed in %.1f s, preemptions %s, %d of %d equal to the prompt run "
      "alone; worker RSS loaded %.0f MB, peak +%.0f MB (budget %.0f MB)\n",
      ok, C, wall, preempted.c_str(), same, std::min(f.check, C), loaded / 1e6,
      (peak - loaded) / 1e6, bytes / 1e6);
}

void Streams(const Flags& f) {
  const int vocab = Vocab(f.model), n = f.concurrent_len;
  std::printf("== 8 streams decoding while %d prompts of %d tokens are read\n", f.joiners, n);
  testing::TempDir state;
  std::vector<std::string> flags = BaseFlags(f, n + 64);
  flags.insert(flags.end(), {"--decode-steps", "1"});
  testing::ControllerProcess c(state.path(), f.model, flags, f.model);
  if (!c.WaitServing()) {
    std::printf("controller did not serve:\n%s\n", c.Log().c_str());
    return;
  }
  // Each stream's chunk arrival times.
  auto stream = [&](int seed, int tokens) {
    v1::GenerateRequest req;
    auto p = Prompt(16, seed, vocab);
    req.mutable_prompt_token_ids()->Add(p.begin(), p.end());
    req.set_max_tokens(tokens);
    req.set_ignore_eos(true);
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::hours(2));
    auto reader = c.stub().GenerateStream(&ctx, req);
    std::vector<std::pair<double, int>> at;  // seconds since start, tokens in the chunk
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) {
      at.push_back({Sec(Clock::now().time_since_epoch()), chunk.token_ids_size()});
    }
    reader->Finish();
    return at;
  };
  auto gaps = [](const std::vector<std::vector<std::pair<double, int>>>& all, double from,
                 double to) {
    std::vector<double> g;
    for (const auto& s : all) {
      for (size_t i = 1; i < s.size(); ++i) {
        if (s[i].first >= from && s[i].first <= to && s[i].second > 0) {
          g.push_back((s[i].first - s[i - 1].first) / s[i].second);
        }
      }
    }
    return g;
  };
  // Alone: 8 streams of 64 tokens.
  std::vector<std::future<std::vector<std::pair<double, int>>>> calls;
  for (int i = 0; i < 8; ++i) calls.push_back(std::async(std::launch::async, stream, i, 64));
  std::vector<std::vector<std::pair<double, int>>> alone;
  for (auto& x : calls) alone.push_back(x.get());
  const double base = Median(gaps(alone, 0, 1e30));
  // With joiners: 8 long streams; the prompts arrive once they run, and the inter-token times
  // are taken while the prompts are being read (until the last joiner's answer).
  calls.clear();
  for (int i = 0; i < 8; ++i)
    calls.push_back(std::async(std::launch::async, stream, 10 + i, 100000 / 100));
  std::this_thread::sleep_for(std::chrono::seconds(2));
  const double from = Sec(Clock::now().time_since_epoch());
  std::vector<std::future<grpc::Status>> joins;
  for (int j = 0; j < f.joiners; ++j) {
    joins.push_back(std::async(std::launch::async, [&, j] {
      v1::GenerateResponse out;
      return c.Generate("", Prompt(n, 200 + j, vocab), 1, &out, false, std::chrono::seconds(7200));
    }));
  }
  for (auto& j : joins) j.get();
  const double to = Sec(Clock::now().time_since_epoch());
  c.process().Signal(SIGTERM);  // the long streams end with the drain
  std::vector<std::vector<std::pair<double, int>>> busy;
  for (auto& x : calls) busy.push_back(x.get());
  const double during = Median(gaps(busy, from, to));
  std::printf(
      "  median inter-token: alone %.1f ms, while the prompts are read %.1f ms (%.2fx; "
      "prompts read in %.1f s)\n",
      base * 1e3, during * 1e3, during / base, to - from);
}

// 4. Prefix caching: a --prefix-len prompt prefix + 16 tokens, then the same prefix with 16 other
// tokens (TTFT of the second against the first), then under an adapter (not reused: about the
// first's TTFT), whose greedy tokens must equal a run on a server with prefix caching off.
void Prefix(const Flags& f) {
  const int vocab = Vocab(f.model);
  std::printf("== prefix cache: %d-token prefix + 16 tokens\n", f.prefix_len);
  const std::string adapters = f.model + "/..";
  auto prompt = [&](int tail) {
    std::vector<int32_t> p = Prompt(f.prefix_len, 7, vocab);
    for (int32_t t : Prompt(16, 1000 + tail, vocab)) p.push_back(t);
    return p;
  };
  auto run = [&](testing::ControllerProcess& c, const std::string& adapter, int tail,
                 std::vector<int32_t>* tokens) {
    v1::GenerateResponse out;
    const auto t0 = Clock::now();
    const grpc::Status s =
        c.Generate(adapter, prompt(tail), 8, &out, false, std::chrono::seconds(3600));
    const double t = Sec(Clock::now() - t0);
    if (!s.ok()) std::printf("  %s\n", s.error_message().c_str());
    if (tokens) tokens->assign(out.token_ids().begin(), out.token_ids().end());
    return t;
  };
  std::vector<int32_t> warm_tokens, cold_tokens;
  double first, second, other;
  {
    testing::TempDir state;
    std::vector<std::string> flags = BaseFlags(f, f.prefix_len + 64);
    flags.push_back("--enable-mixed-moe-lora-format");
    testing::ControllerProcess c(state.path(), adapters, flags, f.model);
    if (!c.WaitServing() || !c.Load("a2d", adapters + "/adapter_2d").ok()) {
      std::printf("controller did not serve or load adapter_2d:\n%s\n", c.Log().c_str());
      return;
    }
    first = run(c, "", 1, nullptr);
    second = run(c, "", 2, nullptr);
    other = run(c, "a2d", 2, &warm_tokens);
  }
  {
    testing::TempDir state;
    std::vector<std::string> flags = BaseFlags(f, f.prefix_len + 64);
    flags.insert(flags.end(), {"--enable-mixed-moe-lora-format", "--noenable-prefix-caching"});
    testing::ControllerProcess c(state.path(), adapters, flags, f.model);
    if (!c.WaitServing() || !c.Load("a2d", adapters + "/adapter_2d").ok()) return;
    run(c, "a2d", 2, &cold_tokens);
  }
  std::printf(
      "  TTFT first %.3f s, second (prefix cached) %.3f s (%.3fx); under an adapter %.3f s "
      "(%.2fx), tokens %s a server without prefix caching\n",
      first, second, second / first, other, other / first,
      warm_tokens == cold_tokens ? "equal to" : "DIFFERENT from");
}

}  // namespace
}  // namespace moelora

int main(int argc, char** argv) {
  using namespace moelora;
  Flags f;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help") {
      std::printf(
          "usage: long_context --model DIR [--dtype D] [--lens 512,2048,8192] [--repeat R] "
          "[--threads T] [--llama-bench BIN --gguf FILE] [--concurrent C] "
          "[--concurrent-len N] [--concurrent-new G] [--kv-blocks B] [--check K] [--joiners J] "
          "[--only ttft|preempt|stream|prefix] [--prefix-len N] [--extra-flags \"...\"]\n");
      return 0;
    }
    if (i + 1 >= argc) return 2;
    const std::string v = argv[++i];
    if (a == "--model")
      f.model = v;
    else if (a == "--dtype")
      f.dtype = v;
    else if (a == "--repeat")
      f.repeat = std::atoi(v.c_str());
    else if (a == "--threads")
      f.threads = std::atoi(v.c_str());
    else if (a == "--llama-bench")
      f.llama_bench = v;
    else if (a == "--gguf")
      f.gguf = v;
    else if (a == "--concurrent")
      f.concurrent = std::atoi(v.c_str());
    else if (a == "--concurrent-len")
      f.concurrent_len = std::atoi(v.c_str());
    else if (a == "--kv-blocks")
      f.kv_blocks = std::atoll(v.c_str());
    else if (a == "--check")
      f.check = std::atoi(v.c_str());
    else if (a == "--concurrent-new")
      f.concurrent_new = std::atoi(v.c_str());
    else if (a == "--prefix-len")
      f.prefix_len = std::atoi(v.c_str());
    else if (a == "--joiners")
      f.joiners = std::atoi(v.c_str());
    else if (a == "--only")
      f.only = v;
    else if (a == "--extra-flags")
      f.extra = v;
    else if (a == "--lens") {
      f.lens.clear();
      for (auto& x : absl::StrSplit(v, ',')) f.lens.push_back(std::atoi(std::string(x).c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s (--help)\n", a.c_str());
      return 2;
    }
  }
  if (f.model.empty()) {
    std::fprintf(stderr, "--model is required (--help)\n");
    return 2;
  }
  if (f.only.empty() || f.only == "ttft") Ttft(f);
  if (f.only.empty() || f.only == "preempt") Preempt(f);
  if (f.only.empty() || f.only == "stream") Streams(f);
  if (f.only.empty() || f.only == "prefix") Prefix(f);
  return 0;
}
