// The engine against transformers + PEFT (tests/data, tools/make_fixtures.py) and against
// itself: converted 3D == native 3D == equivalent 2D, mixed batches == requests alone, Qwen3-MoE
// storage == Qwen3-VL-MoE storage, base tokens untouched by loaded adapters.
#include <ATen/ATen.h>

#include <atomic>
#include <cstring>
#include <filesystem>
#include <thread>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "kernels/device.h"
#include "tests/testing/require_device.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/worker/engine_test_util.h"
#include "worker/torch_guard.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::ExpectBitIdentical;
using ::moelora::testing::GenerateBatch;
using ::moelora::testing::Generation;
using ::moelora::testing::Load;
using ::moelora::testing::MakeEngine;
using ::moelora::testing::MaxAbsDiff;
using ::moelora::testing::PromptLogits;
using ::moelora::testing::ReadExpected;
using ::moelora::testing::StatusIs;
using ::testing::AllOf;
using ::testing::HasSubstr;

constexpr float kRefTol = 1e-4f;   // against transformers + PEFT (f32)
constexpr float kSelfTol = 1e-5f;  // engine against itself

struct RefCase {
  const char* arch_dir;  // qwen3_moe | qwen3_vl_moe
  const char* variant;   // expected_logits variant; also the adapter directory ("" for base)
  bool mixed;
  const char* device = "cpu";  // cpu-twins: the GPU code path through the kernels' CPU twins
  // The model directory under arch_dir: `model`, or `model_hf5` (Qwen3-VL-MoE as transformers 5
  // saves it: the experts in the other layout, the same weights and expected logits).
  const char* model = "model";
};

class ReferenceLogitsTest : public ::testing::TestWithParam<RefCase> {};

std::string RefCaseName(const ::testing::TestParamInfo<RefCase>& info) {
  return std::string(info.param.arch_dir) +
         (std::string(info.param.model) == "model" ? "" : std::string("_") + info.param.model) +
         "_" + info.param.variant + (info.param.mixed ? "_mixed" : "");
}

bool CudaUsable() { return at::hasCUDA() && CudaDeviceAvailable(); }

TEST_P(ReferenceLogitsTest, MatchesTransformersAndPeft) {
  const RefCase c = GetParam();
  if (std::string(c.device) == "cuda") {
    MOELORA_SKIP_UNLESS_DEVICE(CudaUsable(),
                               "needs libtorch with CUDA and a device: " << CudaDeviceSummary());
  }
  const std::string dir = c.arch_dir;
  auto ref = ReadExpected(Data(dir + "/expected_logits.safetensors"));
  ASSERT_EQ(ref.prompts.size(), 3u);
  auto h = MakeEngine(dir + "/" + c.model, c.mixed, 4, 8, "float32", c.device);
  ASSERT_NE(h, nullptr);
  int64_t adapter = 0;
  const std::string variant = c.variant;
  if (variant != "base") {
    adapter = 7;
    ASSERT_OK(Load(*h->engine, adapter, dir + "/" + variant));
  }
  const auto& want = ref.logits.at(variant);
  float worst = 0;
  for (size_t k = 0; k < ref.prompts.size(); ++k) {
    auto got = PromptLogits(*h->engine, adapter, ref.prompts[k], 1 + k);
    ASSERT_EQ(got.size(), want[k].size());
    worst = std::max(worst, MaxAbsDiff(got, want[k]));
  }
  RecordProperty("max_abs_diff", std::to_string(worst));
  std::printf("[ref] %s %s mixed=%d %s: max |logit - HF| = %.3g\n", c.arch_dir, c.variant, c.mixed,
              c.device, worst);
  EXPECT_LE(worst, kRefTol);
}

INSTANTIATE_TEST_SUITE_P(
    Fixtures, ReferenceLogitsTest,
    ::testing::Values(
        RefCase{"qwen3_moe", "base", false}, RefCase{"qwen3_moe", "adapter_2d", false},
        RefCase{"qwen3_moe", "adapter_2d_shared_a", false},
        RefCase{"qwen3_moe", "adapter_3d_as_2d", false}, RefCase{"qwen3_moe", "adapter_3d", true},
        RefCase{"qwen3_moe", "adapter_2d", true}, RefCase{"qwen3_vl_moe", "base", false},
        RefCase{"qwen3_vl_moe", "adapter_3d", false}, RefCase{"qwen3_vl_moe", "adapter_3d", true},
        RefCase{"qwen3_vl_moe", "adapter_2d", true},
        RefCase{"qwen3_vl_moe", "base", false, "cpu", "model_hf5"},
        RefCase{"qwen3_vl_moe", "adapter_3d", false, "cpu", "model_hf5"},
        RefCase{"qwen3_vl_moe", "adapter_2d", true, "cpu", "model_hf5"}),
    RefCaseName);

// Qwen3.5-MoE (Gated DeltaNet + gated attention + shared expert) against transformers + PEFT:
// text-only and VL checkpoints, base, the 3D adapter native and converted in mixed mode, and the
// 2D adapter (reference: the hand-merged base model), over prompts up to 70 tokens (two chunks
// of the chunked delta rule).
struct Q35Case {
  const char* model;    // qwen3_5_moe/model | qwen3_5_moe/model_vl
  const char* variant;  // base | adapter_3d | adapter_2d
  bool mixed;
};
class Qwen35ReferenceTest : public ::testing::TestWithParam<Q35Case> {};

TEST_P(Qwen35ReferenceTest, PrefillLogitsMatchTransformers) {
  const Q35Case c = GetParam();
  auto ref = ReadExpected(Data("qwen3_5_moe/expected_logits.safetensors"));
  ASSERT_EQ(ref.prompts.size(), 3u);
  auto h = MakeEngine(c.model, c.mixed, 4, 8);
  ASSERT_NE(h, nullptr);
  int64_t adapter = 0;
  if (std::string(c.variant) != "base") {
    adapter = 5;
    ASSERT_OK(Load(*h->engine, adapter, std::string("qwen3_5_moe/") + c.variant));
  }
  float worst = 0;
  for (size_t k = 0; k < ref.prompts.size(); ++k) {
    auto got = PromptLogits(*h->engine, adapter, ref.prompts[k], 1 + k);
    worst = std::max(worst, MaxAbsDiff(got, ref.logits.at(c.variant)[k]));
  }
  std::printf("[ref] %s %s mixed=%d: max |logit - HF| = %.3g\n", c.model, c.variant, c.mixed,
              worst);
  EXPECT_LE(worst, kRefTol);
}

