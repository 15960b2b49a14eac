// Qwen3.5-MoE beyond one-shot prefill: a prompt prefilled in two chunks and token by token (the
// carried conv and SSM states) against transformers' logits at every position; the chunked and
// recurrent forms of the delta rule over 200 tokens; mixed batches of 2D, 3D and base requests
// against each request alone; base rows bit-identical with adapters loaded; adapter modules the
// model lacks rejected by name.
#include <ATen/ATen.h>
#include <unistd.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <tuple>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lora/adapter.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"
#include "tests/unit/worker/engine_test_util.h"
#include "worker/model/causal_lm.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::GenerateBatch;
using ::moelora::testing::Load;
using ::moelora::testing::MakeEngine;
using ::moelora::testing::MaxAbsDiff;
using ::moelora::testing::ReadExpected;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

constexpr float kRefTol = 1e-4f;

struct ModelHolder {
  std::unique_ptr<Communicator> comm = MakeLocalCommunicator();
  std::unique_ptr<CausalLM> model;
};

std::unique_ptr<ModelHolder> LoadModel(bool mixed = true) {
  auto h = std::make_unique<ModelHolder>();
  ModelOptions o;
  o.mixed_moe_lora_format = mixed;
  o.max_lora_rank = 8;
  auto m = LoadCausalLM(Data("qwen3_5_moe/model"), o, h->comm.get());
  EXPECT_TRUE(m.ok()) << m.status();
  if (!m.ok()) return nullptr;
  h->model = std::move(*m);
  return h;
}

// Runs `tokens` of one sequence through `m` in pieces of the given sizes (with `slot`); returns
// the logits of every token, row after row.
std::vector<float> RunPieces(CausalLM& m, const std::vector<int32_t>& tokens,
                             const std::vector<int64_t>& pieces, int32_t slot) {
  SeqState st = m.NewState();
  std::vector<float> out;
  size_t pos = 0;
  for (int64_t n : pieces) {
    ForwardBatch b;
    for (int64_t i = 0; i < n; ++i) b.tokens.push_back(tokens[pos + i]);
    b.slots.assign(n, slot);
    b.seqs.push_back({&st, 0, n, /*all_logits=*/true});
    auto logits = m.Forward(b);
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (!logits.ok()) return {};
    const float* p = logits->data_ptr<float>();
    out.insert(out.end(), p, p + logits->numel());
    pos += n;
  }
  EXPECT_EQ(st.len, static_cast<int64_t>(tokens.size()));
  return out;
}

TEST(Qwen35Test, TwoChunkPrefillAndTokenByTokenDecodeMatchTransformers) {
  auto ref = ReadExpected(Data("qwen3_5_moe/expected_logits.safetensors"));
  auto h = LoadModel();
  ASSERT_NE(h, nullptr);
  AdapterReadOptions ro;
  ro.model = h->model->config().info;
  ro.convert_to_2d = true;
  auto a3 = ReadAdapter(Data("qwen3_5_moe/adapter_3d"), ro);
  ASSERT_OK(a3);
  ASSERT_OK(h->model->SetSlot(1, *a3));
  const std::vector<int32_t>& prompt = ref.prompts[2];  // 70 tokens: longer than one chunk
  ASSERT_EQ(prompt.size(), 70u);
  for (auto [variant, slot] : {std::pair<const char*, int32_t>{"base", -1}, {"adapter_3d", 1}}) {
    SCOPED_TRACE(variant);
    const std::vector<float>& want = ref.logits.at(variant)[2];
    const float two_chunks = MaxAbsDiff(RunPieces(*h->model, prompt, {40, 30}, slot), want);
    const float by_token =
        MaxAbsDiff(RunPieces(*h->model, prompt, std::vector<int64_t>(70, 1), slot), want);
    const float mixed = MaxAbsDiff(RunPieces(*h->model, prompt, {3, 1, 1, 64, 1}, slot), want);
    std::printf("[ref] qwen3_5 %s: two-chunk prefill %.3g, token by token %.3g, 3+1+1+64+1 %.3g\n",
                variant, two_chunks, by_token, mixed);
    EXPECT_LE(two_chunks, kRefTol);
    EXPECT_LE(by_token, kRefTol);
    EXPECT_LE(mixed, kRefTol);
  }
}

TEST(Qwen35Test, ChunkedAndRecurrentFormsAgreeOver200Tokens) {
  auto h = LoadModel();
  ASSERT_NE(h, nullptr);
  std::vector<int32_t> tokens;
  for (int i = 0; i < 200; ++i) tokens.push_back((i * 37 + 11) % 96);
  const std::vector<float> chunked = RunPieces(*h->model, tokens, {200}, -1);
  const std::vector<float> recurrent =
      RunPieces(*h->model, tokens, std::vector<int64_t>(200, 1), -1);
  const float d = MaxAbsDiff(chunked, recurrent);
  std::printf("[ref] qwen3_5 chunked (one 200-token prefill) vs recurrent (200 steps): %.3g\n", d);
  EXPECT_LE(d, 1e-5f);
}

