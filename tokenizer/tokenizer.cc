#include "tokenizer/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>

#include <algorithm>
#include <array>
#include <deque>
#include <filesystem>
#include <fstream>
#include <map>
#include <queue>
#include <sstream>

#include "absl/container/flat_hash_map.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "absl/strings/string_view.h"
#include "common/status_macros.h"
#include "common/utf8.h"
#include "nlohmann/json.hpp"

namespace moelora::tok {
namespace {

using json = nlohmann::json;
namespace fs = std::filesystem;

// ---- Byte-level alphabet (GPT-2): every byte has a printable code point. -------------------
struct ByteLevelAlphabet {
  std::array<std::string, 256> byte_to_char;  // UTF-8 of the code point standing for the byte
  absl::flat_hash_map<char32_t, uint8_t> char_to_byte;
  ByteLevelAlphabet() {
    std::vector<int> bs, cs;
    for (int b = 0; b < 256; ++b) {
      if ((b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255)) {
        bs.push_back(b);
        cs.push_back(b);
      }
    }
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      if (std::find(bs.begin(), bs.end(), b) == bs.end()) {
        bs.push_back(b);
        cs.push_back(256 + n++);
      }
    }
    for (size_t i = 0; i < bs.size(); ++i) {
      const char32_t c = static_cast<char32_t>(cs[i]);
      std::string u;
      if (c < 0x80) {
        u.push_back(static_cast<char>(c));
      } else {
        u.push_back(static_cast<char>(0xC0 | (c >> 6)));
        u.push_back(static_cast<char>(0x80 | (c & 0x3F)));
      }
      byte_to_char[bs[i]] = u;
      char_to_byte[c] = static_cast<uint8_t>(bs[i]);
    }
  }
};
const ByteLevelAlphabet& Alphabet() {
  static const ByteLevelAlphabet* a = new ByteLevelAlphabet();
  return *a;
}

// Unicode White_Space (Rust's char::is_whitespace, Oniguruma's \s).
bool IsWhiteSpace(char32_t c) {
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE);
}
// Rust's char::is_alphanumeric (Alphabetic or Numeric), or '_': tokenizers' "word character".
bool IsWordChar(char32_t c) {
  const UChar32 u = static_cast<UChar32>(c);
  if (c == '_' || u_hasBinaryProperty(u, UCHAR_ALPHABETIC)) return true;
  const int8_t t = u_charType(u);
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}
char32_t LastChar(std::string_view s) {
  size_t i = s.size();
  while (i > 0 && (static_cast<unsigned char>(s[i - 1]) & 0xC0) == 0x80) --i;
  if (i == 0) return 0;
  size_t len;
  return DecodeCodePoint(s, i - 1, &len);
}

// ---- Regexes -------------------------------------------------------------------------------
// tokenizer.json regexes are Oniguruma's (what `tokenizers` compiles them with). PCRE2 in UTF
// + UCP mode agrees on \p{..}, (?i:..), look-ahead and leftmost-first alternation; it differs on
// \s (PCRE2 adds U+180E), so \s and \S are rewritten to Unicode White_Space explicitly.
constexpr char kWhiteSpaceClass[] =
    "\\x{9}-\\x{D}\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}\\x{202F}"
    "\\x{205F}\\x{3000}";

[[nodiscard]] absl::StatusOr<std::string> OnigToPcre2(const std::string& p) {
  std::string out;
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char n = p[i + 1];
      ++i;
      if (n == 's') {
        out += in_class ? std::string(kWhiteSpaceClass) : absl::StrCat("[", kWhiteSpaceClass, "]");
      } else if (n == 'S') {
        if (in_class) {
          return absl::UnimplementedError(
              absl::StrCat("regex ", p, ": \\S inside a character class is not supported"));
        }
        out += absl::StrCat("[^", kWhiteSpaceClass, "]");
      } else if (n == 'h' || n == 'H') {
        return absl::UnimplementedError(
            absl::StrCat("regex ", p, ": Oniguruma's \\h (hex digit) is not supported"));
      } else {
        out.push_back('\\');
        out.push_back(n);
      }
      continue;
    }
    if (c == '[' && !in_class) {
      in_class = true;
      out.push_back(c);
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);  // literal ']' first
      continue;
    }
    if (c == '[' && in_class) {
      return absl::UnimplementedError(
          absl::StrCat("regex ", p, ": nested character classes are not supported"));
    }
    if (c == ']' && in_class) in_class = false;
    out.push_back(c);
  }
  return out;
}