INSTANTIATE_TEST_SUITE_P(Fixtures, Qwen35ReferenceTest,
                         ::testing::Values(Q35Case{"qwen3_5_moe/model", "base", false},
                                           Q35Case{"qwen3_5_moe/model", "adapter_3d", false},
                                           Q35Case{"qwen3_5_moe/model", "adapter_3d", true},
                                           Q35Case{"qwen3_5_moe/model", "adapter_2d", true},
                                           Q35Case{"qwen3_5_moe/model_vl", "base", false},
                                           Q35Case{"qwen3_5_moe/model_vl", "adapter_3d", true}),
                         [](const ::testing::TestParamInfo<Q35Case>& i) {
                           return std::string(std::string(i.param.model).find("_vl") !=
                                                      std::string::npos
                                                  ? "vl_"
                                                  : "text_") +
                                  i.param.variant + (i.param.mixed ? "_mixed" : "");
                         });

// Config variants of the Qwen3-MoE fixture (RoPE linear / yarn / llama3, the sliding window):
// greedy generation through prefill and decode steps gives transformers' tokens, and each step's
// logits are transformers' no-cache logits at that position (tools/make_fixtures.py).
class ConfigVariantTest : public ::testing::TestWithParam<const char*> {};

TEST_P(ConfigVariantTest, GreedyDecodeMatchesTransformers) {
  const std::string dir = std::string("qwen3_moe/variants/") + GetParam();
  auto f = SafetensorsFile::Open(Data(dir + "/expected.safetensors"));
  ASSERT_OK(f);
  auto ints = [&](const std::string& name) {
    const TensorView* v = (*f)->Find(name);
    std::vector<int32_t> out(v ? v->numel() : 0);
    if (v) std::memcpy(out.data(), v->data, v->nbytes);
    return out;
  };
  auto h = MakeEngine(dir + "/model", false);
  ASSERT_NE(h, nullptr);
  const int64_t V = h->engine->Info().vocab_size;
  float worst = 0;
  int prompts = 0;
  for (int k = 0;; ++k) {
    const std::vector<int32_t> prompt = ints("prompt." + std::to_string(k));
    if (prompt.empty()) break;
    ++prompts;
    const std::vector<int32_t> want = ints("continuation." + std::to_string(k));
    const TensorView* full = (*f)->Find("logits.full." + std::to_string(k));
    ASSERT_NE(full, nullptr);
    const float* ref = static_cast<const float*>(static_cast<const void*>(full->data));
    auto g = GenerateBatch(*h->engine, {0}, {prompt}, static_cast<int>(want.size()), 10 * k + 100);
    EXPECT_EQ(g[0].tokens, want) << "prompt " << k;
    for (size_t i = 0; i < g[0].logits.size(); ++i) {
      const int64_t row = static_cast<int64_t>(prompt.size()) - 1 + static_cast<int64_t>(i);
      std::vector<float> r(ref + row * V, ref + (row + 1) * V);
      worst = std::max(worst, MaxAbsDiff(g[0].logits[i], r));
    }
  }
  EXPECT_EQ(prompts, 3);
  std::printf("[ref] %s: greedy decode, max |logit - HF| = %.3g\n", GetParam(), worst);
  EXPECT_LE(worst, kRefTol);
}

INSTANTIATE_TEST_SUITE_P(Qwen3Moe, ConfigVariantTest,
                         ::testing::Values("rope_linear", "rope_yarn", "rope_llama3",
                                           "sliding_window"));

// The exception boundary: what libtorch throws becomes a Status.
TEST(TorchGuardTest, ExceptionsBecomeStatuses) {
  auto internal = GuardTorch("op", []() -> absl::Status {
    TORCH_CHECK(false, "boom");
    return absl::OkStatus();
  });
  EXPECT_THAT(internal, StatusIs(absl::StatusCode::kInternal, HasSubstr("op: libtorch: boom")));
  auto oom = GuardTorch("alloc", []() -> absl::StatusOr<at::Tensor> {
    return at::empty({int64_t{1} << 50}, at::kFloat);  // 4 PiB
  });
  EXPECT_THAT(oom.status(), StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("alloc")));
  auto fine = GuardTorch("ok", []() -> absl::StatusOr<int> { return 3; });
  ASSERT_OK(fine);
  EXPECT_EQ(*fine, 3);
}

// The device path's code (slots in the compute dtype, per-token slot tensors, the fused MoE
// call with both wrappers) through the CUDA kernels' CPU twins.
INSTANTIATE_TEST_SUITE_P(
    KernelTwins, ReferenceLogitsTest,
    ::testing::Values(RefCase{"qwen3_moe", "base", false, "cpu-twins"},
                      RefCase{"qwen3_moe", "adapter_2d", false, "cpu-twins"},
                      RefCase{"qwen3_moe", "adapter_3d", true, "cpu-twins"},
                      RefCase{"qwen3_vl_moe", "adapter_3d", false, "cpu-twins"},
                      RefCase{"qwen3_vl_moe", "adapter_2d", true, "cpu-twins"}),
    RefCaseName);

// The GPU worker path: weights, slots and the kernels on the device (gpu_check.sh runs these).
INSTANTIATE_TEST_SUITE_P(Cuda, ReferenceLogitsTest,
                         ::testing::Values(RefCase{"qwen3_moe", "base", false, "cuda"},
                                           RefCase{"qwen3_moe", "adapter_2d", false, "cuda"},
                                           RefCase{"qwen3_moe", "adapter_3d", true, "cuda"},
                                           RefCase{"qwen3_vl_moe", "adapter_3d", false, "cuda"},
                                           RefCase{"qwen3_vl_moe", "adapter_2d", true, "cuda"}),
                         RefCaseName);

TEST(EngineTest, CudaBfloatMixedBatchStaysCloseToReference) {
  MOELORA_SKIP_UNLESS_DEVICE(CudaUsable(),
                             "needs libtorch with CUDA and a device: " << CudaDeviceSummary());
  auto ref = ReadExpected(Data("qwen3_moe/expected_logits.safetensors"));
  auto h = MakeEngine("qwen3_moe/model", true, 4, 8, "bfloat16", "cuda");
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 3, "qwen3_moe/adapter_3d"));
  ASSERT_OK(Load(*h->engine, 4, "qwen3_moe/adapter_2d"));
  for (auto [id, variant] :
       {std::pair<int64_t, const char*>{3, "adapter_3d"}, {4, "adapter_2d"}, {0, "base"}}) {
    auto got = PromptLogits(*h->engine, id, ref.prompts[1]);
    const float d = MaxAbsDiff(got, ref.logits.at(variant)[1]);
    std::printf("[ref] cuda bf16 %s: max |logit - HF f32| = %.3g\n", variant, d);
    EXPECT_LE(d, 0.1f) << variant;
  }
}

