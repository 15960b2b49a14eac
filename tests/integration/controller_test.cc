// moelora-controller end to end: real controller and worker processes on loopback, public API
// only. Bounded waits everywhere.
#include <signal.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>

#include "absl/strings/str_join.h"
#include "common/utf8.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/integration/controller_process.h"
#include "tests/integration/worker_group.h"
#include "tests/testing/adapter_builder.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/worker/engine_test_util.h"
#include "tokenizer/tokenizer.h"

namespace moelora {
namespace {

namespace fs = std::filesystem;
using ::moelora::testing::ControllerProcess;
using ::moelora::testing::Data;
using ::moelora::testing::ReadExpected;
using ::moelora::testing::TempDir;
using ::testing::HasSubstr;
using ::testing::Not;
using Health = grpc::health::v1::HealthCheckResponse;

// An adapter root with copies of the fixtures and a few bad adapters.
struct AdapterRoot {
  TempDir dir;
  std::string root;
  AdapterRoot() {
    root = dir.path() + "/adapters";
    fs::create_directories(root);
    for (const char* a : {"adapter_2d", "adapter_3d", "adapter_2d_shared_a", "adapter_3d_as_2d"}) {
      fs::copy(Data(std::string("qwen3_moe/") + a), root + "/" + a, fs::copy_options::recursive);
    }
    fs::copy(Data("gpt_oss/adapter_3d"), root + "/gpt_oss_3d", fs::copy_options::recursive);
    for (const char* a : {"adapter_2d", "adapter_3d"}) {
      fs::copy(Data(std::string("qwen3_5_moe/") + a), root + "/q35_" + a,
               fs::copy_options::recursive);
      fs::copy(Data(std::string("step3p5/") + a), root + "/s35_" + a, fs::copy_options::recursive);
    }
    fs::create_directories(root + "/pickle_only");
    fs::copy_file(Data("qwen3_moe/adapter_2d/adapter_config.json"),
                  root + "/pickle_only/adapter_config.json");
    std::ofstream(root + "/pickle_only/adapter_model.bin") << "not really a pickle";
    fs::create_directories(root + "/garbage");
    fs::copy_file(Data("qwen3_moe/adapter_2d/adapter_config.json"),
                  root + "/garbage/adapter_config.json");
    std::ofstream(root + "/garbage/adapter_model.safetensors")
        << "\x10\x00\x00\x00\x00\x00\x00\x00{not json";
    // An adapter for another model (hidden size 32, not 24) and one of rank 8.
    {
      ::moelora::testing::AdapterBuilder b;
      b.Pair("model.layers.0.self_attn.q_proj", 2, 32, 32);
      b.Write(root + "/other_model");
    }
    {
      ::moelora::testing::AdapterBuilder b;
      b.config()["r"] = 8;
      b.Pair("model.layers.0.self_attn.q_proj", 8, 24, 32);
      b.Write(root + "/big_rank");
    }
    fs::create_directories(dir.path() + "/outside");
    fs::copy(Data("qwen3_moe/adapter_2d"), dir.path() + "/outside/a", fs::copy_options::recursive);
    fs::create_directory_symlink(dir.path() + "/outside/a", root + "/escape");
  }
};

const std::vector<std::vector<int32_t>> kPrompts = {
    {1, 17, 42, 5, 88}, {3, 9, 27, 81, 50, 11, 60}, {7, 2, 95}};

int32_t Argmax(const std::vector<float>& logits, size_t row, size_t vocab) {
  const float* r = logits.data() + row * vocab;
  return static_cast<int32_t>(std::max_element(r, r + vocab) - r);
}

std::vector<int32_t> Tokens(const v1::GenerateResponse& r) {
  return {r.token_ids().begin(), r.token_ids().end()};
}

class ControllerTest : public ::testing::Test {
 protected:
  AdapterRoot adapters_;
  TempDir state_;
};

TEST_F(ControllerTest, EndToEndMixedAdaptersAtTp2) {
  ControllerProcess c(state_.path(), adapters_.root,
                      {"--tensor-parallel-size", "2", "--enable-mixed-moe-lora-format"});
  ASSERT_TRUE(c.started()) << c.Log();
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  // Base outputs before any adapter exists.
  std::vector<std::vector<int32_t>> base_before;
  for (const auto& p : kPrompts) {
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate("", p, 8, &r).ok());
    base_before.push_back(Tokens(r));
    EXPECT_EQ(r.finish_reason(), "length");
    EXPECT_EQ(r.usage().completion_tokens(), 8);
  }
  v1::Adapter a2d, a3d;
  ASSERT_TRUE(c.Load("a2d", "adapter_2d", &a2d).ok());
  ASSERT_TRUE(c.Load("a3d", "adapter_3d", &a3d).ok());
  EXPECT_EQ(a2d.detected_format(), v1::FORMAT_2D);
  EXPECT_FALSE(a2d.converted_to_2d());
  EXPECT_EQ(a3d.detected_format(), v1::FORMAT_3D);
  EXPECT_TRUE(a3d.converted_to_2d());
  EXPECT_EQ(a3d.rank(), 4);
  EXPECT_DOUBLE_EQ(a3d.scaling(), 2.0);
  EXPECT_EQ(a3d.state(), v1::ADAPTER_STATE_READY);
  EXPECT_GT(a3d.load_seconds(), 0);
  EXPECT_THAT(std::vector<std::string>(a3d.target_modules().begin(), a3d.target_modules().end()),
              ::testing::ElementsAre("experts", "o_proj", "q_proj"));

  // One at a time; the first token is the argmax of transformers+PEFT's logits.
  auto ref = ReadExpected(Data("qwen3_moe/expected_logits.safetensors"));
  const std::vector<std::string> names = {"a2d", "a3d", ""};
  const std::vector<std::string> variants = {"adapter_2d", "adapter_3d", "base"};
  std::vector<std::vector<int32_t>> alone;
  for (size_t i = 0; i < names.size(); ++i) {
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate(names[i], kPrompts[i], 8, &r, true).ok());
    alone.push_back(Tokens(r));
    ASSERT_EQ(r.logprobs_size(), 8);
    for (float lp : r.logprobs()) EXPECT_LE(lp, 0.0f);
    const auto& logits = ref.logits.at(variants[i])[i];
    EXPECT_EQ(alone.back()[0],
              Argmax(logits, kPrompts[i].size() - 1, logits.size() / kPrompts[i].size()))
        << names[i];
  }
  EXPECT_EQ(alone[2], base_before[2]);  // base unchanged by the loaded adapters
  EXPECT_NE(alone[0], base_before[0]);  // the adapters do change their outputs
  // Concurrently, several rounds: same tokens as alone.
  for (int round = 0; round < 3; ++round) {
    std::vector<std::future<std::vector<int32_t>>> fs;
    for (size_t i = 0; i < names.size(); ++i) {
      fs.push_back(std::async(std::launch::async, [&, i] {
        v1::GenerateResponse r;
        grpc::Status s = c.Generate(names[i], kPrompts[i], 8, &r);
        EXPECT_TRUE(s.ok()) << s.error_message();
        return Tokens(r);
      }));
    }
    for (size_t i = 0; i < names.size(); ++i) EXPECT_EQ(fs[i].get(), alone[i]) << names[i];
  }
  // GenerateStream gives the same tokens, in chunks.
  {
    grpc::ClientContext ctx;
    v1::GenerateRequest req;
    req.set_adapter("a3d");
    req.mutable_prompt_token_ids()->Add(kPrompts[1].begin(), kPrompts[1].end());
    req.set_max_tokens(8);
    auto reader = c.stub().GenerateStream(&ctx, req);
    v1::GenerateResponse chunk;
    std::vector<int32_t> got;
    std::string reason;
    while (reader->Read(&chunk)) {
      got.insert(got.end(), chunk.token_ids().begin(), chunk.token_ids().end());
      if (!chunk.finish_reason().empty()) reason = chunk.finish_reason();
    }
    ASSERT_TRUE(reader->Finish().ok());
    EXPECT_EQ(got, alone[1]);
    EXPECT_EQ(reason, "length");
  }
  // Metrics moved.
  const std::string m = c.Metrics();
  EXPECT_THAT(m, HasSubstr("moelora_requests_total{adapter=\"a3d\",code=\"ok\"} 5"));
  EXPECT_THAT(m, HasSubstr("moelora_adapter_load_seconds_count{converted=\"true\",format=\"3d\","
                           "phase=\"stage\"} 1"));
  EXPECT_THAT(m, HasSubstr("moelora_adapters{state=\"ready\"} 2"));
  EXPECT_THAT(m, HasSubstr("moelora_worker_up{rank=\"1\"} 1"));
  EXPECT_THAT(m, HasSubstr("moelora_serving 1"));
  // Unload: then NOT_FOUND.
  ASSERT_TRUE(c.Unload("a2d").ok());
  v1::GenerateResponse r;
  EXPECT_EQ(c.Generate("a2d", kPrompts[0], 4, &r).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(c.List().size(), 1u);
  // SIGTERM: exits 0 and takes its workers along.
  EXPECT_EQ(c.process().Stop(), 0) << c.Log();
}

// The value of the Prometheus sample `name` (the whole name with its labels), -1 when absent.
double Sample(const std::string& metrics, const std::string& name) {
  std::istringstream in(metrics);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind(name + " ", 0) == 0) return std::stod(line.substr(name.size() + 1));
  }
  return -1;
}

