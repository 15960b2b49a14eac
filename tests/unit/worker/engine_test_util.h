// Helpers for engine tests: run prompts through an Engine and compare logits.
#ifndef MOELORA_TESTS_UNIT_WORKER_ENGINE_TEST_UTIL_H_
#define MOELORA_TESTS_UNIT_WORKER_ENGINE_TEST_UTIL_H_

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "common/safetensors.h"
#include "gtest/gtest.h"
#include "worker/comm/communicator.h"
#include "worker/engine/engine.h"

namespace moelora::testing {

// tests/data, or $MOELORA_TEST_DATA_DIR (binaries run from a bundle on another machine).
inline std::string Data(const std::string& rel) {
  const char* env = std::getenv("MOELORA_TEST_DATA_DIR");
  return std::string(env && *env ? env : MOELORA_TEST_DATA_DIR) + "/" + rel;
}

struct Fixture {
  std::vector<std::vector<int32_t>> prompts;
  std::map<std::string, std::vector<std::vector<float>>> logits;  // variant -> per prompt [T*V]
};

inline Fixture ReadExpected(const std::string& path) {
  Fixture f;
  auto file = SafetensorsFile::Open(path);
  EXPECT_TRUE(file.ok()) << file.status();
  if (!file.ok()) return f;
  for (int k = 0;; ++k) {
    const TensorView* p = (*file)->Find("prompt." + std::to_string(k));
    if (!p) break;
    std::vector<int32_t> ids(p->numel());
    std::memcpy(ids.data(), p->data, p->nbytes);
    f.prompts.push_back(ids);
  }
  for (const TensorView& v : (*file)->tensors()) {
    if (v.name.rfind("logits.", 0) != 0) continue;
    const std::string rest = v.name.substr(7);
    const std::string variant = rest.substr(0, rest.rfind('.'));
    const int k = std::stoi(rest.substr(rest.rfind('.') + 1));
    auto& vec = f.logits[variant];
    if (static_cast<int>(vec.size()) <= k) vec.resize(k + 1);
    vec[k].resize(v.numel());
    std::memcpy(vec[k].data(), v.data, v.nbytes);
  }
  return f;
}

inline float MaxAbsDiff(const std::vector<float>& a, const std::vector<float>& b) {
  if (a.size() != b.size()) return INFINITY;
  float m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(a[i] - b[i]));
  return m;
}

struct EngineHolder {
  std::unique_ptr<Communicator> comm = MakeLocalCommunicator();
  std::unique_ptr<Engine> engine;
};

inline std::unique_ptr<EngineHolder> MakeEngine(const std::string& model, bool mixed,
                                                int max_loras = 4, int max_rank = 8,
                                                const std::string& dtype = "float32",
                                                const std::string& device = "cpu") {
  auto h = std::make_unique<EngineHolder>();
  EngineOptions o;
  o.device = device;
  o.model_dir = Data(model);
  o.enable_mixed_moe_lora_format = mixed;
  o.max_loras = max_loras;
  o.max_lora_rank = max_rank;
  o.dtype = dtype;
  auto e = Engine::Create(o, h->comm.get());
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return nullptr;
  h->engine = std::move(*e);
  return h;
}

// Stage + commit; returns the status of the first failing phase.
[[nodiscard]] inline absl::Status Load(Engine& e, int64_t id, const std::string& rel) {
  auto s = e.StageAdapter(id, Data(rel), std::nullopt);
  if (!s.ok()) return s.status();
  return e.CommitAdapter(id).status();
}

// Prompt logits [T*V] of one prompt run alone.
inline std::vector<float> PromptLogits(Engine& e, int64_t adapter_id,
                                       const std::vector<int32_t>& prompt, int64_t seq_id = 1) {
  NewSequence n;
  n.id = seq_id;
  n.adapter_id = adapter_id;
  n.prompt = prompt;
  n.return_prompt_logits = true;
  n.max_tokens = 1;
  auto out = e.Step({n}, {});
  EXPECT_TRUE(out.ok()) << out.status();
  if (!out.ok() || out->tokens.empty()) return {};
  return out->tokens[0].prompt_logits;
}

struct Generation {
  std::vector<int32_t> tokens;
  std::vector<std::vector<float>> logits;  // per generated token
};

// Greedy generation of several sequences run together in one batch (all join at step 0).
inline std::vector<Generation> GenerateBatch(Engine& e, const std::vector<int64_t>& adapters,
                                             const std::vector<std::vector<int32_t>>& prompts,
                                             int max_tokens, int64_t first_id = 100) {
  std::vector<NewSequence> add;
  for (size_t i = 0; i < prompts.size(); ++i) {
    NewSequence n;
    n.id = first_id + static_cast<int64_t>(i);
    n.adapter_id = adapters[i];
    n.prompt = prompts[i];
    n.max_tokens = max_tokens;
    n.return_logits = true;
    add.push_back(n);
  }
  std::vector<Generation> g(prompts.size());
  for (int step = 0; step < max_tokens; ++step) {
    auto out = e.Step(step == 0 ? add : std::vector<NewSequence>{}, {});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) return g;
    for (const TokenOut& t : out->tokens) {
      const size_t i = static_cast<size_t>(t.sequence_id - first_id);
      g[i].tokens.push_back(t.token);
      g[i].logits.push_back(t.logits);
    }
  }
  return g;
}

