// bench/slora: S-LoRA's serving workload against the real controller and worker: requests for n
// adapters with power-law popularity (S-LoRA's `int(numpy.random.power(alpha) * n)`), Poisson
// arrivals at a fixed rate, input and output lengths uniform on [8, 256), streamed; the same
// arrivals (same seed) for every n, so that n = 1 is the baseline of each run.
//   slora [--model DIR] [--adapters DIR] [--n 1,8,100,1000] [--alpha 1,0.3] [--rate R]
//         [--requests N] [--slo-ms S] [--seed K] [--dtype bfloat16] [--flags "..."]
// DIR defaults: bench/peer's medium model (.cache/peer-model) and its adapter_2d / adapter_3d.
// The n adapters are generated, never committed: directories under a temporary root whose files
// link to the two adapters' (2D and 3D in turn), each registered under its own name, so each is
// its own adapter to the server (its own slot, host cache entry and disk read).
// Prints per (n, alpha): throughput (generated tokens / s), TTFT p50 / p99, the share of
// requests whose TTFT meets --slo-ms, and the ratios to n = 1.
// --first-use K instead: on an idle server with default slots, the TTFT of a 16-token prompt
// (1 new token) for K adapters in turn that are registered but in no slot and no host cache
// (read from disk), and for K unregistered directories named through --adapter-resolver
// filesystem (validated, registered and read), each against the same request for a resident
// adapter just before it; medians.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "bench/bench_args.h"
#include "tests/integration/controller_process.h"
#include "tests/testing/temp_dir.h"

namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

struct Args {
  std::string model = std::string(MOELORA_SOURCE_DIR) + "/.cache/peer-model/model";
  std::string adapters = std::string(MOELORA_SOURCE_DIR) + "/.cache/peer-model";
  std::vector<int> n = {1, 8, 100, 1000};
  std::vector<double> alpha = {1.0, 0.3};
  double rate = 4;  // requests a second
  int requests = 200;
  double slo_ms = 1000;
  uint64_t seed = 1;
  std::string dtype = "bfloat16";
  std::vector<std::string> flags;
  int first_use = 0;
};

struct Arrival {
  double at = 0;  // seconds after the start
  double u = 0;   // uniform draw for the adapter
  int prompt = 0, output = 0;
};

struct Outcome {
  double tok_s = 0, ttft_p50 = 0, ttft_p99 = 0, slo_share = 0;
  double queue_p50 = 0, queue_p99 = 0;  // arrival to admission (the response's timings)
  int failed = 0;
};

double Percentile(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1,
                    static_cast<size_t>(p * static_cast<double>(v.size() - 1) + 0.5))];
}

// One GenerateStream: the time to its first token (-1 when the call failed), its tokens and its
// queue time (the last chunk's timings).
struct Result {
  double ttft = -1, queue = 0;
  int tokens = 0;
};

Result Stream(moelora::testing::ControllerProcess& c, const moelora::v1::GenerateRequest& req,
              int deadline_s) {
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(deadline_s));
  const auto s0 = Clock::now();
  auto reader = c.stub().GenerateStream(&ctx, req);
  moelora::v1::GenerateResponse chunk;
  Result r;
  while (reader->Read(&chunk)) {
    if (r.ttft < 0 && chunk.token_ids_size() > 0)
      r.ttft = std::chrono::duration<double>(Clock::now() - s0).count();
    r.tokens += chunk.token_ids_size();
    if (chunk.has_timings()) r.queue = chunk.timings().queue_seconds();
  }
  if (grpc::Status st = reader->Finish(); !st.ok()) {
    std::fprintf(stderr, "%s: %s\n", req.adapter().c_str(), st.error_message().c_str());
    r.ttft = -1;
  }
  return r;
}