TEST(EngineTest, BfloatComputeStaysCloseToReference) {
  auto ref = ReadExpected(Data("qwen3_moe/expected_logits.safetensors"));
  auto h = MakeEngine("qwen3_moe/model", true, 4, 8, "bfloat16");
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 3, "qwen3_moe/adapter_3d"));
  auto got = PromptLogits(*h->engine, 3, ref.prompts[1]);
  const float d = MaxAbsDiff(got, ref.logits.at("adapter_3d")[1]);
  std::printf("[ref] bf16 adapter_3d: max |logit - HF f32| = %.3g\n", d);
  EXPECT_LE(d, 0.1f);  // bf16 has 8 mantissa bits; logits are O(1)
}

// The same bf16 batch with both layouts of adapter and the base, twice: the same bits (a read of
// uninitialised memory or a race in the kernels would show here; bench/peer sees bf16 tokens
// move only when its concurrent calls are grouped differently).
TEST(EngineTest, BfloatMixedBatchRepeatsBitForBit) {
  auto h = MakeEngine("qwen3_moe/model", true, 4, 8, "bfloat16");
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "qwen3_moe/adapter_2d"));
  ASSERT_OK(Load(*h->engine, 2, "qwen3_moe/adapter_3d"));
  const std::vector<std::vector<int32_t>> prompts = {
      {1, 17, 42, 5, 88}, {3, 9, 27, 81}, {7, 2, 95}, {11, 4, 60, 33}};
  const std::vector<int64_t> adapters = {1, 2, 0, 2};
  auto first = GenerateBatch(*h->engine, adapters, prompts, 6);
  auto second = GenerateBatch(*h->engine, adapters, prompts, 6);
  ASSERT_EQ(first.size(), second.size());
  for (size_t j = 0; j < first.size(); ++j) {
    EXPECT_EQ(first[j].tokens, second[j].tokens) << "request " << j;
    ASSERT_EQ(first[j].logits.size(), second[j].logits.size());
    for (size_t t = 0; t < first[j].logits.size(); ++t) {
      EXPECT_EQ(MaxAbsDiff(first[j].logits[t], second[j].logits[t]), 0.0f)
          << "request " << j << " step " << t;
    }
  }
}

// Converted 3D (mixed mode) == native 3D wrapper == the equivalent 2D adapter.
TEST(EngineTest, Converted3DEqualsNative3DEqualsEquivalent2D) {
  const std::vector<std::vector<int32_t>> prompts = {{1, 17, 42, 5, 88}, {3, 9, 27}};
  auto vl_native = MakeEngine("qwen3_vl_moe/model", false);
  auto vl_mixed = MakeEngine("qwen3_vl_moe/model", true);
  auto q_mixed = MakeEngine("qwen3_moe/model", true);
  auto q_2d = MakeEngine("qwen3_moe/model", false);
  ASSERT_OK(Load(*vl_native->engine, 1, "qwen3_vl_moe/adapter_3d"));
  ASSERT_OK(Load(*vl_mixed->engine, 1, "qwen3_vl_moe/adapter_3d"));
  ASSERT_OK(Load(*q_mixed->engine, 1, "qwen3_moe/adapter_3d"));
  ASSERT_OK(Load(*q_2d->engine, 1, "qwen3_moe/adapter_3d_as_2d"));
  EXPECT_EQ(vl_native->engine->Info().native_format, AdapterFormat::k3D);
  auto a = GenerateBatch(*vl_native->engine, {1, 1}, prompts, 8);
  for (auto* other : {vl_mixed.get(), q_mixed.get(), q_2d.get()}) {
    auto b = GenerateBatch(*other->engine, {1, 1}, prompts, 8);
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(a[i].tokens, b[i].tokens);
      for (size_t t = 0; t < a[i].logits.size(); ++t) {
        EXPECT_LE(MaxAbsDiff(a[i].logits[t], b[i].logits[t]), kSelfTol)
            << "seq " << i << " token " << t;
      }
    }
  }
}

// The seed's test on our tiny model: a batch [2D adapter, 3D adapter, base] equals each request
// run alone, in both orders.
TEST(EngineTest, MixedBatchEqualsEachRequestAloneInEitherOrder) {
  auto h = MakeEngine("qwen3_moe/model", true);
  ASSERT_OK(Load(*h->engine, 1, "qwen3_moe/adapter_2d"));
  ASSERT_OK(Load(*h->engine, 2, "qwen3_moe/adapter_3d"));
  const std::vector<std::vector<int32_t>> prompts = {
      {1, 17, 42, 5, 88}, {3, 9, 27, 81}, {7, 2, 95}};
  const std::vector<int64_t> adapters = {1, 2, 0};
  std::vector<testing::Generation> alone;
  for (size_t i = 0; i < prompts.size(); ++i) {
    alone.push_back(GenerateBatch(*h->engine, {adapters[i]}, {prompts[i]}, 6)[0]);
  }
  // The adapters change the output (otherwise the test proves nothing).
  auto base0 = GenerateBatch(*h->engine, {0}, {prompts[0]}, 6)[0];
  EXPECT_GT(MaxAbsDiff(base0.logits[0], alone[0].logits[0]), 1e-3f);
  for (bool swapped : {false, true}) {
    std::vector<size_t> order = {0, 1, 2};
    if (swapped) order = {2, 1, 0};
    std::vector<int64_t> ad;
    std::vector<std::vector<int32_t>> pr;
    for (size_t i : order) ad.push_back(adapters[i]), pr.push_back(prompts[i]);
    auto batch = GenerateBatch(*h->engine, ad, pr, 6);
    for (size_t j = 0; j < order.size(); ++j) {
      const auto& want = alone[order[j]];
      EXPECT_EQ(batch[j].tokens, want.tokens) << "request " << order[j] << " swapped=" << swapped;
      for (size_t t = 0; t < want.logits.size(); ++t) {
        EXPECT_LE(MaxAbsDiff(batch[j].logits[t], want.logits[t]), kSelfTol);
      }
    }
  }
}

