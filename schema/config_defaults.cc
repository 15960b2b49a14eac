#include "schema/config_defaults.h"

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"
#include "schema/architectures.h"

namespace moelora {

[[nodiscard]] absl::StatusOr<std::string> ApplyConfigDefaults(const std::string& text,
                                                              const std::string& file) {
  nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded()) return absl::InvalidArgumentError(absl::StrCat(file, ": not valid JSON"));
  if (!j.is_object() || !j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string()) {
    return text;
  }
  const ArchFacts* table = FindArchFacts(j["architectures"][0].get<std::string>());
  if (table == nullptr || table->defaults_json == nullptr) return text;
  const nlohmann::json d = nlohmann::json::parse(table->defaults_json);
  const bool wrapped = j.contains("text_config") && j["text_config"].is_object();
  nlohmann::json& t = wrapped ? j["text_config"] : j;
  auto set_rope = [](const nlohmann::json& o) {
    for (const char* k : {"rope_parameters", "rope_scaling"}) {
      if (o.contains(k) && !o[k].is_null()) return true;
    }
    return false;
  };
  for (const auto& [key, value] : d.items()) {
    if (key == "@top") {
      for (const auto& [k, v] : value.items()) {
        if (!j.contains(k)) j[k] = v;
      }
      continue;
    }
    // A default rope dict only where the config has none of its own (transformers maps
    // rope_scaling onto rope_parameters; either one replaces the class default).
    if (key == "rope_scaling") {
      if (!set_rope(t)) t[key] = value;
      continue;
    }
    // transformers' attribute_map aliases: either spelling sets the value.
    if (key == "num_experts" || key == "num_local_experts") {
      if (!t.contains("num_experts") && !t.contains("num_local_experts")) t[key] = value;
      continue;
    }
    if (!t.contains(key)) t[key] = value;
  }
  return j.dump();
}

[[nodiscard]] absl::Status CheckRequiredConfigKeys(const std::string& text,
                                                   const std::string& file) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("architectures") || !j["architectures"].is_array() ||
      j["architectures"].empty() || !j["architectures"][0].is_string()) {
    return absl::OkStatus();
  }
  const ArchFacts* table = FindArchFacts(j["architectures"][0].get<std::string>());
  if (table == nullptr) return absl::OkStatus();
  const nlohmann::json& t =
      j.contains("text_config") && j["text_config"].is_object() ? j["text_config"] : j;
  for (const ArchFacts::Required& r : table->required) {
    if (!t.contains(r.key) || t[r.key].is_null()) {
      return absl::FailedPreconditionError(absl::StrCat(file, ": ", r.key, " is required for ",
                                                        table->architecture, " (", r.reason, ")"));
    }
  }
  return absl::OkStatus();
}

std::string ConfigDefaultsJson() {
  nlohmann::json out = nlohmann::json::object();
  for (const ArchFacts& t : AllArchFacts()) {
    if (t.defaults_json == nullptr) continue;
    nlohmann::json req = nlohmann::json::object();
    for (const auto& r : t.required) req[r.key] = r.reason;
    out[t.architecture] = {{"source", t.defaults_source},
                           {"defaults", nlohmann::json::parse(t.defaults_json)},
                           {"required", req}};
  }
  return out.dump(2);
}

}  // namespace moelora
