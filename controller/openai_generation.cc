// The OpenAI-compatible API's completion and chat completion calls (OpenAiApi::Generation).
#include <atomic>
#include <chrono>
#include <memory>
#include <random>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "chat_output/output_parser.h"
#include "common/status_macros.h"
#include "controller/openai_api.h"
#include "controller/openai_internal.h"
#include "controller/token_feed.h"

namespace moelora {
namespace {

using nlohmann::json;
using nlohmann::ordered_json;

// OpenAI leaves seed 0 a seed like any other; the engine reads 0 as "random".
constexpr uint64_t kSeedForZero = 0x9E3779B97F4A7C15ull;

std::string RandomId(const char* prefix) {
  static thread_local std::mt19937_64 rng{std::random_device{}()};
  char buf[17];
  std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(rng()));
  return absl::StrCat(prefix, buf);
}

// A request body's parameters, read with their types checked: the first problem is kept and
// names the parameter.
class Params {
 public:
  explicit Params(const ordered_json& j) : j_(j) {}
  const ordered_json* Get(const char* k) const {
    auto it = j_.find(k);
    return it == j_.end() || it->is_null() ? nullptr : &*it;
  }
  double Number(const char* k, double def) {
    const ordered_json* v = Get(k);
    if (v == nullptr) return def;
    if (!v->is_number()) return Bad(k, "must be a number"), def;
    return v->get<double>();
  }
  int64_t Int(const char* k, int64_t def) {
    const ordered_json* v = Get(k);
    if (v == nullptr) return def;
    if (!v->is_number_integer()) return Bad(k, "must be an integer"), def;
    if (v->is_number_unsigned() && v->get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)) {
      return Bad(k, "is out of range"), def;
    }
    return v->get<int64_t>();
  }
  bool Bool(const char* k, bool def) {
    const ordered_json* v = Get(k);
    if (v == nullptr) return def;
    if (!v->is_boolean()) return Bad(k, "must be true or false"), def;
    return v->get<bool>();
  }
  std::string Str(const char* k, std::string def) {
    const ordered_json* v = Get(k);
    if (v == nullptr) return def;
    if (!v->is_string()) return Bad(k, "must be a string"), def;
    return v->get<std::string>();
  }
  void Bad(const char* k, const std::string& why) {
    if (status_.ok()) {
      status_ = absl::InvalidArgumentError(absl::StrCat(k, " ", why));
      param_ = k;
    }
  }
  // A parameter the engine has no use for unless it has its neutral value.
  void Refuse(const char* k, bool neutral, const std::string& why) {
    if (Get(k) != nullptr && !neutral) Bad(k, why);
  }
  const absl::Status& status() const { return status_; }
  const std::string& param() const { return param_; }

 private:
  const ordered_json& j_;
  absl::Status status_;
  std::string param_;
};

// A JSON integer that fits an int32 (token ids): a larger one is an error, never wrapped.
bool AsInt32(const ordered_json& v, int32_t* out) {
  if (!v.is_number_integer()) return false;
  if (v.is_number_unsigned() ? v.get<uint64_t>() > static_cast<uint64_t>(INT32_MAX)
                             : (v.get<int64_t>() < INT32_MIN || v.get<int64_t>() > INT32_MAX)) {
    return false;
  }
  *out = static_cast<int32_t>(v.get<int64_t>());
  return true;
}

std::string Event(const json& j) { return absl::StrCat("data: ", JsonText(j), "\n\n"); }

json Usage(int64_t prompt, int64_t completion) {
  return json{{"prompt_tokens", prompt},
              {"completion_tokens", completion},
              {"total_tokens", prompt + completion}};
}

// `stop` and `stop_token_ids` into `base`, their counts and sizes checked before anything is
// copied (the first problem goes to `p`).
void ReadStops(Params* p, const RequestCaps& caps, v1::GenerateRequest* base) {
  if (const ordered_json* stop = p->Get("stop")) {
    auto add = [&](const ordered_json& v) {
      const std::string& str = v.get_ref<const std::string&>();
      if (str.empty() || str.size() > caps.max_stop_bytes) {
        p->Bad("stop", absl::StrCat("strings must be 1..", caps.max_stop_bytes,
                                    " bytes (--max-stop-bytes), not ", str.size()));
        return false;
      }
      base->add_stop(str);
      return true;
    };
    if (stop->is_string()) {
      add(*stop);
    } else if (stop->is_array()) {
      if (stop->size() > static_cast<size_t>(caps.max_stop_strings)) {
        p->Bad("stop", absl::StrCat("at most ", caps.max_stop_strings,
                                    " strings (--max-stop-strings), not ", stop->size()));
      }
      for (const auto& s : *stop) {
        if (!p->status().ok()) break;
        if (!s.is_string()) {
          p->Bad("stop", "must be a string or a list of strings");
          break;
        }
        if (!add(s)) break;
      }
    } else {
      p->Bad("stop", "must be a string or a list of strings");
    }
  }
  if (const ordered_json* ids = p->Get("stop_token_ids")) {
    if (!ids->is_array()) p->Bad("stop_token_ids", "must be a list of token ids");
    if (ids->is_array() && ids->size() > static_cast<size_t>(caps.max_stop_token_ids)) {
      p->Bad("stop_token_ids", absl::StrCat("at most ", caps.max_stop_token_ids,
                                            " ids (--max-stop-token-ids), not ", ids->size()));
    }
    for (const auto& id : ids->is_array() && p->status().ok() ? *ids : ordered_json::array()) {
      int32_t v = 0;
      if (!AsInt32(id, &v)) {
        p->Bad("stop_token_ids", "must be a list of token ids");
        break;
      }
      base->add_stop_token_ids(v);
    }
  }
}

}  // namespace

