// ChatTemplate's contract beyond rendering (which chat_template_test.sh compares with
// transformers): errors name the line, the model's template and special tokens are found where
// transformers looks, and the variables are built as apply_chat_template builds them.
#include "tokenizer/chat_template.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"

namespace moelora::tok {
namespace {

using nlohmann::ordered_json;
using ::testing::HasSubstr;

TEST(ChatTemplateTest, SyntaxErrorsNameTheLine) {
  auto t = ChatTemplate::Parse("line one\n{% if x %}\n{{ x + }}\n{% endif %}");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_THAT(t.status().message(), HasSubstr("line 3"));
  auto unclosed = ChatTemplate::Parse("{% for m in messages %}{{ m }}");
  ASSERT_FALSE(unclosed.ok());
  EXPECT_THAT(unclosed.status().message(), HasSubstr("endfor"));
  auto unknown = ChatTemplate::Parse("{% include 'x' %}");
  ASSERT_FALSE(unknown.ok());
  EXPECT_THAT(unknown.status().message(), HasSubstr("unsupported statement 'include'"));
  EXPECT_FALSE(ChatTemplate::Parse("bad \xC3(").ok());
}

TEST(ChatTemplateTest, RuntimeErrorsComeBackAsStatus) {
  auto t = ChatTemplate::Parse("{{ raise_exception('no system role') }}");
  ASSERT_TRUE(t.ok());
  auto r = (*t)->Render(ordered_json::object());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("no system role"));
  auto filter = ChatTemplate::Parse("\n{{ x | no_such_filter }}");
  ASSERT_TRUE(filter.ok());
  auto f = (*filter)->Render(ordered_json{{"x", 1}});
  ASSERT_FALSE(f.ok());
  EXPECT_THAT(f.status().message(), HasSubstr("line 2"));
  EXPECT_THAT(f.status().message(), HasSubstr("no_such_filter"));
}

TEST(ChatTemplateTest, RecursionIsBoundedNotACrash) {
  // Deeply nested expressions and blocks fail to parse; a macro that calls itself fails to
  // render; neither exhausts the stack.
  auto parens =
      ChatTemplate::Parse("{{ " + std::string(5000, '(') + "1" + std::string(5000, ')') + " }}");
  ASSERT_FALSE(parens.ok());
  EXPECT_THAT(parens.status().message(), HasSubstr("nested deeper"));
  std::string blocks;
  for (int i = 0; i < 5000; ++i) blocks += "{% if true %}";
  EXPECT_FALSE(ChatTemplate::Parse(blocks).ok());
  auto self = ChatTemplate::Parse("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}");
  ASSERT_TRUE(self.ok());
  auto r = (*self)->Render(ordered_json::object());
  ASSERT_FALSE(r.ok());
  EXPECT_THAT(r.status().message(), HasSubstr("nested deeper"));
  // Request data nested beyond the bound is refused too.
  ordered_json deep = 1;
  for (int i = 0; i < 1000; ++i) deep = ordered_json::array({deep});
  auto t = ChatTemplate::Parse("{{ x|length }}");
  ASSERT_TRUE(t.ok());
  EXPECT_FALSE((*t)->Render(ordered_json{{"x", deep}}).ok());
}

TEST(ChatTemplateTest, IntegersBeyond64BitsAreErrorsNotWrapped) {
  // Python's integers have no bound; where ours would wrap, the template fails instead.
  for (const char* src :
       {"{{ 9223372036854775807 + 1 }}", "{{ 3 ** 64 }}", "{{ -9223372036854775807 - 2 }}",
        "{{ 99999999999999999999 }}", "{{ 'ab' * 100000000000 }}"}) {
    auto t = ChatTemplate::Parse(src);
    if (!t.ok()) continue;  // a literal beyond 64 bits is refused when parsed
    auto r = (*t)->Render(ordered_json::object());
    EXPECT_FALSE(r.ok()) << src << " gave " << *r;
  }
  // (Results within 64 bits are compared with Python's in the chat_template corpus.)
}

class ChatTemplateDirTest : public ::testing::Test {
 protected:
  void SetUp() override {
    dir_ = std::filesystem::temp_directory_path() /
           ("chat_template_test_" + std::to_string(::getpid()) + "_" +
            ::testing::UnitTest::GetInstance()->current_test_info()->name());
    std::filesystem::create_directories(dir_);
  }
  void TearDown() override { std::filesystem::remove_all(dir_); }
  void Write(const std::string& name, const std::string& text) {
    std::ofstream(dir_ / name) << text;
  }
  std::filesystem::path dir_;
};

TEST_F(ChatTemplateDirTest, TemplateFromJinjaFileThenTokenizerConfig) {
  EXPECT_EQ(ReadChatTemplate(dir_).status().code(), absl::StatusCode::kNotFound);
  Write("tokenizer_config.json",
        R"({"chat_template": [{"name": "tool_use", "template": "T"},
                               {"name": "default", "template": "D"}],
            "bos_token": {"content": "<s>", "lstrip": false}, "eos_token": "</s>",
            "pad_token": null})");
  EXPECT_EQ(*ReadChatTemplate(dir_), "D");
  auto special = ReadSpecialTokenVariables(dir_);
  ASSERT_TRUE(special.ok());
  EXPECT_EQ(special->dump(), R"({"bos_token":"<s>","eos_token":"</s>"})");
  Write("chat_template.jinja", "J");
  EXPECT_EQ(*ReadChatTemplate(dir_), "J");
}

TEST(ChatTemplateVariablesTest, DropsNullKeysAndAliasesReasoning) {
  const ordered_json messages = ordered_json::parse(
      R"([{"role": "assistant", "content": null, "reasoning": "r", "tool_calls": []},
          {"role": "user", "content": "u"}])");
  const ordered_json vars =
      ChatTemplateVariables(messages, nullptr, true, ordered_json{{"bos_token", "<s>"}},
                            ordered_json{{"bos_token", "B"}, {"k", 1}});
  EXPECT_EQ(
      vars["messages"][0].dump(),
      R"({"thinking":"r","role":"assistant","reasoning":"r","tool_calls":[],"reasoning_content":"r"})");
  EXPECT_EQ(vars["messages"][1].dump(), R"({"role":"user","content":"u"})");
  EXPECT_TRUE(vars["tools"].is_null());
  EXPECT_EQ(vars["add_generation_prompt"], true);
  EXPECT_EQ(vars["bos_token"], "B");  // kwargs override special tokens, as in transformers
  EXPECT_EQ(vars["k"], 1);
}

}  // namespace
}  // namespace moelora::tok
