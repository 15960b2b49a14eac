// The formats of one tool call's text (between `<tool_call>` and `</tool_call>`).
#include <cstdint>
#include <random>

#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "chat_output/output_parser.h"

namespace moelora {
namespace chat_output_internal {
namespace {

using ordered_json = nlohmann::ordered_json;

// JSON text from the model is read only when its nesting is shallow: writing a value out again
// (dump) recurses per level, and an answer of max_tokens brackets would exhaust the stack.
constexpr int kMaxDepth = 64;

ordered_json ParseShallow(const std::string& text) {
  int depth = 0;
  bool in_string = false, escaped = false;
  for (char c : text) {
    if (in_string) {
      if (escaped) {
        escaped = false;
      } else if (c == '\\') {
        escaped = true;
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
    } else if (c == '{' || c == '[') {
      if (++depth > kMaxDepth) return ordered_json(ordered_json::value_t::discarded);
    } else if (c == '}' || c == ']') {
      --depth;
    }
  }
  return ordered_json::parse(text, nullptr, false);
}

// The request's tool named `name` (its "function" object), or null.
const ordered_json* FindTool(const ordered_json& tools, const std::string& name) {
  if (!tools.is_array()) return nullptr;
  for (const ordered_json& t : tools) {
    if (!t.is_object() || !t.contains("function") || !t["function"].is_object()) continue;
    const ordered_json& f = t["function"];
    if (f.contains("name") && f["name"].is_string() && f["name"] == name) return &f;
  }
  return nullptr;
}

std::string CallId() {
  thread_local std::mt19937_64 rng{std::random_device{}()};
  return absl::StrFormat("chatcmpl-tool-%016x%016x", rng(), rng());
}

// hermes: {"name": ..., "arguments": {...}} (or "parameters"; arguments given as JSON text are
// read too).
bool ParseHermes(const std::string& text, const ordered_json& tools, ToolCall* call) {
  const ordered_json j = ParseShallow(text);
  if (!j.is_object() || !j.contains("name") || !j["name"].is_string()) return false;
  const std::string name = j["name"];
  if (FindTool(tools, name) == nullptr) return false;
  ordered_json args = ordered_json::object();
  for (const char* key : {"arguments", "parameters"}) {
    if (!j.contains(key)) continue;
    args = j[key];
    if (args.is_string()) args = ParseShallow(args.get<std::string>());
    break;
  }
  if (!args.is_object()) return false;
  call->name = name;
  call->arguments = args.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  return true;
}

// A qwen3_coder parameter's text as the JSON type its schema gives (a string where it has none
// or the text does not read as that type).
ordered_json TypedValue(const std::string& text, const ordered_json* schema) {
  std::string type;
  if (schema != nullptr && schema->is_object() && schema->contains("type") &&
      (*schema)["type"].is_string()) {
    type = (*schema)["type"];
  }
  const std::string t(absl::StripAsciiWhitespace(text));
  if (type == "integer") {
    int64_t v = 0;
    if (absl::SimpleAtoi(t, &v)) return v;
  } else if (type == "number") {
    double v = 0;
    if (absl::SimpleAtod(t, &v)) return v;
  } else if (type == "boolean") {
    const std::string l = absl::AsciiStrToLower(t);
    if (l == "true" || l == "false") return l == "true";
  } else if (type == "object" || type == "array" || type == "null") {
    ordered_json v = ParseShallow(t);
    if (!v.is_discarded()) return v;
  }
  return text;
}

// qwen3_coder: <function=NAME> <parameter=KEY> value </parameter> ... </function>, newlines
// around the tags.
bool ParseQwen3Coder(const std::string& text, const ordered_json& tools, ToolCall* call) {
  const size_t f = text.find("<function=");
  if (f == std::string::npos) return false;
  const size_t name_end = text.find('>', f);
  if (name_end == std::string::npos) return false;
  const std::string name(absl::StripAsciiWhitespace(text.substr(f + 10, name_end - f - 10)));
  const ordered_json* tool = FindTool(tools, name);
  if (tool == nullptr) return false;
  const size_t body_end = text.find("</function>", name_end);
  if (body_end == std::string::npos) return false;
  const ordered_json* props = nullptr;
  if (tool->contains("parameters") && (*tool)["parameters"].is_object() &&
      (*tool)["parameters"].contains("properties")) {
    props = &(*tool)["parameters"]["properties"];
  }
  ordered_json args = ordered_json::object();
  size_t at = name_end + 1;
  for (;;) {
    const size_t p = text.find("<parameter=", at);
    if (p == std::string::npos || p > body_end) break;
    const size_t key_end = text.find('>', p);
    const size_t close = text.find("</parameter>", p);
    if (key_end == std::string::npos || close == std::string::npos || close > body_end ||
        key_end > close) {
      return false;
    }
    const std::string key(absl::StripAsciiWhitespace(text.substr(p + 11, key_end - p - 11)));
    std::string value = text.substr(key_end + 1, close - key_end - 1);
    if (!value.empty() && value.front() == '\n') value.erase(0, 1);
    if (!value.empty() && value.back() == '\n') value.pop_back();
    const ordered_json* schema =
        props != nullptr && props->is_object() && props->contains(key) ? &(*props)[key] : nullptr;
    args[key] = TypedValue(value, schema);
    at = close + 12;
  }
  call->name = name;
  call->arguments = args.dump(-1, ' ', false, ordered_json::error_handler_t::replace);
  return true;
}

}  // namespace

bool ParseToolCall(const std::string& format, const std::string& text,
                   const nlohmann::ordered_json& tools, ToolCall* call) {
  const bool ok = format == "hermes"        ? ParseHermes(text, tools, call)
                  : format == "qwen3_coder" ? ParseQwen3Coder(text, tools, call)
                                            : false;
  if (ok) call->id = CallId();
  return ok;
}

}  // namespace chat_output_internal
}  // namespace moelora