// Same tokens and bit-identical logits, generation by generation.
inline void ExpectBitIdentical(const std::vector<Generation>& a, const std::vector<Generation>& b) {
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i) {
    EXPECT_EQ(a[i].tokens, b[i].tokens) << "sequence " << i;
    ASSERT_EQ(a[i].logits.size(), b[i].logits.size());
    for (size_t t = 0; t < a[i].logits.size(); ++t) {
      ASSERT_EQ(a[i].logits[t].size(), b[i].logits[t].size());
      EXPECT_EQ(0, std::memcmp(a[i].logits[t].data(), b[i].logits[t].data(),
                               a[i].logits[t].size() * sizeof(float)))
          << "sequence " << i << " token " << t;
    }
  }
}

// Greedy generations of `prompts` together (adapter ids in each of `orders`) equal each run
// alone: the same tokens, logits within 5e-5 (f32: a batch's products of 9 or more rows go
// through the wide GEMM, a request alone through the skinny one: two summation orders, 1.02e-5
// apart seen on Step3.5; a row with another adapter's delta would be off by far more). Then the
// first sequence's decode steps equal a prefill of the same tokens (the KV cache and masks of
// single-token steps). The engine must have the orders' adapters loaded.
inline void ExpectBatchesEqualAloneAndDecodeEqualsPrefill(
    Engine& e, const std::vector<std::vector<int64_t>>& orders,
    const std::vector<std::vector<int32_t>>& prompts, int max_tokens) {
  for (const std::vector<int64_t>& order : orders) {
    auto batch = GenerateBatch(e, order, prompts, max_tokens);
    for (size_t i = 0; i < prompts.size(); ++i) {
      auto alone = GenerateBatch(e, {order[i]}, {prompts[i]}, max_tokens, 300);
      EXPECT_EQ(alone[0].tokens, batch[i].tokens) << "adapter " << order[i];
      for (size_t t = 0; t < alone[0].logits.size() && t < batch[i].logits.size(); ++t) {
        EXPECT_LE(MaxAbsDiff(alone[0].logits[t], batch[i].logits[t]), 5e-5f)
            << "adapter " << order[i] << " token " << t;
      }
    }
    if (batch[0].tokens.empty()) continue;
    std::vector<int32_t> seq = prompts[0];
    seq.insert(seq.end(), batch[0].tokens.begin(), batch[0].tokens.end() - 1);
    auto full = PromptLogits(e, order[0], seq, 900);
    const size_t V = batch[0].logits[0].size();
    ASSERT_EQ(full.size(), seq.size() * V);
    for (size_t t = 0; t < batch[0].logits.size(); ++t) {
      const size_t row = prompts[0].size() - 1 + t;
      std::vector<float> r(full.begin() + row * V, full.begin() + (row + 1) * V);
      // Decode rows go through the skinny GEMM, a whole-sequence prefill through BLAS: two f32
      // summation orders (1.2e-5 apart seen on Step3), not two results.
      EXPECT_LE(MaxAbsDiff(batch[0].logits[t], r), 5e-5f) << "step " << t;
    }
  }
}

// `fixture`/model's prompt logits for base, `native` (the adapter in the model's own MoE
// layout) and `other` (the other layout) against `fixture`/expected_logits.safetensors, within
// `tol`: without mixed mode `other` is refused naming the flag, with it both load.
inline void ExpectReferenceLogitsInBothModes(const std::string& fixture, const std::string& native,
                                             const std::string& other, float tol) {
  auto ref = ReadExpected(Data(fixture + "/expected_logits.safetensors"));
  ASSERT_FALSE(ref.prompts.empty());
  for (bool mixed : {false, true}) {
    auto h = MakeEngine(fixture + "/model", mixed, 4, 8);
    ASSERT_NE(h, nullptr);
    ASSERT_TRUE(Load(*h->engine, 1, fixture + "/" + native).ok());
    std::vector<std::pair<int64_t, std::string>> cases = {{0, "base"}, {1, native}};
    const absl::Status s = Load(*h->engine, 2, fixture + "/" + other);
    if (mixed) {
      ASSERT_TRUE(s.ok()) << s;
      cases.push_back({2, other});
    } else {
      EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << s;
      EXPECT_NE(s.message().find("--enable-mixed-moe-lora-format"), std::string::npos) << s;
    }
    for (const auto& [id, variant] : cases) {
      float worst = 0;
      for (size_t k = 0; k < ref.prompts.size(); ++k) {
        auto got = PromptLogits(*h->engine, id, ref.prompts[k], 1 + k);
        worst = std::max(worst, MaxAbsDiff(got, ref.logits.at(variant)[k]));
      }
      std::printf("[ref] %s %s mixed=%d: max |logit - reference| = %.3g\n", fixture.c_str(),
                  variant.c_str(), mixed, worst);
      EXPECT_LE(worst, tol) << variant << " mixed=" << mixed;
    }
  }
}

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_UNIT_WORKER_ENGINE_TEST_UTIL_H_
