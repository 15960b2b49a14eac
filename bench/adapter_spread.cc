// bench/adapter_spread: throughput when concurrent requests spread over more adapters than LoRA
// slots, against the same requests on one adapter, in the same run and the same controller.
//   adapter_spread [--model DIR] [--adapters DIR] [--spreads 1,4,8,16] [--concurrent 32]
//                  [--new-tokens 32] [--prompt-tokens 16] [--dtype bfloat16] [--repeat 3]
//                  [--flags "--max-loras 4 ..."]
//   adapter_spread --registry N
//     The registry alone (the tiny test model): N adapters registered (one small adapter's
//     directory under N names, from 8 client threads), then the time ListAdapters takes, and
//     after a restart with that registry, the time until the controller serves and lists them.
// DIR defaults: bench/peer's medium model (.cache/peer-model; tools/peer_venv.sh makes it) and
// its adapter_2d / adapter_3d, registered as 16 names (2D and 3D in turn). Each round sends
// `concurrent` Generate calls at once, call i on adapter i % spread, and times the round; the
// figure is the median round's tokens a second. Run twice in one controller each: admission as
// configured, and with --max-bypass-ms 0 (strict arrival order: a request waiting for a slot
// holds back every request behind it).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <future>
#include <string>
#include <vector>

#include "bench/bench_args.h"
#include "tests/integration/controller_process.h"
#include "tests/testing/temp_dir.h"

namespace {

using Clock = std::chrono::steady_clock;

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

struct Args {
  std::string model = std::string(MOELORA_SOURCE_DIR) + "/.cache/peer-model/model";
  std::string adapters = std::string(MOELORA_SOURCE_DIR) + "/.cache/peer-model";
  std::vector<int> spreads = {1, 4, 8, 16};
  int concurrent = 32, new_tokens = 32, prompt_tokens = 16, repeat = 3;
  std::string dtype = "bfloat16";
  std::vector<std::string> flags;
};

// Median tokens a second of `repeat` rounds (after one warm-up round) at each spread.
std::vector<double> Run(const Args& a, const std::vector<std::string>& extra) {
  moelora::testing::TempDir state;
  std::vector<std::string> flags = {"--enable-mixed-moe-lora-format", "--dtype", a.dtype,
                                    "--max-num-seqs", std::to_string(std::max(64, a.concurrent))};
  flags.insert(flags.end(), a.flags.begin(), a.flags.end());
  flags.insert(flags.end(), extra.begin(), extra.end());
  moelora::testing::ControllerProcess c(state.path(), a.adapters, flags, a.model);
  if (!c.WaitServing()) {
    std::fprintf(stderr, "controller did not start:\n%s\n", c.Log().c_str());
    std::exit(1);
  }
  const int most = *std::max_element(a.spreads.begin(), a.spreads.end());
  std::vector<std::string> names;
  for (int i = 0; i < most; ++i) {
    names.push_back("s" + std::to_string(i));
    grpc::Status s = c.Load(names.back(), i % 2 == 0 ? "adapter_2d" : "adapter_3d");
    if (!s.ok()) {
      std::fprintf(stderr, "load %s: %s\n", names.back().c_str(), s.error_message().c_str());
      std::exit(1);
    }
  }
  std::vector<double> out;
  for (int spread : a.spreads) {
    std::vector<double> rates;
    for (int r = 0; r <= a.repeat; ++r) {
      std::vector<std::future<bool>> fs;
      const auto t0 = Clock::now();
      for (int i = 0; i < a.concurrent; ++i) {
        fs.push_back(std::async(std::launch::async, [&, i] {
          std::vector<int32_t> prompt(a.prompt_tokens);
          for (int t = 0; t < a.prompt_tokens; ++t) prompt[t] = 1 + (i * 31 + t * 7) % 1000;
          moelora::v1::GenerateRequest req;
          req.set_adapter(names[i % spread]);
          req.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
          req.set_max_tokens(a.new_tokens);
          req.set_ignore_eos(true);
          moelora::v1::GenerateResponse resp;
          return c.Generate(req, &resp).ok();
        }));
      }
      for (auto& f : fs) {
        if (!f.get()) {
          std::fprintf(stderr, "a request failed:\n%s\n", c.Log().c_str());
          std::exit(1);
        }
      }
      const double s = std::chrono::duration<double>(Clock::now() - t0).count();
      if (r > 0) rates.push_back(a.concurrent * a.new_tokens / s);
    }
    out.push_back(Median(rates));
  }
  return out;
}

double Since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

int Registry(int n) {
  moelora::testing::TempDir state;
  const std::vector<std::string> flags = {"--enable-mixed-moe-lora-format",
                                          "--max-registered-adapters", std::to_string(n)};
  double load_s = 0, list_s = 0;
  {
    moelora::testing::ControllerProcess c(state.path(), MOELORA_TEST_DATA_DIR, flags);
    if (!c.WaitServing()) return 1;
    const auto t0 = Clock::now();
    std::vector<std::future<bool>> fs;
    for (int t = 0; t < 8; ++t) {
      fs.push_back(std::async(std::launch::async, [&, t] {
        for (int i = t; i < n; i += 8) {
          if (!c.Load("r" + std::to_string(i), "qwen3_moe/adapter_2d").ok()) return false;
        }
        return true;
      }));
    }
    for (auto& f : fs) {
      if (!f.get()) {
        std::fprintf(stderr, "a load failed:\n%s\n", c.Log().c_str());
        return 1;
      }
    }
    load_s = Since(t0);
    const auto t1 = Clock::now();
    if (static_cast<int>(c.List().size()) != n) return 1;
    list_s = Since(t1);
  }
  const auto t2 = Clock::now();
  moelora::testing::ControllerProcess c(state.path(), MOELORA_TEST_DATA_DIR, flags);
  if (!c.WaitServing()) return 1;
  const double serve_s = Since(t2);
  const auto t3 = Clock::now();
  const size_t listed = c.List().size();
  const double relist_s = Since(t3);
  std::printf(
      "registry: %d adapters registered in %.1f s (%.2f ms each, 8 clients); ListAdapters %.3f s;"
      " after a restart: serving in %.2f s, ListAdapters %.3f s (%zu listed)\n",
      n, load_s, 1e3 * load_s / n, list_s, serve_s, relist_s, listed);
  return static_cast<int>(listed) == n ? 0 : 1;
}

}  // namespace

