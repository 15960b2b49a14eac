// Quantized checkpoints: quantization_config accepted or refused by name, the modules it keeps
// unquantized, and bad MXFP4 tensors (on copies of tests/data/gpt_oss_mxfp4) as clear errors.
#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "schema/model_config.h"
#include "schema/name_tables.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/checkpoint.h"
#include "worker/comm/communicator.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model/causal_lm.h"
#include "worker/model/registry.h"

namespace moelora {
namespace {

using ::moelora::testing::StatusIs;
using ::moelora::testing::TempDir;
using ::testing::AllOf;
using ::testing::HasSubstr;

absl::StatusOr<WeightQuantization> Parse(const std::string& q,
                                         const std::string& arch = "GptOssForCausalLM") {
  return ParseWeightQuantization(nlohmann::json::parse(q), "config.json", arch);
}

TEST(WeightQuantizationTest, ServedMethodsParseAndOthersAreRefusedByName) {
  auto mx = Parse(R"({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]})");
  ASSERT_OK(mx);
  EXPECT_EQ(mx->method, WeightQuantization::Method::kMxfp4);
  auto fp8 = Parse(R"({"quant_method": "fp8", "activation_scheme": "dynamic", "fmt": "e4m3",
                       "weight_block_size": [128, 64]})",
                   "Qwen3MoeForCausalLM");
  ASSERT_OK(fp8);
  EXPECT_EQ(fp8->method, WeightQuantization::Method::kFp8);
  EXPECT_EQ(fp8->block_n, 128);
  EXPECT_EQ(fp8->block_k, 64);
  EXPECT_THAT(Parse(R"({"quant_method": "gptq", "bits": 4})"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("\"gptq\" is not served")));
  EXPECT_THAT(Parse(R"({"quant_method": "mxfp4"})", "Qwen3MoeForCausalLM"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("GPT-OSS's experts only")));
  EXPECT_THAT(Parse(R"({"quant_method": "fp8"})"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("weight_block_size")));
  EXPECT_THAT(Parse(R"({"quant_method": "fp8", "activation_scheme": "static",
                        "weight_block_size": [128, 128]})"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("activation_scheme")));
  EXPECT_THAT(Parse(R"({"quant_method": "fp8", "scale_fmt": "ue8m0",
                        "weight_block_size": [128, 128]})"),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("scale_fmt")));
  EXPECT_THAT(Parse(R"({"quant_method": "fp8", "weight_block_size": [128, 0]})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("weight_block_size")));
  EXPECT_THAT(Parse(R"({"quant_method": "mxfp4", "modules_to_not_convert": "lm_head"})"),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("modules_to_not_convert")));
  EXPECT_THAT(Parse(R"("mxfp4")"), StatusIs(absl::StatusCode::kInvalidArgument));
}

TEST(WeightQuantizationTest, ModulesToNotConvertMatchWholeModules) {
  WeightQuantization q;
  q.modules_to_not_convert = {"model.layers.*.self_attn", "lm_head", "model.embed_tokens"};
  EXPECT_TRUE(q.KeptUnquantized("model.layers.3.self_attn.q_proj.weight"));
  EXPECT_TRUE(q.KeptUnquantized("model.layers.12.self_attn"));
  EXPECT_TRUE(q.KeptUnquantized("lm_head.weight"));
  EXPECT_FALSE(q.KeptUnquantized("model.layers.3.mlp.experts.gate_up_proj"));
  EXPECT_FALSE(q.KeptUnquantized("lm_head_extra.weight"));  // a module's name, not a prefix
  EXPECT_FALSE(q.KeptUnquantized("model.embed_tokens_2.weight"));
}

// ---- Bad quantized checkpoints, on copies of the fixtures ----

class QuantizedCheckpointTest : public ::testing::Test {
 protected:
  struct Edit {
    std::string drop;                // a tensor left out
    std::string replace;             // a tensor written as `with` instead
    at::Tensor with;                 // (its dtype: U8 for kByte, F32 for kFloat)
    std::string config_key, config;  // quantization_config[config_key] = config (JSON)
    DType byte_dtype = DType::kU8;   // how a kByte `with` is stored
  };
  std::string Copy(const Edit& e, const std::string& fixture = "gpt_oss_mxfp4") {
    const std::string src = std::string(MOELORA_TEST_DATA_DIR) + "/" + fixture + "/model";
    auto f = SafetensorsFile::Open(src + "/model.safetensors");
    EXPECT_TRUE(f.ok());
    std::vector<TensorToWrite> w;
    for (const TensorView& v : (*f)->tensors()) {
      if (v.name == e.drop) continue;
      if (v.name == e.replace) {
        const bool bytes = e.with.scalar_type() == at::kByte;
        w.push_back({v.name, bytes ? e.byte_dtype : DType::kF32, e.with.sizes().vec(),
                     e.with.data_ptr(), static_cast<size_t>(e.with.nbytes())});
        continue;
      }
      w.push_back({v.name, v.dtype, std::vector<int64_t>(v.shape.begin(), v.shape.end()), v.data,
                   v.nbytes});
    }
    const std::string dir = tmp_.path() + "/m" + std::to_string(n_++);
    std::filesystem::create_directories(dir);
    EXPECT_TRUE(WriteSafetensors(dir + "/model.safetensors", w).ok());
    std::ifstream in(src + "/config.json");
    nlohmann::json cfg = nlohmann::json::parse(in);
    if (!e.config_key.empty()) {
      cfg["quantization_config"][e.config_key] = nlohmann::json::parse(e.config);
    }
    std::ofstream(dir + "/config.json") << cfg.dump();
    return dir;
  }
  absl::Status Load(const std::string& dir) {
    auto comm = MakeLocalCommunicator();
    return LoadCausalLM(dir, ModelOptions{}, comm.get()).status();
  }
  TempDir tmp_;
  int n_ = 0;
};

const char kGateUp[] = "model.layers.1.mlp.experts.gate_up_proj";

TEST_F(QuantizedCheckpointTest, TheCopyLoads) { ASSERT_OK(Load(Copy({}))); }

TEST_F(QuantizedCheckpointTest, MissingOrMisshapenScalesAreNamed) {
  EXPECT_THAT(Load(Copy({std::string(kGateUp) + "_scales"})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(std::string(kGateUp) + "_blocks"),
                             HasSubstr("no _scales tensor beside it"))));
  EXPECT_THAT(Load(Copy({"", std::string(kGateUp) + "_scales", at::zeros({4, 128, 3}, at::kByte)})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(std::string(kGateUp) + "_scales [4, 128, 3]"),
                             HasSubstr("expected U8 [4, 128, 2]"))));
  // Scales without blocks.
  EXPECT_THAT(Load(Copy({std::string(kGateUp) + "_blocks"})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(std::string(kGateUp) + "_scales"),
                             HasSubstr("has no " + std::string(kGateUp) + "_blocks"))));
}

