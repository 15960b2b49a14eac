// Speculative decoding through the engine (EngineOptions::num_speculative_tokens) on the Qwen3.5
// fixture with a trained MTP head (tests/data/qwen3_5_moe_mtp) and the Step3.5 fixture with three
// trained chained MTP layers (tests/data/step3p5_mtp): continuous batching of base, 3D
// and 2D sequences joining at different steps, with prompts read in chunks, stop tokens and
// max_tokens inside a run of kept drafts, and preemptions, gives every sequence the tokens the
// engine without speculation gives it; sampled sequences keep the target's distribution
// (rejection sampling, a chi-square test against the target's own probabilities); an adapter
// with LoRA on the head drafts adapted and decodes as transformers + PEFT; a model without a head
// is refused.
#include <algorithm>
#include <cmath>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/safetensors.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"
#include "tests/unit/worker/engine_test_util.h"
#include "tests/unit/worker/mm_fixture.h"
#include "worker/comm/communicator.h"
#include "worker/engine/engine.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::EngineHolder;
using ::moelora::testing::Load;
using ::moelora::testing::StatusIs;
using ::testing::HasSubstr;

constexpr int64_t k3D = 1, k2D = 2;  // adapter ids

// A model with MTP heads and the adapters of its target: Qwen3.5's one reused head, or Step3.5's
// three chained heads (at most three drafts a step).
struct SpecFixture {
  const char* name;
  const char* model;     // with expected_mtp.safetensors (its prompts) and model/
  const char* adapters;  // adapter_3d, adapter_2d of the same target
  int max_k;
};
const SpecFixture kQwen35 = {"Qwen35", "qwen3_5_moe_mtp", "qwen3_5_moe", 16};
const SpecFixture kStep35 = {"Step35", "step3p5_mtp", "step3p5", 3};
const SpecFixture* g_fixture = &kQwen35;  // SpeculativeModelsTest sets it

// Sets the fixture for a test's scope (SpeculativeModelsTest sets it per parameter).
struct UseFixture {
  explicit UseFixture(const SpecFixture& f) { g_fixture = &f; }
  ~UseFixture() { g_fixture = &kQwen35; }
};

// k drafts a step, or as many as the fixture's heads allow.
int Drafts(int k) { return std::min(k, g_fixture->max_k); }

std::unique_ptr<EngineHolder> MakeSpecEngine(int k, int max_num_seqs = 8,
                                             int max_num_batched_tokens = 64,
                                             int64_t kv_bytes = int64_t{64} << 20) {
  auto h = std::make_unique<EngineHolder>();
  EngineOptions o;
  o.model_dir = Data(std::string(g_fixture->model) + "/model");
  o.enable_mixed_moe_lora_format = true;
  o.max_lora_rank = 8;
  o.num_speculative_tokens = k;
  o.max_num_seqs = max_num_seqs;
  o.max_num_batched_tokens = max_num_batched_tokens;
  o.kv_cache_memory_bytes = kv_bytes;
  o.block_size = 4;
  auto e = Engine::Create(o, h->comm.get());
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return nullptr;
  h->engine = std::move(*e);
  for (auto [id, dir] : {std::pair<int64_t, const char*>{k3D, "adapter_3d"}, {k2D, "adapter_2d"}}) {
    const absl::Status st = Load(*h->engine, id, std::string(g_fixture->adapters) + "/" + dir);
    EXPECT_TRUE(st.ok()) << st;
  }
  return h;
}

std::vector<std::vector<int32_t>> FixturePrompts() {
  std::vector<std::vector<int32_t>> prompts;
  auto f = SafetensorsFile::Open(Data(std::string(g_fixture->model) + "/expected_mtp.safetensors"));
  EXPECT_TRUE(f.ok()) << f.status();
  if (!f.ok()) return prompts;
  for (int k = 0;; ++k) {
    const TensorView* v = (*f)->Find(absl::StrCat("prompt.", k));
    if (v == nullptr) break;
    const auto* ids = reinterpret_cast<const int64_t*>(v->data);
    prompts.emplace_back(ids, ids + v->numel());
  }
  return prompts;
}

