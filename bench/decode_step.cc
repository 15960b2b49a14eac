// bench/decode_step: one continuous-batching decode step, measured on the same engine with
//   (a) no adapter, (b) one adapter for the whole batch, (c) 8 distinct adapters (4 2D + 4 3D,
//   mixed mode), and printed as ratios (b)/(a) and (c)/(b) from the same run (goal (c)/(b)
//   <= 1.15).
//
//   decode_step [--batch B | --batches B1,B2,..] [--steps N] [--repeat K]
//               [--only tiny|medium|swap-in|slot-memory|ep-memory|qwen3_5|mtp|mtp-speed|a3b|peer|
//                       model] [--model DIR]
//               [--mtp-model DIR] [--mtp-tokens N] [--device cpu|cuda|cuda:N|cpu-twins]
//               [--dtype D] [--prefill N] [--ab-row-streams 1] [--ab-row-stream-rows N]
//               [--ab-row-stream-prefetch BYTES] [--ab-row-stream-far-prefetch BYTES]
//               [--ab-row-stream-nta 1]
//
// Models: the committed tiny fixture (H=24, E=4 top-2, 2 layers; adapters from tests/data); a
// medium synthetic Qwen3-MoE written to a temp dir (H=1024, E=32 top-8, I=512, 4 layers, 16 heads
// x 64, 4 KV heads, vocab 4096) with rank-16 adapters on q/k/v/o and the experts; and, only when
// asked for (--only a3b: gpu_check.sh runs it with --device cuda --dtype bfloat16), 4 layers of
// Qwen3-30B-A3B's shape (H=2048, E=128 top-8, I=768, 32 heads x 128, 4 KV heads; vocab 4096, not
// 151936: the LM head is not what is measured), written in bf16 (4.8 GB). For a3b the line also
// gives tokens/s and (c)/(a), the goal being <= 1.2 at batch 64. qwen3_5: a medium Qwen3.5-like
// model (3 Gated DeltaNet : 1 attention layers) with rank-16 adapters on every module, and a
// 512-token (--prefill) prefill in the chunked form against token by token (goal >= 5x).
// mtp (only when asked for): that model with an untrained MTP head: what a speculative step of
// k drafts costs against a decode step at batch 1 after --prefill tokens (MtpCosts). mtp-speed
// (only when asked for): decode tokens/s with speculation against without through the engine,
// on the model and trained head of `tools/mtp_reference.py medium` (--mtp-model, default
// .cache/mtp-medium; --mtp-tokens: tokens per sequence, default 24: the head learnt 26 tokens
// after each prompt) (MtpSpeed).
// --ab-row-streams 1: case (a)'s decode steps alternate between the skinny kernel's row streams
// at 1-2 x rows and its tiles (SetSkinnyRowStreams), and the line after it gives both medians
// and the median ratio of neighbouring steps: the VM's speed moves by up to 2x within seconds,
// so a change worth a few percent shows only when its two sides alternate step by step in one
// process (two binaries run one after the other differed by more than the change).
// --ab-row-stream-rows N: the same, between row streams up to the CPU's default x rows
// (SkinnyRowStreamRows) and up to N (1-8): how the default was chosen on each CPU.
// --ab-row-stream-prefetch BYTES: the same, between the row streams' prefetch distance of the CPU
// (SkinnyRowStreamPrefetchBytes) and BYTES (0: none at 1-2 x rows, one row at 3-8).
// --ab-row-stream-far-prefetch BYTES: the same, between the CPU's second prefetch for f32 weights
// at 5-8 x rows (SkinnyRowStreamFarPrefetchBytes, into L2) and BYTES (0: none).
// --ab-row-stream-nta 1: the same, between the row streams' prefetches with the non-temporal hint
// and with the L1 / L2 ones (SetSkinnyRowStreamNonTemporal).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_split.h"
#include "common/safetensors.h"
#include "kernels/skinny_gemm.h"
#include "nlohmann/json.hpp"
#include "tests/testing/adapter_builder.h"
#include "worker/architectures/qwen3_moe.h"
#include "worker/checkpoint.h"
#include "worker/comm/communicator.h"
#include "worker/engine/engine.h"
#include "worker/loaders/weight_loader.h"
#include "worker/model/causal_lm.h"

namespace moelora {
namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

void Check(const absl::Status& s, const char* what) {
  if (!s.ok()) {
    std::fprintf(stderr, "%s: %s\n", what, s.ToString().c_str());
    std::exit(1);
  }
}

struct Dims {
  int64_t H, I, E, topk, layers, heads, kv_heads, head_dim, vocab;
};

// A random Qwen3-MoE checkpoint (std 0.02, f32 or bf16) in the per-expert layout.
void WriteModel(const std::string& dir, const Dims& d, bool bf16 = false) {
  std::filesystem::create_directories(dir);
  std::ofstream(dir + "/config.json") << absl::StrCat(
      "{\"architectures\": [\"Qwen3MoeForCausalLM\"], \"hidden_size\": ", d.H,
      ", \"moe_intermediate_size\": ", d.I, ", \"num_experts\": ", d.E,
      ", \"num_experts_per_tok\": ", d.topk, ", \"num_hidden_layers\": ", d.layers,
      ", \"num_attention_heads\": ", d.heads, ", \"num_key_value_heads\": ", d.kv_heads,
      ", \"head_dim\": ", d.head_dim, ", \"vocab_size\": ", d.vocab,
      ", \"max_position_embeddings\": 4096, \"rms_norm_eps\": 1e-6, \"rope_theta\": 10000.0, "
      "\"norm_topk_prob\": true, \"tie_word_embeddings\": false}");
  at::manual_seed(0);
  std::vector<std::pair<std::string, at::Tensor>> ts;
  auto add = [&](const std::string& n, std::vector<int64_t> shape, bool ones = false) {
    at::Tensor t = ones ? at::ones(shape) : at::randn(shape) * 0.02;
    ts.push_back({n, bf16 ? t.to(at::kBFloat16) : t});
  };
  add("model.embed_tokens.weight", {d.vocab, d.H});
  add("lm_head.weight", {d.vocab, d.H});
  add("model.norm.weight", {d.H}, true);
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {d.H}, true);
    add(p + "post_attention_layernorm.weight", {d.H}, true);
    add(p + "self_attn.q_proj.weight", {d.heads * d.head_dim, d.H});
    add(p + "self_attn.k_proj.weight", {d.kv_heads * d.head_dim, d.H});
    add(p + "self_attn.v_proj.weight", {d.kv_heads * d.head_dim, d.H});
    add(p + "self_attn.o_proj.weight", {d.H, d.heads * d.head_dim});
    add(p + "self_attn.q_norm.weight", {d.head_dim}, true);
    add(p + "self_attn.k_norm.weight", {d.head_dim}, true);
    add(p + "mlp.gate.weight", {d.E, d.H});
    for (int64_t e = 0; e < d.E; ++e) {
      const std::string q = absl::StrCat(p, "mlp.experts.", e, ".");
      add(q + "gate_proj.weight", {d.I, d.H});
      add(q + "up_proj.weight", {d.I, d.H});
      add(q + "down_proj.weight", {d.H, d.I});
    }
  }
  std::vector<TensorToWrite> w;
  for (auto& [n, t] : ts) {
    w.push_back({n, bf16 ? DType::kBF16 : DType::kF32, t.sizes().vec(), t.data_ptr(),
                 static_cast<size_t>(t.numel()) * t.element_size()});
  }
  Check(WriteSafetensors(dir + "/model.safetensors", w), "write model");
}

