// The adapter registry: name -> adapter record, persisted in SQLite under --state-dir so a
// controller restart loses no registration. Ids come from SQLite (stable across restarts).
// Thread-safe: every method takes the registry's mutex.
#ifndef MOELORA_CONTROLLER_REGISTRY_H_
#define MOELORA_CONTROLLER_REGISTRY_H_

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/status/statusor.h"
#include "common/mutex.h"

struct sqlite3;

namespace moelora {

struct AdapterRecord {
  int64_t id = 0;
  std::string name;
  std::string path;           // as given by the client
  std::string resolved_path;  // inside --adapter-root, symlinks resolved
  int requested_format = 0;   // moelora.v1.AdapterFormat
  int detected_format = 0;
  bool converted_to_2d = false;
  int rank = 0;
  int max_rank = 0;
  double alpha = 0;
  double scaling = 0;
  std::vector<std::string> target_modules;
  int num_experts = 0;
  int64_t bytes = 0;
  double load_seconds = 0;
  bool pinned = false;
};

class Registry {
 public:
  // Opens (creating) `state_dir`/registry.sqlite3. DATA_LOSS naming the file when it is not a
  // registry or is damaged (the file is left as it is); INTERNAL naming it on other failures.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Registry>> Open(const std::string& state_dir);
  ~Registry();

  // Inserts a new record (its id is assigned and returned). ALREADY_EXISTS if the name is taken.
  [[nodiscard]] absl::StatusOr<int64_t> Insert(const AdapterRecord& r);
  // Rewrites every field of the record with this name. NOT_FOUND if absent.
  [[nodiscard]] absl::Status Update(const AdapterRecord& r);
  [[nodiscard]] absl::Status Remove(const std::string& name);
  std::optional<AdapterRecord> Get(const std::string& name) const;
  std::vector<AdapterRecord> List() const;  // by id

 private:
  Registry() = default;
  // The last SQLite error as a Status naming the file (RESOURCE_EXHAUSTED for a full disk,
  // DATA_LOSS for a damaged file).
  [[nodiscard]] absl::Status Error() const ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  [[nodiscard]] absl::Status Corrupt(const std::string& why) const
      ABSL_EXCLUSIVE_LOCKS_REQUIRED(mu_);
  mutable Mutex mu_;
  sqlite3* db_ ABSL_GUARDED_BY(mu_) = nullptr;
  std::string path_;  // set by Open
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_REGISTRY_H_