struct Result {
  std::map<int64_t, std::vector<int32_t>> tokens;
  std::map<int64_t, std::string> finish;
  int steps = 0, preempted = 0, multi = 0;   // multi: steps where a sequence got several tokens
  std::map<int64_t, int> steps_with_tokens;  // by sequence
  int64_t drafted = 0, accepted = 0, prefix_hits = 0;
  std::map<int64_t, int64_t> accepted_by;  // by sequence
};

// Runs `joins` (the step each sequence joins at, and the sequence) to the end.
Result RunAll(Engine& e, const std::vector<std::pair<int, NewSequence>>& joins) {
  Result r;
  size_t joined = 0;
  for (int step = 0; step < 10000; ++step) {
    std::vector<NewSequence> add;
    for (const auto& [at, n] : joins) {
      if (at == step) add.push_back(n);
    }
    joined += add.size();
    if (joined == joins.size() && add.empty() && e.Info().running == 0) break;
    auto out = e.Step(add, {});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) break;
    ++r.steps;
    r.preempted += out->preempted;
    r.prefix_hits += out->prefix_hits;
    std::map<int64_t, int> per_seq;
    for (const TokenOut& t : out->tokens) {
      r.tokens[t.sequence_id].push_back(t.token);
      if (++per_seq[t.sequence_id] > 1 && !t.same_step) ADD_FAILURE() << "same_step unset";
      r.drafted += t.drafted;
      r.accepted += t.accepted;
      r.accepted_by[t.sequence_id] += t.accepted;
      if (t.finished) r.finish[t.sequence_id] = t.finish_reason;
    }
    for (const auto& [id, n] : per_seq) {
      r.multi += n > 1;
      ++r.steps_with_tokens[id];
    }
  }
  return r;
}

NewSequence Seq(int64_t id, int64_t adapter, std::vector<int32_t> prompt, int max_tokens) {
  NewSequence n;
  n.id = id;
  n.adapter_id = adapter;
  n.prompt = std::move(prompt);
  n.max_tokens = max_tokens;
  return n;
}

// Base, 3D and 2D sequences joining at steps 0, 0, 2, 3, 5, prompts read in chunks of 8 tokens
// beside the decodes: with 1, 2 and 4 drafts a step, every sequence's tokens and finish reason are
// the engine's without speculation; drafts were kept, several tokens came in one step, and the
// base sequence (the head was trained on the base model's outputs) got its tokens in fewer steps.
class SpeculativeModelsTest : public ::testing::TestWithParam<const SpecFixture*> {
 protected:
  void SetUp() override { g_fixture = GetParam(); }
  void TearDown() override { g_fixture = &kQwen35; }
};

TEST_P(SpeculativeModelsTest, GreedyContinuousBatchEqualsDecodingWithoutDrafts) {
  const auto prompts = FixturePrompts();
  ASSERT_GE(prompts.size(), 3u);
  std::vector<std::pair<int, NewSequence>> joins = {{0, Seq(1, 0, prompts[0], 30)},
                                                    {0, Seq(2, k3D, prompts[1], 24)},
                                                    {2, Seq(3, k2D, prompts[2], 28)},
                                                    {3, Seq(4, k3D, prompts[0], 17)},
                                                    {5, Seq(5, 0, prompts[2], 1)}};
  auto plain_h = MakeSpecEngine(0, 8, 8);
  ASSERT_NE(plain_h, nullptr);
  const Result plain = RunAll(*plain_h->engine, joins);
  ASSERT_EQ(plain.tokens.size(), joins.size());
  EXPECT_NE(plain.tokens.at(2), plain.tokens.at(4));  // adapters change the tokens
  for (int k : {1, 2, Drafts(4)}) {
    SCOPED_TRACE(absl::StrCat(k, " drafts"));
    auto h = MakeSpecEngine(k, 8, 8);
    ASSERT_NE(h, nullptr);
    EXPECT_EQ(h->engine->Info().num_speculative_tokens, k);
    const Result spec = RunAll(*h->engine, joins);
    EXPECT_EQ(spec.tokens, plain.tokens);
    EXPECT_EQ(spec.finish, plain.finish);
    EXPECT_GT(spec.accepted, 0);
    EXPECT_LT(spec.accepted, spec.drafted);
    EXPECT_GT(spec.multi, 0);
    EXPECT_LT(spec.steps_with_tokens.at(1), plain.steps_with_tokens.at(1));
    EXPECT_EQ(h->engine->Info().running, 0);
  }
}

