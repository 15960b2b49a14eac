// moelora-worker as real processes on loopback: logits against transformers + PEFT over gRPC,
// TP=2 (gloo over TCP) against TP=1, error codes, /metrics, startup failures.
#include <chrono>
#include <cmath>
#include <filesystem>
#include <future>
#include <map>
#include <ostream>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/integration/worker_group.h"
#include "tests/testing/http_get.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/worker/engine_test_util.h"
#include "tests/unit/worker/mm_fixture.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::MaxAbsDiff;
using ::moelora::testing::ReadExpected;
using ::moelora::testing::WorkerGroup;
using ::testing::HasSubstr;

struct Gen {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;
  std::vector<float> prompt_logits;
};

// Runs `prompts` (adapter ids alongside) as one batch to completion; greedy.
std::vector<Gen> Generate(WorkerGroup& g, const std::vector<int64_t>& adapters,
                          const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
  v1::StepRequest req;
  req.set_step(1);
  for (size_t i = 0; i < prompts.size(); ++i) {
    v1::SequenceSpec* s = req.add_add();
    s->set_sequence_id(static_cast<int64_t>(i) + 1);
    s->set_adapter_id(adapters[i]);
    s->mutable_prompt_token_ids()->Add(prompts[i].begin(), prompts[i].end());
    s->set_max_tokens(max_tokens);
    s->set_return_logits(true);
    s->set_return_prompt_logits(true);
  }
  std::vector<Gen> out(prompts.size());
  for (int step = 0; step < max_tokens + 1; ++step) {
    v1::StepResponse resp;
    grpc::Status st = g.Step(req, &resp);
    EXPECT_TRUE(st.ok()) << st.error_message() << "\n" << g.Logs();
    if (!st.ok() || resp.tokens_size() == 0) break;
    for (const auto& t : resp.tokens()) {
      Gen& o = out[t.sequence_id() - 1];
      o.tokens.push_back(t.token_id());
      o.logits.emplace_back(t.logits().begin(), t.logits().end());
      if (t.prompt_logits_size() > 0)
        o.prompt_logits.assign(t.prompt_logits().begin(), t.prompt_logits().end());
    }
    req.clear_add();
    req.set_step(req.step() + 1);
  }
  return out;
}

struct Case {
  const char* arch;  // fixture dir
  bool mixed;
  std::vector<const char*> adapters;        // loaded with ids 1, 2, ...
  std::vector<std::string> tp2_flags = {};  // extra flags at TP=2 (expert parallelism, ...)
  const char* tag = "";                     // test name suffix
};

// Printed from its fields (gtest's default prints the raw bytes, pointers included).
void PrintTo(const Case& c, std::ostream* os) {
  *os << c.arch << (c.mixed ? " mixed" : "") << c.tag;
}

class WorkerTpTest : public ::testing::TestWithParam<Case> {};

// The batch [adapters..., base] over gRPC matches transformers + PEFT at TP=1 and TP=2, and
// TP=2 generates the same greedy tokens as TP=1 with logits within 1e-4.
TEST_P(WorkerTpTest, Tp2EqualsTp1AndBothMatchTheReference) {
  const Case c = GetParam();
  const std::string arch = c.arch;
  auto ref = ReadExpected(Data(arch + "/expected_logits.safetensors"));
  std::vector<std::string> flags;
  if (c.mixed) flags.push_back("--enable-mixed-moe-lora-format");
  std::vector<int64_t> ids;
  std::vector<std::string> variants;
  for (size_t i = 0; i < c.adapters.size(); ++i)
    ids.push_back(i + 1), variants.push_back(c.adapters[i]);
  ids.push_back(0), variants.push_back("base");
  std::vector<std::vector<int32_t>> prompts;
  for (size_t i = 0; i < ids.size(); ++i) prompts.push_back(ref.prompts[i % ref.prompts.size()]);

  std::map<int, std::vector<Gen>> by_tp;
  for (int tp : {1, 2}) {
    std::vector<std::string> tp_flags = flags;
    if (tp == 2) tp_flags.insert(tp_flags.end(), c.tp2_flags.begin(), c.tp2_flags.end());
    WorkerGroup g(Data(arch + "/model"), tp, tp_flags);
    ASSERT_TRUE(g.WaitReady()) << g.Logs();
    for (size_t i = 0; i < c.adapters.size(); ++i) {
      grpc::Status s = g.Load(ids[i], Data(arch + "/" + c.adapters[i]));
      ASSERT_TRUE(s.ok()) << s.error_message();
    }
    auto gen = Generate(g, ids, prompts, 8);
    for (size_t i = 0; i < ids.size(); ++i) {
      const float d =
          MaxAbsDiff(gen[i].prompt_logits, ref.logits.at(variants[i])[i % ref.prompts.size()]);
      std::printf("[ref] tp=%d %s %s: max |logit - HF| = %.3g\n", tp, c.arch, variants[i].c_str(),
                  d);
      EXPECT_LE(d, 1e-4f) << variants[i];
      EXPECT_EQ(gen[i].tokens.size(), 8u);
    }
    by_tp[tp] = gen;
  }
  float worst = 0;
  for (size_t i = 0; i < ids.size(); ++i) {
    EXPECT_EQ(by_tp[1][i].tokens, by_tp[2][i].tokens) << variants[i];
    for (size_t t = 0; t < by_tp[1][i].logits.size() && t < by_tp[2][i].logits.size(); ++t) {
      worst = std::max(worst, MaxAbsDiff(by_tp[1][i].logits[t], by_tp[2][i].logits[t]));
    }
  }
  std::printf("[tp] %s: TP=2 vs TP=1 max |logit diff| over 8 generated tokens = %.3g\n", c.arch,
              worst);
  EXPECT_LE(worst, 1e-4f);
}

