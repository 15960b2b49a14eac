// bench/peer: moelora through its public API against transformers + PEFT generate() on the same
// medium Qwen3-MoE, prompts, batch and threads, in one run.
//
//   peer [--python PY] [--dir DIR] [--batches 1,8,32] [--dtypes float32,bfloat16]
//        [--new-tokens 32] [--threads 2] [--decode-steps 4] [--call-ahead 1] [--repeat 3]
//        [--quick] [--reuse-peer] [--prefill-waves N] [--llama-cpp]
//
// PY (default .cache/peer-venv/bin/python, made by tools/peer_venv.sh) runs tools/peer_bench.py:
// `make` writes the model, a 2D and a 3D rank-16 adapter and 32 prompts of 16 tokens into DIR
// (default .cache/peer-model) once; `run` times greedy generate() per dtype and batch, called
// once per batch just before moelora's runs of that batch (and once for PEFT's mixed case, f32
// only), so that both sides of a ratio are measured within a minute of each other. moelora:
// moelora-controller (TP=1, mixed mode, the worker on --threads intra-op threads), `batch`
// concurrent Generate calls (ignore_eos, greedy), base and mixed (even rows a2d, odd rows a3d).
//
// Printed per dtype and batch: tokens/s of both sides and their ratio, for base and mixed; the
// prefill tokens/s of both sides (the same batch with max_tokens 1 / one forward); moelora's
// decode step time next to its bandwidth bound (the bytes of weights a step must read: attention,
// router, LM head and the experts the batch is expected to touch under uniform routing, divided
// by the read bandwidth measured here, just before and just after the generate wave the step
// comes from: the VM's read rate moves by 10-30 % over minutes and spikes within seconds, so a
// probe taken once at the start judged later steps against another minute's memory; the probe
// taken before the batch's runs is printed too); and whether the greedy outputs are identical.
// Goals (issue 14): base >= 1.5x at batch 8 and 32, mixed >= 0.85x moelora's base, prefill >= 1x,
// step <= 1.3x the bound at batch 32. The decode step is also split into the worker's own share
// (its moelora_step_seconds over the same waves) and the rest (controller, RPCs). Exits 1 when an
// f32 greedy output differs from transformers' (bf16 outputs are counted, not required: the two
// round differently).
// --repeat N (default 3): each side's generate and prefill timed N times, the best kept (this VM
// drifts by 5-10 % over minutes, and one wave of concurrent calls may split its prefill when the
// calls arrive apart; moelora's base and mixed cases alternate round by round); moelora's f32
// greedy outputs must be the same in every repeat. The peer's
// mixed case (one generate per adapter, minutes in f32) runs once: its ratio is not a goal.
// --quick (CI): batches 1,8, 8 new tokens, float32 only, one repeat. --reuse-peer: the peer's
// figures from the last run in DIR (same flags), to iterate on moelora alone. --decode-steps: the
// controller's flag (its default, 4, unless given); --call-ahead 0|1 too (default 1).
// --prefill-waves N: per batch, after the warm-up, N base prefill waves in a row, with their mean
// time and the worker steps each took (a wave in more than one step was split by the controller's
// batch window).
// --llama-cpp: llama.cpp as a second peer (tools/llama_cpp_peer.sh builds it from the PyPI
// llama-cpp-python sdist and converts the model with its convert_hf_to_gguf.py into DIR's
// llama-<type>.gguf): per batch, right after moelora's runs, llama-batched-bench's decode tokens/s
// (-npp 16 -ntg NEW -npl BATCH) against moelora's base decode (batch / its decode step); and
// llama.cpp's greedy continuations of the prompts (tools/llama_greedy.cc) against moelora's base
// outputs (reported; f32 against f32, bf16 against bf16).
#include <sys/mman.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "bench/bench_args.h"
#include "bench/compute_peak.h"
#include "bench/plain_read.h"
#include "nlohmann/json.hpp"
#include "tests/integration/controller_process.h"
#include "tests/testing/http_get.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using Clock = std::chrono::steady_clock;
double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

constexpr const char* kUsage =
    "usage: peer [--python PY] [--dir DIR] [--batches 1,8,32] [--dtypes float32,bfloat16]\n"
    "            [--new-tokens 32] [--threads 2] [--decode-steps 4] [--call-ahead 1] [--repeat 3]\n"
    "            [--quick] [--reuse-peer] [--prefill-waves N] [--llama-cpp]\n";

// Read bandwidth of `threads` threads summing a 1 GiB buffer (best of 5): what a decode step
// that streams its weights once can reach at most. Two buffers, allocated and written once: one
// 2 MB-aligned on transparent huge pages, as the worker's weights are
// (worker/loaders/weight_loader.h), one on 4 KB pages (where page walks slow the same sum down:
// 22 against 35 GB/s on a Xeon VM); a probe is the faster of the two.
class ReadProbe {
 public:
  explicit ReadProbe(int threads) : threads_(threads) {}
  // GB/s on 4 KB and on 2 MB pages.
  std::pair<double, double> Measure() { return {Sum(&small_, false), Sum(&huge_, true)}; }
  double GBs() {
    const auto [s, h] = Measure();
    return std::max(s, h);
  }