TEST_F(QuantizedCheckpointTest, BlocksOfTheWrongTypeOrShapeAreNamed) {
  EXPECT_THAT(Load(Copy({"", std::string(kGateUp) + "_blocks", at::zeros({4, 128, 2, 16})})),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(std::string(kGateUp) + "_blocks"),
                             HasSubstr("MXFP4 blocks must be U8"))));
  // Blocks and scales that agree with each other but not with the config's sizes.
  const std::string down = "model.layers.0.mlp.experts.down_proj";
  const std::string dir = Copy({"", down + "_blocks", at::zeros({4, 64, 1, 16}, at::kByte)});
  EXPECT_THAT(Load(dir), StatusIs(absl::StatusCode::kInvalidArgument,
                                  HasSubstr(down + "_scales [4, 64, 2]: expected U8 [4, 64, 1]")));
}

TEST_F(QuantizedCheckpointTest, ExpertsTheConfigKeepsUnquantizedButStoredQuantizedAreNamed) {
  EXPECT_THAT(
      Load(Copy(
          {"", "", at::Tensor(), "modules_to_not_convert", R"(["model.layers.*.mlp.experts"])"})),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("_blocks is stored quantized"),
                                                         HasSubstr("modules_to_not_convert"))));
}

// A split inside a block of 32: refused before any weight is read, naming the parameter.
TEST_F(QuantizedCheckpointTest, ASplitInsideABlockIsRefused) {
  auto ckpt = Checkpoint::Open(std::string(MOELORA_TEST_DATA_DIR) + "/gpt_oss_mxfp4/model");
  ASSERT_OK(ckpt);
  auto table = FindArchTable("GptOssForCausalLM");
  ASSERT_OK(table);
  auto cfg = ReadModelConfig(std::string(MOELORA_TEST_DATA_DIR) + "/gpt_oss_mxfp4/model");
  ASSERT_OK(cfg);
  const std::string x = "model.layers.0.mlp.experts";
  const std::vector<ParamSpec> specs = {{W13Name(x, true), {4, 128, 64}, TpSplit::kExperts},
                                        {W2Name(x, true), {4, 64, 64}, TpSplit::kExperts}};
  EXPECT_THAT(LoadWeights(**ckpt, **table, *cfg, specs, LoadOptions{0, 4, at::kFloat, true}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(W2Name(x, true)), HasSubstr("not whole blocks of 32"))));
}

