// The engine's memory model: the paged KV cache's accounting, chunked prefill, preemption with
// recomputation, and requests that cannot fit.
#include <gtest/gtest.h>

#include <functional>
#include <map>

#include "tests/testing/status_matchers.h"
#include "tests/unit/worker/engine_test_util.h"
#include "worker/model/kv_cache.h"

namespace moelora {
namespace {

using testing::Data;
using testing::EngineHolder;
using testing::Load;
using testing::MaxAbsDiff;

TEST(KvCacheTest, ReserveTakesWholeBlocksAndReleaseGivesThemBack) {
  KvCacheOptions o;
  o.block_size = 4;
  o.memory_bytes = 1 << 20;
  o.max_blocks = 5;
  auto c = KvCache::Create({{1, 2, 8}}, 3, o, at::kFloat, at::kCPU);
  ASSERT_OK(c);
  KvCache& kv = **c;
  EXPECT_EQ(kv.num_blocks(), 5);
  EXPECT_EQ(kv.bytes_per_block(), 2 * 4 * 2 * 8 * 4);
  EXPECT_FALSE(kv.k(0).defined());
  EXPECT_EQ(kv.k(1).sizes(), (std::vector<int64_t>{5, 4, 2, 8}));
  std::vector<int32_t> a, b;
  ASSERT_TRUE(kv.Reserve(a, 9));  // 3 blocks
  EXPECT_EQ(a.size(), 3u);
  ASSERT_TRUE(kv.Reserve(a, 12));  // still 3
  EXPECT_EQ(kv.free_blocks(), 2);
  EXPECT_FALSE(kv.Reserve(b, 13));  // 4 blocks: refused, nothing taken
  EXPECT_TRUE(b.empty());
  EXPECT_EQ(kv.free_blocks(), 2);
  ASSERT_TRUE(kv.Reserve(b, 8));
  EXPECT_EQ(kv.free_blocks(), 0);
  kv.Release(a);
  EXPECT_TRUE(a.empty());
  EXPECT_EQ(kv.free_blocks(), 3);
  // A budget below one block is refused, naming what a block takes.
  o.memory_bytes = 100;
  o.max_blocks = 0;
  auto none = KvCache::Create({{1, 2, 8}}, 3, o, at::kFloat, at::kCPU);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("512 bytes"), std::string::npos) << none.status();
}

TEST(KvCacheTest, PrefixBlocksAreSharedUnderTheSameAdapterAndEvictedLeastRecentlyUsedFirst) {
  KvCacheOptions o;
  o.block_size = 2;
  o.max_blocks = 4;
  auto c = KvCache::Create({{0, 1, 4}}, 1, o, at::kFloat, at::kCPU);
  ASSERT_OK(c);
  KvCache& kv = **c;
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9};
  std::vector<int32_t> a;
  std::vector<uint64_t> ha;
  ASSERT_TRUE(kv.Reserve(a, 5));  // 3 blocks
  kv.Publish(/*adapter=*/1, tokens, 5, a, ha);
  EXPECT_EQ(ha.size(), 2u);  // the two full blocks
  // Another sequence with the same prompt and adapter shares them (one token left to compute);
  // under another adapter, or with another token, nothing matches.
  std::vector<int32_t> b, other;
  std::vector<uint64_t> hb, ho;
  EXPECT_EQ(kv.Match(2, tokens, other, ho), 0);
  EXPECT_EQ(kv.Match(1, {5, 6, 7, 0, 9}, other, ho), 2);
  kv.Release(other);
  ho.clear();
  EXPECT_EQ(kv.Match(1, tokens, b, hb), 4);
  EXPECT_EQ(b, std::vector<int32_t>(a.begin(), a.begin() + 2));
  EXPECT_EQ(hb, ha);
  EXPECT_EQ(kv.free_blocks(), 1);
  // Released by both, the cached blocks count as free and stay findable until taken.
  kv.Release(a);
  kv.Release(b);
  EXPECT_EQ(kv.free_blocks(), 4);
  std::vector<int32_t> c1;
  std::vector<uint64_t> h1;
  EXPECT_EQ(kv.Match(1, tokens, c1, h1), 4);
  kv.Release(c1);
  // Taking all four blocks evicts them; the prefix is gone.
  std::vector<int32_t> all;
  ASSERT_TRUE(kv.Reserve(all, 8));
  kv.Release(all);
  std::vector<int32_t> d;
  std::vector<uint64_t> hd;
  EXPECT_EQ(kv.Match(1, tokens, d, hd), 0);
}

