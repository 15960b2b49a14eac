// The engine's image inputs: a joiner's images checked against the model's vision tower, its
// multimodal RoPE positions laid out, and before each forward the tower run on the images a
// prompt chunk reaches, through an encoder cache of tower outputs (--mm-encoder-cache-bytes).
// Compute thread only (the counters may be read from any thread).
#ifndef MOELORA_WORKER_ENGINE_IMAGE_INPUTS_H_
#define MOELORA_WORKER_ENGINE_IMAGE_INPUTS_H_

#include <atomic>
#include <cstdint>
#include <list>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "vision/image_processor.h"
#include "worker/engine/sequence.h"

namespace moelora {

class ImageInputs {
 public:
  // Reads the model's preprocessor_config.json when it has a vision tower; INVALID_ARGUMENT when
  // its patch sizes disagree with the tower's.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<ImageInputs>> Create(
      CausalLM* model, const EngineOptions& options);

  // A joiner's images against the model (the controller checks the same before sending):
  // INVALID_ARGUMENT naming the image.
  [[nodiscard]] absl::Status Check(const NewSequence& n) const;
  // A checked joiner's images: their pixels and encoder cache keys, and the prompt's multimodal
  // positions.
  void Add(RunningSequence& s) const;
  // Before a forward: the tower's output for every image a prompt chunk of `b` reaches that has
  // none yet (all of them in one tower call), and `b`'s image rows with their embeddings and
  // DeepStack features. `seqs[k]` runs `b.seqs[k]`; `head_reads_ahead`: an MTP head reads the
  // token after each chunk's end too.
  [[nodiscard]] absl::Status Prepare(ForwardBatch& b, const std::vector<RunningSequence*>& seqs,
                                     bool head_reads_ahead);
  // After a forward: drops the tower outputs of `s`'s images that end before position `past`.
  static void DropBefore(RunningSequence& s, int64_t past);

  int64_t cache_hits() const { return cache_hits_; }
  int64_t images_encoded() const { return images_encoded_; }

 private:
  ImageInputs(CausalLM* model, const EngineOptions& options) : model_(model), options_(options) {}
  bool CachedEncodingFor(const std::string& key, VisionEncoding* out);
  void CacheEncoding(const std::string& key, const VisionEncoding& e);

  CausalLM* model_;
  const EngineOptions options_;
  // Models with a vision tower: preprocessor_config.json (how pixels become pixel_values).
  std::optional<vision::ImageProcessorConfig> processor_;
  // Tower outputs kept for reuse, most recently used first.
  struct CachedEncoding {
    std::string key;
    VisionEncoding encoding;
    int64_t bytes = 0;
  };
  std::list<CachedEncoding> cache_;
  std::map<std::string, std::list<CachedEncoding>::iterator> index_;
  int64_t cache_bytes_ = 0;
  std::atomic<int64_t> cache_hits_{0}, images_encoded_{0};
};

}  // namespace moelora

#endif  // MOELORA_WORKER_ENGINE_IMAGE_INPUTS_H_
