#include "common/engine_flags.h"

#include <climits>
#include <cstring>
#include <utility>

#include "absl/flags/flag.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "nlohmann/json.hpp"

ABSL_FLAG(int, max_loras, 0,
          "LoRA slots: adapters resident in the workers at once (0: 16 on the CPU, where a slot "
          "costs memory only while it holds an adapter; 4 on CUDA, whose slots are allocated "
          "whole)");
ABSL_FLAG(int, max_cpu_loras, 8,
          "Swapped-out adapters the workers keep in host memory, converted and TP-sliced, so "
          "that a swap-in reads no file (LRU)");
ABSL_FLAG(int, max_lora_rank, 16, "Largest LoRA rank a slot holds (larger: RESOURCE_EXHAUSTED)");
ABSL_FLAG(bool, enable_mixed_moe_lora_format, false,
          "Use the 2D expert wrapper for every MoE layer and convert 3D adapters to 2D in place at "
          "load, so 2D and 3D adapters share batches");
ABSL_FLAG(bool, enable_expert_parallel, false,
          "Each rank holds num_experts / tensor-parallel-size whole experts (and only their LoRA) "
          "instead of 1/tp of every expert");
ABSL_FLAG(bool, fully_sharded_loras, false,
          "Shard lora_A of column-parallel and lora_B of row-parallel LoRA layers too (vLLM's "
          "meaning), with one more collective per LoRA layer (CPU path)");
ABSL_FLAG(bool, enable_tower_connector_lora, false,
          "Let adapters adapt the vision tower and its mergers (attn.qkv, attn.proj, "
          "linear_fc1, linear_fc2 under model.visual.); without it such an adapter is refused");
ABSL_FLAG(int, max_num_seqs, 64, "Sequences in the running batch at most");
ABSL_FLAG(int, max_model_len, 0, "Prompt + generated tokens at most (0: from config.json)");
ABSL_FLAG(std::string, dtype, "float32", "Compute dtype: float32 | bfloat16");
ABSL_FLAG(std::string, device, "cpu",
          "cpu | cuda (rank r on GPU r % visible GPUs; TP over NCCL) | cuda:N (worker) | cpu-twins "
          "(the GPU code path on the CPU through the kernels' CPU twins; slow, for debugging)");
ABSL_FLAG(int, dist_timeout_s, 120, "Seconds to wait for peers and for each collective");
ABSL_FLAG(int, block_size, 16, "Token positions per KV cache block");
ABSL_FLAG(std::string, kv_cache_memory_bytes, "4Gi",
          "KV cache budget of each worker: bytes, or with a K/M/G (1000) or Ki/Mi/Gi (1024) "
          "suffix; the worker holds as many blocks as it buys (no more than --max-num-seqs "
          "sequences of --max-model-len tokens can fill)");
ABSL_FLAG(std::string, mm_encoder_cache_bytes, "256Mi",
          "Vision tower outputs each worker keeps for reuse (the same image under the same "
          "adapter, or any adapter without --enable-tower-connector-lora), least recently used "
          "first out; bytes as --kv-cache-memory-bytes; 0: none");
ABSL_FLAG(int, max_num_batched_tokens, 512,
          "Tokens one step computes at most: running decodes first, then chunks of prompts");
ABSL_FLAG(int, prefill_tokens_beside_decodes, 16,
          "Prompt tokens one step reads at most while other sequences decode, so their "
          "inter-token time stays near a decode step's (0: up to --max-num-batched-tokens)");
ABSL_FLAG(bool, enable_prefix_caching, true,
          "Reuse the KV blocks of a prompt prefix computed before under the same adapter (models "
          "with recurrent layers, Qwen3.5's Gated DeltaNet, never do)");
ABSL_FLAG(
    std::string, speculative_config, "",
    "Speculative decoding, vLLM's JSON: '{\"method\": \"mtp\", \"num_speculative_tokens\": "
    "k}' drafts k tokens per decode step with the checkpoint's MTP head (Qwen3.5/3.6-MoE) and "
    "verifies them in the step's forward; the output is what decoding without it gives "
    "(greedy: the same tokens; sampled: the same distribution). Empty: off");