// --decode-steps: several steps per worker call change no token. Three requests of different
// adapters and lengths run together (one finishes inside a call while the others go on) and a
// fourth joins while they decode; each gets the tokens that one step per call gives, and the
// steps-per-call histogram shows the calls that ran several.
TEST_F(ControllerTest, DecodeStepsChangeNoTokenAndJoinersStillJoin) {
  struct Req {
    std::string adapter;
    std::vector<int32_t> prompt;
    int max_tokens;
  };
  const std::vector<Req> reqs = {
      {"a2d", kPrompts[0], 13}, {"a3d", kPrompts[1], 5}, {"", kPrompts[2], 9}};
  const Req joiner = {"a3d", kPrompts[0], 7};
  std::map<std::string, std::vector<std::vector<int32_t>>> got;
  for (const std::string steps : {"1", "8"}) {
    SCOPED_TRACE("--decode-steps " + steps);
    TempDir state;
    ControllerProcess c(state.path(), adapters_.root,
                        {"--enable-mixed-moe-lora-format", "--decode-steps", steps});
    ASSERT_TRUE(c.started()) << c.Log();
    ASSERT_TRUE(c.WaitServing()) << c.Log();
    ASSERT_TRUE(c.Load("a2d", "adapter_2d").ok());
    ASSERT_TRUE(c.Load("a3d", "adapter_3d").ok());
    auto request = [](const Req& r) {
      v1::GenerateRequest q;
      q.set_adapter(r.adapter);
      q.mutable_prompt_token_ids()->Add(r.prompt.begin(), r.prompt.end());
      q.set_max_tokens(r.max_tokens);
      return q;
    };
    std::vector<std::future<std::vector<int32_t>>> fs;
    for (size_t i = 1; i < reqs.size(); ++i) {
      fs.push_back(std::async(std::launch::async, [&, i] {
        v1::GenerateResponse r;
        const grpc::Status s = c.Generate(request(reqs[i]), &r);
        EXPECT_TRUE(s.ok()) << s.error_message();
        EXPECT_EQ(r.usage().completion_tokens(), reqs[i].max_tokens);
        return Tokens(r);
      }));
    }
    // The first streams; the joiner starts once its first tokens are out.
    std::future<std::vector<int32_t>> late;
    std::vector<int32_t> first;
    {
      grpc::ClientContext ctx;
      ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::seconds(60));
      auto reader = c.stub().GenerateStream(&ctx, request(reqs[0]));
      v1::GenerateResponse chunk;
      while (reader->Read(&chunk)) {
        first.insert(first.end(), chunk.token_ids().begin(), chunk.token_ids().end());
        if (!late.valid() && !first.empty()) {
          late = std::async(std::launch::async, [&] {
            v1::GenerateResponse r;
            const grpc::Status s = c.Generate(request(joiner), &r);
            EXPECT_TRUE(s.ok()) << s.error_message();
            return Tokens(r);
          });
        }
      }
      ASSERT_TRUE(reader->Finish().ok());
    }
    std::vector<std::vector<int32_t>>& out = got[steps];
    out.push_back(first);
    for (auto& f : fs) out.push_back(f.get());
    ASSERT_TRUE(late.valid());
    out.push_back(late.get());
    for (size_t i = 0; i < reqs.size(); ++i) {
      EXPECT_EQ(out[i].size(), static_cast<size_t>(reqs[i].max_tokens)) << "request " << i;
    }
    EXPECT_EQ(out.back().size(), static_cast<size_t>(joiner.max_tokens));
    const std::string m = c.Metrics();
    const double calls = Sample(m, "moelora_steps_per_call_count");
    const double single = Sample(m, "moelora_steps_per_call_bucket{le=\"1\"}");
    ASSERT_GT(calls, 0) << m;
    // Every call's RPC overhead is observed but for the calls sent ahead (--call-ahead, on by
    // default: their wall time includes their predecessor's), and the scheduler's gap before
    // each call that continued running sequences.
    const double ahead = Sample(m, "moelora_worker_calls_ahead_total");
    ASSERT_GE(ahead, 0) << m;
    EXPECT_EQ(Sample(m, "moelora_worker_call_overhead_seconds_count") + ahead, calls) << m;
    EXPECT_GT(Sample(m, "moelora_worker_call_overhead_seconds_sum"), 0) << m;
    const double gaps = Sample(m, "moelora_scheduler_gap_seconds_count");
    EXPECT_GT(gaps, 0) << m;
    EXPECT_LT(gaps, calls) << "the first call of a burst follows no running call";
    EXPECT_GT(Sample(m, "moelora_scheduler_gap_seconds_sum"), 0) << m;
    if (steps == "1") {
      EXPECT_EQ(single, calls);
    } else {
      EXPECT_LT(single, calls) << "no call ran several steps";
    }
  }
  EXPECT_EQ(got["8"], got["1"]);
}

// The upstream change's test through the public API with real processes, at TP=2: plain TP,
// expert parallelism, fully sharded LoRAs; a 2D and a 3D adapter (converted in place) and the
// base model; the first tokens are transformers'; requests run together (issued in both
// orders) give each request's tokens alone; equal across the modes and to TP=1. `fixture`: the
// tests/data directory; `model`: its model directory; `prefix`: the adapters' names under the root.
void UpstreamMixedTestAtTp2(const AdapterRoot& adapters, const std::string& fixture,
                            const std::string& model, const std::string& prefix) {
  auto ref = ReadExpected(Data(fixture + "/expected_logits.safetensors"));
  const std::vector<std::string> names = {"q2d", "q3d", ""};
  const std::vector<std::string> variants = {"adapter_2d", "adapter_3d", "base"};
  std::vector<std::vector<int32_t>> first_mode;
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{"--tensor-parallel-size", "1"},
        std::vector<std::string>{"--tensor-parallel-size", "2"},
        std::vector<std::string>{"--tensor-parallel-size", "2", "--enable-expert-parallel"},
        std::vector<std::string>{"--tensor-parallel-size", "2", "--fully-sharded-loras"}}) {
    SCOPED_TRACE(absl::StrJoin(extra, " "));
    TempDir state;
    std::vector<std::string> flags = {"--enable-mixed-moe-lora-format"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    ControllerProcess c(state.path(), adapters.root, flags, model);
    ASSERT_TRUE(c.started()) << c.Log();
    ASSERT_TRUE(c.WaitServing()) << c.Log();
    v1::Adapter a2d, a3d;
    ASSERT_TRUE(c.Load("q2d", prefix + "adapter_2d", &a2d).ok()) << c.Log();
    ASSERT_TRUE(c.Load("q3d", prefix + "adapter_3d", &a3d).ok()) << c.Log();
    EXPECT_EQ(a2d.detected_format(), v1::FORMAT_2D);
    EXPECT_EQ(a3d.detected_format(), v1::FORMAT_3D);
    EXPECT_TRUE(a3d.converted_to_2d());
    std::vector<std::vector<int32_t>> alone(3);
    for (size_t i = 0; i < names.size(); ++i) {
      v1::GenerateResponse r;
      ASSERT_TRUE(c.Generate(names[i], ref.prompts[i], 6, &r).ok());
      alone[i] = Tokens(r);
      const auto& logits = ref.logits.at(variants[i])[i];
      EXPECT_EQ(alone[i][0],
                Argmax(logits, ref.prompts[i].size() - 1, logits.size() / ref.prompts[i].size()))
          << variants[i];
    }
    for (bool swapped : {false, true}) {
      std::vector<std::vector<int32_t>> together(3);
      std::vector<std::thread> threads;
      for (size_t n = 0; n < names.size(); ++n) {
        const size_t i = swapped ? names.size() - 1 - n : n;
        threads.emplace_back([&, i] {
          v1::GenerateResponse r;
          grpc::Status s = c.Generate(names[i], ref.prompts[i], 6, &r);
          EXPECT_TRUE(s.ok()) << s.error_message();
          together[i] = Tokens(r);
        });
      }
      for (auto& t : threads) t.join();
      EXPECT_EQ(together, alone) << (swapped ? "swapped" : "in order");
    }
    if (first_mode.empty()) {
      first_mode = alone;
    } else {
      EXPECT_EQ(alone, first_mode);
    }
  }
}

