// Block-FP8 bases (tests/data/qwen3_moe_fp8 and qwen3_5_moe_fp8, tools/make_fixtures.py): attention
// projections and per-expert weights read as stored (float8_e4m3fn codes, one scale per block), the
// modules the config keeps unquantized read as they are, against the model with torch's
// dequantization of the same weights, with PEFT's 3D adapter natively and converted to 2D.
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/unit/worker/engine_test_util.h"

namespace moelora {
namespace {

using ::moelora::testing::Load;
using ::moelora::testing::MakeEngine;

TEST(Fp8Test, PrefillLogitsMatchTheDequantizedReference) {
  ::moelora::testing::ExpectReferenceLogitsInBothModes("qwen3_moe_fp8", "adapter_2d", "adapter_3d",
                                                       1e-4f);
}

// Qwen3.5 as its FP8 releases store it: the Gated DeltaNet projections quantized too (BF16
// scales), in_proj_a/b and conv1d kept as they are.
TEST(Fp8Test, Qwen35PrefillLogitsMatchTheDequantizedReference) {
  ::moelora::testing::ExpectReferenceLogitsInBothModes("qwen3_5_moe_fp8", "adapter_3d",
                                                       "adapter_2d", 1e-4f);
}

TEST(Fp8Test, MixedBatchEqualsAloneAndDecodeEqualsPrefill) {
  auto h = MakeEngine("qwen3_moe_fp8/model", true, 4, 8);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "qwen3_moe_fp8/adapter_3d"));
  ASSERT_OK(Load(*h->engine, 2, "qwen3_moe_fp8/adapter_2d"));
  ::moelora::testing::ExpectBatchesEqualAloneAndDecodeEqualsPrefill(
      *h->engine, {{1, 2, 0}, {2, 1, 0}}, {{1, 17, 42, 5, 88, 13, 70}, {7, 2, 95}, {4}}, 8);
}

// Step3.5 with every projection block-FP8, the stacked experts included (tests/data/step3p5_fp8:
// the step3p5 fixture's weights quantized by torch, and their dequantized f32 twin): the same
// prompt logits from the FP8 checkpoint as from the twin, base and with the fixture's 2D and 3D
// adapters. The twin's path is the one checked against the independent Step3.5 reference.
TEST(Fp8Test, Step35StackedExpertsEqualTheirDequantizedTwin) {
  auto fp8 = MakeEngine("step3p5_fp8/model", true, 4, 8);
  auto f32 = MakeEngine("step3p5_fp8/model_dequantized", true, 4, 8);
  ASSERT_NE(fp8, nullptr);
  ASSERT_NE(f32, nullptr);
  for (auto* h : {fp8.get(), f32.get()}) {
    ASSERT_OK(Load(*h->engine, 1, "step3p5/adapter_2d"));
    ASSERT_OK(Load(*h->engine, 2, "step3p5/adapter_3d"));
  }
  const std::vector<std::vector<int32_t>> prompts = {{1, 17, 42, 5, 88, 13, 70, 2, 9}, {7, 2, 95}};
  for (int64_t adapter : {0, 1, 2}) {
    for (size_t k = 0; k < prompts.size(); ++k) {
      const auto a = ::moelora::testing::PromptLogits(*fp8->engine, adapter, prompts[k]);
      const auto b = ::moelora::testing::PromptLogits(*f32->engine, adapter, prompts[k]);
      ASSERT_FALSE(a.empty());
      EXPECT_LE(::moelora::testing::MaxAbsDiff(a, b), 1e-5f)
          << "adapter " << adapter << " prompt " << k;
    }
  }
}

}  // namespace
}  // namespace moelora