TEST(Qwen35Test, MixedBatchEqualsEachRequestAloneInBothOrders) {
  auto h = MakeEngine("qwen3_5_moe/model", true, 4, 8);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "qwen3_5_moe/adapter_2d"));
  ASSERT_OK(Load(*h->engine, 2, "qwen3_5_moe/adapter_3d"));
  const std::vector<std::vector<int32_t>> prompts = {{1, 17, 42, 5, 88}, {7, 2, 95, 3}, {4, 4}};
  for (const std::vector<int64_t>& order :
       {std::vector<int64_t>{1, 2, 0}, std::vector<int64_t>{2, 1, 0}}) {
    auto batch = GenerateBatch(*h->engine, order, prompts, 6);
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto alone = GenerateBatch(*h->engine, {order[i]}, {prompts[i]}, 6, 500);
      EXPECT_EQ(alone[0].tokens, batch[i].tokens) << "adapter " << order[i];
      for (size_t t = 0; t < alone[0].logits.size(); ++t) {
        EXPECT_LE(MaxAbsDiff(alone[0].logits[t], batch[i].logits[t]), 1e-5f)
            << "adapter " << order[i] << " token " << t;
      }
    }
  }
}

TEST(Qwen35Test, BaseRowsBitIdenticalWithAdaptersLoaded) {
  auto plain = MakeEngine("qwen3_5_moe/model", true, 4, 8);
  auto loaded = MakeEngine("qwen3_5_moe/model", true, 4, 8);
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(loaded, nullptr);
  ASSERT_OK(Load(*loaded->engine, 1, "qwen3_5_moe/adapter_2d"));
  ASSERT_OK(Load(*loaded->engine, 2, "qwen3_5_moe/adapter_3d"));
  const std::vector<std::vector<int32_t>> prompts = {{1, 17, 42, 5, 88}, {7, 2, 95}};
  auto a = GenerateBatch(*plain->engine, {0, 0}, prompts, 5);
  auto b = GenerateBatch(*loaded->engine, {0, 0}, prompts, 5);
  ::moelora::testing::ExpectBitIdentical(a, b);
}

TEST(Qwen35Test, WithoutMixedModeTheNativeLayoutIsRequired) {
  auto h = MakeEngine("qwen3_5_moe/model", false, 4, 8);
  ASSERT_NE(h, nullptr);
  EXPECT_THAT(
      Load(*h->engine, 1, "qwen3_5_moe/adapter_2d"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--enable-mixed-moe-lora-format")));
  EXPECT_OK(Load(*h->engine, 2, "qwen3_5_moe/adapter_3d"));
}

// Continuous batching: a prompt prefilled in the same step as another sequence's decodes gives
// both sequences the tokens they get alone.
TEST(Qwen35Test, APromptJoiningRunningDecodesChangesNeither) {
  auto h = MakeEngine("qwen3_5_moe/model", true, 4, 8);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "qwen3_5_moe/adapter_3d"));
  ASSERT_OK(Load(*h->engine, 2, "qwen3_5_moe/adapter_2d"));
  const std::vector<int32_t> pa = {1, 17, 42, 5, 88}, pb = {9, 9, 31, 2, 77, 6, 3};
  auto alone_a = GenerateBatch(*h->engine, {1}, {pa}, 8, 300);
  auto alone_b = GenerateBatch(*h->engine, {2}, {pb}, 5, 400);
  NewSequence a, b;
  a.id = 1, a.adapter_id = 1, a.prompt = pa, a.max_tokens = 8;
  b.id = 2, b.adapter_id = 2, b.prompt = pb, b.max_tokens = 5;
  std::vector<int32_t> got_a, got_b;
  for (int step = 0; step < 8; ++step) {
    std::vector<NewSequence> add;
    if (step == 0) add.push_back(a);
    if (step == 3) add.push_back(b);  // joins while `a` decodes
    auto out = h->engine->Step(add, {});
    ASSERT_OK(out);
    for (const TokenOut& t : out->tokens) (t.sequence_id == 1 ? got_a : got_b).push_back(t.token);
  }
  EXPECT_EQ(got_a, alone_a[0].tokens);
  EXPECT_EQ(got_b, alone_b[0].tokens);
  EXPECT_EQ(h->engine->Info().running, 0);  // both finished, their states freed
}

