// libFuzzer: a model's answer as any text, split into pieces anywhere, through every combination
// of the chat-output parsers. Nothing may crash (ASan+UBSan), and the pieces must add up to what
// the whole text gives: the same reasoning, content and calls.
//
// Input: byte 0 picks the parsers and the cut points' seed (bits 0-1: reasoning none / qwen3 /
// qwen3 with the prompt's <think> open; bit 2: hermes or qwen3_coder; bit 3: tools or none; bits
// 4-7: the pieces' sizes); the rest is the answer.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "chat_output/output_parser.h"

namespace {

using moelora::OutputDelta;
using moelora::OutputParser;
using moelora::OutputParserOptions;

struct Answer {
  std::string reasoning, content, calls;
};

void Add(const OutputDelta& d, Answer* a) {
  a->reasoning += d.reasoning;
  a->content += d.content;
  for (const auto& c : d.calls) a->calls += c.name + "(" + c.arguments + ")";
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const uint8_t mode = data[0];
  const std::string_view text(reinterpret_cast<const char*>(data) + 1, size - 1);
  OutputParserOptions o;
  o.reasoning_parser = (mode & 3) == 0 ? "" : "qwen3";
  o.prompt_opens_reasoning = (mode & 3) == 2;
  o.tool_call_parser = (mode & 4) ? "qwen3_coder" : "hermes";
  if (mode & 8) {
    o.tools = nlohmann::ordered_json::parse(R"([{"type": "function", "function": {"name": "add",
      "parameters": {"type": "object", "properties": {"a": {"type": "array"}}}}}])");
  }
  auto whole = OutputParser::Create(o);
  auto pieces = OutputParser::Create(o);
  if (!whole.ok() || !pieces.ok()) __builtin_trap();
  Answer a, b;
  Add((*whole)->Feed(text), &a);
  Add((*whole)->Finish(), &a);
  const size_t step = 1 + (mode >> 4);
  for (size_t at = 0; at < text.size(); at += step) Add((*pieces)->Feed(text.substr(at, step)), &b);
  Add((*pieces)->Finish(), &b);
  if (a.reasoning != b.reasoning || a.content != b.content || a.calls != b.calls) __builtin_trap();
  // Nothing is lost: every byte of the answer is reasoning, content, or inside a call's tags.
  if (a.calls.empty() && o.reasoning_parser.empty() && a.content != text) __builtin_trap();
  return 0;
}
