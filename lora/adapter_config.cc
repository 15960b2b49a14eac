#include "lora/adapter_config.h"

#include <cmath>
#include <map>
#include <memory>
#include <regex>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moelora {
namespace {

constexpr size_t kMaxPatternKeys = 256;
constexpr size_t kMaxPatternKeyBytes = 256;

bool PatternMatches(const std::string& key, const std::string& name) {
  if (key == name) return true;
  // Each key compiled once per thread, not once per module (an adapter has thousands of modules
  // and up to kMaxPatternKeys keys); the cache is dropped whole when it grows past a bound.
  thread_local std::map<std::string, std::shared_ptr<const std::regex>> compiled;
  auto it = compiled.find(key);
  if (it == compiled.end()) {
    if (compiled.size() >= 4 * kMaxPatternKeys) compiled.clear();
    std::shared_ptr<const std::regex> re;
    try {
      re = std::make_shared<const std::regex>("(.*\\.)?(" + key + ")");
    } catch (const std::regex_error&) {
      // rejected at parse time; defensive
    }
    it = compiled.emplace(key, std::move(re)).first;
  }
  return it->second != nullptr && std::regex_match(name, *it->second);
}

template <typename T>
const T* FindPattern(const std::map<std::string, T>& patterns, const std::string& name) {
  for (const auto& [key, value] : patterns) {
    if (PatternMatches(key, name)) return &value;
  }
  return nullptr;
}

}  // namespace

int AdapterConfig::RankFor(const std::string& name) const {
  const int* r_ = FindPattern(rank_pattern, name);
  return r_ ? *r_ : r;
}

double AdapterConfig::AlphaFor(const std::string& name) const {
  const double* a = FindPattern(alpha_pattern, name);
  return a ? *a : lora_alpha;
}

double AdapterConfig::ScalingFor(int rank, double alpha) const {
  if (rank <= 0) return 0.0;
  return use_rslora ? alpha / std::sqrt(static_cast<double>(rank)) : alpha / rank;
}