 private:
  using Buffer = std::unique_ptr<void, void (*)(void*)>;
  static constexpr size_t kBytes = size_t{1} << 30;
  double Sum(Buffer* buf, bool huge_pages) {
    const size_t n = kBytes / sizeof(uint64_t);
    if (!*buf) {
      void* mem = nullptr;
      if (posix_memalign(&mem, size_t{2} << 20, kBytes) != 0) return 0;
      buf->reset(mem);
#ifdef MADV_HUGEPAGE
      ::madvise(mem, kBytes, huge_pages ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
#endif
      auto* words = static_cast<uint64_t*>(mem);
      for (size_t i = 0; i < n; ++i) words[i] = i;
    }
    return PlainReadGBs(static_cast<const uint64_t*>(buf->get()), static_cast<int64_t>(n), threads_,
                        5);
  }
  const int threads_;
  Buffer small_{nullptr, std::free}, huge_{nullptr, std::free};
};

struct ModelDims {
  int64_t H = 0, I = 0, E = 0, topk = 0, layers = 0, q = 0, kv = 0, vocab = 0;
};

ModelDims ReadDims(const std::string& config) {
  std::ifstream f(config);
  const auto j = nlohmann::json::parse(f);
  ModelDims d;
  d.H = j["hidden_size"];
  d.I = j["moe_intermediate_size"];
  d.E = j.contains("num_experts") && j["num_experts"].is_number() ? j["num_experts"]
                                                                  : j["num_local_experts"];
  d.topk = j["num_experts_per_tok"];
  d.layers = j["num_hidden_layers"];
  const int64_t hd = j["head_dim"];
  d.q = static_cast<int64_t>(j["num_attention_heads"]) * hd;
  d.kv = static_cast<int64_t>(j["num_key_value_heads"]) * hd;
  d.vocab = j["vocab_size"];
  return d;
}

// The weight products of one decode step of `batch` sequences: the bytes each reads at least and
// its flops. Every layer's attention projections, its router and the experts the batch touches
// (expected count under uniform top-k routing: E (1 - (1 - k/E)^batch), each with the rows routed
// to it), then the LM head; norms and embedding rows are negligible.
struct Product {
  double bytes = 0, flops = 0;
};
std::vector<Product> StepProducts(const ModelDims& d, int batch, int elem) {
  const double experts = d.E * (1.0 - std::pow(1.0 - static_cast<double>(d.topk) / d.E, batch));
  const double attn = static_cast<double>(d.H) * (2 * d.q + 2 * d.kv);
  const double router = static_cast<double>(d.E) * d.H, expert = 3.0 * d.H * d.I;
  const double lm_head = static_cast<double>(d.vocab) * d.H;
  std::vector<Product> ps;
  for (int64_t l = 0; l < d.layers; ++l) {
    ps.push_back({elem * attn, 2.0 * batch * attn});
    ps.push_back({elem * router, 2.0 * batch * router});
    ps.push_back({elem * experts * expert, 2.0 * batch * d.topk * expert});
  }
  ps.push_back({elem * lm_head, 2.0 * batch * lm_head});
  return ps;
}

// Bytes of weights one decode step reads at least (the bound divides these by the read
// rate).
double StepBytes(const ModelDims& d, int batch, int elem) {
  double bytes = 0;
  for (const Product& p : StepProducts(d, batch, elem)) bytes += p.bytes;
  return bytes;
}

// A floor under the step that counts arithmetic too: each product at the slower of its bytes at
// `gbs` and its flops at `gflops` (a roofline, product by product). On two cores the dense
// products of a large batch are compute-bound (0.94 GFLOP at batch 32 on this model, 4.2 ms at
// 222 GFLOP/s against 1.6 ms for their 56 MB), which the bound alone does not see.
double StepFloorSeconds(const ModelDims& d, int batch, int elem, double gbs, double gflops) {
  double s = 0;
  for (const Product& p : StepProducts(d, batch, elem)) {
    s += std::max(p.bytes / (gbs * 1e9), gflops > 0 ? p.flops / (gflops * 1e9) : 0.0);
  }
  return s;
}

struct Side {
  double tok_s = 0, prefill_tok_s = 0, seconds = 0;
  // The prefill tokens/s of the repeat whose generate wave was kept: the decode step is that wave
  // less its prefill.
  double wave_prefill_tok_s = 0;
  // The read probe just before and just after the kept generate wave (GB/s; 0 without a probe).
  double bw_before = 0, bw_after = 0;
  // The compute probe just before and just after it (GFLOP/s; 0 without one).
  double gflops_before = 0, gflops_after = 0;
  // Whether every repeat gave the same greedy outputs.
  bool same_outputs = true;
  // Each round's generate tokens/s, in round order (the mixed / base ratio of each round pairs
  // two waves seconds apart).
  std::vector<double> round_tok_s;
  // The worker's moelora_step_seconds (sum, count) over the prefill wave and the generate wave.
  double pf_step_sum = 0, gen_step_sum = 0;
  int64_t pf_steps = 0, gen_steps = 0;
  // Over the generate wave, from the controller's metrics: the worker calls' time beyond their
  // steps (RPCs, hand-offs) and the scheduler's gaps between calls (sum, count).
  double call_overhead_sum = 0, gap_sum = 0;
  int64_t calls = 0, gaps = 0, ahead = 0;  // calls: those not sent ahead
  // The worker's moelora_step_idle_seconds over the generate wave (sum, count).
  double idle_sum = 0;
  int64_t idles = 0;
  std::vector<std::vector<int32_t>> outputs;
};

// The sum of every series of `name` in a Prometheus text page (0 when absent).
double MetricSum(const std::string& page, const std::string& name) {
  double v = 0;
  for (absl::string_view line : absl::StrSplit(page, '\n')) {
    if (!absl::StartsWith(line, name) || line.size() <= name.size()) continue;
    const char next = line[name.size()];
    if (next != ' ' && next != '{') continue;
    const size_t sp = line.rfind(' ');
    double x = 0;
    if (sp != absl::string_view::npos && absl::SimpleAtod(line.substr(sp + 1), &x)) v += x;
  }
  return v;
}

// The worker's (rank 0 of the first group) `metric` (a histogram) so far: (sum, count).
std::pair<double, int64_t> WorkerHistogram(const std::string& state_dir,
                                           const std::string& metric = "moelora_step_seconds") {
  std::ifstream f(state_dir + "/run/group.1/port.0");
  if (!f) return {0, 0};
  const auto j = nlohmann::json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("metrics_port")) return {0, 0};
  const std::string page = testing::HttpGet(j["metrics_port"].get<int>(), "/metrics");
  return {MetricSum(page, metric + "_sum"),
          static_cast<int64_t>(MetricSum(page, metric + "_count"))};
}