// --speculative-config through real processes, on `model` (a fixture with trained MTP heads) and
// its target's adapters (`prefix`adapter_2d, `prefix`adapter_3d): a base, a 2D and a 3D request
// run together give the tokens the service gives without speculation, at TP=1, TP=2 and TP=2
// with expert parallelism, with drafts kept (the metrics count drafts and kept ones per
// adapter); a sampled request runs to its length.
void SpeculationThroughTheService(const AdapterRoot& adapters, const std::string& model,
                                  const std::string& prefix) {
  const std::vector<std::string> names = {"", "q2d", "q3d"};
  auto generate_all = [&](ControllerProcess& c) {
    std::vector<std::vector<int32_t>> out(names.size());
    std::vector<std::thread> threads;
    for (size_t i = 0; i < names.size(); ++i) {
      threads.emplace_back([&, i] {
        v1::GenerateResponse r;
        const grpc::Status s = c.Generate(names[i], kPrompts[i], 24, &r);
        EXPECT_TRUE(s.ok()) << s.error_message();
        out[i] = Tokens(r);
      });
    }
    for (auto& t : threads) t.join();
    return out;
  };
  std::vector<std::vector<int32_t>> plain;
  for (const std::vector<std::string>& extra :
       {std::vector<std::string>{},
        std::vector<std::string>{"--speculative-config",
                                 R"({"method": "mtp", "num_speculative_tokens": 3})"},
        std::vector<std::string>{"--speculative-config",
                                 R"({"method": "mtp", "num_speculative_tokens": 3})",
                                 "--tensor-parallel-size", "2"},
        std::vector<std::string>{"--speculative-config",
                                 R"({"method": "mtp", "num_speculative_tokens": 2})",
                                 "--tensor-parallel-size", "2", "--enable-expert-parallel"}}) {
    SCOPED_TRACE(absl::StrJoin(extra, " "));
    TempDir state;
    std::vector<std::string> flags = {"--enable-mixed-moe-lora-format"};
    flags.insert(flags.end(), extra.begin(), extra.end());
    ControllerProcess c(state.path(), adapters.root, flags, model);
    ASSERT_TRUE(c.started()) << c.Log();
    ASSERT_TRUE(c.WaitServing()) << c.Log();
    ASSERT_TRUE(c.Load("q2d", prefix + "adapter_2d").ok()) << c.Log();
    ASSERT_TRUE(c.Load("q3d", prefix + "adapter_3d").ok()) << c.Log();
    const std::vector<std::vector<int32_t>> got = generate_all(c);
    for (const auto& t : got) EXPECT_EQ(t.size(), 24u);
    const std::string m = c.Metrics();
    if (extra.empty()) {
      plain = got;
      EXPECT_EQ(m.find("moelora_spec_decode_draft_tokens_total{"), std::string::npos);
      continue;
    }
    EXPECT_EQ(got, plain);
    const double drafted = Sample(m, R"(moelora_spec_decode_draft_tokens_total{adapter="base"})");
    const double kept = Sample(m, R"(moelora_spec_decode_accepted_tokens_total{adapter="base"})");
    EXPECT_GT(drafted, 0) << m;
    EXPECT_GT(kept, 0) << m;
    EXPECT_GT(Sample(m, R"(moelora_spec_decode_draft_tokens_total{adapter="q2d"})"), 0) << m;
    EXPECT_NEAR(Sample(m, R"(moelora_spec_decode_acceptance_rate{adapter="base"})"), kept / drafted,
                1e-9);
    EXPECT_GT(Sample(m, R"(moelora_spec_decode_mean_accepted_length{adapter="base"})"), 1) << m;
    v1::GenerateRequest q;
    q.mutable_prompt_token_ids()->Add(kPrompts[0].begin(), kPrompts[0].end());
    q.set_max_tokens(16);
    q.set_temperature(0.8f);
    q.set_seed(5);
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate(q, &r).ok());
    EXPECT_EQ(r.token_ids_size(), 16);
  }
}

// Qwen3.5's reused head and Step3.5's three chained heads.
TEST_F(ControllerTest, SpeculativeDecodingGivesTheSameTokensAtTp1AndTp2) {
  SpeculationThroughTheService(adapters_, "qwen3_5_moe_mtp/model", "q35_");
}
TEST_F(ControllerTest, Step35SpeculativeDecodingGivesTheSameTokensAtTp1AndTp2) {
  SpeculationThroughTheService(adapters_, "step3p5_mtp/model", "s35_");
}

// On Qwen3.5-MoE (the VL release's layout) and on Step3.5 (the hub layout).
TEST_F(ControllerTest, Qwen35MixedAdaptersAtTp2) {
  UpstreamMixedTestAtTp2(adapters_, "qwen3_5_moe", "qwen3_5_moe/model_vl", "q35_");
}
TEST_F(ControllerTest, Step3p5MixedAdaptersAtTp2) {
  UpstreamMixedTestAtTp2(adapters_, "step3p5", "step3p5/model", "s35_");
}

