// Loader name tables for every architecture, with and without `.base_layer.` on either side,
// and the weight loader: every expert weight lands in the right slice of w13/w2 (TP=1 and TP=2),
// and bad checkpoints are clear errors.
#include <ATen/ATen.h>

#include <filesystem>
#include <fstream>
#include <ostream>
#include <string>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "schema/name_tables.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "worker/architectures/qwen3_moe.h"
#include "worker/checkpoint.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model/causal_lm.h"
#include "worker/model/registry.h"

namespace moelora {
namespace {

using ::moelora::testing::StatusIs;
using ::moelora::testing::TempDir;
using ::testing::HasSubstr;

struct NameCase {
  const char* arch;
  const char* ckpt;
  bool lora_wrapped;
  const char* param;  // "" = skipped
  int expert;
  ExpertShard shard;
  bool transposed;
};

// Printed and named from its fields: gtest's default prints the struct's raw bytes, padding and
// pointers included, so the ctest names changed between the discovery run and the test run.
void PrintTo(const NameCase& c, std::ostream* os) {
  *os << c.arch << " " << c.ckpt << (c.lora_wrapped ? " (wrapped)" : "");
}

std::string NameCaseName(const ::testing::TestParamInfo<NameCase>& info) {
  return std::string(info.param.arch) + "_" + std::to_string(info.index);
}

class NameTableTest : public ::testing::TestWithParam<NameCase> {};

TEST_P(NameTableTest, MapsCheckpointNameToParameter) {
  const NameCase c = GetParam();
  auto table = FindArchTable(c.arch);
  ASSERT_OK(table);
  const NameMapping m = (*table)->map(c.ckpt, c.lora_wrapped);
  if (std::string(c.param).empty()) {
    EXPECT_EQ(m.kind, NameMapping::kSkip);
    return;
  }
  ASSERT_EQ(m.kind, NameMapping::kLoad);
  EXPECT_EQ(m.target.param, c.param);
  EXPECT_EQ(m.target.expert, c.expert);
  EXPECT_EQ(m.target.shard, c.shard);
  EXPECT_EQ(m.target.transposed, c.transposed);
}

constexpr auto kNone = ExpertShard::kNone;
constexpr auto kW1 = ExpertShard::kW1;
constexpr auto kW3 = ExpertShard::kW3;
constexpr auto kW13 = ExpertShard::kW13;
constexpr auto kW2 = ExpertShard::kW2;

INSTANTIATE_TEST_SUITE_P(
    AllArchitectures, NameTableTest,
    ::testing::Values(
        // Qwen3-MoE: per-expert checkpoint.
        NameCase{"Qwen3MoeForCausalLM", "model.layers.3.mlp.experts.7.gate_proj.weight", true,
                 "model.layers.3.mlp.experts.base_layer.w13_weight", 7, kW1, false},
        NameCase{"Qwen3MoeForCausalLM", "model.layers.3.mlp.experts.7.gate_proj.weight", false,
                 "model.layers.3.mlp.experts.w13_weight", 7, kW1, false},
        NameCase{"Qwen3MoeForCausalLM", "model.layers.3.mlp.experts.7.up_proj.base_layer.weight",
                 true, "model.layers.3.mlp.experts.base_layer.w13_weight", 7, kW3, false},
        NameCase{"Qwen3MoeForCausalLM", "model.layers.3.mlp.experts.12.down_proj.base_layer.weight",
                 false, "model.layers.3.mlp.experts.w2_weight", 12, kW2, false},
        NameCase{"Qwen3MoeForCausalLM", "model.layers.0.self_attn.q_proj.weight", true,
                 "model.layers.0.self_attn.q_proj.base_layer.weight", -1, kNone, false},
        NameCase{"Qwen3MoeForCausalLM", "model.layers.0.self_attn.o_proj.base_layer.weight", true,
                 "model.layers.0.self_attn.o_proj.base_layer.weight", -1, kNone, false},
        NameCase{"Qwen3MoeForCausalLM", "model.layers.0.self_attn.o_proj.base_layer.weight", false,
                 "model.layers.0.self_attn.o_proj.weight", -1, kNone, false},
        NameCase{"Qwen3MoeForCausalLM", "model.layers.0.self_attn.q_norm.weight", true,
                 "model.layers.0.self_attn.q_norm.weight", -1, kNone, false},
        NameCase{"Qwen3MoeForCausalLM", "model.layers.0.mlp.gate.weight", true,
                 "model.layers.0.mlp.gate.weight", -1, kNone, false},
        // Qwen3-VL-MoE: fused and transposed under model.language_model.; vision skipped.
        NameCase{"Qwen3VLMoeForConditionalGeneration",
                 "model.language_model.layers.2.mlp.experts.gate_up_proj", true,
                 "model.layers.2.mlp.experts.base_layer.w13_weight", -1, kW13, true},
        NameCase{"Qwen3VLMoeForConditionalGeneration",
                 "model.language_model.layers.2.mlp.experts.down_proj", false,
                 "model.layers.2.mlp.experts.w2_weight", -1, kW2, true},
        NameCase{"Qwen3VLMoeForConditionalGeneration",
                 "model.language_model.layers.2.self_attn.v_proj.base_layer.weight", true,
                 "model.layers.2.self_attn.v_proj.base_layer.weight", -1, kNone, false},
        // The vision tower: under model.visual. (older exports: visual.), PEFT's .base_layer.
        // removed; never wrapped by the engine's own .base_layer. (its linears are built by the
        // tower from the plain names).
        NameCase{"Qwen3VLMoeForConditionalGeneration", "model.visual.blocks.0.attn.qkv.weight",
                 true, "model.visual.blocks.0.attn.qkv.weight", -1, kNone, false},
        NameCase{"Qwen3VLMoeForConditionalGeneration",
                 "visual.blocks.0.mlp.linear_fc1.base_layer.weight", true,
                 "model.visual.blocks.0.mlp.linear_fc1.weight", -1, kNone, false},
        NameCase{"Qwen3_5MoeForConditionalGeneration", "model.visual.merger.linear_fc2.bias", true,
                 "model.visual.merger.linear_fc2.bias", -1, kNone, false},
        // Qwen3.5-MoE: fused [E, 2I, H] (not transposed); per-expert FP8 releases; MTP head.
        NameCase{"Qwen3_5MoeForConditionalGeneration",
                 "model.language_model.layers.9.mlp.experts.gate_up_proj", true,
                 "model.layers.9.mlp.experts.base_layer.w13_weight", -1, kW13, false},
        NameCase{"Qwen3_5MoeForConditionalGeneration",
                 "model.language_model.layers.9.mlp.experts.down_proj", true,
                 "model.layers.9.mlp.experts.base_layer.w2_weight", -1, kW2, false},
        NameCase{"Qwen3_5MoeForConditionalGeneration",
                 "model.language_model.layers.9.mlp.experts.3.up_proj.weight", false,
                 "model.layers.9.mlp.experts.w13_weight", 3, kW3, false},
        NameCase{"Qwen3_5MoeMTP", "mtp.layers.0.mlp.experts.gate_up_proj", true,
                 "mtp.layers.0.mlp.experts.base_layer.w13_weight", -1, kW13, false},
        NameCase{"Qwen3_5MoeMTP", "mtp.layers.0.mlp.experts.down_proj", false,
                 "mtp.layers.0.mlp.experts.w2_weight", -1, kW2, false},
        // Step3-text / Step3.5 / Step3.5-MTP: stacked .moe.{gate,up,down}_proj.weight.
        NameCase{"Step3TextForCausalLM", "model.layers.5.moe.gate_proj.weight", true,
                 "model.layers.5.moe.experts.base_layer.w13_weight", -1, kW1, false},
        NameCase{"Step3TextForCausalLM", "model.layers.5.moe.up_proj.weight", false,
                 "model.layers.5.moe.experts.w13_weight", -1, kW3, false},
        NameCase{"Step3p5ForCausalLM", "model.layers.5.moe.down_proj.weight", true,
                 "model.layers.5.moe.experts.base_layer.w2_weight", -1, kW2, false},
        NameCase{"Step3p5ForCausalLM", "model.layers.5.moe.up_proj.base_layer.weight", true,
                 "model.layers.5.moe.experts.base_layer.w13_weight", -1, kW3, false},
        NameCase{"Step3p5MTP", "model.layers.45.moe.gate_proj.weight", true,
                 "model.layers.45.moe.experts.base_layer.w13_weight", -1, kW1, false},
        NameCase{"Step3p5MTP", "model.layers.45.moe.down_proj.weight", false,
                 "model.layers.45.moe.experts.w2_weight", -1, kW2, false}),
    NameCaseName);

// Weights of 2 MB and more are 2 MB-aligned (so transparent huge pages can back them); smaller
// ones come from the usual allocator. Both hold what is written into them (and free cleanly,
// which the ASan tree checks).
TEST(EmptyWeightTest, LargeWeightsAre2MbAligned) {
  at::Tensor big = EmptyWeight({3, 1024, 700}, at::kBFloat16);  // 4.1 MB
  EXPECT_EQ(reinterpret_cast<uintptr_t>(big.data_ptr()) % (uintptr_t{2} << 20), 0u);
  EXPECT_EQ(big.sizes(), (std::vector<int64_t>{3, 1024, 700}));
  EXPECT_EQ(big.scalar_type(), at::kBFloat16);
  EXPECT_TRUE(big.is_contiguous());
  big.fill_(1.5);
  EXPECT_TRUE(big.eq(1.5).all().item<bool>());
  at::Tensor small = EmptyWeight({16, 16}, at::kFloat);
  small.fill_(2.0);
  EXPECT_EQ(small.sum().item<float>(), 512.0f);
}

TEST(NameTableTest, UnknownArchitectureListsTheSupportedOnes) {
  EXPECT_THAT(FindArchTable("LlamaForCausalLM").status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("Qwen3MoeForCausalLM, Qwen3VLMoeForConditionalGeneration")));
  EXPECT_EQ(SupportedArchitectures().size(), 9u);
  // The forward passes served; the rest have name tables only.
  EXPECT_THAT(
      ServedArchitectures(),
      ::testing::ElementsAre("Qwen3MoeForCausalLM", "Qwen3VLMoeForConditionalGeneration",
                             "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM",
                             "GptOssForCausalLM", "Step3TextForCausalLM", "Step3p5ForCausalLM"));
}

// ---- Landing: a synthetic checkpoint per storage layout, loaded through the real loader ----

constexpr int64_t E = 3, I = 4, H = 6;

struct Logical {
  at::Tensor gate, up, down, q;  // [E,I,H], [E,I,H], [E,H,I], [8,H]
};

Logical MakeLogical() {
  at::manual_seed(1);
  return {at::randn({E, I, H}), at::randn({E, I, H}), at::randn({E, H, I}), at::randn({8, H})};
}

enum class Layout { kPerExpert, kFused, kFusedTransposed, kStackedStep };

struct StoredTensor {
  std::string name;
  at::Tensor t;
};

std::vector<StoredTensor> Store(const Logical& L, Layout layout, bool peft_names,
                                const std::string& layer_prefix, const std::string& moe) {
  const std::string bl = peft_names ? "base_layer." : "";
  std::vector<StoredTensor> out;
  out.push_back({layer_prefix + "self_attn.q_proj." + bl + "weight", L.q});
  switch (layout) {
    case Layout::kPerExpert:
      for (int64_t e = 0; e < E; ++e) {
        const std::string p = layer_prefix + moe + ".experts." + std::to_string(e) + ".";
        out.push_back({p + "gate_proj." + bl + "weight", L.gate[e]});
        out.push_back({p + "up_proj." + bl + "weight", L.up[e]});
        out.push_back({p + "down_proj." + bl + "weight", L.down[e]});
      }
      break;
    case Layout::kFused:
      out.push_back({layer_prefix + moe + ".experts.gate_up_proj", at::cat({L.gate, L.up}, 1)});
      out.push_back({layer_prefix + moe + ".experts.down_proj", L.down});
      break;
    case Layout::kFusedTransposed:
      out.push_back({layer_prefix + moe + ".experts.gate_up_proj",
                     at::cat({L.gate, L.up}, 1).transpose(1, 2)});
      out.push_back({layer_prefix + moe + ".experts.down_proj", L.down.transpose(1, 2)});
      break;
    case Layout::kStackedStep:
      out.push_back({layer_prefix + "moe.gate_proj." + bl + "weight", L.gate});
      out.push_back({layer_prefix + "moe.up_proj." + bl + "weight", L.up});
      out.push_back({layer_prefix + "moe.down_proj." + bl + "weight", L.down});
      break;
  }
  return out;
}

void WriteCheckpoint(const std::string& dir, const std::string& config_json,
                     const std::vector<StoredTensor>& tensors) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << config_json;
  std::vector<at::Tensor> keep;
  std::vector<TensorToWrite> w;
  for (const auto& s : tensors) {
    keep.push_back(s.t.contiguous());
    const at::Tensor& c = keep.back();
    w.push_back(
        {s.name, DType::kF32, c.sizes().vec(), c.data_ptr(), static_cast<size_t>(c.numel()) * 4});
  }
  ASSERT_OK(WriteSafetensors(dir + "/model.safetensors", w));
}

