// A chat answer's text split into reasoning, content and tool calls, as vLLM's parsers of the
// same names split it (`--reasoning-parser`, `--tool-call-parser`), fed whole or piece by piece
// as the tokens are decoded. Feeding the text in any pieces gives deltas whose concatenation is
// what one Feed of the whole text gives: a tag split across pieces is held back until it is
// whole.
//
// Reasoning (`qwen3`): the text between `<think>` and `</think>`; where the prompt already opened
// `<think>` (Qwen3.5/3.6's templates, Qwen3's thinking models), from the start to `</think>`, and
// all of it when `</think>` never comes. Without an opening the answer is content.
//
// Tool calls, in the content: `hermes` (Qwen3: `<tool_call>{"name": ..., "arguments": {...}}
// </tool_call>`) and `qwen3_coder` (Qwen3.5/3.6, Qwen3-Coder: `<tool_call><function=NAME>
// <parameter=KEY>value</parameter></function></tool_call>`, each value converted to the JSON type
// the tool's schema gives it). A call that does not parse, names no tool of the request, or is
// never closed stays in the content as it was written: nothing is lost. Whitespace-only content
// around calls is dropped (the templates put newlines there).
//
// Not thread-safe: one parser per answer.
#ifndef MOELORA_CHAT_OUTPUT_OUTPUT_PARSER_H_
#define MOELORA_CHAT_OUTPUT_OUTPUT_PARSER_H_

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/status/statusor.h"
#include "nlohmann/json.hpp"

namespace moelora {

struct ToolCall {
  std::string id;  // "chatcmpl-tool-" and 32 hex digits, as vLLM's
  std::string name;
  std::string arguments;  // JSON text of an object
};

// What a piece of text added: new reasoning text, new content text, and the calls it completed.
struct OutputDelta {
  std::string reasoning, content;
  std::vector<ToolCall> calls;
  bool empty() const { return reasoning.empty() && content.empty() && calls.empty(); }
  // `next` after this one.
  void Append(OutputDelta next) {
    reasoning += next.reasoning;
    content += next.content;
    for (ToolCall& c : next.calls) calls.push_back(std::move(c));
  }
};

struct OutputParserOptions {
  std::string reasoning_parser;  // "" or "qwen3"
  std::string tool_call_parser;  // "" (tool calls stay text), "hermes" or "qwen3_coder"
  // The prompt ends inside an open `<think>` (PromptOpensReasoning).
  bool prompt_opens_reasoning = false;
  // The request's `tools` (OpenAI's list of {"type": "function", "function": {"name",
  // "parameters"}}): the names a call may take, and the parameters' types for qwen3_coder.
  nlohmann::ordered_json tools = nlohmann::ordered_json::array();
  // OpenAI's parallel_tool_calls false: the first call only (later ones dropped, as vLLM does).
  bool single_call = false;
};

// The parser names this build knows, for --help and the flags' checks.
const std::vector<std::string>& ReasoningParserNames();
const std::vector<std::string>& ToolCallParserNames();

// Whether `prompt` (the rendered chat) leaves a `<think>` open: its last `<think>` after its last
// `</think>`.
bool PromptOpensReasoning(std::string_view prompt);

class OutputParser {
 public:
  // INVALID_ARGUMENT naming an unknown parser.
  static absl::StatusOr<std::unique_ptr<OutputParser>> Create(OutputParserOptions options);
  ~OutputParser();

  // The next piece of the answer's text.
  OutputDelta Feed(std::string_view text);
  // The end of the answer: what was held back (an unclosed call as content).
  OutputDelta Finish();
  // Whether any tool call was completed so far (finish_reason "tool_calls").
  bool made_calls() const { return calls_made_ > 0; }

 private:
  explicit OutputParser(OutputParserOptions options);
  void FeedContent(std::string_view text, OutputDelta* out);
  void EmitContent(std::string_view text, OutputDelta* out);
  void CloseCall(OutputDelta* out);

  OutputParserOptions options_;
  enum class Reasoning { kUndecided, kInside, kDone } reasoning_;
  std::string held_;               // reasoning stage: text that may be the start of a tag
  bool in_call_ = false;           // tool stage: inside `<tool_call>`
  std::string call_text_;          // the call's text so far (after `<tool_call>`)
  std::string content_held_;       // tool stage: text that may start `<tool_call>`
  std::string pending_space_;      // whitespace not yet known to be content
  std::string space_before_call_;  // the whitespace before the open call
  bool content_started_ = false;   // content other than whitespace was emitted
  int calls_made_ = 0;
};

namespace chat_output_internal {
// One call's text between `<tool_call>` and `</tool_call>` in `format` ("hermes" or
// "qwen3_coder"), checked against the request's tools: the call, or false where it does not parse
// or names no tool.
bool ParseToolCall(const std::string& format, const std::string& text,
                   const nlohmann::ordered_json& tools, ToolCall* call);
}  // namespace chat_output_internal

}  // namespace moelora

#endif  // MOELORA_CHAT_OUTPUT_OUTPUT_PARSER_H_
