// Layout conversions against independent references: PEFT's own per-expert delta weights
// (tests/data/*/expected_deltas.safetensors, written by tools/make_fixtures.py) and a naive
// out-of-place transpose.
#include "lora/convert.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <cmath>
#include <numeric>
#include <random>

#include "common/dtype.h"
#include "tests/testing/adapter_builder.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"

namespace moelora {
namespace {

using ::moelora::testing::AdapterBuilder;
using ::moelora::testing::IsOk;
using ::moelora::testing::StatusIs;
using ::moelora::testing::TempDir;

const std::string kData = MOELORA_TEST_DATA_DIR;

TEST(InPlaceTranspose, MatchesNaiveTransposeOnManyShapes) {
  std::mt19937 rng(1);
  std::vector<std::array<int64_t, 3>> shapes = {
      {1, 1, 1},  {1, 7, 4},   {7, 1, 4},    {2, 3, 4},      {3, 2, 4},
      {4, 4, 4},  {6, 4, 2},   {4, 6, 2},    {12, 8, 4},     {8, 12, 8},
      {16, 4, 6}, {20, 4, 32}, {24, 128, 2}, {1536, 128, 2}, {9, 6, 3}};
  for (int k = 0; k < 40; ++k) {
    shapes.push_back({1 + static_cast<int64_t>(rng() % 50), 1 + static_cast<int64_t>(rng() % 50),
                      1 + static_cast<int64_t>(rng() % 5)});
  }
  for (const auto& [m, n, es] : shapes) {
    std::vector<uint8_t> data(static_cast<size_t>(m * n * es));
    for (auto& x : data) x = static_cast<uint8_t>(rng());
    std::vector<uint8_t> expected(data.size());
    for (int64_t i = 0; i < m; ++i) {
      for (int64_t j = 0; j < n; ++j) {
        std::memcpy(&expected[(j * m + i) * es], &data[(i * n + j) * es], es);
      }
    }
    std::vector<uint8_t> scratch;
    InPlaceTranspose(data.data(), m, n, static_cast<size_t>(es), &scratch);
    EXPECT_EQ(data, expected) << m << "x" << n << " elem " << es;
    EXPECT_LE(scratch.size(), static_cast<size_t>(std::max(m, n) * es));
  }
}

// Max |ours - PEFT| over every expert projection of every layer.
double MaxDiffAgainstPeft(const LoraAdapter& adapter, const std::string& deltas_path,
                          int* compared) {
  auto ref = SafetensorsFile::Open(deltas_path);
  EXPECT_THAT(ref, IsOk());
  double worst = 0;
  *compared = 0;
  for (const auto& [prefix, layer] : adapter.moe) {
    EXPECT_EQ(layer.format, AdapterFormat::k2D);
    for (size_t e = 0; e < layer.experts.size(); ++e) {
      for (int p = 0; p < 3; ++p) {
        if (!layer.experts[e][p]) continue;
        const std::string key = "layers." + std::to_string(layer.layer) + ".experts." +
                                std::to_string(e) + "." +
                                ExpertProjName(static_cast<ExpertProj>(p));
        const TensorView* r = (*ref)->Find(key);
        if (r == nullptr) {
          ADD_FAILURE() << "no reference " << key;
          continue;
        }
        std::vector<float> ours = DeltaWeight(*layer.experts[e][p]);
        std::vector<float> theirs = ToF32(*r);
        EXPECT_EQ(ours.size(), theirs.size()) << key;
        for (size_t i = 0; i < std::min(ours.size(), theirs.size()); ++i) {
          worst = std::max(worst, static_cast<double>(std::abs(ours[i] - theirs[i])));
        }
        ++*compared;
      }
    }
  }
  return worst;
}

struct FixtureCase {
  std::string dir;
  bool convert;
  int expected_projections;
};

TEST(Convert, ThreeDToTwoDEqualsPeftDeltas) {
  for (const FixtureCase& c : std::vector<FixtureCase>{{"qwen3_moe/adapter_3d", true, 24},
                                                       {"qwen3_vl_moe/adapter_3d", true, 24},
                                                       {"gpt_oss/adapter_3d", true, 24},
                                                       {"qwen3_moe/adapter_2d", false, 24},
                                                       {"qwen3_moe/adapter_2d_shared_a", false, 24},
                                                       {"qwen3_moe/adapter_3d_as_2d", false, 24}}) {
    AdapterReadOptions opt;
    if (c.dir.rfind("gpt_oss", 0) == 0) {
      auto m = ReadModelInfo(kData + "/gpt_oss/model");
      ASSERT_THAT(m, IsOk());
      opt.model = *m;  // GPT-OSS: interleaved gate/up
    }
    opt.convert_to_2d = c.convert;
    auto a = ReadAdapter(kData + "/" + c.dir, opt);
    ASSERT_THAT(a, IsOk()) << c.dir;
    EXPECT_EQ(a->converted_to_2d, c.convert) << c.dir;
    int compared = 0;
    const double diff =
        MaxDiffAgainstPeft(*a, kData + "/" + c.dir + "/expected_deltas.safetensors", &compared);
    EXPECT_EQ(compared, c.expected_projections) << c.dir;
    EXPECT_LE(diff, 1e-6) << c.dir;
    RecordProperty(c.dir + "_max_abs_diff", std::to_string(diff));
  }
}

TEST(Convert, GptOssWithoutInterleaveDisagreesWithPeft) {
  // The interleave matters: reading GPT-OSS gate/up as concatenated must not match PEFT.
  AdapterReadOptions opt;
  opt.convert_to_2d = true;
  auto a = ReadAdapter(kData + "/gpt_oss/adapter_3d", opt);
  ASSERT_THAT(a, IsOk());
  int compared = 0;
  EXPECT_GT(
      MaxDiffAgainstPeft(*a, kData + "/gpt_oss/adapter_3d/expected_deltas.safetensors", &compared),
      1e-3);
}

TEST(Convert, ConvertedThreeDIsBitIdenticalToPythonTwin) {
  // adapter_3d_as_2d was written by the fixture script's own numpy slicing of docs/formats.md §4.
  AdapterReadOptions opt;
  opt.convert_to_2d = true;
  auto ours = ReadAdapter(kData + "/qwen3_moe/adapter_3d", opt);
  auto twin = ReadAdapter(kData + "/qwen3_moe/adapter_3d_as_2d");
  ASSERT_THAT(ours, IsOk());
  ASSERT_THAT(twin, IsOk());
  for (const auto& [prefix, layer] : ours->moe) {
    const auto& other = twin->moe.at(prefix);
    for (size_t e = 0; e < layer.experts.size(); ++e) {
      for (int p = 0; p < 3; ++p) {
        const LoraPair& x = *layer.experts[e][p];
        const LoraPair& y = *other.experts[e][p];
        ASSERT_EQ(x.a.shape, y.a.shape);
        ASSERT_EQ(x.b.shape, y.b.shape);
        EXPECT_EQ(std::memcmp(x.a.data(), y.a.data(), x.a.nbytes()), 0)
            << prefix << " " << e << " " << p;
        EXPECT_EQ(std::memcmp(x.b.data(), y.b.data(), x.b.nbytes()), 0)
            << prefix << " " << e << " " << p;
      }
    }
  }
}

TEST(Convert, ConversionWhileReadingEqualsReadThenConvertInPlace) {
  // ReadAdapter(convert_to_2d) permutes lora_B while copying it out of the file; the CLI reads,
  // then converts in place. Both must give the same bytes: f32, GPT-OSS's interleave, bf16 with
  // r and E multiples of 8 (the SSE2 8 x 8 transposes) and not (the element-wise copy), gate_up
  // rows (2I = 18) not a multiple of the 4-row blocks.
  TempDir tmp;
  auto bf16_adapter = [&](const std::string& name, int experts, int rank) {
    AdapterBuilder b(5);
    b.Experts3D("model.layers.0.mlp.experts", experts, rank, 24, 9, DType::kBF16);
    b.config()["target_modules"] = nlohmann::json::array();
    b.config()["target_parameters"] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
    b.config()["r"] = rank;  // E is inferred from the rows of lora_A and r
    return b.Write(tmp.Sub(name));
  };
  auto gpt_oss = ReadModelInfo(kData + "/gpt_oss/model");
  ASSERT_THAT(gpt_oss, IsOk());
  struct Case {
    std::string dir;
    std::optional<ModelInfo> model;
    int experts;  // the builder's E (0: a fixture)
  };
  for (const auto& [dir, model, experts] :
       std::vector<Case>{{kData + "/qwen3_moe/adapter_3d", std::nullopt, 0},
                         {kData + "/gpt_oss/adapter_3d", *gpt_oss, 0},
                         {bf16_adapter("bf16_e16_r8", 16, 8), std::nullopt, 16},
                         {bf16_adapter("bf16_e8_r16", 8, 16), std::nullopt, 8},
                         {bf16_adapter("bf16_e6_r4", 6, 4), std::nullopt, 6}}) {
    AdapterReadOptions opt;
    opt.model = model;
    auto separate = ReadAdapter(dir, opt);
    ASSERT_THAT(separate, IsOk()) << dir;
    ASSERT_THAT(ConvertTo2DInPlace(&*separate), IsOk()) << dir;
    opt.convert_to_2d = true;
    auto fused = ReadAdapter(dir, opt);
    ASSERT_THAT(fused, IsOk()) << dir;
    if (experts > 0) {
      EXPECT_EQ(fused->num_experts, experts) << dir;
    }
    ASSERT_EQ(fused->moe.size(), separate->moe.size()) << dir;
    for (const auto& [prefix, layer] : fused->moe) {
      const auto& other = separate->moe.at(prefix);
      ASSERT_EQ(layer.format, AdapterFormat::k2D);
      ASSERT_EQ(layer.experts.size(), other.experts.size());
      for (size_t e = 0; e < layer.experts.size(); ++e) {
        for (int p = 0; p < 3; ++p) {
          const LoraPair& x = *layer.experts[e][p];
          const LoraPair& y = *other.experts[e][p];
          ASSERT_EQ(x.b.shape, y.b.shape);
          EXPECT_EQ(std::memcmp(x.a.data(), y.a.data(), x.a.nbytes()), 0)
              << dir << " " << prefix << " expert " << e << " proj " << p << " lora_A";
          EXPECT_EQ(std::memcmp(x.b.data(), y.b.data(), x.b.nbytes()), 0)
              << dir << " " << prefix << " expert " << e << " proj " << p << " lora_B";
        }
      }
    }
  }
}

TEST(Convert, InPlaceConversionAllocatesNoSecondCopy) {
  AdapterReadOptions opt;
  opt.convert_to_2d = true;
  auto a = ReadAdapter(kData + "/qwen3_moe/adapter_3d");
  ASSERT_THAT(a, IsOk());
  std::set<const HostBuffer*> before;
  for (const auto& [prefix, layer] : a->moe) {
    before.insert(layer.gate_up->a.storage.get());
    before.insert(layer.gate_up->b.storage.get());
    before.insert(layer.down->a.storage.get());
    before.insert(layer.down->b.storage.get());
  }
  ASSERT_THAT(ConvertTo2DInPlace(&*a), IsOk());
  for (const auto& [prefix, layer] : a->moe) {
    for (const auto& ex : layer.experts) {
      for (const auto& p : ex) {
        EXPECT_TRUE(before.count(p->a.storage.get()));
        EXPECT_TRUE(before.count(p->b.storage.get()));
      }
      EXPECT_EQ(ex[0]->a.data(), ex[1]->a.data());  // w1 and w3 share lora_A
    }
  }
}

std::string TensorBytes(const std::string& file) {
  auto f = SafetensorsFile::Open(file);
  EXPECT_THAT(f, IsOk());
  std::map<std::string, std::string> by_name;  // file order may differ; compare by name
  for (const auto& t : (*f)->tensors()) {
    by_name[t.name] =
        t.ShapeString() + std::string(reinterpret_cast<const char*>(t.data), t.nbytes);
  }
  std::string out;
  for (const auto& [name, bytes] : by_name) out += name + bytes;
  return out;
}

TEST(Convert, ThreeDToTwoDToThreeDIsBitExact) {
  for (const std::string dir : {"qwen3_moe/adapter_3d", "gpt_oss/adapter_3d"}) {
    TempDir tmp;
    AdapterReadOptions opt;
    opt.arch = dir.rfind("gpt_oss", 0) == 0 ? "GptOssForCausalLM" : "Qwen3MoeForCausalLM";
    opt.convert_to_2d = true;
    auto a = ReadAdapter(kData + "/" + dir, opt);
    ASSERT_THAT(a, IsOk());
    ASSERT_THAT(WriteAdapter(*a, tmp.Sub("2d")), IsOk());
    AdapterReadOptions opt2;
    opt2.arch = opt.arch;
    auto b = ReadAdapter(tmp.Sub("2d"), opt2);
    ASSERT_THAT(b, IsOk());
    EXPECT_EQ(b->format, AdapterFormat::k2D);
    ASSERT_THAT(ConvertTo3D(&*b), IsOk());
    ASSERT_THAT(WriteAdapter(*b, tmp.Sub("3d")), IsOk());
    EXPECT_EQ(TensorBytes(tmp.Sub("3d/adapter_model.safetensors")),
              TensorBytes(kData + "/" + dir + "/adapter_model.safetensors"))
        << dir;
    auto c = ReadAdapter(tmp.Sub("3d"));
    ASSERT_THAT(c, IsOk());
    EXPECT_EQ(c->format, AdapterFormat::k3D);
  }
}

TEST(Convert, TwoDToThreeDRankConcatKeepsDeltas) {
  // A 2D adapter whose gate and up have different A: fused with rank 2r, scaling unchanged.
  TempDir tmp;
  auto a = ReadAdapter(kData + "/qwen3_moe/adapter_2d");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(ConvertTo3D(&*a), IsOk());
  EXPECT_EQ(a->moe.begin()->second.gate_up->rank, 6);
  ASSERT_THAT(WriteAdapter(*a, tmp.Sub("3d")), IsOk());
  AdapterReadOptions opt;
  opt.convert_to_2d = true;
  auto back = ReadAdapter(tmp.Sub("3d"), opt);
  ASSERT_THAT(back, IsOk());
  int compared = 0;
  EXPECT_LE(MaxDiffAgainstPeft(*back, kData + "/qwen3_moe/adapter_2d/expected_deltas.safetensors",
                               &compared),
            1e-6);
  EXPECT_EQ(compared, 24);
}

TEST(Convert, SharedAFusesWithoutRankGrowth) {
  auto a = ReadAdapter(kData + "/qwen3_moe/adapter_2d_shared_a");
  ASSERT_THAT(a, IsOk());
  ASSERT_THAT(ConvertTo3D(&*a), IsOk());
  EXPECT_EQ(a->moe.begin()->second.gate_up->rank, 2);
}

TEST(Convert, Bf16ThreeDConvertsLikeF32) {
  TempDir tmp;
  AdapterBuilder b16(3), b32(3);
  b16.Experts3D("model.layers.0.mlp.experts", 8, 2, 24, 10, DType::kBF16);
  b16.config()["target_modules"] = nlohmann::json::array();
  b16.config()["target_parameters"] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  auto a = ReadAdapter(b16.Write(tmp.Sub("bf16")), {.convert_to_2d = true});
  ASSERT_THAT(a, IsOk());
  // Reference: element-wise from the 3D tensors per docs/formats.md §4.
  auto orig = ReadAdapter(tmp.Sub("bf16"));
  ASSERT_THAT(orig, IsOk());
  const LoraPair& gu = *orig->moe.begin()->second.gate_up;
  const auto& layer = a->moe.begin()->second;
  for (int e = 0; e < 8; ++e) {
    const LoraPair& up = *layer.experts[e][1];
    for (int i = 0; i < 10; ++i) {
      for (int j = 0; j < 2; ++j) {
        const float want = LoadAsF32(DType::kBF16, gu.b.data(), (10 + i) * 16 + j * 8 + e);
        EXPECT_EQ(LoadAsF32(DType::kBF16, up.b.data(), i * 2 + j), want);
      }
    }
  }
}

TEST(Convert, TwoDToThreeDRefusesMissingProjection) {
  TempDir tmp;
  AdapterBuilder b;
  for (int e = 0; e < 4; ++e)
    b.Pair("model.layers.0.mlp.experts." + std::to_string(e) + ".gate_proj", 2, 24, 10);
  auto a = ReadAdapter(b.Write(tmp.Sub("g")));
  ASSERT_THAT(a, IsOk());
  EXPECT_THAT(ConvertTo3D(&*a), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(a->format, AdapterFormat::k2D);  // unchanged
  EXPECT_EQ(a->moe.begin()->second.format, AdapterFormat::k2D);
}

}  // namespace
}  // namespace moelora
