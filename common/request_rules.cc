#include "common/request_rules.h"

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moelora {

int FirstTokenOutsideVocabulary(absl::Span<const int32_t> ids, int vocab_size) {
  for (size_t i = 0; i < ids.size(); ++i) {
    if (ids[i] < 0 || ids[i] >= vocab_size) return static_cast<int>(i);
  }
  return -1;
}

[[nodiscard]] absl::Status CheckMaxTokens(int64_t max_tokens, int64_t prompt_len,
                                          int max_model_len) {
  const int64_t room = static_cast<int64_t>(max_model_len) - prompt_len;
  if (max_tokens <= 0 || max_tokens > room) {
    return absl::InvalidArgumentError(absl::StrCat("max_tokens ", max_tokens, " must be in [1, ",
                                                   std::max<int64_t>(room, 0), "] (max_model_len ",
                                                   max_model_len, " minus the prompt)"));
  }
  return absl::OkStatus();
}

[[nodiscard]] absl::Status CheckSampling(double temperature, double top_p, int top_k) {
  if (!(temperature >= 0) || !(top_p >= 0 && top_p <= 1) || top_k < 0) {
    return absl::InvalidArgumentError("temperature must be >= 0, top_p in [0, 1], top_k >= 0");
  }
  return absl::OkStatus();
}

[[nodiscard]] absl::Status CheckStopTokenIds(absl::Span<const int32_t> ids, int vocab_size) {
  if (const int i = FirstTokenOutsideVocabulary(ids, vocab_size); i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("stop token ", ids[i], " is outside the vocabulary"));
  }
  return absl::OkStatus();
}

absl::Status CheckFitsKvCache(int64_t prompt_len, int64_t max_tokens, int64_t num_blocks,
                              int64_t block_size) {
  if (num_blocks <= 0 || prompt_len + max_tokens <= num_blocks * block_size) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("prompt (", prompt_len, " tokens) + max_tokens (", max_tokens,
                   ") exceed the KV cache: ", num_blocks, " blocks of ", block_size, " tokens (",
                   num_blocks * block_size, " tokens; raise --kv-cache-memory-bytes)"));
}

}  // namespace moelora