std::string Config(const std::string& arch) {
  return "{\"architectures\": [\"" + arch +
         "\"], \"hidden_size\": 6, \"moe_intermediate_size\": 4, \"num_experts\": 3, "
         "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 2, "
         "\"head_dim\": 4, \"vocab_size\": 10, \"partial_rotary_factor\": 1.0, "
         // The Step architectures' names for the same sizes (schema/architectures.cc).
         "\"moe_num_experts\": 3, \"num_attention_groups\": 2}";
}

struct LandCase {
  const char* arch;
  Layout layout;
  const char* layer_prefix;  // as stored
  const char* engine_prefix;
  const char* moe;  // "mlp" or "moe"
};

class LandingTest : public ::testing::TestWithParam<std::tuple<LandCase, bool, bool, int>> {};

TEST_P(LandingTest, EveryExpertWeightLandsInItsSlice) {
  const auto [c, peft_names, lora_wrapped, tp] = GetParam();
  TempDir tmp;
  const Logical L = MakeLogical();
  WriteCheckpoint(tmp.path(), Config(c.arch),
                  Store(L, c.layout, peft_names, c.layer_prefix,
                        c.layout == Layout::kStackedStep ? "moe" : c.moe));
  auto ckpt = Checkpoint::Open(tmp.path());
  ASSERT_OK(ckpt);
  auto table = FindArchTable(c.arch);
  ASSERT_OK(table);
  auto config = ParseModelConfig(Config(c.arch), "config.json");
  ASSERT_OK(config);
  auto specs = InferParamSpecs(**ckpt, **table, *config, lora_wrapped);
  ASSERT_OK(specs);
  const int64_t Ip = I / tp;
  for (int rank = 0; rank < tp; ++rank) {
    LoadOptions o{rank, tp, at::kFloat, lora_wrapped};
    auto w = LoadWeights(**ckpt, **table, *config, *specs, o);
    ASSERT_OK(w);
    const std::string experts =
        std::string(c.engine_prefix) + (std::string(c.moe) == "moe" ? "moe" : "mlp") + ".experts";
    const at::Tensor w13 = w->params.at(W13Name(experts, lora_wrapped));
    const at::Tensor w2 = w->params.at(W2Name(experts, lora_wrapped));
    ASSERT_EQ(w13.sizes(), (at::IntArrayRef{E, 2 * Ip, H}));
    ASSERT_EQ(w2.sizes(), (at::IntArrayRef{E, H, Ip}));
    for (int64_t e = 0; e < E; ++e) {
      EXPECT_TRUE(at::equal(w13[e].narrow(0, 0, Ip), L.gate[e].narrow(0, rank * Ip, Ip)))
          << "gate e=" << e;
      EXPECT_TRUE(at::equal(w13[e].narrow(0, Ip, Ip), L.up[e].narrow(0, rank * Ip, Ip)))
          << "up e=" << e;
      EXPECT_TRUE(at::equal(w2[e], L.down[e].narrow(1, rank * Ip, Ip))) << "down e=" << e;
    }
    const std::string q = std::string(c.engine_prefix) + "self_attn.q_proj." +
                          (lora_wrapped ? "base_layer." : "") + "weight";
    ASSERT_TRUE(w->params.count(q)) << q;
    EXPECT_TRUE(at::equal(w->params.at(q), L.q));
  }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, LandingTest,
    ::testing::Combine(
        ::testing::Values(LandCase{"Qwen3MoeForCausalLM", Layout::kPerExpert, "model.layers.0.",
                                   "model.layers.0.", "mlp"},
                          LandCase{"Qwen3VLMoeForConditionalGeneration", Layout::kFusedTransposed,
                                   "model.language_model.layers.0.", "model.layers.0.", "mlp"},
                          // As transformers 5's save_pretrained writes Qwen3-VL-MoE.
                          LandCase{"Qwen3VLMoeForConditionalGeneration", Layout::kFused,
                                   "model.language_model.layers.0.", "model.layers.0.", "mlp"},
                          LandCase{"Qwen3_5MoeForConditionalGeneration", Layout::kFused,
                                   "model.language_model.layers.0.", "model.layers.0.", "mlp"},
                          LandCase{"Qwen3_5MoeForConditionalGeneration", Layout::kPerExpert,
                                   "model.language_model.layers.0.", "model.layers.0.", "mlp"},
                          LandCase{"Qwen3_5MoeMTP", Layout::kFused, "mtp.layers.0.",
                                   "mtp.layers.0.", "mlp"},
                          LandCase{"Step3TextForCausalLM", Layout::kStackedStep, "model.layers.0.",
                                   "model.layers.0.", "moe"},
                          LandCase{"Step3p5ForCausalLM", Layout::kStackedStep, "model.layers.0.",
                                   "model.layers.0.", "moe"},
                          LandCase{"Step3p5MTP", Layout::kStackedStep, "model.layers.45.",
                                   "model.layers.45.", "moe"}),
        ::testing::Bool(),  // checkpoint names carry .base_layer. (PEFT-wrapped trainer export)
        ::testing::Bool(),  // engine wraps for LoRA (parameters under .base_layer.)
        ::testing::Values(1, 2)),
    [](const auto& info) {
      std::string n = std::get<0>(info.param).arch;
      n += "_" + std::to_string(static_cast<int>(std::get<0>(info.param).layout));
      n += std::get<1>(info.param) ? "_peftnames" : "_plain";
      n += std::get<2>(info.param) ? "_wrapped" : "_bare";
      n += "_tp" + std::to_string(std::get<3>(info.param));
      return n;
    });