std::string WriteAdapter(const std::string& dir, const Dims& d, bool three_d, int seed) {
  testing::AdapterBuilder b(seed);
  const int64_t r = 16;
  b.config()["r"] = r;
  b.config()["lora_alpha"] = 1;  // small scaling keeps activations finite with random weights
  b.config()["target_modules"] = three_d
                                     ? nlohmann::json{"q_proj", "k_proj", "v_proj", "o_proj"}
                                     : nlohmann::json{"q_proj",    "k_proj",  "v_proj",   "o_proj",
                                                      "gate_proj", "up_proj", "down_proj"};
  if (three_d)
    b.config()["target_parameters"] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    b.Pair(p + "self_attn.q_proj", r, d.H, d.heads * d.head_dim);
    b.Pair(p + "self_attn.k_proj", r, d.H, d.kv_heads * d.head_dim);
    b.Pair(p + "self_attn.v_proj", r, d.H, d.kv_heads * d.head_dim);
    b.Pair(p + "self_attn.o_proj", r, d.heads * d.head_dim, d.H);
    if (three_d) {
      b.Experts3D(p + "mlp.experts", d.E, r, d.H, d.I);
    } else {
      b.Experts2D(p + "mlp.experts", d.E, r, d.H, d.I);
    }
  }
  return b.Write(dir);
}

// A medium Qwen3.5-like model: 3 Gated DeltaNet layers to 1 gated attention layer, MoE with a
// gated shared expert, fused expert storage (as the releases). H=1024, 4 layers, E=32 top-8,
// I=512, shared 512, attention 8 x 128 (2 KV heads, partial rotary 0.25), GDN 4 key heads and
// 8 value heads of 128, vocab 4096.
struct Q35Dims {
  int64_t H = 1024, I = 512, Is = 512, E = 32, topk = 8, layers = 4, heads = 8, kv_heads = 2,
          head_dim = 128, nk = 4, nv = 8, dk = 128, dv = 128, K = 4, vocab = 4096;
  bool linear(int64_t l) const { return (l + 1) % 4 != 0; }
};

// With `mtp`: an MTP head too (`mtp.*`, random, untrained: its drafts are rarely accepted, what
// it is for is the cost of drafting and verifying).
void WriteQwen35Model(const std::string& dir, const Q35Dims& d, bool mtp = false) {
  std::filesystem::create_directories(dir);
  std::string types;
  for (int64_t l = 0; l < d.layers; ++l) {
    types +=
        absl::StrCat(l ? ", " : "", d.linear(l) ? "\"linear_attention\"" : "\"full_attention\"");
  }
  std::ofstream(dir + "/config.json") << absl::StrCat(
      "{\"architectures\": [\"Qwen3_5MoeForCausalLM\"], \"hidden_size\": ", d.H,
      ", \"moe_intermediate_size\": ", d.I, ", \"shared_expert_intermediate_size\": ", d.Is,
      ", \"num_experts\": ", d.E, ", \"num_experts_per_tok\": ", d.topk,
      ", \"num_hidden_layers\": ", d.layers, ", \"layer_types\": [", types,
      "], \"num_attention_heads\": ", d.heads, ", \"num_key_value_heads\": ", d.kv_heads,
      ", \"head_dim\": ", d.head_dim, ", \"linear_num_key_heads\": ", d.nk,
      ", \"linear_num_value_heads\": ", d.nv, ", \"linear_key_head_dim\": ", d.dk,
      ", \"linear_value_head_dim\": ", d.dv, ", \"linear_conv_kernel_dim\": ", d.K,
      ", \"vocab_size\": ", d.vocab,
      ", \"max_position_embeddings\": 4096, \"rms_norm_eps\": 1e-6, \"rope_parameters\": "
      "{\"rope_type\": \"default\", \"rope_theta\": 10000000.0, \"partial_rotary_factor\": "
      "0.25}, \"tie_word_embeddings\": false",
      mtp ? ", \"mtp_num_hidden_layers\": 1, \"mtp_use_dedicated_embeddings\": false}" : "}");
  at::manual_seed(0);
  std::vector<std::pair<std::string, at::Tensor>> ts;
  auto add = [&](const std::string& n, std::vector<int64_t> shape, double std = 0.02) {
    ts.push_back({n, std == 0 ? at::zeros(shape) : at::randn(shape) * std});
  };
  const int64_t kd = d.nk * d.dk, vd = d.nv * d.dv;
  // A gated full-attention mixer, and the MoE block with its shared expert, at layer prefix p.
  auto attention = [&](const std::string& p) {
    add(p + "self_attn.q_proj.weight", {2 * d.heads * d.head_dim, d.H});
    add(p + "self_attn.k_proj.weight", {d.kv_heads * d.head_dim, d.H});
    add(p + "self_attn.v_proj.weight", {d.kv_heads * d.head_dim, d.H});
    add(p + "self_attn.o_proj.weight", {d.H, d.heads * d.head_dim});
    add(p + "self_attn.q_norm.weight", {d.head_dim}, 0);
    add(p + "self_attn.k_norm.weight", {d.head_dim}, 0);
  };
  auto moe = [&](const std::string& p) {
    add(p + "mlp.gate.weight", {d.E, d.H});
    add(p + "mlp.experts.gate_up_proj", {d.E, 2 * d.I, d.H});
    add(p + "mlp.experts.down_proj", {d.E, d.H, d.I});
    add(p + "mlp.shared_expert.gate_proj.weight", {d.Is, d.H});
    add(p + "mlp.shared_expert.up_proj.weight", {d.Is, d.H});
    add(p + "mlp.shared_expert.down_proj.weight", {d.H, d.Is});
    add(p + "mlp.shared_expert_gate.weight", {1, d.H});
  };
  add("model.embed_tokens.weight", {d.vocab, d.H});
  add("lm_head.weight", {d.vocab, d.H});
  add("model.norm.weight", {d.H}, 0);
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    add(p + "input_layernorm.weight", {d.H}, 0);
    add(p + "post_attention_layernorm.weight", {d.H}, 0);
    if (d.linear(l)) {
      const std::string a = p + "linear_attn.";
      add(a + "in_proj_qkv.weight", {2 * kd + vd, d.H});
      add(a + "in_proj_z.weight", {vd, d.H});
      add(a + "in_proj_b.weight", {d.nv, d.H});
      add(a + "in_proj_a.weight", {d.nv, d.H});
      add(a + "conv1d.weight", {2 * kd + vd, 1, d.K}, 0.5);
      add(a + "dt_bias", {d.nv}, 0.5);
      add(a + "A_log", {d.nv}, 0.5);
      add(a + "norm.weight", {d.dv}, 0);
      add(a + "out_proj.weight", {d.H, vd});
    } else {
      attention(p);
    }
    moe(p);
  }
  if (mtp) {
    const std::string p = "mtp.layers.0.";
    add("mtp.fc.weight", {d.H, 2 * d.H});
    for (const char* n :
         {"mtp.pre_fc_norm_embedding.weight", "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight",
          "mtp.layers.0.input_layernorm.weight", "mtp.layers.0.post_attention_layernorm.weight"}) {
      add(n, {d.H}, 0);
    }
    attention(p);
    moe(p);
  }
  for (auto& [n, t] : ts) {
    if (absl::EndsWith(n, "norm.weight") && absl::StrContains(n, "linear_attn")) t.fill_(1.0);
  }
  std::vector<TensorToWrite> w;
  for (auto& [n, t] : ts) {
    w.push_back(
        {n, DType::kF32, t.sizes().vec(), t.data_ptr(), static_cast<size_t>(t.numel()) * 4});
  }
  Check(WriteSafetensors(dir + "/model.safetensors", w), "write model");
}

