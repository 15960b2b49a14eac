// The config.json files the supported models are released with (tests/data/release_configs, with
// their sources in tests/data/README.md) go through the worker's config path: at full size they
// parse with every key known and read as the release means them (absent keys as the model's own
// configuration class defaults them); scaled down with every key kept, they load with random
// weights of the implied shapes (--load-format dummy) and run a prefill to finite logits.
// And a Step3.5 model in the release's layout and keys equals its transformers reference.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "schema/model_config.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/worker/engine_test_util.h"
#include "worker/model/causal_lm.h"
#include "worker/model/registry.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::StatusIs;
using ::moelora::testing::TempDir;
using ::testing::HasSubstr;

std::string ReadFile(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

struct Release {
  std::string file;  // under tests/data/release_configs
  // What the release means, read from the file by hand (and, where the key is absent, from the
  // model's configuration class): rms_norm_eps, top-k, rope type and theta of the first layer.
  double eps;
  int top_k;
  std::string rope_type;
  double theta;
  bool norm_topk_prob;
};

const std::vector<Release>& Releases() {
  static const std::vector<Release> r = {
      {"Qwen3-30B-A3B.json", 1e-6, 8, "default", 1e6, true},
      {"Qwen3-235B-A22B.json", 1e-6, 8, "default", 1e6, true},
      {"Qwen3-Coder-480B-A35B-Instruct.json", 1e-6, 8, "default", 1e7, true},
      {"Qwen3-VL-30B-A3B-Instruct.json", 1e-6, 8, "default", 5e6, true},
      {"Qwen3-VL-235B-A22B-Instruct.json", 1e-6, 8, "default", 5e6, true},
      {"Qwen3.5-35B-A3B.json", 1e-6, 8, "default", 1e7, true},
      {"Qwen3.5-122B-A10B.json", 1e-6, 8, "default", 1e7, true},
      {"Qwen3.5-397B-A17B.json", 1e-6, 10, "default", 1e7, true},
      {"Qwen3.6-35B-A3B.json", 1e-6, 8, "default", 1e7, true},
      {"gpt-oss-20b.json", 1e-5, 4, "yarn", 150000, true},
      {"gpt-oss-120b.json", 1e-5, 4, "yarn", 150000, true},
      // No rms_norm_eps in the release: the hub's Step3p5Config says 1e-5.
      {"Step-3.5-Flash.json", 1e-5, 8, "llama3", 5e6, true},
      {"step3-text.json", 1e-5, 3, "default", 5e5, true},
  };
  return r;
}

std::string ReleasePath(const std::string& file) { return Data("release_configs/" + file); }

// A copy of `j` with every key kept and the sizes made tiny: per-layer lists cut to the first
// `n` layers (plus the MTP layers' entries where the list carries them), layer sets filtered.
nlohmann::json ScaledDown(nlohmann::json j) {
  nlohmann::json& t = j.contains("text_config") ? j["text_config"] : j;
  const int full_layers = t["num_hidden_layers"].get<int>();
  const int mtp = t.value("num_nextn_predict_layers", 0);
  const bool step3 = t.contains("share_q_dim");
  const int n = step3 ? 6 : 4;
  const std::map<std::string, nlohmann::json> sizes = {
      {"hidden_size", 32},
      {"intermediate_size", 16},
      {"num_hidden_layers", n},
      {"num_attention_heads", 4},
      {"num_key_value_heads", 2},
      {"num_attention_groups", step3 ? 1 : 2},
      {"head_dim", j.contains("text_config") && t.contains("linear_num_key_heads") ? 64 : 8},
      {"vocab_size", 128},
      {"moe_intermediate_size", 16},
      {"shared_expert_intermediate_size", 16},
      {"share_expert_dim", 16},
      {"share_q_dim", 12},
      {"num_experts", 16},
      {"num_local_experts", 16},
      {"moe_num_experts", 16},
      {"linear_key_head_dim", 16},
      {"linear_value_head_dim", 16},
      {"linear_num_key_heads", 2},
      {"linear_num_value_heads", 4},
  };
  for (const auto& [k, v] : sizes) {
    // 0 keeps its meaning (Qwen3-Coder's shared_expert_intermediate_size: none).
    if (t.contains(k) && !(t[k].is_number() && t[k] == 0)) t[k] = v;
  }
  if (t.contains("attention_other_setting")) {
    t["attention_other_setting"]["num_attention_heads"] = 6;
    t["attention_other_setting"]["num_attention_groups"] = 2;
    t["attention_other_setting"]["head_dim"] = 8;
  }
  for (const char* k : {"layer_types", "rope_theta", "partial_rotary_factors", "swiglu_limits",
                        "swiglu_limits_shared", "use_rope_layers"}) {
    if (!t.contains(k) || !t[k].is_array()) continue;
    nlohmann::json cut = nlohmann::json::array();
    for (int i = 0; i < n; ++i) cut.push_back(t[k][i]);
    if (static_cast<int>(t[k].size()) == full_layers + mtp) {
      for (int i = 0; i < mtp; ++i) cut.push_back(t[k][full_layers + i]);
    }
    t[k] = cut;
  }
  if (t.contains("moe_layers_enum")) {
    std::vector<int> kept;
    if (t["moe_layers_enum"].is_string()) {
      std::stringstream ss(t["moe_layers_enum"].get<std::string>());
      for (std::string part; std::getline(ss, part, ',');) {
        if (std::stoi(part) < n) kept.push_back(std::stoi(part));
      }
      std::string s;
      for (int k : kept) s += (s.empty() ? "" : ",") + std::to_string(k);
      t["moe_layers_enum"] = s;
    } else {
      for (int k : t["moe_layers_enum"]) {
        if (k < n) kept.push_back(k);
      }
      t["moe_layers_enum"] = kept;
    }
  }
  if (j.contains("vision_config")) j["vision_config"]["out_hidden_size"] = 32;
  return j;
}

// The fields a release means beyond its sizes, as the worker read them.
void ExpectReadAsReleased(const ModelConfig& c, const Release& r, const std::string& what) {
  SCOPED_TRACE(what);
  EXPECT_DOUBLE_EQ(c.rms_norm_eps, r.eps);
  EXPECT_EQ(c.num_experts_per_tok, r.top_k);
  EXPECT_EQ(c.rope.type, r.rope_type);
  EXPECT_EQ(c.norm_topk_prob, r.norm_topk_prob);
  EXPECT_EQ(c.hidden_act, "silu");
  if (r.file.rfind("Step", 0) != 0) {
    EXPECT_DOUBLE_EQ(c.rope.theta, r.theta);
  }
}

TEST(ReleaseConfigTest, EveryReleaseConfigParsesWithEveryKeyKnown) {
  for (const Release& r : Releases()) {
    const std::string path = ReleasePath(r.file);
    const nlohmann::json j = nlohmann::json::parse(ReadFile(path));
    const std::string arch = j["architectures"][0];
    auto table = FindArchTable(arch);
    ASSERT_OK(table.status());
    ASSERT_TRUE((*table)->has_forward()) << arch;
    const std::string text = j.dump();
    EXPECT_OK(CheckConfigKeys(text, path, arch, *(*table)->config_keys)) << r.file;
    auto c = ParseModelConfig(text, path);
    ASSERT_OK(c.status()) << r.file;
    ExpectReadAsReleased(*c, r, r.file);
    // GPT-OSS is released in MXFP4 (its experts; the rest as the config lists).
    if (arch == "GptOssForCausalLM") {
      EXPECT_EQ(c->quantization.method, WeightQuantization::Method::kMxfp4) << r.file;
      EXPECT_TRUE(c->quantization.KeptUnquantized("model.layers.3.self_attn.q_proj.weight"));
      EXPECT_FALSE(c->quantization.KeptUnquantized("model.layers.3.mlp.experts.gate_up_proj"));
    } else {
      EXPECT_EQ(c->quantization.method, WeightQuantization::Method::kNone) << r.file;
    }
  }
}

TEST(ReleaseConfigTest, ScaledDownReleasesLoadAndRun) {
  TempDir tmp;
  for (const Release& r : Releases()) {
    SCOPED_TRACE(r.file);
    const nlohmann::json j = ScaledDown(nlohmann::json::parse(ReadFile(ReleasePath(r.file))));
    const std::string dir = tmp.path() + "/" + r.file;
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/config.json") << j.dump(2);
    auto c = ParseModelConfig(j.dump(), dir + "/config.json");
    ASSERT_OK(c.status());
    ExpectReadAsReleased(*c, r, "scaled down");
    auto comm = MakeLocalCommunicator();
    EngineOptions o;
    o.model_dir = dir;
    o.dummy_weights = true;
    o.enable_mixed_moe_lora_format = true;
    o.max_model_len = 64;
    auto e = Engine::Create(o, comm.get());
    ASSERT_OK(e.status());
    const std::vector<float> logits =
        ::moelora::testing::PromptLogits(**e, 0, {1, 17, 42, 5, 88, 13, 70});
    ASSERT_EQ(logits.size(), 7u * 128u);
    for (float x : logits) ASSERT_TRUE(std::isfinite(x));
  }
}

// A key absent from config.json reads as the model's configuration class defaults it, not as a
// fallback of ours (each of these read otherwise before the defaults table).
TEST(ReleaseConfigTest, AbsentKeysReadAsTheClassDefaults) {
  auto parse = [](const std::string& arch, const std::string& more) {
    const std::string text = "{\"architectures\": [\"" + arch +
                             "\"], \"hidden_size\": 32, \"num_attention_heads\": 4, "
                             "\"head_dim\": 8, \"vocab_size\": 64" +
                             more + "}";
    auto c = ParseModelConfig(text, "config.json");
    EXPECT_OK(c.status()) << arch;
    return c.ok() ? *c : ModelConfig{};
  };
  const ModelConfig qwen3 = parse("Qwen3MoeForCausalLM", "");
  EXPECT_FALSE(qwen3.norm_topk_prob);  // Qwen3MoeConfig.norm_topk_prob = False
  EXPECT_EQ(qwen3.num_experts_per_tok, 8);
  EXPECT_EQ(qwen3.info.num_key_value_heads, 4);
  const ModelConfig vl = parse("Qwen3VLMoeForConditionalGeneration", "");
  EXPECT_DOUBLE_EQ(vl.rope.theta, 500000.0);
  const ModelConfig q35 = parse("Qwen3_5MoeForCausalLM", "");
  EXPECT_DOUBLE_EQ(q35.rope.partial_rotary_factor, 0.25);
  const ModelConfig oss = parse("GptOssForCausalLM", ", \"rope_scaling\": null");
  EXPECT_DOUBLE_EQ(oss.rms_norm_eps, 1e-5);
  EXPECT_TRUE(oss.attention_bias);
  EXPECT_EQ(oss.rope.type, "yarn");
  EXPECT_DOUBLE_EQ(oss.rope.factor, 32.0);
  EXPECT_DOUBLE_EQ(oss.rope.theta, 150000.0);
  const ModelConfig s35 = parse("Step3p5ForCausalLM", "");
  EXPECT_DOUBLE_EQ(s35.rms_norm_eps, 1e-5);
  const ModelConfig s3 = parse("Step3TextForCausalLM", "");
  EXPECT_DOUBLE_EQ(s3.rms_norm_eps, 1e-5);
  EXPECT_DOUBLE_EQ(s3.rope.theta, 500000.0);
}

// What used to go wrong on the release's own keys: its older MoE keys were refused, and the
// absent rms_norm_eps read as 1e-6 where the model's class says 1e-5.
TEST(ReleaseConfigTest, Step35ReleaseKeysAndDefaultEps) {
  const std::string path = ReleasePath("Step-3.5-Flash.json");
  auto c = ParseModelConfig(ReadFile(path), path);
  ASSERT_OK(c.status());
  EXPECT_DOUBLE_EQ(c->rms_norm_eps, 1e-5);
  // The older keys must agree with moe_layers_enum and the norms.
  TempDir tmp;
  int n = 0;
  auto load_with = [&](const std::function<void(nlohmann::json&)>& edit) {
    nlohmann::json j = ScaledDown(nlohmann::json::parse(ReadFile(path)));
    edit(j);
    const std::string dir = tmp.path() + "/m" + std::to_string(n++);
    std::filesystem::create_directories(dir);
    std::ofstream(dir + "/config.json") << j.dump();
    auto comm = MakeLocalCommunicator();
    ModelOptions mo;
    mo.dummy_weights = true;
    return LoadCausalLM(dir, mo, comm.get()).status();
  };
  EXPECT_OK(load_with([](nlohmann::json&) {}));
  EXPECT_THAT(load_with([](nlohmann::json& j) { j["use_moe"] = false; }),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("use_moe is false")));
  EXPECT_THAT(load_with([](nlohmann::json& j) { j["moe_every_n_layer"] = 2; }),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("moe_layers_enum makes layer 3 MoE")));
  EXPECT_THAT(load_with([](nlohmann::json& j) { j["zero_centered"] = false; }),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("zero_centered false")));
  EXPECT_THAT(load_with([](nlohmann::json& j) { j["sink"] = true; }),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("sink true")));
  EXPECT_THAT(load_with([](nlohmann::json& j) { j.erase("moe_router_activation"); }),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("moe_router_activation is required")));
}

