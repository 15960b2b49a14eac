// moelora-controller as a real process on loopback (it spawns real workers), with a public-API
// stub, a health client and the /metrics text.
#ifndef MOELORA_TESTS_INTEGRATION_CONTROLLER_PROCESS_H_
#define MOELORA_TESTS_INTEGRATION_CONTROLLER_PROCESS_H_

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <vector>

#include "grpc/health/v1/health.grpc.pb.h"
#include "moelora/v1/controller.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/testing/http_get.h"
#include "tests/testing/process.h"

namespace moelora::testing {

inline std::string ControllerBin() {
  const char* env = std::getenv("MOELORA_CONTROLLER_BIN");
  return env ? env : MOELORA_CONTROLLER_BIN;
}
inline std::string WorkerBin() {
  const char* env = std::getenv("MOELORA_WORKER_BIN");
  return env ? env : MOELORA_WORKER_BIN;
}

class ControllerProcess {
 public:
  ControllerProcess(const std::string& state_dir, const std::string& adapter_root,
                    std::vector<std::string> flags, const std::string& model = "qwen3_moe/model") {
    const std::string pf = state_dir + "/port.json";
    std::filesystem::create_directories(state_dir);
    std::filesystem::remove(pf);
    std::vector<std::string> argv = {
        ControllerBin(),
        "--model",
        model.rfind('/', 0) == 0 ? model : std::string(MOELORA_TEST_DATA_DIR) + "/" + model,
        "--adapter-root",
        adapter_root,
        "--state-dir",
        state_dir,
        "--port",
        "0",
        "--metrics-port",
        "0",
        "--port-file",
        pf,
        "--worker-bin",
        WorkerBin(),
        "--drain-timeout-s",
        "20"};
    argv.insert(argv.end(), flags.begin(), flags.end());
    proc_ = std::make_unique<ChildProcess>(argv, state_dir + "/controller.log");
    // A backstop, not a timing: a loaded machine may take long to start a process.
    const std::string text = WaitForFile(pf, std::chrono::seconds(120), proc_.get());
    if (text.empty()) return;
    auto j = nlohmann::json::parse(text);
    port_ = j["port"].get<int>();
    metrics_port_ = j["metrics_port"].get<int>();
    http_port_ = j.value("http_port", -1);
    auto channel = grpc::CreateChannel("127.0.0.1:" + std::to_string(port_),
                                       grpc::InsecureChannelCredentials());
    stub_ = v1::Controller::NewStub(channel);
    health_ = grpc::health::v1::Health::NewStub(channel);
  }

  bool started() const { return stub_ != nullptr; }
  v1::Controller::Stub& stub() { return *stub_; }
  int port() const { return port_; }
  int http_port() const { return http_port_; }  // -1 without --http-port
  ChildProcess& process() { return *proc_; }
  std::string Metrics() const { return HttpGet(metrics_port_, "/metrics"); }
  std::string Log() const { return proc_->Log(); }

  // grpc.health.v1 status of the whole server ("" service).
  int Health() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(2));
    grpc::health::v1::HealthCheckResponse resp;
    if (!health_->Check(&ctx, {}, &resp).ok()) return -1;
    return resp.status();
  }
  // False at once when the controller never wrote its port file or has exited (its log says
  // why), instead of waiting out the timeout.
  bool WaitHealth(int want, std::chrono::seconds timeout = std::chrono::seconds(120)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    while (std::chrono::steady_clock::now() < deadline) {
      if (!stub_ || proc_->WaitExit(std::chrono::milliseconds(0)) >= 0) return false;
      if (Health() == want) return true;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
    }
    return false;
  }
  bool WaitServing() { return WaitHealth(grpc::health::v1::HealthCheckResponse::SERVING); }

  grpc::Status Load(const std::string& name, const std::string& path, v1::Adapter* out = nullptr,
                    v1::AdapterFormat format = v1::FORMAT_UNSPECIFIED) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::LoadAdapterRequest req;
    req.set_name(name);
    req.set_path(path);
    req.set_format(format);
    v1::Adapter a;
    grpc::Status s = stub_->LoadAdapter(&ctx, req, &a);
    if (out) *out = a;
    return s;
  }
  grpc::Status Unload(const std::string& name) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    v1::UnloadAdapterRequest req;
    req.set_name(name);
    v1::UnloadAdapterResponse resp;
    return stub_->UnloadAdapter(&ctx, req, &resp);
  }
  std::vector<v1::Adapter> List() {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(10));
    v1::ListAdaptersResponse resp;
    stub_->ListAdapters(&ctx, {}, &resp);
    return {resp.adapters().begin(), resp.adapters().end()};
  }
  grpc::Status Generate(const std::string& adapter, const std::vector<int32_t>& prompt,
                        int max_tokens, v1::GenerateResponse* out, bool logprobs = false,
                        std::chrono::seconds deadline = std::chrono::seconds(60)) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + deadline);
    v1::GenerateRequest req;
    req.set_adapter(adapter);
    req.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
    req.set_max_tokens(max_tokens);
    req.set_return_logprobs(logprobs);
    return stub_->Generate(&ctx, req, out);
  }
  grpc::Status Generate(const v1::GenerateRequest& req, v1::GenerateResponse* out) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    return stub_->Generate(&ctx, req, out);
  }
  // A GenerateStream call that has sent its first tokens: the request runs on the workers, so
  // a test acts on a running request without guessing how long it takes to start.
  class RunningStream {
   public:
    // Starts the call and reads its first chunk; false when there is none.
    bool Start(v1::Controller::Stub& stub, const v1::GenerateRequest& req) {
      ctx_.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(120));
      reader_ = stub.GenerateStream(&ctx_, req);
      return Next();
    }
    // Reads to the end; the call's status.
    grpc::Status Finish() {
      while (Next()) {
      }
      return reader_->Finish();
    }
    void Cancel() { ctx_.TryCancel(); }
    const std::vector<int32_t>& tokens() const { return tokens_; }

   private:
    bool Next() {
      v1::GenerateResponse chunk;
      if (!reader_->Read(&chunk)) return false;
      tokens_.insert(tokens_.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      return true;
    }
    grpc::ClientContext ctx_;
    std::unique_ptr<grpc::ClientReader<v1::GenerateResponse>> reader_;
    std::vector<int32_t> tokens_;
  };
  std::unique_ptr<RunningStream> StartStream(const std::string& adapter,
                                             const std::vector<int32_t>& prompt, int max_tokens) {
    v1::GenerateRequest req;
    req.set_adapter(adapter);
    req.mutable_prompt_token_ids()->Add(prompt.begin(), prompt.end());
    req.set_max_tokens(max_tokens);
    auto s = std::make_unique<RunningStream>();
    if (!s->Start(*stub_, req)) return nullptr;
    return s;
  }
  // GenerateStream's chunks (the last one carries finish_reason and usage).
  grpc::Status Stream(const v1::GenerateRequest& req, std::vector<v1::GenerateResponse>* chunks) {
    grpc::ClientContext ctx;
    ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
    auto reader = stub_->GenerateStream(&ctx, req);
    v1::GenerateResponse chunk;
    while (reader->Read(&chunk)) chunks->push_back(chunk);
    return reader->Finish();
  }

 private:
  std::unique_ptr<ChildProcess> proc_;
  int port_ = 0, metrics_port_ = 0, http_port_ = -1;
  std::unique_ptr<v1::Controller::Stub> stub_;
  std::unique_ptr<grpc::health::v1::Health::Stub> health_;
};

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_INTEGRATION_CONTROLLER_PROCESS_H_
