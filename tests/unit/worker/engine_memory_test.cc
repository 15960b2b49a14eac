// The engine's memory model: the paged KV cache's accounting, chunked prefill, preemption with
// recomputation, requests that cannot fit, and an allocation failure in one prompt.
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <sys/mman.h>
#include <unistd.h>

#include <functional>
#include <map>

#include "tests/testing/status_matchers.h"
#include "tests/unit/worker/engine_test_util.h"
#include "worker/layers/kv_cache.h"
#include "worker/layers/lora_ops.h"

namespace moelora {
namespace {

using testing::Data;
using testing::EngineHolder;
using ::testing::HasSubstr;
using testing::Load;
using testing::MaxAbsDiff;

// Pages of [p, p + bytes) resident in memory (mincore).
int64_t ResidentPages(const void* p, size_t bytes) {
  const uintptr_t page = static_cast<uintptr_t>(::sysconf(_SC_PAGESIZE));
  const uintptr_t lo = reinterpret_cast<uintptr_t>(p) / page * page;
  const uintptr_t hi = (reinterpret_cast<uintptr_t>(p) + bytes + page - 1) / page * page;
  std::vector<unsigned char> v((hi - lo) / page);
  if (::mincore(reinterpret_cast<void*>(lo), hi - lo, v.data()) != 0) return -1;
  int64_t n = 0;
  for (unsigned char c : v) n += c & 1;
  return n;
}

// CPU LoRA slots cost memory only while they hold an adapter: a new slot tensor has no resident
// page; writing one slot makes pages of that slot resident, not its neighbours'; ZeroSlot gives
// them back and the slot reads as zero again.
TEST(SlotMemoryTest, ASlotTakesMemoryOnlyWhileItHoldsAnAdapter) {
  const int64_t per_slot = int64_t{1} << 20;  // floats: 4 MiB a slot
  at::Tensor slots = SlotZeros({4, per_slot}, at::TensorOptions().dtype(at::kFloat));
  const size_t slot_bytes = static_cast<size_t>(per_slot) * sizeof(float);
  EXPECT_EQ(ResidentPages(slots.data_ptr(), 4 * slot_bytes), 0);
  slots[1].fill_(0.5f);
  EXPECT_GT(ResidentPages(slots[1].data_ptr(), slot_bytes), 0);
  EXPECT_EQ(ResidentPages(slots[3].data_ptr(), slot_bytes), 0);
  EXPECT_EQ(slots[0].abs().max().item<float>(), 0.0f);
  ZeroSlot(slots[1]);
  EXPECT_EQ(ResidentPages(slots[1].data_ptr(), slot_bytes), 0);
  EXPECT_EQ(slots[1].abs().max().item<float>(), 0.0f);
  // A slice that does not start on a page: the partial pages are cleared by hand.
  slots[2].fill_(1.0f);
  ZeroSlot(slots[2].narrow(0, 3, per_slot - 7));
  EXPECT_EQ(slots[2].narrow(0, 3, per_slot - 7).abs().max().item<float>(), 0.0f);
  EXPECT_EQ(slots[2][2].item<float>(), 1.0f);
  EXPECT_EQ(slots[2][per_slot - 4].item<float>(), 1.0f);
}

TEST(KvCacheTest, ReserveTakesWholeBlocksAndReleaseGivesThemBack) {
  KvCacheOptions o;
  o.block_size = 4;
  o.memory_bytes = 1 << 20;
  o.max_blocks = 5;
  auto c = KvCache::Create({{1, 2, 8}}, {}, 3, o, at::kFloat, at::kCPU);
  ASSERT_OK(c);
  KvCache& kv = **c;
  EXPECT_EQ(kv.num_blocks(), 5);
  EXPECT_EQ(kv.bytes_per_block(), 2 * 4 * 2 * 8 * 4);
  EXPECT_EQ(kv.window_blocks(), 0);
  EXPECT_EQ(kv.state_entries(), 0);
  EXPECT_FALSE(kv.k(0).defined());
  EXPECT_EQ(kv.k(1).sizes(), (std::vector<int64_t>{5, 4, 2, 8}));
  KvTable a, b;
  ASSERT_TRUE(kv.Reserve(a, 9));  // 3 blocks
  EXPECT_EQ(a.blocks.size(), 3u);
  EXPECT_TRUE(a.window_blocks.empty());
  EXPECT_EQ(a.state, -1);
  ASSERT_TRUE(kv.Reserve(a, 12));  // still 3
  EXPECT_EQ(kv.free_blocks(), 2);
  EXPECT_FALSE(kv.Reserve(b, 13));  // 4 blocks: refused, nothing taken
  EXPECT_FALSE(b.Holds());
  EXPECT_EQ(kv.free_blocks(), 2);
  ASSERT_TRUE(kv.Reserve(b, 8));
  EXPECT_EQ(kv.free_blocks(), 0);
  kv.Release(a);
  EXPECT_FALSE(a.Holds());
  EXPECT_EQ(kv.free_blocks(), 3);
  // A budget below one block is refused, naming what a block takes.
  o.memory_bytes = 100;
  o.max_blocks = 0;
  auto none = KvCache::Create({{1, 2, 8}}, {}, 3, o, at::kFloat, at::kCPU);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("512 bytes"), std::string::npos) << none.status();
}

// A speculative verify's rejected tokens: Shrink gives back the blocks past the kept length in
// both tables and keeps what covers it.
TEST(KvCacheTest, ShrinkGivesBackTheBlocksPastTheKeptLength) {
  KvCacheOptions o;
  o.block_size = 4;
  o.max_num_seqs = 2;
  o.max_num_batched_tokens = 8;
  o.memory_bytes = 1 << 20;
  o.max_blocks = 6;
  auto c = KvCache::Create({{0, 1, 8, /*window=*/100}, {1, 1, 8}}, {}, 2, o, at::kFloat, at::kCPU);
  ASSERT_OK(c);
  KvCache& kv = **c;
  KvTable t;
  ASSERT_TRUE(kv.Reserve(t, 14));  // 4 blocks in each table
  ASSERT_EQ(t.blocks.size(), 4u);
  ASSERT_EQ(t.window_blocks.size(), 4u);
  t.hashes = {11, 22, 33};
  const int64_t free = kv.free_blocks(), window_free = kv.window_free_blocks();
  kv.Shrink(t, 9);  // positions 0 .. 8: 3 blocks, the first 2 full
  EXPECT_EQ(t.blocks.size(), 3u);
  EXPECT_EQ(t.window_blocks.size(), 3u);
  EXPECT_EQ(t.hashes, (std::vector<uint64_t>{11, 22}));
  EXPECT_EQ(kv.free_blocks(), free + 1);
  EXPECT_EQ(kv.window_free_blocks(), window_free + 1);
  kv.Shrink(t, 12);  // nothing past 3 blocks to give back
  EXPECT_EQ(t.blocks.size(), 3u);
  EXPECT_EQ(kv.free_blocks(), free + 1);
  ASSERT_TRUE(kv.Reserve(t, 14));  // grows again from there
  EXPECT_EQ(t.blocks.size(), 4u);
  kv.Release(t);
}

TEST(KvCacheTest, PrefixBlocksAreSharedUnderTheSameAdapterAndEvictedLeastRecentlyUsedFirst) {
  KvCacheOptions o;
  o.block_size = 2;
  o.max_blocks = 4;
  auto c = KvCache::Create({{0, 1, 4}}, {}, 1, o, at::kFloat, at::kCPU);
  ASSERT_OK(c);
  KvCache& kv = **c;
  const std::vector<int32_t> tokens = {5, 6, 7, 8, 9};
  KvTable a;
  ASSERT_TRUE(kv.Reserve(a, 5));  // 3 blocks
  kv.Publish(/*adapter=*/1, tokens, 5, a);
  EXPECT_EQ(a.hashes.size(), 2u);  // the two full blocks
  // Another sequence with the same prompt and adapter shares them (one token left to compute);
  // under another adapter, or with another token, nothing matches.
  KvTable b, other;
  EXPECT_EQ(kv.Match(2, tokens, other), 0);
  EXPECT_EQ(kv.Match(1, {5, 6, 7, 0, 9}, other), 2);
  kv.Release(other);
  EXPECT_EQ(kv.Match(1, tokens, b), 4);
  EXPECT_EQ(b.blocks, std::vector<int32_t>(a.blocks.begin(), a.blocks.begin() + 2));
  EXPECT_EQ(b.hashes, a.hashes);
  EXPECT_EQ(kv.free_blocks(), 1);
  // Released by both, the cached blocks count as free and stay findable until taken.
  kv.Release(a);
  kv.Release(b);
  EXPECT_EQ(kv.free_blocks(), 4);
  KvTable c1;
  EXPECT_EQ(kv.Match(1, tokens, c1), 4);
  kv.Release(c1);
  // Taking all four blocks evicts them; the prefix is gone.
  KvTable all;
  ASSERT_TRUE(kv.Reserve(all, 8));
  kv.Release(all);
  KvTable d;
  EXPECT_EQ(kv.Match(1, tokens, d), 0);
}

// Sliding-window layers have their own pool, sized for --max-num-seqs sequences and one step's
// tokens out of the budget; a sequence gives back the blocks that left the window, so however
// long it grows it holds a few of them, and its full-attention blocks grow as before.
TEST(KvCacheTest, SlidingWindowBlocksThatLeaveTheWindowGoBack) {
  KvCacheOptions o;
  o.block_size = 4;
  o.max_num_seqs = 2;
  o.max_num_batched_tokens = 8;
  const int64_t full_bytes = 2 * 4 * 1 * 8 * 4;  // one layer, 1 KV head of 8, f32
  // Window 6: per sequence ceil(6 / 4) + 3 = 5 blocks, and 8 / 4 for the step's tokens.
  const int64_t window_blocks = 2 * 5 + 2;
  o.memory_bytes = window_blocks * full_bytes + 10 * full_bytes;
  auto c = KvCache::Create({{0, 1, 8, /*window=*/6}, {1, 1, 8}}, {}, 2, o, at::kFloat, at::kCPU);
  ASSERT_OK(c);
  KvCache& kv = **c;
  EXPECT_EQ(kv.window_blocks(), window_blocks);
  EXPECT_EQ(kv.num_blocks(), 10);  // what the window pool left of the budget
  EXPECT_EQ(kv.bytes_per_block(), full_bytes);
  EXPECT_TRUE(kv.windowed(0));
  EXPECT_FALSE(kv.windowed(1));
  EXPECT_EQ(kv.k(0).size(0), window_blocks);
  EXPECT_EQ(kv.k(1).size(0), 10);
  KvTable t;
  for (int64_t len = 0; len < 36; ++len) {  // decode one token at a time
    kv.Trim(t, len);
    ASSERT_TRUE(kv.Reserve(t, len + 1)) << len;
    // A query at `len` sees positions len - 5 .. len: their blocks are held, no block before.
    const int64_t first = std::max<int64_t>(0, len - 5) / 4;
    for (int64_t b = 0; b < static_cast<int64_t>(t.window_blocks.size()); ++b) {
      EXPECT_EQ(t.window_blocks[b] >= 0, b >= first) << "len " << len << " block " << b;
    }
  }
  EXPECT_EQ(t.blocks.size(), 9u);  // full attention: every position
  EXPECT_LE(kv.window_blocks() - kv.window_free_blocks(), 3);
  // A budget that holds the window pool but no full-attention block is refused, naming both.
  o.memory_bytes = window_blocks * full_bytes + full_bytes - 1;
  auto none = KvCache::Create({{0, 1, 8, 6}, {1, 1, 8}}, {}, 2, o, at::kFloat, at::kCPU);
  EXPECT_EQ(none.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(none.status().message().find("sliding-window layers' 12 blocks"), std::string::npos)
      << none.status();
  // A window as long as the longest sequence is full attention.
  o.memory_bytes = 1 << 20;
  o.max_model_len = 6;
  auto whole = KvCache::Create({{0, 1, 8, 6}, {1, 1, 8}}, {}, 2, o, at::kFloat, at::kCPU);
  ASSERT_OK(whole);
  EXPECT_FALSE((*whole)->windowed(0));
  EXPECT_EQ((*whole)->window_blocks(), 0);
}

// A prefix is reused for sliding-window layers only as far as their blocks within the window
// before the first token to compute are cached too.
TEST(KvCacheTest, PrefixMatchNeedsTheWindowBlocksBeforeIt) {
  KvCacheOptions o;
  o.block_size = 2;
  o.max_blocks = 64;
  o.max_num_seqs = 2;
  o.max_num_batched_tokens = 16;
  std::vector<int32_t> tokens(11);
  for (int i = 0; i < 11; ++i) tokens[i] = 100 + i;
  const std::vector<int32_t> nine(tokens.begin(), tokens.begin() + 9);
  for (bool publish_first : {true, false}) {
    SCOPED_TRACE(publish_first ? "published, then trimmed" : "trimmed, then published");
    auto c = KvCache::Create({{0, 1, 4, /*window=*/3}, {1, 1, 4}}, {}, 2, o, at::kFloat, at::kCPU);
    ASSERT_OK(c);
    KvCache& kv = **c;
    KvTable a;
    ASSERT_TRUE(kv.Reserve(a, 11));
    if (publish_first) kv.Publish(1, tokens, 11, a);
    kv.Trim(a, 11);  // positions before 9 left the window: blocks 0 .. 3 go back
    if (!publish_first) kv.Publish(1, tokens, 11, a);  // only block 4 is still there to cache
    EXPECT_EQ(a.window_blocks[3], -1);
    ASSERT_GE(a.window_blocks[4], 0);
    // The whole prompt: 5 blocks; the window of the query at 10 needs block 4 (positions 8, 9).
    KvTable b;
    EXPECT_EQ(kv.Match(1, tokens, b), 10);
    EXPECT_EQ(b.blocks.size(), 5u);
    ASSERT_EQ(b.window_blocks.size(), 5u);
    EXPECT_EQ(b.window_blocks[3], -1);
    EXPECT_EQ(b.window_blocks[4], a.window_blocks[4]);
    kv.Release(b);
    // Nine tokens: 4 full blocks are cached, and the query at 8 needs block 3 (positions 6, 7),
    // cached only if it was published before it went back.
    KvTable d;
    EXPECT_EQ(kv.Match(1, nine, d), publish_first ? 8 : 0);
    EXPECT_EQ(d.Holds(), publish_first);
    kv.Release(d);
    kv.Release(a);
    EXPECT_EQ(kv.window_free_blocks(), kv.window_blocks());
  }
}

// Recurrent layers: one zeroed entry per sequence from a pool of --max-num-seqs.
TEST(KvCacheTest, RecurrentStateEntriesComeFromAFixedPool) {
  KvCacheOptions o;
  o.max_num_seqs = 2;
  auto c = KvCache::Create({{1, 1, 4}}, {{0, {3, 5}, {2, 4, 4}}}, 2, o, at::kFloat, at::kCPU);
  ASSERT_OK(c);
  KvCache& kv = **c;
  EXPECT_EQ(kv.state_entries(), 2);
  EXPECT_EQ(kv.state_bytes_per_entry(), (3 * 5 + 2 * 4 * 4) * 4);
  KvTable a, b, x;
  ASSERT_TRUE(kv.Reserve(a, 1));
  ASSERT_TRUE(kv.Reserve(b, 1));
  EXPECT_NE(a.state, b.state);
  EXPECT_EQ(kv.conv(0, a.state).sizes(), (std::vector<int64_t>{3, 5}));
  EXPECT_EQ(kv.ssm(0, a.state).sizes(), (std::vector<int64_t>{2, 4, 4}));
  EXPECT_FALSE(kv.Reserve(x, 1));  // no entry left: refused, nothing taken
  EXPECT_FALSE(x.Holds());
  kv.ssm(0, a.state).fill_(7);
  const int32_t was = a.state;
  kv.Release(a);
  ASSERT_TRUE(kv.Reserve(x, 1));
  EXPECT_EQ(x.state, was);
  EXPECT_EQ(kv.ssm(0, x.state).abs().sum().item<float>(), 0);  // zeroed when taken
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
  int64_t prefix_hits = 0;
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
    r.prefix_hits += out->prefix_hits;
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

// An allocation failure while a long prompt joins sequences that decode (a real libtorch
// allocation failure, asked for by debug_fail_prompt_chunk_tokens): that sequence alone is
// removed, with a message naming the tokens and the allocator's bytes; its blocks go back; the
// decoding sequence goes on to the same tokens and logits as a run that never met it. With
// recurrent layers (Qwen3.5: states change layer by layer) the step is dropped whole instead.
TEST(EngineMemoryTest, AnAllocationFailureInOnePromptFailsThatSequenceAlone) {
  auto failing = MakeEngineWith("qwen3_moe/model", [](EngineOptions& o) {
    o.debug_fail_prompt_chunk_tokens = 20;
    o.prefill_tokens_beside_decodes = 0;
  });
  auto clean = MakeEngineWith("qwen3_moe/model", [](EngineOptions&) {});
  ASSERT_NE(failing, nullptr);
  ASSERT_NE(clean, nullptr);
  const int vocab = clean->engine->Info().vocab_size;
  const int64_t blocks = failing->engine->Info().free_blocks;
  const NewSequence decoding{
      .id = 1, .prompt = Prompt(5, 1, vocab), .max_tokens = 12, .return_logits = true};
  const NewSequence joiner{.id = 2, .prompt = Prompt(30, 2, vocab), .max_tokens = 4};
  Outcome got;
  bool failed = false;
  for (int step = 0; step < 40; ++step) {
    std::vector<NewSequence> add;
    if (step == 0) add = {decoding};
    if (step == 3) add = {joiner};
    auto out = failing->engine->Step(add, {});
    ASSERT_TRUE(out.ok()) << out.status();
    for (const auto& [id, why] : out->failed) {
      EXPECT_EQ(id, 2);
      EXPECT_THAT(why, HasSubstr("out of memory computing 30 tokens of this prompt"));
      EXPECT_THAT(why, HasSubstr("can't allocate memory"));
      failed = true;
    }
    bool done = false;
    for (const TokenOut& t : out->tokens) {
      EXPECT_EQ(t.sequence_id, 1);
      got.tokens[1].push_back(t.token);
      got.logits[1].push_back(t.logits);
      done = done || t.finished;
    }
    if (done) break;
  }
  EXPECT_TRUE(failed);
  EXPECT_EQ(failing->engine->Info().running, 0);
  EXPECT_EQ(failing->engine->Info().free_blocks, blocks);
  Outcome alone = RunToEnd(*clean->engine, {decoding});
  EXPECT_EQ(got.tokens[1], alone.tokens[1]);
  EXPECT_LE(Worst(got.logits[1], alone.logits[1]), 5e-5);

  auto recurrent = MakeEngineWith("qwen3_5_moe/model", [](EngineOptions& o) {
    o.debug_fail_prompt_chunk_tokens = 20;
    o.prefill_tokens_beside_decodes = 0;
  });
  ASSERT_NE(recurrent, nullptr);
  const int v35 = recurrent->engine->Info().vocab_size;
  ASSERT_OK(recurrent->engine->Step(
      {NewSequence{.id = 1, .prompt = Prompt(5, 1, v35), .max_tokens = 8}}, {}));
  auto out = recurrent->engine->Step(
      {NewSequence{.id = 2, .prompt = Prompt(30, 2, v35), .max_tokens = 4}}, {});
  ASSERT_FALSE(out.ok());
  EXPECT_EQ(out.status().code(), absl::StatusCode::kAborted) << out.status();
  EXPECT_EQ(recurrent->engine->Info().running, 0);
}

// The controller's epoch and expected sequences: a sequence it does not expect leaves (its
// blocks back); a newer controller's first call drops what an older one left; a call from the
// older one is then refused, naming both epochs, and changes nothing.
TEST(EngineMemoryTest, EpochsAndExpectedSequencesDropStraysAndRefuseAnOlderController) {
  auto h = MakeEngineWith("qwen3_moe/model", [](EngineOptions&) {});
  ASSERT_NE(h, nullptr);
  Engine& e = *h->engine;
  const int vocab = e.Info().vocab_size;
  const int64_t blocks = e.Info().free_blocks;
  auto seq = [&](int64_t id) {
    return NewSequence{
        .id = id, .prompt = Prompt(6, static_cast<int>(id), vocab), .max_tokens = 50};
  };
  StepControl first{.epoch = 100, .expected = {1, 2}};
  ASSERT_OK(e.Steps({seq(1), seq(2)}, {}, 1, nullptr, nullptr, first));
  EXPECT_EQ(e.Info().running, 2);
  ASSERT_OK(e.Steps({}, {}, 1, nullptr, nullptr, StepControl{.epoch = 100, .expected = {1}}));
  EXPECT_EQ(e.Info().running, 1);  // 2 was not expected
  ASSERT_OK(e.Steps({seq(1)}, {}, 1, nullptr, nullptr, StepControl{.epoch = 200, .expected = {1}}));
  EXPECT_EQ(e.Info().running, 1);  // the newer controller's 1, the older one's dropped first
  auto old = e.Steps({}, {}, 1, nullptr, nullptr, StepControl{.epoch = 100, .expected = {1}});
  ASSERT_FALSE(old.ok());
  EXPECT_EQ(old.status().code(), absl::StatusCode::kFailedPrecondition);
  EXPECT_THAT(std::string(old.status().message()), HasSubstr("a newer controller (epoch 200)"));
  EXPECT_EQ(e.Info().running, 1);
  ASSERT_OK(e.Steps({}, {1}, 1, nullptr, nullptr, StepControl{.epoch = 200}));
  EXPECT_EQ(e.Info().running, 0);
  EXPECT_EQ(e.Info().free_blocks, blocks);
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

// Models with sliding-window layers (4-token windows over 2-token blocks: most of a long prompt's
// window blocks go back while it is read): a prompt sharing a cached prefix reuses it, and its
// tokens and logits are a cold engine's.
TEST(EngineMemoryTest, PrefixCacheWithSlidingWindowLayersEqualsAColdRun) {
  for (const char* model : {"gpt_oss_lm", "step3p5"}) {
    SCOPED_TRACE(model);
    auto make = [&](bool prefix) {
      return MakeEngineWith(std::string(model) + "/model", [&](EngineOptions& o) {
        o.block_size = 2;
        o.max_num_seqs = 4;
        o.max_num_batched_tokens = 8;  // the prompt in chunks: blocks go back between them
        o.enable_prefix_caching = prefix;
      });
    };
    auto warm = make(true), cold = make(false);
    ASSERT_NE(warm, nullptr);
    ASSERT_NE(cold, nullptr);
    const int vocab = warm->engine->Info().vocab_size;
    const std::vector<int32_t> prefix = Prompt(21, 4, vocab);
    auto with = [&](int64_t id, int tail_seed) {
      std::vector<int32_t> p = prefix;
      for (int32_t t : Prompt(3, tail_seed, vocab)) p.push_back(t);
      return NewSequence{.id = id, .prompt = p, .max_tokens = 5, .return_logits = true};
    };
    EXPECT_EQ(RunToEnd(*warm->engine, {with(1, 1)}).prefix_hits, 0);
    const NewSequence second = with(2, 2);
    Outcome a = RunToEnd(*warm->engine, {second}), b = RunToEnd(*cold->engine, {second});
    EXPECT_EQ(a.prefix_hits, 20);  // 10 whole blocks of the shared 21 tokens
    EXPECT_EQ(a.tokens[2], b.tokens[2]);
    EXPECT_LE(Worst(a.logits[2], b.logits[2]), 5e-5);
    EXPECT_EQ(warm->engine->Info().free_blocks, warm->engine->Info().num_blocks);
  }
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
