#include "common/engine_flags.h"

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"

ABSL_FLAG(int, max_loras, 4, "LoRA slots: adapters resident in the workers at once");
ABSL_FLAG(int, max_cpu_loras, 8,
          "Adapters registered at once (>= --max-loras); the workers keep as many swapped-out "
          "adapters in host memory, converted and TP-sliced, so a swap-in reads no file");
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
ABSL_FLAG(int, max_num_seqs, 64, "Sequences in the running batch at most");
ABSL_FLAG(int, max_model_len, 0, "Prompt + generated tokens at most (0: from config.json)");
ABSL_FLAG(std::string, dtype, "float32", "Compute dtype: float32 | bfloat16");
ABSL_FLAG(std::string, device, "cpu",
          "cpu | cuda (rank r on GPU r % visible GPUs; TP over NCCL) | cuda:N (worker) | cpu-twins "
          "(the GPU code path on the CPU through the kernels' CPU twins; slow, for debugging)");
ABSL_FLAG(int, dist_timeout_s, 120, "Seconds to wait for peers and for each collective");

namespace moelora {

EngineFlags ReadEngineFlags() {
  EngineFlags f;
  f.max_loras = absl::GetFlag(FLAGS_max_loras);
  f.max_cpu_loras = absl::GetFlag(FLAGS_max_cpu_loras);
  f.max_lora_rank = absl::GetFlag(FLAGS_max_lora_rank);
  f.mixed = absl::GetFlag(FLAGS_enable_mixed_moe_lora_format);
  f.expert_parallel = absl::GetFlag(FLAGS_enable_expert_parallel);
  f.fully_sharded_loras = absl::GetFlag(FLAGS_fully_sharded_loras);
  f.max_num_seqs = absl::GetFlag(FLAGS_max_num_seqs);
  f.max_model_len = absl::GetFlag(FLAGS_max_model_len);
  f.dtype = absl::GetFlag(FLAGS_dtype);
  f.device = absl::GetFlag(FLAGS_device);
  f.dist_timeout_s = absl::GetFlag(FLAGS_dist_timeout_s);
  return f;
}

[[nodiscard]] absl::Status ValidateEngineFlags(const EngineFlags& f, int largest_rank) {
  auto bad = [](auto&&... parts) { return absl::InvalidArgumentError(absl::StrCat(parts...)); };
  if (f.max_loras < 1) return bad("--max-loras must be >= 1");
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
  return absl::OkStatus();
}

std::vector<std::string> EngineFlagArgs(const EngineFlags& f) {
  std::vector<std::string> a = {"--max-loras",     std::to_string(f.max_loras),
                                "--max-cpu-loras", std::to_string(f.max_cpu_loras),
                                "--max-lora-rank", std::to_string(f.max_lora_rank),
                                "--max-num-seqs",  std::to_string(f.max_num_seqs),
                                "--max-model-len", std::to_string(f.max_model_len),
                                "--dtype",         f.dtype};
  if (f.mixed) a.push_back("--enable-mixed-moe-lora-format");
  if (f.expert_parallel) a.push_back("--enable-expert-parallel");
  if (f.fully_sharded_loras) a.push_back("--fully-sharded-loras");
  return a;
}

}  // namespace moelora
