// Reading and validating adapters: the committed fixtures (written by PEFT) and synthetic bad ones.
#include "lora/adapter.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>

#include "absl/strings/str_cat.h"
#include "tests/testing/adapter_builder.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using ::moelora::testing::AdapterBuilder;
using ::moelora::testing::IsOk;
using ::moelora::testing::StatusIs;
using ::moelora::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

const std::string kData = MOELORA_TEST_DATA_DIR;

ModelInfo TinyModel() {
  auto m = ReadModelInfo(kData + "/qwen3_moe/model");
  EXPECT_THAT(m, IsOk());
  return *m;
}

TEST(ReadAdapter, DetectsFormatsOfFixtures) {
  auto a3 = ReadAdapter(kData + "/qwen3_moe/adapter_3d");
  ASSERT_THAT(a3, IsOk());
  EXPECT_EQ(a3->format, AdapterFormat::k3D);
  EXPECT_EQ(a3->num_experts, 4);
  EXPECT_TRUE(a3->num_experts_inferred);
  EXPECT_EQ(a3->moe.size(), 2u);
  EXPECT_EQ(a3->dense.size(), 4u);  // q_proj, o_proj x 2 layers
  EXPECT_EQ(a3->max_rank, 4);
  EXPECT_DOUBLE_EQ(a3->moe.begin()->second.gate_up->scaling, 2.0);

  auto a2 = ReadAdapter(kData + "/qwen3_moe/adapter_2d", {.model = TinyModel()});
  ASSERT_THAT(a2, IsOk());
  EXPECT_EQ(a2->format, AdapterFormat::k2D);
  EXPECT_FALSE(a2->num_experts_inferred);
  EXPECT_EQ(a2->moe.begin()->second.experts.size(), 4u);
  EXPECT_EQ(a2->num_tensors(), 2u * (2 * 4 * 3 + 2 * 2));

  auto vl = ReadAdapter(kData + "/qwen3_vl_moe/adapter_3d");
  ASSERT_THAT(vl, IsOk());
  EXPECT_EQ(vl->moe.begin()->first, "model.language_model.layers.0.mlp.experts");
}

TEST(ReadAdapter, DenseAdapterHasNoExperts) {
  TempDir tmp;
  AdapterBuilder b;
  b.Pair("model.layers.0.self_attn.q_proj", 2, 24, 32);
  auto a = ReadAdapter(b.Write(tmp.Sub("dense")));
  ASSERT_THAT(a, IsOk());
  EXPECT_EQ(a->format, AdapterFormat::kDense);
  EXPECT_EQ(a->num_experts, 0);
}

TEST(ReadAdapter, MissingDirectoryIsNotFound) {
  EXPECT_THAT(ReadAdapter("/nonexistent/adapter"), StatusIs(absl::StatusCode::kNotFound));
}

TEST(ReadAdapter, PickleOnlyIsRefused) {
  TempDir tmp;
  const std::string dir = AdapterBuilder().Write(tmp.Sub("p"));
  std::remove((dir + "/adapter_model.safetensors").c_str());
  testing::WriteFile(dir + "/adapter_model.bin", "\x80\x04pickle");
  EXPECT_THAT(ReadAdapter(dir),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("adapter_model.bin"), HasSubstr("pickle"))));
}