int main(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    auto value = [&] { return moelora::bench::NextValue(argc, argv, &i); };
    if (f == "--help" || f == "-h") {
      std::printf(
          "adapter_spread [--model DIR] [--adapters DIR] [--spreads 1,4,8,16] [--concurrent 32]\n"
          "               [--new-tokens 32] [--prompt-tokens 16] [--dtype bfloat16] [--repeat 3]\n"
          "               [--flags \"--max-loras 4 ...\"]\n"
          "adapter_spread --registry N\n");
      return 0;
    } else if (f == "--registry") {
      return Registry(std::max(1, std::atoi(value().c_str())));
    } else if (f == "--model") {
      a.model = value();
    } else if (f == "--adapters") {
      a.adapters = value();
    } else if (f == "--spreads") {
      a.spreads = moelora::bench::PositiveList<int>(value());
    } else if (f == "--concurrent") {
      a.concurrent = std::max(1, std::atoi(value().c_str()));
    } else if (f == "--new-tokens") {
      a.new_tokens = std::max(1, std::atoi(value().c_str()));
    } else if (f == "--prompt-tokens") {
      a.prompt_tokens = std::max(1, std::atoi(value().c_str()));
    } else if (f == "--dtype") {
      a.dtype = value();
    } else if (f == "--repeat") {
      a.repeat = std::max(1, std::atoi(value().c_str()));
    } else if (f == "--flags") {
      a.flags = moelora::bench::Words(value());
    } else {
      std::fprintf(stderr, "unknown flag %s (--help)\n", f.c_str());
      return 2;
    }
  }
  if (a.spreads.empty()) return 2;
  const std::vector<double> bypass = Run(a, {});
  const std::vector<double> strict = Run(a, {"--max-bypass-ms", "0"});
  std::printf("%d concurrent requests (%d prompt + %d new tokens), %s, median of %d rounds\n",
              a.concurrent, a.prompt_tokens, a.new_tokens, a.dtype.c_str(), a.repeat);
  std::printf("| adapters | tok/s | vs 1 adapter | strict arrival order tok/s | vs 1 adapter |\n");
  std::printf("|---|---|---|---|---|\n");
  for (size_t k = 0; k < a.spreads.size(); ++k) {
    std::printf("| %d | %.0f | %.2f | %.0f | %.2f |\n", a.spreads[k], bypass[k],
                bypass[k] / bypass[0], strict[k], strict[k] / strict[0]);
  }
  return 0;
}
