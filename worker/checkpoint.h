// An HF model directory's weights: one `model.safetensors`, or the shards listed by
// `model.safetensors.index.json`, or (no index) every `*.safetensors` in the directory.
// Thread-safe after Open(): read-only.
#ifndef MOELORA_WORKER_CHECKPOINT_H_
#define MOELORA_WORKER_CHECKPOINT_H_

#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"

namespace moelora {

class Checkpoint {
 public:
  // NOT_FOUND: no directory / no weights / a shard named by the index is missing (the message
  // names it). INVALID_ARGUMENT: a malformed index or shard, a tensor in two shards, a tensor the
  // index places in a shard that lacks it. Pickle-only checkpoints are refused by name.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Checkpoint>> Open(const std::string& dir);

  const std::string& dir() const { return dir_; }
  // Every tensor, sorted by name.
  const std::map<std::string, const TensorView*>& tensors() const { return tensors_; }
  // The shard a tensor lives in (for messages).
  const std::string& FileOf(const std::string& name) const { return file_of_.at(name); }
  size_t num_files() const { return files_.size(); }
  // OK unless a shard changed since Open (SafetensorsFile::CheckIntact): call once the weights
  // have been copied out.
  [[nodiscard]] absl::Status CheckIntact() const;

 private:
  std::string dir_;
  std::vector<std::unique_ptr<SafetensorsFile>> files_;
  std::map<std::string, const TensorView*> tensors_;
  std::map<std::string, std::string> file_of_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_CHECKPOINT_H_
