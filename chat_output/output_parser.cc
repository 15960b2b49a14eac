#include "chat_output/output_parser.h"

#include <algorithm>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"

namespace moelora {
namespace {

constexpr std::string_view kThinkOpen = "<think>", kThinkClose = "</think>";
constexpr std::string_view kCallOpen = "<tool_call>", kCallClose = "</tool_call>";

bool IsSpace(char c) { return c == ' ' || c == '\n' || c == '\t' || c == '\r'; }

// The length of the longest suffix of `s` that is a proper prefix of `tag` (what may still become
// the tag once more text comes).
size_t HeldSuffix(std::string_view s, std::string_view tag) {
  for (size_t k = std::min(s.size(), tag.size() - 1); k > 0; --k) {
    if (s.substr(s.size() - k) == tag.substr(0, k)) return k;
  }
  return 0;
}

}  // namespace

const std::vector<std::string>& ReasoningParserNames() {
  static const std::vector<std::string> names = {"qwen3"};
  return names;
}

const std::vector<std::string>& ToolCallParserNames() {
  static const std::vector<std::string> names = {"hermes", "qwen3_coder"};
  return names;
}

bool PromptOpensReasoning(std::string_view prompt) {
  const size_t open = prompt.rfind(kThinkOpen);
  if (open == std::string_view::npos) return false;
  const size_t close = prompt.rfind(kThinkClose);
  return close == std::string_view::npos || close < open;
}

absl::StatusOr<std::unique_ptr<OutputParser>> OutputParser::Create(OutputParserOptions options) {
  auto known = [](const std::vector<std::string>& names, const std::string& n) {
    return n.empty() || std::find(names.begin(), names.end(), n) != names.end();
  };
  if (!known(ReasoningParserNames(), options.reasoning_parser)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown reasoning parser \"", options.reasoning_parser,
                     "\" (known: ", absl::StrJoin(ReasoningParserNames(), ", "), ")"));
  }
  if (!known(ToolCallParserNames(), options.tool_call_parser)) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown tool-call parser \"", options.tool_call_parser,
                     "\" (known: ", absl::StrJoin(ToolCallParserNames(), ", "), ")"));
  }
  return std::unique_ptr<OutputParser>(new OutputParser(std::move(options)));
}

OutputParser::OutputParser(OutputParserOptions options) : options_(std::move(options)) {
  reasoning_ = options_.reasoning_parser.empty() ? Reasoning::kDone
               : options_.prompt_opens_reasoning ? Reasoning::kInside
                                                 : Reasoning::kUndecided;
}

OutputParser::~OutputParser() = default;

OutputDelta OutputParser::Feed(std::string_view text) {
  OutputDelta out;
  if (reasoning_ == Reasoning::kDone) {
    FeedContent(text, &out);
    return out;
  }
  const size_t before = held_.size();
  held_.append(text);
  if (reasoning_ == Reasoning::kUndecided) {
    // An answer that opens with `<think>` (after any whitespace) reasons first. What was held
    // before is whitespace or the start of the tag: the search starts where the tag could.
    const size_t start = held_.find_first_not_of(" \n\t\r", before > 6 ? before - 6 : 0);
    if (start == std::string::npos) return out;
    const std::string_view rest = std::string_view(held_).substr(start);
    if (rest.size() < kThinkOpen.size() && kThinkOpen.substr(0, rest.size()) == rest) return out;
    if (rest.substr(0, kThinkOpen.size()) == kThinkOpen) {
      reasoning_ = Reasoning::kInside;
      held_.erase(0, start + kThinkOpen.size());
    } else {
      reasoning_ = Reasoning::kDone;
      std::string all;
      all.swap(held_);
      FeedContent(all, &out);
      return out;
    }
  }
  const size_t close = held_.find(kThinkClose);
  if (close != std::string::npos) {
    out.reasoning = held_.substr(0, close);
    const std::string rest = held_.substr(close + kThinkClose.size());
    held_.clear();
    reasoning_ = Reasoning::kDone;
    FeedContent(rest, &out);
    return out;
  }
  const size_t keep = HeldSuffix(held_, kThinkClose);
  out.reasoning = held_.substr(0, held_.size() - keep);
  held_.erase(0, held_.size() - keep);
  return out;
}