// A stop token that a kept draft produces ends the sequence there (the drafts after it are not
// emitted), as without speculation; so does max_tokens.
TEST_P(SpeculativeModelsTest, StopTokensAndMaxTokensCutARunOfKeptDrafts) {
  const auto prompts = FixturePrompts();
  ASSERT_GE(prompts.size(), 2u);
  auto plain_h = MakeSpecEngine(0);
  ASSERT_NE(plain_h, nullptr);
  const Result free_run = RunAll(*plain_h->engine, {{0, Seq(1, 0, prompts[0], 30)}});
  const std::vector<int32_t>& t = free_run.tokens.at(1);
  ASSERT_EQ(t.size(), 30u);
  auto h = MakeSpecEngine(Drafts(4));
  ASSERT_NE(h, nullptr);
  int checked = 0;
  for (size_t cut = 3; cut < t.size(); ++cut) {
    // The first occurrence of the token: the stop lands at `cut`.
    if (std::find(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(cut), t[cut]) !=
        t.begin() + static_cast<std::ptrdiff_t>(cut)) {
      continue;
    }
    NewSequence n = Seq(10 + static_cast<int64_t>(cut), 0, prompts[0], 30);
    n.stop_token_ids = {t[cut]};
    const Result with_stop = RunAll(*h->engine, {{0, n}});
    const std::vector<int32_t> want(t.begin(), t.begin() + static_cast<std::ptrdiff_t>(cut) + 1);
    EXPECT_EQ(with_stop.tokens.at(n.id), want) << "stop at " << cut;
    EXPECT_EQ(with_stop.finish.at(n.id), "stop");
    ++checked;
  }
  EXPECT_GE(checked, 2);
  for (int max_tokens : {2, 5, 7, 11}) {
    const Result r = RunAll(*h->engine, {{0, Seq(100 + max_tokens, 0, prompts[0], max_tokens)}});
    EXPECT_EQ(r.tokens.at(100 + max_tokens),
              std::vector<int32_t>(t.begin(), t.begin() + max_tokens));
    EXPECT_EQ(r.finish.at(100 + max_tokens), "length");
  }
}

// A KV cache too small for the batch: sequences are preempted (their drafts with them) and
// recomputed, and still decode as without speculation.
TEST_P(SpeculativeModelsTest, PreemptedSequencesRecomputeAndDecodeTheSame) {
  const auto prompts = FixturePrompts();
  ASSERT_GE(prompts.size(), 3u);
  std::vector<std::pair<int, NewSequence>> joins;
  for (int i = 0; i < 4; ++i) {
    joins.push_back({0, Seq(1 + i, i % 3 == 0 ? 0 : i % 3 == 1 ? k3D : k2D, prompts[i % 3], 40)});
  }
  auto plain_h = MakeSpecEngine(0);
  ASSERT_NE(plain_h, nullptr);
  const Result plain = RunAll(*plain_h->engine, joins);
  // Blocks for about two sequences of prompt + 40 tokens (block_size 4; a block of the engine
  // with the head holds its keys and values too).
  // Beside them, what the sliding-window layers (Step3.5) reserve of the default 64 MiB budget.
  const EngineInfo info = MakeSpecEngine(3)->engine->Info();
  const int64_t per_seq = (static_cast<int64_t>(prompts[0].size()) + 40 + 3) / 4 + 1;
  auto h = MakeSpecEngine(3, 8, 64, (2 * per_seq + 1) * info.bytes_per_block + info.window_bytes);
  ASSERT_NE(h, nullptr);
  const Result spec = RunAll(*h->engine, joins);
  EXPECT_GT(spec.preempted, 0);
  EXPECT_EQ(spec.tokens, plain.tokens);
  EXPECT_EQ(spec.finish, plain.finish);
  EXPECT_GT(spec.accepted, 0);
}

