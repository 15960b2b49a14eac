// moelora-adapter, run in-process (RunAdapterCli) and as the real binary.
#include "lora/cli.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cstdio>
#include <sstream>

#include "nlohmann/json.hpp"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using ::moelora::testing::TempDir;
using ::testing::HasSubstr;

const std::string kData = MOELORA_TEST_DATA_DIR;

struct CliRun {
  int code;
  std::string out, err;
};

CliRun Cli(std::vector<std::string> args) {
  std::ostringstream out, err;
  int code = RunAdapterCli(args, out, err);
  return {code, out.str(), err.str()};
}

TEST(AdapterCli, InspectJsonHasPinnedKeys) {
  CliRun r = Cli({"inspect", kData + "/qwen3_moe/adapter_3d", "--json"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["format"], "3d");
  EXPECT_EQ(j["rank"], 4);
  EXPECT_EQ(j["lora_alpha"], 8.0);
  EXPECT_EQ(j["scaling"], 2.0);
  EXPECT_EQ(j["num_experts"], 4);
  EXPECT_EQ(j["target_modules"], nlohmann::json({"experts", "o_proj", "q_proj"}));
  EXPECT_EQ(j["num_tensors"], 16);
  EXPECT_GT(j["bytes"].get<int64_t>(), 0);

  r = Cli({"inspect", kData + "/qwen3_moe/adapter_2d", "--json"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_EQ(nlohmann::json::parse(r.out)["format"], "2d");
}

TEST(AdapterCli, InspectHumanReadable) {
  CliRun r = Cli({"inspect", kData + "/qwen3_moe/adapter_2d"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("format         2d"));
  EXPECT_THAT(r.out, HasSubstr("experts        4 (inferred)"));
}

TEST(AdapterCli, ValidateAgainstModel) {
  CliRun r = Cli(
      {"validate", kData + "/qwen3_vl_moe/adapter_3d", "--model", kData + "/qwen3_vl_moe/model"});
  EXPECT_EQ(r.code, kExitOk) << r.err;
  EXPECT_THAT(r.out, HasSubstr("OK"));
  // A Qwen3-MoE adapter against GPT-OSS's config: layers and dims differ... both have H=24, so
  // use a model whose expert count differs: tighten with --max-lora-rank instead.
  r = Cli({"validate", kData + "/qwen3_moe/adapter_3d", "--model", kData + "/qwen3_moe/model",
           "--max-lora-rank", "2"});
  EXPECT_EQ(r.code, kExitInvalidAdapter);
  EXPECT_THAT(r.err, HasSubstr("max-lora-rank"));
}

TEST(AdapterCli, ExitCodes) {
  EXPECT_EQ(Cli({"--help"}).code, kExitOk);
  EXPECT_EQ(Cli({}).code, kExitFailure);
  EXPECT_EQ(Cli({"frobnicate", "x"}).code, kExitFailure);
  EXPECT_EQ(Cli({"inspect", "/nonexistent"}).code, kExitFailure);
  EXPECT_EQ(Cli({"validate", kData + "/qwen3_moe/adapter_2d"}).code, kExitFailure);  // no --model
  TempDir tmp;
  testing::WriteFile(tmp.Sub("adapter_config.json"),
                     R"({"r": 2, "lora_alpha": 2, "target_modules": ["q"]})");
  testing::WriteFile(tmp.Sub("adapter_model.safetensors"), "garbage!garbage!");
  CliRun r = Cli({"inspect", tmp.path()});
  EXPECT_EQ(r.code, kExitInvalidAdapter);
  EXPECT_THAT(r.err, HasSubstr("adapter_model.safetensors"));
}

TEST(AdapterCli, ConvertBothWays) {
  TempDir tmp;
  CliRun r =
      Cli({"convert", kData + "/qwen3_moe/adapter_3d", "--to", "2d", "--out", tmp.Sub("a2d")});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  r = Cli({"inspect", tmp.Sub("a2d"), "--json"});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  auto j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j["format"], "2d");
  EXPECT_EQ(j["num_tensors"], 2 * (2 * 4 * 3 + 4));
  r = Cli({"convert", tmp.Sub("a2d"), "--to", "3d", "--out", tmp.Sub("a3d")});
  ASSERT_EQ(r.code, kExitOk) << r.err;
  j = nlohmann::json::parse(Cli({"inspect", tmp.Sub("a3d"), "--json"}).out);
  EXPECT_EQ(j["format"], "3d");
  // The written config is what PEFT reads: target_parameters for 3D, per-expert modules for 2D.
  auto cfg3 = nlohmann::json::parse(testing::ReadFile(tmp.Sub("a3d/adapter_config.json")));
  EXPECT_EQ(cfg3["target_parameters"],
            nlohmann::json({"mlp.experts.down_proj", "mlp.experts.gate_up_proj"}));
  auto cfg2 = nlohmann::json::parse(testing::ReadFile(tmp.Sub("a2d/adapter_config.json")));
  EXPECT_TRUE(cfg2["target_parameters"].is_null());
  EXPECT_EQ(cfg2["target_modules"],
            nlohmann::json({"down_proj", "gate_proj", "o_proj", "q_proj", "up_proj"}));
  // Refuses to overwrite its input.
  EXPECT_EQ(Cli({"convert", tmp.Sub("a2d"), "--to", "3d", "--out", tmp.Sub("a2d")}).code,
            kExitFailure);
  EXPECT_EQ(Cli({"convert", tmp.Sub("a2d"), "--to", "4d", "--out", tmp.Sub("x")}).code,
            kExitFailure);
}

TEST(AdapterCli, RealBinaryReportsInvalidAdapterWithExitTwo) {
  TempDir tmp;
  testing::WriteFile(tmp.Sub("adapter_config.json"), R"({"r": 2, "lora_alpha": 2})");
  const std::string cmd =
      std::string(MOELORA_ADAPTER_CLI) + " inspect " + tmp.path() + " 2>/dev/null";
  const int status = std::system(cmd.c_str());
  ASSERT_TRUE(WIFEXITED(status));
  EXPECT_EQ(WEXITSTATUS(status), kExitInvalidAdapter);
}

}  // namespace
}  // namespace moelora
