#include "controller/openai_api.h"

#include <malloc.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <set>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/escaping.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "common/logging.h"
#include "controller/openai_internal.h"
#include "prometheus/text_serializer.h"

namespace moelora {

using nlohmann::json;
using nlohmann::ordered_json;

void ReadSamplingDefaults(const std::string& model_dir, OpenAiOptions* o) {
  std::ifstream f(model_dir + "/generation_config.json");
  if (!f) return;
  const json j = json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object()) return;
  if (auto it = j.find("temperature"); it != j.end() && it->is_number()) {
    o->default_temperature = it->get<double>();
  }
  if (auto it = j.find("top_p"); it != j.end() && it->is_number()) {
    o->default_top_p = it->get<double>();
  }
  if (auto it = j.find("top_k"); it != j.end() && it->is_number_integer()) {
    o->default_top_k = it->get<int>();
  }
}

OpenAiApi::OpenAiApi(Controller* controller, ControllerMetrics* metrics, const TokenAuth* auth,
                     OpenAiOptions options)
    : controller_(controller),
      metrics_(metrics),
      auth_(auth),
      options_(std::move(options)),
      pump_(std::max(1, options_.pump_threads)),
      admin_(2, /*max_queued=*/64) {}

OpenAiApi::~OpenAiApi() = default;

void OpenAiApi::Answer(const std::shared_ptr<HttpExchange>& ex, const std::string& route,
                       int status, std::string content_type, std::string body) {
  metrics_->http_requests.Add({{"route", route}, {"status", std::to_string(status)}}).Increment();
  ex->Respond(status, std::move(content_type), std::move(body));
}

void OpenAiApi::AnswerError(const std::shared_ptr<HttpExchange>& ex, const std::string& route,
                            const absl::Status& status, const std::string& param) {
  Answer(ex, route, HttpStatusOf(status), "application/json", OpenAiErrorBody(status, param));
}

const OpenAiApi::Route* OpenAiApi::FindRoute(const std::string& path, std::string* model_id) {
  static const Route kRoutes[] = {
      {"/v1/completions", "POST", "completions", false},
      {"/v1/chat/completions", "POST", "chat", false},
      {"/v1/models", "GET", "models", false},
      {"/v1/load_lora_adapter", "POST", "load_lora_adapter", true},
      {"/v1/unload_lora_adapter", "POST", "unload_lora_adapter", true},
      {"/health", "GET", "health", false},
      {"/metrics", "GET", "metrics", false},
  };
  for (const Route& r : kRoutes) {
    if (path == r.path) return &r;
  }
  // GET /v1/models/{id}: one model.
  static constexpr char kModelPrefix[] = "/v1/models/";
  if (path.rfind(kModelPrefix, 0) == 0 && path.size() > sizeof(kModelPrefix) - 1) {
    *model_id = path.substr(sizeof(kModelPrefix) - 1);
    return &kRoutes[2];
  }
  return nullptr;
}

absl::Status OpenAiApi::Admit(const HttpExchange& ex) const {
  std::string model_id;
  const Route* route = FindRoute(ex.path(), &model_id);
  const std::string name = route != nullptr ? route->name : "";
  if (name == "health") return absl::OkStatus();
  if (name == "metrics" && options_.metrics != OpenAiOptions::Metrics::kToken) {
    return absl::OkStatus();
  }
  if (auth_ == nullptr) return absl::OkStatus();
  // Tokens as on gRPC: the Authorization header's "Bearer <token>" (an unknown route needs one
  // too: without a token nothing but health says what the server has).
  absl::Status s = auth_->Check(ex.authorization(), route != nullptr && route->admin);
  if (!s.ok()) {
    metrics_->auth_failures
        .Add({{"code", absl::AsciiStrToLower(absl::StatusCodeToString(s.code()))}})
        .Increment();
  }
  return s;
}

