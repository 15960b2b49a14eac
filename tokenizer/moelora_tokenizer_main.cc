// moelora-tokenizer: the controller's tokenizer on JSON lines.
//
//   moelora-tokenizer encode DIR   stdin: a JSON string per line   -> stdout: [ids...] per line
//   moelora-tokenizer decode DIR   stdin: a JSON array of ids      -> stdout: "text" per line
//   moelora-tokenizer chat DIR     stdin: a JSON object per line   -> stdout: "prompt" or
//                                  {"error": "..."} per line
//
// DIR is a model directory or a tokenizer.json. Exit status 2 (with the line number on stderr)
// for a line that is not valid UTF-8, not JSON, or not of the expected type; 1 when the tokenizer
// cannot be loaded.
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"
#include "tokenizer/chat_template.h"
#include "tokenizer/tokenizer.h"

ABSL_FLAG(
    bool, add_special_tokens, true,
    "encode: apply the post-processor's template (e.g. a BOS), as Hugging Face does by default");
ABSL_FLAG(bool, skip_special_tokens, false, "decode: leave out special tokens");

namespace {

int Fail(int64_t line, const std::string& why) {
  std::cerr << "moelora-tokenizer: line " << line << ": " << why << "\n";
  return 2;
}

// chat: each line {"messages", "tools"?, "add_generation_prompt"?, "chat_template"?,
// "chat_template_kwargs"?} rendered with DIR's chat template (or the line's own).
int Chat(const std::string& dir) {
  auto source = moelora::tok::ReadChatTemplate(dir);
  auto special = moelora::tok::ReadSpecialTokenVariables(dir);
  if (!special.ok()) {
    std::cerr << "moelora-tokenizer: " << special.status() << "\n";
    return 1;
  }
  std::shared_ptr<const moelora::tok::ChatTemplate> model_template;
  if (source.ok()) {
    auto t = moelora::tok::ChatTemplate::Parse(*source);
    if (!t.ok()) {
      std::cerr << "moelora-tokenizer: " << t.status() << "\n";
      return 1;
    }
    model_template = *t;
  }
  std::string line;
  int64_t n = 0;
  while (std::getline(std::cin, line)) {
    ++n;
    const nlohmann::ordered_json j =
        nlohmann::ordered_json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Fail(n, "not valid JSON (or not UTF-8)");
    if (!j.is_object() || !j.contains("messages")) {
      return Fail(n, "chat expects a JSON object with \"messages\"");
    }
    std::shared_ptr<const moelora::tok::ChatTemplate> t = model_template;
    if (j.contains("chat_template")) {
      auto own = moelora::tok::ChatTemplate::Parse(j["chat_template"].get<std::string>());
      if (!own.ok()) {
        std::cout << nlohmann::json({{"error", std::string(own.status().message())}}).dump()
                  << "\n";
        continue;
      }
      t = *own;
    }
    if (t == nullptr) return Fail(n, std::string(source.status().message()));
    const auto vars = moelora::tok::ChatTemplateVariables(
        j["messages"], j.value("tools", nlohmann::ordered_json()),
        j.value("add_generation_prompt", false), *special,
        j.value("chat_template_kwargs", nlohmann::ordered_json::object()));
    auto text = t->Render(vars);
    if (text.ok()) {
      std::cout << nlohmann::json(*text).dump() << "\n";
    } else {
      std::cout << nlohmann::json({{"error", std::string(text.status().message())}}).dump() << "\n";
    }
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args = moelora::ParseFlags(
      argc, argv,
      "moelora-tokenizer encode|decode|chat DIR\n"
      "  encode: reads a JSON string per line on stdin, writes its token ids as a JSON array\n"
      "  decode: reads a JSON array of token ids per line, writes the text as a JSON string\n"
      "  chat: reads a JSON object per line ({\"messages\": [...], \"tools\": [...],\n"
      "    \"add_generation_prompt\": true, \"chat_template_kwargs\": {...}, \"chat_template\": "
      "\"...\"})\n"
      "    and writes the prompt DIR's chat template renders as a JSON string, or {\"error\": "
      "...}\n"
      "  DIR: a model directory (tokenizer.json) or a tokenizer.json file.\n"
      "  Exit 2 on a line that is not valid UTF-8 or not the expected JSON (naming the line).",
      "moelora_tokenizer_main");
  if (args.size() != 3 || (args[1] != "encode" && args[1] != "decode" && args[1] != "chat")) {
    std::cerr << "usage: moelora-tokenizer encode|decode|chat DIR (see --help)\n";
    return 2;
  }
  std::ios::sync_with_stdio(false);
  if (args[1] == "chat") return Chat(args[2]);
  auto tok = moelora::tok::Tokenizer::Load(args[2]);
  if (!tok.ok()) {
    std::cerr << "moelora-tokenizer: " << tok.status() << "\n";
    return 1;
  }
  const bool encode = args[1] == "encode";
  const bool add_special = absl::GetFlag(FLAGS_add_special_tokens);
  const bool skip_special = absl::GetFlag(FLAGS_skip_special_tokens);
  std::ios::sync_with_stdio(false);
  std::string line;
  int64_t n = 0;
  while (std::getline(std::cin, line)) {
    ++n;
    size_t bad = 0;
    if (!moelora::IsValidUtf8(line, &bad)) {
      return Fail(n, absl::StrCat("not valid UTF-8 (byte offset ", bad, ")"));
    }
    const nlohmann::json j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded()) return Fail(n, "not valid JSON");
    if (encode) {
      if (!j.is_string()) return Fail(n, "encode expects a JSON string");
      auto ids = (*tok)->Encode(j.get<std::string>(), add_special);
      if (!ids.ok()) return Fail(n, std::string(ids.status().message()));
      std::cout << nlohmann::json(*ids).dump() << "\n";
    } else {
      if (!j.is_array()) return Fail(n, "decode expects a JSON array of token ids");
      std::vector<int32_t> ids;
      for (size_t i = 0; i < j.size(); ++i) {
        const int64_t id = j[i].is_number_integer() ? j[i].get<int64_t>() : -1;
        if (id < 0 || id >= (*tok)->vocab_size() || !(*tok)->IsKnown(static_cast<int32_t>(id))) {
          return Fail(n, absl::StrCat("element ", i, " (", j[i].dump(),
                                      ") is not a token id of this tokenizer (0 .. ",
                                      (*tok)->vocab_size() - 1, ")"));
        }
        ids.push_back(static_cast<int32_t>(id));
      }
      std::cout << nlohmann::json((*tok)->Decode(ids, skip_special)).dump() << "\n";
    }
  }
  return 0;
}
