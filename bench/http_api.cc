// bench/http_api: the OpenAI-compatible HTTP API's cost against gRPC, in one run on one
// controller: C concurrent clients x M requests (greedy, ignore_eos, the same prompt ids and
// max_tokens, adapters a2d and base in turn) through Generate (gRPC) and through
// /v1/completions (HTTP/1.1 keep-alive, libcurl), unary and streamed (GenerateStream vs
// server-sent events); the modes alternate, R rounds each, and the medians' ratio is printed.
// Generated tokens per second count what each client received. The clients start each request
// together (a barrier per wave), so both protocols meet the same batches: without it, how 32
// clients' arrivals happen to fall into steps moved single rounds by 0.65–1.49x either way.
//
//   http_api [--clients 1,32] [--requests M] [--max-tokens T] [--rounds R] [--model DIR]
//            [--flags "controller flags"]
#include <curl/curl.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <future>
#include <map>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/str_split.h"
#include "nlohmann/json.hpp"
#include "tests/integration/controller_process.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using Clock = std::chrono::steady_clock;
double Sec(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

const std::vector<int32_t> kPrompt = {1, 17, 42, 5, 88, 3, 9, 27, 61, 14, 7, 99};

size_t Append(char* data, size_t size, size_t n, void* out) {
  static_cast<std::string*>(out)->append(data, size * n);
  return size * n;
}

// One HTTP client: a curl handle whose connection is kept alive between requests.
class HttpClient {
 public:
  explicit HttpClient(int port)
      : url_("http://127.0.0.1:" + std::to_string(port) + "/v1/completions") {
    curl_ = curl_easy_init();
    headers_ = curl_slist_append(nullptr, "Content-Type: application/json");
    curl_easy_setopt(curl_, CURLOPT_URL, url_.c_str());
    curl_easy_setopt(curl_, CURLOPT_HTTPHEADER, headers_);
    curl_easy_setopt(curl_, CURLOPT_WRITEFUNCTION, &Append);
    curl_easy_setopt(curl_, CURLOPT_TCP_NODELAY, 1L);
  }
  ~HttpClient() {
    curl_slist_free_all(headers_);
    curl_easy_cleanup(curl_);
  }
  // Generated tokens received (usage.completion_tokens, or the stream's text chunks counted
  // through its final usage); -1 on an error.
  int Complete(const std::string& model, int max_tokens, bool stream) {
    nlohmann::json body = {{"model", model},   {"prompt", kPrompt},  {"max_tokens", max_tokens},
                           {"temperature", 0}, {"ignore_eos", true}, {"stream", stream}};
    if (stream) body["stream_options"] = {{"include_usage", true}};
    const std::string text = body.dump();
    std::string out;
    curl_easy_setopt(curl_, CURLOPT_POSTFIELDS, text.c_str());
    curl_easy_setopt(curl_, CURLOPT_WRITEDATA, &out);
    if (curl_easy_perform(curl_) != CURLE_OK) return -1;
    long code = 0;
    curl_easy_getinfo(curl_, CURLINFO_RESPONSE_CODE, &code);
    if (code != 200) return -1;
    std::string usage = out;
    if (stream) {  // the last event before [DONE] carries the usage
      const size_t done = out.rfind("data: [DONE]");
      const size_t last = out.rfind("data: {", done);
      if (done == std::string::npos || last == std::string::npos) return -1;
      usage = out.substr(last + 6, done - last - 6);
    }
    const nlohmann::json j = nlohmann::json::parse(usage, nullptr, false);
    if (j.is_discarded() || !j.contains("usage") || !j["usage"].is_object()) return -1;
    return j["usage"]["completion_tokens"].get<int>();
  }

 private:
  std::string url_;
  CURL* curl_;
  curl_slist* headers_;
};

// Every client waits here before each request (std::barrier is C++20).
class Barrier {
 public:
  explicit Barrier(int n) : n_(n) {}
  void Wait() {
    std::unique_lock<std::mutex> l(mu_);
    const int gen = gen_;
    if (++waiting_ == n_) {
      waiting_ = 0;
      ++gen_;
      cv_.notify_all();
      return;
    }
    cv_.wait(l, [&] { return gen_ != gen; });
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  const int n_;
  int waiting_ = 0, gen_ = 0;
};

int GrpcComplete(testing::ControllerProcess& c, const std::string& adapter, int max_tokens,
                 bool stream) {
  v1::GenerateRequest req;
  req.set_adapter(adapter);
  req.mutable_prompt_token_ids()->Add(kPrompt.begin(), kPrompt.end());
  req.set_max_tokens(max_tokens);
  req.set_ignore_eos(true);
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(300));
  if (!stream) {
    v1::GenerateResponse r;
    if (!c.stub().Generate(&ctx, req, &r).ok()) return -1;
    return r.token_ids_size();
  }
  auto reader = c.stub().GenerateStream(&ctx, req);
  v1::GenerateResponse r;
  int n = 0;
  while (reader->Read(&r)) n += r.token_ids_size();
  return reader->Finish().ok() ? n : -1;
}

}  // namespace
}  // namespace moelora