Outcome Run(moelora::testing::ControllerProcess& c, const std::vector<Arrival>& arrivals, int n,
            double alpha, double slo_ms) {
  std::vector<std::future<Result>> fs;
  const auto t0 = Clock::now();
  for (size_t i = 0; i < arrivals.size(); ++i) {
    const Arrival a = arrivals[i];
    std::this_thread::sleep_until(
        t0 + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(a.at)));
    // numpy.random.power(alpha) draws x = U^(1/alpha) on [0, 1].
    const int idx = std::min(n - 1, static_cast<int>(std::pow(a.u, 1.0 / alpha) * n));
    fs.push_back(std::async(std::launch::async, [&c, a, idx, i] {
      moelora::v1::GenerateRequest req;
      req.set_adapter("n" + std::to_string(idx));
      for (int t = 0; t < a.prompt; ++t) req.add_prompt_token_ids(1 + (i * 13 + t * 7) % 4000);
      req.set_max_tokens(a.output);
      req.set_ignore_eos(true);
      return Stream(c, req, 600);
    }));
  }
  std::vector<double> ttft, queue;
  Outcome o;
  int64_t tokens = 0;
  for (auto& f : fs) {
    const Result r = f.get();
    if (r.ttft < 0) {
      ++o.failed;
      continue;
    }
    ttft.push_back(r.ttft);
    queue.push_back(r.queue);
    tokens += r.tokens;
  }
  const double wall = std::chrono::duration<double>(Clock::now() - t0).count();
  o.tok_s = static_cast<double>(tokens) / wall;
  o.ttft_p50 = Percentile(ttft, 0.5);
  o.ttft_p99 = Percentile(ttft, 0.99);
  o.queue_p50 = Percentile(queue, 0.5);
  o.queue_p99 = Percentile(queue, 0.99);
  int met = 0;
  for (double t : ttft) met += t * 1e3 <= slo_ms;
  o.slo_share = ttft.empty() ? 0 : static_cast<double>(met) / static_cast<double>(arrivals.size());
  return o;
}

// TTFT of one streamed request (16 prompt tokens, 1 new token); -1 when it failed.
double OneTtft(moelora::testing::ControllerProcess& c, const std::string& adapter) {
  moelora::v1::GenerateRequest req;
  req.set_adapter(adapter);
  for (int t = 0; t < 16; ++t) req.add_prompt_token_ids(1 + t * 7);
  req.set_max_tokens(1);
  req.set_ignore_eos(true);
  return Stream(c, req, 60).ttft;
}

