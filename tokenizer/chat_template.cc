#include "tokenizer/chat_template.h"

#include <fstream>
#include <sstream>
#include <utility>

#include "absl/strings/str_cat.h"
#include "jinja/template.h"
#include "nlohmann/json.hpp"

namespace moelora::tok {

using nlohmann::ordered_json;

struct ChatTemplate::Impl {
  std::shared_ptr<const jinja::Template> engine;
};

ChatTemplate::ChatTemplate() : impl_(std::make_unique<Impl>()) {}
ChatTemplate::~ChatTemplate() = default;

absl::StatusOr<std::shared_ptr<const ChatTemplate>> ChatTemplate::Parse(std::string_view source) {
  std::shared_ptr<ChatTemplate> t(new ChatTemplate());
  absl::StatusOr<std::shared_ptr<const jinja::Template>> engine =
      jinja::Template::Parse(source, "chat template");
  if (!engine.ok()) return engine.status();
  t->impl_->engine = *std::move(engine);
  return std::shared_ptr<const ChatTemplate>(std::move(t));
}

absl::StatusOr<std::string> ChatTemplate::Render(const ordered_json& variables) const {
  return impl_->engine->Render(variables);
}

absl::StatusOr<std::string> ReadChatTemplate(const std::string& model_dir) {
  {
    std::ifstream f(model_dir + "/chat_template.jinja", std::ios::binary);
    if (f) {
      std::stringstream ss;
      ss << f.rdbuf();
      return ss.str();
    }
  }
  const std::string path = model_dir + "/tokenizer_config.json";
  std::ifstream f(path);
  if (!f)
    return absl::NotFoundError(
        absl::StrCat(model_dir, " has no chat_template.jinja and no tokenizer_config.json"));
  ordered_json j = ordered_json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  auto it = j.find("chat_template");
  if (it == j.end() || it->is_null())
    return absl::NotFoundError(absl::StrCat(path, " has no chat_template"));
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array()) {
    for (const auto& e : *it) {
      if (e.is_object() && e.value("name", "") == "default" && e.contains("template") &&
          e["template"].is_string()) {
        return e["template"].get<std::string>();
      }
    }
    return absl::NotFoundError(absl::StrCat(path, ": chat_template has no \"default\" entry"));
  }
  return absl::InvalidArgumentError(
      absl::StrCat(path, ": chat_template is neither a string nor a list"));
}

absl::StatusOr<ordered_json> ReadSpecialTokenVariables(const std::string& model_dir) {
  ordered_json out = ordered_json::object();
  const std::string path = model_dir + "/tokenizer_config.json";
  std::ifstream f(path);
  if (!f) return out;
  ordered_json j = ordered_json::parse(f, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object())
    return absl::InvalidArgumentError(absl::StrCat(path, ": not a JSON object"));
  for (const char* key : {"bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                          "cls_token", "mask_token"}) {
    auto it = j.find(key);
    if (it == j.end()) continue;
    if (it->is_string()) {
      out[key] = *it;
    } else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) {
      out[key] = (*it)["content"];
    }
  }
  return out;
}

ordered_json ChatTemplateVariables(const ordered_json& messages, const ordered_json& tools,
                                   bool add_generation_prompt, const ordered_json& special_tokens,
                                   const ordered_json& kwargs) {
  ordered_json chat = ordered_json::array();
  for (const ordered_json& given : messages) {
    if (!given.is_object()) {
      chat.push_back(given);
      continue;
    }
    // transformers drops a message's keys whose value is null (OpenAI clients send
    // "content": null beside tool calls).
    ordered_json m = ordered_json::object();
    for (const auto& [k, v] : given.items()) {
      if (!v.is_null()) m[k] = v;
    }
    // transformers fills `thinking` (first) and `reasoning_content` (last, or in place) from the
    // first of reasoning_content, thinking, reasoning that is set.
    const ordered_json* reasoning = nullptr;
    for (const char* key : {"reasoning_content", "thinking", "reasoning"}) {
      auto it = m.find(key);
      if (it != m.end() && !it->is_null()) {
        reasoning = &*it;
        break;
      }
    }
    if (reasoning == nullptr) {
      chat.push_back(std::move(m));
      continue;
    }
    ordered_json aliased = ordered_json::object();
    aliased["thinking"] = *reasoning;
    for (const auto& [k, v] : m.items()) aliased[k] = v;
    aliased["reasoning_content"] = *reasoning;
    chat.push_back(std::move(aliased));
  }
  ordered_json vars = ordered_json::object();
  vars["messages"] = std::move(chat);
  vars["tools"] = tools;
  vars["documents"] = nullptr;
  vars["add_generation_prompt"] = add_generation_prompt;
  for (const auto& [k, v] : special_tokens.items()) vars[k] = v;
  if (kwargs.is_object()) {
    for (const auto& [k, v] : kwargs.items()) vars[k] = v;
  }
  return vars;
}

}  // namespace moelora::tok