// The memory model through the public API at TP=2: a request that could not fit the whole KV
// cache even alone is refused naming the budget; more requests than the cache holds at once all
// complete (admitted as blocks free up, preempted and recomputed when decodes outgrow it), each
// with its tokens alone; a repeated prompt finds its prefix cached; the metrics say so.
TEST_F(ControllerTest, KvBudgetRefusesWhatCannotFitAndServesTheRestInTurn) {
  // The tiny model: 2 layers, 2 KV heads of 8, f32: a 4-token block takes 2 · 2 · 4 · 2 · 8 · 4
  // bytes (1 KiB) per worker at TP=1, half at TP=2: 12 KiB = 24 blocks = 96 positions (under
  // max_model_len 128).
  ControllerProcess c(
      state_.path(), adapters_.root,
      {"--tensor-parallel-size", "2", "--block-size", "4", "--kv-cache-memory-bytes", "12Ki",
       "--max-num-batched-tokens", "64", "--prefill-tokens-beside-decodes", "8"});
  ASSERT_TRUE(c.started()) << c.Log();
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  std::vector<int32_t> long_prompt(50, 7);
  v1::GenerateResponse r;
  grpc::Status s = c.Generate("", long_prompt, 60, &r);  // 110 positions
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << s.error_message();
  EXPECT_THAT(s.error_message(), HasSubstr("24 blocks of 4 tokens"));
  EXPECT_THAT(s.error_message(), HasSubstr("--kv-cache-memory-bytes"));
  // Alone, then six at once (6 x (20 + 40) positions > 96).
  std::vector<std::vector<int32_t>> prompts, alone;
  for (int i = 0; i < 6; ++i) {
    std::vector<int32_t> p;
    for (int j = 0; j < 20; ++j) p.push_back((i * 13 + j * 5) % 90 + 3);
    prompts.push_back(p);
    v1::GenerateRequest req;
    req.mutable_prompt_token_ids()->Add(p.begin(), p.end());
    req.set_max_tokens(40);
    req.set_ignore_eos(true);
    ASSERT_TRUE(c.Generate(req, &r).ok());
    alone.push_back(Tokens(r));
  }
  std::vector<std::future<std::pair<grpc::Status, std::vector<int32_t>>>> calls;
  for (const auto& p : prompts) {
    calls.push_back(std::async(std::launch::async, [&c, p] {
      v1::GenerateRequest req;
      req.mutable_prompt_token_ids()->Add(p.begin(), p.end());
      req.set_max_tokens(40);
      req.set_ignore_eos(true);
      v1::GenerateResponse out;
      grpc::Status st = c.Generate(req, &out);
      return std::make_pair(st, Tokens(out));
    }));
  }
  for (size_t i = 0; i < calls.size(); ++i) {
    auto [st, toks] = calls[i].get();
    EXPECT_TRUE(st.ok()) << st.error_message();
    EXPECT_EQ(toks, alone[i]) << "prompt " << i;
  }
  // The first prompt twice more, one after the other: the second finds its 16-token prefix (4
  // full blocks; the last token is always computed) cached, and answers the same.
  for (int k = 0; k < 2; ++k) {
    v1::GenerateRequest req;
    req.mutable_prompt_token_ids()->Add(prompts[0].begin(), prompts[0].end());
    req.set_max_tokens(40);
    req.set_ignore_eos(true);
    ASSERT_TRUE(c.Generate(req, &r).ok());
    EXPECT_EQ(Tokens(r), alone[0]);
  }
  const std::string m = c.Metrics();
  EXPECT_THAT(m, HasSubstr("moelora_kv_cache_usage_ratio"));
  EXPECT_THAT(m, HasSubstr("moelora_preemptions_total"));
  const std::string name = "\nmoelora_prefix_cache_hits_total ";
  const size_t at = m.find(name);
  ASSERT_NE(at, std::string::npos) << m;
  EXPECT_GE(std::stod(m.substr(at + name.size())), 16.0);
}