// --first-use: see the top of the file.
int FirstUse(const Args& a, const std::string& root, const std::string& state) {
  constexpr int kSlots = 16;  // the CPU default of --max-loras
  std::vector<std::string> flags = {"--enable-mixed-moe-lora-format", "--dtype", a.dtype,
                                    "--adapter-resolver", "filesystem"};
  flags.insert(flags.end(), a.flags.begin(), a.flags.end());
  moelora::testing::ControllerProcess c(state, root, flags, a.model);
  if (!c.WaitServing()) {
    std::fprintf(stderr, "controller did not start:\n%s\n", c.Log().c_str());
    return 1;
  }
  // n0..n15 fill the slots; the K after them are registered only.
  for (int i = 0; i < kSlots + a.first_use; ++i) {
    const std::string name = "n" + std::to_string(i);
    if (grpc::Status s = c.Load(name, name); !s.ok()) {
      std::fprintf(stderr, "load %s: %s\n", name.c_str(), s.error_message().c_str());
      return 1;
    }
  }
  std::vector<double> resident, disk, resident2, resolved;
  for (int i = 0; i < a.first_use; ++i) {
    // The most recently used adapter is resident (never the LRU victim of the next swap).
    resident.push_back(OneTtft(c, "n0"));
    disk.push_back(OneTtft(c, "n" + std::to_string(kSlots + i)));
    resident2.push_back(OneTtft(c, "n0"));
    resolved.push_back(OneTtft(c, "n" + std::to_string(kSlots + a.first_use + i)));
  }
  for (const auto* v : {&resident, &disk, &resident2, &resolved}) {
    if (std::count(v->begin(), v->end(), -1.0) > 0) return 1;
  }
  const double r = Percentile(resident, 0.5), d = Percentile(disk, 0.5),
               r2 = Percentile(resident2, 0.5), u = Percentile(resolved, 0.5);
  std::printf("first use, %d adapters each, medians (%s):\n", a.first_use, a.dtype.c_str());
  std::printf("  resident %.1f ms; registered, read from disk %.1f ms: +%.1f ms\n", r * 1e3,
              d * 1e3, (d - r) * 1e3);
  std::printf(
      "  resident %.1f ms; unregistered, through the filesystem resolver %.1f ms: +%.1f ms\n",
      r2 * 1e3, u * 1e3, (u - r2) * 1e3);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&] { return moelora::bench::NextValue(argc, argv, &i); };
    if (f == "--help" || f == "-h") {
      std::printf(
          "slora [--model DIR] [--adapters DIR] [--n 1,8,100,1000] [--alpha 1,0.3] [--rate R]\n"
          "      [--requests N] [--slo-ms S] [--seed K] [--dtype bfloat16] [--flags \"...\"]\n"
          "slora --first-use K [--model DIR] [--adapters DIR] [--dtype D] [--flags \"...\"]\n");
      return 0;
    } else if (f == "--model") {
      a.model = value();
    } else if (f == "--adapters") {
      a.adapters = value();
    } else if (f == "--n") {
      a.n = moelora::bench::PositiveList<int>(value());
    } else if (f == "--alpha") {
      a.alpha = moelora::bench::PositiveList<double>(value());
    } else if (f == "--rate") {
      a.rate = std::atof(value().c_str());
    } else if (f == "--requests") {
      a.requests = std::max(1, std::atoi(value().c_str()));
    } else if (f == "--slo-ms") {
      a.slo_ms = std::atof(value().c_str());
    } else if (f == "--seed") {
      a.seed = static_cast<uint64_t>(std::atoll(value().c_str()));
    } else if (f == "--dtype") {
      a.dtype = value();
    } else if (f == "--flags") {
      a.flags = moelora::bench::Words(value());
    } else if (f == "--first-use") {
      a.first_use = std::max(1, std::atoi(value().c_str()));
    } else {
      std::fprintf(stderr, "unknown flag %s (--help)\n", f.c_str());
      return 2;
    }
  }
  if (a.n.empty() || a.alpha.empty() || a.rate <= 0) return 2;
  std::sort(a.n.begin(), a.n.end());
  // The arrivals: one list for every n and alpha.
  std::mt19937_64 rng(a.seed);
  std::exponential_distribution<double> gap(a.rate);
  std::uniform_real_distribution<double> unit(0, 1);
  std::uniform_int_distribution<int> len(8, 255);
  std::vector<Arrival> arrivals(a.requests);
  double t = 0;
  for (Arrival& x : arrivals) {
    t += gap(rng);
    x.at = t;
    x.u = unit(rng);
    x.prompt = len(rng);
    x.output = len(rng);
  }
  // The generated adapters: n directories of links to the two adapters' files.
  moelora::testing::TempDir root, state;
  const int most = a.first_use > 0 ? 16 + 2 * a.first_use : a.n.back();
  for (int i = 0; i < most; ++i) {
    const fs::path src = fs::path(a.adapters) / (i % 2 == 0 ? "adapter_2d" : "adapter_3d");
    const fs::path dst = fs::path(root.path()) / ("n" + std::to_string(i));
    fs::create_directories(dst);
    for (const auto& e : fs::directory_iterator(src)) {
      fs::create_symlink(fs::absolute(e.path()), dst / e.path().filename());
    }
  }
  if (a.first_use > 0) return FirstUse(a, root.path(), state.path());
  std::vector<std::string> flags = {"--enable-mixed-moe-lora-format", "--dtype", a.dtype,
                                    "--max-num-seqs", "128"};
  flags.insert(flags.end(), a.flags.begin(), a.flags.end());
  moelora::testing::ControllerProcess c(state.path(), root.path(), flags, a.model);
  if (!c.WaitServing()) {
    std::fprintf(stderr, "controller did not start:\n%s\n", c.Log().c_str());
    return 1;
  }
  for (int i = 0; i < most; ++i) {
    const std::string name = "n" + std::to_string(i);
    if (grpc::Status s = c.Load(name, name); !s.ok()) {
      std::fprintf(stderr, "load %s: %s\n", name.c_str(), s.error_message().c_str());
      return 1;
    }
  }
  std::printf(
      "S-LoRA workload: %d requests at %.2f/s (Poisson), lengths uniform [8, 256), %s, "
      "TTFT SLO %.0f ms\n",
      a.requests, a.rate, a.dtype.c_str(), a.slo_ms);
  std::printf(
      "| n | alpha | tok/s | vs n=1 | TTFT p50 | TTFT p99 | vs n=1 | within SLO | queued p50, p99 "
      "| failed |\n");
  std::printf("|---|---|---|---|---|---|---|---|---|---|\n");
  for (double alpha : a.alpha) {
    Outcome base;
    for (int n : a.n) {
      const Outcome o = Run(c, arrivals, n, alpha, a.slo_ms);
      if (n == a.n.front()) base = o;
      std::printf(
          "| %d | %.1f | %.0f | %.2f | %.3f s | %.3f s | %.2f | %.0f %% | %.3f, %.3f s | %d |\n", n,
          alpha, o.tok_s, o.tok_s / std::max(base.tok_s, 1e-9), o.ttft_p50, o.ttft_p99,
          o.ttft_p99 / std::max(base.ttft_p99, 1e-9), 100 * o.slo_share, o.queue_p50, o.queue_p99,
          o.failed);
      std::fflush(stdout);
    }
  }
  return 0;
}
