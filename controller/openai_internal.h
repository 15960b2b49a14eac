// Helpers the OpenAI-compatible API's files share (openai_api.cc, openai_generation.cc).
#ifndef MOELORA_CONTROLLER_OPENAI_INTERNAL_H_
#define MOELORA_CONTROLLER_OPENAI_INTERNAL_H_

#include <chrono>
#include <cstdint>
#include <string>

#include "nlohmann/json.hpp"

namespace moelora {

inline int64_t UnixNow() {
  return std::chrono::duration_cast<std::chrono::seconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// A string member of a JSON object, or "" (a value of another type is not read as one).
inline std::string StringMember(const nlohmann::ordered_json& o, const char* key) {
  if (!o.is_object()) return "";
  auto it = o.find(key);
  return it != o.end() && it->is_string() ? it->get<std::string>() : "";
}

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_OPENAI_INTERNAL_H_
