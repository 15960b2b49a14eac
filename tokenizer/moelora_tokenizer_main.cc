// moelora-tokenizer: the controller's tokenizer on JSON lines.
//
//   moelora-tokenizer encode DIR   stdin: a JSON string per line   -> stdout: [ids...] per line
//   moelora-tokenizer decode DIR   stdin: a JSON array of ids      -> stdout: "text" per line
//
// DIR is a model directory or a tokenizer.json. Exit status 2 (with the line number on stderr)
// for a line that is not valid UTF-8, not JSON, or not of the expected type; 1 when the tokenizer
// cannot be loaded.
#include <iostream>
#include <string>

#include "absl/flags/flag.h"
#include "absl/strings/str_cat.h"
#include "common/flags.h"
#include "nlohmann/json.hpp"
#include "tokenizer/tokenizer.h"
#include "tokenizer/utf8.h"

ABSL_FLAG(
    bool, add_special_tokens, true,
    "encode: apply the post-processor's template (e.g. a BOS), as Hugging Face does by default");
ABSL_FLAG(bool, skip_special_tokens, false, "decode: leave out special tokens");

namespace {

int Fail(int64_t line, const std::string& why) {
  std::cerr << "moelora-tokenizer: line " << line << ": " << why << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args = moelora::ParseFlags(
      argc, argv,
      "moelora-tokenizer encode|decode DIR\n"
      "  encode: reads a JSON string per line on stdin, writes its token ids as a JSON array\n"
      "  decode: reads a JSON array of token ids per line, writes the text as a JSON string\n"
      "  DIR: a model directory (tokenizer.json) or a tokenizer.json file.\n"
      "  Exit 2 on a line that is not valid UTF-8 or not the expected JSON (naming the line).",
      "moelora_tokenizer_main");
  if (args.size() != 3 || (args[1] != "encode" && args[1] != "decode")) {
    std::cerr << "usage: moelora-tokenizer encode|decode DIR (see --help)\n";
    return 2;
  }
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
    if (!moelora::tok::IsValidUtf8(line, &bad)) {
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
