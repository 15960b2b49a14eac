#include "controller/request_validation.h"

#include <algorithm>
#include <chrono>

#include "absl/strings/str_cat.h"
#include "common/request_rules.h"
#include "common/status_macros.h"

namespace moelora {
namespace {

// The request's images decoded and resized, each bound to the prompt's next run of image pad
// tokens: a run of one pad grows to the image's token count, a run of exactly that many stays.
absl::Status PrepareImages(v1::GenerateRequest& req, const RequestLimits& limits,
                           ValidatedRequest* out) {
  const int n = req.images_size();  // within the caps (CheckCaps)
  const int32_t pad = limits.image_token_id;
  std::vector<std::pair<int64_t, int64_t>> runs;  // [begin, end) of each run of pads
  const auto& ids = req.prompt_token_ids();
  for (int64_t i = 0; i < ids.size(); ++i) {
    if (ids[i] != pad) continue;
    int64_t j = i;
    while (j < ids.size() && ids[j] == pad) ++j;
    runs.push_back({i, j});
    i = j - 1;
  }
  if (static_cast<int>(runs.size()) != n) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt has ", runs.size(), " image placeholders (runs of image pad token ", pad,
        ", <|image_pad|> in text) for ", n, " images"));
  }
  if (n == 0) return absl::OkStatus();
  // What the images will take, from their headers: a prompt they would make too long is refused
  // before any is decoded.
  const vision::ImageProcessorConfig& header_cfg = *limits.image_processor;
  int64_t prompt_len = ids.size();
  for (int k = 0; k < n; ++k) {
    auto tokens = vision::ImageTokensFromHeader(req.images(k), header_cfg, limits.decode_limits);
    if (!tokens.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("images[", k, "]: ", tokens.status().message()));
    }
    prompt_len += *tokens - (runs[k].second - runs[k].first);
  }
  if (limits.max_model_len > 0 && prompt_len >= limits.max_model_len) {
    return absl::InvalidArgumentError(absl::StrCat(
        "the prompt with its ", n, " images is ", prompt_len, " tokens; max_model_len ",
        limits.max_model_len, " leaves no room to generate"));
  }
  const auto t0 = std::chrono::steady_clock::now();
  const vision::ImageProcessorConfig& cfg = *limits.image_processor;
  std::vector<int32_t> expanded;
  int64_t from = 0;
  for (int k = 0; k < n; ++k) {
    auto im = vision::ProcessImage(req.images(k), cfg, limits.decode_limits);
    if (!im.ok()) {
      return absl::InvalidArgumentError(absl::StrCat("images[", k, "]: ", im.status().message()));
    }
    const int64_t tokens = im->tokens(cfg.merge_size);
    const auto [b, e] = runs[k];
    if (e - b != 1 && e - b != tokens) {
      return absl::InvalidArgumentError(absl::StrCat("images[", k, "]: its placeholder has ", e - b,
                                                     " image pad tokens; the image takes ", tokens,
                                                     " (", im->pixels.width, "x", im->pixels.height,
                                                     " pixels after resizing): give "
                                                     "one pad or exactly that many"));
    }
    expanded.insert(expanded.end(), ids.begin() + from, ids.begin() + b);
    v1::SequenceImage s;
    s.set_offset(static_cast<int64_t>(expanded.size()));
    s.set_height(im->pixels.height);
    s.set_width(im->pixels.width);
    s.set_rgb(im->pixels.rgb.data(), im->pixels.rgb.size());
    out->images.push_back(std::move(s));
    expanded.insert(expanded.end(), tokens, pad);
    from = e;
  }
  expanded.insert(expanded.end(), ids.begin() + from, ids.end());
  req.mutable_prompt_token_ids()->Assign(expanded.begin(), expanded.end());
  req.clear_images();
  out->image_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  return absl::OkStatus();
}

}  // namespace