std::unique_ptr<EngineHolder> MakeEngineWith(const std::string& model,
                                             const std::function<void(EngineOptions&)>& tweak) {
  auto h = std::make_unique<EngineHolder>();
  EngineOptions o;
  o.model_dir = Data(model);
  o.max_lora_rank = 8;
  tweak(o);
  auto e = Engine::Create(o, h->comm.get());
  EXPECT_TRUE(e.ok()) << e.status();
  if (!e.ok()) return nullptr;
  h->engine = std::move(*e);
  return h;
}

struct Outcome {
  std::map<int64_t, std::vector<int32_t>> tokens;
  std::map<int64_t, std::vector<std::vector<float>>> logits;
  std::map<int64_t, std::vector<float>> prompt_logits;
  int preempted = 0;
  int steps = 0;
};

// Steps until every sequence has finished, collecting what each sampled.
Outcome RunToEnd(Engine& e, const std::vector<NewSequence>& add) {
  Outcome r;
  std::set<int64_t> open;
  for (const auto& n : add) open.insert(n.id);
  for (int step = 0; !open.empty() && step < 2000; ++step) {
    auto out = e.Step(step == 0 ? add : std::vector<NewSequence>{}, {});
    EXPECT_TRUE(out.ok()) << out.status();
    if (!out.ok()) break;
    ++r.steps;
    r.preempted += out->preempted;
    for (const TokenOut& t : out->tokens) {
      r.tokens[t.sequence_id].push_back(t.token);
      r.logits[t.sequence_id].push_back(t.logits);
      if (!t.prompt_logits.empty()) r.prompt_logits[t.sequence_id] = t.prompt_logits;
      if (t.finished) open.erase(t.sequence_id);
    }
  }
  EXPECT_TRUE(open.empty()) << open.size() << " sequences never finished";
  return r;
}

std::vector<int32_t> Prompt(int n, int seed, int vocab) {
  std::vector<int32_t> p(n);
  for (int i = 0; i < n; ++i) p[i] = (seed * 31 + i * 7 + i * i) % vocab;
  return p;
}

float Worst(const std::vector<std::vector<float>>& a, const std::vector<std::vector<float>>& b) {
  if (a.size() != b.size()) return INFINITY;
  float w = 0;
  for (size_t i = 0; i < a.size(); ++i) w = std::max(w, MaxAbsDiff(a[i], b[i]));
  return w;
}

struct ChunkCase {
  const char* model;
  const char* adapter;  // or ""
  bool mixed;
};

class ChunkedPrefillTest : public ::testing::TestWithParam<ChunkCase> {};

// A prompt read in chunks of 3 tokens over blocks of 4 (so chunks and blocks cross each other
// and the sliding windows of Step3.5 and GPT-OSS) gives the prompt logits and the greedy
// continuation (logits included) of a prompt read in one forward with blocks of 16.
TEST_P(ChunkedPrefillTest, EqualsOneShotPrefill) {
  const ChunkCase c = GetParam();
  auto one = MakeEngineWith(std::string(c.model) + "/model",
                            [&](EngineOptions& o) { o.enable_mixed_moe_lora_format = c.mixed; });
  auto chunked = MakeEngineWith(std::string(c.model) + "/model", [&](EngineOptions& o) {
    o.enable_mixed_moe_lora_format = c.mixed;
    o.block_size = 4;
    o.max_num_seqs = 2;
    o.max_num_batched_tokens = 3;
  });
  ASSERT_NE(one, nullptr);
  ASSERT_NE(chunked, nullptr);
  int64_t adapter = 0;
  if (*c.adapter != '\0') {
    adapter = 3;
    ASSERT_OK(Load(*one->engine, adapter, std::string(c.model) + "/" + c.adapter));
    ASSERT_OK(Load(*chunked->engine, adapter, std::string(c.model) + "/" + c.adapter));
  }
  const int vocab = one->engine->Info().vocab_size;
  NewSequence n{.id = 5,
                .adapter_id = adapter,
                .prompt = Prompt(29, 3, vocab),
                .max_tokens = 6,
                .return_logits = true,
                .return_prompt_logits = true};
  Outcome a = RunToEnd(*one->engine, {n});
  Outcome b = RunToEnd(*chunked->engine, {n});
  EXPECT_GE(b.steps, 29 / 3 + 5);  // the prompt took 10 steps
  EXPECT_EQ(a.tokens[5], b.tokens[5]);
  EXPECT_LE(MaxAbsDiff(a.prompt_logits[5], b.prompt_logits[5]), 1e-5);
  EXPECT_EQ(a.prompt_logits[5].size(), static_cast<size_t>(29 * vocab));
  EXPECT_LE(Worst(a.logits[5], b.logits[5]), 1e-5);
}

