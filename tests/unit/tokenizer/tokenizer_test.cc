// The tokenizer against Hugging Face `tokenizers`: the committed tiny tokenizer and its reference
// ids (tools/make_tokenizers.py tiny), and, when MOELORA_TOKENIZER_CORPUS names the directory
// that `make_tokenizers.py real` wrote, the Qwen3 and Qwen3.5 vocabularies on the full corpus
// (tests/integration/tokenizer_corpus_test.sh sets it in CI). Plus UTF-8, stream and stop-string
// behaviour, and the refusals.
#include "tokenizer/tokenizer.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "tokenizer/text_stream.h"

namespace moelora::tok {
namespace {

using ::testing::HasSubstr;
namespace fs = std::filesystem;
const std::string kData = MOELORA_TEST_DATA_DIR;

std::unique_ptr<Tokenizer> LoadOrDie(const std::string& path) {
  auto t = Tokenizer::Load(path);
  EXPECT_TRUE(t.ok()) << t.status();
  return t.ok() ? std::move(*t) : nullptr;
}

std::vector<nlohmann::json> ReadLines(const std::string& path) {
  std::ifstream in(path);
  EXPECT_TRUE(in.good()) << path;
  std::vector<nlohmann::json> rows;
  std::string line;
  while (std::getline(in, line)) rows.push_back(nlohmann::json::parse(line));
  return rows;
}

std::string Nfc(const Tokenizer& t, const std::string& s) {
  // NFC through the tokenizer's own round trip is what is under test; the reference decoded text
  // from `tokenizers` is the independent NFC.
  return t.Decode(*t.Encode(s));
}

// Compares every row's ids and decoded text; returns the number of rows checked.
int CheckCorpus(const Tokenizer& t, const std::vector<nlohmann::json>& rows,
                const std::string& ids_key, const std::string& decoded_key) {
  int mismatched = 0, checked = 0;
  for (size_t i = 0; i < rows.size(); ++i) {
    const std::string text = rows[i]["text"].get<std::string>();
    const std::vector<int32_t> want = rows[i][ids_key].get<std::vector<int32_t>>();
    auto got = t.Encode(text);
    EXPECT_TRUE(got.ok()) << got.status();
    if (!got.ok()) continue;
    ++checked;
    if (*got != want && ++mismatched <= 5) {
      ADD_FAILURE() << ids_key << " row " << i << ": ids differ for "
                    << nlohmann::json(text).dump().substr(0, 200) << "\n  got  "
                    << nlohmann::json(*got).dump().substr(0, 300) << "\n  want "
                    << nlohmann::json(want).dump().substr(0, 300);
    }
    const std::string decoded = t.Decode(want);
    EXPECT_EQ(decoded, rows[i][decoded_key].get<std::string>()) << ids_key << " row " << i;
    // decode(encode(s)) == s, up to the NFC normalizer (the reference decode is NFC(s)).
    if (decoded != text) {
      EXPECT_EQ(Nfc(t, decoded), decoded) << "row " << i << ": the round trip is not NFC-stable";
    }
  }
  EXPECT_EQ(mismatched, 0) << ids_key << ": " << mismatched << " of " << checked
                           << " strings differ";
  return checked;
}

TEST(TokenizerTest, TinyMatchesHuggingFaceOnCorpus) {
  auto t = LoadOrDie(kData + "/tokenizer/tiny_tokenizer.json");
  ASSERT_NE(t, nullptr);
  const auto rows = ReadLines(kData + "/tokenizer/tiny_corpus.jsonl");
  ASSERT_GE(rows.size(), 300u);
  EXPECT_EQ(CheckCorpus(*t, rows, "ids", "decoded"), static_cast<int>(rows.size()));
}

TEST(TokenizerTest, RealVocabulariesMatchHuggingFace) {
  const char* dir = std::getenv("MOELORA_TOKENIZER_CORPUS");
  if (dir == nullptr)
    GTEST_SKIP() << "MOELORA_TOKENIZER_CORPUS is not set (tokenizer_corpus_test.sh sets it)";
  const auto rows = ReadLines(absl::StrCat(dir, "/corpus.jsonl"));
  ASSERT_GE(rows.size(), 2000u);
  for (const std::string name : {"qwen3", "qwen3_5"}) {
    auto t = LoadOrDie(absl::StrCat(dir, "/", name));
    ASSERT_NE(t, nullptr);
    EXPECT_EQ(CheckCorpus(*t, rows, name, name + "_decoded"), static_cast<int>(rows.size()))
        << name;
  }
}

TEST(TokenizerTest, ModelDirectoryGivesEosFromGenerationAndTokenizerConfig) {
  const fs::path d = fs::path(testing::TempDir()) / "tok_model_dir";
  fs::create_directories(d);
  fs::copy_file(kData + "/tokenizer/tiny_tokenizer.json", d / "tokenizer.json",
                fs::copy_options::overwrite_existing);
  std::ofstream(d / "generation_config.json") << R"({"eos_token_id": [0, 2], "bos_token_id": 1})";
  std::ofstream(d / "tokenizer_config.json") << R"({"eos_token": {"content": "<|im_start|>"}})";
  auto t = LoadOrDie(d.string());
  ASSERT_NE(t, nullptr);
  const int32_t im_start = *t->TokenToId("<|im_start|>");
  EXPECT_THAT(t->eos_token_ids(), ::testing::ElementsAre(0, 2, im_start));
  EXPECT_EQ(t->bos_token_id(), 1);
  EXPECT_TRUE(t->IsSpecial(im_start));
  EXPECT_FALSE(t->IsSpecial(*t->TokenToId("a")));
}

TEST(TokenizerTest, SpecialTokensAreMatchedBeforePreTokenizationAndSkippedOnRequest) {
  auto t = LoadOrDie(kData + "/tokenizer/tiny_tokenizer.json");
  ASSERT_NE(t, nullptr);
  const int32_t end = *t->TokenToId("<|im_end|>");
  auto ids = t->Encode("hi<|im_end|>there");
  ASSERT_TRUE(ids.ok());
  EXPECT_EQ(std::count(ids->begin(), ids->end(), end), 1);
  EXPECT_EQ(t->Decode(*ids), "hi<|im_end|>there");
  EXPECT_EQ(t->Decode(*ids, /*skip_special=*/true), "hithere");
}

TEST(TokenizerTest, InvalidUtf8IsRefusedWithTheOffset) {
  auto t = LoadOrDie(kData + "/tokenizer/tiny_tokenizer.json");
  ASSERT_NE(t, nullptr);
  EXPECT_THAT(t->Encode("ok\xC3(").status().message(), HasSubstr("byte offset 2"));
}

TEST(TokenizerTest, UnimplementedComponentsAreRefusedByName) {
  const fs::path d = fs::path(testing::TempDir()) / "tok_bad";
  fs::create_directories(d);
  std::ifstream in(kData + "/tokenizer/tiny_tokenizer.json");
  const nlohmann::json good = nlohmann::json::parse(in);
  struct Case {
    std::string pointer;
    nlohmann::json value;
    std::string message;
  };
  const std::vector<Case> cases = {
      {"/normalizer", {{"type", "Lowercase"}}, "normalizer \"Lowercase\""},
      {"/pre_tokenizer", {{"type", "Whitespace"}}, "pre-tokenizer \"Whitespace\""},
      {"/decoder", {{"type", "WordPiece"}}, "decoder \"WordPiece\""},
      {"/model/type", "Unigram", "model \"Unigram\""},
      {"/model/byte_fallback", true, "byte_fallback"},
      {"/truncation", {{"max_length", 8}}, "\"truncation\""},
      {"/post_processor", {{"type", "BertProcessing"}}, "post-processor \"BertProcessing\""},
  };
  for (const Case& c : cases) {
    nlohmann::json j = good;
    j[nlohmann::json::json_pointer(c.pointer)] = c.value;
    std::ofstream(d / "tokenizer.json") << j.dump();
    auto t = Tokenizer::Load(d.string());
    ASSERT_FALSE(t.ok()) << c.pointer;
    EXPECT_THAT(t.status().message(), HasSubstr(c.message)) << c.pointer;
    EXPECT_THAT(t.status().message(), HasSubstr("tokenizer.json")) << c.pointer;
  }
  EXPECT_EQ(Tokenizer::Load((d / "missing").string()).status().code(), absl::StatusCode::kNotFound);
  std::ofstream(d / "tokenizer.json") << "{not json";
  EXPECT_EQ(Tokenizer::Load(d.string()).status().code(), absl::StatusCode::kInvalidArgument);
}

TEST(Utf8Test, LossyDecodingReplacesMaximalSubpartsAsPythonDoes) {
  // Expected strings: Python's bytes.decode("utf-8", "replace"), which follows the same
  // Unicode recommendation as Rust's from_utf8_lossy.
  const std::vector<std::pair<std::string, std::string>> cases = {
      {"a\x80"
       "b",
       "a\xEF\xBF\xBD"
       "b"},
      {"\xE2\x82", "\xEF\xBF\xBD"},
      {"\xE2\x82"
       "a",
       "\xEF\xBF\xBD"
       "a"},
      {"\xF0\x9F\x98\x80", "\xF0\x9F\x98\x80"},
      {"\xF0\x9F\x98", "\xEF\xBF\xBD"},
      {"\xED\xA0\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},  // a surrogate
      {"\xC0\xAF", "\xEF\xBF\xBD\xEF\xBF\xBD"},
      {"\xF4\x90\x80\x80", "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"},
  };
  for (const auto& [in, want] : cases) {
    std::string out;
    EXPECT_EQ(AppendUtf8Lossy(in, true, &out), in.size());
    EXPECT_EQ(out, want);
    // Byte by byte, not final until the end: the same text.
    std::string pieces, pending;
    for (char c : in) {
      pending.push_back(c);
      pending.erase(0, AppendUtf8Lossy(pending, false, &pieces));
    }
    AppendUtf8Lossy(pending, true, &pieces);
    EXPECT_EQ(pieces, want);
  }
  size_t bad = 0;
  EXPECT_FALSE(IsValidUtf8("ab\xE2\x82", &bad));
  EXPECT_EQ(bad, 2u);
  EXPECT_TRUE(IsValidUtf8("\xE4\xB8\x80"));
}

TEST(TextStreamTest, DeltasAreValidUtf8AndSumToTheDecodedText) {
  auto t = LoadOrDie(kData + "/tokenizer/tiny_tokenizer.json");
  ASSERT_NE(t, nullptr);
  // Characters outside the tiny vocabulary's merges come out byte by byte.
  const std::string text = "h\xC3\xA9llo \xE4\xB8\x96\xE7\x95\x8C \xF0\x9F\x98\x80!";
  auto ids = t->Encode(text);
  ASSERT_TRUE(ids.ok());
  TextStream s(t.get(), {}, true);
  std::string all;
  int split_chars = 0;
  for (int32_t id : *ids) {
    EXPECT_FALSE(s.Add(id));
    const std::string d = s.TakeDelta();
    EXPECT_TRUE(IsValidUtf8(d)) << nlohmann::json(all).dump();
    if (d.empty()) ++split_chars;
    all += d;
  }
  all += s.Finish();
  EXPECT_EQ(all, text);
  EXPECT_GT(split_chars, 0) << "the test text should split a character across tokens";
}

TEST(TextStreamTest, StopStringsEndTheTextAndAreNeverStreamed) {
  auto t = LoadOrDie(kData + "/tokenizer/tiny_tokenizer.json");
  ASSERT_NE(t, nullptr);
  const std::string text = "the quick brown fox. END here";
  auto ids = t->Encode(text);
  ASSERT_TRUE(ids.ok());
  TextStream s(t.get(), {"x. E", "nothing"}, true);
  std::string all;
  size_t stopped_at = 0;
  for (size_t i = 0; i < ids->size(); ++i) {
    const bool stop = s.Add((*ids)[i]);
    all += s.TakeDelta();
    EXPECT_EQ(all.find("x. "), std::string::npos)
        << "a prefix of the stop string was streamed: " << all;
    if (stop) {
      stopped_at = i;
      break;
    }
  }
  all += s.Finish();
  EXPECT_TRUE(s.stopped());
  EXPECT_EQ(s.matched_stop(), "x. E");
  EXPECT_EQ(all, "the quick brown fo");
  EXPECT_LT(stopped_at, ids->size() - 1);
  // A held-back prefix that does not complete is released at the end.
  TextStream u(t.get(), {"fox!"}, true);
  for (int32_t id : *ids) u.Add(id);
  EXPECT_EQ(u.TakeDelta() + u.Finish(), text);
}

TEST(TextStreamTest, RandomIdsStreamTheSameTextAsOneDecode) {
  auto t = LoadOrDie(kData + "/tokenizer/tiny_tokenizer.json");
  ASSERT_NE(t, nullptr);
  std::mt19937 rng(5);
  for (int round = 0; round < 200; ++round) {
    std::vector<int32_t> ids(1 + rng() % 30);
    for (int32_t& id : ids) id = static_cast<int32_t>(rng() % t->vocab_size());
    TextStream s(t.get(), {}, false);
    std::string all;
    for (int32_t id : ids) {
      s.Add(id);
      const std::string d = s.TakeDelta();
      ASSERT_TRUE(IsValidUtf8(d));
      all += d;
    }
    all += s.Finish();
    EXPECT_EQ(all, t->Decode(ids)) << round;
  }
}

}  // namespace
}  // namespace moelora::tok
