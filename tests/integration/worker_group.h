// Real moelora-worker processes on loopback, driven over gRPC as the controller drives them:
// every RPC goes to all ranks, Steps concurrently (ranks meet in collectives).
#ifndef MOELORA_TESTS_INTEGRATION_WORKER_GROUP_H_
#define MOELORA_TESTS_INTEGRATION_WORKER_GROUP_H_

#include <grpcpp/grpcpp.h>

#include <cstdlib>
#include <future>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "gtest/gtest.h"
#include "moelora/v1/worker.grpc.pb.h"
#include "nlohmann/json.hpp"
#include "tests/testing/process.h"
#include "tests/testing/temp_dir.h"

namespace moelora::testing {

class WorkerGroup {
 public:
  WorkerGroup(const std::string& model_dir, int tp, std::vector<std::string> extra_flags = {}) {
    const std::string dist = dir_.path() + "/dist";
    std::filesystem::create_directories(dist);
    for (int r = 0; r < tp; ++r) {
      const std::string pf = dir_.path() + "/port." + std::to_string(r);
      // MOELORA_WORKER_BIN in the environment wins (sanitizer trees use a release worker).
      const char* env_bin = std::getenv("MOELORA_WORKER_BIN");
      std::vector<std::string> argv = {env_bin ? env_bin : MOELORA_WORKER_BIN, "--model", model_dir,
                                       "--rank", std::to_string(r), "--tensor-parallel-size",
                                       std::to_string(tp), "--dist-init-dir", dist, "--port-file",
                                       pf, "--dist-timeout-s", "60",
                                       // Tests stage fixtures and temporary directories alike;
                                       // a test of the root passes its own after this one.
                                       "--adapter-root", "/"};
      argv.insert(argv.end(), extra_flags.begin(), extra_flags.end());
      // MOELORA_TEST_WORKER_FLAGS (space-separated) is appended: kernels/gpu_check.sh runs the TP
      // tests with "--device cuda".
      if (const char* more = std::getenv("MOELORA_TEST_WORKER_FLAGS")) {
        std::istringstream in(more);
        for (std::string f; in >> f;) argv.push_back(f);
      }
      procs_.push_back(
          std::make_unique<ChildProcess>(argv, dir_.path() + "/log." + std::to_string(r)));
    }
    for (int r = 0; r < tp; ++r) {
      const std::string text = WaitForFile(dir_.path() + "/port." + std::to_string(r),
                                           std::chrono::seconds(30), procs_[r].get());
      if (text.empty()) return;
      auto j = nlohmann::json::parse(text);
      ports_.push_back(j["port"].get<int>());
      metrics_ports_.push_back(j["metrics_port"].get<int>());
      stubs_.push_back(v1::Worker::NewStub(grpc::CreateChannel(
          "127.0.0.1:" + std::to_string(ports_.back()), grpc::InsecureChannelCredentials())));
    }
  }

  // Waits until every rank reports ready.
  bool WaitReady(std::chrono::seconds timeout = std::chrono::seconds(60)) {
    if (stubs_.size() != procs_.size()) return false;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (auto& stub : stubs_) {
      while (true) {
        grpc::ClientContext ctx;
        v1::WorkerHealthResponse resp;
        if (stub->Health(&ctx, {}, &resp).ok() && resp.ready()) break;
        if (std::chrono::steady_clock::now() > deadline) return false;
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
      }
    }
    return true;
  }

  int size() const { return static_cast<int>(stubs_.size()); }
  v1::Worker::Stub& stub(int r) { return *stubs_[r]; }
  int metrics_port(int r) const { return metrics_ports_[r]; }
  int port(int r) const { return ports_[r]; }
  ChildProcess& process(int r) { return *procs_[r]; }
  std::string Logs() {
    std::string s;
    for (size_t r = 0; r < procs_.size(); ++r)
      s += "--- rank " + std::to_string(r) + "\n" + procs_[r]->Log();
    return s;
  }

  // Stage on all ranks, then commit on all (the controller's atomic load, without rollback).
  grpc::Status Load(int64_t id, const std::string& path,
                    v1::AdapterFormat format = v1::FORMAT_UNSPECIFIED,
                    v1::StageAdapterResponse* out = nullptr) {
    for (auto& stub : stubs_) {
      grpc::ClientContext ctx;
      v1::StageAdapterRequest req;
      req.set_adapter_id(id);
      req.set_name("a" + std::to_string(id));
      req.set_path(path);
      req.set_format(format);
      v1::StageAdapterResponse resp;
      grpc::Status s = stub->StageAdapter(&ctx, req, &resp);
      if (!s.ok()) return s;
      if (out) *out = resp;
    }
    for (auto& stub : stubs_) {
      grpc::ClientContext ctx;
      v1::CommitAdapterRequest req;
      req.set_adapter_id(id);
      v1::CommitAdapterResponse resp;
      grpc::Status s = stub->CommitAdapter(&ctx, req, &resp);
      if (!s.ok()) return s;
    }
    return grpc::Status::OK;
  }

  // Sends the step to every rank at once; returns rank 0's reply and checks the ranks agree.
  grpc::Status Step(const v1::StepRequest& req, v1::StepResponse* out) {
    std::vector<std::future<std::pair<grpc::Status, v1::StepResponse>>> fs;
    for (auto& stub : stubs_) {
      v1::Worker::Stub* s = stub.get();
      fs.push_back(std::async(std::launch::async, [s, req] {
        grpc::ClientContext ctx;
        ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
        v1::StepResponse resp;
        grpc::Status st = s->Step(&ctx, req, &resp);
        return std::make_pair(st, resp);
      }));
    }
    std::vector<std::pair<grpc::Status, v1::StepResponse>> rs;
    for (auto& f : fs) rs.push_back(f.get());
    for (size_t r = 1; r < rs.size(); ++r) {
      EXPECT_EQ(rs[r].first.error_code(), rs[0].first.error_code()) << "rank " << r;
      if (!rs[r].first.ok() || !rs[0].first.ok()) continue;
      EXPECT_EQ(rs[r].second.tokens_size(), rs[0].second.tokens_size());
      for (int i = 0; i < std::min(rs[r].second.tokens_size(), rs[0].second.tokens_size()); ++i) {
        EXPECT_EQ(rs[r].second.tokens(i).token_id(), rs[0].second.tokens(i).token_id())
            << "rank " << r << " disagrees with rank 0";
      }
    }
    *out = rs[0].second;
    return rs[0].first;
  }

 private:
  TempDir dir_;
  std::vector<std::unique_ptr<ChildProcess>> procs_;
  std::vector<int> ports_, metrics_ports_;
  std::vector<std::unique_ptr<v1::Worker::Stub>> stubs_;
};

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_INTEGRATION_WORKER_GROUP_H_
