// The reasoning and tool-call parsers on the formats the real templates teach the models, malformed
// answers included, fed whole, a byte at a time and in random pieces: the same answer each way.
#include "chat_output/output_parser.h"

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

namespace moelora {
namespace {

using ordered_json = nlohmann::ordered_json;

const ordered_json kTools = ordered_json::parse(R"([
  {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
    "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                   "metric": {"type": "boolean"}, "hours": {"type": "array"}}}}},
  {"type": "function", "function": {"name": "add", "parameters": {"type": "object",
    "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}}])");

struct Case {
  const char* name;
  const char* reasoning_parser;
  const char* tool_parser;
  bool prompt_opens;
  std::string text;
  std::string reasoning, content;
  std::vector<std::pair<std::string, std::string>> calls;  // name, arguments (JSON text)
};

struct Answer {
  std::string reasoning, content;
  std::vector<ToolCall> calls;
};

Answer Parse(const Case& c, const std::vector<size_t>& cuts) {
  OutputParserOptions o;
  o.reasoning_parser = c.reasoning_parser;
  o.tool_call_parser = c.tool_parser;
  o.prompt_opens_reasoning = c.prompt_opens;
  o.tools = kTools;
  auto p = OutputParser::Create(o);
  EXPECT_TRUE(p.ok());
  Answer a;
  auto add = [&](const OutputDelta& d) {
    a.reasoning += d.reasoning;
    a.content += d.content;
    a.calls.insert(a.calls.end(), d.calls.begin(), d.calls.end());
  };
  size_t at = 0;
  for (size_t cut : cuts) {
    add((*p)->Feed(std::string_view(c.text).substr(at, cut - at)));
    at = cut;
  }
  add((*p)->Feed(std::string_view(c.text).substr(at)));
  add((*p)->Finish());
  EXPECT_EQ((*p)->made_calls(), !a.calls.empty());
  return a;
}

const std::vector<Case>& Cases() {
  static const std::vector<Case> cases = {
      {"plain", "qwen3", "hermes", false, "Hello there.\n", "", "Hello there.\n", {}},
      {"qwen3_thinking",
       "qwen3",
       "",
       false,
       "<think>\nLet me see.\n</think>\n\nIt is 4.",
       "\nLet me see.\n",
       "\n\nIt is 4.",
       {}},
      {"qwen3_empty_thinking",
       "qwen3",
       "",
       false,
       "<think>\n\n</think>\n\nHi",
       "\n\n",
       "\n\nHi",
       {}},
      {"prompt_opened_think",
       "qwen3",
       "",
       true,
       "Thinking it over.\n</think>\n\nDone.",
       "Thinking it over.\n",
       "\n\nDone.",
       {}},
      {"cut_off_while_thinking",
       "qwen3",
       "",
       true,
       "Still thinking about </thi",
       "Still thinking about </thi",
       "",
       {}},
      {"no_reasoning_parser_keeps_tags",
       "",
       "",
       false,
       "<think>x</think>y",
       "",
       "<think>x</think>y",
       {}},
      {"hermes_one_call",
       "qwen3",
       "hermes",
       false,
       "<think>\nNeed weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
       "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>",
       "\nNeed weather.\n",
       "",
       {{"get_weather", "{\"city\":\"Paris\"}"}}},
      {"hermes_text_then_two_calls",
       "",
       "hermes",
       false,
       "Checking both.\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": "
       "\"Oslo\", \"days\": 2}}\n</tool_call>\n<tool_call>\n{\"name\": \"add\", \"arguments\": "
       "{\"a\": 1, \"b\": 2.5}}\n</tool_call>\n",
       "",
       "Checking both.\n\n",
       {{"get_weather", "{\"city\":\"Oslo\",\"days\":2}"}, {"add", "{\"a\":1,\"b\":2.5}"}}},
      {"hermes_invalid_json_stays_text",
       "",
       "hermes",
       false,
       "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,}\n</tool_call>",
       "",
       "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1,}\n</tool_call>",
       {}},
      {"hermes_bad_call_keeps_the_newline_before_it",
       "",
       "hermes",
       false,
       "\n<tool_call>{\"name\": \"nope\"}</tool_call>",
       "",
       "\n<tool_call>{\"name\": \"nope\"}</tool_call>",
       {}},
      // Found by chat_output_fuzz: whitespace after the calls, in one piece or split.
      {"hermes_trailing_space_after_a_call",
       "qwen3",
       "hermes",
       false,
       " <tool_call>\n{\"name\": \"add\"}</tool_call>xyz  ",
       "",
       "xyz",
       {{"add", "{}"}}},
      {"hermes_unknown_function_stays_text",
       "",
       "hermes",
       false,
       "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
       "",
       "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
       {}},
      {"hermes_unclosed_stays_text",
       "",
       "hermes",
       false,
       "Sure <tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1",
       "",
       "Sure <tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1",
       {}},
      {"hermes_arguments_as_text",
       "",
       "hermes",
       false,
       "<tool_call>{\"name\": \"add\", \"arguments\": \"{\\\"a\\\": 3}\"}</tool_call>",
       "",
       "",
       {{"add", "{\"a\":3}"}}},
      {"tag_like_text_is_content",
       "",
       "hermes",
       false,
       "Use <tool_ to start <b>bold</b>",
       "",
       "Use <tool_ to start <b>bold</b>",
       {}},
      {"qwen3_coder_typed",
       "qwen3",
       "qwen3_coder",
       true,
       "The user wants weather.\n</think>\n\n<tool_call>\n<function=get_weather>\n"
       "<parameter=city>\nNew York\n</parameter>\n<parameter=days>\n3\n</parameter>\n"
       "<parameter=metric>\ntrue\n</parameter>\n<parameter=hours>\n[6, 18]\n</parameter>\n"
       "</function>\n</tool_call>",
       "The user wants weather.\n",
       "",
       {{"get_weather", "{\"city\":\"New York\",\"days\":3,\"metric\":true,\"hours\":[6,18]}"}}},
      {"qwen3_coder_untyped_value_stays_string",
       "",
       "qwen3_coder",
       false,
       "<tool_call>\n<function=add>\n<parameter=a>\nseven\n</parameter>\n<parameter=b>\n2\n"
       "</parameter>\n</function>\n</tool_call>",
       "",
       "",
       {{"add", "{\"a\":\"seven\",\"b\":2.0}"}}},
      {"qwen3_coder_missing_function_end_stays_text",
       "",
       "qwen3_coder",
       false,
       "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
       "",
       "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
       {}},
  };
  return cases;
}

class OutputParserTest : public ::testing::TestWithParam<Case> {};

TEST_P(OutputParserTest, WholeBytewiseAndRandomPiecesGiveTheSameAnswer) {
  const Case& c = GetParam();
  std::vector<std::vector<size_t>> splits = {{}};
  std::vector<size_t> bytes;
  for (size_t i = 1; i < c.text.size(); ++i) bytes.push_back(i);
  splits.push_back(bytes);
  std::mt19937 rng(7);
  for (int r = 0; r < 20; ++r) {
    std::vector<size_t> cuts;
    for (size_t i = 1; i < c.text.size(); ++i) {
      if (rng() % 5 == 0) cuts.push_back(i);
    }
    splits.push_back(cuts);
  }
  for (const auto& cuts : splits) {
    const Answer a = Parse(c, cuts);
    EXPECT_EQ(a.reasoning, c.reasoning) << cuts.size() << " cuts";
    EXPECT_EQ(a.content, c.content) << cuts.size() << " cuts";
    ASSERT_EQ(a.calls.size(), c.calls.size()) << cuts.size() << " cuts";
    for (size_t i = 0; i < a.calls.size(); ++i) {
      EXPECT_EQ(a.calls[i].name, c.calls[i].first);
      EXPECT_EQ(ordered_json::parse(a.calls[i].arguments), ordered_json::parse(c.calls[i].second));
      EXPECT_EQ(a.calls[i].id.rfind("chatcmpl-tool-", 0), 0u);
      EXPECT_EQ(a.calls[i].id.size(), 14u + 32u);
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Formats, OutputParserTest, ::testing::ValuesIn(Cases()),
                         [](const ::testing::TestParamInfo<Case>& i) { return i.param.name; });

TEST(OutputParserTest, UnknownParsersAreNamed) {
  OutputParserOptions o;
  o.tool_call_parser = "mistral";
  auto p = OutputParser::Create(o);
  ASSERT_FALSE(p.ok());
  EXPECT_NE(p.status().message().find("\"mistral\""), std::string::npos);
  EXPECT_NE(p.status().message().find("hermes"), std::string::npos);
}

TEST(OutputParserTest, ParallelToolCallsFalseKeepsTheFirstCall) {
  OutputParserOptions o;
  o.tool_call_parser = "hermes";
  o.tools = kTools;
  o.single_call = true;
  auto p = OutputParser::Create(o);
  ASSERT_TRUE(p.ok());
  OutputDelta d = (*p)->Feed(
      "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 1}}</tool_call>\n"
      "<tool_call>{\"name\": \"add\", \"arguments\": {\"a\": 2}}</tool_call>");
  const OutputDelta rest = (*p)->Finish();
  ASSERT_EQ(d.calls.size() + rest.calls.size(), 1u);
  EXPECT_EQ(d.calls[0].arguments, "{\"a\":1}");
  EXPECT_TRUE((*p)->made_calls());
  EXPECT_EQ(d.content + rest.content, "");
}

// A model (or a hostile adapter) can write any text: JSON nested 200,000 deep in a call is not
// read as JSON (writing it out again, nlohmann's dump recurses per level and would exhaust the
// stack): the call stays text, or the value a string.
TEST(OutputParserTest, DeeplyNestedArgumentsStayText) {
  for (const char* format : {"hermes", "qwen3_coder"}) {
    OutputParserOptions o;
    o.tool_call_parser = format;
    o.tools = kTools;
    auto p = OutputParser::Create(o);
    ASSERT_TRUE(p.ok());
    const std::string deep = std::string(200000, '[') + std::string(200000, ']');
    const std::string call =
        std::string(format) == "hermes"
            ? "<tool_call>{\"name\": \"add\", \"arguments\": " + deep + "</tool_call>"
            : "<tool_call><function=get_weather><parameter=hours>" + deep +
                  "</parameter></function></tool_call>";
    OutputDelta d = (*p)->Feed(call);
    const OutputDelta rest = (*p)->Finish();
    d.content += rest.content;
    d.calls.insert(d.calls.end(), rest.calls.begin(), rest.calls.end());
    if (std::string(format) == "hermes") {
      EXPECT_TRUE(d.calls.empty());
      EXPECT_EQ(d.content, call);
    } else {  // the value stays a string
      ASSERT_EQ(d.calls.size(), 1u);
      EXPECT_EQ(ordered_json::parse(d.calls[0].arguments)["hours"], deep);
    }
  }
}

// A call that never closes, 4 MB fed 16 bytes at a time: all of it comes back as content (each
// piece is searched once: 0.05 s here, where searching the whole call again per piece took 7.7 s).
TEST(OutputParserTest, ALongUnclosedCallStaysContent) {
  OutputParserOptions o;
  o.reasoning_parser = "qwen3";
  o.tool_call_parser = "hermes";
  o.tools = kTools;
  auto p = OutputParser::Create(o);
  ASSERT_TRUE(p.ok());
  const std::string text =
      "<tool_call>{\"name\": \"add\", \"arguments\": \"" + std::string(4 << 20, 'x');
  OutputDelta all;
  for (size_t at = 0; at < text.size(); at += 16) all.Append((*p)->Feed(text.substr(at, 16)));
  all.Append((*p)->Finish());
  EXPECT_TRUE(all.calls.empty());
  EXPECT_EQ(all.content.size(), text.size());
  EXPECT_TRUE(all.content == text);
}

TEST(OutputParserTest, PromptOpensReasoning) {
  EXPECT_TRUE(PromptOpensReasoning("<|im_start|>assistant\n<think>\n"));
  EXPECT_FALSE(PromptOpensReasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n"));
  EXPECT_FALSE(PromptOpensReasoning("<|im_start|>assistant\n"));
}

}  // namespace
}  // namespace moelora
