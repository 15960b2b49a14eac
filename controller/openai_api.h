// The OpenAI-compatible HTTP API (--http-port) over the same controller as gRPC: the scheduler,
// adapters, tokens and metrics are shared.
//
//   GET  /v1/models[/ID]           the base model (--served-model-name) and every adapter
//   POST /v1/completions           prompt as text, token ids, or a list of either
//   POST /v1/chat/completions      messages rendered by the model's chat template
//   POST /v1/load_lora_adapter     vLLM's {"lora_name", "lora_path"} (admin token)
//   POST /v1/unload_lora_adapter   vLLM's {"lora_name"} (admin token)
//   GET  /health                   200 while gRPC's health says SERVING, else 503
//   GET  /metrics                  the controller's Prometheus metrics (as on --metrics-port)
//
// `model` names an adapter or the base. Sampling: max_tokens (max_completion_tokens),
// temperature, top_p, seed, stop, n, logprobs of the sampled tokens, stream (server-sent
// events ending in "data: [DONE]") with stream_options.include_usage, and vLLM's top_k,
// ignore_eos, stop_token_ids. What the engine cannot do (penalties, logit_bias, top
// alternatives in logprobs, echo, suffix, ...) is refused with 400 naming the parameter, never
// ignored. Errors have OpenAI's shape {"error": {"message", "type", "param", "code"}}.
//
// A generation runs like a gRPC Generate: its body is parsed (within a JSON budget), rendered
// and tokenized on the controller's preparation threads (Controller::Prepare), its requests'
// listeners post to a few pump threads that turn tokens into text and answer; nothing holds a
// thread while it waits. Tokens are checked at the headers (Admit), before any body is read.
//
// Thread-safety: Handle may be called from any thread.
#ifndef MOELORA_CONTROLLER_OPENAI_API_H_
#define MOELORA_CONTROLLER_OPENAI_API_H_

#include <atomic>
#include <memory>
#include <optional>
#include <string>

#include "absl/status/statusor.h"
#include "common/work_pool.h"
#include "controller/auth.h"
#include "controller/controller.h"
#include "controller/http_server.h"
#include "controller/json_input.h"
#include "controller/metrics.h"
#include "nlohmann/json.hpp"
#include "tokenizer/chat_template.h"

namespace moelora {

struct OpenAiOptions {
  std::string served_model_name;  // `model` for the base
  std::string model_path;         // /v1/models' root for the base
  // The model's chat template (null: /v1/chat/completions answers 400 saying so).
  std::shared_ptr<const tok::ChatTemplate> chat_template;
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();
  // generation_config.json's sampling defaults, used where a request sets none (as vLLM does);
  // else OpenAI's (temperature 1, top_p 1).
  std::optional<double> default_temperature, default_top_p;
  std::optional<int> default_top_k;
  // --reasoning-parser and --tool-call-parser (chat_output/output_parser.h); "" for none.
  std::string reasoning_parser, tool_call_parser;
  int pump_threads = 4;
  int max_n = 16;   // `n` (choices per prompt) at most
  JsonBudget json;  // a request body's nesting and values at most
  // GET /metrics on this port: kOpen (as vLLM: the inference gateway's scraper reads it with no
  // token), kToken (a token of either role, with --auth-tokens-file), kOff (404: --metrics-port
  // only).
  enum class Metrics { kOpen, kToken, kOff } metrics = Metrics::kOpen;
};

// Reads generation_config.json's temperature, top_p and top_k from `model_dir` into `o` (absent
// file or keys: nothing set).
void ReadSamplingDefaults(const std::string& model_dir, OpenAiOptions* o);

class OpenAiApi {
 public:
  OpenAiApi(Controller* controller, ControllerMetrics* metrics, const TokenAuth* auth,
            OpenAiOptions options);
  ~OpenAiApi();
  // HttpServer's handler.
  void Handle(std::shared_ptr<HttpExchange> ex);
  // HttpServer's admit (the headers, before the body): the token, as the route asks for it.
  [[nodiscard]] absl::Status Admit(const HttpExchange& ex) const;
  // What /health says (the binary sets it with gRPC's health: serving, and preloads done).
  void set_healthy(bool healthy) { healthy_ = healthy; }

 private:
  // One completion or chat completion call (openai_generation.cc).
  class Generation;
  // Prepares and submits `ex`'s call (a preparation thread); its answer follows by itself.
  void Generate(const std::shared_ptr<HttpExchange>& ex, bool chat);
  void Answer(const std::shared_ptr<HttpExchange>& ex, const std::string& route, int status,
              std::string content_type, std::string body);
  void AnswerError(const std::shared_ptr<HttpExchange>& ex, const std::string& route,
                   const absl::Status& status, const std::string& param = "");
  struct Route {
    const char* path;
    const char* method;
    const char* name;
    bool admin;
  };
  // The route of `path` (null: none); /v1/models/{id} sets `model_id`.
  static const Route* FindRoute(const std::string& path, std::string* model_id);
  // POST /v1/load_lora_adapter or /v1/unload_lora_adapter (a preparation thread).
  void AdapterCall(const std::shared_ptr<HttpExchange>& ex, bool load);
  // The model list, or the model `id` (404 when there is none).
  void Models(const std::shared_ptr<HttpExchange>& ex, const std::string& id);

  Controller* const controller_;
  ControllerMetrics* const metrics_;
  const TokenAuth* const auth_;
  const OpenAiOptions options_;
  std::atomic<bool> healthy_{false};
  WorkPool pump_;
  // vLLM's load/unload calls (an adapter load may take seconds): apart from the preparation
  // threads, so that loads never hold up requests.
  WorkPool admin_;
};

}  // namespace moelora

#endif  // MOELORA_CONTROLLER_OPENAI_API_H_