// The Step3.5 fixture (transformers reference logits) with its config rewritten in the release's
// keys: the older MoE keys added, rms_norm_eps removed (the fixture's 1e-5 is the class default).
TEST(ReleaseConfigTest, Step35InTheReleaseKeysEqualsItsReference) {
  TempDir tmp;
  const std::string src = Data("step3p5/model");
  const std::string dir = tmp.path() + "/step3p5";
  std::filesystem::copy(src, dir, std::filesystem::copy_options::recursive);
  nlohmann::json j = nlohmann::json::parse(ReadFile(src + "/config.json"));
  ASSERT_DOUBLE_EQ(j["rms_norm_eps"].get<double>(), 1e-5);
  j.erase("rms_norm_eps");
  j["use_moe"] = true;
  j["moe_layer_offset"] = 0;
  j["moe_every_n_layer"] = 1;
  j["zero_centered"] = true;
  j["sink"] = false;
  std::filesystem::remove(dir + "/config.json");
  std::ofstream(dir + "/config.json") << j.dump(2);
  auto ref = ::moelora::testing::ReadExpected(Data("step3p5/expected_logits.safetensors"));
  auto comm = MakeLocalCommunicator();
  EngineOptions o;
  o.model_dir = dir;
  auto e = Engine::Create(o, comm.get());
  ASSERT_OK(e.status());
  for (size_t k = 0; k < ref.prompts.size(); ++k) {
    const float d = ::moelora::testing::MaxAbsDiff(
        ::moelora::testing::PromptLogits(**e, 0, ref.prompts[k], 1 + k), ref.logits.at("base")[k]);
    EXPECT_LE(d, 1e-4f) << "prompt " << k;
  }
}

}  // namespace
}  // namespace moelora
