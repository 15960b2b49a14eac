// /v1/chat/completions with --reasoning-parser qwen3 and --tool-call-parser hermes, over the real
// HTTP server and OpenAI API on loopback and a real Controller whose worker group is the unit
// tests' fake, scripted to emit the tokens of a chosen answer (the qwen3_moe fixture's byte-level
// tokenizer encodes any text): the message's reasoning, tool calls and finish reason, and a
// stream whose deltas add up to the same answer.
#include <cstdlib>
#include <filesystem>
#include <memory>
#include <string>

#include "absl/strings/str_split.h"
#include "controller/controller.h"
#include "controller/http_server.h"
#include "controller/openai_api.h"
#include "gtest/gtest.h"
#include "nlohmann/json.hpp"
#include "schema/model_info.h"
#include "tests/testing/http_get.h"
#include "tests/testing/temp_dir.h"
#include "tests/unit/controller/fake_worker_group.h"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

namespace moelora {
namespace {

using json = nlohmann::json;

std::string Post(int port, const std::string& path, const std::string& body) {
  return ::moelora::testing::HttpRequest(port, "POST", path, body);
}

class ChatOutputApiTest : public ::testing::Test {
 protected:
  void SetUp() override {
    registry_ = *Registry::Open(tmp_.path());
    const std::string model = std::string(MOELORA_TEST_DATA_DIR) + "/qwen3_moe/model";
    ControllerOptions o;
    o.adapter_root = MOELORA_TEST_DATA_DIR;
    o.clock = &clock_;
    o.model = *ReadModelInfo(model);
    o.tokenizer = *tok::Tokenizer::Load(model);
    o.eos_token_ids = o.tokenizer->eos_token_ids();
    tokenizer_ = o.tokenizer.get();
    controller_ = std::make_unique<Controller>(o, registry_.get(), &group_, &metrics_);
    ASSERT_TRUE(controller_->OnGroupReady().ok());
    controller_->Start();
    OpenAiOptions oo;
    oo.model_path = model;
    oo.chat_template = *tok::ChatTemplate::Parse(*tok::ReadChatTemplate(model));
    oo.special_tokens = *tok::ReadSpecialTokenVariables(model);
    oo.reasoning_parser = "qwen3";
    oo.tool_call_parser = "hermes";
    Serve(oo);
  }
  // The OpenAI API with `oo` on a fresh HTTP server (replacing any).
  void Serve(OpenAiOptions oo) {
    http_.reset();
    api_.reset();
    oo.served_model_name = "base";
    api_ = std::make_unique<OpenAiApi>(controller_.get(), &metrics_, nullptr, oo);
    api_->set_healthy(true);
    HttpServer::Options ho;
    ho.host = "127.0.0.1";
    ho.port = 0;
    http_ = *HttpServer::Start(
        ho, [a = api_.get()](std::shared_ptr<HttpExchange> ex) { a->Handle(std::move(ex)); });
  }
  void TearDown() override {
    http_.reset();
    api_.reset();
    controller_.reset();
  }
  // The fake answers `text` (then the end-of-turn token).
  void Answer(const std::string& text) {
    auto ids = tokenizer_->Encode(text, false);
    ASSERT_TRUE(ids.ok());
    ids->push_back(tokenizer_->eos_token_ids().at(0));
    group_.ScriptTokens(*ids);
  }
  json Request(bool stream, bool tools = true) const {
    json j = {{"model", "base"},
              {"messages", {{{"role", "user"}, {"content", "Weather in Paris?"}}}},
              {"stream", stream}};
    if (tools) {
      j["tools"] = json::parse(R"([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}])");
    }
    return j;
  }
  // A stream's deltas added up into one message, and its finish reason.
  json Streamed(const json& req, std::string* finish) {
    const std::string body = Post(http_->port(), "/v1/chat/completions", req.dump());
    json msg = {{"reasoning", ""}, {"content", ""}, {"tool_calls", json::array()}};
    for (absl::string_view line : absl::StrSplit(body, '\n')) {
      if (!absl::ConsumePrefix(&line, "data: ") || line == "[DONE]") continue;
      const json ev = json::parse(line);
      const json& ch = ev["choices"][0];
      if (!ch["finish_reason"].is_null()) *finish = ch["finish_reason"];
      const json& d = ch["delta"];
      if (d.contains("reasoning")) {
        msg["reasoning"] = msg["reasoning"].get<std::string>() + d["reasoning"].get<std::string>();
        EXPECT_EQ(d["reasoning"], d["reasoning_content"]);
      }
      if (d.contains("content") && d["content"].is_string()) {
        msg["content"] = msg["content"].get<std::string>() + d["content"].get<std::string>();
      }
      if (d.contains("tool_calls")) {
        // As clients do: a call's first delta (its id and name) opens it, later ones with its
        // index add to its arguments.
        for (const json& c : d["tool_calls"]) {
          const size_t index = c["index"];
          json& calls = msg["tool_calls"];
          if (index == calls.size()) {
            EXPECT_TRUE(c.contains("id") && c["function"].contains("name")) << c.dump();
            EXPECT_EQ(c["function"]["arguments"], "");  // the arguments follow
            calls.push_back(c);
          } else {
            EXPECT_LT(index, calls.size());
            if (index >= calls.size()) continue;
            EXPECT_FALSE(c.contains("id"));
            calls[index]["function"]["arguments"] =
                calls[index]["function"]["arguments"].get<std::string>() +
                c["function"]["arguments"].get<std::string>();
          }
        }
      }
    }
    return msg;
  }