// The caps on what a request carries: checked on the client's message before it is copied.
absl::Status CheckWireCaps(std::string_view w, const RequestCaps& caps, int max_images) {
  // Protobuf's wire format by hand: a loop over tags, each value skipped by its wire type
  // (protobuf's own parser has no count limits, which is why this runs first).
  size_t i = 0;
  auto varint = [&](uint64_t* v) {
    uint64_t r = 0;
    for (int shift = 0; i < w.size() && shift < 64; shift += 7) {
      const auto b = static_cast<uint8_t>(w[i++]);
      r |= static_cast<uint64_t>(b & 0x7f) << shift;
      if ((b & 0x80) == 0) {
        *v = r;
        return true;
      }
    }
    return false;
  };
  const auto bad = [] {
    return absl::InvalidArgumentError("the request is not a moelora.v1.GenerateRequest");
  };
  int64_t stops = 0, images = 0;
  while (i < w.size()) {
    uint64_t tag = 0, v = 0;
    if (!varint(&tag)) return bad();
    const uint64_t field = tag >> 3;
    switch (tag & 7) {
      case 0:
        if (!varint(&v)) return bad();
        break;
      case 1:
        if (w.size() - i < 8) return bad();
        i += 8;
        break;
      case 5:
        if (w.size() - i < 4) return bad();
        i += 4;
        break;
      case 2:
        if (!varint(&v) || v > w.size() - i) return bad();
        i += v;
        if (field == v1::GenerateRequest::kStopFieldNumber && ++stops > caps.max_stop_strings) {
          return absl::InvalidArgumentError(absl::StrCat("stop: at most ", caps.max_stop_strings,
                                                         " stop strings (--max-stop-strings)"));
        }
        if (field == v1::GenerateRequest::kImagesFieldNumber && ++images > max_images) {
          return absl::InvalidArgumentError(
              absl::StrCat("images: at most ", max_images, " per prompt (--limit-mm-per-prompt)"));
        }
        break;
      default:  // groups: not in this message
        return bad();
    }
  }
  return absl::OkStatus();
}

static absl::Status CheckCaps(const v1::GenerateRequest& req, const RequestLimits& limits) {
  const RequestCaps& c = limits.caps;
  if (req.prompt().size() > c.max_prompt_bytes) {
    return absl::InvalidArgumentError(absl::StrCat("prompt is ", req.prompt().size(),
                                                   " bytes; at most ", c.max_prompt_bytes,
                                                   " (--max-prompt-bytes)"));
  }
  if (req.stop_size() > c.max_stop_strings) {
    return absl::InvalidArgumentError(absl::StrCat("stop: at most ", c.max_stop_strings,
                                                   " stop strings (--max-stop-strings), not ",
                                                   req.stop_size()));
  }
  for (int i = 0; i < req.stop_size(); ++i) {
    if (req.stop(i).empty() || req.stop(i).size() > c.max_stop_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("stop[", i, "] must be 1..", c.max_stop_bytes,
                                                     " bytes (--max-stop-bytes), not ",
                                                     req.stop(i).size()));
    }
  }
  if (req.stop_token_ids_size() > c.max_stop_token_ids) {
    return absl::InvalidArgumentError(absl::StrCat("stop_token_ids: at most ", c.max_stop_token_ids,
                                                   " (--max-stop-token-ids), not ",
                                                   req.stop_token_ids_size()));
  }
  if (req.prompt_token_ids_size() > 0 && limits.max_model_len > 0 &&
      req.prompt_token_ids_size() >= limits.max_model_len &&
      (req.images_size() == 0 || limits.image_processor == nullptr)) {
    return absl::InvalidArgumentError(absl::StrCat(
        "prompt_token_ids holds ", req.prompt_token_ids_size(), " tokens; max_model_len ",
        limits.max_model_len, " leaves no room to generate"));
  }
  if (req.images_size() > 0 && limits.image_processor == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat("images: ", limits.no_images_reason));
  }
  if (req.images_size() > limits.max_images) {
    return absl::InvalidArgumentError(absl::StrCat(req.images_size(), " images: at most ",
                                                   limits.max_images,
                                                   " per prompt (--limit-mm-per-prompt)"));
  }
  for (int i = 0; i < req.images_size(); ++i) {
    if (req.images(i).size() > c.max_image_bytes) {
      return absl::InvalidArgumentError(absl::StrCat("images[", i, "] is ", req.images(i).size(),
                                                     " bytes; at most ", c.max_image_bytes,
                                                     " (--max-image-bytes)"));
    }
  }
  return absl::OkStatus();
}

absl::StatusOr<ValidatedRequest> ValidateGenerateRequest(const v1::GenerateRequest& request,
                                                         const RequestLimits& limits) {
  MOELORA_RETURN_IF_ERROR(CheckCaps(request, limits));
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
  if (req.images_size() > 0 || limits.image_token_id >= 0) {
    MOELORA_RETURN_IF_ERROR(PrepareImages(req, limits, &out));
  }
  if (req.stop_size() > 0) {
    if (limits.tokenizer == nullptr) {
      return absl::InvalidArgumentError(
          "stop strings need a tokenizer: this model directory has no tokenizer.json");
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
