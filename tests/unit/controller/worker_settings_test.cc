// CheckWorkerSettings: every setting the controller and its workers must share, one at a time.
#include "controller/worker_settings.h"

#include <functional>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moelora {
namespace {

using ::testing::HasSubstr;

WorkerSettings Mine() {
  WorkerSettings s;
  s.flags.max_loras = 4;
  s.flags.max_lora_rank = 16;
  s.flags.max_num_seqs = 64;
  s.flags.dtype = "bfloat16";
  s.flags.enable_mixed_moe_lora_format = true;
  s.model = "/models/a";
  s.config_fingerprint = "fnv1a64:0000000000000001";
  return s;
}

std::vector<v1::WorkerInfoResponse> Agreeing(int n) {
  std::vector<v1::WorkerInfoResponse> ranks(n);
  for (int r = 0; r < n; ++r) {
    v1::WorkerInfoResponse& w = ranks[r];
    w.set_rank(r);
    w.set_world_size(n);
    w.set_max_loras(4);
    w.set_max_lora_rank(16);
    w.set_max_num_seqs(256);
    w.set_max_model_len(4096);
    w.set_dtype("bfloat16");
    w.set_mixed_moe_lora_format(true);
    w.set_model("/mnt/elsewhere/a");  // another mount of the same model
    w.set_config_fingerprint("fnv1a64:0000000000000001");
    w.set_block_size(16);
    w.set_max_num_batched_tokens(512);
    w.set_num_blocks(1000);
    w.set_prefix_caching(true);
    w.set_prefill_tokens_beside_decodes(16);
  }
  return ranks;
}

TEST(WorkerSettingsTest, AgreeingWorkersPassAndEachDisagreementIsNamed) {
  EXPECT_TRUE(CheckWorkerSettings(Mine(), Agreeing(2)).ok());
  struct Case {
    std::function<void(v1::WorkerInfoResponse&)> edit;
    std::string message;
  };
  const std::vector<Case> cases = {
      {[](auto& w) { w.set_max_loras(2); }, "--max-loras 2, the controller with 4"},
      {[](auto& w) { w.set_max_lora_rank(64); }, "--max-lora-rank 64, the controller with 16"},
      {[](auto& w) { w.set_dtype("float32"); }, "--dtype float32, the controller with bfloat16"},
      {[](auto& w) { w.set_mixed_moe_lora_format(false); },
       "--enable-mixed-moe-lora-format off, the controller with on"},
      {[](auto& w) { w.set_expert_parallel(true); }, "--enable-expert-parallel on"},
      {[](auto& w) { w.set_fully_sharded_loras(true); }, "--fully-sharded-loras on"},
      {[](auto& w) { w.set_max_num_seqs(32); }, "--max-num-seqs 32"},
      {[](auto& w) { w.set_config_fingerprint("fnv1a64:0000000000000002"); },
       "both must be the same model"},
      {[](auto& w) { w.set_rank(0); }, "list the 2 ranks in rank order"},
      {[](auto& w) { w.set_block_size(32); }, "--block-size 32, the controller with 16"},
      {[](auto& w) { w.set_max_num_batched_tokens(256); },
       "--max-num-batched-tokens 256, the controller with 512"},
      {[](auto& w) { w.set_num_blocks(999); },
       "rank 1 has 999 KV cache blocks, rank 0 1000: start every rank with the same "
       "--kv-cache-memory-bytes"},
      {[](auto& w) { w.set_prefix_caching(false); }, "--enable-prefix-caching"},
      {[](auto& w) { w.set_prefill_tokens_beside_decodes(0); },
       "--prefill-tokens-beside-decodes 0, the controller with 16"},
      {[](auto& w) { w.set_num_speculative_tokens(3); },
       "--speculative-config num_speculative_tokens 3, the controller with 0"},
  };
  for (const Case& c : cases) {
    auto ranks = Agreeing(2);
    c.edit(ranks[1]);
    const absl::Status s = CheckWorkerSettings(Mine(), ranks);
    EXPECT_EQ(s.code(), absl::StatusCode::kFailedPrecondition) << c.message;
    EXPECT_THAT(std::string(s.message()), HasSubstr(c.message));
    EXPECT_THAT(std::string(s.message()), HasSubstr("rank"));
  }
  // --max-model-len is checked only when the controller sets it.
  WorkerSettings with_len = Mine();
  with_len.flags.max_model_len = 2048;
  EXPECT_THAT(std::string(CheckWorkerSettings(with_len, Agreeing(1)).message()),
              HasSubstr("--max-model-len 4096, the controller with 2048"));
}

}  // namespace
}  // namespace moelora
