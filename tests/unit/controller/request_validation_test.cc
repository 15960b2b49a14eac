// ValidateGenerateRequest alone: every refusal names its field and bound; a text prompt is
// encoded with the model's tokenizer; EOS ids join the stop tokens unless ignore_eos.
#include "controller/request_validation.h"

#include "gmock/gmock.h"
#include "gtest/gtest.h"
#include "tests/testing/status_matchers.h"

namespace moelora {
namespace {

using ::moelora::testing::StatusIs;

std::string Data(const std::string& rel) { return std::string(MOELORA_TEST_DATA_DIR) + "/" + rel; }
using ::testing::ElementsAre;
using ::testing::HasSubstr;

v1::GenerateRequest Ids(std::vector<int32_t> ids, int max_tokens) {
  v1::GenerateRequest r;
  for (int32_t t : ids) r.add_prompt_token_ids(t);
  r.set_max_tokens(max_tokens);
  return r;
}

TEST(RequestValidationTest, RefusalsNameTheFieldAndTheBound) {
  RequestLimits l;
  l.vocab_size = 100;
  l.max_model_len = 10;
  EXPECT_THAT(ValidateGenerateRequest(Ids({}, 1), l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("empty prompt")));
  EXPECT_THAT(ValidateGenerateRequest(Ids({1, 100}, 1), l),
              StatusIs(absl::StatusCode::kInvalidArgument,
                       HasSubstr("prompt_token_ids[1] = 100 is outside the vocabulary [0, 100)")));
  EXPECT_THAT(ValidateGenerateRequest(Ids({1, 2, 3}, 8), l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("must be in [1, 7]")));
  EXPECT_THAT(ValidateGenerateRequest(Ids({1}, 0), l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("max_tokens 0")));
  v1::GenerateRequest r = Ids({1}, 1);
  r.set_top_p(1.5f);
  EXPECT_THAT(ValidateGenerateRequest(r, l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("top_p in [0, 1]")));
  r = Ids({1}, 1);
  r.add_stop_token_ids(-1);
  EXPECT_THAT(ValidateGenerateRequest(r, l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stop token -1")));
  r = Ids({}, 1);
  r.set_prompt("hello");
  EXPECT_THAT(ValidateGenerateRequest(r, l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("no tokenizer.json")));
  r = Ids({1}, 1);
  r.add_stop("x");
  EXPECT_THAT(ValidateGenerateRequest(r, l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stop strings need")));
}

TEST(RequestValidationTest, TextPromptsAreEncodedAndEosJoinsTheStopTokens) {
  auto tok = tok::Tokenizer::Load(Data("qwen3_moe/model"));
  ASSERT_TRUE(tok.ok()) << tok.status();
  RequestLimits l;
  l.vocab_size = 384;
  l.max_model_len = 64;
  l.tokenizer = tok->get();
  l.eos_token_ids = {383};
  v1::GenerateRequest r;
  r.set_prompt("Hello, world");
  r.set_max_tokens(4);
  r.add_stop_token_ids(7);
  auto v = ValidateGenerateRequest(r, l);
  ASSERT_TRUE(v.ok()) << v.status();
  auto want = (*tok)->Encode("Hello, world");
  ASSERT_TRUE(want.ok());
  EXPECT_EQ(
      std::vector<int32_t>(v->req.prompt_token_ids().begin(), v->req.prompt_token_ids().end()),
      *want);
  EXPECT_TRUE(v->req.prompt().empty());
  EXPECT_THAT(v->req.stop_token_ids(), ElementsAre(7, 383));
  r.set_ignore_eos(true);
  v = ValidateGenerateRequest(r, l);
  ASSERT_TRUE(v.ok());
  EXPECT_THAT(v->req.stop_token_ids(), ElementsAre(7));
  // Both forms at once, too many or too long stop strings.
  r.add_prompt_token_ids(1);
  EXPECT_THAT(ValidateGenerateRequest(r, l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("not both")));
  r.clear_prompt_token_ids();
  for (int i = 0; i <= kMaxStopStrings; ++i) r.add_stop("s");
  EXPECT_THAT(ValidateGenerateRequest(r, l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("at most 16 stop strings")));
  r.clear_stop();
  r.add_stop(std::string(kMaxStopBytes + 1, 'x'));
  EXPECT_THAT(ValidateGenerateRequest(r, l),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("stop[0] must be 1..256")));
}

// Counts on the wire, before protobuf builds the message: what protobuf's own parser would read
// passes, one more stop string or image than the caps allow does not, nor do bytes that are not
// the wire format.
TEST(RequestValidationTest, WireCountsAreCheckedBeforeTheMessageIsBuilt) {
  RequestCaps caps;
  v1::GenerateRequest r;
  r.set_adapter("a");
  r.add_prompt_token_ids(1);
  r.add_prompt_token_ids(300);
  r.set_temperature(0.5f);
  r.set_seed(1ull << 60);
  for (int i = 0; i < caps.max_stop_strings; ++i) r.add_stop("");
  r.add_images("png");
  r.add_images("jpg");
  EXPECT_TRUE(CheckWireCaps(r.SerializeAsString(), caps, 2).ok());
  EXPECT_THAT(CheckWireCaps(r.SerializeAsString(), caps, 1),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--limit-mm-per-prompt")));
  r.add_stop("");
  EXPECT_THAT(CheckWireCaps(r.SerializeAsString(), caps, 2),
              StatusIs(absl::StatusCode::kInvalidArgument, HasSubstr("--max-stop-strings")));
  std::string truncated = r.SerializeAsString();
  truncated.pop_back();
  EXPECT_FALSE(CheckWireCaps(truncated, caps, 99).ok());
  EXPECT_FALSE(CheckWireCaps(std::string("\x0b\x01", 2), caps, 99).ok());  // a group
  EXPECT_TRUE(CheckWireCaps("", caps, 0).ok());
}

}  // namespace
}  // namespace moelora