// Rank-16 adapters on every linear module of both mixers, the shared expert and the experts.
std::string WriteQwen35Adapter(const std::string& dir, const Q35Dims& d, bool three_d, int seed) {
  testing::AdapterBuilder b(seed);
  const int64_t r = 16, kd = d.nk * d.dk, vd = d.nv * d.dv;
  b.config()["r"] = r;
  b.config()["lora_alpha"] = 1;
  b.config()["target_modules"] = {"q_proj",      "k_proj",    "v_proj",    "o_proj",
                                  "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                  "out_proj",    "gate_proj", "up_proj",   "down_proj"};
  if (three_d)
    b.config()["target_parameters"] = {"mlp.experts.gate_up_proj", "mlp.experts.down_proj"};
  for (int64_t l = 0; l < d.layers; ++l) {
    const std::string p = absl::StrCat("model.layers.", l, ".");
    if (d.linear(l)) {
      b.Pair(p + "linear_attn.in_proj_qkv", r, d.H, 2 * kd + vd);
      b.Pair(p + "linear_attn.in_proj_z", r, d.H, vd);
      b.Pair(p + "linear_attn.in_proj_b", r, d.H, d.nv);
      b.Pair(p + "linear_attn.in_proj_a", r, d.H, d.nv);
      b.Pair(p + "linear_attn.out_proj", r, vd, d.H);
    } else {
      b.Pair(p + "self_attn.q_proj", r, d.H, 2 * d.heads * d.head_dim);
      b.Pair(p + "self_attn.k_proj", r, d.H, d.kv_heads * d.head_dim);
      b.Pair(p + "self_attn.v_proj", r, d.H, d.kv_heads * d.head_dim);
      b.Pair(p + "self_attn.o_proj", r, d.heads * d.head_dim, d.H);
    }
    b.Pair(p + "mlp.shared_expert.gate_proj", r, d.H, d.Is);
    b.Pair(p + "mlp.shared_expert.up_proj", r, d.H, d.Is);
    b.Pair(p + "mlp.shared_expert.down_proj", r, d.Is, d.H);
    if (three_d) {
      b.Experts3D(p + "mlp.experts", d.E, r, d.H, d.I);
    } else {
      b.Experts2D(p + "mlp.experts", d.E, r, d.H, d.I);
    }
  }
  return b.Write(dir);
}

// Prefill of one `len`-token prompt: one forward (the chunked delta rule) against `len`
// single-token forwards (the recurrent form), on the model itself.
void PrefillChunkedVsTokenByToken(const std::string& model, int len) {
  auto comm = MakeLocalCommunicator();
  auto m = LoadCausalLM(model, ModelOptions{}, comm.get());
  Check(m.status(), "load");
  std::vector<int64_t> toks(len);
  for (int i = 0; i < len; ++i) toks[i] = (i * 31 + 7) % 4096;
  auto run = [&](int piece) {
    SeqState st = (*m)->NewState();
    const double t0 = Now();
    for (int p = 0; p < len; p += piece) {
      ForwardBatch b;
      b.tokens.assign(toks.begin() + p, toks.begin() + std::min(len, p + piece));
      b.slots.assign(b.tokens.size(), -1);
      b.seqs.push_back({&st, 0, static_cast<int64_t>(b.tokens.size()), false});
      Check((*m)->Forward(b).status(), "forward");
    }
    return Now() - t0;
  };
  run(len);  // warm-up
  const double chunked = run(len), by_token = run(1);
  std::printf(
      "qwen3.5 prefill %d tokens: chunked %.3f s (%.0f tok/s)  token by token %.3f s (%.0f tok/s)"
      "  ratio %.2f  [goal >= 5]\n",
      len, chunked, len / chunked, by_token, len / by_token, by_token / chunked);
}

// What speculative decoding with the MTP head costs on the medium Qwen3.5 model at batch 1,
// after a prompt of `len` tokens: a decode step (1 token), a verify forward of k + 1 tokens with
// the recurrent states kept (then rolled back to 1 token, so the length grows as decoding's), and
// a head forward of one token. A step of k drafts costs verify(k) + k · head (k − 1 drafts and
// the catch-up); with each draft accepted with probability a, it yields (1 − a^(k+1)) / (1 − a)
// tokens. Prints each k's cost against a decode step, its speed-up at a = 0.6 and 0.75 (what
// llama.cpp reports for Qwen3.6's head), and the acceptance a step needs for 1.6x.
void MtpCosts(const std::string& model, int len) {
  auto comm = MakeLocalCommunicator();
  ModelOptions o;
  o.mtp = true;
  auto m = LoadCausalLM(model, o, comm.get());
  Check(m.status(), "load");
  CausalLM& lm = **m;
  SeqState st = lm.NewState();
  std::vector<int64_t> toks(len);
  for (int i = 0; i < len; ++i) toks[i] = (i * 31 + 7) % 4096;
  auto forward = [&](std::vector<int64_t> t, bool keep) {
    ForwardBatch b;
    const auto n = static_cast<int64_t>(t.size());
    b.tokens = std::move(t);
    b.slots.assign(n, -1);
    b.seqs.push_back({&st, 0, n, keep, keep});
    const double t0 = Now();
    Check(lm.Forward(b).status(), "forward");
    return Now() - t0;
  };
  forward(toks, false);
  auto median = [](std::vector<double> v) {
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
  };
  constexpr int kReps = 9;
  std::vector<double> decode, head;
  for (int r = 0; r < kReps; ++r) decode.push_back(forward({int64_t{r % 4096}}, false));
  for (int r = 0; r < kReps; ++r) {
    st.mtp_len[0] = st.len - 1;
    ForwardBatch b;
    b.tokens = {r};
    b.slots = {-1};
    b.seqs.push_back({&st, 0, 1, false});
    const double t0 = Now();
    Check(lm.ForwardMtp(b, lm.last_hidden().narrow(0, 0, 1)).status(), "head");
    head.push_back(Now() - t0);
  }
  const double dec = median(decode), hd = median(head);
  std::printf("qwen3.5 MTP costs after %d tokens, batch 1: decode step %.2f ms, head %.2f ms\n",
              len, dec * 1e3, hd * 1e3);
  for (int k = 1; k <= 4; ++k) {
    std::vector<double> v;
    for (int r = 0; r < kReps; ++r) {
      std::vector<int64_t> t(k + 1);
      for (int i = 0; i <= k; ++i) t[i] = (r * 7 + i) % 4096;
      v.push_back(forward(t, true));
      Check(lm.RollBack(st, k + 1, 1), "rollback");
    }
    const double step = median(v) + k * hd, cost = step / dec;
    auto yield = [&](double a) { return (1 - std::pow(a, k + 1)) / (1 - a); };
    double need = 1.0;  // the acceptance for 1.6x (bisection on the yield)
    for (double lo = 0, hi = 0.9999, i = 0; i < 40; ++i) {
      need = (lo + hi) / 2;
      (yield(need) >= 1.6 * cost ? hi : lo) = need;
    }
    std::printf(
        "  k=%d: verify %.2f ms, step %.2f ms = %.2f decode steps; speed-up at a=0.6 "
        "%.2f, a=0.75 %.2f; 1.6x needs a >= %s\n",
        k, median(v) * 1e3, step * 1e3, cost, yield(0.6) / cost, yield(0.75) / cost,
        yield(0.9999) >= 1.6 * cost ? absl::StrFormat("%.2f", need).c_str() : "(never)");
  }
}

// Expert memory per rank at TP=2, plain TP against expert parallelism, on the medium model:
// the base expert weights (the loader's shards) and one 2D and one 3D adapter's LoRA as the slots
// hold it (SlotBytes), for rank 0 (the model is loaded with rank 0's options; nothing runs).
void ExpertMemory(const std::string& model, const std::string& a2d, const std::string& a3d) {
  auto comm = MakeLocalCommunicator();
  for (int mode = 0; mode < 3; ++mode) {
    const bool ep = mode == 1, fs = mode == 2;
    ModelOptions o;
    o.tp_rank = 0;
    o.tp_size = 2;
    o.expert_parallel = ep;
    o.fully_sharded_loras = fs;
    o.mixed_moe_lora_format = true;
    auto m = LoadCausalLM(model, o, comm.get());
    Check(m.status(), "load");
    auto ckpt = Checkpoint::Open(model);
    Check(ckpt.status(), "checkpoint");
    const ModelConfig& c = (*m)->config();
    auto table = FindArchTable(c.info.architecture);
    Check(table.status(), "arch");
    auto w = LoadWeights(**ckpt, **table, c, Qwen3MoeParamSpecs(c, true, true),
                         LoadOptions{0, 2, at::kFloat, true, ep});
    Check(w.status(), "weights");
    int64_t expert_bytes = 0;
    for (const auto& [name, t] : w->params) {
      if (absl::StrContains(name, ".experts.")) expert_bytes += t.nbytes();
    }
    AdapterReadOptions ro;
    ro.model = c.info;
    ro.convert_to_2d = true;
    int64_t lora[2] = {0, 0};
    for (int i = 0; i < 2; ++i) {
      auto a = ReadAdapter(i == 0 ? a2d : a3d, ro);
      Check(a.status(), "adapter");
      // Expert LoRA only: drop the dense modules.
      a->dense.clear();
      lora[i] = (*m)->SlotBytes(*a);
    }
    std::printf(
        "expert memory per rank, TP=2 %-18s base experts %8.1f MB   expert LoRA: 2D %6.2f MB, 3D "
        "(converted) %6.2f MB   slots allocated (--max-loras %d, rank %d): experts %7.1f MB, "
        "dense %6.1f MB\n",
        ep   ? "expert-parallel:"
        : fs ? "fully sharded:"
             : "plain TP:",
        expert_bytes / 1e6, lora[0] / 1e6, lora[1] / 1e6, o.max_loras, o.max_lora_rank,
        (*m)->AllocatedSlotBytes(true) / 1e6, (*m)->AllocatedSlotBytes(false) / 1e6);
  }
}

// A swap-in from the worker's host cache (--max-cpu-loras) against a memcpy of the bytes the
// cache holds for the adapter, both best of `repeat` in this run (goal: <= 2x). The first stage
// (read + validate + convert + copy from disk) is printed beside them.
double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void SwapIn(const std::string& model, const std::string& a2d, const std::string& a3d, int repeat,
            const std::string& device, const std::string& dtype) {
  auto comm = MakeLocalCommunicator();
  EngineOptions o;
  o.model_dir = model;
  o.device = device;
  o.dtype = dtype;
  o.max_loras = 1;
  o.max_cpu_loras = 2;
  o.max_lora_rank = 16;
  o.enable_mixed_moe_lora_format = true;
  auto engine = Engine::Create(o, comm.get());
  Check(engine.status(), "engine");
  Engine& e = **engine;
  const std::vector<std::pair<const char*, std::string>> cases = {{"2D", a2d},
                                                                  {"3D (converted)", a3d}};
  for (size_t k = 0; k < cases.size(); ++k) {
    const int64_t id = static_cast<int64_t>(k) + 1;
    // Twice from disk (the second with the file in the page cache); the second one's phases
    // are printed.
    double disk = 0;
    std::string phases;
    for (int r = 0; r < 2; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      auto st = e.StageAdapter(id, cases[k].second, std::nullopt);
      disk = Since(t0);
      Check(st.status(), "stage");
      phases.clear();
      for (const auto& [phase, s] : st->phase_seconds) {
        phases += absl::StrFormat(" %s %.1f", phase, s * 1e3);
      }
      Check(e.CommitAdapter(id).status(), "commit");
      if (r == 0) Check(e.UnloadAdapter(id, false).status(), "unload");
    }
    auto cache = e.UnloadAdapter(id, true);
    Check(cache.status(), "unload");
    const int64_t bytes = cache->bytes;  // the only entry: the previous case left the cache
    double best = 1e30;
    for (int r = 0; r < repeat; ++r) {
      const auto t1 = std::chrono::steady_clock::now();
      auto st = e.StageAdapter(id, cases[k].second, std::nullopt);
      best = std::min(best, Since(t1));
      Check(st.status(), "swap in");
      if (!st->from_host_cache) Check(absl::InternalError("not from the host cache"), "swap in");
      Check(e.CommitAdapter(id).status(), "commit");
      Check(e.UnloadAdapter(id, true).status(), "unload");
    }
    // Out of the cache (an unload by the user), so the next case's bytes are its own.
    Check(e.StageAdapter(id, cases[k].second, std::nullopt).status(), "stage");
    Check(e.CommitAdapter(id).status(), "commit");
    Check(e.UnloadAdapter(id, false).status(), "unload");
    std::vector<char> src(static_cast<size_t>(bytes), 1), dst(static_cast<size_t>(bytes), 0);
    double copy = 1e30;
    for (int r = 0; r < repeat; ++r) {
      const auto t1 = std::chrono::steady_clock::now();
      std::memcpy(dst.data(), src.data(), src.size());
      copy = std::min(copy, Since(t1));
    }
    std::printf(
        "swap-in %-15s slot bytes %7.2f MB: from disk %8.2f ms, from the host cache %7.3f ms, "
        "memcpy %7.3f ms: ratio %.2f (goal <= 2)\n  from disk (ms):%s\n",
        cases[k].first, bytes / 1e6, disk * 1e3, best * 1e3, copy * 1e3, best / copy,
        phases.c_str());
  }
}

// Slot memory follows the adapter's rank, not --max-lora-rank: the bytes of slots in memory
// (mincore) after a rank-16 2D and 3D adapter were loaded into engines at --max-lora-rank 16 and
// 64 (a slot's capacity four times as large).
void SlotMemory(const std::string& model, const std::string& a2d, const std::string& a3d) {
  auto comm = MakeLocalCommunicator();
  double at16 = 0;
  for (int R : {16, 64}) {
    EngineOptions o;
    o.model_dir = model;
    o.max_loras = 2;
    o.max_lora_rank = R;
    o.enable_mixed_moe_lora_format = true;
    auto engine = Engine::Create(o, comm.get());
    Check(engine.status(), "engine");
    Engine& e = **engine;
    Check(e.StageAdapter(1, a2d, std::nullopt).status(), "stage");
    Check(e.CommitAdapter(1).status(), "commit");
    Check(e.StageAdapter(2, a3d, std::nullopt).status(), "stage");
    Check(e.CommitAdapter(2).status(), "commit");
    const double mb = static_cast<double>(e.SlotResidentBytes()) / 1e6;
    if (R == 16) at16 = mb;
    std::printf(
        "slot memory, rank-16 2D + 3D adapters, --max-lora-rank %2d: %7.2f MB (%.2fx "
        "the figure at 16)\n",
        R, mb, mb / std::max(at16, 1e-9));
  }
}

struct Case {
  const char* name;
  std::vector<int64_t> adapter_of_seq;
};

// Mean seconds of one decode step for `batch` sequences (best of `repeat`); *prefill: the best
// time of the step that prefills their 16-token prompts.
// ab (optional): the decode steps alternate row streams on (even steps, ab[0]) and off (odd,
// ab[1]), as side(0) and side(1) set them (AbSide below); side(-1) restores the defaults after;
// each step's seconds appended.
double TimeDecode(Engine& e, const std::vector<int64_t>& adapters, int steps, int repeat, int vocab,
                  int64_t* next_id, double* prefill = nullptr,
                  std::vector<double> (*ab)[2] = nullptr,
                  const std::function<void(int)>& side = {}) {
  double best = 1e30, best_prefill = 1e30;
  for (int rep = 0; rep < repeat; ++rep) {
    std::vector<NewSequence> add;
    std::vector<int64_t> ids;
    for (size_t i = 0; i < adapters.size(); ++i) {
      NewSequence n;
      n.id = (*next_id)++;
      n.adapter_id = adapters[i];
      for (int t = 0; t < 16; ++t)
        n.prompt.push_back(static_cast<int32_t>((i * 31 + t * 7) % vocab));
      n.max_tokens = steps + 8;
      add.push_back(n);
      ids.push_back(n.id);
    }
    const double tp = Now();
    Check(e.Step(add, {}).status(), "prefill");
    best_prefill = std::min(best_prefill, Now() - tp);
    for (int w = 0; w < 2; ++w) Check(e.Step({}, {}).status(), "warmup");
    const double t0 = Now();
    for (int s = 0; s < steps; ++s) {
      if (ab != nullptr) side(s % 2);
      const double ts = Now();
      Check(e.Step({}, {}).status(), "decode");
      if (ab != nullptr) (*ab)[s % 2].push_back(Now() - ts);
    }
    if (ab != nullptr) side(-1);
    best = std::min(best, (Now() - t0) / steps);
    Check(e.Step({}, ids).status(), "remove");
  }
  if (prefill != nullptr) *prefill = best_prefill;
  return best;
}

struct RunFlags {
  std::vector<int> batches{32};
  int steps = 20, repeat = 3;
  std::string device = "cpu", dtype = "float32";
  int prefill_len = 512;
  bool ab_row_streams = false;
  int ab_rows = 0;           // --ab-row-stream-rows
  int64_t ab_prefetch = -1;  // --ab-row-stream-prefetch
  int64_t ab_far = -1;       // --ab-row-stream-far-prefetch
  bool ab_nta = false;       // --ab-row-stream-nta
};

// How many --ab-* flags were given (one at most).
int AbFlags(const RunFlags& f) {
  return f.ab_row_streams + (f.ab_rows > 0) + (f.ab_prefetch >= 0) + (f.ab_far >= 0) + f.ab_nta;
}

// For the --ab-* flag given: side(0) sets what the even steps run, side(1) the odd ones, side(-1)
// the default again.
std::function<void(int)> AbSide(const RunFlags& f) {
  if (f.ab_nta)
    return [](int side) { SetSkinnyRowStreamNonTemporal(side == 0 ? 1 : side == 1 ? 0 : -1); };
  if (f.ab_prefetch >= 0) {
    return [b = f.ab_prefetch](int side) { SetSkinnyRowStreamPrefetchBytes(side == 1 ? b : -1); };
  }
  if (f.ab_far >= 0) {
    return [b = f.ab_far](int side) { SetSkinnyRowStreamFarPrefetchBytes(side == 1 ? b : -1); };
  }
  if (f.ab_rows > 0) {
    return [r = f.ab_rows](int side) { SetSkinnyRowStreamRows(side == 1 ? r : 0); };
  }
  return [](int side) { SetSkinnyRowStreams(side != 1); };
}

double Median(std::vector<double> v) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

void Run(const std::string& label, const std::string& model,
         const std::vector<std::string>& adapters_2d, const std::vector<std::string>& adapters_3d,
         const RunFlags& f, int rank) {
  const int batch = *std::max_element(f.batches.begin(), f.batches.end());
  const int steps = f.steps, repeat = f.repeat;
  auto comm = MakeLocalCommunicator();
  EngineOptions o;
  o.model_dir = model;
  o.device = f.device;
  o.dtype = f.dtype;
  o.max_loras = 8;
  o.max_lora_rank = rank;
  o.enable_mixed_moe_lora_format = true;
  o.max_num_seqs = batch;
  auto engine = Engine::Create(o, comm.get());
  Check(engine.status(), "engine");
  // Ids 1..8: 2D and 3D alternating.
  for (int i = 0; i < 8; ++i) {
    const std::string& p = i % 2 == 0 ? adapters_2d[(i / 2) % adapters_2d.size()]
                                      : adapters_3d[(i / 2) % adapters_3d.size()];
    auto s = (*engine)->StageAdapter(i + 1, p, std::nullopt);
    Check(s.status(), "stage");
    Check((*engine)->CommitAdapter(i + 1).status(), "commit");
  }
  const int vocab = (*engine)->Info().vocab_size;
  int64_t next_id = 1;
  for (int b_size : f.batches) {
    std::vector<int64_t> none(b_size, 0), one(b_size, 1), eight(b_size);
    for (int i = 0; i < b_size; ++i) eight[i] = 1 + i % 8;
    double prefill = 0;
    std::vector<double> ab[2];
    const double a = TimeDecode(**engine, none, steps, repeat, vocab, &next_id, &prefill,
                                AbFlags(f) > 0 ? &ab : nullptr, AbSide(f));
    const double b = TimeDecode(**engine, one, steps, repeat, vocab, &next_id);
    const double c = TimeDecode(**engine, eight, steps, repeat, vocab, &next_id);
    std::printf(
        "%-7s %s %s threads %d batch %3d  (a) no adapter %8.3f ms %9.1f tok/s  (b) one adapter "
        "%8.3f ms  (c) 8 adapters 2D+3D %8.3f ms %9.1f tok/s   (b)/(a) = %.3f   (c)/(b) = %.3f  "
        "[goal <= 1.15]   (c)/(a) = %.3f   prefill (a) %d x 16 tokens %.1f ms %.0f tok/s\n",
        label.c_str(), f.device.c_str(), f.dtype.c_str(), at::get_num_threads(), b_size, a * 1e3,
        b_size / a, b * 1e3, c * 1e3, b_size / c, b / a, c / b, c / a, b_size, prefill * 1e3,
        b_size * 16 / prefill);
    // Each even step over the odd step after it.
    std::vector<double> ratios;
    for (size_t i = 0; i < ab[0].size() && i < ab[1].size(); ++i) {
      ratios.push_back(ab[0][i] / ab[1][i]);
    }
    if (f.ab_nta) {
      std::printf(
          "%-7s batch %3d  (a) steps alternating: row streams prefetching non-temporal "
          "%.3f ms, with the L1 / L2 hints %.3f ms (medians), median ratio of neighbouring steps "
          "%.3f (%zu pairs)\n",
          label.c_str(), b_size, Median(ab[0]) * 1e3, Median(ab[1]) * 1e3, Median(ratios),
          ratios.size());
    } else if (f.ab_prefetch >= 0 || f.ab_far >= 0) {
      const bool far = f.ab_prefetch < 0;
      std::printf(
          "%-7s batch %3d  (a) steps alternating: row streams prefetching%s the CPU's %ld bytes "
          "ahead %.3f ms, %ld bytes %.3f ms (medians), median ratio of neighbouring steps %.3f "
          "(%zu pairs)\n",
          label.c_str(), b_size, far ? " (the far prefetch, f32 at 5-8 x rows)" : "",
          static_cast<long>(far ? SkinnyRowStreamFarPrefetchBytes()
                                : SkinnyRowStreamPrefetchBytes(f.dtype == "bfloat16"
                                                                   ? SkinnyWeight::kBF16
                                                                   : SkinnyWeight::kF32)),
          Median(ab[0]) * 1e3, static_cast<long>(far ? f.ab_far : f.ab_prefetch),
          Median(ab[1]) * 1e3, Median(ratios), ratios.size());
    } else if (f.ab_rows > 0) {
      std::printf(
          "%-7s batch %3d  (a) steps alternating: row streams up to the CPU's %d x rows %.3f ms, "
          "up to %d x rows %.3f ms (medians), median ratio of neighbouring steps %.3f (%zu "
          "pairs)\n",
          label.c_str(), b_size, SkinnyRowStreamRows(), Median(ab[0]) * 1e3, f.ab_rows,
          Median(ab[1]) * 1e3, Median(ratios), ratios.size());
    } else if (f.ab_row_streams) {
      std::printf(
          "%-7s batch %3d  (a) steps alternating: row streams %.3f ms, tiles %.3f ms (medians), "
          "median ratio of neighbouring steps %.3f (%zu pairs)\n",
          label.c_str(), b_size, Median(ab[0]) * 1e3, Median(ab[1]) * 1e3, Median(ratios),
          ratios.size());
    }
  }
}

// What speculative decoding gives through the engine (mtp-speed): the model and trained head
// of `tools/mtp_reference.py medium` (`dir`), greedy decoding of `tokens` tokens for batches of
// 1 and 8 of the prompts the head was trained on (prompts.json), with num_speculative_tokens
// k = 1..4 against the same engine options without (k = 0), the two engines loaded side by side
// and their runs alternated `repeat` times; decode tokens/s (after the prefill step) medians and
// their ratio, the acceptance and tokens per verify step. Then the best k's acceptance per
// adapter at batch 8 (base, a 2D and a 3D adapter, on held-out prompts too).
struct SpecRun {
  double seconds = 0;  // decode steps only
  int64_t tokens = 0, drafted = 0, accepted = 0, verify_steps = 0;
  std::map<int64_t, std::pair<int64_t, int64_t>> by_adapter;  // drafted, kept
};

SpecRun RunGreedy(Engine& e, const std::vector<std::vector<int32_t>>& prompts,
                  const std::vector<int64_t>& adapters, int tokens, int64_t first_id) {
  std::vector<NewSequence> add;
  std::map<int64_t, int64_t> adapter_of;
  for (size_t i = 0; i < prompts.size(); ++i) {
    NewSequence n;
    n.id = first_id + static_cast<int64_t>(i);
    n.adapter_id = adapters[i % adapters.size()];
    n.prompt = prompts[i];
    n.max_tokens = tokens;
    adapter_of[n.id] = n.adapter_id;
    add.push_back(n);
  }
  SpecRun r;
  auto first = e.Step(add, {});
  Check(first.status(), "prefill");
  const double t0 = Now();
  while (e.Info().running > 0) {
    auto out = e.Step({}, {});
    Check(out.status(), "step");
    for (const TokenOut& t : out->tokens) {
      ++r.tokens;
      if (t.drafted > 0) {
        ++r.verify_steps;
        r.drafted += t.drafted;
        r.accepted += t.accepted;
        auto& a = r.by_adapter[adapter_of[t.sequence_id]];
        a.first += t.drafted;
        a.second += t.accepted;
      }
    }
  }
  r.seconds = Now() - t0;
  return r;
}

void MtpSpeed(const std::string& dir, int tokens, int repeat) {
  std::ifstream pf(dir + "/prompts.json");
  if (!pf) {
    std::fprintf(stderr,
                 "decode_step: no %s/prompts.json (make it: .cache/peer-venv/bin/python "
                 "tools/mtp_reference.py medium --out %s)\n",
                 dir.c_str(), dir.c_str());
    std::exit(2);
  }
  const nlohmann::json pj = nlohmann::json::parse(pf);
  auto prompts_of = [&](const char* set) {
    std::vector<std::vector<int32_t>> v;
    for (const auto& p : pj.at(set)) v.push_back(p.get<std::vector<int32_t>>());
    return v;
  };
  const auto trained = prompts_of("trained"), held_out = prompts_of("held_out");
  Q35Dims d;
  {
    std::ifstream cf(dir + "/model/config.json");
    d.layers = nlohmann::json::parse(cf).at("num_hidden_layers").get<int64_t>();
  }
  const std::string a2d = WriteQwen35Adapter(dir + "/a2d", d, false, 30);
  const std::string a3d = WriteQwen35Adapter(dir + "/a3d", d, true, 40);
  auto comm0 = MakeLocalCommunicator(), comm1 = MakeLocalCommunicator();
  auto make = [&](int k, Communicator* comm) {
    EngineOptions o;
    o.model_dir = dir + "/model";
    o.num_speculative_tokens = k;
    o.enable_mixed_moe_lora_format = true;
    o.max_num_seqs = 16;
    o.max_num_batched_tokens = 64;
    o.kv_cache_memory_bytes = int64_t{256} << 20;
    auto e = Engine::Create(o, comm);
    Check(e.status(), "engine");
    return std::move(*e);
  };
  std::unique_ptr<Engine> plain = make(0, comm0.get());
  std::printf(
      "mtp-speed: %s (%ld layers), greedy, %d tokens per sequence, prompts the head was "
      "trained on; decode tokens/s medians of %d alternated runs\n",
      dir.c_str(), static_cast<long>(d.layers), tokens, repeat);
  int64_t id = 1;
  std::map<int, std::pair<double, int>> best;  // batch -> (ratio, k)
  for (int k = 1; k <= 4; ++k) {
    std::unique_ptr<Engine> spec = make(k, comm1.get());
    for (int batch : {1, 8}) {
      std::vector<std::vector<int32_t>> prompts(trained.begin(), trained.begin() + batch);
      std::vector<double> off, on;
      SpecRun last;
      for (int r = 0; r < repeat; ++r) {
        const SpecRun a = RunGreedy(*plain, prompts, {0}, tokens, id);
        id += batch;
        last = RunGreedy(*spec, prompts, {0}, tokens, id);
        id += batch;
        off.push_back(static_cast<double>(a.tokens) / a.seconds);
        on.push_back(static_cast<double>(last.tokens) / last.seconds);
      }
      const double ratio = Median(on) / Median(off);
      if (ratio > best[batch].first) best[batch] = {ratio, k};
      std::printf(
          "  k=%d batch %d: %.1f tokens/s without, %.1f with: %.2fx; acceptance %.2f, %.2f "
          "tokens per verify step\n",
          k, batch, Median(off), Median(on), ratio,
          static_cast<double>(last.accepted) / std::max<int64_t>(1, last.drafted),
          1.0 + static_cast<double>(last.accepted) / std::max<int64_t>(1, last.verify_steps));
    }
  }
  for (const auto& [batch, b] : best) {
    std::printf("  best at batch %d: k=%d (%.2fx)\n", batch, b.second, b.first);
  }
  // Acceptance per adapter at batch 8, the best k of batch 8, on trained and held-out prompts.
  std::unique_ptr<Engine> spec = make(best[8].second, comm1.get());
  Check(spec->StageAdapter(1, a2d, std::nullopt).status(), "stage a2d");
  Check(spec->CommitAdapter(1).status(), "commit a2d");
  Check(spec->StageAdapter(2, a3d, std::nullopt).status(), "stage a3d");
  Check(spec->CommitAdapter(2).status(), "commit a3d");
  const char* names[] = {"base", "2D adapter", "3D adapter"};
  for (const auto* set : {&trained, &held_out}) {
    std::vector<std::vector<int32_t>> prompts(set->begin(), set->begin() + 9);
    const SpecRun r = RunGreedy(*spec, prompts, {0, 1, 2}, tokens, id);
    id += 9;
    std::string line;
    for (const auto& [a, dk] : r.by_adapter) {
      absl::StrAppendFormat(&line, "  %s %.2f", names[a],
                            static_cast<double>(dk.second) / std::max<int64_t>(1, dk.first));
    }
    std::printf("  acceptance by adapter, k=%d, %s prompts:%s\n", best[8].second,
                set == &trained ? "trained" : "held-out", line.c_str());
  }
}

}  // namespace
// --only model --model DIR: base decode steps (no adapter) on the checkpoint at DIR, as stored
// (quantized experts stay quantized), at each batch: step time and tokens/s, and the process's
// resident memory once loaded. bench/gpt_oss_20b.sh runs it beside llama.cpp on the same
// checkpoint.
void ModelDecode(const std::string& model, const RunFlags& f) {
  auto comm = MakeLocalCommunicator();
  EngineOptions o;
  o.model_dir = model;
  o.device = f.device;
  o.dtype = f.dtype;
  o.max_loras = 1;
  o.max_num_seqs = *std::max_element(f.batches.begin(), f.batches.end());
  const double t0 = Now();
  auto engine = Engine::Create(o, comm.get());
  Check(engine.status(), "engine");
  long pages = 0, resident = 0;
  if (FILE* statm = std::fopen("/proc/self/statm", "r")) {
    if (std::fscanf(statm, "%ld %ld", &pages, &resident) != 2) resident = 0;
    std::fclose(statm);
  }
  std::printf("model %s: loaded in %.1f s, resident %.2f GB\n", model.c_str(), Now() - t0,
              static_cast<double>(resident) * 4096 / 1e9);
  const int vocab = (*engine)->Info().vocab_size;
  int64_t next_id = 1;
  for (int b : f.batches) {
    double prefill = 0;
    const double step = TimeDecode(**engine, std::vector<int64_t>(b, 0), f.steps, f.repeat, vocab,
                                   &next_id, &prefill);
    std::printf("batch %d: decode step %.1f ms, %.2f tokens/s; prefill of %d x 16 tokens %.1f ms\n",
                b, step * 1e3, b / step, b, prefill * 1e3);
  }
}

}  // namespace moelora

