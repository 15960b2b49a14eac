// Chat templates: a model's `chat_template` read from its files and rendered through the Jinja
// engine (jinja/template.h) as transformers' `apply_chat_template` does, with the special tokens
// as variables and the reasoning fields aliased. tests/integration/chat_template_test.sh renders
// real templates and a corpus of conversations and template snippets through transformers and
// this class and requires identical bytes.
//
// Thread-safety: a parsed ChatTemplate is immutable; Render may run on any thread at once.
#ifndef MOELORA_TOKENIZER_CHAT_TEMPLATE_H_
#define MOELORA_TOKENIZER_CHAT_TEMPLATE_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace moelora::tok {

class ChatTemplate {
 public:
  // INVALID_ARGUMENT naming the line for a template this class cannot parse.
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const ChatTemplate>> Parse(
      std::string_view source);
  ~ChatTemplate();
  ChatTemplate(const ChatTemplate&) = delete;
  ChatTemplate& operator=(const ChatTemplate&) = delete;

  // Renders with `variables` as the template's globals (JSON object: messages, tools,
  // add_generation_prompt, special tokens, kwargs). INVALID_ARGUMENT with the template's own
  // message for raise_exception, or naming the line of an error (an undefined attribute's
  // attribute, a type error).
  [[nodiscard]] absl::StatusOr<std::string> Render(const nlohmann::ordered_json& variables) const;

  struct Impl;

 private:
  ChatTemplate();
  std::unique_ptr<Impl> impl_;
};

// The model's chat template: `chat_template.jinja` in `model_dir`, else tokenizer_config.json's
// `chat_template` (a string, or a list of {name, template} whose "default" is taken). NOT_FOUND
// when neither has one.
[[nodiscard]] absl::StatusOr<std::string> ReadChatTemplate(const std::string& model_dir);

// The variables transformers adds for a tokenizer: tokenizer_config.json's bos_token, eos_token,
// unk_token, sep_token, pad_token, cls_token and mask_token (strings or {"content": ...}), those
// that are set. An empty object when there is no tokenizer_config.json.
[[nodiscard]] absl::StatusOr<nlohmann::ordered_json> ReadSpecialTokenVariables(
    const std::string& model_dir);

// Everything apply_chat_template(messages, tools=tools, add_generation_prompt=..., **kwargs)
// hands the template: `messages` without their null-valued keys and with reasoning aliased as
// transformers does (`thinking` and `reasoning_content` set from the first of reasoning_content,
// thinking, reasoning that is present), `tools` (null when
// absent), `documents` null, `add_generation_prompt`, the special tokens, then `kwargs` (which
// override them).
[[nodiscard]] nlohmann::ordered_json ChatTemplateVariables(
    const nlohmann::ordered_json& messages, const nlohmann::ordered_json& tools,
    bool add_generation_prompt, const nlohmann::ordered_json& special_tokens,
    const nlohmann::ordered_json& kwargs);

}  // namespace moelora::tok

#endif  // MOELORA_TOKENIZER_CHAT_TEMPLATE_H_