class Regex {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<Regex>> Compile(const std::string& onig,
                                                                      bool literal) {
    std::string pattern;
    uint32_t options = PCRE2_UTF | PCRE2_UCP | PCRE2_NO_UTF_CHECK;
    if (literal) {
      pattern = onig;
      options |= PCRE2_LITERAL;
    } else {
      MOELORA_ASSIGN_OR_RETURN(pattern, OnigToPcre2(onig));
    }
    int err = 0;
    PCRE2_SIZE off = 0;
    pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                     options, &err, &off, nullptr);
    if (code == nullptr) {
      PCRE2_UCHAR msg[256];
      pcre2_get_error_message(err, msg, sizeof(msg));
      return absl::InvalidArgumentError(
          absl::StrCat("regex ", onig, ": ", reinterpret_cast<char*>(msg), " at offset ", off));
    }
    pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter if unavailable
    return std::unique_ptr<Regex>(new Regex(code));
  }
  ~Regex() { pcre2_code_free(code_); }

  // Appends the pieces of `s` to *out: matches and the text between them ("Isolated"), or the
  // text between matches only ("Removed").
  [[nodiscard]] absl::Status Split(std::string_view s, bool keep_matches,
                                   std::vector<std::string_view>* out) const {
    pcre2_match_data* md = pcre2_match_data_create_from_pattern(code_, nullptr);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(s.data());
    size_t pos = 0, last = 0;
    absl::Status status;
    while (pos <= s.size()) {
      const int rc = pcre2_match(code_, subject, s.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(rc, msg, sizeof(msg));
        status = absl::InternalError(absl::StrCat("regex match: ", reinterpret_cast<char*>(msg)));
        break;
      }
      const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
      const size_t b = ov[0], e = ov[1];
      if (e == b) {  // an empty match splits nothing: step one character on
        size_t len = 1;
        if (b < s.size()) DecodeCodePoint(s, b, &len);
        pos = b + len;
        continue;
      }
      if (b > last) out->push_back(s.substr(last, b - last));
      if (keep_matches) out->push_back(s.substr(b, e - b));
      last = pos = e;
    }
    if (last < s.size()) out->push_back(s.substr(last));
    pcre2_match_data_free(md);
    return status;
  }

 private:
  explicit Regex(pcre2_code* code) : code_(code) {}
  pcre2_code* code_;
};

// The GPT-2 pattern ByteLevel uses when `use_regex` is true.
constexpr char kGpt2Pattern[] =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

// ---- Pipeline components -------------------------------------------------------------------
struct PreTokenizerStep {
  enum Kind { kSplit, kByteLevel } kind;
  std::unique_ptr<Regex> regex;   // kSplit; kByteLevel with use_regex
  bool keep_matches = true;       // kSplit: Isolated (true) or Removed
  bool add_prefix_space = false;  // kByteLevel
};

struct AddedToken {
  int32_t id;
  std::string content;
  bool special, normalized, lstrip, rstrip, single_word;
};

// A byte trie over added tokens' contents, for leftmost-longest matching.
class Trie {
 public:
  void Insert(std::string_view s, int index) {
    int node = 0;
    for (unsigned char c : s) {
      auto it = nodes_[node].next.find(c);
      if (it == nodes_[node].next.end()) {
        nodes_.push_back({});
        it = nodes_[node].next.emplace(c, static_cast<int>(nodes_.size()) - 1).first;
      }
      node = it->second;
    }
    nodes_[node].token = index;
    first_[static_cast<unsigned char>(s[0])] = true;
  }
  bool empty() const { return nodes_.size() == 1; }
  // The longest token at s[i] (its index; *len its length), or -1.
  int LongestAt(std::string_view s, size_t i, size_t* len) const {
    if (!first_[static_cast<unsigned char>(s[i])]) return -1;
    int node = 0, best = -1;
    for (size_t j = i; j < s.size(); ++j) {
      auto it = nodes_[node].next.find(static_cast<unsigned char>(s[j]));
      if (it == nodes_[node].next.end()) break;
      node = it->second;
      if (nodes_[node].token >= 0) {
        best = nodes_[node].token;
        *len = j + 1 - i;
      }
    }
    return best;
  }

 private:
  struct Node {
    std::map<unsigned char, int> next;
    int token = -1;
  };
  std::vector<Node> nodes_ = {Node{}};
  std::array<bool, 256> first_{};
};

// One piece of the input: text still to tokenize, or an added token's id.
struct Piece {
  std::string text;
  int32_t added_id = -1;
};

[[nodiscard]] absl::StatusOr<json> ReadJson(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat("cannot read ", p.string()));
  std::stringstream ss;
  ss << in.rdbuf();
  json j = json::parse(ss.str(), nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded())
    return absl::InvalidArgumentError(absl::StrCat(p.string(), ": not valid JSON"));
  return j;
}