// Rejection sampling keeps the target's distribution: 1536 sequences of one prompt at
// temperature 1 with top_k 3, two drafts a step (the second and third tokens come from verified
// drafts: kept with p(draft), else drawn from the rest); the joint counts of their first three
// tokens against the target's own probabilities (its prompt logits over each prefix, the same
// top-k and temperature), chi-square at p = 1e-4. Drafts were both kept and rejected.
TEST_P(SpeculativeModelsTest, SampledTokensKeepTheTargetsDistribution) {
  const auto prompts = FixturePrompts();
  ASSERT_FALSE(prompts.empty());
  const std::vector<int32_t>& p = prompts[0];
  constexpr int kTopK = 3;
  constexpr int kSeqs = 1536, kBatch = 256;
  auto h = MakeSpecEngine(2, kBatch, 1024, int64_t{256} << 20);
  ASSERT_NE(h, nullptr);
  std::map<std::vector<int32_t>, int> counts;
  int64_t drafted = 0, accepted = 0;
  for (int round = 0; round < kSeqs / kBatch; ++round) {
    std::vector<std::pair<int, NewSequence>> joins;
    for (int i = 0; i < kBatch; ++i) {
      NewSequence n = Seq(round * kBatch + i + 1, 0, p, 4);
      n.sampling.temperature = 1.0f;
      n.sampling.top_k = kTopK;
      n.sampling.seed = 1000003ull * static_cast<uint64_t>(n.id);
      joins.push_back({0, n});
    }
    const Result r = RunAll(*h->engine, joins);
    for (const auto& [id, t] : r.tokens) {
      ASSERT_EQ(t.size(), 4u);
      ++counts[{t[0], t[1], t[2]}];
    }
    drafted += r.drafted;
    accepted += r.accepted;
  }
  EXPECT_GT(accepted, drafted / 10);
  EXPECT_LT(accepted, drafted * 9 / 10);
  // The target's probabilities: top-k of softmax(logits / T), renormalised.
  auto plain_h = MakeSpecEngine(0);
  ASSERT_NE(plain_h, nullptr);
  Engine& plain = *plain_h->engine;
  const int vocab = plain.Info().vocab_size;
  auto top_k = [&](const float* row) {
    std::vector<std::pair<float, int32_t>> v;
    for (int i = 0; i < vocab; ++i) v.push_back({row[i], i});
    std::sort(v.begin(), v.end(), [](auto& a, auto& b) {
      return a.first != b.first ? a.first > b.first : a.second < b.second;
    });
    v.resize(kTopK);
    double z = 0;
    for (auto& [l, id] : v) z += std::exp(static_cast<double>(l) - v[0].first);
    std::map<int32_t, double> out;
    for (auto& [l, id] : v) out[id] = std::exp(static_cast<double>(l) - v[0].first) / z;
    return out;
  };
  std::map<std::vector<int32_t>, double> expected;
  int64_t seq_id = 1 << 20;
  const std::vector<float> l0 = testing::PromptLogits(plain, 0, p, seq_id++);
  ASSERT_FALSE(l0.empty());
  const auto P = static_cast<int64_t>(p.size());
  for (const auto& [t1, p1] : top_k(&l0[(P - 1) * vocab])) {
    std::vector<int32_t> q = p;
    q.push_back(t1);
    const std::vector<float> l1 = testing::PromptLogits(plain, 0, q, seq_id++);
    for (const auto& [t2, p2] : top_k(&l1[P * vocab])) {
      std::vector<int32_t> q2 = q;
      q2.push_back(t2);
      const std::vector<float> l2 = testing::PromptLogits(plain, 0, q2, seq_id++);
      for (const auto& [t3, p3] : top_k(&l2[(P + 1) * vocab])) {
        expected[{t1, t2, t3}] = p1 * p2 * p3;
      }
    }
  }
  // Chi-square over the cells expecting at least 5 sequences, the rest pooled in one.
  double chi2 = 0, rest_expected = 0, rest_observed = 0;
  int cells = 0, observed_total = 0;
  for (const auto& [t, c] : counts) {
    observed_total += c;
    EXPECT_TRUE(expected.count(t)) << "a triple the target's top-k cannot give";
  }
  for (const auto& [t, prob] : expected) {
    const double e = prob * kSeqs;
    const double o = counts.count(t) ? counts.at(t) : 0;
    if (e < 5) {
      rest_expected += e;
      rest_observed += o;
      continue;
    }
    chi2 += (o - e) * (o - e) / e;
    ++cells;
  }
  if (rest_expected > 0) {
    chi2 += (rest_observed - rest_expected) * (rest_observed - rest_expected) / rest_expected;
    ++cells;
  }
  EXPECT_EQ(observed_total, kSeqs);
  ASSERT_GE(cells, 4);
  // The chi-square quantile at 1 - 1e-4 with cells - 1 degrees of freedom (Wilson-Hilferty;
  // z = 3.719).
  const double dof = cells - 1;
  const double a = 2.0 / (9.0 * dof);
  const double critical = dof * std::pow(1 - a + 3.719 * std::sqrt(a), 3);
  EXPECT_LT(chi2, critical) << cells << " cells";
}