TEST(ReadAdapter, MalformedSafetensorsIsInvalidArgument) {
  TempDir tmp;
  const std::string dir = AdapterBuilder().Write(tmp.Sub("m"));
  testing::WriteFile(dir + "/adapter_model.safetensors",
                     std::string("\x05\0\0\0\0\0\0\0{oops", 13));
  EXPECT_THAT(ReadAdapter(dir),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not valid JSON")));
}

struct Case {
  std::string label;
  std::function<void(AdapterBuilder&)> build;
  absl::StatusCode code;
  std::vector<std::string> message_parts;
  AdapterReadOptions options;
};

class BadAdapter : public ::testing::TestWithParam<int> {};

std::vector<Case> BadCases() {
  const std::string L0 = "model.layers.0.mlp.experts";
  std::vector<Case> cases;
  cases.push_back(
      {"lora_A without lora_B",
       [](AdapterBuilder& b) {
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {2, 24});
       },
       absl::StatusCode::kInvalidArgument,
       {"q_proj.lora_A.weight", "no matching lora_B"},
       {}});
  cases.push_back(
      {"1-D tensor",
       [](AdapterBuilder& b) {
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {48});
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {32, 2});
       },
       absl::StatusCode::kInvalidArgument,
       {"q_proj.lora_A.weight", "[48]", "2-D"},
       {}});
  cases.push_back(
      {"empty tensor",
       [](AdapterBuilder& b) {
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {0, 24});
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {32, 0});
       },
       absl::StatusCode::kInvalidArgument,
       {"[0, 24]", "non-empty"},
       {}});
  cases.push_back({"rank not matching config",
                   [](AdapterBuilder& b) { b.Pair("model.layers.0.self_attn.q_proj", 3, 24, 32); },
                   absl::StatusCode::kInvalidArgument,
                   {"q_proj.lora_A.weight", "[3, 24]", "rank 3", "rank 2"},
                   {}});
  cases.push_back(
      {"B columns != A rows",
       [](AdapterBuilder& b) {
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {2, 24});
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {32, 3});
       },
       absl::StatusCode::kInvalidArgument,
       {"[32, 3]", "[2, 24]"},
       {}});
  cases.push_back({"expert index >= E",
                   [L0](AdapterBuilder& b) {
                     b.Experts2D(L0, 4, 2, 24, 10);
                     b.Pair(L0 + ".4.gate_proj", 2, 24, 10);
                   },
                   absl::StatusCode::kInvalidArgument,
                   {"experts.4.gate_proj", "expert index 4", "4 experts"},
                   {.model = TinyModel()}});
  cases.push_back({"missing expert",
                   [L0](AdapterBuilder& b) {
                     b.Pair(L0 + ".0.gate_proj", 2, 24, 10);
                     b.Pair(L0 + ".2.gate_proj", 2, 24, 10);
                   },
                   absl::StatusCode::kInvalidArgument,
                   {"expert 1 has no gate_proj"},
                   {}});
  cases.push_back({"2D and 3D mixed",
                   [L0](AdapterBuilder& b) {
                     b.Experts2D(L0, 4, 2, 24, 10);
                     b.Experts3D("model.layers.1.mlp.experts", 4, 2, 24, 10);
                   },
                   absl::StatusCode::kInvalidArgument,
                   {"mixes 2D", "experts.0.", "base_layer"},
                   {}});
  cases.push_back({"3D rows not divisible by E",
                   [L0](AdapterBuilder& b) {
                     b.Tensor("base_model.model." + L0 + ".base_layer.lora_A.weight", {10, 24});
                     b.Tensor("base_model.model." + L0 + ".base_layer.lora_B.weight", {20, 10});
                     b.Tensor("base_model.model." + L0 + ".lora_A.weight", {8, 10});
                     b.Tensor("base_model.model." + L0 + ".lora_B.weight", {24, 8});
                   },
                   absl::StatusCode::kInvalidArgument,
                   {"[10, 24]", "not divisible", "4"},
                   {.model = TinyModel()}});
  cases.push_back({"odd gate_up rows",
                   [L0](AdapterBuilder& b) {
                     b.Tensor("base_model.model." + L0 + ".base_layer.lora_A.weight", {8, 24});
                     b.Tensor("base_model.model." + L0 + ".base_layer.lora_B.weight", {21, 8});
                     b.Tensor("base_model.model." + L0 + ".lora_A.weight", {8, 10});
                     b.Tensor("base_model.model." + L0 + ".lora_B.weight", {24, 8});
                   },
                   absl::StatusCode::kInvalidArgument,
                   {"[21, 8]", "even"},
                   {}});
  cases.push_back({"old PEFT swapped orientation",
                   [L0](AdapterBuilder& b) {
                     b.Tensor("base_model.model." + L0 + ".base_layer.lora_A.weight", {8, 20});
                     b.Tensor("base_model.model." + L0 + ".base_layer.lora_B.weight", {24, 8});
                     b.Tensor("base_model.model." + L0 + ".lora_A.weight", {8, 24});
                     b.Tensor("base_model.model." + L0 + ".lora_B.weight", {10, 8});
                   },
                   absl::StatusCode::kInvalidArgument,
                   {"swapped", "PEFT <= 0.19.0", "[8, 20]"},
                   {}});
  cases.push_back({"3D with only one pair",
                   [L0](AdapterBuilder& b) {
                     b.Tensor("base_model.model." + L0 + ".lora_A.weight", {8, 10});
                     b.Tensor("base_model.model." + L0 + ".lora_B.weight", {24, 8});
                   },
                   absl::StatusCode::kInvalidArgument,
                   {"needs both"},
                   {}});
  cases.push_back({"rank above max",
                   [](AdapterBuilder& b) { b.Pair("model.layers.0.self_attn.q_proj", 2, 24, 32); },
                   absl::StatusCode::kResourceExhausted,
                   {"max-lora-rank 1"},
                   {.max_rank = 1}});
  cases.push_back({"3D flag on a 2D file",
                   [L0](AdapterBuilder& b) { b.Experts2D(L0, 4, 2, 24, 10); },
                   absl::StatusCode::kInvalidArgument,
                   {"requested format 3d", "experts.0.gate_proj"},
                   {.expected_format = AdapterFormat::k3D}});
  cases.push_back({"hidden size of another model",
                   [L0](AdapterBuilder& b) { b.Experts3D(L0, 4, 2, 64, 10); },
                   absl::StatusCode::kInvalidArgument,
                   {"hidden size must be 24"},
                   {.model = TinyModel()}});
  cases.push_back({"dense dims of another model",
                   [](AdapterBuilder& b) { b.Pair("model.layers.0.self_attn.q_proj", 2, 64, 64); },
                   absl::StatusCode::kInvalidArgument,
                   {"q_proj", "different base model"},
                   {.model = TinyModel()}});
  cases.push_back({"layer beyond the model",
                   [](AdapterBuilder& b) { b.Pair("model.layers.7.self_attn.q_proj", 2, 24, 32); },
                   absl::StatusCode::kInvalidArgument,
                   {"layer 7", "2 layers"},
                   {.model = TinyModel()}});
  cases.push_back(
      {"non-LoRA tensor",
       [](AdapterBuilder& b) {
         b.Pair("model.layers.0.self_attn.q_proj", 2, 24, 32);
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_magnitude_vector", {32});
       },
       absl::StatusCode::kInvalidArgument,
       {"DoRA"},
       {}});
  cases.push_back(
      {"integer dtype",
       [](AdapterBuilder& b) {
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight", {2, 24},
                  DType::kI32);
         b.Tensor("base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight", {32, 2});
       },
       absl::StatusCode::kInvalidArgument,
       {"I32"},
       {}});
  auto with_config = [](const char* label, nlohmann::json patch, std::vector<std::string> parts) {
    return Case{label,
                [patch](AdapterBuilder& b) {
                  b.Pair("model.layers.0.self_attn.q_proj", 2, 24, 32);
                  b.config().merge_patch(patch);
                },
                absl::StatusCode::kInvalidArgument,
                std::move(parts),
                {}};
  };
  cases.push_back(with_config("config without r", {{"r", nullptr}}, {"missing required", "r"}));
  cases.push_back(
      with_config("config without lora_alpha", {{"lora_alpha", nullptr}}, {"lora_alpha"}));
  cases.push_back(with_config("config without target_modules", {{"target_modules", nullptr}},
                              {"target_modules"}));
  cases.push_back(with_config("r <= 0", {{"r", 0}}, {"r must be positive"}));
  cases.push_back(with_config("DoRA", {{"use_dora", true}}, {"DoRA"}));
  cases.push_back(
      with_config("modules_to_save", {{"modules_to_save", {"lm_head"}}}, {"modules_to_save"}));
  cases.push_back(with_config("lora bias", {{"bias", "lora_only"}}, {"bias"}));
  // Weights that are not numbers: refused at load, naming the tensor, in every dtype and on the
  // path that permutes a 3D lora_B while it copies it.
  const std::string qb = "base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight";
  for (DType dt : {DType::kF32, DType::kBF16, DType::kF16}) {
    for (float bad : {std::nanf(""), INFINITY, -INFINITY}) {
      cases.push_back({absl::StrCat(DTypeName(dt), " ", bad),
                       [=](AdapterBuilder& b) {
                         b.Pair("model.layers.0.self_attn.q_proj", 2, 24, 32, dt);
                         b.Poke(qb, 37, bad);
                       },
                       absl::StatusCode::kInvalidArgument,
                       {"q_proj.lora_B.weight", "[32, 2]", "NaN or infinite"},
                       {}});
    }
  }
  AdapterReadOptions convert;
  convert.convert_to_2d = true;
  cases.push_back({"NaN in a 3D lora_B converted to 2D",
                   [L0](AdapterBuilder& b) {
                     b.Experts3D(L0, 4, 2, 24, 10);
                     b.Poke("base_model.model." + L0 + ".base_layer.lora_B.weight", 5, NAN);
                   },
                   absl::StatusCode::kInvalidArgument,
                   {"experts.base_layer.lora_B.weight", "NaN or infinite"},
                   convert});
  return cases;
}