// Qwen3-VL-MoE with H == I: down_proj [E, H, H] fits both layouts, and gate_up_proj decides.
// A layer whose experts fit neither layout is refused naming both.
TEST(FusedLayoutTest, Qwen3VlSquareDownProjIsDecidedByGateUp) {
  constexpr int64_t kE = 2, kH = 4;
  const std::string arch = "Qwen3VLMoeForConditionalGeneration";
  const std::string config =
      "{\"architectures\": [\"" + arch +
      "\"], \"hidden_size\": 4, \"moe_intermediate_size\": 4, \"num_experts\": 2, "
      "\"num_hidden_layers\": 1, \"num_attention_heads\": 2, \"num_key_value_heads\": 2, "
      "\"head_dim\": 4, \"vocab_size\": 10, \"partial_rotary_factor\": 1.0}";
  at::manual_seed(3);
  const at::Tensor gate_up = at::randn({kE, 2 * kH, kH});  // [E, 2I, H], I = H
  const at::Tensor down = at::randn({kE, kH, kH});         // [E, H, I]
  const std::string p = "model.language_model.layers.0.";
  for (bool released : {true, false}) {
    TempDir tmp;
    WriteCheckpoint(tmp.path(), config,
                    {{p + "self_attn.q_proj.weight", at::randn({8, kH})},
                     {p + "mlp.experts.gate_up_proj", released ? gate_up.transpose(1, 2) : gate_up},
                     {p + "mlp.experts.down_proj", released ? down.transpose(1, 2) : down}});
    auto ckpt = Checkpoint::Open(tmp.path());
    ASSERT_OK(ckpt);
    auto table = FindArchTable(arch);
    ASSERT_OK(table);
    auto cfg = ParseModelConfig(config, "config.json");
    ASSERT_OK(cfg);
    auto specs = InferParamSpecs(**ckpt, **table, *cfg, false);
    ASSERT_OK(specs);
    auto w = LoadWeights(**ckpt, **table, *cfg, *specs, LoadOptions{0, 1, at::kFloat, false});
    ASSERT_OK(w);
    EXPECT_TRUE(at::equal(w->params.at(W13Name("model.layers.0.mlp.experts", false)), gate_up))
        << (released ? "released layout" : "transformers' layout");
    EXPECT_TRUE(at::equal(w->params.at(W2Name("model.layers.0.mlp.experts", false)), down))
        << (released ? "released layout" : "transformers' layout");
  }
  TempDir tmp;
  WriteCheckpoint(tmp.path(), config,
                  {{p + "self_attn.q_proj.weight", at::randn({8, kH})},
                   {p + "mlp.experts.gate_up_proj", at::randn({kE, 5, 7})},
                   {p + "mlp.experts.down_proj", down}});
  auto ckpt = Checkpoint::Open(tmp.path());
  ASSERT_OK(ckpt);
  auto table = FindArchTable(arch);
  ASSERT_OK(table);
  auto cfg = ParseModelConfig(config, "config.json");
  ASSERT_OK(cfg);
  std::vector<ParamSpec> specs = {
      {"model.layers.0.self_attn.q_proj.weight", {8, kH}, TpSplit::kRows},
      {W13Name("model.layers.0.mlp.experts", false), {kE, 2 * kH, kH}, TpSplit::kExperts},
      {W2Name("model.layers.0.mlp.experts", false), {kE, kH, kH}, TpSplit::kExperts}};
  EXPECT_THAT(LoadWeights(**ckpt, **table, *cfg, specs, LoadOptions{0, 1, at::kFloat, false}),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       ::testing::AllOf(HasSubstr("gate_up_proj"), HasSubstr("fits neither layout"),
                                        HasSubstr("as transformers saves them"))));
}