TEST(EngineTest, SameModelStoredPerExpertOrFusedTransposedGivesSameLogits) {
  auto q = MakeEngine("qwen3_moe/model", false);
  auto vl = MakeEngine("qwen3_vl_moe/model", false);
  const std::vector<int32_t> prompt = {3, 9, 27, 81, 50, 11, 60};
  const float d =
      MaxAbsDiff(PromptLogits(*q->engine, 0, prompt), PromptLogits(*vl->engine, 0, prompt));
  EXPECT_LE(d, kSelfTol);
}

TEST(EngineTest, BaseTokensBitIdenticalWithAdaptersLoaded) {
  auto plain = MakeEngine("qwen3_moe/model", true);
  auto loaded = MakeEngine("qwen3_moe/model", true);
  ASSERT_OK(Load(*loaded->engine, 1, "qwen3_moe/adapter_2d"));
  ASSERT_OK(Load(*loaded->engine, 2, "qwen3_moe/adapter_3d"));
  const std::vector<std::vector<int32_t>> prompts = {{1, 17, 42, 5, 88}, {7, 2, 95}};
  auto a = GenerateBatch(*plain->engine, {0, 0}, prompts, 5);
  auto b = GenerateBatch(*loaded->engine, {0, 0}, prompts, 5);
  ::moelora::testing::ExpectBitIdentical(a, b);
}

// On the kernel path: a batch mixing a 2D adapter, a 3D adapter (converted) and the base model
// equals each request alone, and its base rows are bit-identical to an engine with no adapters
// running a batch of the same shape (the same GEMM shapes: BLAS may pick another kernel, and so
// another summation order, for another number of rows, as OpenBLAS does on AVX-512 machines).
TEST(EngineTest, KernelTwinsMixedBatchEqualsAloneAndKeepsBaseBitIdentical) {
  auto plain = MakeEngine("qwen3_moe/model", true, 4, 8, "float32", "cpu-twins");
  auto loaded = MakeEngine("qwen3_moe/model", true, 4, 8, "float32", "cpu-twins");
  ASSERT_NE(plain, nullptr);
  ASSERT_NE(loaded, nullptr);
  ASSERT_OK(Load(*loaded->engine, 1, "qwen3_moe/adapter_2d"));
  ASSERT_OK(Load(*loaded->engine, 2, "qwen3_moe/adapter_3d"));
  const std::vector<std::vector<int32_t>> prompts = {{1, 17, 42, 5, 88}, {7, 2, 95}, {4, 4, 8}};
  auto mixed = GenerateBatch(*loaded->engine, {1, 0, 2}, prompts, 4);
  auto base = GenerateBatch(*plain->engine, {0, 0, 0}, prompts, 4);
  ASSERT_EQ(mixed[1].logits.size(), base[1].logits.size());
  for (size_t t = 0; t < base[1].logits.size(); ++t) {
    EXPECT_EQ(0, std::memcmp(mixed[1].logits[t].data(), base[1].logits[t].data(),
                             base[1].logits[t].size() * sizeof(float)))
        << "token " << t;
  }
  // The adapters really change their own rows (so the comparison above could fail).
  EXPECT_GT(MaxAbsDiff(mixed[0].logits[0], base[0].logits[0]), 1e-3f);
  for (int i : {0, 2}) {
    auto alone = GenerateBatch(*loaded->engine, {i == 0 ? 1 : 2}, {prompts[i]}, 4);
    EXPECT_EQ(alone[0].tokens, mixed[i].tokens);
    for (size_t t = 0; t < alone[0].logits.size(); ++t) {
      EXPECT_LE(MaxAbsDiff(alone[0].logits[t], mixed[i].logits[t]), kSelfTol);
    }
  }
}

TEST(EngineTest, DeviceFlagIsCheckedAndCudaFailsCleanlyWithoutOne) {
  int idx = 0;
  EXPECT_THAT(ParseDevice("tpu", &idx), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(ParseDevice("cuda:x", &idx), StatusIs(absl::StatusCode::kInvalidArgument));
  ASSERT_OK(ParseDevice("cuda:1", &idx));
  EXPECT_EQ(idx, 1);
  EngineOptions o;
  o.model_dir = Data("qwen3_moe/model");
  o.device = "cpu-twins";
  o.max_lora_rank = 65;
  auto comm = MakeLocalCommunicator();
  EXPECT_THAT(Engine::Create(o, comm.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("ranks up to 64")));
  // The fused MoE kernel's sort takes num_experts x (max_loras + 1) <= 10240 keys (the tiny
  // model has 4 experts): refused at load, naming the flag and the largest value that works.
  o.max_lora_rank = 8;
  o.max_loras = 2560;
  EXPECT_THAT(Engine::Create(o, comm.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       AllOf(HasSubstr("--max-loras 2560"), HasSubstr("--max-loras <= 2559"))));
  o.max_loras = 4;
  // Fully sharded LoRAs run on the CPU path only: refused on the kernel paths, naming the flag.
  o.fully_sharded_loras = true;
  EXPECT_THAT(Engine::Create(o, comm.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       HasSubstr("--fully-sharded-loras runs on the CPU path only")));
  o.fully_sharded_loras = false;
  if (!at::hasCUDA()) {
    o.device = "cuda";
    EXPECT_THAT(Engine::Create(o, comm.get()).status(),
                StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("no CUDA")));
  }
}