INSTANTIATE_TEST_SUITE_P(Models, ChunkedPrefillTest,
                         ::testing::Values(ChunkCase{"qwen3_moe", "adapter_2d", true},
                                           ChunkCase{"qwen3_5_moe", "adapter_3d", false},
                                           ChunkCase{"gpt_oss_lm", "adapter_3d", true},
                                           ChunkCase{"step3p5", "adapter_3d", true}),
                         [](const auto& info) { return std::string(info.param.model); });

// Three sequences that together need more blocks than the cache holds (each fits alone): the
// latest admitted is preempted and recomputed, and every sequence's tokens and logits equal its
// run alone.
TEST(EngineMemoryTest, PreemptedSequencesEqualTheirUninterruptedRuns) {
  auto probe = MakeEngineWith("qwen3_moe/model", [](EngineOptions& o) { o.block_size = 4; });
  ASSERT_NE(probe, nullptr);
  const int64_t per_block = probe->engine->Info().bytes_per_block;
  ASSERT_GT(per_block, 0);
  auto small = MakeEngineWith("qwen3_moe/model", [&](EngineOptions& o) {
    o.block_size = 4;
    o.kv_cache_memory_bytes = 7 * per_block;  // 28 positions; each sequence takes 18
  });
  ASSERT_NE(small, nullptr);
  EXPECT_EQ(small->engine->Info().num_blocks, 7);
  ASSERT_OK(Load(*small->engine, 1, "qwen3_moe/adapter_2d"));
  ASSERT_OK(Load(*probe->engine, 1, "qwen3_moe/adapter_2d"));
  const int vocab = small->engine->Info().vocab_size;
  std::vector<NewSequence> seqs;
  for (int i = 0; i < 3; ++i) {
    seqs.push_back(NewSequence{.id = 10 + i,
                               .adapter_id = i == 1 ? 1 : 0,
                               .prompt = Prompt(6 + i, i, vocab),
                               .max_tokens = 12 - i,
                               .return_logits = true});
  }
  Outcome together = RunToEnd(*small->engine, seqs);
  EXPECT_GT(together.preempted, 0);
  EXPECT_EQ(small->engine->Info().free_blocks, 7);  // every block back
  for (const NewSequence& n : seqs) {
    Outcome alone = RunToEnd(*probe->engine, {n});
    EXPECT_EQ(together.tokens[n.id], alone.tokens[n.id]) << "sequence " << n.id;
    // Batched and alone differ only in summation order (engine_test.cc: within 5e-5).
    EXPECT_LE(Worst(together.logits[n.id], alone.logits[n.id]), 5e-5) << "sequence " << n.id;
  }
}