namespace moelora {

absl::Status ParseSpeculativeConfig(const std::string& text, int* k) {
  *k = 0;
  if (text.empty()) return absl::OkStatus();
  auto bad = [&](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat("--speculative-config ", text, ": ", parts...));
  };
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return bad("not a JSON object");
  for (const auto& [key, value] : j.items()) {
    if (key != "method" && key != "num_speculative_tokens") {
      return bad("\"", key, "\" is not taken (method, num_speculative_tokens)");
    }
  }
  if (!j.contains("method") || !j["method"].is_string() || j["method"] != "mtp") {
    return bad("\"method\" must be \"mtp\" (the checkpoint's multi-token-prediction head)");
  }
  if (!j.contains("num_speculative_tokens") || !j["num_speculative_tokens"].is_number_integer() ||
      j["num_speculative_tokens"].get<int64_t>() < 1 ||
      j["num_speculative_tokens"].get<int64_t>() > 16) {
    return bad("\"num_speculative_tokens\" must be an integer in 1..16");
  }
  *k = j["num_speculative_tokens"].get<int>();
  return absl::OkStatus();
}

absl::Status ParseByteCount(const std::string& text, int64_t* bytes) {
  static const std::pair<const char*, int64_t> kSuffixes[] = {{"Ki", int64_t{1} << 10},
                                                              {"Mi", int64_t{1} << 20},
                                                              {"Gi", int64_t{1} << 30},
                                                              {"Ti", int64_t{1} << 40},
                                                              {"K", 1000},
                                                              {"M", 1000000},
                                                              {"G", 1000000000},
                                                              {"T", 1000000000000}};
  std::string digits = text;
  int64_t unit = 1;
  for (const auto& [suffix, value] : kSuffixes) {
    if (absl::EndsWith(text, suffix)) {
      digits = text.substr(0, text.size() - std::strlen(suffix));
      unit = value;
      break;
    }
  }
  int64_t n = 0;
  if (!absl::SimpleAtoi(digits, &n) || n < 0 || n > INT64_MAX / unit) {
    return absl::InvalidArgumentError(absl::StrCat(
        "\"", text,
        "\" is not a byte count (an integer, or with a K/M/G/T or Ki/Mi/Gi/Ti suffix)"));
  }
  *bytes = n * unit;
  return absl::OkStatus();
}

absl::Status ReadEngineFlags(EngineFlags* out) {
  EngineFlags& f = *out;
  f.max_loras = absl::GetFlag(FLAGS_max_loras);
  f.max_cpu_loras = absl::GetFlag(FLAGS_max_cpu_loras);
  f.max_lora_rank = absl::GetFlag(FLAGS_max_lora_rank);
  f.enable_mixed_moe_lora_format = absl::GetFlag(FLAGS_enable_mixed_moe_lora_format);
  f.enable_expert_parallel = absl::GetFlag(FLAGS_enable_expert_parallel);
  f.fully_sharded_loras = absl::GetFlag(FLAGS_fully_sharded_loras);
  f.enable_tower_connector_lora = absl::GetFlag(FLAGS_enable_tower_connector_lora);
  f.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  f.max_model_len = absl::GetFlag(FLAGS_max_model_len);
  f.dtype = absl::GetFlag(FLAGS_dtype);
  f.device = absl::GetFlag(FLAGS_device);
  if (f.max_loras == 0) f.max_loras = absl::StartsWith(f.device, "cuda") ? 4 : 16;
  f.dist_timeout_s = absl::GetFlag(FLAGS_dist_timeout_s);
  f.block_size = absl::GetFlag(FLAGS_block_size);
  f.max_num_batched_tokens = absl::GetFlag(FLAGS_max_num_batched_tokens);
  f.enable_prefix_caching = absl::GetFlag(FLAGS_enable_prefix_caching);
  f.prefill_tokens_beside_decodes = absl::GetFlag(FLAGS_prefill_tokens_beside_decodes);
  const absl::Status s =
      ParseByteCount(absl::GetFlag(FLAGS_kv_cache_memory_bytes), &f.kv_cache_memory_bytes);
  if (!s.ok())
    return absl::InvalidArgumentError(absl::StrCat("--kv-cache-memory-bytes: ", s.message()));
  MOELORA_RETURN_IF_ERROR(
      ParseSpeculativeConfig(absl::GetFlag(FLAGS_speculative_config), &f.num_speculative_tokens));
  if (absl::GetFlag(FLAGS_mm_encoder_cache_bytes) != "0") {
    const absl::Status e =
        ParseByteCount(absl::GetFlag(FLAGS_mm_encoder_cache_bytes), &f.mm_encoder_cache_bytes);
    if (!e.ok())
      return absl::InvalidArgumentError(absl::StrCat("--mm-encoder-cache-bytes: ", e.message()));
  } else {
    f.mm_encoder_cache_bytes = 0;
  }
  return absl::OkStatus();
}

