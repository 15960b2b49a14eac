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

// The engine's settings as the flags give them; the worker's EngineOptions (worker/engine/engine.h)
// extends this struct with what only a worker process knows, and the model's options are derived
// from it in one place (the engine's ModelOptionsFor). Field names are the flags' names.
struct EngineFlags {
  int max_loras = 4;
  // Adapters swapped out of their slots kept in host memory (LRU), ready to be copied back
  // without reading a file; 0: none.
  int max_cpu_loras = 8;
  int max_lora_rank = 16;
  bool enable_mixed_moe_lora_format = false;
  bool enable_expert_parallel = false;       // whole experts per rank
  bool fully_sharded_loras = false;          // dense LoRA A/B sharded too
  bool enable_tower_connector_lora = false;  // LoRA on the vision tower and its mergers
  int max_num_seqs = 64;
  int max_model_len = 0;          // 0: the model's max_position_embeddings
  std::string dtype = "float32";  // float32 | bfloat16
  // cpu | cuda (device tp_rank % devices) | cuda:N | cpu-twins (the GPU code path on the CPU,
  // through the CUDA kernels' CPU twins: slow; for tests and debugging).
  std::string device = "cpu";
  int dist_timeout_s = 120;
  int block_size = 16;                               // tokens per KV cache block
  int64_t kv_cache_memory_bytes = int64_t{4} << 30;  // per worker
  // Vision tower outputs kept for reuse by later requests with the same image (and the same
  // adapter, where adapters adapt the tower), least recently used out first; 0: none.
  int64_t mm_encoder_cache_bytes = int64_t{256} << 20;
  // Tokens one step computes at most: the running decodes, then prompt chunks in admission order.
  int max_num_batched_tokens = 512;
  // Prompt tokens a step reads at most while other sequences decode (0: the whole budget).
  int prefill_tokens_beside_decodes = 16;
  // Automatic prefix caching (models without recurrent layers only; off with speculation).
  bool enable_prefix_caching = true;
  // --speculative-config, parsed: drafts per decode step of the model's MTP head, verified in
  // the step's one forward (0: off).
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
