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

}  // namespace
}  // namespace moelora
