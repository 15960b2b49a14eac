#include "controller/request_validation.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/request_rules.h"
#include "common/status_macros.h"

namespace moelora {

absl::StatusOr<ValidatedRequest> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                         const RequestLimits& limits) {
  ValidatedRequest out;
  v1::GenerateRequest& req = out.req;
  req = request;
  if (!req.prompt().empty()) {
    if (!req.prompt_token_ids().empty()) {
      return absl::InvalidArgumentError("set prompt or prompt_token_ids, not both");
    }
    if (limits.tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "this model directory has no tokenizer.json: send prompt_token_ids instead of prompt");
    }
    const auto t0 = std::chrono::steady_clock::now();
    auto ids = limits.tokenizer->Encode(req.prompt());
    out.tokenize_seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (!ids.ok())
      return absl::InvalidArgumentError(absl::StrCat("prompt: ", ids.status().message()));
    if (ids->empty()) return absl::InvalidArgumentError("prompt encodes to no tokens");
    if (static_cast<int64_t>(ids->size()) >= limits.max_model_len) {
      return absl::InvalidArgumentError(
          absl::StrCat("prompt is ", ids->size(), " tokens; max_model_len ", limits.max_model_len,
                       " leaves no room to generate"));
    }
    req.clear_prompt();
    req.mutable_prompt_token_ids()->Add(ids->begin(), ids->end());
  }
  if (req.prompt_token_ids().empty()) return absl::InvalidArgumentError("empty prompt");
  if (req.stop_size() > 0) {
    if (limits.tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "stop strings need a tokenizer: this model directory has no tokenizer.json");
    }
    if (req.stop_size() > kMaxStopStrings) {
      return absl::InvalidArgumentError(
          absl::StrCat("at most ", kMaxStopStrings, " stop strings, not ", req.stop_size()));
    }
    for (int i = 0; i < req.stop_size(); ++i) {
      if (req.stop(i).empty() || req.stop(i).size() > kMaxStopBytes) {
        return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] must be 1..", kMaxStopBytes,
                                                       " bytes, not ", req.stop(i).size()));
      }
    }
  }
  if (const int i = FirstTokenOutsideVocabulary(req.prompt_token_ids(), limits.vocab_size);
      i >= 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("prompt_token_ids[", i, "] = ", req.prompt_token_ids(i),
                     " is outside the vocabulary [0, ", limits.vocab_size, ")"));
  }
  // The rules the workers apply too (common/request_rules.h).
  MOELORA_RETURN_IF_ERROR(
      CheckMaxTokens(req.max_tokens(), req.prompt_token_ids_size(), limits.max_model_len));
  MOELORA_RETURN_IF_ERROR(CheckFitsKvCache(req.prompt_token_ids_size(), req.max_tokens(),
                                           limits.kv_num_blocks, limits.kv_block_size));
  MOELORA_RETURN_IF_ERROR(CheckSampling(req.temperature(), req.top_p(), req.top_k()));
  MOELORA_RETURN_IF_ERROR(CheckStopTokenIds(req.stop_token_ids(), limits.vocab_size));
  if (!req.ignore_eos()) {
    for (int32_t id : limits.eos_token_ids) {
      if (id >= 0 && id < limits.vocab_size &&
          std::find(req.stop_token_ids().begin(), req.stop_token_ids().end(), id) ==
              req.stop_token_ids().end()) {
        req.add_stop_token_ids(id);
      }
    }
  }
  return out;
}

}  // namespace moelora
