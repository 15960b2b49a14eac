// GPT-OSS against transformers + PEFT (tests/data/gpt_oss_lm, tools/make_fixtures.py): sinks,
// attention biases, alternating sliding (4) / full layers, YaRN (truncate false), the biased
// top-k-then-softmax router, expert biases and the clamped SwiGLU over interleaved gate/up; the
// PEFT 3D adapter natively (interleaved B rows) and converted to 2D in mixed mode.
#include <unistd.h>

#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"
#include "tests/unit/worker/engine_test_util.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::GenerateBatch;
using ::moelora::testing::Generation;
using ::moelora::testing::Load;
using ::moelora::testing::MakeEngine;
using ::moelora::testing::MaxAbsDiff;
using ::moelora::testing::PromptLogits;
using ::moelora::testing::ReadExpected;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

TEST(GptOssTest, PrefillLogitsMatchTransformersAndPeft) {
  auto ref = ReadExpected(Data("gpt_oss_lm/expected_logits.safetensors"));
  ASSERT_EQ(ref.prompts.size(), 3u);
  for (bool mixed : {false, true}) {
    auto h = MakeEngine("gpt_oss_lm/model", mixed, 4, 8);
    ASSERT_NE(h, nullptr);
    ASSERT_OK(Load(*h->engine, 1, "gpt_oss_lm/adapter_3d"));
    std::vector<std::pair<int64_t, const char*>> cases = {{0, "base"}, {1, "adapter_3d"}};
    if (mixed) {
      // The per-expert twin of the 3D adapter (tools/make_fixtures.py, interleaved gate/up
      // split by FORMATS.md §7.4): PEFT's 3D logits.
      ASSERT_OK(Load(*h->engine, 2, "gpt_oss_lm/adapter_2d"));
      cases.push_back({2, "adapter_2d"});
    } else {
      EXPECT_THAT(Load(*h->engine, 2, "gpt_oss_lm/adapter_2d"),
                  StatusIs(absl::StatusCode::kFailedPrecondition,
                           HasSubstr("--enable-mixed-moe-lora-format")));
    }
    for (auto [id, variant] : cases) {
      float worst = 0;
      for (size_t k = 0; k < ref.prompts.size(); ++k) {
        auto got = PromptLogits(*h->engine, id, ref.prompts[k], 1 + k);
        worst = std::max(worst, MaxAbsDiff(got, ref.logits.at(variant)[k]));
      }
      std::printf("[ref] gpt_oss %s mixed=%d: max |logit - HF| = %.3g\n", variant, mixed, worst);
      EXPECT_LE(worst, 1e-4f) << variant << " mixed=" << mixed;
    }
  }
}

// Decode steps over the window: greedy tokens of a prompt longer than the 4-token window, one
// at a time, equal the prefill logits' argmax chain of transformers at each position.
TEST(GptOssTest, MixedBatchEqualsAloneAndDecodePastTheWindow) {
  auto h = MakeEngine("gpt_oss_lm/model", true, 4, 8);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "gpt_oss_lm/adapter_3d"));
  ASSERT_OK(Load(*h->engine, 2, "gpt_oss_lm/adapter_2d"));
  const std::vector<std::vector<int32_t>> prompts = {{1, 17, 42, 5, 88, 13, 70}, {7, 2, 95}, {4}};
  std::vector<Generation> batch;
  for (const std::vector<int64_t>& order :
       {std::vector<int64_t>{1, 2, 0}, std::vector<int64_t>{2, 1, 0}}) {
    batch = GenerateBatch(*h->engine, order, prompts, 8);
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto alone = GenerateBatch(*h->engine, {order[i]}, {prompts[i]}, 8, 300);
      EXPECT_EQ(alone[0].tokens, batch[i].tokens) << "adapter " << order[i];
      for (size_t t = 0; t < alone[0].logits.size(); ++t) {
        EXPECT_LE(MaxAbsDiff(alone[0].logits[t], batch[i].logits[t]), 1e-5f);
      }
    }
  }
  batch = GenerateBatch(*h->engine, {1, 0}, {prompts[0], prompts[1]}, 8);
  // Decoding past the window agrees with a prefill of the same tokens (the KV cache and the
  // window mask of single-token steps against the prefill's).
  std::vector<int32_t> seq = prompts[0];
  seq.insert(seq.end(), batch[0].tokens.begin(), batch[0].tokens.end() - 1);
  auto full = PromptLogits(*h->engine, 1, seq, 900);
  const size_t V = batch[0].logits[0].size();
  for (size_t t = 0; t < batch[0].logits.size(); ++t) {
    const size_t row = prompts[0].size() - 1 + t;
    std::vector<float> r(full.begin() + row * V, full.begin() + (row + 1) * V);
    EXPECT_LE(MaxAbsDiff(batch[0].logits[t], r), 1e-5f) << "step " << t;
  }
}

TEST(GptOssTest, BaseRowsBitIdenticalWithAdaptersLoaded) {
  auto plain = MakeEngine("gpt_oss_lm/model", true, 4, 8);
  auto loaded = MakeEngine("gpt_oss_lm/model", true, 4, 8);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(loaded, nullptr);
  ASSERT_OK(Load(*loaded->engine, 1, "gpt_oss_lm/adapter_3d"));
  ASSERT_OK(Load(*loaded->engine, 2, "gpt_oss_lm/adapter_2d"));
  const std::vector<std::vector<int32_t>> prompts = {{1, 17, 42, 5, 88, 13}, {7, 2, 95}};
  ::moelora::testing::ExpectBitIdentical(GenerateBatch(*plain->engine, {0, 0}, prompts, 6),
                                         GenerateBatch(*loaded->engine, {0, 0}, prompts, 6));
}

TEST(GptOssTest, TheKernelPathAndMxfp4AreRefusedByName) {
  EngineOptions o;
  o.model_dir = Data("gpt_oss_lm/model");
  o.device = "cpu-twins";
  auto comm = MakeLocalCommunicator();
  EXPECT_THAT(Engine::Create(o, comm.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CPU path only")));
  // An MXFP4 release's config: refused, saying so.
  namespace fs = std::filesystem;
  const fs::path dir = fs::temp_directory_path() / ("moelora_gptoss_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  fs::copy_file(Data("gpt_oss_lm/model/model.safetensors"), dir / "model.safetensors");
  std::ifstream in(Data("gpt_oss_lm/model/config.json"));
  nlohmann::json j = nlohmann::json::parse(in);
  j["quantization_config"] = {{"quant_method", "mxfp4"}};
  std::ofstream(dir / "config.json") << j.dump();
  o.model_dir = dir.string();
  o.device = "cpu";
  EXPECT_THAT(Engine::Create(o, comm.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("MXFP4 checkpoints")));
  fs::remove_all(dir);
}

}  // namespace
}  // namespace moelora
