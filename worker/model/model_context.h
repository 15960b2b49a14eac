// What an architecture's factory gets: the loaded config, the options, the communicator, its
// registry entry and the opened checkpoint. Includes ATen (through causal_lm.h).
#ifndef MOELORA_WORKER_MODEL_MODEL_CONTEXT_H_
#define MOELORA_WORKER_MODEL_MODEL_CONTEXT_H_

#include <string>

#include "worker/checkpoint.h"
#include "worker/model/causal_lm.h"
#include "worker/model/registry.h"

namespace moelora {

struct ModelContext {
  std::string dir;
  ModelConfig config;
  ModelOptions options;
  Communicator* comm = nullptr;
  const ArchTable* arch = nullptr;
  const Checkpoint* checkpoint = nullptr;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_MODEL_MODEL_CONTEXT_H_