// generation_config.json's EOS ids (an int or a list, deduplicated) and BOS id; empty when the
// file or a key is absent.
struct GenerationIds {
  std::vector<int32_t> eos;
  std::optional<int32_t> bos;
};
[[nodiscard]] absl::StatusOr<GenerationIds> ReadGenerationConfig(const std::string& model_dir) {
  GenerationIds out;
  std::error_code ec;
  const fs::path gen = fs::path(model_dir) / "generation_config.json";
  if (!fs::exists(gen, ec)) return out;
  MOELORA_ASSIGN_OR_RETURN(json g, ReadJson(gen));
  if (!g.is_object()) return out;
  const json& e = g.value("eos_token_id", json());
  auto add = [&](const json& x) {
    if (!x.is_number_integer()) return;
    const int32_t id = x.get<int32_t>();
    if (std::find(out.eos.begin(), out.eos.end(), id) == out.eos.end()) out.eos.push_back(id);
  };
  add(e);
  if (e.is_array()) {
    for (const json& x : e) add(x);
  }
  const json& b = g.value("bos_token_id", json());
  if (b.is_number_integer()) out.bos = b.get<int32_t>();
  return out;
}

}  // namespace

struct Tokenizer::Impl {
  std::string file;
  // Normalizers applied in order (ICU instances are process-wide singletons).
  std::vector<const icu::Normalizer2*> normalizers;
  std::vector<PreTokenizerStep> pre;
  bool byte_level = false;  // the ByteLevel pre-tokenizer maps bytes to the alphabet
  // BPE.
  absl::flat_hash_map<std::string, int32_t> vocab;
  // Byte-level vocabularies: the raw bytes each token stands for -> its id (for ignore_merges,
  // so that a word is looked up without mapping it to the byte alphabet first).
  absl::flat_hash_map<std::string, int32_t> bytes_vocab;
  absl::flat_hash_map<uint64_t, std::pair<int32_t, int32_t>> merges;  // (a,b) -> (rank, new id)
  std::array<int32_t, 256> byte_id{};                                 // byte -> its token (-1)
  std::optional<int32_t> unk_id;
  bool fuse_unk = false;
  bool ignore_merges = false;
  // Added tokens.
  std::vector<AddedToken> added;
  Trie raw_trie, normalized_trie;
  // Post-processor template (single sequence): ids before and after the sequence.
  std::vector<int32_t> prefix_ids, suffix_ids;
  // Decoding.
  std::vector<std::string> id_bytes;
  std::vector<uint8_t> id_flags;  // bit 0 known, bit 1 special

  [[nodiscard]] absl::Status ParseNormalizer(const json& n);
  [[nodiscard]] absl::Status ParsePreTokenizer(const json& p);
  [[nodiscard]] absl::Status ParseModel(const json& m);
  [[nodiscard]] absl::Status ParsePostProcessor(const json& p);
  [[nodiscard]] absl::Status ParseDecoder(const json& d);

  [[nodiscard]] absl::StatusOr<std::string> Normalize(std::string_view s) const;
  void SplitAdded(std::string_view s, const Trie& trie, std::vector<Piece>* out) const;
  void Bpe(std::string_view word, std::vector<int32_t>* out) const;
};

absl::Status Tokenizer::Impl::ParseNormalizer(const json& n) {
  if (n.is_null()) return absl::OkStatus();
  const std::string type = n.value("type", "");
  if (type == "Sequence") {
    for (const json& x : n.value("normalizers", json::array()))
      MOELORA_RETURN_IF_ERROR(ParseNormalizer(x));
    return absl::OkStatus();
  }
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* nz = nullptr;
  if (type == "NFC") nz = icu::Normalizer2::getNFCInstance(err);
  if (type == "NFD") nz = icu::Normalizer2::getNFDInstance(err);
  if (type == "NFKC") nz = icu::Normalizer2::getNFKCInstance(err);
  if (type == "NFKD") nz = icu::Normalizer2::getNFKDInstance(err);
  if (nz == nullptr) {
    return absl::UnimplementedError(absl::StrCat(
        "normalizer \"", type, "\" is not implemented (NFC, NFD, NFKC, NFKD and Sequence are)"));
  }
  if (U_FAILURE(err))
    return absl::InternalError(absl::StrCat("ICU ", type, ": ", u_errorName(err)));
  normalizers.push_back(nz);
  return absl::OkStatus();
}

