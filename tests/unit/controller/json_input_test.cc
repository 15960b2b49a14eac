// ParseClientJson against nlohmann's own parser (the same documents, key order kept, the last of
// repeated keys kept), its bounds (depth, values: refused with the bound named, not a crash), and
// JsonText / Printable on bytes that are not UTF-8.
#include "controller/json_input.h"

#include <string>

#include "gtest/gtest.h"

namespace moelora {
namespace {

using nlohmann::ordered_json;

TEST(JsonInputTest, BuildsWhatNlohmannBuilds) {
  const std::string text =
      R"({"z": 1, "a": [true, null, 2.5, -3, 18446744073709551615, "s\u00e9"], "m": {"k": {}}, )"
      R"("e": [], "z2": "x"})";
  auto j = ParseClientJson(text, JsonBudget{});
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(*j, ordered_json::parse(text));
  EXPECT_EQ(j->dump(), ordered_json::parse(text).dump());  // the same key order
  EXPECT_EQ(j->begin().key(), "z");
}

TEST(JsonInputTest, TheLastOfRepeatedKeysWinsInItsFirstPlace) {
  auto j = ParseClientJson(R"({"a": 1, "b": 2, "a": 3})", JsonBudget{});
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->dump(), ordered_json::parse(R"({"a": 1, "b": 2, "a": 3})").dump());
  EXPECT_EQ((*j)["a"], 3);
  EXPECT_EQ(j->size(), 2u);
}

TEST(JsonInputTest, DeepNestingIsRefusedByItsBound) {
  const std::string deep = std::string(200000, '[') + std::string(200000, ']');
  auto j = ParseClientJson(deep, JsonBudget{});
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("deeper than 64"), std::string::npos) << j.status();
  std::string objects;
  for (int i = 0; i < 100000; ++i) objects += "{\"a\":";
  EXPECT_FALSE(ParseClientJson(objects, JsonBudget{}).ok());
  // Exactly at the bound: accepted.
  const std::string at = std::string(64, '[') + std::string(64, ']');
  EXPECT_TRUE(ParseClientJson(at, JsonBudget{}).ok());
}

TEST(JsonInputTest, ValuesPastTheBudgetAreRefused) {
  std::string many = "[";
  for (int i = 0; i < 5000; ++i) many += "0,";
  many += "0]";
  JsonBudget b;
  b.max_values = 1000;
  auto j = ParseClientJson(many, b);
  ASSERT_FALSE(j.ok());
  EXPECT_NE(j.status().message().find("more than 1000 JSON values"), std::string::npos);
  b.max_values = 5002;
  EXPECT_TRUE(ParseClientJson(many, b).ok());
}

TEST(JsonInputTest, ManyKeysParseWithEveryKeyFound) {
  std::string text = "{";
  for (int i = 0; i < 200000; ++i)
    text += "\"k" + std::to_string(i) + "\":" + std::to_string(i) + ",";
  text += "\"last\":0}";
  auto j = ParseClientJson(text, JsonBudget{});
  ASSERT_TRUE(j.ok()) << j.status();
  EXPECT_EQ(j->size(), 200001u);
  EXPECT_EQ(j->begin().key(), "k0");
  EXPECT_EQ(j->back(), 0);
}

TEST(JsonInputTest, NotJsonSaysWhere) {
  for (const char* bad : {"", "{", "{\"a\" 1}", "[1,]", "nul", "{} x", "\"\xff"}) {
    auto j = ParseClientJson(bad, JsonBudget{});
    EXPECT_FALSE(j.ok()) << bad;
    // The message is printable whatever the input.
    for (char c : std::string(j.status().message())) {
      EXPECT_TRUE(c >= 0x20 && c < 0x7f) << bad;
    }
  }
}

TEST(JsonInputTest, JsonTextReplacesInvalidUtf8) {
  nlohmann::json j = {{"path", std::string("/\xff\xfe")}};
  EXPECT_THROW((void)j.dump(), nlohmann::json::type_error);  // what JsonText exists for
  EXPECT_EQ(JsonText(j), "{\"path\":\"/\xef\xbf\xbd\xef\xbf\xbd\"}");
  EXPECT_EQ(Printable("a\xff\n", 10), "a\\xff\\x0a");
  EXPECT_EQ(Printable(std::string(300, 'x'), 4), "xxxx...");
}

}  // namespace
}  // namespace moelora
