// What the controller expects of its workers' engine settings, and the check it makes on every
// rank's Info before it serves: the same --model (by config.json fingerprint), --dtype,
// --max-loras, --max-lora-rank, mixed mode, expert parallelism and fully sharded LoRAs, a
// --max-num-seqs at least its own, the same --max-model-len when it sets one, and the ranks
// in order. In --workers mode the workers are started on their own, so a flag given to one side
// only would otherwise serve wrong answers or fail requests later. Thread-safe: pure functions.
#ifndef MOELORA_CONTROLLER_WORKER_SETTINGS_H_
#define MOELORA_CONTROLLER_WORKER_SETTINGS_H_

#include <string>
#include <vector>

#include "absl/status/status.h"
#include "common/engine_flags.h"
#include "moelora/v1/worker.pb.h"

namespace moelora {

struct WorkerSettings {
  EngineFlags flags;
  std::string model;               // the controller's --model (named in messages)
  std::string config_fingerprint;  // of its config.json (ConfigFingerprint); empty: not checked
};

// The settings the controller's own flags imply (its config.json fingerprinted).
WorkerSettings WorkerSettingsFromFlags(const EngineFlags& flags, const std::string& model);

// FAILED_PRECONDITION naming the rank, the flag and both values at the first disagreement;
// `ranks` are the ranks' Info replies in rank order.
[[nodiscard]] absl::Status CheckWorkerSettings(const WorkerSettings& mine,
                                               const std::vector<v1::WorkerInfoResponse>& ranks);

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_WORKER_SETTINGS_H_