const char kFp8Down[] = "model.layers.0.mlp.experts.2.down_proj.weight";

TEST_F(QuantizedCheckpointTest, Fp8CopyLoadsAndBadScalesAreNamed) {
  ASSERT_OK(Load(Copy({}, "qwen3_moe_fp8")));
  EXPECT_THAT(Load(Copy({std::string(kFp8Down) + "_scale_inv"}, "qwen3_moe_fp8")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(kFp8Down), HasSubstr("no .weight_scale_inv tensor"))));
  // down_proj [32, 16] in 8x8 blocks: scales [4, 2].
  EXPECT_THAT(
      Load(Copy({"", std::string(kFp8Down) + "_scale_inv", at::ones({2, 4})}, "qwen3_moe_fp8")),
      StatusIs(absl::StatusCode::kInvalidArgument,
               AllOf(HasSubstr(std::string(kFp8Down) + "_scale_inv [2, 4]"),
                     HasSubstr("expected F32 or BF16 [4, 2]"))));
  // A NaN code.
  at::Tensor nan = at::zeros({32, 16}, at::kByte);
  nan[3][5] = 0xFF;
  Edit e{"", kFp8Down, nan};
  e.byte_dtype = DType::kF8E4M3;
  EXPECT_THAT(Load(Copy(e, "qwen3_moe_fp8")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(kFp8Down), HasSubstr("element 53 is an FP8 NaN code"))));
  // Codes that are not FP8.
  EXPECT_THAT(Load(Copy({"", kFp8Down, at::zeros({32, 16}, at::kByte)}, "qwen3_moe_fp8")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr(kFp8Down), HasSubstr("block-FP8 weights must be F8_E4M3"))));
}

TEST_F(QuantizedCheckpointTest, Fp8WhereTheConfigKeepsTheModuleUnquantizedIsNamed) {
  EXPECT_THAT(
      Load(Copy(
          {"", "", at::Tensor(), "modules_to_not_convert", R"(["model.layers.0.mlp.experts"])"},
          "qwen3_moe_fp8")),
      StatusIs(absl::StatusCode::kInvalidArgument, AllOf(HasSubstr("model.layers.0.mlp.experts."),
                                                         HasSubstr("modules_to_not_convert"))));
  // An FP8 byte where an f32 weight was (its module unquantized in the config): no scales.
  Edit e{"", "model.layers.1.self_attn.q_proj.weight", at::zeros({32, 32}, at::kByte)};
  e.byte_dtype = DType::kF8E4M3;
  EXPECT_THAT(Load(Copy(e, "qwen3_moe_fp8")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.layers.1.self_attn.q_proj.weight"),
                             HasSubstr("no .weight_scale_inv tensor"))));
}

}  // namespace
}  // namespace moelora