// ---- Errors, on a copy of the Qwen3-MoE fixture ----

class BadCheckpointTest : public ::testing::Test {
 protected:
  // Copies the fixture with `drop` removed and `extra` added.
  std::string Copy(const std::string& drop, const std::vector<StoredTensor>& extra = {},
                   const std::string& config_edit_from = "",
                   const std::string& config_edit_to = "") {
    const std::string src = std::string(MOELORA_TEST_DATA_DIR) + "/qwen3_moe/model";
    auto f = SafetensorsFile::Open(src + "/model.safetensors");
    EXPECT_TRUE(f.ok());
    std::vector<StoredTensor> ts;
    for (const TensorView& v : (*f)->tensors()) {
      if (v.name == drop) continue;
      at::Tensor t = at::empty(std::vector<int64_t>(v.shape.begin(), v.shape.end()), at::kFloat);
      std::memcpy(t.data_ptr(), v.data, v.nbytes);
      ts.push_back({v.name, t});
    }
    ts.insert(ts.end(), extra.begin(), extra.end());
    std::ifstream in(src + "/config.json");
    std::string cfg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    if (!config_edit_from.empty())
      cfg.replace(cfg.find(config_edit_from), config_edit_from.size(), config_edit_to);
    const std::string dir = tmp_.path() + "/m" + std::to_string(n_++);
    WriteCheckpoint(dir, cfg, ts);
    return dir;
  }
  [[nodiscard]] absl::Status Load(const std::string& dir) {
    auto comm = MakeLocalCommunicator();
    return LoadCausalLM(dir, ModelOptions{}, comm.get()).status();
  }
  TempDir tmp_;
  int n_ = 0;
};