// An adapter that carries LoRA for the heads too (tools/mtp_reference.py adapter, tools/
// step3p5_mtp_reference.py adapter: their modules under `mtp.`, or at the MTP layers' indices): the
// engine says so at staging, drafts with the adapted head, and decodes the adapted target's greedy
// tokens as transformers + PEFT do; a 3D adapter without head modules leaves the head unadapted.
TEST_P(SpeculativeModelsTest, AnAdapterWithHeadLoraDecodesAsTransformers) {
  const auto prompts = FixturePrompts();
  const std::string fixture = g_fixture->model;
  auto ref = SafetensorsFile::Open(Data(fixture + "/expected_mtp_adapter.safetensors"));
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto h = MakeSpecEngine(3);
  ASSERT_NE(h, nullptr);
  Engine& e = *h->engine;
  auto staged = e.StageAdapter(3, Data(fixture + "/adapter_mtp"), std::nullopt);
  ASSERT_TRUE(staged.ok()) << staged.status();
  EXPECT_TRUE(staged->adapts_draft);
  ASSERT_TRUE(e.CommitAdapter(3).ok());
  auto plain3d =
      e.StageAdapter(4, Data(std::string(g_fixture->adapters) + "/adapter_3d"), std::nullopt);
  ASSERT_TRUE(plain3d.ok()) << plain3d.status();
  EXPECT_FALSE(plain3d->adapts_draft);
  ASSERT_TRUE(e.AbortAdapter(4).ok());
  std::vector<std::pair<int, NewSequence>> joins;
  for (size_t i = 0; i < prompts.size(); ++i) {
    joins.push_back({0, Seq(static_cast<int64_t>(i) + 1, 3, prompts[i], 16)});
  }
  const Result r = RunAll(e, joins);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const TensorView* v = (*ref)->Find(absl::StrCat("greedy.", i));
    ASSERT_NE(v, nullptr);
    const auto* want = reinterpret_cast<const int64_t*>(v->data);
    EXPECT_EQ(r.tokens.at(static_cast<int64_t>(i) + 1),
              std::vector<int32_t>(want, want + v->numel()))
        << "prompt " << i;
  }
  EXPECT_GT(r.accepted, 0);
}

TEST(SpeculativeEngineTest, AModelWithoutAnMtpHeadIsRefused) {
  auto comm = MakeLocalCommunicator();
  EngineOptions o;
  o.model_dir = Data("qwen3_moe/model");
  o.num_speculative_tokens = 2;
  EXPECT_THAT(Engine::Create(o, comm.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("--speculative-config")));
}

INSTANTIATE_TEST_SUITE_P(Models, SpeculativeModelsTest, ::testing::Values(&kQwen35, &kStep35),
                         [](const ::testing::TestParamInfo<const SpecFixture*>& i) {
                           return std::string(i.param->name);
                         });

