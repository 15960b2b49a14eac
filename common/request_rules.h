// The bounds of one generation, one set of rules for the controller (the public API) and the
// worker's engine (its Step RPC): what one side accepts, the other does not refuse.
#ifndef MOELORA_COMMON_REQUEST_RULES_H_
#define MOELORA_COMMON_REQUEST_RULES_H_

#include <cstdint>

#include "absl/status/status.h"
#include "absl/types/span.h"

namespace moelora {

// The index of the first id outside [0, vocab_size), or -1.
int FirstTokenOutsideVocabulary(absl::Span<const int32_t> ids, int vocab_size);

// INVALID_ARGUMENT unless 1 <= max_tokens <= max_model_len - prompt_len.
[[nodiscard]] absl::Status CheckMaxTokens(int64_t max_tokens, int64_t prompt_len,
                                          int max_model_len);

// INVALID_ARGUMENT unless temperature >= 0, top_p in [0, 1] and top_k >= 0 (NaN refused).
[[nodiscard]] absl::Status CheckSampling(double temperature, double top_p, int top_k);

// INVALID_ARGUMENT naming the first stop token id outside the vocabulary.
[[nodiscard]] absl::Status CheckStopTokenIds(absl::Span<const int32_t> ids, int vocab_size);

// INVALID_ARGUMENT unless prompt_len + max_tokens token positions fit in the whole KV cache
// (num_blocks blocks of block_size), naming the budget: such a request could never complete, even
// alone. num_blocks 0: not known (no check).
[[nodiscard]] absl::Status CheckFitsKvCache(int64_t prompt_len, int64_t max_tokens,
                                            int64_t num_blocks, int64_t block_size);

}  // namespace moelora

#endif  // MOELORA_COMMON_REQUEST_RULES_H_
