// Step3 text against the independent torch reference of tools/step3_reference.py (transformers
// has no class for it): MQA with the shared low-rank query (q_proj → inter_norm → wq) and one
// KV head, a dense layer and two MoE layers (softmax top-k, renormalised, ungated shared
// expert); a 2D adapter on every linear module and the experts, a 3D adapter on the experts and
// wq / o_proj (reference: the model with each merged).
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/unit/worker/engine_test_util.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::GenerateBatch;
using ::moelora::testing::Load;
using ::moelora::testing::MakeEngine;
using ::moelora::testing::MaxAbsDiff;
using ::moelora::testing::PromptLogits;
using ::moelora::testing::ReadExpected;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

TEST(Step3Test, PrefillLogitsMatchTheReference) {
  ::moelora::testing::ExpectReferenceLogitsInBothModes("step3", "adapter_2d", "adapter_3d", 1e-4f);
}

// Mixed batches equal each request alone in both orders; decode steps equal a prefill of the
// same tokens; base rows bit-identical with adapters loaded.
TEST(Step3Test, MixedBatchesDecodeAndBaseRows) {
  auto h = MakeEngine("step3/model", true, 4, 8);
  auto plain = MakeEngine("step3/model", true, 4, 8);
  ASSERT_NE(h, nullptr);
  ASSERT_NE(plain, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "step3/adapter_2d"));
  ASSERT_OK(Load(*h->engine, 2, "step3/adapter_3d"));
  ::moelora::testing::ExpectBatchesEqualAloneAndDecodeEqualsPrefill(
      *h->engine, {{1, 2, 0}, {2, 1, 0}}, {{1, 17, 42, 5, 88, 13, 70}, {7, 2, 95}, {4}}, 6);
  const std::vector<std::vector<int32_t>> base_prompts = {{1, 17, 42, 5}, {7, 2, 95}};
  ::moelora::testing::ExpectBitIdentical(GenerateBatch(*plain->engine, {0, 0}, base_prompts, 5),
                                         GenerateBatch(*h->engine, {0, 0}, base_prompts, 5));
}

// The GPU code path through the CPU twins and bf16, against the reference's f32 logits. The
// logits reach |5.3|; the reference itself run in bf16 is 0.47 (base) and 0.10 (adapter_3d)
// from its f32 logits on this prompt (measured 2026-12-01), hence 0.5: no closer than the
// reference's own bf16 run can be asked of a bf16 computation (ours was 0.44 / 0.09 once the CPU
// bf16 GEMMs ran as f32 BLAS and the skinny kernel, rounding at other points than before).
TEST(Step3Test, KernelTwinsAndBfloat16StayClose) {
  auto ref = ReadExpected(Data("step3/expected_logits.safetensors"));
  for (auto [dtype, device, tol] :
       {std::tuple<const char*, const char*, float>{"float32", "cpu-twins", 1e-4f},
        {"bfloat16", "cpu", 0.5f}}) {
    auto h = MakeEngine("step3/model", true, 4, 8, dtype, device);
    ASSERT_NE(h, nullptr);
    ASSERT_OK(Load(*h->engine, 2, "step3/adapter_3d"));
    for (auto [id, variant] : {std::pair<int64_t, const char*>{0, "base"}, {2, "adapter_3d"}}) {
      const float d =
          MaxAbsDiff(PromptLogits(*h->engine, id, ref.prompts[1]), ref.logits.at(variant)[1]);
      std::printf("[ref] step3 %s %s %s: max |logit - reference f32| = %.3g\n", device, dtype,
                  variant, d);
      EXPECT_LE(d, tol) << device << " " << dtype << " " << variant;
    }
  }
}

}  // namespace
}  // namespace moelora