TEST(EngineTest, LayoutThatTheWrapperDoesNotTakeIsFailedPreconditionNamingTheFlag) {
  auto q = MakeEngine("qwen3_moe/model", false);
  EXPECT_THAT(
      Load(*q->engine, 1, "qwen3_moe/adapter_3d"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--enable-mixed-moe-lora-format")));
  auto vl = MakeEngine("qwen3_vl_moe/model", false);
  EXPECT_THAT(
      Load(*vl->engine, 1, "qwen3_vl_moe/adapter_2d"),
      StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--enable-mixed-moe-lora-format")));
  // Nothing was kept: the slot is free again and the id can be reused for a valid adapter.
  ASSERT_OK(Load(*q->engine, 1, "qwen3_moe/adapter_2d"));
  EXPECT_EQ(q->engine->Info().committed_adapters, 1);
}

TEST(EngineTest, SlotsAndRanksAreBounded) {
  auto h = MakeEngine("qwen3_moe/model", true, /*max_loras=*/2, /*max_rank=*/3);
  EXPECT_THAT(Load(*h->engine, 1, "qwen3_moe/adapter_3d"),  // r=4
              StatusIs(absl::StatusCode::kResourceExhausted));
  ASSERT_OK(Load(*h->engine, 1, "qwen3_moe/adapter_2d"));
  ASSERT_OK(Load(*h->engine, 2, "qwen3_moe/adapter_2d_shared_a"));
  EXPECT_THAT(Load(*h->engine, 3, "qwen3_moe/adapter_3d_as_2d"),
              StatusIs(absl::StatusCode::kResourceExhausted, HasSubstr("--max-loras")));
  ASSERT_OK(h->engine->UnloadAdapter(2));
  EXPECT_THAT(h->engine->UnloadAdapter(2), StatusIs(absl::StatusCode::kNotFound));
}

// Threads of this process (Linux: /proc/self/task).
int ThreadCount() {
  int n = 0;
  for ([[maybe_unused]] const auto& e : std::filesystem::directory_iterator("/proc/self/task")) ++n;
  return n;
}

// ThreadCount once it has not changed for 100 ms (threads of a finished OpenMP team exit after
// their owner does, asynchronously); at most 5 s.
int SettledThreadCount() {
  int n = ThreadCount();
  for (int same = 0, i = 0; same < 10 && i < 500; ++i) {
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    const int m = ThreadCount();
    same = m == n ? same + 1 : 0;
    n = m;
  }
  return n;
}

// The load, staging (the 3D-to-2D conversion is an OpenMP region), unloads and steps all run on
// the engine's compute thread: a caller that opened regions itself would keep an OpenMP team of
// its own, and with more libgomp threads than cores every region of a step waits for a sleeping
// thread to wake (engine.cc). So the engine adds its compute thread and that one team only.
TEST(EngineTest, TensorWorkRunsOnTheComputeThreadOnly) {
  // Each round from a fresh caller thread. The first one also starts libtorch's process-wide
  // pools (its pthreadpool keeps a thread), which the second round's count then includes.
  for (int round = 0; round < 2; ++round) {
    SCOPED_TRACE(round);
    std::thread caller([round] {
      const int before = SettledThreadCount();
      auto comm = MakeLocalCommunicator();
      EngineOptions o;
      o.model_dir = Data("qwen3_moe/model");
      o.enable_mixed_moe_lora_format = true;
      o.num_threads = 2;
      auto e = Engine::Create(o, comm.get());
      ASSERT_OK(e.status());
      Engine& eng = **e;
      ASSERT_OK(Load(eng, 1, "qwen3_moe/adapter_3d"));
      ASSERT_OK(Load(eng, 2, "qwen3_moe/adapter_2d"));
      GenerateBatch(eng, {1, 2, 0}, {{1, 2, 3}, {4, 5}, {6}}, 3);
      ASSERT_OK(eng.UnloadAdapter(1, /*keep_in_host_cache=*/true));
      ASSERT_OK(Load(eng, 1, "qwen3_moe/adapter_3d"));  // from the host cache
      EXPECT_THAT(Load(eng, 3, "qwen3_moe/no_such_adapter"), StatusIs(absl::StatusCode::kNotFound));
      // The compute thread and the one other thread of its 2-thread team.
      if (round == 1) {
        EXPECT_EQ(ThreadCount() - before, 2);
      }
    });
    caller.join();
  }
}

// CPU slots pack each adapter at its own rank: in an engine whose --max-lora-rank is 32 the same
// adapters (ranks up to 8) give bit-identical logits to an engine at 8, loaded from disk and
// swapped back in from the host cache, alone and mixed (3D converted beside 2D).
TEST(EngineTest, SlotsPackedAtTheAdaptersRankGiveTheSameLogits) {
  auto narrow = MakeEngine("qwen3_moe/model", /*mixed=*/true, /*max_loras=*/2, /*max_rank=*/8);
  auto wide = MakeEngine("qwen3_moe/model", /*mixed=*/true, /*max_loras=*/2, /*max_rank=*/32);
  ASSERT_NE(narrow, nullptr);
  ASSERT_NE(wide, nullptr);
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4}, {5, 6}, {7}};
  std::vector<std::vector<Generation>> got;
  for (Engine* e : {narrow->engine.get(), wide->engine.get()}) {
    ASSERT_OK(Load(*e, 1, "qwen3_moe/adapter_3d"));
    ASSERT_OK(Load(*e, 2, "qwen3_moe/adapter_2d"));
    got.push_back(GenerateBatch(*e, {1, 2, 0}, prompts, 4, 100));
    // Both out into the host cache and back (restored from the packed image).
    ASSERT_OK(e->UnloadAdapter(1, /*keep_in_host_cache=*/true).status());
    ASSERT_OK(e->UnloadAdapter(2, /*keep_in_host_cache=*/true).status());
    ASSERT_OK(Load(*e, 2, "qwen3_moe/adapter_2d"));
    ASSERT_OK(Load(*e, 1, "qwen3_moe/adapter_3d"));
    got.push_back(GenerateBatch(*e, {1, 2, 0}, prompts, 4, 200));
  }
  ExpectBitIdentical(got[1], got[0]);
  ExpectBitIdentical(got[2], got[0]);
  ExpectBitIdentical(got[3], got[0]);
}

// Adapters staged, swapped out and swapped in from another thread while a batch steps (as the
// controller's swap-ins come beside its step calls): the batch gets bit-identical logits, and
// every load stays usable (the TSan tree checks the threads' accesses).
TEST(EngineTest, AdapterWorkBetweenStepsChangesNoStep) {
  auto h = MakeEngine("qwen3_moe/model", /*mixed=*/true, /*max_loras=*/3);
  ASSERT_NE(h, nullptr);
  Engine& e = *h->engine;
  ASSERT_OK(Load(e, 1, "qwen3_moe/adapter_3d"));
  const std::vector<std::vector<int32_t>> prompts = {{1, 2, 3, 4}, {5, 6}};
  const auto want = GenerateBatch(e, {1, 0}, prompts, 6, 100);
  std::atomic<bool> done{false};
  std::atomic<int> loads{0};
  std::thread adapter_work([&] {
    for (int i = 0; !done.load() || i < 4; ++i) {
      // Kept in the host cache every other round: the next round swaps it in from there.
      ASSERT_OK(Load(e, 2, "qwen3_moe/adapter_2d"));
      ASSERT_OK(e.UnloadAdapter(2, /*keep_in_host_cache=*/i % 2 == 0).status());
      loads.fetch_add(1);
    }
  });
  for (int round = 0; round < 6; ++round) {
    SCOPED_TRACE(round);
    ExpectBitIdentical(GenerateBatch(e, {1, 0}, prompts, 6, 200 + 10 * round), want);
  }
  done.store(true);
  adapter_work.join();
  EXPECT_GE(loads.load(), 4);
  ASSERT_OK(Load(e, 2, "qwen3_moe/adapter_2d"));
  const auto with2 = GenerateBatch(e, {2, 1}, prompts, 4, 400);
  const auto alone = GenerateBatch(e, {2}, {prompts[0]}, 4, 500);
  EXPECT_EQ(with2[0].tokens, alone[0].tokens);
}

// The host cache: a swapped-out adapter (UnloadAdapter keeping it) comes back from host memory
// with no file to read, bit-identical; the least recently used is evicted beyond max_cpu_loras;
// an unload by the user forgets it. 3D converted (mixed mode), 2D, and 2D with shared A.
TEST(EngineTest, HostCacheSwapInReadsNoFileAndIsExact) {
  ::moelora::testing::TempDir tmp;
  const std::vector<std::string> dirs = {"adapter_3d", "adapter_2d", "adapter_2d_shared_a"};
  for (const auto& d : dirs) {
    std::filesystem::copy(Data("qwen3_moe/" + d), tmp.path() + "/" + d,
                          std::filesystem::copy_options::recursive);
  }
  EngineOptions o;
  o.model_dir = Data("qwen3_moe/model");
  o.enable_mixed_moe_lora_format = true;
  o.max_loras = 1;
  o.max_lora_rank = 8;
  o.max_cpu_loras = 2;
  auto comm = MakeLocalCommunicator();
  auto e = Engine::Create(o, comm.get());
  ASSERT_OK(e);
  Engine& eng = **e;
  const std::vector<int32_t> prompt = {1, 17, 42, 5, 9};
  std::vector<std::vector<float>> want;
  for (size_t k = 0; k < dirs.size(); ++k) {
    const int64_t id = static_cast<int64_t>(k) + 1;
    auto st = eng.StageAdapter(id, tmp.path() + "/" + dirs[k], std::nullopt);
    ASSERT_OK(st);
    EXPECT_FALSE(st->from_host_cache);
    ASSERT_OK(eng.CommitAdapter(id));
    want.push_back(PromptLogits(eng, id, prompt, 10 + id));
    auto cache = eng.UnloadAdapter(id, /*keep_in_host_cache=*/true);
    ASSERT_OK(cache);
    EXPECT_EQ(cache->adapter_ids.front(), id);
    EXPECT_GT(cache->bytes, 0);
  }
  ASSERT_GT(MaxAbsDiff(want[0], want[1]), 1e-3f);
  std::filesystem::remove_all(tmp.path());
  // Capacity 2: adapter 1 was evicted when 3 came in, and its file is gone.
  EXPECT_EQ(eng.Info().host_cache.adapter_ids, (std::vector<int64_t>{3, 2}));
  EXPECT_THAT(eng.StageAdapter(1, tmp.path() + "/" + dirs[0], std::nullopt),
              StatusIs(absl::StatusCode::kNotFound));
  int64_t holder = 0;  // the adapter in the slot
  for (int64_t id : {2, 3, 2, 3}) {
    if (holder != 0) {
      ASSERT_OK(eng.UnloadAdapter(holder, /*keep_in_host_cache=*/true));
    }
    auto st = eng.StageAdapter(id, tmp.path() + "/" + dirs[id - 1], std::nullopt);
    ASSERT_OK(st);
    EXPECT_TRUE(st->from_host_cache);
    EXPECT_EQ(st->phase_seconds.count("swap_in"), 1u);
    EXPECT_EQ(st->phase_seconds.count("read"), 0u);
    ASSERT_OK(eng.CommitAdapter(id));
    holder = id;
    EXPECT_EQ(MaxAbsDiff(PromptLogits(eng, id, prompt, 100 + id), want[id - 1]), 0.0f) << id;
  }
  // 3 holds the slot, 2 is cached. The same id under another path is not served from the cache
  // (and the stale entry is dropped).
  ASSERT_OK(eng.UnloadAdapter(3, true));
  EXPECT_EQ(eng.Info().host_cache.adapter_ids, (std::vector<int64_t>{3, 2}));
  EXPECT_THAT(eng.StageAdapter(2, tmp.path() + "/elsewhere", std::nullopt),
              StatusIs(absl::StatusCode::kNotFound));
  EXPECT_EQ(eng.Info().host_cache.adapter_ids, (std::vector<int64_t>{3}));
  // An unload by the user forgets it in the cache (3 is not loaded: NOT_FOUND, and gone).
  EXPECT_THAT(eng.UnloadAdapter(3, false), StatusIs(absl::StatusCode::kNotFound));
  EXPECT_TRUE(eng.Info().host_cache.adapter_ids.empty());
  EXPECT_EQ(eng.Info().host_cache.bytes, 0);
  EXPECT_FALSE(eng.StageAdapter(3, tmp.path() + "/" + dirs[2], std::nullopt).ok());
}

// The 3D adapter native in a 3D-wrapped model (Qwen3-VL-MoE, no mixed mode) through the cache.
TEST(EngineTest, HostCacheKeepsA3DSlotExactly) {
  auto h = MakeEngine("qwen3_vl_moe/model", false, 1, 8);
  ASSERT_NE(h, nullptr);
  ASSERT_OK(Load(*h->engine, 1, "qwen3_vl_moe/adapter_3d"));
  const std::vector<int32_t> prompt = {3, 1, 4, 1, 5, 9, 2, 6};
  const auto want = PromptLogits(*h->engine, 1, prompt, 1);
  const auto base = PromptLogits(*h->engine, 0, prompt, 2);
  ASSERT_GT(MaxAbsDiff(want, base), 1e-3f);
  ASSERT_OK(h->engine->UnloadAdapter(1, true));
  EXPECT_EQ(MaxAbsDiff(PromptLogits(*h->engine, 0, prompt, 3), base), 0.0f);  // slot cleared
  auto st = h->engine->StageAdapter(1, Data("qwen3_vl_moe/adapter_3d"), std::nullopt);
  ASSERT_OK(st);
  EXPECT_TRUE(st->from_host_cache);
  ASSERT_OK(h->engine->CommitAdapter(1));
  EXPECT_EQ(MaxAbsDiff(PromptLogits(*h->engine, 1, prompt, 4), want), 0.0f);
}

TEST(EngineTest, StageAbortAndIdempotentStage) {
  auto h = MakeEngine("qwen3_moe/model", true, 1);
  auto s1 = h->engine->StageAdapter(5, Data("qwen3_moe/adapter_3d"), std::nullopt);
  ASSERT_OK(s1);
  EXPECT_EQ(s1->detected_format, AdapterFormat::k3D);
  EXPECT_TRUE(s1->converted_to_2d);
  ASSERT_OK(h->engine->StageAdapter(5, Data("qwen3_moe/adapter_3d"), std::nullopt));  // same
  EXPECT_THAT(h->engine->StageAdapter(5, Data("qwen3_moe/adapter_2d"), std::nullopt),
              StatusIs(absl::StatusCode::kAlreadyExists));
  // Staged is not usable.
  NewSequence n{.id = 1, .adapter_id = 5, .prompt = {1, 2}};
  EXPECT_THAT(h->engine->Step({n}, {}).status(), StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(h->engine->AbortAdapter(5));
  ASSERT_OK(Load(*h->engine, 6, "qwen3_moe/adapter_2d"));  // the only slot is free again
  EXPECT_THAT(h->engine->StageAdapter(7, Data("qwen3_moe/adapter_2d"), AdapterFormat::k3D),
              StatusIs(absl::StatusCode::kResourceExhausted));
}

TEST(EngineTest, FlagThatContradictsTheFileIsInvalidArgument) {
  auto h = MakeEngine("qwen3_moe/model", true);
  EXPECT_THAT(h->engine->StageAdapter(1, Data("qwen3_moe/adapter_2d"), AdapterFormat::k3D).status(),
              StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_THAT(h->engine->StageAdapter(1, Data("does/not/exist"), std::nullopt).status(),
              StatusIs(absl::StatusCode::kNotFound));
  ASSERT_OK(Load(*h->engine, 1, "qwen3_moe/adapter_2d"));
}

// Steps(add, remove, k): the same tokens, finishes and per-step outputs as k calls of Step, one
// StepOutput per step; it stops early once every sequence has finished.
TEST(EngineTest, StepsEqualsThatManyStepCalls) {
  auto one = MakeEngine("qwen3_moe/model", true);
  auto many = MakeEngine("qwen3_moe/model", true);
  for (auto* h : {one.get(), many.get()}) {
    ASSERT_OK(Load(*h->engine, 1, "qwen3_moe/adapter_2d"));
    ASSERT_OK(Load(*h->engine, 2, "qwen3_moe/adapter_3d"));
  }
  const std::vector<NewSequence> add = {
      {.id = 1, .adapter_id = 1, .prompt = {1, 17, 42}, .max_tokens = 3},
      {.id = 2, .adapter_id = 2, .prompt = {3, 9, 27, 81}, .max_tokens = 6},
      {.id = 3, .prompt = {7, 2, 95}, .max_tokens = 9}};
  std::vector<StepOutput> want;
  for (int i = 0; i < 5; ++i) {
    auto o = i == 0 ? one->engine->Step(add, {}) : one->engine->Step({}, {});
    ASSERT_OK(o);
    want.push_back(*o);
  }
  auto got = many->engine->Steps(add, {}, 5);
  ASSERT_OK(got);
  ASSERT_EQ(got->size(), want.size());
  auto same = [](const std::vector<StepOutput>& a, const std::vector<StepOutput>& b) {
    for (size_t i = 0; i < a.size(); ++i) {
      EXPECT_EQ(a[i].batch_tokens, b[i].batch_tokens) << "step " << i;
      ASSERT_EQ(a[i].tokens.size(), b[i].tokens.size()) << "step " << i;
      for (size_t j = 0; j < a[i].tokens.size(); ++j) {
        const TokenOut &x = a[i].tokens[j], &y = b[i].tokens[j];
        EXPECT_EQ(x.sequence_id, y.sequence_id);
        EXPECT_EQ(x.token, y.token) << "step " << i << " sequence " << x.sequence_id;
        EXPECT_EQ(x.finished, y.finished);
        EXPECT_EQ(x.finish_reason, y.finish_reason);
      }
    }
  };
  same(*got, want);
  EXPECT_EQ(want[2].tokens.size(), 3u);  // sequence 1 finishes at its third token
  EXPECT_EQ(want[3].tokens.size(), 2u);
  // The rest: 6 more steps asked, 4 run (sequence 3's last token is its 9th).
  want.clear();
  for (int i = 0; i < 4; ++i) {
    auto o = one->engine->Step({}, {});
    ASSERT_OK(o);
    want.push_back(*o);
  }
  got = many->engine->Steps({}, {}, 6);
  ASSERT_OK(got);
  ASSERT_EQ(got->size(), 4u);
  same(*got, want);
  EXPECT_TRUE(got->back().tokens.at(0).finished);
  EXPECT_EQ(many->engine->Info().running, 0);
}

TEST(EngineTest, InvalidJoinerFailsTheStepAndChangesNothing) {
  auto h = MakeEngine("qwen3_moe/model", false);
  NewSequence a{.id = 1, .prompt = {1, 17, 42}, .max_tokens = 4};
  auto first = h->engine->Step({a}, {});
  ASSERT_OK(first);
  NewSequence bad_token{.id = 2, .prompt = {1, 384}};
  EXPECT_THAT(h->engine->Step({bad_token}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("outside [0, 384)")));
  NewSequence dup{.id = 1, .prompt = {1}};
  EXPECT_THAT(h->engine->Step({dup}, {}).status(), StatusIs(absl::StatusCode::kAlreadyExists));
  NewSequence unknown{.id = 3, .adapter_id = 42, .prompt = {1}};
  EXPECT_THAT(h->engine->Step({unknown}, {}).status(), StatusIs(absl::StatusCode::kNotFound));
  NewSequence too_long{.id = 4, .prompt = std::vector<int32_t>(128, 1)};
  EXPECT_THAT(h->engine->Step({too_long}, {}).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_model_len")));
  // Sequence 1 continues exactly as if nothing happened.
  auto alone = MakeEngine("qwen3_moe/model", false);
  auto want = GenerateBatch(*alone->engine, {0}, {{1, 17, 42}}, 4)[0];
  std::vector<int32_t> got = {first->tokens[0].token};
  while (true) {
    auto s = h->engine->Step({}, {});
    ASSERT_OK(s);
    if (s->tokens.empty()) break;
    got.push_back(s->tokens[0].token);
    if (s->tokens[0].finished) {
      EXPECT_EQ(s->tokens[0].finish_reason, "length");
      break;
    }
  }
  EXPECT_EQ(got, want.tokens);
  EXPECT_EQ(h->engine->Info().running, 0);
}

TEST(EngineTest, StopTokensMaxTokensAndRemoval) {
  auto h = MakeEngine("qwen3_moe/model", false);
  auto free_run = GenerateBatch(*h->engine, {0}, {{5, 6, 7}}, 6)[0];
  NewSequence n{
      .id = 1, .prompt = {5, 6, 7}, .max_tokens = 6, .stop_token_ids = {free_run.tokens[2]}};
  std::vector<int32_t> got;
  std::string reason;
  for (int i = 0; i < 10; ++i) {
    auto s = h->engine->Step(i == 0 ? std::vector<NewSequence>{n} : std::vector<NewSequence>{}, {});
    ASSERT_OK(s);
    if (s->tokens.empty()) break;
    got.push_back(s->tokens[0].token);
    if (s->tokens[0].finished) reason = s->tokens[0].finish_reason;
  }
  // Stops at the first occurrence of the stop token (it may occur earlier than index 2).
  EXPECT_EQ(reason, "stop");
  EXPECT_EQ(got.back(), free_run.tokens[2]);
  EXPECT_LE(got.size(), 3u);
  // Removal frees the sequence at once.
  NewSequence m{.id = 2, .prompt = {5, 6}, .max_tokens = 50};
  ASSERT_OK(h->engine->Step({m}, {}));
  EXPECT_EQ(h->engine->Info().running, 1);
  auto s = h->engine->Step({}, {2});
  ASSERT_OK(s);
  EXPECT_TRUE(s->tokens.empty());
  EXPECT_EQ(h->engine->Info().running, 0);
}

TEST(EngineTest, SeededSamplingIsDeterministicAndLogprobsAreLogProbabilities) {
  auto h = MakeEngine("qwen3_moe/model", false);
  auto run = [&](uint64_t seed, int64_t id) {
    NewSequence n{.id = id,
                  .prompt = {1, 2, 3},
                  .sampling = {.temperature = 1.5f, .top_p = 0.95f, .top_k = 50, .seed = seed},
                  .max_tokens = 12,
                  .return_logprobs = true};
    std::vector<int32_t> toks;
    for (int i = 0; i < 12; ++i) {
      auto s =
          h->engine->Step(i == 0 ? std::vector<NewSequence>{n} : std::vector<NewSequence>{}, {});
      EXPECT_TRUE(s.ok());
      if (!s.ok() || s->tokens.empty()) break;
      EXPECT_LE(s->tokens[0].logprob, 0.0f);
      EXPECT_GT(s->tokens[0].logprob, -50.0f);
      toks.push_back(s->tokens[0].token);
    }
    return toks;
  };
  const auto a = run(7, 1), b = run(7, 2), c = run(8, 3);
  EXPECT_EQ(a, b);
  EXPECT_NE(a, c);
  EXPECT_EQ(a.size(), 12u);
}

TEST(EngineTest, ContinuousBatchingJoinMidwayMatchesAlone) {
  auto h = MakeEngine("qwen3_moe/model", true);
  ASSERT_OK(Load(*h->engine, 1, "qwen3_moe/adapter_2d"));
  auto alone = GenerateBatch(*h->engine, {1}, {{9, 8, 7, 6}}, 5)[0];
  NewSequence first{.id = 1, .prompt = {1, 2, 3, 4, 5}, .max_tokens = 8};
  NewSequence late{
      .id = 2, .adapter_id = 1, .prompt = {9, 8, 7, 6}, .max_tokens = 5, .return_logits = true};
  ASSERT_OK(h->engine->Step({first}, {}));
  ASSERT_OK(h->engine->Step({}, {}));
  std::vector<int32_t> got;
  for (int i = 0; i < 5; ++i) {
    auto s =
        h->engine->Step(i == 0 ? std::vector<NewSequence>{late} : std::vector<NewSequence>{}, {});
    ASSERT_OK(s);
    for (const auto& t : s->tokens) {
      if (t.sequence_id == 2) got.push_back(t.token);
    }
  }
  EXPECT_EQ(got, alone.tokens);
}

TEST(EngineTest, ModelErrorsAreClear) {
  auto comm = MakeLocalCommunicator();
  EngineOptions o;
  o.model_dir = Data("gpt_oss/model");  // config only: no loader forward / weights
  EXPECT_FALSE(Engine::Create(o, comm.get()).ok());
  o.model_dir = Data("nope");
  EXPECT_THAT(Engine::Create(o, comm.get()).status(), StatusIs(absl::StatusCode::kNotFound));
  o.model_dir = Data("qwen3_moe/model");
  o.dtype = "float64";
  EXPECT_THAT(Engine::Create(o, comm.get()).status(),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--dtype")));
}

}  // namespace
}  // namespace moelora

namespace moelora {
namespace {

// The engine refuses what the controller refuses (common/request_rules.h): one set of rules.
TEST(EngineTest, RequestBoundsAreTheControllersToo) {
  auto h = ::moelora::testing::MakeEngine("qwen3_moe/model", false);
  ASSERT_NE(h, nullptr);
  NewSequence zero{.id = 1, .prompt = {1, 2}, .max_tokens = 0};
  EXPECT_THAT(h->engine->Step({zero}, {}).status(),
              ::moelora::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("max_tokens 0 must be in [1, ")));
  NewSequence top_p{.id = 2, .prompt = {1, 2}, .sampling = {.top_p = 1.5f}, .max_tokens = 2};
  EXPECT_THAT(h->engine->Step({top_p}, {}).status(),
              ::moelora::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("top_p in [0, 1]")));
  NewSequence stop{.id = 3, .prompt = {1, 2}, .max_tokens = 2, .stop_token_ids = {100000}};
  EXPECT_THAT(h->engine->Step({stop}, {}).status(),
              ::moelora::testing::StatusIs(absl::StatusCode::kInvalidArgument,
                                           ::testing::HasSubstr("stop token 100000")));
  EXPECT_EQ(h->engine->Info().running, 0);
}

}  // namespace
}  // namespace moelora
