// adapter_config.json of a PEFT LoRA adapter: the fields moelora reads, parsed and checked.
// Thread-safe: plain data and a pure parse function.
#ifndef MOELORA_LORA_ADAPTER_CONFIG_H_
#define MOELORA_LORA_ADAPTER_CONFIG_H_

#include <map>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moelora {

struct AdapterConfig {
  int r = 0;                                        // default rank
  double lora_alpha = 0;                            // default alpha
  bool use_rslora = false;                          // scaling alpha/sqrt(r) instead of alpha/r
  std::vector<std::string> target_modules;          // list form
  std::optional<std::string> target_modules_regex;  // string form (a full-match regex)
  std::vector<std::string> target_parameters;       // PEFT ParamWrapper targets (3D MoE LoRA)
  std::map<std::string, int> rank_pattern;          // key: PEFT pattern, value: rank
  std::map<std::string, double> alpha_pattern;      // key: PEFT pattern, value: alpha
  std::vector<std::string> modules_to_save;         // refused when non-empty
  bool use_dora = false;                            // refused
  std::string bias = "none";                        // anything else refused
  bool lora_bias = false;                           // refused
  std::string base_model_name_or_path;
  nlohmann::json raw;  // the whole file, kept so conversions can write it back with changes

  // Rank and alpha for a module (or "<module>.<parameter>" for 3D targets), honouring
  // rank_pattern / alpha_pattern with PEFT's rule: a pattern key K matches a name N when N fully
  // matches the regex "(.*\.)?(K)"; the first matching key (in key order) wins.
  int RankFor(const std::string& name) const;
  double AlphaFor(const std::string& name) const;
  // alpha/r, or alpha/sqrt(r) with use_rslora.
  double ScalingFor(int rank, double alpha) const;
};

// Parses the text of adapter_config.json. INVALID_ARGUMENT naming `file` and the field for:
// invalid JSON, missing r / lora_alpha / target_modules (and target_parameters), r <= 0,
// non-finite alpha, wrongly typed fields, a bad regex. Refusals of supported-but-unservable
// settings (DoRA, modules_to_save, bias) are checked separately by CheckServable.
[[nodiscard]] absl::StatusOr<AdapterConfig> ParseAdapterConfig(const std::string& text,
                                                               const std::string& file);

// INVALID_ARGUMENT for settings moelora cannot serve: modules_to_save, use_dora, bias != "none",
// lora_bias. `file` names the config in the message.
[[nodiscard]] absl::Status CheckServable(const AdapterConfig& config, const std::string& file);

}  // namespace moelora

#endif  // MOELORA_LORA_ADAPTER_CONFIG_H_
