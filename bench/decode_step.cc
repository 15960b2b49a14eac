// bench/decode_step: one continuous-batching decode step, measured on the same engine with
//   (a) no adapter, (b) one adapter for the whole batch, (c) 8 distinct adapters (4 2D + 4 3D,
//   mixed mode), and printed as ratios (b)/(a) and (c)/(b) from the same run (goal (c)/(b)
//   <= 1.15).
//
//   decode_step [--batch B | --batches B1,B2,..] [--steps N] [--repeat K]
//               [--only tiny|medium|a3b] [--device cpu|cuda|cuda:N|cpu-twins] [--dtype D]
//
// Models: the committed tiny fixture (H=24, E=4 top-2, 2 layers; adapters from tests/data); a
// medium synthetic Qwen3-MoE written to a temp dir (H=1024, E=32 top-8, I=512, 4 layers, 16 heads
// x 64, 4 KV heads, vocab 4096) with rank-16 adapters on q/k/v/o and the experts; and, only when
// asked for (--only a3b: gpu_check.sh runs it with --device cuda --dtype bfloat16), 4 layers of
// Qwen3-30B-A3B's shape (H=2048, E=128 top-8, I=768, 32 heads x 128, 4 KV heads; vocab 4096, not
// 151936: the LM head is not what is measured), written in bf16 (4.8 GB). For a3b the line also
// gives tokens/s and (c)/(a), the goal being <= 1.2 at batch 64.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/safetensors.h"
#include "tests/testing/adapter_builder.h"
#include "worker/comm/communicator.h"
#include "worker/engine.h"

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

struct Case {
  const char* name;
  std::vector<int64_t> adapter_of_seq;
};

// Mean seconds of one decode step for `batch` sequences (best of `repeat`).
double TimeDecode(Engine& e, const std::vector<int64_t>& adapters, int steps, int repeat, int vocab,
                  int64_t* next_id) {
  double best = 1e30;
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
    Check(e.Step(add, {}).status(), "prefill");
    for (int w = 0; w < 2; ++w) Check(e.Step({}, {}).status(), "warmup");
    const double t0 = Now();
    for (int s = 0; s < steps; ++s) Check(e.Step({}, {}).status(), "decode");
    best = std::min(best, (Now() - t0) / steps);
    Check(e.Step({}, ids).status(), "remove");
  }
  return best;
}

struct RunFlags {
  std::vector<int> batches{32};
  int steps = 20, repeat = 3;
  std::string device = "cpu", dtype = "float32";
};

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
    const double a = TimeDecode(**engine, none, steps, repeat, vocab, &next_id);
    const double b = TimeDecode(**engine, one, steps, repeat, vocab, &next_id);
    const double c = TimeDecode(**engine, eight, steps, repeat, vocab, &next_id);
    std::printf(
        "%-7s %s %s threads %d batch %3d  (a) no adapter %8.3f ms %9.1f tok/s  (b) one adapter "
        "%8.3f ms  (c) 8 adapters 2D+3D %8.3f ms %9.1f tok/s   (b)/(a) = %.3f   (c)/(b) = %.3f  "
        "[goal <= 1.15]   (c)/(a) = %.3f\n",
        label.c_str(), f.device.c_str(), f.dtype.c_str(), at::get_num_threads(), b_size, a * 1e3,
        b_size / a, b * 1e3, c * 1e3, b_size / c, b / a, c / b, c / a);
  }
}

}  // namespace
}  // namespace moelora

int main(int argc, char** argv) {
  moelora::RunFlags f;
  std::string only;
  const char* usage =
      "usage: decode_step [--batch B | --batches B1,B2,..] [--steps N] [--repeat K]\n"
      "                   [--only tiny|medium|a3b] [--device cpu|cuda|cuda:N|cpu-twins] "
      "[--dtype float32|bfloat16]\n";
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
    } else if (flag == "--device") {
      f.device = v;
    } else if (flag == "--dtype") {
      f.dtype = v;
    } else {
      std::fprintf(stderr, "%s", usage);
      return 2;
    }
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
  if (only == "a3b") {
    synthetic("a3b", tmp + "/moelora_bench_decode_a3b", {2048, 768, 128, 8, 4, 32, 4, 128, 4096},
              true);
  }
  return 0;
}