void OpenAiApi::Handle(std::shared_ptr<HttpExchange> ex) {
  const std::string& path = ex->path();
  const std::string& method = ex->method();
  std::string model_id;
  const Route* route = FindRoute(path, &model_id);
  if (route == nullptr || (std::string_view(route->name) == "metrics" &&
                           options_.metrics == OpenAiOptions::Metrics::kOff)) {
    return AnswerError(ex, "other",
                       absl::NotFoundError(absl::StrCat("no route ", Printable(path))));
  }
  if (method != route->method) {
    metrics_->http_requests.Add({{"route", route->name}, {"status", "405"}}).Increment();
    return ex->Respond(
        405, "application/json",
        OpenAiErrorBody(absl::InvalidArgumentError(
            absl::StrCat(Printable(path), " takes ", route->method, ", not ", Printable(method)))));
  }
  const std::string name = route->name;
  if (name == "health") {
    const bool serving = healthy_ && controller_->serving();
    return Answer(ex, name, serving ? 200 : 503, "text/plain", serving ? "" : "not serving");
  }
  // The controller's metrics here too (as on --metrics-port): the Kubernetes inference gateway's
  // endpoint picker scrapes the pool's serving port.
  if (name == "metrics") {
    return Answer(ex, name, 200, "text/plain; version=0.0.4",
                  prometheus::TextSerializer().Serialize(metrics_->registry()->Collect()));
  }
  // The token was checked at the headers (Admit).
  if (name == "models") return Models(ex, model_id);
  absl::Status queued;
  if (name == "load_lora_adapter" || name == "unload_lora_adapter") {
    // LoadAdapter reads and stages the adapter: on a thread of its own.
    const bool posted = admin_.TryPost([this, ex, load = name == "load_lora_adapter"] {
      const std::string route = load ? "load_lora_adapter" : "unload_lora_adapter";
      try {
        AdapterCall(ex, load);
      } catch (const std::exception& e) {  // no exception leaves a request: it is answered 500
        LOG(ERROR) << "HTTP " << route << ": exception: " << e.what();
        AnswerError(ex, route, absl::InternalError("internal error"));
      }
    });
    if (!posted) {
      queued = absl::ResourceExhaustedError("64 adapter calls wait already: retry later");
    }
  } else {
    queued = controller_->Prepare([ex, name, this] {
      const size_t body_bytes = ex->body().size();
      try {
        Generate(ex, name == "chat");
      } catch (const std::exception& e) {
        LOG(ERROR) << "HTTP " << name << ": exception: " << e.what();
        AnswerError(ex, name, absl::InternalError("internal error"));
      }
      // A large body's text and tree are freed by now; glibc would keep their pages in its
      // arenas (up to hundreds of MB after a body of a million values): handed back here, so
      // that the controller's memory follows what it holds.
      if (body_bytes >= (size_t{1} << 20)) malloc_trim(0);
    });
  }
  if (!queued.ok()) AnswerError(ex, name, queued);
}

void OpenAiApi::AdapterCall(const std::shared_ptr<HttpExchange>& ex, bool load) {
  const std::string route = load ? "load_lora_adapter" : "unload_lora_adapter";
  absl::StatusOr<ordered_json> parsed;
  {
    const std::string text = ex->TakeBody();
    parsed = ParseClientJson(text, options_.json);
  }
  if (!parsed.ok() || !parsed->is_object()) {
    return AnswerError(ex, route,
                       absl::InvalidArgumentError(absl::StrCat(
                           "the request body is not a JSON object",
                           parsed.ok() ? "" : absl::StrCat(": ", parsed.status().message()))));
  }
  const ordered_json& body = *parsed;
  const std::string n = StringMember(body, "lora_name");
  if (n.empty()) {
    return AnswerError(
        ex, route, absl::InvalidArgumentError("lora_name must be a non-empty string"), "lora_name");
  }
  if (load) {
    auto path = body.find("lora_path");
    if (path == body.end() || !path->is_string()) {
      return AnswerError(ex, route, absl::InvalidArgumentError("lora_path must be a string"),
                         "lora_path");
    }
    // vLLM refuses a name that is loaded already (gRPC's LoadAdapter takes the same name and
    // path again as a no-op).
    if (controller_->GetAdapter(n).ok()) {
      return AnswerError(ex, route,
                         absl::InvalidArgumentError(
                             absl::StrCat("The lora adapter '", n, "' has already been loaded.")),
                         "lora_name");
    }
    v1::LoadAdapterRequest req;
    req.set_name(n);
    req.set_path(path->get<std::string>());
    absl::StatusOr<v1::Adapter> a = controller_->LoadAdapter(req);
    if (!a.ok()) return AnswerError(ex, route, a.status());
    return Answer(ex, route, 200, "text/plain",
                  absl::StrCat("Success: LoRA adapter '", n, "' added successfully."));
  }
  absl::StatusOr<v1::Adapter> a = controller_->UnloadAdapter(n);
  if (!a.ok()) return AnswerError(ex, route, a.status());
  return Answer(ex, route, 200, "text/plain",
                absl::StrCat("Success: LoRA adapter '", n, "' removed successfully."));
}

void OpenAiApi::Models(const std::shared_ptr<HttpExchange>& ex, const std::string& id) {
  const int64_t now = UnixNow();
  json data = json::array();
  json base = {{"id", options_.served_model_name},
               {"object", "model"},
               {"created", now},
               {"owned_by", "moelora"},
               {"root", options_.model_path},
               {"parent", nullptr}};
  if (const int len = controller_->max_model_len(); len > 0) base["max_model_len"] = len;
  data.push_back(std::move(base));
  for (const v1::Adapter& a : controller_->ListAdapters()) {
    if (a.state() != v1::ADAPTER_STATE_READY) continue;
    data.push_back({{"id", a.name()},
                    {"object", "model"},
                    {"created", now},
                    {"owned_by", "moelora"},
                    {"root", a.path()},
                    {"parent", options_.served_model_name}});
  }
  if (id.empty()) {
    return Answer(ex, "models", 200, "application/json",
                  JsonText(json{{"object", "list"}, {"data", std::move(data)}}));
  }
  for (json& m : data) {
    if (m["id"] == id) return Answer(ex, "models", 200, "application/json", JsonText(m));
  }
  AnswerError(ex, "models",
              absl::NotFoundError(absl::StrCat("The model `", id, "` does not exist.")), "model");
}

}  // namespace moelora
