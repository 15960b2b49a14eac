// A sequence the engine runs: the request as it joined, its KV state, its sampler, what is left
// to read of its prompt, its speculation drafts and its images. The engine's parts (the step
// planner, the speculation, the image inputs) read and move these on the compute thread.
#ifndef MOELORA_WORKER_ENGINE_SEQUENCE_H_
#define MOELORA_WORKER_ENGINE_SEQUENCE_H_

#include <ATen/ATen.h>

#include <array>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "vision/image_processor.h"
#include "worker/engine/engine.h"
#include "worker/model/causal_lm.h"
#include "worker/sampling.h"

namespace moelora {

struct RunningSequence {
  NewSequence spec;
  int32_t slot = -1;
  SeqState state;
  std::unique_ptr<Sampler> sampler;
  int32_t pending = -1;  // last sampled token, fed at the next step
  int generated = 0;
  // Tokens to compute before the next sample: the prompt, read in chunks of at most
  // --max-num-batched-tokens a step; after a preemption, the prompt and every sampled token
  // (recomputed, so the sequence goes on as if it had not stopped).
  std::vector<int32_t> feed;
  size_t fed = 0;
  bool recompute = false;
  std::vector<int32_t> history;      // the token at each position: the prompt, then sampled
  std::vector<float> prompt_logits;  // return_prompt_logits: collected over the chunks
  // Speculative decoding: the MTP head's draft of the token after `pending`, and the head's
  // output there (the hidden input of a further draft); -1 / undefined until the head has run
  // over the whole feed (again after a preemption). Sequences with images decode without.
  int64_t draft = -1;
  at::Tensor head_out;
  int32_t head_slot = -1;  // the slot when the adapter adapts the head too (else -1)
  // Chained heads (Step3.5): drafts 2 .. k, from heads 1 .. k - 1 at the same position as the
  // first; and each head's output at its last position computed from known tokens, the hidden
  // input of the next head there at the next step.
  std::vector<int64_t> more_drafts;
  std::vector<at::Tensor> chain_out;
  bool Prefilling() const { return fed < feed.size(); }
  // Images of the prompt: their tokens, patch grid, and the tower's output while the prompt
  // is being read (computed when a chunk first reaches the image, dropped once the prompt is
  // past it; a preempted sequence computes it again).
  struct Image {
    int64_t offset = 0, tokens = 0;
    vision::ProcessedImage pixels;  // the controller's resized RGB (pixel_values made per encode)
    std::string cache_key;          // the encoder cache's: the pixels' SHA-256, size, adapter
    VisionEncoding encoded;
  };
  std::vector<Image> images;
  // Multimodal RoPE with images: each prompt position's (t, h, w) rows; positions after the
  // prompt are p + rope_delta on every stream.
  std::vector<int64_t> pos3;
  int64_t rope_delta = 0;
  // Position p's three streams (text-only sequences: p on each).
  std::array<int64_t, 3> Position(int64_t p) const {
    const int64_t P = static_cast<int64_t>(spec.prompt.size());
    if (pos3.empty()) return {p, p, p};
    if (p >= P) return {p + rope_delta, p + rope_delta, p + rope_delta};
    return {pos3[p], pos3[P + p], pos3[2 * P + p]};
  }
};

}  // namespace moelora

#endif  // MOELORA_WORKER_ENGINE_SEQUENCE_H_
