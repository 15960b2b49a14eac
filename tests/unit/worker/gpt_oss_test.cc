// GPT-OSS against transformers + PEFT (tests/data/gpt_oss_lm, tools/make_fixtures.py): sinks,
// attention biases, alternating sliding (4) / full layers, YaRN (truncate false), the biased
// top-k-then-softmax router, expert biases and the clamped SwiGLU over interleaved gate/up; the
// PEFT 3D adapter natively (interleaved B rows) and converted to 2D in mixed mode.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
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

TEST(GptOssTest, TheKernelPathIsRefusedByName) {
  EngineOptions o;
  o.device = "cpu-twins";
  auto comm = MakeLocalCommunicator();
  for (const char* model : {"gpt_oss_lm/model", "gpt_oss_mxfp4/model"}) {
    o.model_dir = Data(model);
    EXPECT_THAT(Engine::Create(o, comm.get()).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("CPU path only")))
        << model;
  }
}

// The release's storage (tests/data/gpt_oss_mxfp4, tools/make_fixtures.py): MXFP4 experts read
// as they are stored, against transformers' own loading of the checkpoint (which dequantizes),
// and PEFT's 3D adapter over it, natively and converted to 2D.
TEST(GptOssTest, Mxfp4ExpertsMatchTransformersAndPeft) {
  ::moelora::testing::ExpectReferenceLogitsInBothModes("gpt_oss_mxfp4", "adapter_3d", "adapter_2d",
                                                       1e-4f);
}

TEST(GptOssTest, Mxfp4MixedBatchEqualsAloneAndDecodeEqualsPrefill) {
  auto h = MakeEngine("gpt_oss_mxfp4/model", true, 4, 8);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "gpt_oss_mxfp4/adapter_3d"));
  ASSERT_OK(Load(*h->engine, 2, "gpt_oss_mxfp4/adapter_2d"));
  ::moelora::testing::ExpectBatchesEqualAloneAndDecodeEqualsPrefill(
      *h->engine, {{1, 2, 0}, {2, 1, 0}}, {{1, 17, 42, 5, 88, 13, 70}, {7, 2, 95}, {4}}, 8);
}

}  // namespace
}  // namespace moelora