TEST_F(BadCheckpointTest, TheFixtureCopyLoads) { ASSERT_OK(Load(Copy(""))); }

TEST_F(BadCheckpointTest, UnconsumedTensorIsNamed) {
  EXPECT_THAT(
      Load(Copy("", {{"model.layers.0.mlp.shared_expert.up_proj.weight", at::zeros({4, 24})}})),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("does not consume: model.layers.0.mlp.shared_expert.up_proj.weight")));
}

TEST_F(BadCheckpointTest, UnsetParameterPieceIsNamed) {
  EXPECT_THAT(
      Load(Copy("model.layers.1.mlp.experts.2.up_proj.weight")),
      StatusIs(absl::StatusCode::kInvalidArgument,
               HasSubstr("model.layers.1.mlp.experts.base_layer.w13_weight (expert 2 up)")));
  EXPECT_THAT(Load(Copy("model.norm.weight")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.norm.weight")));
}

TEST_F(BadCheckpointTest, ShapeMismatchNamesFileTensorAndShapes) {
  EXPECT_THAT(
      Load(Copy("model.layers.0.mlp.experts.1.down_proj.weight",
                {{"model.layers.0.mlp.experts.1.down_proj.weight", at::zeros({10, 24})}})),
      StatusIs(absl::StatusCode::kInvalidArgument,
               ::testing::AllOf(HasSubstr("model.safetensors"),
                                HasSubstr("model.layers.0.mlp.experts.1.down_proj.weight [10, 24]"),
                                HasSubstr("expected [24, 10]"))));
}

TEST_F(BadCheckpointTest, ExpertIndexOutOfRangeAndDoubleSets) {
  EXPECT_THAT(
      Load(Copy("", {{"model.layers.0.mlp.experts.4.gate_proj.weight", at::zeros({10, 24})}})),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("expert index 4 >= num_experts 4")));
  EXPECT_THAT(Load(Copy("", {{"model.layers.0.mlp.experts.0.gate_proj.base_layer.weight",
                              at::zeros({10, 24})}})),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("already set")));
}