int main(int argc, char** argv) {
  moelora::RunFlags f;
  std::string only, mtp_dir, model_dir;
  int mtp_tokens = 24;
  const char* usage =
      "usage: decode_step [--batch B | --batches B1,B2,..] [--steps N] [--repeat K]\n"
      "                   [--only tiny|medium|swap-in|slot-memory|ep-memory|qwen3_5|mtp|mtp-speed|"
      "a3b|peer|model] [--model DIR] [--mtp-model DIR] [--mtp-tokens N] "
      "[--device "
      "cpu|cuda|cuda:N|cpu-twins] "
      "[--dtype float32|bfloat16] [--prefill N] [--ab-row-streams 1] [--ab-row-stream-rows N] "
      "[--ab-row-stream-prefetch BYTES] [--ab-row-stream-far-prefetch BYTES] "
      "[--ab-row-stream-nta 1]\n";
  if (argc == 2) {
    std::printf("%s", usage);
    return std::string(argv[1]) == "--help" ? 0 : 2;
  }
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i], v = argv[i + 1];
    if (flag == "--batch") {
      f.batches = {std::atoi(v.c_str())};
    } else if (flag == "--batches") {
      f.batches.clear();
      for (absl::string_view b : absl::StrSplit(v, ','))
        f.batches.push_back(std::atoi(std::string(b).c_str()));
    } else if (flag == "--steps") {
      f.steps = std::atoi(v.c_str());
    } else if (flag == "--repeat") {
      f.repeat = std::atoi(v.c_str());
    } else if (flag == "--only") {
      only = v;
    } else if (flag == "--model") {
      model_dir = v;
    } else if (flag == "--mtp-model") {
      mtp_dir = v;
    } else if (flag == "--mtp-tokens") {
      mtp_tokens = std::atoi(v.c_str());
    } else if (flag == "--device") {
      f.device = v;
    } else if (flag == "--dtype") {
      f.dtype = v;
    } else if (flag == "--prefill") {
      f.prefill_len = std::atoi(v.c_str());
    } else if (flag == "--ab-row-streams") {
      f.ab_row_streams = v != "0";
    } else if (flag == "--ab-row-stream-nta") {
      f.ab_nta = v != "0";
    } else if (flag == "--ab-row-stream-rows") {
      f.ab_rows = std::atoi(v.c_str());
      if (f.ab_rows < 1 || f.ab_rows > 8) {
        std::fprintf(stderr, "decode_step: --ab-row-stream-rows takes 1-8\n%s", usage);
        return 2;
      }
    } else if (flag == "--ab-row-stream-prefetch" || flag == "--ab-row-stream-far-prefetch") {
      int64_t& bytes = flag == "--ab-row-stream-prefetch" ? f.ab_prefetch : f.ab_far;
      bytes = std::atoll(v.c_str());
      if (bytes < 0 || bytes > (int64_t{1} << 20)) {
        std::fprintf(stderr, "decode_step: %s takes 0-1048576\n%s", flag.c_str(), usage);
        return 2;
      }
    } else {
      std::fprintf(stderr, "%s", usage);
      return 2;
    }
  }
  if (moelora::AbFlags(f) > 1) {
    std::fprintf(stderr, "decode_step: one --ab-* flag at a time\n%s", usage);
    return 2;
  }
  for (int b : f.batches) {
    if (b < 1) {
      std::fprintf(stderr, "decode_step: batch sizes must be >= 1\n%s", usage);
      return 2;
    }
  }
  std::printf("decode_step: mean decode-step time, best of %d x %d steps\n", f.repeat, f.steps);
  const std::string data = MOELORA_TEST_DATA_DIR;
  const std::string tmp = std::filesystem::temp_directory_path().string();
  if (only == "model") {
    if (model_dir.empty()) {
      std::fprintf(stderr, "decode_step: --only model needs --model DIR\n%s", usage);
      return 2;
    }
    moelora::ModelDecode(model_dir, f);
    return 0;
  }
  if (only.empty() || only == "tiny") {
    moelora::Run("tiny", data + "/qwen3_moe/model",
                 {data + "/qwen3_moe/adapter_2d", data + "/qwen3_moe/adapter_2d_shared_a",
                  data + "/qwen3_moe/adapter_3d_as_2d"},
                 {data + "/qwen3_moe/adapter_3d"}, f, 8);
  }
  auto synthetic = [&](const char* label, const std::string& dir, const moelora::Dims& d,
                       bool bf16) {
    if (!std::filesystem::exists(dir + "/model/model.safetensors"))
      moelora::WriteModel(dir + "/model", d, bf16);
    std::vector<std::string> a2, a3;
    for (int i = 0; i < 4; ++i) {
      a2.push_back(moelora::WriteAdapter(dir + "/a2d_" + std::to_string(i), d, false, 10 + i));
      a3.push_back(moelora::WriteAdapter(dir + "/a3d_" + std::to_string(i), d, true, 20 + i));
    }
    moelora::Run(label, dir + "/model", a2, a3, f, 16);
  };
  if (only.empty() || only == "medium") {
    synthetic("medium", tmp + "/moelora_bench_decode", {1024, 512, 32, 8, 4, 16, 4, 64, 4096},
              false);
  }
  // The medium synthetic model, written once (f32), for the swap-in and memory figures.
  const std::string dir = tmp + "/moelora_bench_decode";
  const moelora::Dims d{1024, 512, 32, 8, 4, 16, 4, 64, 4096};
  auto medium_model = [&] {
    if (!std::filesystem::exists(dir + "/model/model.safetensors"))
      moelora::WriteModel(dir + "/model", d);
  };
  if (only == "slot-memory") {
    medium_model();
    moelora::SlotMemory(dir + "/model", moelora::WriteAdapter(dir + "/a2d_0", d, false, 10),
                        moelora::WriteAdapter(dir + "/a3d_0", d, true, 20));
  }
  if (only.empty() || only == "swap-in") {
    medium_model();
    moelora::SwapIn(dir + "/model", moelora::WriteAdapter(dir + "/a2d_0", d, false, 10),
                    moelora::WriteAdapter(dir + "/a3d_0", d, true, 20), std::max(3, f.repeat),
                    f.device, f.dtype);
  }
  if (only.empty() || only == "ep-memory") {
    medium_model();
    moelora::ExpertMemory(dir + "/model", moelora::WriteAdapter(dir + "/a2d_0", d, false, 10),
                          moelora::WriteAdapter(dir + "/a3d_0", d, true, 20));
  }
  if (only.empty() || only == "qwen3_5") {
    const std::string dir = tmp + "/moelora_bench_decode_q35";
    const moelora::Q35Dims d;
    if (!std::filesystem::exists(dir + "/model/model.safetensors"))
      moelora::WriteQwen35Model(dir + "/model", d);
    std::vector<std::string> a2, a3;
    for (int i = 0; i < 4; ++i) {
      a2.push_back(
          moelora::WriteQwen35Adapter(dir + "/a2d_" + std::to_string(i), d, false, 30 + i));
      a3.push_back(moelora::WriteQwen35Adapter(dir + "/a3d_" + std::to_string(i), d, true, 40 + i));
    }
    moelora::Run("qwen3.5", dir + "/model", a2, a3, f, 16);
    if (f.device == "cpu") moelora::PrefillChunkedVsTokenByToken(dir + "/model", f.prefill_len);
  }
  if (only == "mtp-speed") {
    moelora::MtpSpeed(
        mtp_dir.empty() ? std::filesystem::current_path().string() + "/.cache/mtp-medium" : mtp_dir,
        mtp_tokens, std::max(3, f.repeat));
  }
  if (only == "mtp") {
    const std::string dir = tmp + "/moelora_bench_decode_q35_mtp";
    if (!std::filesystem::exists(dir + "/model/model.safetensors"))
      moelora::WriteQwen35Model(dir + "/model", moelora::Q35Dims(), /*mtp=*/true);
    moelora::MtpCosts(dir + "/model", f.prefill_len);
  }
  // bench/peer's model and adapters (top-4 of 32 experts), where a bench/peer run wrote them.
  if (only == "peer") {
    const std::string pd = std::filesystem::current_path().string() + "/.cache/peer-model";
    if (!std::filesystem::exists(pd + "/model")) {
      std::fprintf(stderr, "decode_step: no %s/model (run bench/peer once)\n", pd.c_str());
      return 2;
    }
    moelora::Run("peer", pd + "/model", {pd + "/adapter_2d"}, {pd + "/adapter_3d"}, f, 16);
  }
  if (only == "a3b") {
    synthetic("a3b", tmp + "/moelora_bench_decode_a3b", {2048, 768, 128, 8, 4, 32, 4, 128, 4096},
              true);
  }
  return 0;
}