absl::Status Tokenizer::Impl::ParsePreTokenizer(const json& p) {
  if (p.is_null()) return absl::OkStatus();
  const std::string type = p.value("type", "");
  if (type == "Sequence") {
    for (const json& x : p.value("pretokenizers", json::array()))
      MOELORA_RETURN_IF_ERROR(ParsePreTokenizer(x));
    return absl::OkStatus();
  }
  PreTokenizerStep step;
  if (type == "Split") {
    step.kind = PreTokenizerStep::kSplit;
    const std::string behavior = p.value("behavior", "");
    if (behavior != "Isolated" && behavior != "Removed") {
      return absl::UnimplementedError(
          absl::StrCat("pre-tokenizer Split with behavior \"", behavior,
                       "\" is not implemented (Isolated and Removed are)"));
    }
    if (p.value("invert", false))
      return absl::UnimplementedError("pre-tokenizer Split with invert: true is not implemented");
    step.keep_matches = behavior == "Isolated";
    const json& pat = p.value("pattern", json::object());
    if (pat.contains("Regex")) {
      MOELORA_ASSIGN_OR_RETURN(step.regex, Regex::Compile(pat["Regex"].get<std::string>(), false));
    } else if (pat.contains("String")) {
      MOELORA_ASSIGN_OR_RETURN(step.regex, Regex::Compile(pat["String"].get<std::string>(), true));
    } else {
      return absl::InvalidArgumentError(
          "pre-tokenizer Split has no pattern.Regex or pattern.String");
    }
  } else if (type == "ByteLevel") {
    step.kind = PreTokenizerStep::kByteLevel;
    step.add_prefix_space = p.value("add_prefix_space", false);
    if (p.value("use_regex", true)) {
      MOELORA_ASSIGN_OR_RETURN(step.regex, Regex::Compile(kGpt2Pattern, false));
    }
    byte_level = true;
  } else {
    return absl::UnimplementedError(absl::StrCat(
        "pre-tokenizer \"", type, "\" is not implemented (Split, ByteLevel and Sequence are)"));
  }
  pre.push_back(std::move(step));
  return absl::OkStatus();
}

absl::Status Tokenizer::Impl::ParseModel(const json& m) {
  const std::string type = m.value("type", "");
  if (type != "BPE")
    return absl::UnimplementedError(
        absl::StrCat("model \"", type, "\" is not implemented (BPE is)"));
  if (!m.value("dropout", json()).is_null())
    return absl::UnimplementedError("BPE dropout is not implemented");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"}) {
    const json& v = m.value(key, json());
    if (!v.is_null() && !v.get<std::string>().empty())
      return absl::UnimplementedError(absl::StrCat("BPE ", key, " is not implemented"));
  }
  if (m.value("byte_fallback", false))
    return absl::UnimplementedError("BPE byte_fallback is not implemented");
  fuse_unk = m.value("fuse_unk", false);
  ignore_merges = m.value("ignore_merges", false);
  const json& v = m.value("vocab", json::object());
  if (!v.is_object() || v.empty())
    return absl::InvalidArgumentError("model.vocab is missing or empty");
  vocab.reserve(v.size());
  for (auto it = v.begin(); it != v.end(); ++it) {
    if (!it.value().is_number_integer())
      return absl::InvalidArgumentError(
          absl::StrCat("model.vocab[\"", it.key(), "\"] is not an integer"));
    const int64_t id = it.value().get<int64_t>();
    if (id < 0 || id > INT32_MAX - 1)
      return absl::InvalidArgumentError(
          absl::StrCat("model.vocab[\"", it.key(), "\"] = ", id, " is out of range"));
    vocab[it.key()] = static_cast<int32_t>(id);
  }
  const json& mm = m.value("merges", json::array());
  merges.reserve(mm.size());
  int32_t rank = 0;
  for (const json& x : mm) {
    std::string a, b;
    if (x.is_string()) {  // "a b" (tokenizers < 0.20)
      const std::string s = x.get<std::string>();
      const size_t sp = s.find(' ', 1);
      if (sp == std::string::npos)
        return absl::InvalidArgumentError(
            absl::StrCat("model.merges[", rank, "] = \"", s, "\" is not \"a b\""));
      a = s.substr(0, sp);
      b = s.substr(sp + 1);
    } else if (x.is_array() && x.size() == 2 && x[0].is_string() && x[1].is_string()) {
      a = x[0].get<std::string>();
      b = x[1].get<std::string>();
    } else {
      return absl::InvalidArgumentError(
          absl::StrCat("model.merges[", rank, "] is neither \"a b\" nor [a, b]"));
    }
    auto ia = vocab.find(a), ib = vocab.find(b), iab = vocab.find(a + b);
    if (ia == vocab.end() || ib == vocab.end() || iab == vocab.end()) {
      return absl::InvalidArgumentError(
          absl::StrCat("model.merges[", rank, "] (\"", a, "\", \"", b,
                       "\"): a part or the merged token is not in the vocabulary"));
    }
    const uint64_t key =
        (static_cast<uint64_t>(ia->second) << 32) | static_cast<uint32_t>(ib->second);
    merges.try_emplace(key, rank, iab->second);  // a repeated pair keeps its first rank
    ++rank;
  }
  const json& unk = m.value("unk_token", json());
  if (!unk.is_null()) {
    auto it = vocab.find(unk.get<std::string>());
    if (it == vocab.end())
      return absl::InvalidArgumentError(absl::StrCat("model.unk_token \"", unk.get<std::string>(),
                                                     "\" is not in the vocabulary"));
    unk_id = it->second;
  }
  return absl::OkStatus();
}