// The GPU code path (slots in the compute dtype, BGMV, the fused MoE call) through the kernels'
// CPU twins, and bfloat16 compute, against transformers' f32 logits.
TEST(Qwen35Test, KernelTwinsAndBfloat16StayCloseToTransformers) {
  auto ref = ReadExpected(Data("qwen3_5_moe/expected_logits.safetensors"));
  for (auto [dtype, device, tol] :
       {std::tuple<const char*, const char*, float>{"float32", "cpu-twins", kRefTol},
        {"bfloat16", "cpu", 0.1f}}) {
    auto h = MakeEngine("qwen3_5_moe/model", true, 4, 8, dtype, device);
    ASSERT_NE(h, nullptr);
    ASSERT_OK(Load(*h->engine, 3, "qwen3_5_moe/adapter_3d"));
    for (auto [id, variant] : {std::pair<int64_t, const char*>{0, "base"}, {3, "adapter_3d"}}) {
      auto got = ::moelora::testing::PromptLogits(*h->engine, id, ref.prompts[1]);
      const float d = MaxAbsDiff(got, ref.logits.at(variant)[1]);
      std::printf("[ref] qwen3_5 %s %s %s: max |logit - HF f32| = %.3g\n", device, dtype, variant,
                  d);
      EXPECT_LE(d, tol) << device << " " << dtype << " " << variant;
    }
  }
}

// Keys that change Qwen3.5's math and are not implemented stop the load, naming the key.
TEST(Qwen35Test, ConfigKeysItDoesNotImplementAreRefused) {
  namespace fs = std::filesystem;
  const fs::path tmp =
      fs::temp_directory_path() / ("moelora_q35_cfg_" + std::to_string(::getpid()));
  const std::string src = Data("qwen3_5_moe/model");
  std::ifstream in(src + "/config.json");
  const nlohmann::json base = nlohmann::json::parse(in);
  struct Case {
    const char* key;
    nlohmann::json value;
    const char* message;
  };
  const std::vector<Case> cases = {
      {"attn_output_gate", false, "attn_output_gate false"},
      {"use_sliding_window", true, "sliding_window"},
      {"norm_topk_prob", false, "norm_topk_prob false"},
      {"linear_conv_bias", true, "linear_conv_bias = true is not implemented"},
  };
  int n = 0;
  for (const Case& c : cases) {
    SCOPED_TRACE(c.key);
    const fs::path dir = tmp / std::to_string(n++);
    fs::create_directories(dir);
    fs::copy_file(src + "/model.safetensors", dir / "model.safetensors");
    nlohmann::json j = base;
    j[c.key] = c.value;
    if (std::string(c.key) == "use_sliding_window") j["sliding_window"] = 4;
    std::ofstream(dir / "config.json") << j.dump();
    auto comm = MakeLocalCommunicator();
    EXPECT_THAT(LoadCausalLM(dir.string(), ModelOptions{}, comm.get()).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr(c.message)));
  }
  // Without layer_types, full_attention_interval decides (here: every layer is full attention,
  // so the DeltaNet weights are not consumed: the load names them).
  {
    const fs::path dir = tmp / "interval";
    fs::create_directories(dir);
    fs::copy_file(src + "/model.safetensors", dir / "model.safetensors");
    nlohmann::json j = base;
    j.erase("layer_types");
    j["full_attention_interval"] = 1;
    std::ofstream(dir / "config.json") << j.dump();
    auto comm = MakeLocalCommunicator();
    EXPECT_THAT(
        LoadCausalLM(dir.string(), ModelOptions{}, comm.get()).status(),
        StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.layers.0.linear_attn.")));
  }
  fs::remove_all(tmp);
}

TEST(Qwen35Test, TheVisionTowerIsSkippedAndListed) {
  auto h = MakeEngine("qwen3_5_moe/model_vl", false, 4, 8);
  ASSERT_NE(h, nullptr);
  const EngineInfo i = h->engine->Info();
  EXPECT_EQ(i.architecture, "Qwen3_5MoeForConditionalGeneration");
  EXPECT_EQ(i.native_format, AdapterFormat::k3D);
  ASSERT_FALSE(i.skipped_tensors.empty());
  for (const std::string& s : i.skipped_tensors) {
    EXPECT_THAT(s, AllOf(HasSubstr("model.visual."), HasSubstr("vision tower")));
  }
}

TEST(Qwen35Test, AModuleTheModelLacksIsRejectedByName) {
  // Layer 2 is a full-attention layer: it has no linear_attn.in_proj_qkv.
  auto h = LoadModel();
  ASSERT_NE(h, nullptr);
  AdapterReadOptions ro;
  auto a = ReadAdapter(Data("qwen3_5_moe/adapter_3d"), ro);
  ASSERT_OK(a);
  LoraPair p = a->dense.at("model.layers.0.linear_attn.in_proj_qkv");
  a->dense["model.layers.2.linear_attn.in_proj_qkv"] = p;
  EXPECT_THAT(h->model->SetSlot(0, *a),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("model.layers.2.linear_attn.in_proj_qkv"),
                             HasSubstr("linear_attn.in_proj_qkv, linear_attn.in_proj_z"))));
}

}  // namespace
}  // namespace moelora