[[nodiscard]] absl::StatusOr<AdapterConfig> ParseAdapterConfig(const std::string& text,
                                                               const std::string& file) {
  auto bad = [&file](auto&&... parts) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": ", parts...));
  };
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    const bool nan =
        text.find("NaN") != std::string::npos || text.find("Infinity") != std::string::npos;
    return bad(
        "not valid JSON: ", e.what(),
        nan ? " (NaN and Infinity are not numbers in JSON; lora_alpha and r must be finite)" : "");
  }
  if (!j.is_object()) return bad("not a JSON object");
  AdapterConfig c;
  c.raw = j;
  if (j.contains("peft_type") && j["peft_type"].is_string() && j["peft_type"] != "LORA") {
    return bad("peft_type is '", j["peft_type"].get<std::string>(),
               "', only LORA adapters are served");
  }
  std::vector<std::string> missing;
  for (const char* key : {"r", "lora_alpha"}) {
    if (!j.contains(key) || j[key].is_null()) missing.push_back(key);
  }
  const bool has_modules = j.contains("target_modules") && !j["target_modules"].is_null();
  const bool has_params = j.contains("target_parameters") && j["target_parameters"].is_array() &&
                          !j["target_parameters"].empty();
  if (!has_modules && !has_params) missing.push_back("target_modules");
  if (!missing.empty()) return bad("missing required field(s): ", absl::StrJoin(missing, ", "));

  const auto& r = j["r"];
  if (!r.is_number_integer()) return bad("r must be an integer, got ", r.dump());
  if (r.get<int64_t>() <= 0 || r.get<int64_t>() > 1 << 20)
    return bad("r must be positive, got ", r.dump());
  c.r = static_cast<int>(r.get<int64_t>());
  const auto& alpha = j["lora_alpha"];
  if (!alpha.is_number()) return bad("lora_alpha must be a number, got ", alpha.dump());
  c.lora_alpha = alpha.get<double>();
  if (!std::isfinite(c.lora_alpha)) return bad("lora_alpha must be finite, got ", alpha.dump());

  auto get_bool = [&](const char* key, bool* out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (!j[key].is_boolean()) return bad(key, " must be true or false, got ", j[key].dump());
    *out = j[key].get<bool>();
    return absl::OkStatus();
  };
  if (auto s = get_bool("use_rslora", &c.use_rslora); !s.ok()) return s;
  if (auto s = get_bool("use_dora", &c.use_dora); !s.ok()) return s;
  if (auto s = get_bool("lora_bias", &c.lora_bias); !s.ok()) return s;

  auto string_list = [&](const char* key, std::vector<std::string>* out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (!j[key].is_array()) return bad(key, " must be a list of strings");
    for (const auto& v : j[key]) {
      if (!v.is_string()) return bad(key, " must be a list of strings, got ", v.dump());
      out->push_back(v.get<std::string>());
    }
    return absl::OkStatus();
  };
  if (has_modules) {
    const auto& tm = j["target_modules"];
    if (tm.is_string()) {
      c.target_modules_regex = tm.get<std::string>();
      try {
        std::regex check(*c.target_modules_regex);
      } catch (const std::regex_error& e) {
        return bad("target_modules regex '", *c.target_modules_regex, "' is invalid: ", e.what());
      }
    } else if (auto s = string_list("target_modules", &c.target_modules); !s.ok()) {
      return s;
    }
  }
  if (auto s = string_list("target_parameters", &c.target_parameters); !s.ok()) return s;
  if (auto s = string_list("modules_to_save", &c.modules_to_save); !s.ok()) return s;

  for (const char* key : {"rank_pattern", "alpha_pattern"}) {
    if (!j.contains(key) || j[key].is_null()) continue;
    if (!j[key].is_object()) return bad(key, " must be an object");
    // Each key is a regex matched against every module's name: their number and length bounded.
    if (j[key].size() > kMaxPatternKeys) {
      return bad(key, " has ", j[key].size(), " keys, more than ", kMaxPatternKeys);
    }
    for (auto it = j[key].begin(); it != j[key].end(); ++it) {
      if (it.key().size() > kMaxPatternKeyBytes) {
        return bad(key, " key of ", it.key().size(), " bytes, more than ", kMaxPatternKeyBytes);
      }
      try {
        std::regex check("(.*\\.)?(" + it.key() + ")");
      } catch (const std::regex_error&) {
        return bad(key, " key '", it.key(), "' is not a valid regex");
      }
      if (std::string(key) == "rank_pattern") {
        if (!it.value().is_number_integer() || it.value().get<int64_t>() <= 0 ||
            it.value().get<int64_t>() > 1 << 20) {
          return bad("rank_pattern['", it.key(), "'] must be a positive integer, got ",
                     it.value().dump());
        }
        c.rank_pattern[it.key()] = static_cast<int>(it.value().get<int64_t>());
      } else {
        if (!it.value().is_number() || !std::isfinite(it.value().get<double>())) {
          return bad("alpha_pattern['", it.key(), "'] must be a finite number, got ",
                     it.value().dump());
        }
        c.alpha_pattern[it.key()] = it.value().get<double>();
      }
    }
  }
  if (j.contains("bias") && !j["bias"].is_null()) {
    if (!j["bias"].is_string()) return bad("bias must be a string");
    c.bias = j["bias"].get<std::string>();
  }
  if (j.contains("base_model_name_or_path") && j["base_model_name_or_path"].is_string()) {
    c.base_model_name_or_path = j["base_model_name_or_path"].get<std::string>();
  }
  return c;
}

[[nodiscard]] absl::Status CheckServable(const AdapterConfig& c, const std::string& file) {
  std::vector<std::string> problems;
  if (!c.modules_to_save.empty()) {
    problems.push_back(absl::StrCat("modules_to_save [", absl::StrJoin(c.modules_to_save, ", "),
                                    "] is not supported (only LoRA deltas are served)"));
  }
  if (c.use_dora) problems.push_back("DoRA (use_dora) is not supported");
  if (c.bias != "none")
    problems.push_back(absl::StrCat("bias '", c.bias, "' is not supported (only \"none\")"));
  if (c.lora_bias) problems.push_back("lora_bias is not supported");
  if (problems.empty()) return absl::OkStatus();
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", absl::StrJoin(problems, "; ")));
}

}  // namespace moelora