TEST_P(BadAdapter, IsRejectedWithAClearError) {
  const Case c = BadCases()[GetParam()];
  TempDir tmp;
  AdapterBuilder b;
  c.build(b);
  const std::string dir = b.Write(tmp.Sub("bad"));
  auto a = ReadAdapter(dir, c.options);
  ASSERT_THAT(a, StatusIs(c.code)) << c.label;
  for (const auto& part : c.message_parts) {
    EXPECT_THAT(std::string(a.status().message()), HasSubstr(part)) << c.label;
  }
  EXPECT_THAT(std::string(a.status().message()), HasSubstr(tmp.path()))
      << c.label << ": names the file";
}

INSTANTIATE_TEST_SUITE_P(All, BadAdapter, ::testing::Range(0, static_cast<int>(BadCases().size())),
                         [](const auto& info) {
                           std::string n = BadCases()[info.param].label;
                           for (char& ch : n) {
                             if (!isalnum(static_cast<unsigned char>(ch))) ch = '_';
                           }
                           return n;
                         });

TEST(ReadAdapter, RankPatternAndRsloraSetPerModuleScaling) {
  TempDir tmp;
  AdapterBuilder b;
  b.Pair("model.layers.0.self_attn.q_proj", 4, 24, 32)
      .Pair("model.layers.0.self_attn.v_proj", 2, 24, 16);
  b.config()["rank_pattern"] = {{"q_proj", 4}};
  b.config()["alpha_pattern"] = {{"q_proj", 16}};
  b.config()["use_rslora"] = true;
  b.config()["target_modules"] = {"q_proj", "v_proj"};
  auto a = ReadAdapter(b.Write(tmp.Sub("rp")));
  ASSERT_THAT(a, IsOk());
  EXPECT_DOUBLE_EQ(a->dense.at("model.layers.0.self_attn.q_proj").scaling, 16 / 2.0);  // 16/sqrt(4)
  EXPECT_DOUBLE_EQ(a->dense.at("model.layers.0.self_attn.v_proj").scaling, 4 / std::sqrt(2.0));
  EXPECT_EQ(a->max_rank, 4);
}

}  // namespace
}  // namespace moelora