struct VisionCase {
  const char* fixture;
  int tp;
  std::vector<std::string> flags;
  const char* tag;
};

class WorkerVisionTest : public ::testing::TestWithParam<VisionCase> {};

// The upstream mixed 2D/3D test's shape through worker processes: image prompts under a 2D and a
// 3D adapter that both adapt the tower, alone and in one batch in both orders (with a base
// request beside them), at TP=1 and at TP=2 with expert parallelism or fully sharded LoRAs:
// prompt logits within 1e-4 of transformers, greedy tokens equal transformers' and equal alone
// and together.
TEST_P(WorkerVisionTest, ImagesThroughBothLayoutsAloneAndMixedMatchTransformers) {
  const VisionCase c = GetParam();
  const std::string fx = c.fixture;
  const auto prompts = testing::ReadMm(fx);
  std::vector<std::string> flags = {"--enable-mixed-moe-lora-format",
                                    "--enable-tower-connector-lora"};
  flags.insert(flags.end(), c.flags.begin(), c.flags.end());
  WorkerGroup g(Data(fx + "/model"), c.tp, flags);
  ASSERT_TRUE(g.WaitReady()) << g.Logs();
  ASSERT_TRUE(g.Load(2, Data(fx + "/adapter_2d")).ok());
  ASSERT_TRUE(g.Load(3, Data(fx + "/adapter_3d")).ok());
  int64_t next_id = 1, step = 1;
  // (prompt, adapter id) requests run as one batch to completion: tokens and prompt logits.
  auto run = [&](const std::vector<std::pair<size_t, int64_t>>& reqs) {
    v1::StepRequest req;
    const int64_t first = next_id;
    for (const auto& [k, adapter] : reqs) {
      v1::SequenceSpec* s = req.add_add();
      s->set_sequence_id(next_id++);
      s->set_adapter_id(adapter);
      s->mutable_prompt_token_ids()->Add(prompts[k].ids.begin(), prompts[k].ids.end());
      s->set_max_tokens(6);
      s->set_return_prompt_logits(true);
      for (const ImageInput& im : testing::Images(fx, prompts[k])) {
        v1::SequenceImage* si = s->add_images();
        si->set_offset(im.offset);
        si->set_height(im.height);
        si->set_width(im.width);
        si->set_rgb(im.rgb);
      }
    }
    std::vector<Gen> out(reqs.size());
    for (int i = 0; i < 8; ++i) {
      req.set_step(step++);
      v1::StepResponse resp;
      grpc::Status st = g.Step(req, &resp);
      EXPECT_TRUE(st.ok()) << st.error_message() << "\n" << g.Logs();
      if (!st.ok()) break;
      for (const auto& t : resp.tokens()) {
        Gen& o = out[t.sequence_id() - first];
        o.tokens.push_back(t.token_id());
        if (t.prompt_logits_size() > 0) {
          o.prompt_logits.assign(t.prompt_logits().begin(), t.prompt_logits().end());
        }
      }
      req.clear_add();
    }
    return out;
  };
  auto variant = [](int64_t id) {
    return id == 0 ? "base" : id == 2 ? "adapter_2d" : "adapter_3d";
  };
  const std::vector<std::pair<size_t, int64_t>> mixed = {{0, 2}, {1, 3}, {3, 0}};
  const std::vector<std::pair<size_t, int64_t>> swapped = {{1, 2}, {0, 3}, {3, 0}};
  for (const auto& reqs : {mixed, swapped}) {
    const auto batch = run(reqs);
    for (size_t i = 0; i < reqs.size(); ++i) {
      const auto [k, adapter] = reqs[i];
      const auto alone = run({reqs[i]});
      const testing::MmPrompt& p = prompts[k];
      EXPECT_EQ(batch[i].tokens, p.continuation.at(variant(adapter)))
          << c.tag << " prompt " << k << " " << variant(adapter) << " in the batch";
      EXPECT_EQ(alone[0].tokens, batch[i].tokens) << c.tag << " prompt " << k;
      const auto& want = p.logits.at(variant(adapter));
      const size_t V = want.size() / p.rows.size();
      std::vector<float> rows;
      for (int64_t r : p.rows) {
        if ((r + 1) * V > batch[i].prompt_logits.size()) break;
        rows.insert(rows.end(), batch[i].prompt_logits.begin() + r * V,
                    batch[i].prompt_logits.begin() + (r + 1) * V);
      }
      const float d = MaxAbsDiff(rows, want);
      std::printf("[ref] %s %s prompt %zu %s: max |logit - HF| = %.3g\n", fx.c_str(), c.tag, k,
                  variant(adapter), d);
      EXPECT_LE(d, 1e-4f) << c.tag << " prompt " << k << " " << variant(adapter);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, WorkerVisionTest,
    ::testing::Values(VisionCase{"qwen3_vl_moe_mm", 1, {}, "tp1"},
                      VisionCase{"qwen3_vl_moe_mm", 2, {"--enable-expert-parallel"}, "tp2_ep"},
                      VisionCase{"qwen3_vl_moe_mm", 2, {"--fully-sharded-loras"}, "tp2_fs"},
                      VisionCase{"qwen3_5_moe_mm", 1, {}, "tp1"},
                      VisionCase{"qwen3_5_moe_mm", 2, {"--enable-expert-parallel"}, "tp2_ep"},
                      VisionCase{"qwen3_5_moe_mm", 2, {"--fully-sharded-loras"}, "tp2_fs"}),
    [](const ::testing::TestParamInfo<VisionCase>& i) {
      return std::string(i.param.fixture) + "_" + i.param.tag;
    });

INSTANTIATE_TEST_SUITE_P(
    Fixtures, WorkerTpTest,
    ::testing::Values(
        Case{"qwen3_moe", true, {"adapter_2d", "adapter_3d"}},
        Case{"qwen3_vl_moe", false, {"adapter_3d"}},
        Case{"qwen3_vl_moe", true, {"adapter_2d", "adapter_3d"}},
        // Qwen3.5-MoE at TP=2: heads, GDN value/key heads
        // and conv sections sharded.
        Case{"qwen3_5_moe", false, {"adapter_3d"}},
        Case{"qwen3_5_moe", true, {"adapter_2d", "adapter_3d"}},
        // GPT-OSS: sinks and biases sharded by head, the down bias added once.
        Case{"gpt_oss_lm", false, {"adapter_3d"}},
        Case{"gpt_oss_lm", true, {"adapter_3d"}, {"--enable-expert-parallel"}, "_ep"},
        Case{"gpt_oss_lm", true, {"adapter_2d", "adapter_3d"}},
        Case{"gpt_oss_lm",
             true,
             {"adapter_3d", "adapter_2d"},
             {"--fully-sharded-loras"},
             "_fully_sharded_swapped"},
        // MXFP4 experts: each rank's half of the intermediate dim (whole blocks of 32), and
        // whole experts per rank.
        Case{"gpt_oss_mxfp4", true, {"adapter_2d", "adapter_3d"}},
        Case{"gpt_oss_mxfp4", true, {"adapter_3d"}, {"--enable-expert-parallel"}, "_ep"},
        // Block FP8: attention rows and columns and each expert's halves split on whole blocks.
        Case{"qwen3_moe_fp8", true, {"adapter_2d", "adapter_3d"}},
        Case{"qwen3_moe_fp8", true, {"adapter_3d"}, {"--enable-expert-parallel"}, "_ep"},
        // Qwen3.5's merged in_proj_qkv: each of its sections split on whole blocks.
        Case{"qwen3_5_moe_fp8", true, {"adapter_2d", "adapter_3d"}},
        // The upstream mixed 2D/3D test at TP=2 with expert parallelism and
        // with fully sharded LoRAs, in both orders.
        Case{
            "qwen3_5_moe", true, {"adapter_2d", "adapter_3d"}, {"--enable-expert-parallel"}, "_ep"},
        Case{"qwen3_5_moe",
             true,
             {"adapter_3d", "adapter_2d"},
             {"--enable-expert-parallel"},
             "_ep_swapped"},
        Case{"qwen3_moe", true, {"adapter_2d", "adapter_3d"}, {"--enable-expert-parallel"}, "_ep"},
        Case{"qwen3_5_moe",
             true,
             {"adapter_2d", "adapter_3d"},
             {"--fully-sharded-loras"},
             "_fully_sharded"},
        Case{"qwen3_5_moe",
             true,
             {"adapter_3d", "adapter_2d"},
             {"--fully-sharded-loras"},
             "_fully_sharded_swapped"},
        Case{"qwen3_moe",
             true,
             {"adapter_2d", "adapter_3d"},
             {"--fully-sharded-loras", "--enable-expert-parallel"},
             "_fully_sharded_ep"},
        // Step3.5: full (2 heads per rank) and sliding (3 per rank) layers, the head-wise gate
        // and g_proj LoRA sharded by head, the dense layer's MLP; plain TP, expert
        // parallelism and fully sharded LoRAs, in both orders.
        Case{"step3p5", false, {"adapter_2d"}},
        // Step3: wq and o_proj sharded by head, the one KV head, q_proj and inter_norm
        // replicated.
        Case{"step3", false, {"adapter_2d"}},
        // The kernel path (the fused MoE call through the CPU twins) with expert parallelism:
        // other ranks' assignments masked to weight 0.
        Case{"step3p5",
             true,
             {"adapter_2d", "adapter_3d"},
             {"--enable-expert-parallel", "--device", "cpu-twins"},
             "_ep_kernel_twins"},
        Case{"step3", true, {"adapter_2d", "adapter_3d"}},
        Case{"step3", true, {"adapter_3d", "adapter_2d"}, {"--enable-expert-parallel"}, "_ep"},
        Case{"step3",
             true,
             {"adapter_2d", "adapter_3d"},
             {"--fully-sharded-loras"},
             "_fully_sharded"},
        Case{"step3p5", true, {"adapter_2d", "adapter_3d"}},
        Case{"step3p5", true, {"adapter_2d", "adapter_3d"}, {"--enable-expert-parallel"}, "_ep"},
        Case{"step3p5",
             true,
             {"adapter_3d", "adapter_2d"},
             {"--enable-expert-parallel"},
             "_ep_swapped"},
        Case{"step3p5",
             true,
             {"adapter_2d", "adapter_3d"},
             {"--fully-sharded-loras"},
             "_fully_sharded"},
        Case{"step3p5",
             true,
             {"adapter_3d", "adapter_2d"},
             {"--fully-sharded-loras"},
             "_fully_sharded_swapped"}),
    [](const auto& info) {
      return std::string(info.param.arch) + (info.param.mixed ? "_mixed" : "_native") +
             info.param.tag;
    });

TEST(WorkerProcessTest, RejectedAdaptersGetClearCodesAndChangeNothing) {
  WorkerGroup g(Data("qwen3_moe/model"), 1, {"--max-loras", "2"});
  ASSERT_TRUE(g.WaitReady()) << g.Logs();
  grpc::Status s = g.Load(1, Data("qwen3_moe/adapter_3d"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::FAILED_PRECONDITION);
  EXPECT_THAT(s.error_message(), HasSubstr("--enable-mixed-moe-lora-format"));
  s = g.Load(1, Data("qwen3_moe/missing"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::NOT_FOUND);
  s = g.Load(1, Data("qwen3_moe/adapter_2d"), v1::FORMAT_3D);
  EXPECT_EQ(s.error_code(), grpc::StatusCode::INVALID_ARGUMENT);
  EXPECT_THAT(s.error_message(), HasSubstr("adapter_model.safetensors"));
  // Both slots are still free.
  ASSERT_TRUE(g.Load(1, Data("qwen3_moe/adapter_2d")).ok());
  ASSERT_TRUE(g.Load(2, Data("qwen3_moe/adapter_2d_shared_a")).ok());
  s = g.Load(3, Data("qwen3_moe/adapter_3d_as_2d"));
  EXPECT_EQ(s.error_code(), grpc::StatusCode::RESOURCE_EXHAUSTED);
  // Steps with a bad joiner fail whole; the good ones then run.
  v1::StepRequest bad;
  auto* seq = bad.add_add();
  seq->set_sequence_id(1);
  seq->set_adapter_id(9);
  seq->add_prompt_token_ids(1);
  seq->set_max_tokens(4);  // 1 .. max_model_len - prompt, as the controller requires too
  v1::StepResponse resp;
  EXPECT_EQ(g.Step(bad, &resp).error_code(), grpc::StatusCode::NOT_FOUND);
  seq->set_adapter_id(1);
  ASSERT_TRUE(g.Step(bad, &resp).ok());
  EXPECT_EQ(resp.tokens_size(), 1);

  grpc::ClientContext ctx;
  v1::WorkerInfoResponse info;
  ASSERT_TRUE(g.stub(0).Info(&ctx, {}, &info).ok());
  EXPECT_EQ(info.architecture(), "Qwen3MoeForCausalLM");
  EXPECT_EQ(info.native_moe_format(), v1::FORMAT_2D);
  EXPECT_EQ(info.max_loras(), 2);
}

// A call sent ahead (after_step) waits until the call it names has ended, then continues the
// batch: the tokens come out as from calls sent one after the other. One that waits past its
// deadline, or is cancelled, fails without stepping.
TEST(WorkerProcessTest, ACallSentAheadRunsAfterTheCallItNames) {
  WorkerGroup g(Data("qwen3_moe/model"), 1);
  ASSERT_TRUE(g.WaitReady()) << g.Logs();
  auto call = [&](int64_t step, int64_t after, int steps, std::vector<int32_t>* tokens,
                  int64_t add_id = 0, std::chrono::milliseconds deadline = std::chrono::seconds(60),
                  grpc::ClientContext* given = nullptr) {
    v1::StepRequest req;
    req.set_step(step);
    req.set_after_step(after);
    req.set_decode_steps(steps);
    if (add_id != 0) {
      v1::SequenceSpec* s = req.add_add();
      s->set_sequence_id(add_id);
      for (int32_t t : {5, 17, 42, 9}) s->add_prompt_token_ids(t);
      s->set_max_tokens(40);
    }
    grpc::ClientContext own;
    grpc::ClientContext* ctx = given != nullptr ? given : &own;
    ctx->set_deadline(std::chrono::system_clock::now() + deadline);
    v1::StepResponse resp;
    const grpc::Status st = g.stub(0).Step(ctx, req, &resp);
    for (const auto& t : resp.tokens()) tokens->push_back(t.token_id());
    return st;
  };
  // The reference: sequence 1 in calls one after the other (prefill, then 2 + 3 + 1 steps).
  std::vector<int32_t> want;
  ASSERT_TRUE(call(1, 0, 1, &want, /*add_id=*/1).ok());
  ASSERT_TRUE(call(2, 0, 2, &want).ok());
  ASSERT_TRUE(call(3, 0, 3, &want).ok());
  ASSERT_TRUE(call(4, 0, 1, &want).ok());
  ASSERT_EQ(want.size(), 7u);
  v1::StepRequest end;
  end.set_step(5);
  end.add_remove(1);
  v1::StepResponse ignored;
  ASSERT_TRUE(g.Step(end, &ignored).ok());

  // The same prompt again (sequence 2); the call for steps 8 goes out first and waits for 7.
  std::vector<int32_t> got, ahead;
  ASSERT_TRUE(call(6, 0, 1, &got, /*add_id=*/2).ok());
  auto later = std::async(std::launch::async, [&] { return call(8, 7, 3, &ahead); });
  EXPECT_EQ(later.wait_for(std::chrono::milliseconds(300)), std::future_status::timeout)
      << "the call sent ahead ran before the call it names";
  ASSERT_TRUE(call(7, 0, 2, &got).ok());
  ASSERT_TRUE(later.get().ok());
  got.insert(got.end(), ahead.begin(), ahead.end());

  // Waiting for a call that never comes: DEADLINE_EXCEEDED, or CANCELLED, and no step.
  std::vector<int32_t> none;
  const grpc::Status late = call(9, 99, 2, &none, 0, std::chrono::milliseconds(300));
  EXPECT_EQ(late.error_code(), grpc::StatusCode::DEADLINE_EXCEEDED) << late.error_message();
  grpc::ClientContext cancelled;
  auto waiting = std::async(std::launch::async, [&] {
    return call(10, 98, 2, &none, 0, std::chrono::seconds(60), &cancelled);
  });
  std::this_thread::sleep_for(std::chrono::milliseconds(200));
  cancelled.TryCancel();
  ASSERT_EQ(waiting.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  EXPECT_EQ(waiting.get().error_code(), grpc::StatusCode::CANCELLED);
  EXPECT_TRUE(none.empty());
  ASSERT_TRUE(call(11, 0, 1, &got).ok());
  EXPECT_EQ(got, want);
}

// Whoever reaches a worker's port stages only adapters under the worker's own --adapter-root:
// an absolute path elsewhere, a ".." escape and a symlink out of the root are refused, and a
// worker without a root stages nothing.
TEST(WorkerProcessTest, StageAdapterReadsOnlyUnderItsAdapterRoot) {
  ::moelora::testing::TempDir root;
  std::filesystem::create_symlink(Data("qwen3_moe/adapter_2d"), root.path() + "/outside");
  std::filesystem::create_directories(root.path() + "/sub");
  std::filesystem::copy(Data("qwen3_moe/adapter_2d"), root.path() + "/sub/inside");
  WorkerGroup g(Data("qwen3_moe/model"), 1, {"--adapter-root", root.path()});
  ASSERT_TRUE(g.WaitReady()) << g.Logs();
  EXPECT_TRUE(g.Load(1, root.path() + "/sub/inside").ok());
  EXPECT_TRUE(g.Load(2, "sub/inside").ok()) << "relative to the root";
  for (const std::string& p :
       {Data("qwen3_moe/adapter_2d"), root.path() + "/sub/../../x",
        std::string("../") + Data("qwen3_moe/adapter_2d"), root.path() + "/outside"}) {
    const grpc::Status s = g.Load(3, p);
    EXPECT_EQ(s.error_code(), grpc::StatusCode::PERMISSION_DENIED)
        << p << ": " << s.error_message();
    EXPECT_THAT(s.error_message(), HasSubstr("--adapter-root")) << p;
  }
  WorkerGroup none(Data("qwen3_moe/model"), 1, {"--adapter-root="});
  ASSERT_TRUE(none.WaitReady()) << none.Logs();
  EXPECT_EQ(none.Load(1, Data("qwen3_moe/adapter_2d")).error_code(),
            grpc::StatusCode::FAILED_PRECONDITION);
}

TEST(WorkerProcessTest, MetricsReportAdapterLoadPhasesAndTokens) {
  WorkerGroup g(Data("qwen3_vl_moe/model"), 1, {"--enable-mixed-moe-lora-format"});
  ASSERT_TRUE(g.WaitReady()) << g.Logs();
  v1::StageAdapterResponse staged;
  ASSERT_TRUE(g.Load(1, Data("qwen3_vl_moe/adapter_3d"), v1::FORMAT_UNSPECIFIED, &staged).ok());
  EXPECT_EQ(staged.detected_format(), v1::FORMAT_3D);
  EXPECT_TRUE(staged.converted_to_2d());
  EXPECT_EQ(staged.rank(), 4);
  EXPECT_EQ(g.Load(2, Data("qwen3_vl_moe/nope")).error_code(), grpc::StatusCode::NOT_FOUND);
  Generate(g, {1, 0}, {{1, 2, 3}, {4, 5}}, 3);
  const std::string m = ::moelora::testing::HttpGet(g.metrics_port(0), "/metrics");
  EXPECT_THAT(m, HasSubstr("moelora_adapter_load_seconds_count{rank=\"0\",converted=\"true\","
                           "format=\"3d\",phase=\"convert\"} 1"));
  EXPECT_THAT(m, HasSubstr("phase=\"total\""));
  EXPECT_THAT(m,
              HasSubstr("moelora_adapter_load_failures_total{rank=\"0\",reason=\"not_found\"} 1"));
  EXPECT_THAT(m, HasSubstr("moelora_generated_tokens_total{rank=\"0\"} 6"));
  EXPECT_THAT(m, HasSubstr("moelora_adapters{rank=\"0\",state=\"loaded\"} 1"));
  EXPECT_THAT(m, HasSubstr("moelora_batch_distinct_adapters_count{rank=\"0\"} 3"));
  // The two calls that continued running sequences (the prefill's found none running).
  EXPECT_THAT(m, HasSubstr("moelora_step_idle_seconds_count{rank=\"0\"} 2"));
  grpc::ClientContext ctx;
  v1::WorkerInfoResponse info;
  ASSERT_TRUE(g.stub(0).Info(&ctx, {}, &info).ok());
  EXPECT_EQ(info.native_moe_format(), v1::FORMAT_3D);
  EXPECT_GT(info.skipped_tensors_size(), 0);  // the vision tower
  EXPECT_THAT(info.skipped_tensors(0), HasSubstr("model.visual."));
}

TEST(WorkerProcessTest, StartupFailuresExitNonZeroWithAReason) {
  {
    WorkerGroup g(Data("qwen3_moe/no_such_model"), 1);
    EXPECT_EQ(g.process(0).WaitExit(std::chrono::seconds(30)), 1);
    EXPECT_THAT(g.process(0).Log(), HasSubstr("model directory does not exist"));
  }
  {
    WorkerGroup g(Data("gpt_oss/model"), 1);  // a served architecture, config only: no weights
    EXPECT_EQ(g.process(0).WaitExit(std::chrono::seconds(30)), 1);
    EXPECT_THAT(g.process(0).Log(), HasSubstr("gpt_oss/model: no *.safetensors weights"));
  }
  {
    WorkerGroup g(Data("qwen3_moe/model"), 1, {"--no-such-flag"});
    EXPECT_EQ(g.process(0).WaitExit(std::chrono::seconds(30)), 1);
  }
  {
    WorkerGroup g(Data("qwen3_moe/model"), 1, {"--device", "tpu"});
    EXPECT_EQ(g.process(0).WaitExit(std::chrono::seconds(30)), 1);
    EXPECT_THAT(g.process(0).Log(), HasSubstr("expected cpu, cuda, cuda:N or cpu-twins"));
  }
  if (!CudaDeviceAvailable()) {
    WorkerGroup g(Data("qwen3_moe/model"), 1, {"--device", "cuda"});
    EXPECT_EQ(g.process(0).WaitExit(std::chrono::seconds(30)), 1);
    EXPECT_THAT(g.process(0).Log(), HasSubstr("--device cuda: "));
  }
}

// The GPU code path through the kernels' CPU twins, as a real worker process.
TEST(WorkerProcessTest, CpuTwinsWorkerServesMixedAdapters) {
  WorkerGroup g(Data("qwen3_moe/model"), 1,
                {"--device", "cpu-twins", "--enable-mixed-moe-lora-format"});
  ASSERT_TRUE(g.WaitReady()) << g.Logs();
  ASSERT_TRUE(g.Load(1, Data("qwen3_moe/adapter_3d")).ok());
  ASSERT_TRUE(g.Load(2, Data("qwen3_moe/adapter_2d")).ok());
  auto ref = ReadExpected(Data("qwen3_moe/expected_logits.safetensors"));
  // One batch: [3D adapter, 2D adapter, base], each against transformers + PEFT.
  const std::vector<std::string> variants = {"adapter_3d", "adapter_2d", "base"};
  auto gen = Generate(g, {1, 2, 0}, {ref.prompts[0], ref.prompts[1], ref.prompts[2]}, 2);
  ASSERT_EQ(gen.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    const auto& want = ref.logits.at(variants[i])[i];
    ASSERT_EQ(gen[i].prompt_logits.size(), want.size()) << variants[i];
    EXPECT_LE(MaxAbsDiff(gen[i].prompt_logits, want), 1e-4f) << variants[i];
  }
}

}  // namespace
}  // namespace moelora
