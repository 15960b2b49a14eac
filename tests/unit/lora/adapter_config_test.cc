#include "lora/adapter_config.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::IsOk;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

TEST(AdapterConfig, ParsesPeftFields) {
  auto c = ParseAdapterConfig(R"({"r": 8, "lora_alpha": 16, "use_rslora": true,
      "target_modules": ["q_proj", "v_proj"], "target_parameters": ["mlp.experts.gate_up_proj"],
      "rank_pattern": {"q_proj": 4}, "alpha_pattern": {".*\\.gate_up_proj": 32},
      "modules_to_save": null, "bias": "none", "base_model_name_or_path": "Qwen/Qwen3-30B-A3B"})",
                              "cfg.json");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(c->r, 8);
  EXPECT_EQ(c->lora_alpha, 16);
  EXPECT_TRUE(c->use_rslora);
  EXPECT_EQ(c->target_modules, (std::vector<std::string>{"q_proj", "v_proj"}));
  EXPECT_EQ(c->target_parameters.size(), 1u);
  EXPECT_EQ(c->base_model_name_or_path, "Qwen/Qwen3-30B-A3B");
  // PEFT's get_pattern_key: "(.*\.)?(KEY)$" against the full name.
  EXPECT_EQ(c->RankFor("model.layers.0.self_attn.q_proj"), 4);
  EXPECT_EQ(c->RankFor("model.layers.0.self_attn.v_proj"), 8);
  EXPECT_EQ(c->RankFor("model.layers.0.self_attn.xq_proj"), 8);  // must match at a dot boundary
  EXPECT_EQ(c->AlphaFor("model.layers.0.mlp.experts.gate_up_proj"), 32);
  EXPECT_EQ(c->AlphaFor("model.layers.0.mlp.experts.down_proj"), 16);
  EXPECT_DOUBLE_EQ(c->ScalingFor(16, 32), 32 / std::sqrt(16.0));
}

TEST(AdapterConfig, TargetModulesAsRegexString) {
  auto c =
      ParseAdapterConfig(R"({"r": 2, "lora_alpha": 2, "target_modules": ".*\\.(q|v)_proj"})", "c");
  ASSERT_THAT(c, IsOk());
  EXPECT_EQ(*c->target_modules_regex, ".*\\.(q|v)_proj");
  EXPECT_DOUBLE_EQ(c->ScalingFor(2, 2), 1.0);
}

TEST(AdapterConfig, RejectsMissingAndInvalidFields) {
  const std::vector<std::pair<std::string, std::string>> cases = {
      {R"({"lora_alpha": 2, "target_modules": ["q_proj"]})", "missing required field(s): r"},
      {R"({"r": 2, "target_modules": ["q_proj"]})", "missing required field(s): lora_alpha"},
      {R"({"r": 2, "lora_alpha": 2})", "missing required field(s): target_modules"},
      {R"({"r": 0, "lora_alpha": 2, "target_modules": ["q_proj"]})", "r must be positive"},
      {R"({"r": -3, "lora_alpha": 2, "target_modules": ["q_proj"]})", "r must be positive"},
      {R"({"r": 2.5, "lora_alpha": 2, "target_modules": ["q_proj"]})", "r must be an integer"},
      {R"({"r": 2, "lora_alpha": NaN, "target_modules": ["q_proj"]})",
       "NaN and Infinity are not numbers"},
      {R"({"r": 2, "lora_alpha": "x", "target_modules": ["q_proj"]})",
       "lora_alpha must be a number"},
      {R"({"r": 2, "lora_alpha": 1e999, "target_modules": ["q_proj"]})", "1e999"},
      {R"({"r": 2, "lora_alpha": 2, "target_modules": "(["})", "regex"},
      {R"({"r": 2, "lora_alpha": 2, "target_modules": [1]})", "list of strings"},
      {R"({"r": 2, "lora_alpha": 2, "target_modules": ["q"], "rank_pattern": {"q": 0}})",
       "rank_pattern"},
      {R"({"r": 2, "lora_alpha": 2, "target_modules": ["q"], "peft_type": "IA3"})", "only LORA"},
      {"not json", "not valid JSON"},
      {"[]", "not a JSON object"},
  };
  for (const auto& [text, message] : cases) {
    EXPECT_THAT(
        ParseAdapterConfig(text, "dir/adapter_config.json"),
        StatusIs(absl::StatusCode::kInvalidArgument,
                 ::testing::AllOf(HasSubstr(message), HasSubstr("dir/adapter_config.json"))))
        << text;
  }
}

TEST(AdapterConfig, ServabilityRefusesDoraModulesToSaveAndBias) {
  auto c = ParseAdapterConfig(
      R"({"r": 2, "lora_alpha": 2, "target_modules": ["q_proj"], "use_dora": true,
      "modules_to_save": ["lm_head"], "bias": "all"})",
      "c.json");
  ASSERT_THAT(c, IsOk());
  auto s = CheckServable(*c, "c.json");
  EXPECT_THAT(s, StatusIs(absl::StatusCode::kInvalidArgument,
                          ::testing::AllOf(HasSubstr("DoRA"), HasSubstr("modules_to_save"),
                                           HasSubstr("bias"))));
}

}  // namespace
}  // namespace moelora
