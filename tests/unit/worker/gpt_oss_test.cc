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
  // 3D-native; the 2D twin (its reference is PEFT's 3D logits) needs mixed mode.
  ::moelora::testing::ExpectReferenceLogitsInBothModes("gpt_oss_lm", "adapter_3d", "adapter_2d",
                                                       1e-4f);
}

// Mixed batches [3D, 2D, base] equal each request alone in both orders; decode steps past the
// 4-token window equal a prefill of the same tokens.
TEST(GptOssTest, MixedBatchEqualsAloneAndDecodePastTheWindow) {
  auto h = MakeEngine("gpt_oss_lm/model", true, 4, 8);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "gpt_oss_lm/adapter_3d"));
  ASSERT_OK(Load(*h->engine, 2, "gpt_oss_lm/adapter_2d"));
  ::moelora::testing::ExpectBatchesEqualAloneAndDecodeEqualsPrefill(
      *h->engine, {{1, 2, 0}, {2, 1, 0}}, {{1, 17, 42, 5, 88, 13, 70}, {7, 2, 95}, {4}}, 8);
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
