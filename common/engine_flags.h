// The engine flags both binaries take, defined once: moelora-controller forwards them to the
// workers it spawns (EngineFlagArgs) and, in --workers mode, checks them against what each worker
// reports (controller/worker_settings.h); moelora-worker runs with them. Same names, defaults,
// help and ranges in both.
#ifndef MOELORA_COMMON_ENGINE_FLAGS_H_
#define MOELORA_COMMON_ENGINE_FLAGS_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/flags/declare.h"
#include "absl/status/status.h"

ABSL_DECLARE_FLAG(int, max_loras);
ABSL_DECLARE_FLAG(int, max_cpu_loras);
ABSL_DECLARE_FLAG(int, max_lora_rank);
ABSL_DECLARE_FLAG(bool, enable_mixed_moe_lora_format);
ABSL_DECLARE_FLAG(bool, enable_expert_parallel);
ABSL_DECLARE_FLAG(bool, fully_sharded_loras);
ABSL_DECLARE_FLAG(bool, enable_tower_connector_lora);
ABSL_DECLARE_FLAG(int, max_num_seqs);
ABSL_DECLARE_FLAG(int, max_model_len);
ABSL_DECLARE_FLAG(std::string, dtype);
ABSL_DECLARE_FLAG(std::string, device);
ABSL_DECLARE_FLAG(int, dist_timeout_s);
ABSL_DECLARE_FLAG(int, block_size);
ABSL_DECLARE_FLAG(std::string, kv_cache_memory_bytes);
ABSL_DECLARE_FLAG(std::string, mm_encoder_cache_bytes);
ABSL_DECLARE_FLAG(int, max_num_batched_tokens);
ABSL_DECLARE_FLAG(bool, enable_prefix_caching);
ABSL_DECLARE_FLAG(int, prefill_tokens_beside_decodes);
ABSL_DECLARE_FLAG(std::string, speculative_config);

namespace moelora {

struct EngineFlags {
  int max_loras = 4;
  int max_cpu_loras = 8;
  int max_lora_rank = 16;
  bool mixed = false;
  bool expert_parallel = false;
  bool fully_sharded_loras = false;
  bool tower_connector_lora = false;  // LoRA on the vision tower and its mergers
  int max_num_seqs = 64;
  int max_model_len = 0;  // 0: from config.json
  std::string dtype = "float32";
  std::string device = "cpu";
  int dist_timeout_s = 120;
  int block_size = 16;                                  // tokens per KV cache block
  int64_t kv_cache_memory_bytes = int64_t{4} << 30;     // per worker
  int64_t mm_encoder_cache_bytes = int64_t{256} << 20;  // vision tower outputs kept, per worker
  int max_num_batched_tokens = 512;                     // tokens of one step at most
  int prefill_tokens_beside_decodes = 16;               // while sequences decode
  bool prefix_caching = true;  // where the model allows it (no recurrent layers)
  // --speculative-config, parsed: drafts per decode step of the model's MTP head (0: off).
  int num_speculative_tokens = 0;
};

// vLLM's --speculative-config JSON as this server takes it: {"method": "mtp",
// "num_speculative_tokens": k} with 1 <= k <= 16 (empty text: off, 0). INVALID_ARGUMENT naming
// what is wrong (another method, a key it does not take, k out of range).
[[nodiscard]] absl::Status ParseSpeculativeConfig(const std::string& json, int* k);

// A byte count: an integer, or one with a K/M/G/T (powers of 1000) or Ki/Mi/Gi/Ti (powers of
// 1024) suffix, as vLLM's --kv-cache-memory-bytes takes it. INVALID_ARGUMENT otherwise.
[[nodiscard]] absl::Status ParseByteCount(const std::string& text, int64_t* bytes);

// The parsed flags (INVALID_ARGUMENT for a --kv-cache-memory-bytes that is no byte count).
[[nodiscard]] absl::Status ReadEngineFlags(EngineFlags* f);

// INVALID_ARGUMENT naming the first flag out of range. `largest_rank`: what the LoRA kernels take.
[[nodiscard]] absl::Status ValidateEngineFlags(const EngineFlags& f, int largest_rank);

// The flags as a worker's command line ("--max-loras", "4", ...); --device and
// --dist-timeout-s excluded (the worker group passes them).
std::vector<std::string> EngineFlagArgs(const EngineFlags& f);

}  // namespace moelora

#endif  // MOELORA_COMMON_ENGINE_FLAGS_H_