TEST_F(BadCheckpointTest, ConfigErrors) {
  EXPECT_THAT(Load(Copy("", {}, "\"Qwen3MoeForCausalLM\"", "\"LlamaForCausalLM\"")),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("unknown architecture \"LlamaForCausalLM\"")));
  EXPECT_THAT(Load(Copy("", {}, "\"architectures\"", "\"archs\"")),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no architectures[0]")));
  EXPECT_THAT(Load(Copy("", {}, "\"Qwen3MoeForCausalLM\"", "\"Step3p5MTP\"")),
              StatusIs(absl::StatusCode::kUnimplemented, HasSubstr("no forward pass yet")));
}

// Every config.json key that changes the math is implemented or refused, naming the key: a
// setting the forward pass would ignore gives wrong answers with no error.
TEST_F(BadCheckpointTest, ConfigKeysThatChangeTheMathAreImplementedOrRefused) {
  const std::string rope = "\"rope_type\": \"default\"";
  struct Case {
    std::string from, to;
    absl::StatusCode code;
    std::string message;
  };
  const std::vector<Case> cases = {
      {rope, "\"rope_type\": \"dynamic\", \"factor\": 2.0", absl::StatusCode::kFailedPrecondition,
       "rope_parameters.rope_type \"dynamic\""},
      {rope, "\"rope_type\": \"longrope\"", absl::StatusCode::kFailedPrecondition,
       "is not implemented (implemented: default, linear, yarn, llama3)"},
      {rope, "\"rope_type\": \"yarn\", \"factor\": 4.0, \"low_freq_factor\": 1.0",
       absl::StatusCode::kFailedPrecondition, "rope_parameters.low_freq_factor"},
      {rope, "\"rope_type\": \"llama3\", \"factor\": 8.0", absl::StatusCode::kInvalidArgument,
       "llama3 needs low_freq_factor < high_freq_factor"},
      {rope, "\"rope_type\": \"default\", \"partial_rotary_factor\": 0.5",
       absl::StatusCode::kFailedPrecondition, "partial_rotary_factor 0.5"},
      {"\"hidden_act\": \"silu\"", "\"hidden_act\": \"gelu\"",
       absl::StatusCode::kFailedPrecondition, "hidden_act \"gelu\""},
      {"\"attention_bias\": false", "\"attention_bias\": true",
       absl::StatusCode::kFailedPrecondition, "attention_bias"},
      {"\"use_sliding_window\": false", "\"use_sliding_window\": true",
       absl::StatusCode::kInvalidArgument, "sliding_window is not a positive integer"},
      {"\"vocab_size\": 384", "\"vocab_size\": 384, \"query_pre_attn_scalar\": 144",
       absl::StatusCode::kFailedPrecondition, "query_pre_attn_scalar = 144 is not implemented"},
      {"\"vocab_size\": 384",
       "\"vocab_size\": 384, \"quantization_config\": {\"quant_method\": \"awq\"}",
       absl::StatusCode::kFailedPrecondition, "\"awq\" is not served"},
      {"\"vocab_size\": 384",
       "\"vocab_size\": 384, \"layer_types\": [\"full_attention\", \"linear_attention\"]",
       absl::StatusCode::kFailedPrecondition, "layer_types[1] \"linear_attention\""},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.to);
    EXPECT_THAT(Load(Copy("", {}, c.from, c.to)), StatusIs(c.code, HasSubstr(c.message)));
  }
  // What is implemented loads: each RoPE type, the window, and the 4.x spelling rope_scaling.
  for (const std::string& to :
       {std::string("\"rope_type\": \"linear\", \"factor\": 2.0"),
        std::string("\"rope_type\": \"yarn\", \"factor\": 4.0, \"beta_fast\": 16"),
        std::string("\"rope_type\": \"llama3\", \"factor\": 8.0, \"low_freq_factor\": 1.0, "
                    "\"high_freq_factor\": 4.0, \"original_max_position_embeddings\": 16")}) {
    SCOPED_TRACE(to);
    EXPECT_OK(Load(Copy("", {}, rope, to)));
  }
  // (Later duplicate keys win, as in Python's json.)
  EXPECT_OK(Load(Copy("", {}, "\"vocab_size\": 384",
                      "\"vocab_size\": 384, \"use_sliding_window\": true, \"sliding_window\": 4")));
  EXPECT_OK(Load(Copy("", {}, "\"rope_parameters\"", "\"rope_scaling\"")));
}