  ::moelora::testing::TempDir tmp_;
  std::unique_ptr<Registry> registry_;
  ControllerMetrics metrics_;
  SimulatedClock clock_;
  testing::FakeWorkerGroup group_{4, &clock_, /*max_model_len=*/1024};
  std::unique_ptr<Controller> controller_;
  std::unique_ptr<OpenAiApi> api_;
  std::unique_ptr<HttpServer> http_;
  const tok::Tokenizer* tokenizer_ = nullptr;
};

TEST_F(ChatOutputApiTest, ReasoningAndAToolCallWholeAndStreamed) {
  Answer(
      "<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", "
      "\"arguments\": {\"city\": \"Paris\"}}\n</tool_call>");
  const std::string raw = Post(http_->port(), "/v1/chat/completions", Request(false).dump());
  const json whole = json::parse(raw);
  ASSERT_TRUE(whole.contains("choices")) << raw;
  const json& choice = whole["choices"][0];
  EXPECT_EQ(choice["finish_reason"], "tool_calls");
  const json& m = choice["message"];
  EXPECT_EQ(m["reasoning"], "\nThe user wants the weather.\n");
  EXPECT_EQ(m["reasoning_content"], m["reasoning"]);
  EXPECT_TRUE(m["content"].is_null());
  ASSERT_EQ(m["tool_calls"].size(), 1u);
  EXPECT_EQ(m["tool_calls"][0]["type"], "function");
  EXPECT_EQ(m["tool_calls"][0]["function"]["name"], "get_weather");
  EXPECT_EQ(json::parse(m["tool_calls"][0]["function"]["arguments"].get<std::string>()),
            json::parse(R"({"city": "Paris"})"));
  std::string finish;
  const json s = Streamed(Request(true), &finish);
  EXPECT_EQ(finish, "tool_calls");
  EXPECT_EQ(s["reasoning"], m["reasoning"]);
  EXPECT_EQ(s["content"], "");
  ASSERT_EQ(s["tool_calls"].size(), 1u);
  EXPECT_EQ(s["tool_calls"][0]["function"], m["tool_calls"][0]["function"]);
  EXPECT_EQ(s["tool_calls"][0]["id"].get<std::string>().rfind("chatcmpl-tool-", 0), 0u);
}

// Without tools in the request the call stays text; a malformed call stays text too.
TEST_F(ChatOutputApiTest, WithoutToolsOrWithABadCallTheTextIsContent) {
  const std::string text = "<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>";
  Answer(text);
  json whole = json::parse(
      Post(http_->port(), "/v1/chat/completions", Request(false, /*tools=*/false).dump()));
  EXPECT_EQ(whole["choices"][0]["message"]["content"], text);
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "stop");
  EXPECT_FALSE(whole["choices"][0]["message"].contains("tool_calls"));
  const std::string bad =
      "Calling: <tool_call>{\"name\": \"get_weather\", \"arguments\": {</tool_call>";
  Answer(bad);
  whole = json::parse(Post(http_->port(), "/v1/chat/completions", Request(false).dump()));
  EXPECT_EQ(whole["choices"][0]["message"]["content"], bad);
  EXPECT_EQ(whole["choices"][0]["finish_reason"], "stop");
  std::string finish;
  const json s = Streamed(Request(true), &finish);
  EXPECT_EQ(s["content"], bad);
  EXPECT_EQ(finish, "stop");
}

// An earlier turn's reasoning given back under vLLM's `reasoning` reaches the template as
// `reasoning_content`, the name Qwen3's templates read, as transformers aliases it
// (tokenizer/chat_template.cc), through the HTTP API (a template that prints it, here).
TEST_F(ChatOutputApiTest, ReasoningGivenBackReachesTheTemplate) {
  OpenAiOptions oo;
  oo.chat_template = *tok::ChatTemplate::Parse(
      "{% for m in messages %}[{{ m.role }}|{{ m.reasoning_content }}|{{ m.content }}]"
      "{% endfor %}");
  Serve(oo);
  Answer("ok");
  json req = {{"model", "base"},
              {"messages",
               {{{"role", "user"}, {"content", "2+2?"}},
                {{"role", "assistant"}, {"content", "4"}, {"reasoning", "adding"}},
                {{"role", "user"}, {"content", "and 3+3?"}}}}};
  const json whole = json::parse(Post(http_->port(), "/v1/chat/completions", req.dump()));
  ASSERT_TRUE(whole.contains("choices")) << whole.dump();
  const std::string prompt = tokenizer_->Decode(group_.last_prompt());
  EXPECT_NE(prompt.find("[assistant|adding|4]"), std::string::npos) << prompt;
}

}  // namespace
}  // namespace moelora