[[nodiscard]] absl::Status ValidateEngineFlags(const EngineFlags& f, int largest_rank) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (f.max_loras < 1) return bad("--max-loras must be >= 1 (0: by --device)");
  if (f.max_cpu_loras < 0) return bad("--max-cpu-loras must be >= 0");
  if (f.max_lora_rank < 1 || f.max_lora_rank > largest_rank) {
    return bad("--max-lora-rank must be in 1..", largest_rank);
  }
  if (f.max_num_seqs < 1) return bad("--max-num-seqs must be >= 1");
  if (f.max_model_len < 0) return bad("--max-model-len must be >= 0 (0: from config.json)");
  if (f.dtype != "float32" && f.dtype != "bfloat16") {
    return bad("--dtype ", f.dtype, ": expected float32 or bfloat16");
  }
  if (f.dist_timeout_s < 1) return bad("--dist-timeout-s must be >= 1");
  if (f.block_size < 1 || f.block_size > 1024) return bad("--block-size must be in 1..1024");
  if (f.max_num_batched_tokens < 1) return bad("--max-num-batched-tokens must be >= 1");
  if (f.prefill_tokens_beside_decodes < 0)
    return bad("--prefill-tokens-beside-decodes must be >= 0");
  if (f.kv_cache_memory_bytes < 1) return bad("--kv-cache-memory-bytes must be > 0");
  return absl::OkStatus();
}

std::vector<std::string> EngineFlagArgs(const EngineFlags& f) {
  std::vector<std::string> a = {"--max-loras",
                                std::to_string(f.max_loras),
                                "--max-cpu-loras",
                                std::to_string(f.max_cpu_loras),
                                "--max-lora-rank",
                                std::to_string(f.max_lora_rank),
                                "--max-num-seqs",
                                std::to_string(f.max_num_seqs),
                                "--max-model-len",
                                std::to_string(f.max_model_len),
                                "--dtype",
                                f.dtype,
                                "--block-size",
                                std::to_string(f.block_size),
                                "--kv-cache-memory-bytes",
                                std::to_string(f.kv_cache_memory_bytes),
                                "--max-num-batched-tokens",
                                std::to_string(f.max_num_batched_tokens)};
  a.push_back(f.enable_prefix_caching ? "--enable-prefix-caching" : "--noenable-prefix-caching");
  a.push_back("--mm-encoder-cache-bytes");
  a.push_back(std::to_string(f.mm_encoder_cache_bytes));
  a.push_back("--prefill-tokens-beside-decodes");
  a.push_back(std::to_string(f.prefill_tokens_beside_decodes));
  if (f.enable_mixed_moe_lora_format) a.push_back("--enable-mixed-moe-lora-format");
  if (f.enable_expert_parallel) a.push_back("--enable-expert-parallel");
  if (f.fully_sharded_loras) a.push_back("--fully-sharded-loras");
  if (f.enable_tower_connector_lora) a.push_back("--enable-tower-connector-lora");
  if (f.num_speculative_tokens > 0) {
    a.push_back("--speculative-config");
    a.push_back(absl::StrCat(R"({"method": "mtp", "num_speculative_tokens": )",
                             f.num_speculative_tokens, "}"));
  }
  return a;
}

}  // namespace moelora
