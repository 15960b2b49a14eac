#include "controller/worker_settings.h"

#include "absl/strings/str_cat.h"
#include "schema/model_info.h"

namespace moelora {

WorkerSettings WorkerSettingsFromFlags(const EngineFlags& flags, const std::string& model) {
  WorkerSettings s;
  s.flags = flags;
  s.model = model;
  auto fp = ConfigFingerprint(model);
  if (fp.ok()) s.config_fingerprint = *fp;
  return s;
}

[[nodiscard]] absl::Status CheckWorkerSettings(const WorkerSettings& mine,
                                               const std::vector<v1::WorkerInfoResponse>& ranks) {
  const EngineFlags& f = mine.flags;
  for (size_t r = 0; r < ranks.size(); ++r) {
    const v1::WorkerInfoResponse& w = ranks[r];
    auto differ = [&](const char* flag, const auto& ours, const auto& theirs) {
      return absl::FailedPreconditionError(
          absl::StrCat("worker rank ", r, " (--model ", w.model(), ") runs with ", flag, " ",
                       theirs, ", the controller with ", ours,
                       ": start both with the same value (the controller does not serve until "
                       "they agree)"));
    };
    auto flag_value = [](bool on) { return on ? "on" : "off"; };
    if (w.rank() != static_cast<int>(r) || w.world_size() != static_cast<int>(ranks.size())) {
      return absl::FailedPreconditionError(
          absl::StrCat("the worker at position ", r, " of --workers is rank ", w.rank(), " of ",
                       w.world_size(), "; list the ", ranks.size(), " ranks in rank order"));
    }
    if (!mine.config_fingerprint.empty() && w.config_fingerprint() != mine.config_fingerprint) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker rank ", r, " serves --model ", w.model(), " whose config.json (",
          w.config_fingerprint(), ") differs from the controller's --model ", mine.model, " (",
          mine.config_fingerprint, "): both must be the same model"));
    }
    if (w.dtype() != f.dtype) return differ("--dtype", f.dtype, w.dtype());
    if (w.max_loras() != f.max_loras) return differ("--max-loras", f.max_loras, w.max_loras());
    if (w.max_lora_rank() != f.max_lora_rank) {
      return differ("--max-lora-rank", f.max_lora_rank, w.max_lora_rank());
    }
    if (w.mixed_moe_lora_format() != f.enable_mixed_moe_lora_format) {
      return differ("--enable-mixed-moe-lora-format", flag_value(f.enable_mixed_moe_lora_format),
                    flag_value(w.mixed_moe_lora_format()));
    }
    if (w.expert_parallel() != f.enable_expert_parallel) {
      return differ("--enable-expert-parallel", flag_value(f.enable_expert_parallel),
                    flag_value(w.expert_parallel()));
    }
    if (w.fully_sharded_loras() != f.fully_sharded_loras) {
      return differ("--fully-sharded-loras", flag_value(f.fully_sharded_loras),
                    flag_value(w.fully_sharded_loras()));
    }
    if (w.tower_connector_lora() != f.enable_tower_connector_lora) {
      return differ("--enable-tower-connector-lora", flag_value(f.enable_tower_connector_lora),
                    flag_value(w.tower_connector_lora()));
    }
    if (w.max_num_seqs() < f.max_num_seqs) {
      return differ("--max-num-seqs", absl::StrCat(f.max_num_seqs, " (at most the workers')"),
                    w.max_num_seqs());
    }
    if (f.max_model_len > 0 && w.max_model_len() != f.max_model_len) {
      return differ("--max-model-len", f.max_model_len, w.max_model_len());
    }
    if (w.block_size() != f.block_size) return differ("--block-size", f.block_size, w.block_size());
    if (w.max_num_batched_tokens() != f.max_num_batched_tokens) {
      return differ("--max-num-batched-tokens", f.max_num_batched_tokens,
                    w.max_num_batched_tokens());
    }
    if (w.prefill_tokens_beside_decodes() != f.prefill_tokens_beside_decodes) {
      return differ("--prefill-tokens-beside-decodes", f.prefill_tokens_beside_decodes,
                    w.prefill_tokens_beside_decodes());
    }
    if (w.num_speculative_tokens() != f.num_speculative_tokens) {
      return differ("--speculative-config num_speculative_tokens", f.num_speculative_tokens,
                    w.num_speculative_tokens());
    }
    if (w.prefix_caching() != ranks[0].prefix_caching()) {
      return absl::FailedPreconditionError(absl::StrCat("worker rank ", r, " has prefix caching ",
                                                        flag_value(w.prefix_caching()), ", rank 0 ",
                                                        flag_value(ranks[0].prefix_caching()),
                                                        ": start every rank with the same "
                                                        "--enable-prefix-caching"));
    }
    if (w.num_blocks() != ranks[0].num_blocks()) {
      return absl::FailedPreconditionError(absl::StrCat(
          "worker rank ", r, " has ", w.num_blocks(), " KV cache blocks, rank 0 ",
          ranks[0].num_blocks(), ": start every rank with the same --kv-cache-memory-bytes"));
    }
  }
  return absl::OkStatus();
}

}  // namespace moelora