TEST_F(ControllerTest, BadInputGetsItsStatusAndChangesNothing) {
  ControllerProcess c(state_.path(), adapters_.root, {"--max-lora-rank", "4"});
  ASSERT_TRUE(c.started()) << c.Log();
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  ASSERT_TRUE(c.Load("good", "adapter_2d").ok());
  struct Bad {
    std::string name, path;
    grpc::StatusCode code;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {"t1", "../outside/a", grpc::StatusCode::PERMISSION_DENIED, "outside --adapter-root"},
      {"t2", "/etc", grpc::StatusCode::PERMISSION_DENIED, "outside --adapter-root"},
      {"t3", "escape", grpc::StatusCode::PERMISSION_DENIED, "symlink"},
      {"t4", "missing", grpc::StatusCode::NOT_FOUND, "does not exist"},
      {"t5", "pickle_only", grpc::StatusCode::INVALID_ARGUMENT, "pickle"},
      {"t6", "garbage", grpc::StatusCode::INVALID_ARGUMENT, "adapter_model.safetensors"},
      {"t7", "other_model", grpc::StatusCode::INVALID_ARGUMENT, "q_proj"},
      {"t8", "big_rank", grpc::StatusCode::RESOURCE_EXHAUSTED, "--max-lora-rank"},
      {"t9", "adapter_3d", grpc::StatusCode::FAILED_PRECONDITION, "--enable-mixed-moe-lora-format"},
      {"good", "adapter_2d_shared_a", grpc::StatusCode::ALREADY_EXISTS, "already loaded"},
      {"bad/name", "adapter_2d", grpc::StatusCode::INVALID_ARGUMENT, "adapter name"},
      {"t10", std::string("adapter_2d\0x", 12), grpc::StatusCode::INVALID_ARGUMENT, "NUL"},
      {"t11", std::string(5000, 'a'), grpc::StatusCode::INVALID_ARGUMENT, "longer than 4096"},
  };
  for (const Bad& b : bad) {
    grpc::Status s = c.Load(b.name, b.path);
    EXPECT_EQ(s.error_code(), b.code)
        << b.name << " " << b.path.substr(0, 40) << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr(b.message)) << b.name;
    auto list = c.List();
    ASSERT_EQ(list.size(), 1u) << b.name;
    EXPECT_EQ(list[0].name(), "good");
  }
  // The same name and path again is idempotent.
  v1::Adapter again;
  ASSERT_TRUE(c.Load("good", "adapter_2d", &again).ok());
  EXPECT_EQ(again.state(), v1::ADAPTER_STATE_READY);
  // Generate errors.
  v1::GenerateResponse r;
  EXPECT_EQ(c.Generate("nope", kPrompts[0], 4, &r).error_code(), grpc::StatusCode::NOT_FOUND);
  EXPECT_EQ(c.Generate("", kPrompts[0], 1000000, &r).error_code(),
            grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(c.Generate("", kPrompts[0], 0, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(c.Generate("", {}, 4, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(c.Generate("", {1, 384}, 4, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_EQ(c.Generate("", {-1}, 4, &r).error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  ASSERT_TRUE(c.Generate("good", kPrompts[0], 4, &r).ok());
  const std::string m = c.Metrics();
  EXPECT_THAT(m, HasSubstr("moelora_adapter_load_failures_total{reason=\"permission_denied\"} 3"));
  // A name no adapter has is no label value of its own.
  EXPECT_THAT(m,
              HasSubstr("moelora_requests_total{adapter=\"unregistered\",code=\"not_found\"} 1"));
  EXPECT_THAT(m, Not(HasSubstr("adapter=\"nope\"")));
}

TEST_F(ControllerTest, RegistrySurvivesARestart) {
  std::vector<int32_t> before;
  {
    ControllerProcess c(state_.path(), adapters_.root, {"--enable-mixed-moe-lora-format"});
    ASSERT_TRUE(c.WaitServing()) << c.Log();
    ASSERT_TRUE(c.Load("a3d", "adapter_3d").ok());
    ASSERT_TRUE(c.Load("a2d", "adapter_2d").ok());
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate("a3d", kPrompts[0], 6, &r).ok());
    before = Tokens(r);
    EXPECT_EQ(c.process().Stop(), 0);
  }
  ControllerProcess c(state_.path(), adapters_.root, {"--enable-mixed-moe-lora-format"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  auto list = c.List();
  ASSERT_EQ(list.size(), 2u);
  for (const auto& a : list) EXPECT_EQ(a.state(), v1::ADAPTER_STATE_READY) << a.name();
  v1::GenerateResponse r;
  ASSERT_TRUE(c.Generate("a3d", kPrompts[0], 6, &r).ok());
  EXPECT_EQ(Tokens(r), before);
}

TEST_F(ControllerTest, KilledWorkerFailsInFlightRequestsFastAndComesBack) {
  ControllerProcess c(state_.path(), adapters_.root,
                      {"--tensor-parallel-size", "2", "--enable-mixed-moe-lora-format",
                       "--worker-args", "--debug-step-delay-ms 20"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  ASSERT_TRUE(c.Load("a3d", "adapter_3d").ok());
  v1::GenerateResponse ref;
  ASSERT_TRUE(c.Generate("a3d", kPrompts[1], 5, &ref).ok());
  // A long generation, then SIGKILL rank 1 while it runs (it has streamed its first tokens).
  auto long_run = c.StartStream("a3d", kPrompts[0], 100);
  ASSERT_NE(long_run, nullptr);
  // Worker pids: from the controller's run directory logs is fragile; use pgrep on our state dir.
  const std::string cmd = "pgrep -f -- '[-]-rank 1 --tensor-parallel-size 2 --dist-init-dir " +
                          state_.path() + "/run/group.1/dist'";
  FILE* p = popen(cmd.c_str(), "r");
  int pid = 0;
  ASSERT_EQ(fscanf(p, "%d", &pid), 1);
  pclose(p);
  const auto kill_time = std::chrono::steady_clock::now();
  ASSERT_EQ(kill(pid, SIGKILL), 0);
  const grpc::Status status = long_run->Finish();
  EXPECT_EQ(status.error_code(), grpc::StatusCode::UNAVAILABLE) << status.error_message();
  // Found within a step timeout or a health probe (about a second), not the 60 s step timeout.
  EXPECT_LT(std::chrono::steady_clock::now() - kill_time, std::chrono::seconds(20));
  EXPECT_TRUE(c.WaitHealth(Health::NOT_SERVING, std::chrono::seconds(5)));
  // The group restarts, the adapter is re-loaded, requests succeed again.
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  v1::GenerateResponse r;
  ASSERT_TRUE(c.Generate("a3d", kPrompts[1], 5, &r).ok());
  EXPECT_EQ(Tokens(r), Tokens(ref));
  EXPECT_THAT(c.Metrics(), HasSubstr("moelora_worker_group_restarts_total 1"));
}

TEST_F(ControllerTest, ConcurrentGenerateWithLoadUnloadChurn) {
  ControllerProcess c(
      state_.path(), adapters_.root,
      {"--enable-mixed-moe-lora-format", "--max-loras", "3", "--max-cpu-loras", "8"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  ASSERT_TRUE(c.Load("a2d", "adapter_2d").ok());
  ASSERT_TRUE(c.Load("a3d", "adapter_3d").ok());
  // Reference outputs, one at a time.
  const std::vector<std::string> stable = {"a2d", "a3d", ""};
  std::map<std::string, std::vector<int32_t>> want;
  for (const auto& n : stable) {
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate(n, kPrompts[0], 6, &r).ok());
    want[n] = Tokens(r);
  }
  // Churn adapters: their expected outputs, measured while loaded alone.
  std::map<std::string, std::string> churn = {{"c1", "adapter_2d_shared_a"},
                                              {"c2", "adapter_3d_as_2d"},
                                              {"c3", "adapter_2d_shared_a"},
                                              {"c4", "adapter_3d"}};
  for (const auto& [n, path] : churn) {
    ASSERT_TRUE(c.Load(n, path).ok()) << n;
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate(n, kPrompts[0], 6, &r).ok());
    want[n] = Tokens(r);
  }
  std::atomic<bool> stop{false};
  std::atomic<int> ok{0}, not_found{0}, bad{0};
  constexpr int kGenerates = 300;
  std::vector<std::thread> threads;
  for (int t = 0; t < 16; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(t);
      std::vector<std::string> names = {"a2d", "a3d", "", "c1", "c2", "c3", "c4"};
      while (ok + not_found + bad < kGenerates) {
        const std::string n = names[rng() % names.size()];
        v1::GenerateResponse r;
        grpc::Status s = c.Generate(n, kPrompts[0], 6, &r);
        if (s.ok() && Tokens(r) == want[n]) {
          ++ok;
        } else if (s.error_code() == grpc::StatusCode::NOT_FOUND && n.size() == 2 && n[0] == 'c') {
          ++not_found;
        } else {
          ++bad;
          ADD_FAILURE() << "adapter '" << n << "': " << s.error_code() << " " << s.error_message();
        }
      }
    });
  }
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      std::mt19937 rng(100 + t);
      while (!stop) {
        auto it = churn.begin();
        std::advance(it, rng() % churn.size());
        grpc::Status s = (rng() % 2) ? c.Unload(it->first) : c.Load(it->first, it->second);
        const auto code = s.error_code();
        if (!(s.ok() || code == grpc::StatusCode::NOT_FOUND || code == grpc::StatusCode::ABORTED ||
              code == grpc::StatusCode::RESOURCE_EXHAUSTED)) {
          ++bad;
          ADD_FAILURE() << "churn " << it->first << ": " << code << " " << s.error_message();
        }
      }
    });
  }
  // The generators do a fixed amount of work (not a time: a loaded machine does less in six
  // seconds); the churn goes on until they are done.
  for (int t = 0; t < 16; ++t) threads[t].join();
  stop = true;
  for (auto& th : threads) {
    if (th.joinable()) th.join();
  }
  std::printf("[churn] ok=%d not_found=%d bad=%d\n", ok.load(), not_found.load(), bad.load());
  EXPECT_GT(ok.load(), 20);
  EXPECT_EQ(bad.load(), 0);
  EXPECT_EQ(c.Health(), Health::SERVING);
}

// The workers' host cache (--max-cpu-loras): three adapters through one slot at TP=2, their
// directories deleted once each has been swapped out: every swap-in then comes from the host
// cache, with the tokens it gave when read from disk.
TEST_F(ControllerTest, SwapInsComeFromTheHostCacheOnceTheFilesAreGone) {
  TempDir own;
  const std::string root = own.path() + "/adapters";
  const std::vector<std::pair<std::string, std::string>> adapters = {
      {"a3d", "adapter_3d"}, {"a2d", "adapter_2d"}, {"sha", "adapter_2d_shared_a"}};
  for (const auto& [name, dir] : adapters) {
    fs::create_directories(root);
    fs::copy(Data("qwen3_moe/" + dir), root + "/" + dir, fs::copy_options::recursive);
  }
  ControllerProcess c(state_.path(), root,
                      {"--tensor-parallel-size", "2", "--enable-mixed-moe-lora-format",
                       "--max-loras", "1", "--max-cpu-loras", "8"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  for (const auto& [name, dir] : adapters) ASSERT_TRUE(c.Load(name, dir).ok()) << name;
  // Each in turn (a swap each time), then the first again, so that every adapter has been
  // swapped out at least once: all three are then in the host cache or in the slot.
  std::map<std::string, std::vector<int32_t>> want;
  for (const auto& [name, dir] : adapters) {
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate(name, kPrompts[0], 6, &r).ok()) << name;
    want[name] = Tokens(r);
  }
  {
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate("a3d", kPrompts[0], 6, &r).ok());
    ASSERT_EQ(Tokens(r), want["a3d"]);
  }
  // The adapters differ (else the test would not see a wrong swap).
  ASSERT_NE(want["a3d"], want["a2d"]);
  ASSERT_NE(want["a2d"], want["sha"]);
  const std::string before = c.Metrics();
  EXPECT_THAT(before, HasSubstr("moelora_adapter_resident{adapter=\"a2d\",tier=\"host\"} 1"));
  EXPECT_THAT(before, HasSubstr("moelora_adapter_resident{adapter=\"a3d\",tier=\"slot\"} 1"));
  fs::remove_all(root);
  // Every order of swaps, sequential and concurrent, with no file left to read.
  for (int round = 0; round < 2; ++round) {
    for (const std::string name : {"sha", "a2d", "a3d", "a2d", "sha"}) {
      v1::GenerateResponse r;
      grpc::Status s = c.Generate(name, kPrompts[0], 6, &r);
      ASSERT_TRUE(s.ok()) << name << ": " << s.error_message() << c.Log();
      EXPECT_EQ(Tokens(r), want[name]) << name;
    }
  }
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int t = 0; t < 6; ++t) {
    threads.emplace_back([&, t] {
      const std::string name = adapters[t % 3].first;
      v1::GenerateResponse r;
      grpc::Status s = c.Generate(name, kPrompts[0], 6, &r);
      if (s.ok() && Tokens(r) == want[name])
        ++good;
      else
        ADD_FAILURE() << name << ": " << s.error_message();
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(good.load(), 6);
  const std::string m = c.Metrics();
  EXPECT_THAT(m, ::testing::ContainsRegex("moelora_adapter_load_seconds_count\\{[^}]*"
                                          "phase=\"swap_in\"\\} [1-9]"));
  // An unload by the user forgets it in the host cache too: loading it again needs the file
  // (gone with the whole adapter root).
  ASSERT_TRUE(c.Unload("a2d").ok());
  const grpc::Status again = c.Load("a2d", "adapter_2d");
  EXPECT_FALSE(again.ok());
  EXPECT_THAT(again.error_message(), HasSubstr("adapter"));
}

// The three tiers: more adapters registered than the host cache and the slots hold together
// (--max-loras 1, --max-cpu-loras 1, six adapters): each request for one in neither tier reads
// it from disk, with the tokens it gave right after its LoadAdapter; concurrent requests for
// the same adapter share one swap-in; --max-registered-adapters bounds the registry.
TEST_F(ControllerTest, AdaptersBeyondTheHostCacheAreReadFromDiskOnDemand) {
  ControllerProcess c(state_.path(), adapters_.root,
                      {"--enable-mixed-moe-lora-format", "--max-loras", "1", "--max-cpu-loras", "1",
                       "--max-registered-adapters", "6"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  const std::vector<std::string> dirs = {"adapter_3d", "adapter_2d", "adapter_2d_shared_a"};
  std::map<std::string, std::vector<int32_t>> want;
  std::vector<std::string> names;
  for (int i = 0; i < 6; ++i) {
    const std::string name = "t" + std::to_string(i);
    ASSERT_TRUE(c.Load(name, dirs[i % 3]).ok()) << name << c.Log();
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate(name, kPrompts[i % 2], 6, &r).ok()) << name;
    want[name] = Tokens(r);
    names.push_back(name);
  }
  const grpc::Status seventh = c.Load("t6", "adapter_2d");
  EXPECT_EQ(seventh.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  EXPECT_THAT(seventh.error_message(), HasSubstr("--max-registered-adapters"));
  for (int round = 0; round < 2; ++round) {
    for (int i = 5; i >= 0; --i) {
      v1::GenerateResponse r;
      grpc::Status s = c.Generate(names[i], kPrompts[i % 2], 6, &r);
      ASSERT_TRUE(s.ok()) << names[i] << ": " << s.error_message();
      EXPECT_EQ(Tokens(r), want[names[i]]) << names[i];
    }
  }
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      const int i = t % 2 == 0 ? 0 : 3;  // two adapters, four requests each, all at once
      v1::GenerateResponse r;
      grpc::Status s = c.Generate(names[i], kPrompts[i % 2], 6, &r);
      if (s.ok() && Tokens(r) == want[names[i]]) ++good;
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(good.load(), 8);
  EXPECT_EQ(c.List().size(), 6u);
}

// --adapter-resolver filesystem: a request names an adapter directory under --adapter-root
// that was never registered; it is validated, registered and loaded on first use (concurrent
// requests share one load), with the tokens an explicit LoadAdapter of the same directory gives.
// A missing directory, a path outside the root and a malformed adapter get their usual codes.
TEST_F(ControllerTest, TheFilesystemResolverLoadsAnAdapterOnFirstUse) {
  TempDir own;
  const std::string root = own.path() + "/adapters";
  fs::create_directories(root);
  fs::copy(Data("qwen3_moe/adapter_2d"), root + "/fs2d", fs::copy_options::recursive);
  fs::copy(Data("qwen3_moe/adapter_3d"), root + "/fs3d", fs::copy_options::recursive);
  fs::create_directories(root + "/broken");
  { std::ofstream(root + "/broken/adapter_config.json") << "{not json"; }
  ControllerProcess c(state_.path(), root,
                      {"--enable-mixed-moe-lora-format", "--adapter-resolver", "filesystem"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  ASSERT_TRUE(c.Load("explicit3d", "fs3d").ok());
  v1::GenerateResponse want;
  ASSERT_TRUE(c.Generate("explicit3d", kPrompts[0], 6, &want).ok());
  std::vector<std::thread> threads;
  std::atomic<int> good{0};
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      v1::GenerateResponse r;
      grpc::Status s = c.Generate("fs3d", kPrompts[0], 6, &r);
      if (s.ok() && Tokens(r) == Tokens(want)) {
        ++good;
      } else {
        ADD_FAILURE() << s.error_message();
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(good.load(), 4);
  v1::GenerateResponse r2;
  ASSERT_TRUE(c.Generate("fs2d", kPrompts[1], 6, &r2).ok());
  EXPECT_NE(Tokens(r2), Tokens(want));
  int registered = 0;
  for (const v1::Adapter& a : c.List()) registered += a.name() == "fs3d" || a.name() == "fs2d";
  EXPECT_EQ(registered, 2);
  v1::GenerateResponse r;
  grpc::Status missing = c.Generate("nope", kPrompts[0], 2, &r);
  EXPECT_EQ(missing.error_code(), grpc::StatusCode::NOT_FOUND) << missing.error_message();
  grpc::Status outside = c.Generate("..", kPrompts[0], 2, &r);
  EXPECT_EQ(outside.error_code(), grpc::StatusCode::PERMISSION_DENIED) << outside.error_message();
  grpc::Status broken = c.Generate("broken", kPrompts[0], 2, &r);
  EXPECT_EQ(broken.error_code(), grpc::StatusCode::INVALID_ARGUMENT) << broken.error_message();
  EXPECT_THAT(broken.error_message(), HasSubstr("adapter_config.json"));
  EXPECT_EQ(c.List().size(), 3u);  // explicit3d, fs3d, fs2d: nothing for the failures
}

TEST_F(ControllerTest, SigtermDrainsInFlightRequests) {
  ControllerProcess c(state_.path(), adapters_.root, {"--worker-args", "--debug-step-delay-ms 10"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  auto run = c.StartStream("", kPrompts[0], 60);
  ASSERT_NE(run, nullptr);
  c.process().Signal(SIGTERM);
  const grpc::Status s = run->Finish();
  EXPECT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(run->tokens().size(), 60u);
  EXPECT_EQ(c.process().WaitExit(std::chrono::seconds(30)), 0) << c.Log();
  // New requests are refused once draining has started (the server is gone after exit).
  v1::GenerateResponse r;
  EXPECT_FALSE(c.Generate("", kPrompts[0], 2, &r, false, std::chrono::seconds(2)).ok());
}

TEST_F(ControllerTest, UnloadWhileInFlightFinishesThoseAndRefusesNewOnes) {
  ControllerProcess c(
      state_.path(), adapters_.root,
      {"--enable-mixed-moe-lora-format", "--worker-args", "--debug-step-delay-ms 15"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  ASSERT_TRUE(c.Load("a3d", "adapter_3d").ok());
  v1::GenerateResponse want;
  ASSERT_TRUE(c.Generate("a3d", kPrompts[0], 40, &want).ok());
  auto run = c.StartStream("a3d", kPrompts[0], 40);
  ASSERT_NE(run, nullptr);
  ASSERT_TRUE(c.Unload("a3d").ok());
  v1::GenerateResponse r;
  EXPECT_EQ(c.Generate("a3d", kPrompts[0], 4, &r).error_code(), grpc::StatusCode::NOT_FOUND);
  const grpc::Status s = run->Finish();
  ASSERT_TRUE(s.ok()) << s.error_message();
  EXPECT_EQ(run->tokens(), Tokens(want));  // finished with the adapter
  // Listed as UNLOADING until the workers drop it, right after its last request.
  bool gone = false;
  for (int i = 0; i < 50 && !gone; ++i) {
    gone = c.List().empty();
    if (!gone) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  EXPECT_TRUE(gone);
}

TEST_F(ControllerTest, DeadlinesAndCancellationFreeTheSequence) {
  ControllerProcess c(state_.path(), adapters_.root, {"--worker-args", "--debug-step-delay-ms 20"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  v1::GenerateResponse r;
  grpc::ClientContext ctx;
  ctx.set_deadline(std::chrono::system_clock::now() + std::chrono::milliseconds(300));
  v1::GenerateRequest req;
  req.mutable_prompt_token_ids()->Add(kPrompts[0].begin(), kPrompts[0].end());
  req.set_max_tokens(100);
  // The client's status alone says nothing of the server (gRPC ends the call at the deadline
  // either way): the requests counter below says the scheduler ended it for its deadline.
  EXPECT_EQ(c.stub().Generate(&ctx, req, &r).error_code(), grpc::StatusCode::DEADLINE_EXCEEDED);
  // A cancelled stream.
  {
    grpc::ClientContext sctx;
    auto reader = c.stub().GenerateStream(&sctx, req);
    v1::GenerateResponse chunk;
    ASSERT_TRUE(reader->Read(&chunk));
    sctx.TryCancel();
    while (reader->Read(&chunk)) {
    }
    EXPECT_EQ(reader->Finish().error_code(), grpc::StatusCode::CANCELLED);
  }
  // Both left the batch within a step or two.
  bool drained = false;
  for (int i = 0; i < 50 && !drained; ++i) {
    drained = c.Metrics().find("moelora_running_sequences 0\n") != std::string::npos;
    if (!drained) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(drained) << c.Metrics();
  // The handler counts the request once the scheduler has ended it.
  bool counted = false;
  const std::string want = "moelora_requests_total{adapter=\"base\",code=\"deadline_exceeded\"} 1";
  for (int i = 0; i < 50 && !counted; ++i) {
    counted = c.Metrics().find(want) != std::string::npos;
    if (!counted) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_TRUE(counted) << c.Metrics();
}

TEST_F(ControllerTest, WorkersDieWithTheirController) {
  ControllerProcess c(state_.path(), adapters_.root, {"--tensor-parallel-size", "2"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  auto count = [&] {
    // "[-]-" keeps the pattern from matching the shell that runs pgrep.
    const std::string cmd = "pgrep -c -f -- '[-]-dist-init-dir " + state_.path() + "/run/'";
    FILE* p = popen(cmd.c_str(), "r");
    int n = 0;
    if (fscanf(p, "%d", &n) != 1) n = 0;
    pclose(p);
    return n;
  };
  EXPECT_EQ(count(), 2);
  c.process().Signal(SIGKILL);
  c.process().WaitExit(std::chrono::seconds(5));
  int n = 2;
  for (int i = 0; i < 100 && n > 0; ++i) {
    n = count();
    if (n > 0) std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(n, 0);
}

// --workers for a group started on its own, rank order.
std::string WorkerAddresses(::moelora::testing::WorkerGroup& workers) {
  return "127.0.0.1:" + std::to_string(workers.port(0)) +
         ",127.0.0.1:" + std::to_string(workers.port(1));
}

TEST_F(ControllerTest, ConnectModeDrivesRunningWorkers) {
  // Two ranks started on their own (as Kubernetes would), then a controller with --workers.
  ::moelora::testing::WorkerGroup workers(Data("qwen3_moe/model"), 2,
                                          {"--enable-mixed-moe-lora-format"});
  ASSERT_TRUE(workers.WaitReady()) << workers.Logs();
  const std::string addrs = WorkerAddresses(workers);
  ControllerProcess c(state_.path(), adapters_.root,
                      {"--workers", addrs, "--enable-mixed-moe-lora-format"});
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  ASSERT_TRUE(c.Load("a3d", "adapter_3d").ok());
  v1::GenerateResponse r;
  ASSERT_TRUE(c.Generate("a3d", kPrompts[0], 5, &r).ok());
  EXPECT_EQ(r.token_ids_size(), 5);
  EXPECT_THAT(c.Metrics(), HasSubstr("moelora_worker_up{rank=\"1\"} 1"));
}

// Workers started on their own with a setting the controller does not share: the controller
// does not serve, and says which flag (health NOT_SERVING, requests UNAVAILABLE naming it, the
// log too) instead of serving with slot counts that disagree.
TEST_F(ControllerTest, ConnectModeRefusesWorkersWhoseSettingsDisagree) {
  ::moelora::testing::WorkerGroup workers(Data("qwen3_moe/model"), 2,
                                          {"--enable-mixed-moe-lora-format", "--max-loras", "2"});
  ASSERT_TRUE(workers.WaitReady()) << workers.Logs();
  const std::string addrs = WorkerAddresses(workers);
  ControllerProcess c(state_.path(), adapters_.root,
                      {"--workers", addrs, "--enable-mixed-moe-lora-format"});
  ASSERT_TRUE(c.started()) << c.Log();
  // The mismatch is found as soon as both ranks answer Info; until the controller says so,
  // requests get UNAVAILABLE for "not ready" only.
  grpc::Status s;
  v1::GenerateResponse r;
  for (int i = 0; i < 300; ++i) {
    s = c.Generate("", kPrompts[0], 2, &r);
    if (s.error_message().find("--max-loras") != std::string::npos) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  EXPECT_EQ(s.error_code(), grpc::StatusCode::UNAVAILABLE);
  EXPECT_THAT(s.error_message(), HasSubstr("runs with --max-loras 2, the controller with 16"));
  EXPECT_NE(c.Health(), grpc::health::v1::HealthCheckResponse::SERVING);
  EXPECT_THAT(c.Log(), HasSubstr("--max-loras 2"));
}

namespace text_api {

v1::GenerateRequest TextRequest(const std::string& adapter, const std::string& prompt,
                                int max_tokens) {
  v1::GenerateRequest req;
  req.set_adapter(adapter);
  req.set_prompt(prompt);
  req.set_max_tokens(max_tokens);
  return req;
}

std::string Joined(const std::vector<v1::GenerateResponse>& chunks, std::vector<int32_t>* tokens) {
  std::string text;
  for (const auto& c : chunks) {
    EXPECT_TRUE(IsValidUtf8(c.text())) << "a chunk's text is not valid UTF-8";
    text += c.text();
    tokens->insert(tokens->end(), c.token_ids().begin(), c.token_ids().end());
  }
  return text;
}

}  // namespace text_api

// Text in, text out on the run command's model (its tokenizer.json is a byte-level BPE trained
// by tools/make_tokenizers.py): the prompt is the tokenizer's ids, the text is the tokenizer's
// decode of the generated ids, a stream's text deltas add up to the unary text, stop strings end
// generation and are cut, EOS from generation_config.json stops it, and bad text requests get
// INVALID_ARGUMENT and change nothing.
TEST_F(ControllerTest, TextPromptsStreamsStopStringsAndEos) {
  using namespace text_api;
  auto tokenizer = tok::Tokenizer::Load(Data("qwen3_moe/model"));
  ASSERT_TRUE(tokenizer.ok()) << tokenizer.status();
  ControllerProcess c(state_.path(), adapters_.root, {"--enable-mixed-moe-lora-format"});
  ASSERT_TRUE(c.started()) << c.Log();
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  ASSERT_TRUE(c.Load("a3d", "adapter_3d").ok());
  const std::string prompt = "The quick brown fox, \xe4\xb8\x96\xe7\x95\x8c!";
  const std::vector<int32_t> prompt_ids = *(*tokenizer)->Encode(prompt);
  for (const std::string adapter : {"", "a3d"}) {
    SCOPED_TRACE(adapter);
    v1::GenerateResponse by_text, by_ids;
    ASSERT_TRUE(c.Generate(TextRequest(adapter, prompt, 12), &by_text).ok()) << c.Log();
    ASSERT_TRUE(c.Generate(adapter, prompt_ids, 12, &by_ids).ok());
    const std::vector<int32_t> tokens = Tokens(by_text);
    EXPECT_EQ(tokens, Tokens(by_ids));
    EXPECT_EQ(by_text.usage().prompt_tokens(), static_cast<int>(prompt_ids.size()));
    EXPECT_EQ(by_text.usage().completion_tokens(), 12);
    EXPECT_EQ(by_text.text(), (*tokenizer)->Decode(tokens, /*skip_special=*/true));
    EXPECT_EQ(by_ids.text(), by_text.text());
    ASSERT_FALSE(by_text.text().empty());

    std::vector<v1::GenerateResponse> chunks;
    grpc::Status ss = c.Stream(TextRequest(adapter, prompt, 12), &chunks);
    ASSERT_TRUE(ss.ok()) << ss.error_code() << " " << ss.error_message() << "\n" << c.Log();
    std::vector<int32_t> streamed;
    EXPECT_EQ(Joined(chunks, &streamed), by_text.text());
    EXPECT_EQ(streamed, tokens);
    EXPECT_EQ(chunks.back().finish_reason(), "length");

    // A stop string from the middle of the text: the text ends before its first occurrence.
    const std::string& text = by_text.text();
    size_t mid = text.size() / 2;
    while (mid > 0 && (static_cast<unsigned char>(text[mid]) & 0xC0) == 0x80) --mid;
    size_t end = mid + 1;
    while (end < text.size() && (static_cast<unsigned char>(text[end]) & 0xC0) == 0x80) ++end;
    const std::string stop = text.substr(mid, end - mid);
    v1::GenerateRequest sreq = TextRequest(adapter, prompt, 12);
    sreq.add_stop(stop);
    sreq.add_stop("a stop string that never appears");
    v1::GenerateResponse stopped;
    ASSERT_TRUE(c.Generate(sreq, &stopped).ok());
    EXPECT_EQ(stopped.text(), text.substr(0, text.find(stop)))
        << "stop " << nlohmann::json(stop).dump();
    EXPECT_EQ(stopped.finish_reason(), "stop");
    const std::vector<int32_t> st = Tokens(stopped);
    ASSERT_LE(st.size(), tokens.size());
    EXPECT_EQ(st, std::vector<int32_t>(tokens.begin(), tokens.begin() + st.size()));
    EXPECT_EQ(stopped.usage().completion_tokens(), static_cast<int>(st.size()));
    // The text of the kept tokens reaches the stop string; one token fewer does not.
    EXPECT_NE((*tokenizer)->Decode(st, true).find(stop), std::string::npos);
    EXPECT_EQ((*tokenizer)->Decode(std::vector<int32_t>(st.begin(), st.end() - 1), true).find(stop),
              std::string::npos);
    chunks.clear();
    ss = c.Stream(sreq, &chunks);
    ASSERT_TRUE(ss.ok()) << ss.error_code() << " " << ss.error_message() << "\n" << c.Log();
    std::vector<int32_t> streamed_stop;
    EXPECT_EQ(Joined(chunks, &streamed_stop), stopped.text());
    EXPECT_EQ(streamed_stop, st);
    EXPECT_EQ(chunks.back().finish_reason(), "stop");
  }

  // Bad text requests: INVALID_ARGUMENT with the reason; the server keeps serving.
  v1::GenerateResponse r;
  v1::GenerateRequest both = TextRequest("", "hi", 4);
  both.add_prompt_token_ids(1);
  EXPECT_THAT(c.Generate(both, &r).error_message(), HasSubstr("not both"));
  std::string long_prompt;
  for (int i = 0; i < 400; ++i) long_prompt += "word ";
  grpc::Status s = c.Generate(TextRequest("", long_prompt, 4), &r);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("max_model_len"));
  v1::GenerateRequest long_stop = TextRequest("", "hi", 4);
  long_stop.add_stop(std::string(300, 'x'));
  EXPECT_THAT(c.Generate(long_stop, &r).error_message(), HasSubstr("stop[0] must be 1..256 bytes"));
  v1::GenerateRequest many = TextRequest("", "hi", 4);
  for (int i = 0; i < 17; ++i) many.add_stop("s" + std::to_string(i));
  EXPECT_THAT(c.Generate(many, &r).error_message(), HasSubstr("at most 16 stop strings"));
  EXPECT_TRUE(c.Generate(TextRequest("", "hi", 4), &r).ok());
  EXPECT_THAT(c.Metrics(), HasSubstr("moelora_tokenize_seconds_count"));
  EXPECT_THAT(c.Metrics(), HasSubstr("moelora_stop_string_matches_total 4"));
  EXPECT_EQ(c.process().Stop(), 0) << c.Log();
}

// EOS ids from generation_config.json end generation (finish_reason "stop", the EOS token
// included); ignore_eos generates on.
TEST_F(ControllerTest, EosFromGenerationConfigStopsUnlessIgnored) {
  TempDir model;
  for (const char* f : {"config.json", "model.safetensors", "tokenizer.json"}) {
    fs::copy_file(Data(std::string("qwen3_moe/model/") + f), model.path() + "/" + f);
  }
  std::vector<int32_t> free_run;
  {
    ControllerProcess c(state_.path(), adapters_.root, {}, model.path());
    ASSERT_TRUE(c.WaitServing()) << c.Log();
    v1::GenerateResponse r;
    ASSERT_TRUE(c.Generate("", {1, 17, 42, 5}, 10, &r).ok());
    free_run = Tokens(r);
    EXPECT_EQ(c.process().Stop(), 0);
  }
  ASSERT_EQ(free_run.size(), 10u);
  const int32_t eos = free_run[4];
  const size_t first = std::find(free_run.begin(), free_run.end(), eos) - free_run.begin();
  std::ofstream(model.path() + "/generation_config.json") << "{\"eos_token_id\": [" << eos << "]}";
  TempDir state2;
  ControllerProcess c(state2.path(), adapters_.root, {}, model.path());
  ASSERT_TRUE(c.WaitServing()) << c.Log();
  v1::GenerateResponse r;
  ASSERT_TRUE(c.Generate("", {1, 17, 42, 5}, 10, &r).ok());
  EXPECT_EQ(Tokens(r), std::vector<int32_t>(free_run.begin(), free_run.begin() + first + 1));
  EXPECT_EQ(r.finish_reason(), "stop");
  v1::GenerateRequest req;
  for (int32_t t : {1, 17, 42, 5}) req.add_prompt_token_ids(t);
  req.set_max_tokens(10);
  req.set_ignore_eos(true);
  ASSERT_TRUE(c.Generate(req, &r).ok());
  EXPECT_EQ(Tokens(r), free_run);
  EXPECT_EQ(r.finish_reason(), "length");
  EXPECT_EQ(c.process().Stop(), 0) << c.Log();
}

// SIGKILL of the controller in the middle of a LoadAdapter, then a restart on the same state
// directory: the adapter is either loaded (READY, and it generates) or cleanly absent; never
// half-registered. Several kill delays cover the phases (validate, registry insert, stage,
// commit).
TEST_F(ControllerTest, SigkillDuringLoadAdapterLeavesItLoadedOrAbsent) {
  int loaded = 0, absent = 0;
  for (int delay_ms : {0, 5, 20}) {
    SCOPED_TRACE(delay_ms);
    TempDir state;
    {
      ControllerProcess c(state.path(), adapters_.root, {"--enable-mixed-moe-lora-format"});
      ASSERT_TRUE(c.WaitServing()) << c.Log();
      std::thread load([&] { c.Load("a3d", "adapter_3d").IgnoreError(); });
      std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
      c.process().Signal(SIGKILL);
      load.join();
      c.process().WaitExit(std::chrono::seconds(10));
    }
    ControllerProcess c(state.path(), adapters_.root, {"--enable-mixed-moe-lora-format"});
    ASSERT_TRUE(c.WaitServing()) << c.Log();
    const std::vector<v1::Adapter> list = c.List();
    ASSERT_LE(list.size(), 1u);
    if (list.empty()) {
      ++absent;
    } else {
      ++loaded;
      EXPECT_EQ(list[0].name(), "a3d");
      EXPECT_EQ(list[0].state(), v1::ADAPTER_STATE_READY);
      v1::GenerateResponse r;
      EXPECT_TRUE(c.Generate("a3d", {1, 17, 42}, 2, &r).ok());
    }
    // Either way the name can be loaded (again) and used.
    EXPECT_TRUE(c.Load("a3d", "adapter_3d").ok());
    EXPECT_EQ(c.process().Stop(), 0) << c.Log();
  }
  std::printf("[sigkill] after restart: %d loaded, %d absent\n", loaded, absent);
}

}  // namespace
}  // namespace moelora
