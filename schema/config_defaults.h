// What a config.json key means when it is absent: the default of each architecture's own
// configuration class (transformers, or the model's hub/vLLM class where transformers has none),
// as its entry in schema/architectures.cc gives it.
// Every reader of config.json (adapter validation, the worker's config and its forward passes)
// sees the config with these defaults filled in, so an absent key never falls back to a value the
// model's authors did not choose. Thread-safe: constant tables and pure functions.
#ifndef MOELORA_SCHEMA_CONFIG_DEFAULTS_H_
#define MOELORA_SCHEMA_CONFIG_DEFAULTS_H_

#include <string>

#include "absl/status/statusor.h"

namespace moelora {

// `text` (a config.json) with every absent key of its architecture's table filled in. The text
// unchanged when it names no known architecture (the callers report that themselves); rope
// defaults are filled only where the config sets no rope of its own. INVALID_ARGUMENT for bad
// JSON.
[[nodiscard]] absl::StatusOr<std::string> ApplyConfigDefaults(const std::string& text,
                                                              const std::string& file);

// FAILED_PRECONDITION naming `file`, the key and the reason when a key the architecture's table
// requires is absent (checked before a forward pass is built, not where only names are read).
[[nodiscard]] absl::Status CheckRequiredConfigKeys(const std::string& text,
                                                   const std::string& file);

// {"Arch": {"source": ..., "defaults": {...}, "required": {"key": "reason"}}, ...} as JSON text.
std::string ConfigDefaultsJson();

}  // namespace moelora

#endif  // MOELORA_SCHEMA_CONFIG_DEFAULTS_H_
