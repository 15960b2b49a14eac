// Image prompts on Qwen3-VL-MoE and Qwen3.5-MoE with their vision towers against transformers
// (tools/make_vision_fixtures.py, logits computed in float64): the pixel_values the processor
// made, the logits of prompts with one or two images (DeepStack, M-RoPE positions after each
// image, images at the start), base and with adapters of both layouts that also adapt the tower
// and the mergers, whole and in 16-token chunks.
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tests/testing/status_matchers.h"
#include "tests/unit/worker/engine_test_util.h"
#include "tests/unit/worker/mm_fixture.h"
#include "vision/image_processor.h"
#include "worker/architectures/vision_tower.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::MaxAbsDiff;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;
using testing::Images;
using testing::MmPrompt;
using testing::ReadBytes;
using testing::ReadMm;

struct EngineSetup {
  bool tower_lora = true;
  bool mixed = true;
  int max_num_batched_tokens = 512;
  int tp_rank = 0;
};

std::unique_ptr<testing::EngineHolder> MakeMmEngine(const std::string& fixture,
                                                    EngineSetup s = {}) {
  auto h = std::make_unique<testing::EngineHolder>();
  EngineOptions o;
  o.model_dir = Data(fixture + "/model");
  o.enable_mixed_moe_lora_format = s.mixed;
  o.enable_tower_connector_lora = s.tower_lora;
  o.max_loras = 4;
  o.max_lora_rank = 8;
  o.max_num_batched_tokens = s.max_num_batched_tokens;
  o.max_num_seqs = 8;
  o.kv_cache_memory_bytes = int64_t{64} << 20;
  auto e = Engine::Create(o, h->comm.get());
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return nullptr;
  h->engine = std::move(*e);
  return h;
}

std::vector<float> Rows(const std::vector<float>& all, const std::vector<int64_t>& rows, size_t V) {
  std::vector<float> out;
  for (int64_t r : rows) {
    if ((r + 1) * V > all.size()) return {};
    out.insert(out.end(), all.begin() + r * V, all.begin() + (r + 1) * V);
  }
  return out;
}

std::vector<float> MmPromptLogits(Engine& e, int64_t adapter, const std::string& fixture,
                                  const MmPrompt& p, int64_t id = 1) {
  NewSequence n;
  n.id = id;
  n.adapter_id = adapter;
  n.prompt = p.ids;
  n.images = Images(fixture, p);
  n.return_prompt_logits = true;
  n.max_tokens = 1;
  std::vector<float> logits;
  // Chunked prefills take several steps before the sampled token.
  for (int step = 0; step < 64 && logits.empty(); ++step) {
    auto out = e.Step(step == 0 ? std::vector<NewSequence>{n} : std::vector<NewSequence>{}, {});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return {};
    for (const TokenOut& t : out->tokens) {
      if (t.sequence_id == id) logits = t.prompt_logits;
    }
  }
  return logits;
}

class VisionTest : public ::testing::TestWithParam<const char*> {};

TEST_P(VisionTest, PixelValuesEqualTheProcessors) {
  const std::string fixture = GetParam();
  auto cfg = vision::ImageProcessorConfig::Load(Data(fixture + "/model"));
  ASSERT_TRUE(cfg.ok()) << cfg.status();
  int checked = 0;
  for (const MmPrompt& p : ReadMm(fixture)) {
    std::vector<float> ours;
    for (const std::string& name : p.images) {
      auto im = vision::ProcessImage(ReadBytes(Data(fixture + "/images/" + name)), *cfg);
      ASSERT_TRUE(im.ok()) << im.status();
      const auto v = vision::PixelValues(*im, *cfg);
      ours.insert(ours.end(), v.begin(), v.end());
    }
    EXPECT_EQ(ours, p.pixel_values);
    checked += !p.images.empty();
  }
  EXPECT_EQ(checked, 3);
}

TEST_P(VisionTest, ImagePromptsMatchTransformersBaseAndBothLayoutsWithTowerLora) {
  const std::string fixture = GetParam();
  const auto prompts = ReadMm(fixture);
  ASSERT_EQ(prompts.size(), 4u);
  // Whole prompts in one step, and chunks of 16 tokens (images split across steps).
  for (int chunk : {512, 16}) {
    EngineSetup s;
    s.max_num_batched_tokens = chunk;
    auto h = MakeMmEngine(fixture, s);
    ASSERT_NE(h, nullptr);
    ASSERT_OK(testing::Load(*h->engine, 3, fixture + "/adapter_3d"));
    ASSERT_OK(testing::Load(*h->engine, 2, fixture + "/adapter_2d"));
    for (size_t k = 0; k < prompts.size(); ++k) {
      const MmPrompt& p = prompts[k];
      for (auto [variant, id] :
           {std::pair<const char*, int64_t>{"base", 0}, {"adapter_3d", 3}, {"adapter_2d", 2}}) {
        const auto& want = p.logits.at(variant);
        const size_t V = want.size() / p.rows.size();
        const auto got = Rows(MmPromptLogits(*h->engine, id, fixture, p), p.rows, V);
        const float d = MaxAbsDiff(got, want);
        std::printf("[ref] %s chunk %d prompt %zu %s: max |logit - HF| = %.3g\n", fixture.c_str(),
                    chunk, k, variant, d);
        EXPECT_LE(d, 1e-4f) << fixture << " chunk " << chunk << " prompt " << k << " " << variant;
      }
    }
  }
}