// The controller's moelora_worker_call_overhead_seconds and moelora_scheduler_gap_seconds so
// far, and moelora_worker_calls_ahead_total.
struct CallCosts {
  double overhead = 0, gap = 0;
  int64_t calls = 0, gaps = 0, ahead = 0;
};
CallCosts ControllerCallCosts(const testing::ControllerProcess& c) {
  const std::string page = c.Metrics();
  return {MetricSum(page, "moelora_worker_call_overhead_seconds_sum"),
          MetricSum(page, "moelora_scheduler_gap_seconds_sum"),
          static_cast<int64_t>(MetricSum(page, "moelora_worker_call_overhead_seconds_count")),
          static_cast<int64_t>(MetricSum(page, "moelora_scheduler_gap_seconds_count")),
          static_cast<int64_t>(MetricSum(page, "moelora_worker_calls_ahead_total"))};
}

// One of a batch's cases: `batch` concurrent Generate calls, row i with adapters[i %
// adapters.size()]; its figures go to `out`, and with a probe, the read rate just before and just
// after each generate wave.
struct Case {
  std::vector<std::string> adapters;
  Side* out = nullptr;
  ReadProbe* probe = nullptr;
  // With a probe: the compute probe (GFLOP/s), run next to the read probe.
  std::function<double()> compute;
};