absl::Status Tokenizer::Impl::ParsePostProcessor(const json& p) {
  if (p.is_null()) return absl::OkStatus();
  const std::string type = p.value("type", "");
  if (type == "ByteLevel") return absl::OkStatus();  // offsets only
  if (type == "Sequence") {
    for (const json& x : p.value("processors", json::array()))
      MOELORA_RETURN_IF_ERROR(ParsePostProcessor(x));
    return absl::OkStatus();
  }
  if (type == "TemplateProcessing") {
    if (!prefix_ids.empty() || !suffix_ids.empty())
      return absl::UnimplementedError("more than one TemplateProcessing post-processor");
    const json& specials = p.value("special_tokens", json::object());
    bool seen_sequence = false;
    for (const json& item : p.value("single", json::array())) {
      if (item.contains("Sequence")) {
        if (seen_sequence)
          return absl::InvalidArgumentError("post_processor.single names the sequence twice");
        seen_sequence = true;
      } else if (item.contains("SpecialToken")) {
        const std::string name = item["SpecialToken"].value("id", "");
        if (!specials.contains(name))
          return absl::InvalidArgumentError(
              absl::StrCat("post_processor.single names special token \"", name,
                           "\" that special_tokens lacks"));
        for (const json& id : specials[name].value("ids", json::array())) {
          (seen_sequence ? suffix_ids : prefix_ids).push_back(id.get<int32_t>());
        }
      } else {
        return absl::InvalidArgumentError(
            "post_processor.single: an item is neither Sequence nor SpecialToken");
      }
    }
    return absl::OkStatus();
  }
  return absl::UnimplementedError(
      absl::StrCat("post-processor \"", type,
                   "\" is not implemented (ByteLevel, TemplateProcessing and Sequence are)"));
}

absl::Status Tokenizer::Impl::ParseDecoder(const json& d) {
  const std::string type = d.is_null() ? "null" : d.value("type", "");
  if (type == "ByteLevel") return absl::OkStatus();
  if (type == "Sequence") {
    const json& ds = d.value("decoders", json::array());
    if (ds.size() == 1) return ParseDecoder(ds[0]);
  }
  return absl::UnimplementedError(
      absl::StrCat("decoder \"", type, "\" is not implemented (ByteLevel is)"));
}

absl::StatusOr<std::string> Tokenizer::Impl::Normalize(std::string_view s) const {
  std::string cur(s);
  for (const icu::Normalizer2* nz : normalizers) {
    if (std::all_of(cur.begin(), cur.end(),
                    [](char c) { return static_cast<unsigned char>(c) < 0x80; })) {
      return cur;  // ASCII is invariant under every Unicode normalization form
    }
    UErrorCode err = U_ZERO_ERROR;
    if (nz->isNormalizedUTF8(cur, err) && U_SUCCESS(err)) continue;
    err = U_ZERO_ERROR;
    std::string out;
    icu::StringByteSink<std::string> sink(&out);
    nz->normalizeUTF8(0, cur, sink, nullptr, err);
    if (U_FAILURE(err))
      return absl::InternalError(absl::StrCat("ICU normalization: ", u_errorName(err)));
    cur = std::move(out);
  }
  return cur;
}

void Tokenizer::Impl::SplitAdded(std::string_view s, const Trie& trie,
                                 std::vector<Piece>* out) const {
  if (trie.empty()) {
    out->push_back({std::string(s)});
    return;
  }
  size_t start_offset = 0;  // end of the previous match (with its rstrip)
  size_t i = 0;
  while (i < s.size()) {
    size_t len = 0;
    const int t = trie.LongestAt(s, i, &len);
    if (t < 0) {
      ++i;
      continue;
    }
    const AddedToken& a = added[t];
    size_t start = i, stop = i + len;
    if (a.single_word) {
      const bool start_ok = start == 0 || !IsWordChar(LastChar(s.substr(0, start)));
      size_t cl = 0;
      const bool stop_ok = stop == s.size() || !IsWordChar(DecodeCodePoint(s, stop, &cl));
      if (!start_ok || !stop_ok) {
        i = stop;  // tokenizers' find_iter has consumed the match: it stays plain text
        continue;
      }
    }
    if (a.lstrip) {
      size_t b = start;
      while (b > start_offset) {
        size_t k = b - 1;
        while (k > start_offset && (static_cast<unsigned char>(s[k]) & 0xC0) == 0x80) --k;
        size_t cl;
        if (!IsWhiteSpace(DecodeCodePoint(s, k, &cl))) break;
        b = k;
      }
      start = b;
    }
    if (a.rstrip) {
      while (stop < s.size()) {
        size_t cl;
        if (!IsWhiteSpace(DecodeCodePoint(s, stop, &cl))) break;
        stop += cl;
      }
    }
    if (start > start_offset)
      out->push_back({std::string(s.substr(start_offset, start - start_offset))});
    out->push_back({"", a.id});
    start_offset = i = stop;
  }
  if (start_offset < s.size()) out->push_back({std::string(s.substr(start_offset))});
}

