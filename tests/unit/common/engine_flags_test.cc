// --speculative-config as vLLM writes it, and what it refuses (naming the problem); the worker's
// command line carries it on.
#include "common/engine_flags.h"

#include <algorithm>
#include <string>
#include <utility>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace moelora {
namespace {

using ::testing::HasSubstr;

TEST(SpeculativeConfigTest, ParsesVllmsShapeAndRefusesWhatItDoesNotTake) {
  int k = -1;
  ASSERT_TRUE(ParseSpeculativeConfig("", &k).ok());
  EXPECT_EQ(k, 0);
  ASSERT_TRUE(ParseSpeculativeConfig(R"({"method": "mtp", "num_speculative_tokens": 3})", &k).ok());
  EXPECT_EQ(k, 3);
  const std::pair<const char*, const char*> bad[] = {
      {"mtp", "not a JSON object"},
      {R"({"method": "eagle", "num_speculative_tokens": 3})", "\"method\" must be \"mtp\""},
      {R"({"num_speculative_tokens": 3})", "\"method\" must be \"mtp\""},
      {R"({"method": "mtp"})", "num_speculative_tokens\" must be an integer in 1..16"},
      {R"({"method": "mtp", "num_speculative_tokens": 0})", "in 1..16"},
      {R"({"method": "mtp", "num_speculative_tokens": 17})", "in 1..16"},
      {R"({"method": "mtp", "num_speculative_tokens": 2.5})", "in 1..16"},
      {R"({"method": "mtp", "num_speculative_tokens": 2, "model": "x"})", "\"model\" is not taken"},
  };
  for (const auto& [text, why] : bad) {
    k = 7;
    const absl::Status s = ParseSpeculativeConfig(text, &k);
    EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << text;
    EXPECT_THAT(std::string(s.message()), HasSubstr(why)) << text;
    EXPECT_THAT(std::string(s.message()), HasSubstr("--speculative-config")) << text;
    EXPECT_EQ(k, 0) << text;
  }
}

TEST(SpeculativeConfigTest, TheWorkersCommandLineCarriesIt) {
  EngineFlags f;
  auto args = EngineFlagArgs(f);
  EXPECT_EQ(std::find(args.begin(), args.end(), "--speculative-config"), args.end());
  f.num_speculative_tokens = 2;
  args = EngineFlagArgs(f);
  auto it = std::find(args.begin(), args.end(), "--speculative-config");
  ASSERT_NE(it, args.end());
  ASSERT_NE(it + 1, args.end());
  int k = 0;
  ASSERT_TRUE(ParseSpeculativeConfig(*(it + 1), &k).ok()) << *(it + 1);
  EXPECT_EQ(k, 2);
}

}  // namespace
}  // namespace moelora
