// Arbitrary bytes as a chat template: Parse must refuse or accept without crashing, and an
// accepted template renders a fixed conversation (tools, reasoning, a tool call, Unicode) to
// valid UTF-8 or refuses with a status; never a crash, a hang or unbounded recursion.
#include <cstdint>
#include <cstdlib>
#include <string>

#include "common/utf8.h"
#include "nlohmann/json.hpp"
#include "tokenizer/chat_template.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string source(reinterpret_cast<const char*>(data), size);
  auto t = moelora::tok::ChatTemplate::Parse(source);
  if (!t.ok()) return 0;
  static const nlohmann::ordered_json kVars = moelora::tok::ChatTemplateVariables(
      nlohmann::ordered_json::parse(R"([
        {"role": "system", "content": "Be brief. \u00e9\u4e16"},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "think",
         "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"c": [1, 2.5, null]}}}]},
        {"role": "tool", "content": "{\"t\": 21}"}])"),
      nlohmann::ordered_json::parse(R"([{"type": "function", "function": {"name": "w",
        "parameters": {"type": "object", "properties": {"c": {"type": "string"}}}}}])"),
      true, nlohmann::ordered_json{{"bos_token", "<s>"}, {"eos_token", "</s>"}},
      nlohmann::ordered_json{{"enable_thinking", false}});
  auto text = (*t)->Render(kVars);
  if (text.ok() && !moelora::IsValidUtf8(*text)) std::abort();
  return 0;
}