// Each of `repeat` rounds runs every case once, one after the other: a prefill wave (max_tokens
// 1), then a generate wave; the fastest of each is kept per case. Rounds, not cases, on the
// outside: the base and the mixed case of a round run within seconds of each other, so that the
// mixed / base ratio does not hang on which of them met the VM's fast or slow stretch (its read
// rate jumps by up to 2x within seconds; in one run the f32 batch-32 base
// waves, all run first, met a fast stretch and the mixed waves after them did not: 29.2 against
// 37.2 ms a step).
bool RunMoelora(testing::ControllerProcess& c, const std::string& state_dir,
                const std::vector<std::vector<int32_t>>& prompts, int batch, int new_tokens,
                const std::vector<Case>& cases, int repeat, int prefill_waves) {
  auto wave = [&](const std::vector<std::string>& adapters, int max_tokens,
                  std::vector<std::vector<int32_t>>* outs) {
    std::vector<std::thread> ts;
    std::atomic<bool> ok{true};
    outs->assign(batch, {});
    const auto t0 = Clock::now();
    for (int i = 0; i < batch; ++i) {
      ts.emplace_back([&, i] {
        v1::GenerateRequest req;
        req.set_adapter(adapters[i % adapters.size()]);
        req.mutable_prompt_token_ids()->Add(prompts[i].begin(), prompts[i].end());
        req.set_max_tokens(max_tokens);
        req.set_ignore_eos(true);
        v1::GenerateResponse r;
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(600));
        const grpc::Status s = c.stub().Generate(&ctx, req, &r);
        if (!s.ok()) {
          std::fprintf(stderr, "Generate: %s\n", s.error_message().c_str());
          ok = false;
          return;
        }
        (*outs)[i].assign(r.token_ids().begin(), r.token_ids().end());
      });
    }
    for (auto& t : ts) t.join();
    return ok ? Sec(Clock::now() - t0) : -1.0;
  };
  std::vector<std::vector<int32_t>> scratch, outs;
  for (const Case& cs : cases) {
    if (wave(cs.adapters, 2, &scratch) < 0) return false;  // warm (this batch's shapes, slots)
  }
  // --prefill-waves N: the first case's prefill wave N times in a row, and how many worker steps
  // each took (more than one: the burst of calls was split).
  if (prefill_waves > 0) {
    std::vector<double> times;
    std::vector<std::string> steps;
    int split = 0;
    for (int i = 0; i < prefill_waves; ++i) {
      const auto s0 = WorkerHistogram(state_dir);
      const double t = wave(cases[0].adapters, 1, &scratch);
      const auto s1 = WorkerHistogram(state_dir);
      if (t < 0) return false;
      times.push_back(t);
      steps.push_back(std::to_string(s1.second - s0.second));
      if (s1.second - s0.second > 1) ++split;
    }
    std::sort(times.begin(), times.end());
    std::printf(
        "batch %d: %d prefill waves in a row: median %.1f ms, best %.1f ms; worker steps a wave "
        "%s (%d split)\n",
        batch, prefill_waves, times[times.size() / 2] * 1e3, times[0] * 1e3,
        absl::StrJoin(steps, " ").c_str(), split);
  }
  for (int r = 0; r < repeat; ++r) {
    for (const Case& cs : cases) {
      Side* out = cs.out;
      const auto s0 = WorkerHistogram(state_dir);
      const double pf = wave(cs.adapters, 1, &scratch);
      const double bw0 = cs.probe != nullptr ? cs.probe->GBs() : 0.0;
      const double fl0 = cs.probe != nullptr && cs.compute ? cs.compute() : 0.0;
      const auto s1 = WorkerHistogram(state_dir);
      const CallCosts k1 = ControllerCallCosts(c);
      const auto i1 = WorkerHistogram(state_dir, "moelora_step_idle_seconds");
      const double gen = wave(cs.adapters, new_tokens, &outs);
      const auto i2 = WorkerHistogram(state_dir, "moelora_step_idle_seconds");
      const CallCosts k2 = ControllerCallCosts(c);
      const auto s2 = WorkerHistogram(state_dir);
      const double bw1 = cs.probe != nullptr ? cs.probe->GBs() : 0.0;
      const double fl1 = cs.probe != nullptr && cs.compute ? cs.compute() : 0.0;
      if (pf < 0 || gen < 0) return false;
      const double pf_tok_s = static_cast<double>(batch) * prompts[0].size() / pf;
      out->prefill_tok_s = std::max(out->prefill_tok_s, pf_tok_s);
      out->round_tok_s.push_back(static_cast<double>(batch) * new_tokens / gen);
      if (r == 0) {
        out->outputs = outs;
      } else if (outs != out->outputs) {
        out->same_outputs = false;
      }
      if (r > 0 && gen >= out->seconds) continue;
      out->pf_step_sum = s1.first - s0.first;
      out->pf_steps = s1.second - s0.second;
      out->gen_step_sum = s2.first - s1.first;
      out->gen_steps = s2.second - s1.second;
      out->call_overhead_sum = k2.overhead - k1.overhead;
      out->calls = k2.calls - k1.calls;
      out->gap_sum = k2.gap - k1.gap;
      out->gaps = k2.gaps - k1.gaps;
      out->ahead = k2.ahead - k1.ahead;
      out->idle_sum = i2.first - i1.first;
      out->idles = i2.second - i1.second;
      out->seconds = gen;
      out->tok_s = static_cast<double>(batch) * new_tokens / gen;
      out->wave_prefill_tok_s = pf_tok_s;
      out->bw_before = bw0;
      out->bw_after = bw1;
      out->gflops_before = fl0;
      out->gflops_after = fl1;
    }
  }
  return true;
}

using bench::Capture;

// llama.cpp as a peer: its binaries' directory and a model converted per dtype.
struct LlamaPeer {
  std::string bin;  // holds llama-batched-bench and llama_greedy
  int threads = 2;
  // The GGUF of `dt` for `dir`'s model, converted once.
  std::string Gguf(const std::string& src, const std::string& dir, const std::string& dt) const {
    const std::string type = dt == "float32" ? "f32" : "bf16";
    const std::string out = absl::StrCat(dir, "/llama-", type, ".gguf");
    if (std::filesystem::exists(out)) return out;
    std::printf("converting for llama.cpp: %s\n", out.c_str());
    std::fflush(stdout);
    const std::string got = Capture(absl::StrCat("bash ", src, "/tools/llama_cpp_peer.sh convert ",
                                                 dir, "/model ", out, " ", type));
    return got.empty() ? "" : out;
  }
  // llama-batched-bench's decode tokens/s for `batch` sequences of 16-token prompts; 0 on error.
  double DecodeTokS(const std::string& gguf, int batch, int new_tokens) const {
    const std::string out = Capture(absl::StrCat(
        bin, "/llama-batched-bench -m ", gguf, " -c ", std::max(16384, batch * (16 + new_tokens)),
        " -b 2048 -ub 512 -npp 16 -ntg ", new_tokens, " -npl ", batch, " -t ", threads, " -tb ",
        threads, " --output-format jsonl 2>/dev/null"));
    for (absl::string_view line : absl::StrSplit(out, '\n')) {
      if (!absl::StartsWith(line, "{")) continue;
      auto j = nlohmann::json::parse(line, nullptr, false);
      if (!j.is_discarded() && j.contains("speed_tg")) return j["speed_tg"].get<double>();
    }
    std::fprintf(stderr, "llama-batched-bench gave no figure for batch %d:\n%s\n", batch,
                 out.c_str());
    return 0;
  }
  // Greedy continuations of `prompts`, `new_tokens` each.
  std::vector<std::vector<int32_t>> Greedy(const std::string& gguf,
                                           const std::vector<std::vector<int32_t>>& prompts,
                                           int new_tokens) const {
    testing::TempDir tmp;
    const std::string in = tmp.path() + "/prompts.txt";
    {
      std::ofstream f(in);
      for (const auto& p : prompts) f << absl::StrJoin(p, " ") << "\n";
    }
    const std::string out = Capture(absl::StrCat(bin, "/llama_greedy ", gguf, " ", new_tokens, " ",
                                                 threads, " < ", in, " 2>/dev/null"));
    std::vector<std::vector<int32_t>> r;
    for (absl::string_view line : absl::StrSplit(out, '\n', absl::SkipEmpty())) {
      std::vector<int32_t> toks;
      for (absl::string_view t : absl::StrSplit(line, ' ', absl::SkipEmpty())) {
        int32_t v = 0;
        if (absl::SimpleAtoi(t, &v)) toks.push_back(v);
      }
      r.push_back(toks);
    }
    return r;
  }
};