// One /v1/completions or /v1/chat/completions call: its choices (prompts × n) are requests in
// the scheduler, each followed by a TokenFeed; the listeners post Pump, which writes stream
// events or, at the end, the whole answer. Shared by the pump threads and the listeners.
class OpenAiApi::Generation : public std::enable_shared_from_this<Generation> {
 public:
  Generation(OpenAiApi* api, std::shared_ptr<HttpExchange> ex, bool chat)
      : api_(api), ex_(std::move(ex)), chat_(chat), route_(chat ? "chat" : "completions") {}

  // A pump thread: parse, render and tokenize, submit.
  void Start() {
    // From here the exchange keeps this call alive until the request completes (or is cut
    // short, which cancels what still runs).
    ex_->SetOnClose([self = shared_from_this()] { self->Cancel(); });
    absl::StatusOr<ordered_json> body;
    {
      const std::string text = ex_->TakeBody();
      body = ParseClientJson(text, api_->options_.json);
    }
    if (!body.ok()) {
      return Refuse(absl::InvalidArgumentError(
                        absl::StrCat("the request body is not JSON: ", body.status().message())),
                    "");
    }
    if (!body->is_object()) {
      return Refuse(absl::InvalidArgumentError("the request body is not a JSON object"), "");
    }
    std::vector<v1::GenerateRequest> reqs;
    std::vector<Choice> choices;
    Params p(*body);
    absl::Status s = Prepare(&p, &reqs, &choices);
    body = ordered_json();  // the requests hold what is needed from here
    if (!s.ok()) return Refuse(s, p.param());
    Controller* c = api_->controller_;
    std::vector<std::shared_ptr<GenRequest>> submitted;
    for (const v1::GenerateRequest& req : reqs) {
      absl::StatusOr<std::shared_ptr<GenRequest>> r =
          c->Submit(req, std::chrono::steady_clock::time_point::max());
      if (!r.ok()) {
        c->RecordRequest(req.adapter(), /*admitted=*/false, r.status().code());
        for (auto& done : submitted) done->cancelled = true;
        if (!submitted.empty()) c->Wake();
        absl::Status st = r.status();
        if (st.code() == absl::StatusCode::kNotFound) {
          st = absl::NotFoundError(
              absl::StrCat("The model `", model_, "` does not exist: ", st.message()));
        }
        return Refuse(st, st.code() == absl::StatusCode::kNotFound ? "model" : "");
      }
      submitted.push_back(*r);
    }
    // Prompt tokens as submitted (image placeholders expanded), each prompt once.
    int64_t prompt_tokens = 0;
    std::set<int> counted;
    for (size_t k = 0; k < submitted.size(); ++k) {
      if (counted.insert(choices[k].prompt).second) {
        prompt_tokens += submitted[k]->req.prompt_token_ids_size();
      }
    }
    {
      MutexLock lock(&mu_);
      prompt_tokens_ = prompt_tokens;
      choices_ = std::move(choices);
      for (size_t k = 0; k < submitted.size(); ++k) {
        choices_[k].feed.emplace(c, api_->metrics_, submitted[k]);
        if (client_gone_) submitted[k]->cancelled = true;  // it left while this submitted
      }
      if (client_gone_) c->Wake();
    }
    if (stream_) {
      ex_->StartStream(200, "text/event-stream");
      api_->metrics_->http_requests.Add({{"route", route_}, {"status", "200"}}).Increment();
    }
    for (auto& r : submitted) {
      r->SetListener(
          [weak = weak_from_this()] {
            if (std::shared_ptr<Generation> self = weak.lock()) self->Schedule();
          },
          /*on_tokens=*/stream_ || !r->req.stop().empty());
    }
  }

 private:
  struct Choice {
    int index = 0;
    int prompt = 0;
    std::optional<TokenFeed> feed;
    bool done = false;
    bool role_sent = false;
    size_t text_offset = 0;  // completions logprobs: bytes of text before the next token
    TokenFeed::Outcome outcome;
    // Chat with --reasoning-parser / --tool-call-parser: the answer split as it comes, and the
    // calls a stream has sent.
    std::unique_ptr<OutputParser> parser;
    int calls_sent = 0;
  };