int main(int argc, char** argv) {
  using namespace moelora;
  std::vector<int> clients = {1, 32};
  int requests = 8, max_tokens = 32, rounds = 3;
  std::string model = "qwen3_moe/model", extra;
  const char* kUsage =
      "usage: http_api [--clients 1,32] [--requests M] [--max-tokens T] [--rounds R] "
      "[--model DIR] [--flags \"controller flags\"]\n";
  for (int i = 1; i < argc; ++i) {
    const std::string f = argv[i];
    if (f == "--help") {
      std::printf("%s", kUsage);
      return 0;
    }
    if (i + 1 >= argc) {
      std::fprintf(stderr, "%s", kUsage);
      return 2;
    }
    const std::string v = argv[++i];
    if (f == "--clients") {
      clients.clear();
      for (auto p : absl::StrSplit(v, ',')) clients.push_back(std::atoi(std::string(p).c_str()));
    } else if (f == "--requests") {
      requests = std::atoi(v.c_str());
    } else if (f == "--max-tokens") {
      max_tokens = std::atoi(v.c_str());
    } else if (f == "--rounds") {
      rounds = std::atoi(v.c_str());
    } else if (f == "--model") {
      model = v;
    } else if (f == "--flags") {
      extra = v;
    } else {
      std::fprintf(stderr, "%s", kUsage);
      return 2;
    }
  }
  curl_global_init(CURL_GLOBAL_DEFAULT);
  const bool tiny = model == "qwen3_moe/model";
  std::vector<std::string> flags = {"--http-port",    "0", "--served-model-name", "base",
                                    "--max-num-seqs", "64"};
  if (tiny) flags.push_back("--enable-mixed-moe-lora-format");
  for (auto f : absl::StrSplit(extra, ' ', absl::SkipEmpty())) flags.emplace_back(f);
  moelora::testing::TempDir state;
  moelora::testing::ControllerProcess c(state.path(), MOELORA_TEST_DATA_DIR, flags, model);
  if (!c.WaitServing() || c.http_port() < 0) {
    std::fprintf(stderr, "controller did not start:\n%s\n", c.Log().c_str());
    return 1;
  }
  std::vector<std::string> adapters = {""};
  if (tiny) {
    if (!c.Load("a2d", "qwen3_moe/adapter_2d").ok()) return 1;
    adapters = {"a2d", ""};
  }
  // One round of one mode: tokens per second over all clients.
  auto run = [&](bool http, bool stream, int n_clients) {
    std::vector<std::future<int>> fs;
    Barrier wave(n_clients);
    const auto t0 = Clock::now();
    for (int k = 0; k < n_clients; ++k) {
      fs.push_back(std::async(std::launch::async, [&, k] {
        HttpClient client(c.http_port());
        int tokens = 0;
        for (int i = 0; i < requests; ++i) {
          wave.Wait();
          const std::string& a = adapters[(k + i) % adapters.size()];
          const int n = http ? client.Complete(a.empty() ? "base" : a, max_tokens, stream)
                             : GrpcComplete(c, a, max_tokens, stream);
          if (n != max_tokens) {
            std::fprintf(stderr, "%s request got %d tokens\n", http ? "HTTP" : "gRPC", n);
            std::abort();
          }
          tokens += n;
        }
        return tokens;
      }));
    }
    int tokens = 0;
    for (auto& f : fs) tokens += f.get();
    return tokens / Sec(Clock::now() - t0);
  };
  std::printf("http_api: %s, %d requests per client, %d new tokens each (greedy, ignore_eos), %s\n",
              model.c_str(), requests, max_tokens, tiny ? "adapters a2d and base in turn" : "base");
  run(false, false, clients.back());  // warm-up
  run(true, false, clients.back());
  for (bool stream : {false, true}) {
    for (int n : clients) {
      std::vector<double> grpc_tps, http_tps, ratios;
      for (int r = 0; r < rounds; ++r) {
        // Alternate which goes first.
        const bool http_first = r % 2 == 1;
        const double a = run(http_first, stream, n);
        const double b = run(!http_first, stream, n);
        const double g = http_first ? b : a, h = http_first ? a : b;
        grpc_tps.push_back(g);
        http_tps.push_back(h);
        ratios.push_back(h / g);
      }
      std::printf(
          "  %-8s %2d clients: gRPC %8.0f tok/s  HTTP %8.0f tok/s  HTTP/gRPC %.3f "
          "(median of %d rounds; per round",
          stream ? "stream" : "unary", n, Median(grpc_tps), Median(http_tps), Median(ratios),
          rounds);
      for (double x : ratios) std::printf(" %.3f", x);
      std::printf(")\n");
    }
  }
  curl_global_cleanup();
  return 0;
}