TEST_P(VisionTest, MixedBatchOfImagesAndAdaptersEqualsEachAlone) {
  const std::string fixture = GetParam();
  const auto prompts = ReadMm(fixture);
  auto h = MakeMmEngine(fixture);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(testing::Load(*h->engine, 3, fixture + "/adapter_3d"));
  ASSERT_OK(testing::Load(*h->engine, 2, fixture + "/adapter_2d"));
  auto run = [&](const std::vector<std::pair<size_t, int64_t>>& reqs, int64_t first_id) {
    std::vector<NewSequence> add;
    for (size_t i = 0; i < reqs.size(); ++i) {
      NewSequence n;
      n.id = first_id + static_cast<int64_t>(i);
      n.adapter_id = reqs[i].second;
      n.prompt = prompts[reqs[i].first].ids;
      n.images = Images(fixture, prompts[reqs[i].first]);
      n.max_tokens = 6;
      n.return_logits = true;
      add.push_back(std::move(n));
    }
    std::vector<testing::Generation> g(reqs.size());
    for (int step = 0; step < 40; ++step) {
      auto out = h->engine->Step(step == 0 ? add : std::vector<NewSequence>{}, {});
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) break;
      for (const TokenOut& t : out->tokens) {
        g[t.sequence_id - first_id].tokens.push_back(t.token);
        g[t.sequence_id - first_id].logits.push_back(t.logits);
      }
    }
    return g;
  };
  // The upstream test's shape: two images through a 2D and a 3D adapter, together and in the
  // other order, and beside the base model.
  const std::vector<std::pair<size_t, int64_t>> mixed = {{0, 2}, {1, 3}, {3, 0}};
  const std::vector<std::pair<size_t, int64_t>> swapped = {{1, 2}, {0, 3}, {3, 0}};
  for (const auto& reqs : {mixed, swapped}) {
    auto batch = run(reqs, 100);
    for (size_t i = 0; i < reqs.size(); ++i) {
      auto alone = run({reqs[i]}, 200);
      ASSERT_EQ(alone[0].tokens.size(), 6u);
      const char* variant = reqs[i].second == 0   ? "base"
                            : reqs[i].second == 2 ? "adapter_2d"
                                                  : "adapter_3d";
      EXPECT_EQ(alone[0].tokens, prompts[reqs[i].first].continuation.at(variant))
          << "transformers' greedy tokens, request " << i;
      EXPECT_EQ(alone[0].tokens, batch[i].tokens) << "request " << i;
      for (size_t t = 0; t < alone[0].logits.size() && t < batch[i].logits.size(); ++t) {
        EXPECT_LE(MaxAbsDiff(alone[0].logits[t], batch[i].logits[t]), 5e-5f)
            << "request " << i << " token " << t;
      }
    }
  }
}

TEST_P(VisionTest, AnImageSeenBeforeReusesItsTowerOutputPerAdapter) {
  const std::string fixture = GetParam();
  const auto prompts = ReadMm(fixture);
  auto h = MakeMmEngine(fixture);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(testing::Load(*h->engine, 3, fixture + "/adapter_3d"));
  const MmPrompt& p = prompts[0];
  const auto first = MmPromptLogits(*h->engine, 3, fixture, p, 1);
  EngineInfo i = h->engine->Info();
  EXPECT_EQ(i.images_encoded, 1);
  EXPECT_EQ(i.encoder_cache_hits, 0);
  // The same image under the same adapter (a later turn of a chat): the tower does not run, and
  // the logits are the same bit for bit.
  const auto again = MmPromptLogits(*h->engine, 3, fixture, p, 2);
  i = h->engine->Info();
  EXPECT_EQ(i.images_encoded, 1);
  EXPECT_EQ(i.encoder_cache_hits, 1);
  ASSERT_EQ(first.size(), again.size());
  EXPECT_EQ(0, std::memcmp(first.data(), again.data(), first.size() * sizeof(float)));
  // Another adapter adapts the tower differently: computed, not reused.
  const auto base = MmPromptLogits(*h->engine, 0, fixture, p, 3);
  EXPECT_EQ(h->engine->Info().images_encoded, 2);
  const size_t V = p.logits.at("base").size() / p.rows.size();
  EXPECT_LE(MaxAbsDiff(Rows(base, p.rows, V), p.logits.at("base")), 1e-4f);
}