void Tokenizer::Impl::Bpe(std::string_view word, std::vector<int32_t>* out) const {
  // Symbols: the word's bytes (byte-level) or characters, as token ids.
  struct Symbol {
    int32_t id;
    int prev, next;
    bool alive;
  };
  std::vector<Symbol> sym;
  sym.reserve(word.size());
  if (byte_level) {
    if (ignore_merges) {
      auto it = bytes_vocab.find(absl::string_view(word.data(), word.size()));
      if (it != bytes_vocab.end()) {
        out->push_back(it->second);
        return;
      }
    }
    for (unsigned char b : word) {
      const int32_t id = byte_id[b];
      if (id < 0) {
        if (unk_id && !(fuse_unk && !sym.empty() && sym.back().id == *unk_id))
          sym.push_back({*unk_id, 0, 0, true});
        continue;
      }
      sym.push_back({id, 0, 0, true});
    }
  } else {
    if (ignore_merges) {
      auto it = vocab.find(std::string(word));
      if (it != vocab.end()) {
        out->push_back(it->second);
        return;
      }
    }
    for (size_t i = 0; i < word.size();) {
      size_t len;
      DecodeCodePoint(word, i, &len);
      auto it = vocab.find(std::string(word.substr(i, len)));
      i += len;
      if (it == vocab.end()) {
        if (unk_id && !(fuse_unk && !sym.empty() && sym.back().id == *unk_id))
          sym.push_back({*unk_id, 0, 0, true});
        continue;
      }
      sym.push_back({it->second, 0, 0, true});
    }
  }
  const int n = static_cast<int>(sym.size());
  for (int i = 0; i < n; ++i) {
    sym[i].prev = i - 1;
    sym[i].next = i + 1 < n ? i + 1 : -1;
  }
  // tokenizers' Word::merge_all: the lowest rank first, then the leftmost position; a queued
  // merge whose pair has changed since is skipped.
  struct Merge {
    int32_t rank;
    int pos;
    int32_t new_id;
    bool operator<(const Merge& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
  };
  auto lookup = [&](int32_t a, int32_t b) -> const std::pair<int32_t, int32_t>* {
    auto it = merges.find((static_cast<uint64_t>(a) << 32) | static_cast<uint32_t>(b));
    return it == merges.end() ? nullptr : &it->second;
  };
  std::priority_queue<Merge> queue;
  for (int i = 0; i + 1 < n; ++i) {
    if (const auto* m = lookup(sym[i].id, sym[i + 1].id)) queue.push({m->first, i, m->second});
  }
  while (!queue.empty()) {
    const Merge top = queue.top();
    queue.pop();
    Symbol& cur = sym[top.pos];
    if (!cur.alive || cur.next < 0) continue;
    const int right = cur.next;
    const auto* m = lookup(cur.id, sym[right].id);
    if (m == nullptr || m->second != top.new_id) continue;
    cur.id = top.new_id;
    sym[right].alive = false;
    cur.next = sym[right].next;
    if (cur.next >= 0) sym[cur.next].prev = top.pos;
    if (cur.prev >= 0) {
      if (const auto* pm = lookup(sym[cur.prev].id, cur.id))
        queue.push({pm->first, cur.prev, pm->second});
    }
    if (cur.next >= 0) {
      if (const auto* nm = lookup(cur.id, sym[cur.next].id))
        queue.push({nm->first, top.pos, nm->second});
    }
  }
  for (const Symbol& s : sym) {
    if (s.alive) out->push_back(s.id);
  }
}

Tokenizer::Tokenizer() : impl_(std::make_unique<Impl>()) {}
Tokenizer::~Tokenizer() = default;

absl::StatusOr<std::unique_ptr<Tokenizer>> Tokenizer::Load(const std::string& path) {
  fs::path file = path, dir;
  std::error_code ec;
  if (fs::is_directory(path, ec)) {
    dir = path;
    file = dir / "tokenizer.json";
  } else {
    dir = file.parent_path();
  }
  if (!fs::exists(file, ec))
    return absl::NotFoundError(absl::StrCat(file.string(), " does not exist"));
  MOELORA_ASSIGN_OR_RETURN(json j, ReadJson(file));
  std::unique_ptr<Tokenizer> t(new Tokenizer());
  t->source_ = file.string();
  Impl& im = *t->impl_;
  im.file = file.string();
  auto in_file = [&](const absl::Status& s) { return Annotate(s, file.string()); };
  if (!j.is_object()) return in_file(absl::InvalidArgumentError("not a JSON object"));
  for (const char* key : {"truncation", "padding"}) {
    if (j.contains(key) && !j[key].is_null()) {
      return in_file(absl::UnimplementedError(absl::StrCat(
          "\"", key,
          "\" is set; only null is implemented (a server encodes one prompt at a time)")));
    }
  }
  try {
    MOELORA_RETURN_IF_ERROR(in_file(im.ParseNormalizer(j.value("normalizer", json()))));
    MOELORA_RETURN_IF_ERROR(in_file(im.ParsePreTokenizer(j.value("pre_tokenizer", json()))));
    if (!j.contains("model")) return in_file(absl::InvalidArgumentError("no \"model\""));
    MOELORA_RETURN_IF_ERROR(in_file(im.ParseModel(j["model"])));
    MOELORA_RETURN_IF_ERROR(in_file(im.ParsePostProcessor(j.value("post_processor", json()))));
    MOELORA_RETURN_IF_ERROR(in_file(im.ParseDecoder(j.value("decoder", json()))));
    int32_t max_id = -1;
    for (const auto& [tok, id] : im.vocab) max_id = std::max(max_id, id);
    for (const json& a : j.value("added_tokens", json::array())) {
      AddedToken at{a.at("id").get<int32_t>(),    a.at("content").get<std::string>(),
                    a.value("special", false),    a.value("normalized", !a.value("special", false)),
                    a.value("lstrip", false),     a.value("rstrip", false),
                    a.value("single_word", false)};
      if (at.content.empty() || at.id < 0)
        return in_file(absl::InvalidArgumentError(
            absl::StrCat("added token ", at.id, " is empty or has a negative id")));
      if (!IsValidUtf8(at.content))
        return in_file(
            absl::InvalidArgumentError(absl::StrCat("added token ", at.id, " is not valid UTF-8")));
      max_id = std::max(max_id, at.id);
      im.added.push_back(std::move(at));
    }
    for (size_t i = 0; i < im.added.size(); ++i) {
      const AddedToken& a = im.added[i];
      (a.normalized ? im.normalized_trie : im.raw_trie).Insert(a.content, static_cast<int>(i));
    }
    // Tables for encoding bytes and decoding ids.
    const ByteLevelAlphabet& ab = Alphabet();
    for (int b = 0; b < 256; ++b) {
      auto it = im.vocab.find(ab.byte_to_char[b]);
      im.byte_id[b] = it == im.vocab.end() ? -1 : it->second;
    }
    im.id_bytes.assign(max_id + 1, "");
    im.id_flags.assign(max_id + 1, 0);
    auto decoded = [&](const std::string& token) {
      // ByteLevel decoder: each character back to its byte; a token with a character outside
      // the alphabet is kept as its UTF-8 bytes (tokenizers does the same).
      std::string bytes;
      for (size_t i = 0; i < token.size();) {
        size_t len;
        const char32_t c = DecodeCodePoint(token, i, &len);
        auto it = ab.char_to_byte.find(c);
        if (it == ab.char_to_byte.end()) return token;
        bytes.push_back(static_cast<char>(it->second));
        i += len;
      }
      return bytes;
    };
    for (const auto& [tok, id] : im.vocab) {
      im.id_bytes[id] = decoded(tok);
      im.id_flags[id] = 1;
      bool in_alphabet = true;  // else no byte-level word can map to it
      for (size_t i = 0; i < tok.size() && in_alphabet;) {
        size_t len;
        in_alphabet = ab.char_to_byte.count(DecodeCodePoint(tok, i, &len)) > 0;
        i += len;
      }
      if (im.byte_level && in_alphabet) im.bytes_vocab.emplace(im.id_bytes[id], id);
    }
    for (const AddedToken& a : im.added) {
      im.id_bytes[a.id] = decoded(a.content);
      im.id_flags[a.id] = a.special ? 3 : 1;
    }
    for (int32_t id : im.prefix_ids) {
      if (id < 0 || id > max_id)
        return in_file(absl::InvalidArgumentError(
            absl::StrCat("post_processor names id ", id, " outside the vocabulary")));
    }
    for (int32_t id : im.suffix_ids) {
      if (id < 0 || id > max_id)
        return in_file(absl::InvalidArgumentError(
            absl::StrCat("post_processor names id ", id, " outside the vocabulary")));
    }
  } catch (const json::exception& e) {
    return in_file(absl::InvalidArgumentError(e.what()));
  }

  // BOS/EOS from the model directory (both files optional).
  auto add_eos = [&](int32_t id) {
    if (std::find(t->eos_ids_.begin(), t->eos_ids_.end(), id) == t->eos_ids_.end())
      t->eos_ids_.push_back(id);
  };
  MOELORA_ASSIGN_OR_RETURN(const GenerationIds gen, ReadGenerationConfig(dir.string()));
  for (int32_t id : gen.eos) add_eos(id);
  t->bos_id_ = gen.bos;
  const fs::path tc = dir / "tokenizer_config.json";
  if (fs::exists(tc, ec)) {
    MOELORA_ASSIGN_OR_RETURN(json c, ReadJson(tc));
    auto token_of = [&](const char* key) -> std::optional<int32_t> {
      const json& v = c.value(key, json());
      std::string s;
      if (v.is_string()) s = v.get<std::string>();
      if (v.is_object()) s = v.value("content", "");
      if (s.empty()) return std::nullopt;
      return t->TokenToId(s);
    };
    if (auto e = token_of("eos_token")) add_eos(*e);
    if (!t->bos_id_) t->bos_id_ = token_of("bos_token");
  }
  for (int32_t id : t->eos_ids_) {
    if (!t->IsKnown(id))
      return absl::InvalidArgumentError(
          absl::StrCat(dir.string(), ": EOS id ", id, " is not in the tokenizer's vocabulary"));
  }
  return t;
}

[[nodiscard]] absl::StatusOr<std::vector<int32_t>> ReadGenerationEosIds(
    const std::string& model_dir) {
  MOELORA_ASSIGN_OR_RETURN(GenerationIds g, ReadGenerationConfig(model_dir));
  return g.eos;
}

absl::StatusOr<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                                       bool add_special_tokens) const {
  size_t bad = 0;
  if (!IsValidUtf8(text, &bad)) {
    return absl::InvalidArgumentError(
        absl::StrCat("text is not valid UTF-8 (byte offset ", bad, ")"));
  }
  const Impl& im = *impl_;
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = im.prefix_ids;
  std::vector<Piece> raw;
  im.SplitAdded(text, im.raw_trie, &raw);
  std::vector<std::string_view> cur, next;
  for (const Piece& rp : raw) {
    if (rp.added_id >= 0) {
      ids.push_back(rp.added_id);
      continue;
    }
    MOELORA_ASSIGN_OR_RETURN(const std::string normalized, im.Normalize(rp.text));
    std::vector<Piece> pieces;
    im.SplitAdded(normalized, im.normalized_trie, &pieces);
    for (Piece& p : pieces) {
      if (p.added_id >= 0) {
        ids.push_back(p.added_id);
        continue;
      }
      std::deque<std::string> prefixed;  // stable storage for pieces given a space
      cur.assign(1, p.text);
      for (const PreTokenizerStep& step : im.pre) {
        if (step.kind == PreTokenizerStep::kByteLevel && step.add_prefix_space) {
          // tokenizers prepends a space to each piece (as split so far) that lacks one.
          for (std::string_view& s : cur) {
            if (!s.empty() && s[0] != ' ') s = prefixed.emplace_back(" " + std::string(s));
          }
        }
        if (step.regex == nullptr) continue;
        next.clear();
        for (std::string_view s : cur)
          MOELORA_RETURN_IF_ERROR(step.regex->Split(s, step.keep_matches, &next));
        cur.swap(next);
      }
      for (std::string_view word : cur) im.Bpe(word, &ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), im.suffix_ids.begin(), im.suffix_ids.end());
  return ids;
}

std::string Tokenizer::DecodeBytes(absl::Span<const int32_t> ids, bool skip_special) const {
  std::string out;
  for (int32_t id : ids) {
    if (!IsKnown(id) || (skip_special && IsSpecial(id))) continue;
    out += impl_->id_bytes[id];
  }
  return out;
}

std::string Tokenizer::Decode(absl::Span<const int32_t> ids, bool skip_special) const {
  std::string text;
  AppendUtf8Lossy(DecodeBytes(ids, skip_special), /*final=*/true, &text);
  return text;
}

bool Tokenizer::IsKnown(int32_t id) const {
  return id >= 0 && id < vocab_size() && (impl_->id_flags[id] & 1) != 0;
}
bool Tokenizer::IsSpecial(int32_t id) const {
  return id >= 0 && id < vocab_size() && (impl_->id_flags[id] & 2) != 0;
}
int32_t Tokenizer::vocab_size() const { return static_cast<int32_t>(impl_->id_flags.size()); }

std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  for (const AddedToken& a : impl_->added) {
    if (a.content == token) return a.id;
  }
  auto it = impl_->vocab.find(std::string(token));
  if (it == impl_->vocab.end()) return std::nullopt;
  return it->second;
}

std::string_view Tokenizer::TokenBytes(int32_t id) const {
  if (!IsKnown(id)) return {};
  return impl_->id_bytes[id];
}

}  // namespace moelora::tok