// Step3.5 (no recurrent layers) keeps prefix caching with its chained heads: a prompt sent again
// after the first finished, and one sharing its first blocks, start from cached blocks (a block
// serves the heads only where the prompt matches as many tokens past it as there are heads) and
// decode as without speculation; the prompt sent again keeps as many drafts as the first did,
// so its heads read the same keys and values.
TEST(SpeculativeEngineTest, Step35PrefixCachingWithChainedHeads) {
  const UseFixture step35(kStep35);
  const auto prompts = FixturePrompts();
  ASSERT_FALSE(prompts.empty());
  // Sharing the first two blocks (8 tokens), not the token after them that head 1 reads there.
  std::vector<int32_t> other = prompts[0];
  other[9] = (other[9] + 1) % 96;
  const std::vector<std::pair<int, NewSequence>> joins = {
      {0, Seq(1, 0, prompts[0], 20)}, {30, Seq(2, 0, prompts[0], 20)}, {30, Seq(3, 0, other, 16)}};
  auto plain_h = MakeSpecEngine(0);
  ASSERT_NE(plain_h, nullptr);
  const Result plain = RunAll(*plain_h->engine, joins);
  auto h = MakeSpecEngine(3);
  ASSERT_NE(h, nullptr);
  ASSERT_TRUE(h->engine->Info().prefix_caching);
  const Result spec = RunAll(*h->engine, joins);
  EXPECT_EQ(spec.tokens, plain.tokens);
  EXPECT_EQ(spec.finish, plain.finish);
  EXPECT_GT(spec.prefix_hits, 0);
  EXPECT_EQ(spec.tokens.at(1), spec.tokens.at(2));
  EXPECT_GT(spec.accepted_by.at(1), 0);
  EXPECT_EQ(spec.accepted_by.at(2), spec.accepted_by.at(1));
  // The other prompt drafts as it does on an engine of its own.
  auto alone_h = MakeSpecEngine(3);
  ASSERT_NE(alone_h, nullptr);
  const Result alone = RunAll(*alone_h->engine, {{0, Seq(3, 0, other, 16)}});
  EXPECT_EQ(alone.prefix_hits, 0);
  EXPECT_EQ(spec.accepted_by.at(3), alone.accepted_by.at(3));
  EXPECT_EQ(spec.tokens.at(3), alone.tokens.at(3));
}

// Image requests draft too (tests/data/qwen3_5_moe_mm_mtp: Qwen3.5's head reads the tower's
// embeddings and the target's multimodal positions). With 1 and 3 drafts a step, prompts read
// whole or in chunks of 16 tokens (images split across steps, the head reading one token into
// the next chunk), they decode transformers' greedy tokens, as without drafts; with one draft a
// step and whole prompts, each keeps exactly the drafts the reference head's argmax at the
// positions the steps put them predicts.
TEST(SpeculativeEngineTest, ImageRequestsDraftAsTheReferenceHead) {
  const auto mm = testing::ReadMm("qwen3_5_moe_mm");
  auto ref = SafetensorsFile::Open(Data("qwen3_5_moe_mm_mtp/expected_mtp.safetensors"));
  ASSERT_TRUE(ref.ok()) << ref.status();
  auto ints = [&](const std::string& name) {
    const TensorView* v = (*ref)->Find(name);
    EXPECT_NE(v, nullptr) << name;
    if (v == nullptr) return std::vector<int64_t>();
    const auto* p = reinterpret_cast<const int64_t*>(v->data);
    return std::vector<int64_t>(p, p + v->numel());
  };
  std::vector<std::pair<int, NewSequence>> joins;
  std::map<int64_t, std::vector<int64_t>> full, drafts;
  for (const testing::MmPrompt& p : mm) {
    if (p.images.empty()) continue;
    const auto i = static_cast<int64_t>(joins.size());
    ASSERT_EQ(ints(absl::StrCat("prompt.", i)), std::vector<int64_t>(p.ids.begin(), p.ids.end()));
    NewSequence n = Seq(i + 1, 0, p.ids, 16);
    n.images = testing::Images("qwen3_5_moe_mm", p);
    joins.push_back({0, n});
    full[i + 1] = ints(absl::StrCat("prompt.", i));
    for (int64_t t : ints(absl::StrCat("greedy.", i))) full[i + 1].push_back(t);
    drafts[i + 1] = ints(absl::StrCat("drafts.", i));
  }
  ASSERT_EQ(joins.size(), 3u);
  for (int chunk : {512, 16}) {
    for (int k : {0, 1, 3}) {
      SCOPED_TRACE(absl::StrCat(k, " drafts, chunks of ", chunk));
      auto h = std::make_unique<EngineHolder>();
      EngineOptions o;
      o.model_dir = Data("qwen3_5_moe_mm_mtp/model");
      o.num_speculative_tokens = k;
      o.max_num_seqs = 8;
      o.max_num_batched_tokens = chunk;
      o.kv_cache_memory_bytes = int64_t{64} << 20;
      auto e = Engine::Create(o, h->comm.get());
      ASSERT_TRUE(e.ok()) << e.status();
      const Result r = RunAll(**e, joins);
      for (const auto& [id, f] : full) {
        const std::vector<int32_t> want(f.end() - 16, f.end());
        EXPECT_EQ(r.tokens.at(id), want) << "sequence " << id;
      }
      if (k == 0) continue;
      EXPECT_GT(r.accepted, 0);
      if (k != 1 || chunk != 512) continue;
      for (const auto& [id, f] : full) {
        // After the prompt (len positions computed, the first token sampled) each step verifies
        // the head's draft at len - 1 against the token at len + 1, but the last one.
        int64_t len = static_cast<int64_t>(f.size()) - 16, gen = 1, kept = 0;
        while (gen < 16) {
          const bool draft = 16 - gen - 1 >= 1;
          const bool hit = draft && drafts.at(id)[static_cast<size_t>(len - 1)] ==
                                        f[static_cast<size_t>(len + 1)];
          kept += hit;
          gen += hit ? 2 : 1;
          len += hit ? 2 : 1;
        }
        EXPECT_EQ(r.accepted_by.at(id), kept) << "sequence " << id;
      }
    }
  }
}