int Matches(const std::vector<std::vector<int32_t>>& a, const nlohmann::json& b) {
  int n = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    if (a[i] == b[i].get<std::vector<int32_t>>()) ++n;
  }
  return n;
}

}  // namespace
}  // namespace moelora

int main(int argc, char** argv) {
  using namespace moelora;
  const std::string src = MOELORA_SOURCE_DIR;
  std::string python = src + "/.cache/peer-venv/bin/python", dir = src + "/.cache/peer-model";
  std::string batches_s = "1,8,32", dtypes_s = "float32,bfloat16";
  int new_tokens = 32, threads = 2;
  int decode_steps = 4;    // the controller's default
  bool call_ahead = true;  // the controller's default
  int prefill_waves = 0;
  int repeat = 3;
  bool reuse_peer = false;
  bool llama_cpp = false;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&]() -> std::string {
      if (i + 1 >= argc) {
        std::fprintf(stderr, "%s needs a value\n%s", f.c_str(), kUsage);
        std::exit(2);
      }
      return argv[++i];
    };
    if (f == "--help" || f == "-h") {
      std::printf("%s", kUsage);
      return 0;
    } else if (f == "--python") {
      python = value();
    } else if (f == "--dir") {
      dir = value();
    } else if (f == "--batches") {
      batches_s = value();
    } else if (f == "--dtypes") {
      dtypes_s = value();
    } else if (f == "--new-tokens") {
      new_tokens = std::atoi(value().c_str());
    } else if (f == "--threads") {
      threads = std::atoi(value().c_str());
    } else if (f == "--decode-steps") {
      decode_steps = std::atoi(value().c_str());
    } else if (f == "--call-ahead") {
      call_ahead = value() != "0";
    } else if (f == "--repeat") {
      repeat = std::max(1, std::atoi(value().c_str()));
    } else if (f == "--reuse-peer") {
      reuse_peer = true;
    } else if (f == "--llama-cpp") {
      llama_cpp = true;
    } else if (f == "--prefill-waves") {
      prefill_waves = std::atoi(value().c_str());
    } else if (f == "--quick") {
      batches_s = "1,8";
      dtypes_s = "float32";
      new_tokens = 8;
      repeat = 1;
    } else {
      std::fprintf(stderr, "unknown flag %s\n%s", f.c_str(), kUsage);
      return 2;
    }
  }
  std::vector<int> batches;
  for (absl::string_view b : absl::StrSplit(batches_s, ',')) batches.push_back(std::atoi(b.data()));
  const std::vector<std::string> dtypes = absl::StrSplit(dtypes_s, ',');
  if (!std::filesystem::exists(python)) {
    std::fprintf(stderr, "%s: not found; run tools/peer_venv.sh (or pass --python)\n",
                 python.c_str());
    return 1;
  }
  const std::string script = src + "/tools/peer_bench.py";
  // The controller resolves relative model paths against the test data: pass it absolute ones.
  dir = std::filesystem::absolute(dir).lexically_normal().string();
  if (!std::filesystem::exists(dir + "/prompts.json")) {
    const std::string cmd = absl::StrCat(python, " ", script, " make --out ", dir);
    std::printf("writing the model: %s\n", cmd.c_str());
    std::fflush(stdout);
    if (std::system(cmd.c_str()) != 0) return 1;
  }
  std::vector<std::vector<int32_t>> prompts;
  {
    std::ifstream f(dir + "/prompts.json");
    prompts = nlohmann::json::parse(f).get<std::vector<std::vector<int32_t>>>();
  }
  const int max_batch = *std::max_element(batches.begin(), batches.end());
  if (max_batch > static_cast<int>(prompts.size())) {
    std::fprintf(stderr, "batch %d > %zu prompts\n", max_batch, prompts.size());
    return 2;
  }
  const ModelDims dims = ReadDims(dir + "/model/config.json");
  // Read just before each batch's base runs (below), and again just before and just after each
  // of its base generate waves: the faster of the two page sizes, what the machine can read at
  // best.
  ReadProbe probe(threads);
  auto read_bandwidth = [&](const std::string& dt, int batch) {
    const auto [bw_small, bw_huge] = probe.Measure();
    std::printf(
        "%s, batch %d: read bandwidth (%d threads, 1 GiB) %.1f GB/s on 2 MB pages, %.1f GB/s on "
        "4 KB pages (its bound uses the faster)\n",
        dt.c_str(), batch, threads, bw_huge, bw_small);
    return std::max(bw_small, bw_huge);
  };
  bool outputs_ok = true;
  LlamaPeer llama;
  llama.threads = threads;
  if (llama_cpp) {
    const std::string bench = Capture(absl::StrCat("bash ", src, "/tools/llama_cpp_peer.sh build"));
    if (bench.empty()) return 1;
    llama.bin = std::filesystem::path(std::string(absl::StripTrailingAsciiWhitespace(bench)))
                    .parent_path()
                    .string();
  }
  // One run of the peer (tools/peer_bench.py run) into DIR/peer_<dt>_<tag>.json, read back into
  // `into` (its "torch" and its cases merged); with --reuse-peer, an earlier run's file if there.
  auto run_peer = [&](const std::string& dt, const std::string& cases, const std::string& bs,
                      const std::string& tag, nlohmann::json* into) {
    const std::string pj = absl::StrCat(dir, "/peer_", dt, "_", tag, ".json");
    const std::string log = absl::StrCat(dir, "/peer_", dt, "_", tag, ".log");
    const std::string cmd =
        absl::StrCat(python, " ", script, " run --dir ", dir, " --dtype ", dt, " --batches ", bs,
                     " --new-tokens ", new_tokens, " --threads ", threads, " --repeat ", repeat,
                     " --cases ", cases, " --out ", pj, " 2>", log);
    std::printf("peer: %s\n", reuse_peer && std::filesystem::exists(pj) ? "(reused)" : cmd.c_str());
    std::fflush(stdout);
    if (!(reuse_peer && std::filesystem::exists(pj)) && std::system(cmd.c_str()) != 0) {
      std::fprintf(stderr, "the peer failed; see %s\n", log.c_str());
      return false;
    }
    std::ifstream f(pj);
    const auto j = nlohmann::json::parse(f);
    (*into)["torch"] = j["torch"];
    for (const auto& [k, v] : j["cases"].items()) (*into)["cases"][k] = v;
    return true;
  };
  for (const std::string& dt : dtypes) {
    nlohmann::json peer;
    peer["cases"] = nlohmann::json::object();
    // PEFT's mixed case (one generate() per adapter) once, first, f32 only: in bf16 it took over
    // 20 minutes here (its 3D wrapper rebuilds the expert deltas every forward), and its ratio
    // is not a goal.
    if (dt == "float32" && !run_peer(dt, "mixed", batches_s, "mixed", &peer)) return 1;
    testing::TempDir state;
    testing::ControllerProcess c(
        state.path(), dir,
        {"--enable-mixed-moe-lora-format", "--max-num-seqs", "64", "--dtype", dt, "--decode-steps",
         std::to_string(decode_steps), absl::StrCat("--call-ahead=", call_ahead ? "true" : "false"),
         "--worker-args", absl::StrCat("--cpu-threads ", threads)},
        dir + "/model");
    if (!c.WaitHealth(grpc::health::v1::HealthCheckResponse::SERVING, std::chrono::seconds(300))) {
      std::fprintf(stderr, "controller did not start:\n%s\n", c.Log().c_str());
      return 1;
    }
    if (!c.Load("a2d", "adapter_2d").ok() || !c.Load("a3d", "adapter_3d").ok()) {
      std::fprintf(stderr, "LoadAdapter failed:\n%s\n", c.Log().c_str());
      return 1;
    }
    // Per batch: the peer's base case, the read probe, then moelora's base and mixed cases, round
    // by round (RunMoelora), so that the two sides and the bound see the same stretch of the VM
    // (its speed moves by 10-30 % over minutes; one side's whole run after the other's put
    // minutes between a batch's two figures). The controller idles while the peer runs.
    std::vector<std::string> rows, llama_rows;
    std::map<int, Side> base;
    std::vector<std::string> extra;
    const std::string gguf = llama_cpp ? llama.Gguf(src, dir, dt) : "";
    if (llama_cpp && gguf.empty()) return 1;
    for (int b : batches) {
      if (!run_peer(dt, "base", std::to_string(b), absl::StrCat("base_", b), &peer)) return 1;
      const double bw = read_bandwidth(dt, b);
      // The multiply-add rate the floor below judges the products by; like the read rate, it
      // moves with the VM (132-222 GFLOP/s in f32 within minutes on the Zen 4 VM), so it is
      // probed again around each base generate wave.
      auto compute = [&] { return ComputePeakGflops(threads, dt == "bfloat16"); };
      const char* ins = peak::Instruction(dt == "bfloat16");
      std::printf("%s, batch %d: compute probe (%d threads, %s) %.0f GFLOP/s\n", dt.c_str(), b,
                  threads, ins != nullptr ? ins : "none", compute());
      Side sides[2];
      if (!RunMoelora(c, state.path(), prompts, b, new_tokens,
                      {Case{{""}, &sides[0], &probe, compute},
                       Case{{"a2d", "a3d"}, &sides[1], nullptr, nullptr}},
                      repeat, prefill_waves)) {
        return 1;
      }
      for (const std::string cs : {"base", "mixed"}) {
        const Side& s = sides[cs == "base" ? 0 : 1];
        if (!s.same_outputs) {
          // f32 must repeat exactly; bf16 rounds each product to bf16, so a row's tokens may
          // follow from how the wave's calls were grouped (counted, as against transformers).
          extra.push_back(
              absl::StrFormat("batch %d, %s: moelora's greedy outputs differ between repeats%s", b,
                              cs, dt == "float32" ? " (FAIL in f32)" : " (bf16: not required)"));
          if (dt == "float32") outputs_ok = false;
        }
        const std::string key = absl::StrCat(cs, "/", b);
        // Decode step: the generate wave less its prefill, over the remaining steps.
        const double step =
            (s.seconds - b * 16.0 / s.wave_prefill_tok_s) / std::max(1, new_tokens - 1);
        // The worker's share: the generate wave's steps less its prefill steps (those of the
        // max_tokens 1 wave stand for them).
        const bool split = s.gen_steps > s.pf_steps && s.pf_steps > 0;
        const double worker =
            split ? (s.gen_step_sum - s.pf_step_sum) / static_cast<double>(s.gen_steps - s.pf_steps)
                  : 0.0;
        auto mixed_line = [&] {
          // Best against best, and each round's mixed wave against the base wave just before it
          // (the median of those; each side's best may come from different stretches of the VM).
          std::vector<double> paired;
          std::vector<std::string> each;
          const std::vector<double>& br = base[b].round_tok_s;
          for (size_t r = 0; r < s.round_tok_s.size() && r < br.size(); ++r) {
            paired.push_back(s.round_tok_s[r] / br[r]);
            each.push_back(absl::StrFormat("%.2f", paired.back()));
          }
          std::sort(paired.begin(), paired.end());
          const double median = paired.empty() ? 0.0 : paired[paired.size() / 2];
          return absl::StrFormat(
              "batch %d: mixed / moelora base = %.2f, best against best; round by round %s, "
              "median %.2f (prefill %.0f tok/s, %.2f of base; decode step %.1f ms, the worker's "
              "%.1f ms)",
              b, s.tok_s / base[b].tok_s, absl::StrJoin(each, ", "), median, s.prefill_tok_s,
              s.prefill_tok_s / base[b].prefill_tok_s, step * 1e3, worker * 1e3);
        };
        if (!peer["cases"].contains(key)) {
          rows.push_back(absl::StrFormat("| %s | %d | %.0f | - | - | - |\n", cs, b, s.tok_s));
          extra.push_back(mixed_line());
          continue;
        }
        const auto& p = peer["cases"][key];
        const int m = Matches(s.outputs, p["outputs"]);
        if (m != b && dt == "float32") outputs_ok = false;
        rows.push_back(absl::StrFormat("| %s | %d | %.0f | %.0f | %.2f | %d/%d |\n", cs, b, s.tok_s,
                                       p["tok_s"].get<double>(), s.tok_s / p["tok_s"].get<double>(),
                                       m, b));
        if (cs == "base") {
          base[b] = s;
          if (llama_cpp) {
            const double theirs = llama.DecodeTokS(gguf, b, new_tokens);
            llama_rows.push_back(absl::StrFormat("| %d | %.0f | %.0f | %.2f |\n", b, b / step,
                                                 theirs, theirs > 0 ? b / step / theirs : 0.0));
          }
          // The bound from the probes just before and just after the wave the step comes from
          // (their mean): the VM's read rate moves within seconds (28-58 GB/s within a minute on
          // the Zen 4 VM), so the probe before the batch, seconds earlier, can catch a moment the
          // wave did not have. Both are printed.
          const double bytes = StepBytes(dims, b, dt == "float32" ? 4 : 2);
          const double around = (s.bw_before + s.bw_after) / 2;
          const double bound = bytes / (around * 1e9), bound_first = bytes / (bw * 1e9);
          extra.push_back(absl::StrFormat(
              "batch %d: prefill %.0f vs %.0f tok/s (ratio %.2f); decode step %.1f ms, bound "
              "%.1f ms (%.0f MB / %.1f GB/s, the mean of the probes just before and after that "
              "wave: %.1f, %.1f), step/bound %.2f; against the probe before the batch (%.1f GB/s) "
              "%.2f",
              b, s.prefill_tok_s, p["prefill_tok_s"].get<double>(),
              s.prefill_tok_s / p["prefill_tok_s"].get<double>(), step * 1e3, bound * 1e3,
              bytes / 1e6, around, s.bw_before, s.bw_after, step / bound, bw, step / bound_first));
          const double gflops = (s.gflops_before + s.gflops_after) / 2;
          if (gflops > 0) {
            const double floor = StepFloorSeconds(dims, b, dt == "float32" ? 4 : 2, around, gflops);
            extra.push_back(absl::StrFormat(
                "batch %d: roofline floor %.1f ms (each weight product at the slower of its bytes "
                "at %.1f GB/s and its flops at %.0f GFLOP/s, %s, the mean of the compute probes "
                "just before and after that wave: %.0f, %.0f), floor/bound %.2f, step/floor %.2f",
                b, floor * 1e3, around, gflops, ins, s.gflops_before, s.gflops_after, floor / bound,
                step / floor));
          }
          if (split) {
            extra.push_back(absl::StrFormat(
                "batch %d: of the decode step, the worker's step %.1f ms (%lld prefill step(s) "
                "per wave), the rest (controller, RPCs) %.1f ms; the prefill wave %.1f ms, the "
                "worker's prefill step(s) %.1f ms",
                b, worker * 1e3, static_cast<long long>(s.pf_steps), (step - worker) * 1e3,
                b * 16e3 / s.wave_prefill_tok_s, s.pf_step_sum * 1e3));
          }
          if (s.calls > 0) {
            // The controller's own figures for the generate wave: what a call costs beyond its
            // steps, and the scheduler's time between calls, while the worker idles (both for
            // the calls not sent ahead: one sent ahead hides them).
            const int64_t all = s.calls + s.ahead;
            extra.push_back(absl::StrFormat(
                "batch %d: the generate wave's %lld worker calls (%.1f steps a call), %lld sent "
                "ahead; the others %.3f ms a call beyond their steps (RPCs, hand-offs), the "
                "scheduler %.3f ms before each of %lld; %.2f ms a step in all; the worker idled "
                "%.3f ms between calls (%lld), %.3f ms a step",
                b, static_cast<long long>(all),
                static_cast<double>(s.gen_steps) / static_cast<double>(all),
                static_cast<long long>(s.ahead), s.call_overhead_sum / s.calls * 1e3,
                s.gaps > 0 ? s.gap_sum / s.gaps * 1e3 : 0.0, static_cast<long long>(s.gaps),
                (s.call_overhead_sum + s.gap_sum) / std::max<int64_t>(1, s.gen_steps) * 1e3,
                s.idles > 0 ? s.idle_sum / s.idles * 1e3 : 0.0, static_cast<long long>(s.idles),
                s.idle_sum / std::max<int64_t>(1, s.gen_steps) * 1e3));
          }
        } else {
          extra.push_back(mixed_line());
        }
      }
    }
    std::printf(
        "\n%s, %d new tokens, %d threads each, --decode-steps %d, --call-ahead %d, best of %d, "
        "torch %s on the "
        "peer side\n"
        "| case | batch | moelora tok/s | transformers+PEFT tok/s | ratio | greedy identical |\n"
        "|---|---|---|---|---|---|\n",
        dt.c_str(), new_tokens, threads, decode_steps, call_ahead ? 1 : 0, repeat,
        peer["torch"].get<std::string>().c_str());
    for (const auto& r : rows) std::printf("%s", r.c_str());
    for (const auto& e : extra) std::printf("  %s\n", e.c_str());
    if (llama_cpp) {
      std::printf(
          "\n%s, llama.cpp (llama-batched-bench -npp 16 -ntg %d, %d threads): decode tokens/s\n"
          "| batch | moelora (batch / decode step) | llama.cpp | ratio |\n|---|---|---|---|\n",
          dt.c_str(), new_tokens, threads);
      for (const auto& r : llama_rows) std::printf("%s", r.c_str());
      // Greedy continuations of the largest batch's prompts, against moelora's base outputs.
      const int n = max_batch;
      const Side& ours = base[n];
      const auto theirs = llama.Greedy(
          gguf, std::vector<std::vector<int32_t>>(prompts.begin(), prompts.begin() + n),
          new_tokens);
      // Rows equal, and tokens equal up to each row's first difference (after which the two
      // continue from different text).
      int same = 0;
      int64_t agree = 0, total = 0;
      for (int i = 0; i < n && i < static_cast<int>(theirs.size()) &&
                      i < static_cast<int>(ours.outputs.size());
           ++i) {
        const auto& a = ours.outputs[i];
        const auto& t = theirs[i];
        same += a == t;
        size_t k = 0;
        while (k < a.size() && k < t.size() && a[k] == t[k]) ++k;
        agree += static_cast<int64_t>(k);
        total += static_cast<int64_t>(a.size());
      }
      std::printf(
          "greedy outputs identical to llama.cpp's (%s both): %d/%d rows; %lld of %lld tokens "
          "before each row's first difference\n",
          dt.c_str(), same, n, static_cast<long long>(agree), static_cast<long long>(total));
    }
  }
  if (!outputs_ok) {
    std::fprintf(stderr, "FAIL: an f32 greedy output differs from transformers'\n");
    return 1;
  }
  return 0;
}
