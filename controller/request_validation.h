// Validation of a Generate request before it is queued: prompt (text encoded with the model's
// tokenizer, or token ids), stop strings, sampling values, token ranges, the model's length, and
// the model's EOS tokens added to the stop tokens. Pure: no threads, no state.
#ifndef MOELORA_CONTROLLER_REQUEST_VALIDATION_H_
#define MOELORA_CONTROLLER_REQUEST_VALIDATION_H_

#include <cstdint>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "moelora/v1/controller.pb.h"
#include "moelora/v1/worker.pb.h"
#include "tokenizer/tokenizer.h"
#include "vision/image_processor.h"

namespace moelora {

// What one request may carry, on both APIs (each a controller flag), checked before anything is
// copied, tokenized or decoded. Stop strings: the pump scans each new token's text for them, so
// their bounds keep that scan short.
struct RequestCaps {
  int max_stop_strings = 16;           // --max-stop-strings
  size_t max_stop_bytes = 256;         // --max-stop-bytes (each)
  int max_stop_token_ids = 1024;       // --max-stop-token-ids
  size_t max_prompt_bytes = 8u << 20;  // --max-prompt-bytes: a text prompt, before tokenizing
  size_t max_image_bytes = 32u << 20;  // --max-image-bytes: one encoded image
  // HTTP only: prompts × n of one call, chat messages, tools.
  int max_choices = 256;    // --max-choices
  int max_messages = 4096;  // --max-messages
  int max_tools = 512;      // --max-tools
};
inline constexpr int kMaxStopStrings = RequestCaps{}.max_stop_strings;
inline constexpr size_t kMaxStopBytes = RequestCaps{}.max_stop_bytes;

struct RequestLimits {
  int vocab_size = 0;
  int max_model_len = 0;
  // The workers' KV cache (0 blocks: not known): prompt + max_tokens must fit in it.
  int64_t kv_num_blocks = 0;
  int64_t kv_block_size = 0;
  const tok::Tokenizer* tokenizer = nullptr;  // null: text prompts and stop strings refused
  std::vector<int32_t> eos_token_ids;         // added to the stop tokens unless ignore_eos
  RequestCaps caps;
  // Images (models with a vision tower): how to prepare them (null: images are refused, with
  // `no_images_reason`), the prompt's image pad token, and how many one prompt may hold.
  const vision::ImageProcessorConfig* image_processor = nullptr;
  std::string no_images_reason = "this model takes no images";
  int32_t image_token_id = -1;
  int max_images = 0;
  vision::DecodeLimits decode_limits;
};

struct ValidatedRequest {
  v1::GenerateRequest req;      // prompt_token_ids filled (image pads expanded), prompt and
                                // images cleared, stop tokens completed
  double tokenize_seconds = 0;  // encoding a text prompt (0 for token ids)
  std::vector<v1::SequenceImage> images;  // decoded and resized, with their prompt offsets
  double image_seconds = 0;               // decoding and resizing them
};

// A serialized GenerateRequest's counts checked on the wire, before protobuf builds the message
// (each repeated string costs 2 bytes there and some 40 in memory): stop strings at most
// caps.max_stop_strings, images at most `max_images`. INVALID_ARGUMENT naming the field and its
// flag, or for bytes that are not protobuf's wire format. Linear, stops at the first excess.
[[nodiscard]] absl::Status CheckWireCaps(std::string_view wire, const RequestCaps& caps,
                                         int max_images);

// INVALID_ARGUMENT naming the field and the bound it broke (an image by its index).
[[nodiscard]] absl::StatusOr<ValidatedRequest> ValidateGenerateRequest(
    const v1::GenerateRequest& request, const RequestLimits& limits);

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_REQUEST_VALIDATION_H_