OutputDelta OutputParser::Finish() {
  OutputDelta out;
  if (reasoning_ == Reasoning::kInside) {
    out.reasoning = std::move(held_);  // cut off while reasoning: all of it was reasoning
  } else if (reasoning_ == Reasoning::kUndecided) {
    FeedContent(held_, &out);
  }
  held_.clear();
  reasoning_ = Reasoning::kDone;
  if (in_call_) {  // never closed: the text as written
    in_call_ = false;
    pending_space_ = space_before_call_ + pending_space_;
    space_before_call_.clear();
    EmitContent(std::string(kCallOpen) + call_text_, &out);
    call_text_.clear();
  }
  EmitContent(content_held_, &out);
  content_held_.clear();
  if (calls_made_ == 0) out.content += pending_space_;
  pending_space_.clear();
  return out;
}

void OutputParser::EmitContent(std::string_view text, OutputDelta* out) {
  // Trailing whitespace waits, whatever piece it came in: what follows decides whether it is
  // content (more text) or layout (a call, or the end after calls).
  size_t end = text.size();
  while (end > 0 && IsSpace(text[end - 1])) --end;
  if (end > 0) {
    out->content += pending_space_;
    out->content.append(text.substr(0, end));
    pending_space_.clear();
    content_started_ = true;
  }
  pending_space_.append(text.substr(end));
}

void OutputParser::FeedContent(std::string_view text, OutputDelta* out) {
  if (options_.tool_call_parser.empty()) {
    // No tool calls to find: the content as it comes (whitespace too).
    out->content += pending_space_;
    pending_space_.clear();
    out->content.append(text);
    return;
  }
  std::string buf = content_held_;
  buf.append(text);
  content_held_.clear();
  while (!buf.empty()) {
    if (in_call_) {
      // Only the new text (and a tag's worth before it) is searched: a long call stays linear.
      const size_t from =
          call_text_.size() >= kCallClose.size() ? call_text_.size() - kCallClose.size() + 1 : 0;
      call_text_ += buf;
      buf.clear();
      const size_t close = call_text_.find(kCallClose, from);
      if (close == std::string::npos) return;
      buf = call_text_.substr(close + kCallClose.size());
      call_text_.resize(close);
      CloseCall(out);
      continue;
    }
    const size_t open = buf.find(kCallOpen);
    if (open == std::string::npos) {
      const size_t keep = HeldSuffix(buf, kCallOpen);
      EmitContent(std::string_view(buf).substr(0, buf.size() - keep), out);
      content_held_ = buf.substr(buf.size() - keep);
      return;
    }
    EmitContent(std::string_view(buf).substr(0, open), out);
    // The whitespace before a call waits for the call: content again if the call does not parse.
    space_before_call_.swap(pending_space_);
    pending_space_.clear();
    in_call_ = true;
    call_text_.clear();
    buf.erase(0, open + kCallOpen.size());
  }
}

void OutputParser::CloseCall(OutputDelta* out) {
  in_call_ = false;
  ToolCall call;
  if (chat_output_internal::ParseToolCall(options_.tool_call_parser, call_text_, options_.tools,
                                          &call)) {
    // Whitespace before the first call stays with the text before it, if any; elsewhere it is
    // the template's layout.
    if (calls_made_ == 0 && content_started_) out->content += space_before_call_;
    if (!options_.single_call || calls_made_ == 0) out->calls.push_back(std::move(call));
    ++calls_made_;
  } else {
    pending_space_ = space_before_call_;
    EmitContent(std::string(kCallOpen) + call_text_ + std::string(kCallClose), out);
  }
  space_before_call_.clear();
  call_text_.clear();
}

}  // namespace moelora