// Step3.5's chained heads draft as the reference's: three prompts decoding 16 tokens together
// with 3 drafts a step keep exactly the drafts tools/step3p5_mtp_reference.py's simulation of
// those steps keeps (`kept3`). Heads 1 and 2 read the drafts before theirs and their own keys,
// which lag the sequence's: a head reading sliding-window blocks already given back drafts
// otherwise.
TEST(SpeculativeEngineTest, Step35HeadsDraftAsTheReference) {
  const UseFixture step35(kStep35);
  const auto prompts = FixturePrompts();
  auto ref = SafetensorsFile::Open(Data("step3p5_mtp/expected_mtp.safetensors"));
  ASSERT_TRUE(ref.ok()) << ref.status();
  std::vector<std::pair<int, NewSequence>> joins;
  for (size_t i = 0; i < prompts.size(); ++i) {
    joins.push_back({0, Seq(static_cast<int64_t>(i) + 1, 0, prompts[i], 16)});
  }
  auto h = MakeSpecEngine(3);
  ASSERT_NE(h, nullptr);
  const Result r = RunAll(*h->engine, joins);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const TensorView* greedy = (*ref)->Find(absl::StrCat("greedy.", i));
    const TensorView* kept = (*ref)->Find(absl::StrCat("kept3.", i));
    ASSERT_NE(greedy, nullptr);
    ASSERT_NE(kept, nullptr);
    const auto* g = reinterpret_cast<const int64_t*>(greedy->data);
    const auto id = static_cast<int64_t>(i) + 1;
    EXPECT_EQ(r.tokens.at(id), std::vector<int32_t>(g, g + greedy->numel())) << "prompt " << i;
    EXPECT_EQ(r.accepted_by.at(id), *reinterpret_cast<const int64_t*>(kept->data))
        << "prompt " << i;
  }
}

// Step3.5's heads are chained, one per draft: more drafts a step than MTP layers are refused by
// name at start.
TEST(SpeculativeEngineTest, Step35RefusesMoreDraftsThanMtpLayers) {
  EngineHolder h;
  EngineOptions o;
  o.model_dir = Data("step3p5_mtp/model");
  o.num_speculative_tokens = 4;
  EXPECT_THAT(Engine::Create(o, h.comm.get()).status(),
              StatusIs(absl::StatusCode::kFailedPrecondition,
                       ::testing::AllOf(HasSubstr("num_speculative_tokens 4"),
                                        HasSubstr("num_nextn_predict_layers 3"))));
}

}  // namespace
}  // namespace moelora