TEST_P(VisionTest, TowerLoraNeedsTheFlagAndBadImagesAreRefusedByIndex) {
  const std::string fixture = GetParam();
  const auto prompts = ReadMm(fixture);
  EngineSetup s;
  s.tower_lora = false;
  auto h = MakeMmEngine(fixture, s);
  ASSERT_NE(h, nullptr);
  auto st = testing::Load(*h->engine, 3, fixture + "/adapter_3d");
  EXPECT_THAT(
      st, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--enable-tower-connector-lora")));
  EXPECT_THAT(st, StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("model.visual.")));
  // Images still work without it (base model).
  const MmPrompt& p = prompts[1];
  const size_t V = p.logits.at("base").size() / p.rows.size();
  EXPECT_LE(
      MaxAbsDiff(Rows(MmPromptLogits(*h->engine, 0, fixture, p), p.rows, V), p.logits.at("base")),
      1e-4f);

  auto step = [&](NewSequence n) {
    n.id = 50;
    n.max_tokens = 1;
    return h->engine->Step({n}, {}).status();
  };
  NewSequence n;
  n.prompt = p.ids;
  n.images = Images(fixture, p);
  n.images[1].rgb.resize(10);
  EXPECT_THAT(step(n), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("image 1: ")));
  n.images = Images(fixture, p);
  n.images[0].offset += 1;
  EXPECT_THAT(step(n), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("image 0: ")));
  n.images = Images(fixture, p);
  n.images.pop_back();
  EXPECT_THAT(step(n), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("image tokens")));
  n.images.clear();
  EXPECT_THAT(step(n), StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no image")));
  // Nothing of the refused joiners stayed.
  EXPECT_EQ(h->engine->Info().running, 0);
}

INSTANTIATE_TEST_SUITE_P(Models, VisionTest,
                         ::testing::Values("qwen3_vl_moe_mm", "qwen3_5_moe_mm"));

TEST(VisionAttentionTest, TiledEqualsPlainSoftmaxOverFramesOfManyTiles) {
  // Frames of 700 and 1300 rows: several 512-row and 512-key tiles, partial ones included.
  at::manual_seed(3);
  const int64_t N = 2000, heads = 3, d = 72;
  const at::Tensor q = at::randn({N, heads, d}), k = at::randn({N, heads, d}),
                   v = at::randn({N, heads, d});
  const std::vector<int64_t> frames = {0, 700, 2000};
  const at::Tensor tiled = FrameAttention(q, k, v, frames, 0.12, true);
  const at::Tensor chunked = FrameAttention(q, k, v, frames, 0.12, false);
  // The plain form: the whole softmax of each frame.
  std::vector<at::Tensor> ref;
  for (size_t f = 0; f + 1 < frames.size(); ++f) {
    const int64_t s = frames[f], n = frames[f + 1] - s;
    const at::Tensor qi = q.narrow(0, s, n).transpose(0, 1), ki = k.narrow(0, s, n).transpose(0, 1),
                     vi = v.narrow(0, s, n).transpose(0, 1);
    ref.push_back(at::matmul((at::matmul(qi, ki.transpose(1, 2)) * 0.12).softmax(-1), vi)
                      .transpose(0, 1)
                      .reshape({n, heads * d}));
  }
  const at::Tensor want = at::cat(ref, 0);
  EXPECT_LE((tiled - want).abs().max().item<float>(), 1e-5f);
  EXPECT_LE((chunked - want).abs().max().item<float>(), 1e-5f);
  // Not the attention over both frames at once.
  const at::Tensor one = FrameAttention(q, k, v, {0, N}, 0.12, true);
  EXPECT_GT((one - want).abs().max().item<float>(), 1e-2f);
}

TEST(VisionConfigTest, KeysTheTowerDoesNotImplementAreRefusedByName) {
  const std::string ok = R"({"vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2,
      "out_hidden_size": 24, "num_position_embeddings": 36, "model_type": "x"}})";
  ASSERT_OK(VisionConfig::Parse(ok, "c.json", true, 5, 24, 100).status());
  for (const char* extra : {R"("window_size": 112)", R"("fullatt_block_indexes": [7])",
                            R"("rope_parameters": {"rope_type": "yarn"})"}) {
    const std::string bad = R"({"vision_config": {"depth": 2, "hidden_size": 32, "num_heads": 2,
        "out_hidden_size": 24, "num_position_embeddings": 36, )" +
                            std::string(extra) + "}}";
    EXPECT_THAT(
        VisionConfig::Parse(bad, "c.json", true, 5, 24, 100).status(),
        StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("c.json: vision_config.")))
        << extra;
  }
}

TEST(VisionTextOnlyModelTest, ImagesAreRefused) {
  auto h = testing::MakeEngine("qwen3_moe/model", false);
  ASSERT_NE(h, nullptr);
  NewSequence n;
  n.id = 1;
  n.prompt = {1, 2, 3};
  n.max_tokens = 1;
  n.images.push_back({0, 16, 16, std::string(16 * 16 * 3, '\0')});
  EXPECT_THAT(h->engine->Step({n}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no vision tower")));
}

}  // namespace
}  // namespace moelora