TEST(EngineMemoryTest, ARequestBeyondTheWholeCacheIsRefusedNamingTheBudget) {
  auto probe = MakeEngineWith("qwen3_moe/model", [](EngineOptions& o) { o.block_size = 4; });
  ASSERT_NE(probe, nullptr);
  auto small = MakeEngineWith("qwen3_moe/model", [&](EngineOptions& o) {
    o.block_size = 4;
    o.kv_cache_memory_bytes = 3 * probe->engine->Info().bytes_per_block;
  });
  ASSERT_NE(small, nullptr);
  NewSequence n{.id = 1, .prompt = {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}, .max_tokens = 3};
  auto out = small->engine->Step({n}, {});
  EXPECT_EQ(out.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(out.status().message().find("--kv-cache-memory-bytes"), std::string::npos)
      << out.status();
  EXPECT_NE(out.status().message().find("3 blocks of 4 tokens"), std::string::npos) << out.status();
  EXPECT_EQ(small->engine->Info().running, 0);
  n.max_tokens = 2;  // 12 positions: fits
  EXPECT_OK(small->engine->Step({n}, {}));
}

// A second prompt that shares a prefix with the first (under the same adapter) computes only its
// own tokens and gives what a cold engine gives; under another adapter (or the base model) the
// prefix is not reused. Not for Qwen3.5 (recurrent layers).
TEST(EngineMemoryTest, PrefixCacheReusesOnlyUnderTheSameAdapter) {
  auto warm = MakeEngineWith("qwen3_moe/model", [](EngineOptions& o) {
    o.block_size = 4;
    o.enable_mixed_moe_lora_format = true;
  });
  auto cold = MakeEngineWith("qwen3_moe/model", [](EngineOptions& o) {
    o.block_size = 4;
    o.enable_mixed_moe_lora_format = true;
    o.enable_prefix_caching = false;
  });
  ASSERT_NE(warm, nullptr);
  ASSERT_NE(cold, nullptr);
  EXPECT_TRUE(warm->engine->Info().prefix_caching);
  EXPECT_FALSE(cold->engine->Info().prefix_caching);
  for (auto* e : {warm->engine.get(), cold->engine.get()}) {
    ASSERT_OK(Load(*e, 1, "qwen3_moe/adapter_2d"));
    ASSERT_OK(Load(*e, 2, "qwen3_moe/adapter_3d"));
  }
  const int vocab = warm->engine->Info().vocab_size;
  const std::vector<int32_t> prefix = Prompt(20, 7, vocab);
  auto with = [&](int64_t id, int64_t adapter, int tail_seed) {
    std::vector<int32_t> p = prefix;
    for (int32_t t : Prompt(5, tail_seed, vocab)) p.push_back(t);
    return NewSequence{
        .id = id, .adapter_id = adapter, .prompt = p, .max_tokens = 4, .return_logits = true};
  };
  int64_t hits = 0, queries = 0;
  auto run = [&](Engine& e, const NewSequence& n) {
    Outcome r;
    std::vector<NewSequence> add = {n};
    for (int step = 0; step < 50; ++step) {
      auto out = e.Step(step == 0 ? add : std::vector<NewSequence>{}, {});
      EXPECT_TRUE(out.ok()) << out.status();
      if (!out.ok()) break;
      if (&e == warm->engine.get()) {
        hits += out->prefix_hits;
        queries += out->prefix_queries;
      }
      bool done = false;
      for (const TokenOut& t : out->tokens) {
        r.tokens[t.sequence_id].push_back(t.token);
        r.logits[t.sequence_id].push_back(t.logits);
        done = done || t.finished;
      }
      if (done) break;
    }
    return r;
  };
  run(*warm->engine, with(1, 1, 1));  // computes and caches the prefix under adapter 1
  EXPECT_EQ(hits, 0);
  // The same adapter: 20 prefix tokens = 5 blocks found.
  NewSequence second = with(2, 1, 2);
  Outcome a = run(*warm->engine, second), b = run(*cold->engine, second);
  EXPECT_EQ(hits, 20);
  EXPECT_EQ(queries, 50);
  EXPECT_EQ(a.tokens[2], b.tokens[2]);
  EXPECT_LE(Worst(a.logits[2], b.logits[2]), 5e-5);
  // Another adapter and the base model: nothing found, and the output is a cold run's.
  for (int64_t adapter : {2, 0}) {
    hits = 0;
    NewSequence n = with(3 + adapter, adapter, 2);
    Outcome x = run(*warm->engine, n), y = run(*cold->engine, n);
    EXPECT_EQ(hits, 0) << "adapter " << adapter;
    EXPECT_EQ(x.tokens[n.id], y.tokens[n.id]);
    EXPECT_LE(Worst(x.logits[n.id], y.logits[n.id]), 5e-5);
  }
  // A model with recurrent layers never caches prefixes.
  auto hybrid = MakeEngineWith("qwen3_5_moe/model", [](EngineOptions&) {});
  ASSERT_NE(hybrid, nullptr);
  EXPECT_FALSE(hybrid->engine->Info().prefix_caching);
}

TEST(EngineMemoryTest, TheTokenBudgetMustCoverEveryDecode) {
  EngineHolder h;
  EngineOptions o;
  o.model_dir = Data("qwen3_moe/model");
  o.max_num_seqs = 8;
  o.max_num_batched_tokens = 4;
  auto e = Engine::Create(o, h.comm.get());
  EXPECT_EQ(e.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(e.status().message().find("--max-num-batched-tokens"), std::string::npos);
}

}  // namespace
}  // namespace moelora