  // Parses the body into one request per choice (prompts × n) and `choices`.
  absl::Status Prepare(Params* p, std::vector<v1::GenerateRequest>* reqs,
                       std::vector<Choice>* choices) {
    Controller* c = api_->controller_;
    const OpenAiOptions& o = api_->options_;
    const RequestCaps& caps = c->caps();
    const tok::Tokenizer* tokenizer = c->tokenizer();
    model_ = p->Str("model", o.served_model_name);
    stream_ = p->Bool("stream", false);
    if (const ordered_json* so = p->Get("stream_options")) {
      if (!so->is_object()) {
        p->Bad("stream_options", "must be an object");
      } else if (!stream_) {
        p->Bad("stream_options", "is only allowed with stream: true");
      } else if (auto it = so->find("include_usage"); it != so->end() && !it->is_null()) {
        if (!it->is_boolean()) {
          p->Bad("stream_options", "include_usage must be true or false");
        } else {
          include_usage_ = it->get<bool>();
        }
      }
    }
    const int64_t n = p->Int("n", 1);
    if (p->status().ok() && (n < 1 || n > o.max_n))
      p->Bad("n", absl::StrCat("must be in 1..", o.max_n));
    const int64_t best_of = p->Int("best_of", n);
    p->Refuse("best_of", best_of == n, "other than n is not supported");
    p->Refuse("presence_penalty", p->Number("presence_penalty", 0) == 0,
              "is not supported (use 0)");
    p->Refuse("frequency_penalty", p->Number("frequency_penalty", 0) == 0,
              "is not supported (use 0)");
    p->Refuse("repetition_penalty", p->Number("repetition_penalty", 1) == 1,
              "is not supported (use 1)");
    p->Refuse("min_p", p->Number("min_p", 0) == 0, "is not supported (use 0)");
    p->Refuse("min_tokens", p->Int("min_tokens", 0) == 0, "is not supported (use 0)");
    const ordered_json* bias = p->Get("logit_bias");
    p->Refuse("logit_bias", bias == nullptr || bias->empty(), "is not supported");
    p->Refuse("echo", !p->Bool("echo", false), "is not supported");
    p->Refuse("suffix", p->Str("suffix", "").empty(), "is not supported");
    p->Refuse("use_beam_search", !p->Bool("use_beam_search", false), "is not supported");
    p->Refuse("prompt_logprobs", false, "is not supported");
    for (const char* k :
         {"guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs"}) {
      p->Refuse(k, false, "(structured output) is not supported");
    }
    if (const ordered_json* rf = p->Get("response_format")) {
      p->Refuse("response_format",
                rf->is_object() && (!rf->contains("type") || StringMember(*rf, "type") == "text"),
                "other than {\"type\": \"text\"} is not supported");
    }
    // Logprobs: those of the sampled tokens; top alternatives are not computed.
    if (chat_) {
      logprobs_ = p->Bool("logprobs", false);
      p->Refuse("top_logprobs", p->Int("top_logprobs", 0) == 0,
                "above 0 is not supported: the engine returns the sampled tokens' logprobs only");
    } else if (p->Get("logprobs") != nullptr) {
      const int64_t lp = p->Int("logprobs", 0);
      if (lp != 0) {
        p->Bad("logprobs",
               "above 0 is not supported: the engine returns the sampled tokens' "
               "logprobs only (use 0)");
      }
      logprobs_ = true;
    }
    v1::GenerateRequest base;
    base.set_adapter(model_ == o.served_model_name ? "" : model_);
    base.set_temperature(
        static_cast<float>(p->Number("temperature", o.default_temperature.value_or(1.0))));
    base.set_top_p(static_cast<float>(p->Number("top_p", o.default_top_p.value_or(1.0))));
    // vLLM's top_k: -1 (or 0) for no bound.
    const int64_t top_k = p->Int("top_k", o.default_top_k.value_or(0));
    if (top_k < -1 || top_k > INT32_MAX) {
      p->Bad("top_k", absl::StrCat("must be -1 (no bound) or in 0..", INT32_MAX));
    }
    base.set_top_k(top_k < 0 || top_k > INT32_MAX ? 0 : static_cast<int32_t>(top_k));
    base.set_ignore_eos(p->Bool("ignore_eos", false));
    base.set_return_logprobs(logprobs_);
    ReadStops(p, caps, &base);
    const bool has_seed = p->Get("seed") != nullptr;
    const int64_t seed = p->Int("seed", 0);
    int64_t max_tokens = p->Int("max_tokens", -1);
    const char* max_tokens_name = "max_tokens";
    if (chat_ && p->Get("max_completion_tokens") != nullptr) {
      max_tokens = p->Int("max_completion_tokens", max_tokens);
      max_tokens_name = "max_completion_tokens";
    }
    if (p->status().ok() && p->Get(max_tokens_name) != nullptr && max_tokens < 1) {
      p->Bad(max_tokens_name, "must be at least 1");
    }
    if (!p->status().ok()) return p->status();
    const int max_model_len = c->max_model_len();

    // The prompts, as token ids.
    std::vector<std::vector<int32_t>> prompts;
    if (chat_) {
      std::string text;
      std::vector<std::string> images;
      MOELORA_RETURN_IF_ERROR(RenderChat(p, &text, &images));
      parser_options_.prompt_opens_reasoning = PromptOpensReasoning(text);
      for (std::string& im : images) base.add_images(std::move(im));
      if (tokenizer == nullptr) return absl::InvalidArgumentError("this model has no tokenizer");
      auto ids = tokenizer->Encode(text, /*add_special_tokens=*/false);
      if (!ids.ok()) return ids.status();
      prompts.push_back(std::move(*ids));
    } else {
      MOELORA_RETURN_IF_ERROR(ReadPrompts(p, n, max_model_len, &prompts));
    }
    if (prompts.size() * static_cast<size_t>(n) > static_cast<size_t>(caps.max_choices)) {
      return absl::InvalidArgumentError(absl::StrCat(prompts.size(), " prompts x n = ", n,
                                                     " is more than ", caps.max_choices,
                                                     " choices (--max-choices)"));
    }
    for (size_t k = 0; k < prompts.size(); ++k) {
      for (int64_t j = 0; j < n; ++j) {
        v1::GenerateRequest req = base;
        req.mutable_prompt_token_ids()->Add(prompts[k].begin(), prompts[k].end());
        // OpenAI's default is 16 for completions; chat runs to the end of the context.
        int64_t m = max_tokens;
        if (m < 0) {
          m = chat_ ? std::max<int64_t>(
                          1, c->max_model_len() - static_cast<int64_t>(prompts[k].size()))
                    : 16;
        }
        req.set_max_tokens(static_cast<int32_t>(std::min<int64_t>(m, INT32_MAX)));
        if (has_seed) {
          const uint64_t s = static_cast<uint64_t>(seed) + static_cast<uint64_t>(reqs->size());
          req.set_seed(s == 0 ? kSeedForZero : s);
        }
        Choice ch;
        ch.index = static_cast<int>(reqs->size());
        ch.prompt = static_cast<int>(k);
        if (chat_ && (!parser_options_.reasoning_parser.empty() ||
                      !parser_options_.tool_call_parser.empty())) {
          MOELORA_ASSIGN_OR_RETURN(ch.parser, OutputParser::Create(parser_options_));
        }
        choices->push_back(std::move(ch));
        reqs->push_back(std::move(req));
      }
    }
    return absl::OkStatus();
  }

