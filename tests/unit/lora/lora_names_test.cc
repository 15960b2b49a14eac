#include "lora/lora_names.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::IsOk;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

TEST(LoraNames, ParsesLikeVllm) {
  auto n =
      ParseLoraTensorName("base_model.model.model.layers.3.mlp.experts.7.gate_proj.lora_A.weight");
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(n->module, "model.layers.3.mlp.experts.7.gate_proj");
  EXPECT_TRUE(n->is_a);
  n = ParseLoraTensorName("base_model.model.model.layers.3.mlp.experts.base_layer.lora_B.weight");
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(n->module, "model.layers.3.mlp.experts.base_layer");
  EXPECT_FALSE(n->is_a);
  n = ParseLoraTensorName("model.layers.0.self_attn.q_proj.lora_B.weight");  // no base_model.model.
  ASSERT_THAT(n, IsOk());
  EXPECT_EQ(n->module, "model.layers.0.self_attn.q_proj");
}

TEST(LoraNames, RejectsNonLoraTensorsWithHints) {
  EXPECT_THAT(ParseLoraTensorName("base_model.model.model.layers.0.q_proj.lora_magnitude_vector"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("DoRA")));
  EXPECT_THAT(ParseLoraTensorName("base_model.model.model.embed_tokens.lora_embedding_A"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("embedding")));
  EXPECT_THAT(ParseLoraTensorName("base_model.model.model.layers.0.q_proj.lora_B.bias"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("bias")));
  EXPECT_THAT(ParseLoraTensorName("lora_A.weight"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(LoraNames, ClassifiesExpertLayouts) {
  auto c = ClassifyModule("model.layers.3.mlp.experts.7.up_proj");
  EXPECT_EQ(c.kind, ModuleKind::kExpert2D);
  EXPECT_EQ(c.experts_prefix, "model.layers.3.mlp.experts");
  EXPECT_EQ(c.expert, 7);
  EXPECT_EQ(c.proj, ExpertProj::kUp);
  EXPECT_EQ(c.layer, 3);
  EXPECT_EQ(ClassifyModule("model.layers.1.moe.experts.2.w2").proj,
            ExpertProj::kDown);  // Step3 / Mixtral names
  c = ClassifyModule("model.language_model.layers.5.mlp.experts.base_layer");
  EXPECT_EQ(c.kind, ModuleKind::kGateUp3D);
  EXPECT_EQ(c.experts_prefix, "model.language_model.layers.5.mlp.experts");
  EXPECT_EQ(ClassifyModule("model.layers.5.mlp.experts").kind, ModuleKind::kDown3D);
  EXPECT_EQ(ClassifyModule("model.layers.5.self_attn.q_proj").kind, ModuleKind::kDense);
  EXPECT_EQ(ClassifyModule("model.layers.5.mlp.shared_expert.gate_proj").kind, ModuleKind::kDense);
}

}  // namespace
}  // namespace moelora
