// Qwen3.5's MTP head against tools/mtp_reference.py (an independent torch forward of the head,
// tests/data/qwen3_5_moe_mtp): the target's hidden states after the final norm, and the head's
// draft logits over whole prompts and in pieces (its own keys and values carried in the KV
// cache), at TP=1 and TP=2 (with and without expert parallelism); the checkpoint with its experts
// stored one by one under `.base_layer.` names; greedy decoding with drafts verified and rolled
// back equal to greedy decoding, alone and in a batch mixing 2D, 3D and base sequences; a model
// built without the head, and a checkpoint without one. Step3.5's chained MTP layers against
// tools/step3p5_mtp_reference.py (tests/data/step3p5_mtp) at TP=1 and TP=2.
#include <ATen/ATen.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "common/safetensors.h"
#include "common/status_macros.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "lora/adapter.h"
#include "tests/testing/status_matchers.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/worker/engine_test_util.h"
#include "tests/unit/worker/speculative_reference.h"
#include "worker/architectures/vision_tower.h"
#include "worker/comm/communicator.h"
#include "worker/model/causal_lm.h"

namespace moelora {
namespace {

using ::moelora::testing::Data;
using ::moelora::testing::StatusIs;
using ::moelora::testing::TempDir;
using ::testing::HasSubstr;

constexpr float kRefTol = 1e-4f;

// One tensor of a safetensors file as a tensor of its own (f32 or i64).
at::Tensor Read(const SafetensorsFile& f, const std::string& name) {
  const TensorView* v = f.Find(name);
  EXPECT_NE(v, nullptr) << name;
  if (v == nullptr) return at::Tensor();
  const at::ScalarType t = v->dtype == DType::kI64 ? at::kLong : at::kFloat;
  return at::from_blob(const_cast<uint8_t*>(v->data), v->shape, t).clone();
}

struct Holder {
  std::unique_ptr<Communicator> comm = MakeLocalCommunicator();
  std::unique_ptr<CausalLM> model;
};

absl::StatusOr<std::unique_ptr<Holder>> Load(const std::string& dir, bool mtp) {
  auto h = std::make_unique<Holder>();
  ModelOptions o;
  o.mtp = mtp;
  o.mixed_moe_lora_format = true;  // 2D and 3D adapters side by side
  o.max_lora_rank = 8;
  MOELORA_ASSIGN_OR_RETURN(h->model, LoadCausalLM(dir, o, h->comm.get()));
  return h;
}

// One sequence's tokens as a batch, on `slot`.
ForwardBatch OneSeq(SeqState* st, std::vector<int64_t> tokens, bool all_logits, int32_t slot = -1) {
  ForwardBatch b;
  const auto n = static_cast<int64_t>(tokens.size());
  b.tokens = std::move(tokens);
  b.slots.assign(n, slot);
  b.seqs.push_back({st, 0, n, all_logits});
  return b;
}

std::vector<int64_t> Ids(const at::Tensor& t) {
  return std::vector<int64_t>(t.data_ptr<int64_t>(), t.data_ptr<int64_t>() + t.numel());
}

// The target over `ids` in pieces (every row's logits), then the head over the same positions
// in pieces of its own: each head piece feeds tokens p + 1 with the target's hidden state at p.
// Returns the head's logits [ids.size() - 1, vocab] and the target's hidden states.
// `slot` adapts the target, `head_slot` the head (-1: none).
std::pair<at::Tensor, at::Tensor> TargetThenHead(CausalLM& m, const std::vector<int64_t>& ids,
                                                 const std::vector<int64_t>& target_pieces,
                                                 const std::vector<int64_t>& head_pieces,
                                                 int32_t slot = -1, int32_t head_slot = -1) {
  SeqState st = m.NewState();
  std::vector<at::Tensor> hidden;
  int64_t pos = 0;
  for (int64_t n : target_pieces) {
    auto logits = m.Forward(OneSeq(&st, {ids.begin() + pos, ids.begin() + pos + n}, true, slot));
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (!logits.ok()) return {};
    hidden.push_back(m.last_hidden().clone());
    pos += n;
  }
  const at::Tensor h = at::cat(hidden, 0);
  std::vector<at::Tensor> drafts;
  pos = 0;
  for (int64_t n : head_pieces) {
    auto logits = m.ForwardMtp(
        OneSeq(&st, {ids.begin() + pos + 1, ids.begin() + pos + 1 + n}, true, head_slot),
        h.narrow(0, pos, n));
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (!logits.ok()) return {};
    drafts.push_back(*logits);
    pos += n;
  }
  EXPECT_EQ(st.len, static_cast<int64_t>(ids.size()));
  EXPECT_EQ(st.mtp_len[0], static_cast<int64_t>(ids.size()) - 1);
  return {at::cat(drafts, 0), h.to(at::kFloat)};
}

float MaxDiff(const at::Tensor& a, const at::Tensor& b) {
  if (!a.defined() || !b.defined() || a.sizes() != b.sizes()) return INFINITY;
  return (a - b).abs().max().item<float>();
}

// `expected`: the reference's file (expected_mtp, or expected_mtp_adapter with the adapter in
// `slot` adapting both the target and the head).
void ExpectHeadMatchesTheReference(CausalLM& m,
                                   const std::string& expected = "expected_mtp.safetensors",
                                   int32_t slot = -1) {
  auto prompts = SafetensorsFile::Open(Data("qwen3_5_moe_mtp/expected_mtp.safetensors"));
  ASSERT_OK(prompts);
  auto ref = SafetensorsFile::Open(Data("qwen3_5_moe_mtp/" + expected));
  ASSERT_OK(ref);
  ASSERT_TRUE(m.has_mtp());
  for (int k = 0; (*prompts)->Find(absl::StrCat("prompt.", k)) != nullptr; ++k) {
    SCOPED_TRACE(absl::StrCat("prompt ", k));
    const std::vector<int64_t> ids = Ids(Read(**prompts, absl::StrCat("prompt.", k)));
    const at::Tensor want = Read(**ref, absl::StrCat("mtp_logits.", k));
    const at::Tensor want_hidden = Read(**ref, absl::StrCat("hidden.", k));
    const int64_t n = static_cast<int64_t>(ids.size());
    auto [whole, hidden] = TargetThenHead(m, ids, {n}, {n - 1}, slot, slot);
    EXPECT_LE(MaxDiff(hidden, want_hidden), kRefTol);
    const float d_whole = MaxDiff(whole, want);
    // In pieces: the head's keys and values from earlier pieces are read back from the cache.
    std::vector<int64_t> tp = {n}, hp = {n - 1};
    if (n > 3) tp = {2, n - 2}, hp = {1, 1, n - 3};
    const float d_pieces = MaxDiff(TargetThenHead(m, ids, tp, hp, slot, slot).first, want);
    std::vector<int64_t> ones(n - 1, 1);
    const float d_steps = MaxDiff(TargetThenHead(m, ids, {n}, ones, slot, slot).first, want);
    std::printf(
        "[ref] qwen3_5 MTP%s prompt %d (%lld tokens): whole %.3g, in pieces %.3g, token by "
        "token %.3g\n",
        slot >= 0 ? " with an adapter" : "", k, static_cast<long long>(n), d_whole, d_pieces,
        d_steps);
    EXPECT_LE(d_whole, kRefTol);
    EXPECT_LE(d_pieces, kRefTol);
    EXPECT_LE(d_steps, kRefTol);
  }
}

// A model built from `dir` without its heads (no speculation) takes adapter `a` for its target
// alone (the heads' modules left out): its logits over `ids` are those of `m` (built with the
// heads, `a` in slot 2).
void ExpectAModelWithoutHeadsTakesTheAdapter(const std::string& dir, const LoraAdapter& a,
                                             CausalLM& m, const std::vector<int64_t>& ids) {
  auto plain = Load(dir, /*mtp=*/false);
  ASSERT_OK(plain);
  CausalLM& t = *(*plain)->model;
  ASSERT_OK(t.SetSlot(1, a));
  SeqState s1 = t.NewState(), s2 = m.NewState();
  auto without_heads = t.Forward(OneSeq(&s1, ids, true, 1));
  auto with_heads = m.Forward(OneSeq(&s2, ids, true, 2));
  ASSERT_OK(without_heads);
  ASSERT_OK(with_heads);
  EXPECT_LE(MaxDiff(*without_heads, *with_heads), 1e-6);
}

TEST(MtpTest, HeadLogitsMatchTheReference) {
  auto h = Load(Data("qwen3_5_moe_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  ExpectHeadMatchesTheReference(*(*h)->model);
}

// An adapter with LoRA on the head's modules (`mtp.layers.0.*`: attention, shared expert, fused
// experts converted to 2D in place) and on the target's: the adapted target's hidden states and
// the adapted head's logits match the reference (PEFT on the joint module); the head without its
// LoRA gives other logits; a model built without the head takes the adapter for its target.
TEST(MtpTest, AnAdapterOnTheHeadMatchesTheReference) {
  auto h = Load(Data("qwen3_5_moe_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  EXPECT_THAT(m.lora_modules(), ::testing::Contains("mtp.layers.0.self_attn.q_proj"));
  EXPECT_THAT(m.lora_modules(), ::testing::Contains("mtp.layers.0.mlp.experts"));
  AdapterReadOptions ro;
  ro.model = m.config().info;
  ro.convert_to_2d = true;
  auto a = ReadAdapter(Data("qwen3_5_moe_mtp/adapter_mtp"), ro);
  ASSERT_OK(a);
  ASSERT_OK(m.SetSlot(2, *a));
  ExpectHeadMatchesTheReference(m, "expected_mtp_adapter.safetensors", 2);
  // The head unadapted (slot -1) beside the adapted target: not the reference's head.
  auto prompts = SafetensorsFile::Open(Data("qwen3_5_moe_mtp/expected_mtp.safetensors"));
  auto ref = SafetensorsFile::Open(Data("qwen3_5_moe_mtp/expected_mtp_adapter.safetensors"));
  ASSERT_OK(prompts);
  ASSERT_OK(ref);
  const std::vector<int64_t> ids = Ids(Read(**prompts, "prompt.2"));
  const auto n = static_cast<int64_t>(ids.size());
  EXPECT_GT(MaxDiff(TargetThenHead(m, ids, {n}, {n - 1}, 2, -1).first, Read(**ref, "mtp_logits.2")),
            1e-2);
  ExpectAModelWithoutHeadsTakesTheAdapter(Data("qwen3_5_moe_mtp/model"), *a, m, ids);
}

// `dir` built with its MTP heads on two ranks (threads, gloo over loopback), with expert
// parallelism when `ep`; `body` runs on each rank's model and returns what went wrong ("" for
// nothing). Expects both ranks to say nothing.
void OnTwoRanks(const std::string& dir, bool ep,
                const std::function<std::string(CausalLM&, int rank)>& body) {
  TempDir store;
  std::vector<std::string> errors(2);
  std::vector<std::thread> ranks;
  for (int r = 0; r < 2; ++r) {
    ranks.emplace_back([&, r] {
      RendezvousOptions ro;
      ro.rank = r;
      ro.world_size = 2;
      ro.store_dir = store.path();
      auto comm = MakeGlooCommunicator(ro);
      if (!comm.ok()) {
        errors[r] = std::string(comm.status().message());
        return;
      }
      ModelOptions o;
      o.mtp = true;
      o.tp_rank = r;
      o.tp_size = 2;
      o.expert_parallel = ep;
      auto m = LoadCausalLM(dir, o, comm->get());
      if (!m.ok()) {
        errors[r] = std::string(m.status().message());
        return;
      }
      errors[r] = body(**m, r);
    });
  }
  for (auto& t : ranks) t.join();
  EXPECT_EQ(errors[0], "");
  EXPECT_EQ(errors[1], "");
}

// Tensor parallelism: two ranks (threads, gloo over loopback), the head's attention heads split
// and its experts split by rows or, with expert parallelism, whole on one rank each; every rank's
// draft logits match the reference, and greedy decoding with drafts gives transformers' tokens.
TEST(MtpTest, HeadLogitsAtTp2MatchTheReference) {
  for (bool ep : {false, true}) {
    SCOPED_TRACE(ep ? "expert parallel" : "tensor parallel");
    std::mutex mu;
    OnTwoRanks(Data("qwen3_5_moe_mtp/model"), ep, [&](CausalLM& m, int r) {
      auto ref = SafetensorsFile::Open(Data("qwen3_5_moe_mtp/expected_mtp.safetensors"));
      const std::vector<int64_t> ids = Ids(Read(**ref, "prompt.2"));
      const int64_t n = static_cast<int64_t>(ids.size());
      const float d =
          MaxDiff(TargetThenHead(m, ids, {n}, {2, n - 3}).first, Read(**ref, "mtp_logits.2"));
      // Greedy decoding with 3 drafts a step: transformers' greedy tokens on both ranks.
      const std::vector<int64_t> want = Ids(Read(**ref, "greedy.2"));
      auto spec = GreedyWithMtp(m, ids, static_cast<int64_t>(want.size()), 3, nullptr);
      std::lock_guard<std::mutex> l(mu);
      std::printf("[ref] qwen3_5 MTP at TP=2%s, rank %d: %.3g\n", ep ? " EP" : "", r, d);
      std::string err;
      if (!(d <= kRefTol)) err = absl::StrCat("rank ", r, ": max diff ", d);
      if (!spec.ok()) {
        err += std::string(spec.status().message());
      } else if (*spec != want) {
        err += " speculative tokens differ from greedy";
      }
      return err;
    });
  }
}

// The released layouts differ: experts one by one, and `.base_layer.` in the names once LoRA
// wraps the layer. The same head from such a checkpoint.
TEST(MtpTest, PerExpertBaseLayerCheckpointGivesTheSameHead) {
  const std::string src = Data("qwen3_5_moe_mtp/model");
  TempDir dir;
  std::filesystem::copy_file(src + "/config.json", dir.path() + "/config.json");
  auto f = SafetensorsFile::Open(src + "/model.safetensors");
  ASSERT_OK(f);
  std::vector<std::string> names;
  std::vector<at::Tensor> keep;
  std::vector<TensorToWrite> out;
  auto add = [&](const std::string& name, const at::Tensor& t) {
    keep.push_back(t.contiguous());
    names.push_back(name);
  };
  int split = 0;
  for (const TensorView& v : (*f)->tensors()) {
    const at::Tensor t = Read(**f, v.name);
    const std::string e = "mtp.layers.0.mlp.experts.";
    if (v.name == e + "gate_up_proj") {  // [E, 2I, H]: gate rows, then up rows
      const int64_t I = t.size(1) / 2;
      for (int64_t x = 0; x < t.size(0); ++x) {
        add(absl::StrCat(e, x, ".gate_proj.base_layer.weight"), t[x].narrow(0, 0, I));
        add(absl::StrCat(e, x, ".up_proj.base_layer.weight"), t[x].narrow(0, I, I));
      }
      ++split;
    } else if (v.name == e + "down_proj") {  // [E, H, I]
      for (int64_t x = 0; x < t.size(0); ++x) {
        add(absl::StrCat(e, x, ".down_proj.base_layer.weight"), t[x]);
      }
      ++split;
    } else if (v.name == "mtp.layers.0.self_attn.q_proj.weight") {
      add("mtp.layers.0.self_attn.q_proj.base_layer.weight", t);
    } else {
      add(v.name, t);
    }
  }
  ASSERT_EQ(split, 2);
  for (size_t i = 0; i < keep.size(); ++i) {
    out.push_back({names[i], DType::kF32, keep[i].sizes().vec(), keep[i].data_ptr(),
                   static_cast<size_t>(keep[i].nbytes())});
  }
  ASSERT_OK(WriteSafetensors(dir.path() + "/model.safetensors", out, {{"format", "pt"}}));
  auto h = Load(dir.path(), /*mtp=*/true);
  ASSERT_OK(h);
  ExpectHeadMatchesTheReference(*(*h)->model);
}

// Greedy decoding one token a step (no drafts) on `slot`.
std::vector<int64_t> PlainGreedy(CausalLM& m, const std::vector<int64_t>& prompt, int64_t n,
                                 int32_t slot = -1) {
  SeqState st = m.NewState();
  std::vector<int64_t> out, in = prompt;
  for (int64_t i = 0; i < n; ++i) {
    auto logits = m.Forward(OneSeq(&st, in, false, slot));
    EXPECT_TRUE(logits.ok()) << logits.status();
    if (!logits.ok()) return out;
    out.push_back((*logits)[0].argmax().item<int64_t>());
    in = {out.back()};
  }
  return out;
}

// Lossless: with 1-4 drafts a step (a verify that accepts all, some or none of them, rolled
// back through the Gated DeltaNet states and the KV blocks), the tokens are greedy decoding's,
// which are transformers' greedy tokens; the trained head's drafts are mostly accepted.
TEST(MtpTest, GreedyWithDraftsEqualsGreedy) {
  auto ref = SafetensorsFile::Open(Data("qwen3_5_moe_mtp/expected_mtp.safetensors"));
  ASSERT_OK(ref);
  auto h = Load(Data("qwen3_5_moe_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  constexpr int64_t kTokens = 40;
  SpeculationStats all;
  for (int k = 0; (*ref)->Find(absl::StrCat("prompt.", k)) != nullptr; ++k) {
    SCOPED_TRACE(absl::StrCat("prompt ", k));
    const std::vector<int64_t> prompt = Ids(Read(**ref, absl::StrCat("prompt.", k)));
    const std::vector<int64_t> hf = Ids(Read(**ref, absl::StrCat("greedy.", k)));
    const std::vector<int64_t> plain = PlainGreedy(m, prompt, kTokens);
    ASSERT_EQ(std::vector<int64_t>(plain.begin(), plain.begin() + hf.size()), hf);
    for (int drafts : {1, 2, 3, 4}) {
      SpeculationStats s;
      auto spec = GreedyWithMtp(m, prompt, kTokens, drafts, &s);
      ASSERT_OK(spec);
      EXPECT_EQ(*spec, plain) << drafts << " drafts a step";
      std::printf(
          "[mtp] prompt %d, k=%d: %lld verify steps for %lld tokens, %lld of %lld drafts "
          "accepted\n",
          k, drafts, static_cast<long long>(s.steps), static_cast<long long>(kTokens),
          static_cast<long long>(s.accepted), static_cast<long long>(s.drafted));
      EXPECT_GT(s.accepted, 0);
      all.drafted += s.drafted;
      all.accepted += s.accepted;
    }
  }
  // The trained head: over half its drafts accepted (mtp_stats.json: 0.44-0.94 per prompt).
  EXPECT_GT(all.accepted * 2, all.drafted);
}

// A batch of three sequences on the base model, a 3D and a 2D adapter (the target adapted, the
// head not), each accepting a different number of drafts a step: every sequence's tokens equal
// its greedy decoding alone, in either order of the batch.
TEST(MtpTest, MixedAdapterBatchWithDraftsEqualsEachAlone) {
  auto ref = SafetensorsFile::Open(Data("qwen3_5_moe_mtp/expected_mtp.safetensors"));
  ASSERT_OK(ref);
  auto h = Load(Data("qwen3_5_moe_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  AdapterReadOptions ro;
  ro.model = m.config().info;
  ro.convert_to_2d = true;
  for (auto [slot, dir] : {std::pair<int, const char*>{1, "adapter_3d"}, {2, "adapter_2d"}}) {
    auto a = ReadAdapter(Data(std::string("qwen3_5_moe/") + dir), ro);
    ASSERT_OK(a);
    ASSERT_OK(m.SetSlot(slot, *a));
  }
  constexpr int64_t kTokens = 24;
  constexpr int kDrafts = 3;
  std::vector<std::vector<int64_t>> prompts;
  for (int k = 0; k < 3; ++k) prompts.push_back(Ids(Read(**ref, absl::StrCat("prompt.", k))));
  const std::vector<int32_t> slots = {-1, 1, 2};
  std::vector<std::vector<int64_t>> alone;
  for (int i = 0; i < 3; ++i) alone.push_back(PlainGreedy(m, prompts[i], kTokens, slots[i]));
  EXPECT_NE(alone[1], PlainGreedy(m, prompts[1], kTokens));  // the adapters change the tokens
  for (bool swapped : {false, true}) {
    SCOPED_TRACE(swapped ? "swapped" : "in order");
    std::vector<int> order = {0, 1, 2};
    if (swapped) order = {2, 1, 0};
    std::vector<SeqState> states;
    for (int i = 0; i < 3; ++i) states.push_back(m.NewState());
    ForwardBatch pre;
    for (int i : order) {
      const auto begin = static_cast<int64_t>(pre.tokens.size());
      const auto n = static_cast<int64_t>(prompts[i].size());
      pre.tokens.insert(pre.tokens.end(), prompts[i].begin(), prompts[i].end());
      pre.slots.insert(pre.slots.end(), n, slots[i]);
      pre.seqs.push_back({&states[i], begin, n, false});
    }
    auto logits = m.Forward(pre);
    ASSERT_OK(logits);
    std::vector<DraftingSeq> seqs;
    std::vector<std::vector<int64_t>> got(3);
    for (size_t r = 0; r < order.size(); ++r) {
      DraftingSeq d;
      d.state = &states[order[r]];
      d.slot = slots[order[r]];
      d.next = (*logits)[static_cast<int64_t>(r)].argmax().item<int64_t>();
      got[order[r]].push_back(d.next);
      seqs.push_back(std::move(d));
    }
    ASSERT_OK(StartDrafting(m, pre, seqs));
    SpeculationStats stats;
    while (true) {
      bool done = true;
      for (int i = 0; i < 3; ++i) done &= static_cast<int64_t>(got[i].size()) >= kTokens;
      if (done) break;
      ASSERT_OK(SpeculativeGreedyStep(m, seqs, kDrafts, &stats));
      for (size_t r = 0; r < order.size(); ++r) {
        auto& g = got[order[r]];
        g.insert(g.end(), seqs[r].emitted.begin(), seqs[r].emitted.end());
      }
    }
    for (int i = 0; i < 3; ++i) {
      got[i].resize(kTokens);
      EXPECT_EQ(got[i], alone[i]) << "sequence " << i << " (slot " << slots[i] << ")";
    }
    std::printf("[mtp] mixed batch%s: %lld of %lld drafts accepted\n", swapped ? " (swapped)" : "",
                static_cast<long long>(stats.accepted), static_cast<long long>(stats.drafted));
  }
}

// RollBack needs the states of the forward it undoes, and a count it can keep.
TEST(MtpTest, RollBackRefusesWhatItCannotUndo) {
  auto h = Load(Data("qwen3_5_moe_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  SeqState st = m.NewState();
  ForwardBatch b = OneSeq(&st, {1, 2, 3}, false);
  ASSERT_OK(m.Forward(b).status());
  EXPECT_THAT(m.RollBack(st, 3, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("keep_states")));
  b.seqs[0].keep_states = true;
  ASSERT_OK(m.Forward(b).status());
  EXPECT_THAT(m.RollBack(st, 3, 4), StatusIs(absl::StatusCode::kInvalidArgument));
  EXPECT_EQ(st.len, 6);
  // States kept by one forward are stale after the next one without: refused again.
  ASSERT_OK(m.Forward(b).status());
  b.seqs[0].keep_states = false;
  ASSERT_OK(m.Forward(b).status());
  EXPECT_THAT(m.RollBack(st, 3, 1),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("keep_states")));
  EXPECT_EQ(st.len, 12);
}

TEST(MtpTest, WithoutTheOptionTheHeadIsSkippedAndRefused) {
  auto h = Load(Data("qwen3_5_moe_mtp/model"), /*mtp=*/false);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  EXPECT_FALSE(m.has_mtp());
  bool listed = false;
  for (const std::string& s : m.skipped_tensors()) listed |= s.rfind("mtp.fc.weight", 0) == 0;
  EXPECT_TRUE(listed);
  SeqState st = m.NewState();
  EXPECT_THAT(m.ForwardMtp(OneSeq(&st, {1, 2}, true), at::zeros({2, m.config().info.hidden_size})),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("without an MTP head")));
}

TEST(MtpTest, ACheckpointWithoutAHeadIsRefusedByName) {
  auto h = Load(Data("qwen3_5_moe/model"), /*mtp=*/true);
  EXPECT_THAT(h.status(),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("mtp_num_hidden_layers")));
}

TEST(MtpTest, HiddenStatesOfTheWrongShapeAreRefused) {
  auto h = Load(Data("qwen3_5_moe_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  SeqState st = m.NewState();
  EXPECT_THAT(
      m.ForwardMtp(OneSeq(&st, {1, 2, 3}, true), at::zeros({2, m.config().info.hidden_size})),
      StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("one hidden state")));
  EXPECT_EQ(st.mtp_len[0], 0);
}

// Image prompts (tools/mtp_reference.py mm, tests/data/qwen3_5_moe_mm_mtp): the head reads the
// tower's embedding where its input is an image token, and the target's multimodal rotary
// streams at its position. The target over prompt + greedy tokens with the reference's streams
// and image embeddings, then the head over the same positions, whole and in pieces: its logits
// match the reference's; with the image tokens' own embeddings, or text positions, they do not.
TEST(MtpTest, ImagePromptsReachTheHeadAsTheTargetReadThem) {
  auto h = Load(Data("qwen3_5_moe_mm_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  ASSERT_NE(m.vision(), nullptr);
  const int64_t image_token = m.vision()->image_token_id;
  auto ref = SafetensorsFile::Open(Data("qwen3_5_moe_mm_mtp/expected_mtp.safetensors"));
  ASSERT_OK(ref);
  for (int k = 0; (*ref)->Find(absl::StrCat("prompt.", k)) != nullptr; ++k) {
    SCOPED_TRACE(absl::StrCat("prompt ", k));
    std::vector<int64_t> ids = Ids(Read(**ref, absl::StrCat("prompt.", k)));
    const std::vector<int64_t> more = Ids(Read(**ref, absl::StrCat("greedy.", k)));
    ids.insert(ids.end(), more.begin(), more.end());
    const auto n = static_cast<int64_t>(ids.size());
    const at::Tensor pos = Read(**ref, absl::StrCat("positions.", k));  // [3, n]
    const at::Tensor embeds = Read(**ref, absl::StrCat("image_embeds.", k));
    ASSERT_EQ(pos.size(1), n);
    // Image rows of a run of positions [from, from + count) whose inputs are the tokens at
    // positions + shift; their embeddings in the order the images hold them.
    auto visual = [&](ForwardBatch& b, int64_t from, int64_t count, int64_t shift) {
      int64_t before = 0;
      for (int64_t q = 0; q < from + shift; ++q) before += ids[q] == image_token;
      std::vector<at::Tensor> rows;
      for (int64_t i = 0; i < count; ++i) {
        if (ids[from + i + shift] != image_token) continue;
        b.visual_rows.push_back(i);
        rows.push_back(embeds[before++]);
      }
      if (!rows.empty()) b.visual_embeds = at::stack(rows, 0);
      b.positions3.resize(3 * count);
      for (int r = 0; r < 3; ++r) {
        for (int64_t i = 0; i < count; ++i)
          b.positions3[r * count + i] = pos[r][from + i].item<int64_t>();
      }
    };
    SeqState st = m.NewState();
    ForwardBatch t = OneSeq(&st, ids, true);
    visual(t, 0, n, 0);
    ASSERT_FALSE(t.visual_rows.empty());
    auto target = m.Forward(t);
    ASSERT_OK(target);
    const at::Tensor hidden = m.last_hidden().clone();
    EXPECT_LE(MaxDiff(hidden.to(at::kFloat), Read(**ref, absl::StrCat("hidden.", k))), kRefTol);
    const at::Tensor want = Read(**ref, absl::StrCat("mtp_logits.", k));
    // The head over positions 0 .. n - 2 in two pieces (its keys read back from the cache).
    std::vector<at::Tensor> got;
    for (auto [from, count] : {std::pair<int64_t, int64_t>{0, n / 2}, {n / 2, n - 1 - n / 2}}) {
      ForwardBatch hb = OneSeq(&st, {ids.begin() + from + 1, ids.begin() + from + 1 + count}, true);
      visual(hb, from, count, 1);
      auto l = m.ForwardMtp(hb, hidden.narrow(0, from, count));
      ASSERT_OK(l);
      got.push_back(*l);
    }
    const float d = MaxDiff(at::cat(got, 0), want);
    std::printf("[ref] qwen3_5 MTP image prompt %d (%lld tokens): %.3g\n", k,
                static_cast<long long>(n), d);
    EXPECT_LE(d, kRefTol);
    // Without the tower's embeddings (the image token's own), or with text positions: not the
    // reference's head.
    SeqState s2 = m.NewState(), s3 = m.NewState();
    ForwardBatch t2 = OneSeq(&s2, ids, false), t3 = OneSeq(&s3, ids, false);
    visual(t2, 0, n, 0);
    visual(t3, 0, n, 0);
    ASSERT_OK(m.Forward(t2));
    ASSERT_OK(m.Forward(t3));
    ForwardBatch plain = OneSeq(&s2, {ids.begin() + 1, ids.end()}, true);
    visual(plain, 0, n - 1, 1);
    plain.visual_rows.clear();
    plain.visual_embeds = at::Tensor();
    auto l2 = m.ForwardMtp(plain, hidden.narrow(0, 0, n - 1));
    ASSERT_OK(l2);
    EXPECT_GT(MaxDiff(*l2, want), 1e-3);
    ForwardBatch text = OneSeq(&s3, {ids.begin() + 1, ids.end()}, true);
    visual(text, 0, n - 1, 1);
    text.positions3.clear();
    auto l3 = m.ForwardMtp(text, hidden.narrow(0, 0, n - 1));
    ASSERT_OK(l3);
    EXPECT_GT(MaxDiff(*l3, want), 1e-3);
  }
}

// Step3.5's chained MTP layers (tests/data/step3p5_mtp, tools/step3p5_mtp_reference.py): the
// target over `ids` whole, then each head j over the positions whose input tokens are known
// (token p + 1 + j, the previous head's output at p before its norm; head 0 the target's hidden
// state before the final norm), in `pieces` pieces. Returns each head's logits [n - 1 - j, vocab]
// and the target's hidden states.
// `slot` adapts the target, `head_slot` the heads (-1: none).
std::pair<std::vector<at::Tensor>, at::Tensor> ChainedHeads(CausalLM& m,
                                                            const std::vector<int64_t>& ids,
                                                            int pieces, int32_t slot = -1,
                                                            int32_t head_slot = -1) {
  SeqState st = m.NewState();
  const auto n = static_cast<int64_t>(ids.size());
  auto target = m.Forward(OneSeq(&st, ids, true, slot));
  EXPECT_TRUE(target.ok()) << target.status();
  if (!target.ok()) return {};
  const at::Tensor h = m.last_hidden().clone();
  at::Tensor prev = h;
  std::vector<at::Tensor> logits;
  for (int j = 0; j < m.mtp_heads() && n - 1 - j > 0; ++j) {
    const int64_t count = n - 1 - j;
    std::vector<at::Tensor> lg, zs;
    for (int64_t pos = 0, piece = 0; pos < count; ++piece) {
      const int64_t len = piece + 1 < pieces ? std::max<int64_t>(1, count / pieces) : count - pos;
      at::Tensor z;
      auto l =
          m.ForwardMtp(OneSeq(&st, {ids.begin() + pos + 1 + j, ids.begin() + pos + 1 + j + len},
                              true, head_slot),
                       prev.narrow(0, pos, len), &z, j, /*every_row=*/true);
      EXPECT_TRUE(l.ok()) << l.status();
      if (!l.ok()) return {};
      lg.push_back(*l);
      zs.push_back(z);
      pos += len;
    }
    EXPECT_EQ(st.mtp_len[static_cast<size_t>(j)], count);
    logits.push_back(at::cat(lg, 0));
    prev = at::cat(zs, 0);
  }
  return {logits, h.to(at::kFloat)};
}

// `expected`: expected_mtp, or expected_mtp_adapter with the adapter in `slot` adapting both
// the target and the heads.
void ExpectChainedHeadsMatchTheReference(CausalLM& m,
                                         const std::string& expected = "expected_mtp.safetensors",
                                         int32_t slot = -1) {
  auto prompts = SafetensorsFile::Open(Data("step3p5_mtp/expected_mtp.safetensors"));
  ASSERT_OK(prompts);
  auto ref = SafetensorsFile::Open(Data("step3p5_mtp/" + expected));
  ASSERT_OK(ref);
  ASSERT_EQ(m.mtp_heads(), 3);
  ASSERT_TRUE(m.mtp_chained());
  for (int k = 0; (*prompts)->Find(absl::StrCat("prompt.", k)) != nullptr; ++k) {
    const std::vector<int64_t> ids = Ids(Read(**prompts, absl::StrCat("prompt.", k)));
    for (int pieces : {1, 3}) {
      SCOPED_TRACE(absl::StrCat("prompt ", k, ", ", pieces, " pieces"));
      auto [logits, hidden] = ChainedHeads(m, ids, pieces, slot, slot);
      EXPECT_LE(MaxDiff(hidden, Read(**ref, absl::StrCat("hidden.", k))), kRefTol);
      int heads = 0;
      for (size_t j = 0; j < logits.size(); ++j) {
        const std::string name = absl::StrCat("mtp_logits.", k, ".", j);
        if ((*ref)->Find(name) == nullptr) continue;
        const float d = MaxDiff(logits[j], Read(**ref, name));
        std::printf("[ref] step3p5 MTP head %zu%s prompt %d (%zu tokens, %d pieces): %.3g\n", j,
                    slot >= 0 ? " with an adapter" : "", k, ids.size(), pieces, d);
        EXPECT_LE(d, kRefTol) << name;
        ++heads;
      }
      EXPECT_EQ(heads, std::min<int>(3, static_cast<int>(ids.size()) - 1));
    }
  }
}

// Step3.5's three MTP layers (sliding / full / sliding attention; dense with a clamp, MoE,
// dense) load from the checkpoint's layers after num_hidden_layers and match the reference:
// the target's hidden states before the final norm, each head's logits over whole prompts and
// in pieces (its keys and values read back from its own KV layer). Their LoRA modules are named
// by their checkpoint layers. Without --speculative-config the layers are skipped and listed.
TEST(MtpTest, Step35ChainedHeadsMatchTheReference) {
  auto h = Load(Data("step3p5_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  EXPECT_THAT(m.lora_modules(), ::testing::Contains("model.layers.5.moe.experts"));
  EXPECT_THAT(m.lora_modules(), ::testing::Contains("model.layers.4.self_attn.g_proj"));
  EXPECT_TRUE(m.IsMtpModule("model.layers.6.mlp.down_proj"));
  EXPECT_FALSE(m.IsMtpModule("model.layers.3.mlp.down_proj"));
  ExpectChainedHeadsMatchTheReference(m);
  // The heads' greedy speculation helpers are the reused head's: refused here.
  EXPECT_THAT(GreedyWithMtp(m, {1, 2, 3}, 4, 2, nullptr),
              StatusIs(absl::StatusCode::kFailedPrecondition, HasSubstr("chained")));
  auto plain = Load(Data("step3p5_mtp/model"), /*mtp=*/false);
  ASSERT_OK(plain);
  EXPECT_FALSE((*plain)->model->has_mtp());
  EXPECT_THAT((*plain)->model->skipped_tensors(),
              ::testing::Contains(HasSubstr("model.layers.5.eh_proj.weight")));
}

// An adapter with LoRA on the MTP layers' modules (named by their checkpoint layers 4 .. 6) and
// on the target's: the adapted heads match the reference (PEFT on a module holding both); the
// heads unadapted beside the adapted target do not; a model built without the heads takes the
// adapter for its target (the heads' modules left out).
TEST(MtpTest, Step35AnAdapterOnTheHeadsMatchesTheReference) {
  auto h = Load(Data("step3p5_mtp/model"), /*mtp=*/true);
  ASSERT_OK(h);
  CausalLM& m = *(*h)->model;
  AdapterReadOptions ro;
  ro.model = m.config().info;
  ro.convert_to_2d = true;
  auto a = ReadAdapter(Data("step3p5_mtp/adapter_mtp"), ro);
  ASSERT_OK(a);
  ASSERT_OK(m.SetSlot(2, *a));
  ExpectChainedHeadsMatchTheReference(m, "expected_mtp_adapter.safetensors", 2);
  auto ref = SafetensorsFile::Open(Data("step3p5_mtp/expected_mtp_adapter.safetensors"));
  auto prompts = SafetensorsFile::Open(Data("step3p5_mtp/expected_mtp.safetensors"));
  ASSERT_OK(ref);
  ASSERT_OK(prompts);
  const std::vector<int64_t> ids = Ids(Read(**prompts, "prompt.0"));
  auto [unadapted, hidden] = ChainedHeads(m, ids, 1, 2, -1);
  ASSERT_EQ(unadapted.size(), 3u);
  EXPECT_GT(MaxDiff(unadapted[0], Read(**ref, "mtp_logits.0.0")), 1e-2);
  ExpectAModelWithoutHeadsTakesTheAdapter(Data("step3p5_mtp/model"), *a, m, ids);
}

// Step3.5 checkpoints name the MTP layers in more ways: `.base_layer.` once LoRA wraps a module,
// `.transformer.` inside a block (vLLM drops it), and a layer's own copy of the embedding (the
// model's is used). The same heads from such a checkpoint.
TEST(MtpTest, Step35HeadsFromOtherNamesAreTheSame) {
  const std::string src = Data("step3p5_mtp/model");
  TempDir dir;
  std::filesystem::copy_file(src + "/config.json", dir.path() + "/config.json");
  auto f = SafetensorsFile::Open(src + "/model.safetensors");
  ASSERT_OK(f);
  std::vector<std::string> names;
  std::vector<at::Tensor> keep;
  int renamed = 0;
  for (const TensorView& v : (*f)->tensors()) {
    std::string name = v.name;
    if (absl::StartsWith(name, "model.layers.5.moe.") && absl::EndsWith(name, "_proj.weight")) {
      name = absl::StrReplaceAll(name, {{"_proj.weight", "_proj.base_layer.weight"}});
      ++renamed;
    } else if (name == "model.layers.4.self_attn.q_proj.weight") {
      name = "model.layers.4.self_attn.q_proj.base_layer.weight";
      ++renamed;
    } else if (absl::StartsWith(name, "model.layers.6.self_attn.")) {
      name = absl::StrReplaceAll(name, {{"model.layers.6.", "model.layers.6.transformer."}});
      ++renamed;
    }
    names.push_back(name);
    keep.push_back(Read(**f, v.name).contiguous());
    if (v.name == "model.embed_tokens.weight") {
      names.push_back("model.layers.4.embed_tokens.weight");
      keep.push_back(keep.back());
    }
  }
  ASSERT_GE(renamed, 8);
  std::vector<TensorToWrite> out;
  for (size_t i = 0; i < keep.size(); ++i) {
    out.push_back({names[i], DType::kF32, keep[i].sizes().vec(), keep[i].data_ptr(),
                   static_cast<size_t>(keep[i].nbytes())});
  }
  ASSERT_OK(WriteSafetensors(dir.path() + "/model.safetensors", out, {{"format", "pt"}}));
  auto h = Load(dir.path(), /*mtp=*/true);
  ASSERT_OK(h);
  ExpectChainedHeadsMatchTheReference(*(*h)->model);
  EXPECT_THAT((*h)->model->skipped_tensors(),
              ::testing::Contains(HasSubstr("model.layers.4.embed_tokens.weight")));
}

TEST(MtpTest, Step35ChainedHeadsAtTp2MatchTheReference) {
  OnTwoRanks(Data("step3p5_mtp/model"), /*ep=*/false, [](CausalLM& m, int) {
    auto ref = SafetensorsFile::Open(Data("step3p5_mtp/expected_mtp.safetensors"));
    const std::vector<int64_t> ids = Ids(Read(**ref, "prompt.0"));
    auto [logits, hidden] = ChainedHeads(m, ids, 2);
    std::string err;
    for (size_t j = 0; j < logits.size(); ++j) {
      const float d = MaxDiff(logits[j], Read(**ref, absl::StrCat("mtp_logits.0.", j)));
      if (!(d <= kRefTol)) err += absl::StrCat("head ", j, " differs by ", d, "; ");
    }
    if (logits.size() != 3) err += "not three heads";
    return err;
  });
}

}  // namespace
}  // namespace moelora