TEST_F(BadCheckpointTest, ShardedCheckpointsAndMissingShards) {
  // Split the fixture into two shards with an index.
  const std::string one = Copy("");
  auto f = SafetensorsFile::Open(one + "/model.safetensors");
  ASSERT_OK(f);
  const std::string dir = tmp_.path() + "/sharded";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(one + "/config.json", dir + "/config.json");
  std::vector<TensorToWrite> a, b;
  std::string map;
  for (const TensorView& v : (*f)->tensors()) {
    const bool first = v.name.find("layers.1.") == std::string::npos;
    (first ? a : b).push_back({v.name, v.dtype, v.shape, v.data, v.nbytes});
    map += std::string(map.empty() ? "" : ", ") + "\"" + v.name + "\": \"" +
           (first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors") + "\"";
  }
  ASSERT_OK(WriteSafetensors(dir + "/model-00001-of-00002.safetensors", a));
  ASSERT_OK(WriteSafetensors(dir + "/model-00002-of-00002.safetensors", b));
  std::ofstream(dir + "/model.safetensors.index.json")
      << "{\"metadata\": {}, \"weight_map\": {" << map << "}}";
  ASSERT_OK(Load(dir));
  auto ckpt = Checkpoint::Open(dir);
  ASSERT_OK(ckpt);
  EXPECT_EQ((*ckpt)->num_files(), 2u);
  std::filesystem::remove(dir + "/model-00002-of-00002.safetensors");
  EXPECT_THAT(Load(dir),
              StatusIs(absl::StatusCode::kNotFound, HasSubstr("model-00002-of-00002.safetensors")));
}

TEST_F(BadCheckpointTest, IntegerWeightsAreRefused) {
  const std::string dir = Copy("model.norm.weight");
  // Rewrite with an int32 norm weight.
  auto f = SafetensorsFile::Open(dir + "/model.safetensors");
  ASSERT_OK(f);
  std::vector<TensorToWrite> w;
  for (const TensorView& v : (*f)->tensors())
    w.push_back({v.name, v.dtype, v.shape, v.data, v.nbytes});
  std::vector<int32_t> ints(24, 1);
  w.push_back({"model.norm.weight", DType::kI32, {24}, ints.data(), 96});
  const std::string out = tmp_.path() + "/ints";
  std::filesystem::create_directories(out);
  std::filesystem::copy_file(dir + "/config.json", out + "/config.json");
  ASSERT_OK(WriteSafetensors(out + "/model.safetensors", w));
  EXPECT_THAT(Load(out), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("dtype I32")));
}