  // /v1/completions' `prompt` as token ids: a string, token ids, or a list of either; prompts x n
  // and each prompt's size bounded before any is tokenized or copied.
  absl::Status ReadPrompts(Params* p, int64_t n, int max_model_len,
                           std::vector<std::vector<int32_t>>* out) {
    const RequestCaps& caps = api_->controller_->caps();
    const tok::Tokenizer* tokenizer = api_->controller_->tokenizer();
    std::vector<std::vector<int32_t>>& prompts = *out;
    const ordered_json* prompt = p->Get("prompt");
    if (prompt == nullptr) return p->Bad("prompt", "is required"), p->status();
    auto encode = [&](const std::string& text) -> absl::Status {
      if (text.size() > caps.max_prompt_bytes) {
        p->Bad("prompt", absl::StrCat("is ", text.size(), " bytes; at most ", caps.max_prompt_bytes,
                                      " (--max-prompt-bytes)"));
        return p->status();
      }
      if (tokenizer == nullptr) {
        return absl::InvalidArgumentError(
            "this model directory has no tokenizer.json: send the prompt as token ids");
      }
      const auto t0 = std::chrono::steady_clock::now();
      auto ids = tokenizer->Encode(text);
      api_->metrics_->tokenize_seconds.Observe(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      if (!ids.ok())
        return absl::InvalidArgumentError(absl::StrCat("prompt: ", ids.status().message()));
      prompts.push_back(std::move(*ids));
      return absl::OkStatus();
    };
    auto token_list = [&](const ordered_json& a) -> bool {
      if (max_model_len > 0 && a.size() >= static_cast<size_t>(max_model_len)) {
        return false;  // longer than the model: refused before it is copied
      }
      std::vector<int32_t> ids;
      ids.reserve(a.size());
      for (const auto& t : a) {
        int32_t v = 0;
        if (!AsInt32(t, &v)) return false;
        ids.push_back(v);
      }
      prompts.push_back(std::move(ids));
      return true;
    };
    const std::string kShape = absl::StrCat(
        "must be a string, a list of strings, a list of token ids or a list of those (each "
        "shorter than max_model_len ",
        max_model_len, ")");
    // prompts × n bounded before any prompt is tokenized or copied.
    const size_t count =
        prompt->is_array() && !prompt->empty() && !(*prompt)[0].is_number() ? prompt->size() : 1;
    if (count * static_cast<size_t>(n) > static_cast<size_t>(caps.max_choices)) {
      p->Bad("prompt", absl::StrCat(count, " prompts x n = ", n, " is more than ", caps.max_choices,
                                    " choices (--max-choices)"));
      return p->status();
    }
    if (prompt->is_string()) {
      MOELORA_RETURN_IF_ERROR(encode(prompt->get<std::string>()));
    } else if (prompt->is_array() && !prompt->empty()) {
      if ((*prompt)[0].is_number_integer()) {
        if (!token_list(*prompt)) return p->Bad("prompt", kShape), p->status();
      } else {
        for (const auto& e : *prompt) {
          if (e.is_string()) {
            MOELORA_RETURN_IF_ERROR(encode(e.get<std::string>()));
          } else if (!e.is_array() || e.empty() || !token_list(e)) {
            return p->Bad("prompt", kShape), p->status();
          }
        }
      }
    } else {
      return p->Bad("prompt", kShape), p->status();
    }
    return absl::OkStatus();
  }

  // An image_url part's image: a data: URL with base64 content ({"image_url": {"url": ...}} or
  // {"image_url": "..."}). Other URLs are refused: the server fetches nothing.
  static absl::Status ImageFromUrlPart(const ordered_json& part, const std::string& at,
                                       size_t max_bytes, std::string* bytes) {
    const ordered_json* u = part.contains("image_url") ? &part["image_url"] : nullptr;
    if (u != nullptr && u->is_object() && u->contains("url")) u = &(*u)["url"];
    if (u == nullptr || !u->is_string()) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".image_url.url must be a string"));
    }
    const std::string& url = u->get_ref<const std::string&>();
    const size_t comma = url.find(',');
    if (!absl::StartsWith(url, "data:") || comma == std::string::npos ||
        url.substr(0, comma).find(";base64") == std::string::npos) {
      return absl::InvalidArgumentError(absl::StrCat(
          at,
          ".image_url.url: only data: URLs with base64 content are accepted (the server "
          "fetches nothing)"));
    }
    // Base64 holds 3 bytes in 4 characters: a longer text cannot decode within the bound.
    if ((url.size() - comma - 1) / 4 * 3 > max_bytes + 3) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".image_url.url: more than ", max_bytes,
                                                     " bytes of image (--max-image-bytes)"));
    }
    if (!absl::Base64Unescape(absl::string_view(url).substr(comma + 1), bytes)) {
      return absl::InvalidArgumentError(absl::StrCat(at, ".image_url.url: invalid base64"));
    }
    return absl::OkStatus();
  }

  absl::Status RenderChat(Params* p, std::string* text, std::vector<std::string>* images) {
    const OpenAiOptions& o = api_->options_;
    if (o.chat_template == nullptr) {
      return absl::InvalidArgumentError(
          "this model has no chat template (chat_template.jinja or tokenizer_config.json's "
          "chat_template): use /v1/completions");
    }
    const RequestCaps& caps = api_->controller_->caps();
    const ordered_json* messages = p->Get("messages");
    if (messages == nullptr || !messages->is_array() || messages->empty()) {
      p->Bad("messages", "must be a non-empty list");
      return p->status();
    }
    if (messages->size() > static_cast<size_t>(caps.max_messages)) {
      p->Bad("messages", absl::StrCat("at most ", caps.max_messages,
                                      " messages (--max-messages), not ", messages->size()));
      return p->status();
    }
    // Images counted before any is decoded.
    size_t image_parts = 0;
    for (const ordered_json& m : *messages) {
      if (!m.is_object()) continue;
      auto it = m.find("content");
      if (it == m.end() || !it->is_array()) continue;
      for (const ordered_json& part : *it) image_parts += StringMember(part, "type") == "image_url";
    }
    if (image_parts >
        static_cast<size_t>(std::max(0, api_->controller_->limit_images_per_prompt()))) {
      p->Bad("messages", absl::StrCat(image_parts, " images: at most ",
                                      api_->controller_->limit_images_per_prompt(),
                                      " per prompt (--limit-mm-per-prompt)"));
      return p->status();
    }
    p->Refuse("continue_final_message", !p->Bool("continue_final_message", false),
              "is not supported");
    if (const ordered_json* tc = p->Get("tool_choice")) {
      p->Refuse("tool_choice", tc->is_string() && (*tc == "auto" || *tc == "none"),
                "other than \"auto\" or \"none\" is not supported");
    }
    const ordered_json* tools = p->Get("tools");
    if (tools != nullptr && !tools->is_array()) p->Bad("tools", "must be a list");
    parser_options_.reasoning_parser = api_->options_.reasoning_parser;
    // Tool calls are parsed where the request offers tools and allows calls (as vLLM).
    const ordered_json* choice = p->Get("tool_choice");
    if (tools != nullptr && tools->is_array() && !tools->empty() &&
        !(choice != nullptr && *choice == "none")) {
      parser_options_.tool_call_parser = api_->options_.tool_call_parser;
      parser_options_.tools = *tools;
      parser_options_.single_call = !p->Bool("parallel_tool_calls", true);
    }
    if (tools != nullptr && tools->is_array() &&
        tools->size() > static_cast<size_t>(caps.max_tools)) {
      p->Bad("tools",
             absl::StrCat("at most ", caps.max_tools, " tools (--max-tools), not ", tools->size()));
    }
    const ordered_json* kwargs = p->Get("chat_template_kwargs");
    if (kwargs != nullptr && !kwargs->is_object())
      p->Bad("chat_template_kwargs", "must be an object");
    const bool add_generation_prompt = p->Bool("add_generation_prompt", true);
    if (!p->status().ok()) return p->status();
    // Messages as vLLM hands them to the template: text parts joined into one string, tool
    // call arguments parsed from their JSON text.
    ordered_json chat = ordered_json::array();
    size_t args_bytes = 0;  // tool-call arguments parsed, in all: within the body's value budget
    for (size_t i = 0; i < messages->size(); ++i) {
      const ordered_json& m = (*messages)[i];
      const std::string where = absl::StrCat("messages[", i, "]");
      if (!m.is_object() || !m.contains("role") || !m["role"].is_string()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, " must be an object with a string role"));
      }
      ordered_json out = m;
      if (m.contains("content") && m["content"].is_array()) {
        // Text parts only: joined into one string. With images: the list of parts the
        // multimodal templates read ({"type": "image"} where each image goes, which they
        // render as the model's image placeholder), and the images' bytes in order.
        std::string joined;
        ordered_json parts = ordered_json::array();
        bool has_image = false;
        for (size_t j = 0; j < m["content"].size(); ++j) {
          const auto& part = m["content"][j];
          const std::string type = StringMember(part, "type");
          const std::string at = absl::StrCat(where, ".content[", j, "]");
          if (type == "image_url") {
            std::string bytes;
            MOELORA_RETURN_IF_ERROR(ImageFromUrlPart(part, at, caps.max_image_bytes, &bytes));
            images->push_back(std::move(bytes));
            parts.push_back({{"type", "image"}});
            has_image = true;
            continue;
          }
          if (type != "text" || !part.contains("text") || !part["text"].is_string()) {
            return absl::InvalidArgumentError(absl::StrCat(
                at, ": only text and image_url parts are supported (got \"", type, "\")"));
          }
          if (!joined.empty()) joined += "\n";
          joined += part["text"].get<std::string>();
          parts.push_back({{"type", "text"}, {"text", part["text"]}});
        }
        out["content"] = has_image ? parts : ordered_json(joined);
      } else if (m.contains("content") && !m["content"].is_string() && !m["content"].is_null()) {
        return absl::InvalidArgumentError(
            absl::StrCat(where, ".content must be a string or a list of parts"));
      }
      if (out.contains("tool_calls") && out["tool_calls"].is_array()) {
        for (auto& call : out["tool_calls"]) {
          if (!call.is_object() || !call.contains("function") || !call["function"].is_object() ||
              !call["function"].contains("arguments")) {
            continue;
          }
          auto& args = call["function"]["arguments"];
          if (args.is_string()) {
            // A text of N bytes holds at most N values: their sum stays within the body's budget
            // (past it, the arguments stay text).
            const std::string& text = args.get_ref<const std::string&>();
            args_bytes += text.size();
            if (args_bytes > api_->options_.json.max_values) continue;
            absl::StatusOr<ordered_json> parsed = ParseClientJson(text, api_->options_.json);
            if (parsed.ok()) args = *std::move(parsed);
          }
        }
      }
      chat.push_back(std::move(out));
    }
    const ordered_json vars = tok::ChatTemplateVariables(
        chat, tools != nullptr ? *tools : ordered_json(), add_generation_prompt, o.special_tokens,
        kwargs != nullptr ? *kwargs : ordered_json::object());
    absl::StatusOr<std::string> r = o.chat_template->Render(vars);
    if (!r.ok()) return r.status();
    *text = std::move(*r);
    return absl::OkStatus();
  }

  // The client left: what still runs is cancelled, and this call lives on (the exchange no
  // longer holds it) until its requests have ended and been counted.
  void Cancel() {
    MutexLock lock(&mu_);
    if (finished_) return;
    client_gone_ = true;
    keep_alive_ = shared_from_this();
    for (Choice& c : choices_) {
      if (c.feed) c.feed->request()->cancelled = true;
    }
    api_->controller_->Wake();
  }

  // Answers an error before anything ran; nothing keeps this call alive after.
  void Refuse(const absl::Status& s, const std::string& param) {
    {
      MutexLock lock(&mu_);
      finished_ = true;
      keep_alive_.reset();
    }
    api_->AnswerError(ex_, route_, s, param);
  }

  // A listener (the scheduler's thread): at most one Pump queued at a time.
  void Schedule() {
    if (!queued_.exchange(true)) api_->pump_.Post([self = shared_from_this()] { self->Pump(); });
  }

  json LogprobsJson(Choice& c, const std::vector<int32_t>& tokens, const std::vector<float>& lps) {
    const tok::Tokenizer* tokenizer = api_->controller_->tokenizer();
    auto token_text = [&](int32_t id) {
      return tokenizer != nullptr ? tokenizer->Decode({id}) : std::to_string(id);
    };
    if (chat_) {
      json content = json::array();
      for (size_t i = 0; i < tokens.size() && i < lps.size(); ++i) {
        json bytes = json::array();
        if (tokenizer != nullptr) {
          for (unsigned char b : tokenizer->DecodeBytes({tokens[i]})) bytes.push_back(b);
        }
        content.push_back({{"token", token_text(tokens[i])},
                           {"logprob", lps[i]},
                           {"bytes", std::move(bytes)},
                           {"top_logprobs", json::array()}});
      }
      return json{{"content", std::move(content)}};
    }
    json toks = json::array(), lp = json::array(), offsets = json::array();
    for (size_t i = 0; i < tokens.size() && i < lps.size(); ++i) {
      const std::string t = token_text(tokens[i]);
      toks.push_back(t);
      lp.push_back(lps[i]);
      offsets.push_back(c.text_offset);
      c.text_offset += t.size();
    }
    return json{{"tokens", std::move(toks)},
                {"token_logprobs", std::move(lp)},
                {"top_logprobs", nullptr},
                {"text_offset", std::move(offsets)}};
  }

  json ChunkHead() const {
    return json{{"id", id_},
                {"object", chat_ ? "chat.completion.chunk" : "text_completion"},
                {"created", created_},
                {"model", model_}};
  }

  // The message fields of a parsed answer (or of a stream delta): reasoning under both names
  // clients read (vLLM's `reasoning` and the older `reasoning_content`), content, tool calls
  // numbered from `first_call`.
  static void AddParsed(const OutputDelta& d, bool whole, bool reasoning_parser, int first_call,
                        json* msg) {
    if (reasoning_parser && (whole || !d.reasoning.empty())) {
      const json r = d.reasoning.empty() ? json() : json(d.reasoning);
      (*msg)["reasoning"] = r;
      (*msg)["reasoning_content"] = r;
    }
    if (whole) {
      // null where the answer was only calls or only reasoning, as vLLM answers.
      (*msg)["content"] = d.content.empty() && (!d.calls.empty() || !d.reasoning.empty())
                              ? json()
                              : json(d.content);
    } else if (!d.content.empty()) {
      (*msg)["content"] = d.content;
    }
    if (d.calls.empty()) return;
    // Streamed, a call's id and name come first with empty arguments; CallArguments follows.
    json calls = json::array();
    for (size_t i = 0; i < d.calls.size(); ++i) {
      json call = {{"id", d.calls[i].id},
                   {"type", "function"},
                   {"function",
                    {{"name", d.calls[i].name}, {"arguments", whole ? d.calls[i].arguments : ""}}}};
      if (!whole) call["index"] = first_call + static_cast<int>(i);
      calls.push_back(std::move(call));
    }
    (*msg)["tool_calls"] = std::move(calls);
  }

  // A stream delta with the arguments of the calls whose heads AddParsed sent.
  static json CallArguments(const OutputDelta& d, int first_call) {
    json calls = json::array();
    for (size_t i = 0; i < d.calls.size(); ++i) {
      calls.push_back({{"index", first_call + static_cast<int>(i)},
                       {"function", {{"arguments", d.calls[i].arguments}}}});
    }
    return json{{"tool_calls", std::move(calls)}};
  }

  // A parsed answer's finish reason: "tool_calls" once it called a tool.
  static std::string ParsedFinish(const Choice& c, const std::string& finish_reason) {
    return c.parser != nullptr && c.parser->made_calls() ? "tool_calls" : finish_reason;
  }

  // One stream event for a choice: its new text (and logprobs), or its end. With a parser, its
  // new reasoning, content and calls instead of the text.
  std::string ChunkEvent(Choice& c, const std::string& text, const std::vector<int32_t>& tokens,
                         const std::vector<float>& lps, const std::string& finish_reason) {
    json choice = {{"index", c.index}};
    std::string first;  // an event before this one (a call's head)
    if (chat_) {
      json delta = json::object();
      if (!c.role_sent) {
        delta["role"] = "assistant";
        c.role_sent = true;
      }
      if (c.parser != nullptr) {
        OutputDelta d = c.parser->Feed(text);
        if (!finish_reason.empty()) d.Append(c.parser->Finish());
        AddParsed(d, /*whole=*/false, !parser_options_.reasoning_parser.empty(), c.calls_sent,
                  &delta);
        if (d.empty() && finish_reason.empty() && delta.empty() &&
            !(logprobs_ && !tokens.empty())) {
          return "";  // held back inside a tag: nothing to send yet
        }
        if (!d.calls.empty()) {
          // Two events: the text and the calls' ids and names, then their arguments (with the
          // logprobs and the finish reason, if any).
          json head = {{"index", c.index}, {"delta", std::move(delta)}};
          head["logprobs"] = nullptr;
          head["finish_reason"] = nullptr;
          json j = ChunkHead();
          j["choices"] = json::array({std::move(head)});
          if (include_usage_) j["usage"] = nullptr;
          first = Event(j);
          delta = CallArguments(d, c.calls_sent);
        }
        c.calls_sent += static_cast<int>(d.calls.size());
      } else if (!text.empty() || finish_reason.empty()) {
        delta["content"] = text;
      }
      choice["delta"] = std::move(delta);
    } else {
      choice["text"] = text;
    }
    choice["logprobs"] = logprobs_ && !tokens.empty() ? LogprobsJson(c, tokens, lps) : json();
    choice["finish_reason"] = finish_reason.empty() ? json() : json(ParsedFinish(c, finish_reason));
    json j = ChunkHead();
    j["choices"] = json::array({std::move(choice)});
    if (include_usage_) j["usage"] = nullptr;
    return first + Event(j);
  }

  void Pump() {
    queued_ = false;
    MutexLock lock(&mu_);
    if (finished_) return;
    std::string out;
    bool all_done = true;
    for (Choice& c : choices_) {
      if (c.done) continue;
      TokenFeed::Chunk k = c.feed->Take();
      if (stream_ &&
          (!k.text.empty() || (logprobs_ && !k.tokens.empty()) || (chat_ && !c.role_sent))) {
        out += ChunkEvent(c, k.text, k.tokens, k.logprobs, "");
      }
      if (!k.done) {
        all_done = false;
        continue;
      }
      c.done = true;
      c.outcome = c.feed->Finish();
      completion_tokens_ += static_cast<int64_t>(c.outcome.result.tokens.size());
      if (stream_) {
        if (c.outcome.status.ok()) {
          out += ChunkEvent(c, c.outcome.rest, {}, {}, c.outcome.finish_reason);
        } else {
          out += absl::StrCat("data: ", OpenAiErrorBody(c.outcome.status), "\n\n");
        }
      }
    }
    if (all_done) keep_alive_.reset();  // the last Pump holds a reference of its own
    if (stream_) {
      if (all_done) {
        if (include_usage_) {
          json j = ChunkHead();
          j["choices"] = json::array();
          j["usage"] = Usage(prompt_tokens_, completion_tokens_);
          out += Event(j);
        }
        out += "data: [DONE]\n\n";
        finished_ = true;
      }
      if (!out.empty()) ex_->Write(std::move(out));
      if (finished_) ex_->End();
      return;
    }
    if (!all_done) return;
    finished_ = true;
    for (const Choice& c : choices_) {
      if (!c.outcome.status.ok()) return api_->AnswerError(ex_, route_, c.outcome.status);
    }
    json choices = json::array();
    for (Choice& c : choices_) {
      json choice = {{"index", c.index}};
      if (chat_ && c.parser != nullptr) {
        OutputDelta d = c.parser->Feed(c.outcome.text);
        d.Append(c.parser->Finish());
        json msg = {{"role", "assistant"}};
        AddParsed(d, /*whole=*/true, !parser_options_.reasoning_parser.empty(), 0, &msg);
        choice["message"] = std::move(msg);
      } else if (chat_) {
        choice["message"] = {{"role", "assistant"}, {"content", c.outcome.text}};
      } else {
        choice["text"] = c.outcome.text;
      }
      choice["logprobs"] =
          logprobs_ ? LogprobsJson(c, c.outcome.result.tokens, c.outcome.result.logprobs) : json();
      choice["finish_reason"] = ParsedFinish(c, c.outcome.finish_reason);
      choices.push_back(std::move(choice));
    }
    json j = {{"id", id_},
              {"object", chat_ ? "chat.completion" : "text_completion"},
              {"created", created_},
              {"model", model_},
              {"choices", std::move(choices)},
              {"usage", Usage(prompt_tokens_, completion_tokens_)}};
    api_->Answer(ex_, route_, 200, "application/json", JsonText(j));
  }

  OpenAiApi* const api_;
  const std::shared_ptr<HttpExchange> ex_;
  const bool chat_;
  const std::string route_;
  const std::string id_ = RandomId(chat_ ? "chatcmpl-" : "cmpl-");
  const int64_t created_ = UnixNow();
  // Set by Start before any listener runs.
  std::string model_;
  bool stream_ = false;
  bool include_usage_ = false;
  bool logprobs_ = false;
  int64_t prompt_tokens_ = 0;
  OutputParserOptions parser_options_;

  std::atomic<bool> queued_{false};
  Mutex mu_;
  std::vector<Choice> choices_ ABSL_GUARDED_BY(mu_);
  int64_t completion_tokens_ ABSL_GUARDED_BY(mu_) = 0;
  bool finished_ ABSL_GUARDED_BY(mu_) = false;
  bool client_gone_ ABSL_GUARDED_BY(mu_) = false;
  std::shared_ptr<Generation> keep_alive_ ABSL_GUARDED_BY(mu_);  // set by Cancel
};

void OpenAiApi::Generate(const std::shared_ptr<HttpExchange>& ex, bool chat) {
  std::make_shared<Generation>(this, ex, chat)->Start();
}

}  // namespace moelora