TEST_F(BadCheckpointTest, Bf16AndF16CheckpointsLoadAsComputeDtype) {
  // The fixture rewritten with every tensor in BF16 (or F16): it loads, and the f32 parameters
  // equal the rounded originals.
  const std::string src = std::string(MOELORA_TEST_DATA_DIR) + "/qwen3_moe/model";
  auto f = SafetensorsFile::Open(src + "/model.safetensors");
  ASSERT_OK(f);
  for (at::ScalarType st : {at::kBFloat16, at::kHalf}) {
    std::vector<StoredTensor> ts;
    for (const TensorView& v : (*f)->tensors()) {
      at::Tensor t = at::empty(std::vector<int64_t>(v.shape.begin(), v.shape.end()), at::kFloat);
      std::memcpy(t.data_ptr(), v.data, v.nbytes);
      ts.push_back({v.name, t.to(st)});
    }
    const std::string dir = tmp_.path() + (st == at::kHalf ? "/f16" : "/bf16");
    std::filesystem::create_directories(dir);
    std::filesystem::copy_file(src + "/config.json", dir + "/config.json");
    std::vector<TensorToWrite> w;
    for (const auto& s : ts) {
      w.push_back({s.name, st == at::kHalf ? DType::kF16 : DType::kBF16, s.t.sizes().vec(),
                   s.t.data_ptr(), static_cast<size_t>(s.t.numel()) * 2});
    }
    ASSERT_OK(WriteSafetensors(dir + "/model.safetensors", w));
    auto ckpt = Checkpoint::Open(dir);
    ASSERT_OK(ckpt);
    auto cfg = ReadModelConfig(dir);
    ASSERT_OK(cfg);
    auto table = FindArchTable("Qwen3MoeForCausalLM");
    ASSERT_OK(table);
    auto loaded = LoadWeights(**ckpt, **table, *cfg, Qwen3MoeParamSpecs(*cfg, true, true),
                              LoadOptions{0, 1, at::kFloat, true});
    ASSERT_OK(loaded);
    const at::Tensor q = loaded->params.at("model.layers.0.self_attn.q_proj.base_layer.weight");
    const auto it = std::find_if(ts.begin(), ts.end(), [](const StoredTensor& s) {
      return s.name == "model.layers.0.self_attn.q_proj.weight";
    });
    ASSERT_NE(it, ts.end());
    EXPECT_TRUE(at::equal(q, it->t.to(at::kFloat)));
    ASSERT_OK(Load(dir));
  }
}

}  // namespace
}  // namespace moelora
