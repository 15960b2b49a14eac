#include "jinja/lexer.h"

#include <cctype>
#include <string_view>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "jinja/error.h"
#include "jinja/strings.h"

namespace moelora::jinja {

namespace {

bool IsNameStart(char c) { return std::isalpha(static_cast<unsigned char>(c)) || c == '_'; }
bool IsNameChar(char c) { return std::isalnum(static_cast<unsigned char>(c)) || c == '_'; }

// Python's str literal escapes, as Jinja decodes them.
std::string Unescape(std::string_view body, int line) {
  std::string out;
  for (size_t k = 0; k < body.size(); ++k) {
    if (body[k] != '\\' || k + 1 == body.size()) {
      out += body[k];
      continue;
    }
    const char e = body[++k];
    auto hex = [&](int n) {
      const std::string h(body.substr(k + 1, n));
      if (h.size() != static_cast<size_t>(n) ||
          h.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos) {
        Fail("bad \\x/\\u escape in a string literal", line);
      }
      k += n;
      return static_cast<char32_t>(std::strtoul(h.c_str(), nullptr, 16));
    };
    switch (e) {
      case 'n':
        out += '\n';
        break;
      case 't':
        out += '\t';
        break;
      case 'r':
        out += '\r';
        break;
      case '\\':
        out += '\\';
        break;
      case '\'':
        out += '\'';
        break;
      case '"':
        out += '"';
        break;
      case '0':
        out += '\0';
        break;
      case 'a':
        out += '\a';
        break;
      case 'b':
        out += '\b';
        break;
      case 'f':
        out += '\f';
        break;
      case 'v':
        out += '\v';
        break;
      case '\n':
        break;
      case 'x':
        AppendCodePoint(hex(2), &out);
        break;
      case 'u':
        AppendCodePoint(hex(4), &out);
        break;
      case 'U':
        AppendCodePoint(hex(8), &out);
        break;
      default:
        out += '\\';
        out += e;
    }
  }
  return out;
}

// Tokens of one tag's inside, from `pos` up to its closing delimiter (`close` "}}" or "%}"),
// which is found outside string literals and brackets. Returns the position after the
// delimiter; `strip_after` tells whether it was "-}}" / "-%}".
size_t LexTag(const std::string& src, size_t pos, std::string_view close, int* line,
              std::vector<Token>* out, bool* strip_after) {
  int depth = 0;
  while (true) {
    if (pos >= src.size())
      Fail(absl::StrCat("unclosed tag (expected '", std::string(close), "')"), *line);
    const char c = src[pos];
    if (c == '\n') ++*line;
    if (std::isspace(static_cast<unsigned char>(c))) {
      ++pos;
      continue;
    }
    if (depth == 0) {
      if (c == '-' && src.compare(pos + 1, close.size(), close) == 0) {
        *strip_after = true;
        out->push_back(Token{Token::Kind::kEnd, "", 0, 0, *line});
        return pos + 1 + close.size();
      }
      if (src.compare(pos, close.size(), close) == 0) {
        *strip_after = false;
        out->push_back(Token{Token::Kind::kEnd, "", 0, 0, *line});
        return pos + close.size();
      }
    }
    Token t;
    t.line = *line;
    if (IsNameStart(c)) {
      size_t end = pos;
      while (end < src.size() && IsNameChar(src[end])) ++end;
      t.kind = Token::Kind::kName;
      t.text = src.substr(pos, end - pos);
      pos = end;
    } else if (std::isdigit(static_cast<unsigned char>(c))) {
      size_t end = pos;
      bool is_float = false;
      while (end < src.size() &&
             (std::isdigit(static_cast<unsigned char>(src[end])) || src[end] == '_'))
        ++end;
      if (end + 1 < src.size() && src[end] == '.' &&
          std::isdigit(static_cast<unsigned char>(src[end + 1]))) {
        is_float = true;
        ++end;
        while (end < src.size() &&
               (std::isdigit(static_cast<unsigned char>(src[end])) || src[end] == '_'))
          ++end;
      }
      if (end < src.size() && (src[end] == 'e' || src[end] == 'E')) {
        size_t e = end + 1;
        if (e < src.size() && (src[e] == '+' || src[e] == '-')) ++e;
        if (e < src.size() && std::isdigit(static_cast<unsigned char>(src[e]))) {
          is_float = true;
          end = e;
          while (end < src.size() && std::isdigit(static_cast<unsigned char>(src[end]))) ++end;
        }
      }
      std::string num = src.substr(pos, end - pos);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      if (is_float) {
        t.kind = Token::Kind::kFloat;
        t.f = std::strtod(num.c_str(), nullptr);
      } else {
        t.kind = Token::Kind::kInt;
        errno = 0;
        t.i = std::strtoll(num.c_str(), nullptr, 10);
        if (errno == ERANGE) Fail("an integer literal beyond 64 bits", *line);
      }
      pos = end;
    } else if (c == '\'' || c == '"') {
      size_t end = pos + 1;
      while (end < src.size() && src[end] != c) {
        if (src[end] == '\\') ++end;
        if (end < src.size() && src[end] == '\n') ++*line;
        ++end;
      }
      if (end >= src.size()) Fail("unterminated string literal", t.line);
      t.kind = Token::Kind::kString;
      t.text = Unescape(std::string_view(src).substr(pos + 1, end - pos - 1), t.line);
      pos = end + 1;
    } else {
      static const char* kOps[] = {"//", "**", "==", "!=", "<=", ">=", "+", "-", "*",
                                   "/",  "%",  "~",  "<",  ">",  "(",  ")", "[", "]",
                                   "{",  "}",  ",",  ".",  ":",  "|",  "="};
      const char* op = nullptr;
      for (const char* o : kOps) {
        if (src.compare(pos, std::strlen(o), o) == 0) {
          op = o;
          break;
        }
      }
      if (op == nullptr)
        Fail(absl::StrCat("unexpected character '", std::string(1, c), "'"), *line);
      t.kind = Token::Kind::kOp;
      t.text = op;
      pos += t.text.size();
      if (t.text == "(" || t.text == "[" || t.text == "{") ++depth;
      if (t.text == ")" || t.text == "]" || t.text == "}") --depth;
    }
    out->push_back(std::move(t));
  }
}

bool IsJinjaSpace(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

}  // namespace

std::vector<Piece> Lex(std::string src) {
  // Jinja's defaults: line endings become "\n" and one trailing newline is dropped.
  src = Replace(src, "\r\n", "\n", -1);
  if (!src.empty() && src.back() == '\n') src.pop_back();
  std::vector<Piece> pieces;
  size_t pos = 0;
  int line = 1;
  bool line_starting = true;  // the last tag ended a line (trim_blocks' newline included)
  bool strip_next = false;    // the last tag ended with '-'
  while (pos < src.size()) {
    size_t open = pos;
    while (true) {
      open = src.find('{', open);
      if (open == std::string::npos || open + 1 >= src.size()) {
        open = std::string::npos;
        break;
      }
      const char n = src[open + 1];
      if (n == '{' || n == '%' || n == '#') break;
      ++open;
    }
    std::string text = src.substr(pos, open == std::string::npos ? std::string::npos : open - pos);
    if (strip_next) {
      size_t k = 0;
      while (k < text.size() && IsJinjaSpace(text[k])) ++k;
      text.erase(0, k);
    }
    const int text_line = line;
    line += static_cast<int>(std::count(text.begin(), text.end(), '\n'));
    if (open == std::string::npos) {
      if (!text.empty())
        pieces.push_back(Piece{Piece::Kind::kText, std::move(text), {}, text_line});
      break;
    }
    const char type = src[open + 1];
    size_t inner = open + 2;
    char sign = 0;
    if (inner < src.size() && (src[inner] == '-' || src[inner] == '+')) sign = src[inner++];
    if (sign == '-') {
      while (!text.empty() && IsJinjaSpace(text.back())) text.pop_back();
    } else if (sign != '+' && type != '{') {
      // lstrip_blocks: spaces and tabs from the line's start to a block or comment tag.
      const size_t nl = text.rfind('\n');
      const size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((nl != std::string::npos || line_starting) && l_pos < text.size() &&
          text.find_first_not_of(" \t\v\f\r", l_pos) == std::string::npos) {
        text.erase(l_pos);
      }
    }
    if (!text.empty()) pieces.push_back(Piece{Piece::Kind::kText, std::move(text), {}, text_line});
    bool strip_after = false;
    if (type == '#') {
      const size_t close = src.find("#}", inner);
      if (close == std::string::npos) Fail("unclosed comment", line);
      line += static_cast<int>(std::count(src.begin() + inner, src.begin() + close, '\n'));
      strip_after = close > inner && src[close - 1] == '-';
      pos = close + 2;
    } else {
      Piece p;
      p.kind = type == '{' ? Piece::Kind::kOutput : Piece::Kind::kStatement;
      p.line = line;
      pos = LexTag(src, inner, type == '{' ? "}}" : "%}", &line, &p.tokens, &strip_after);
      pieces.push_back(std::move(p));
    }
    line_starting = false;
    if (strip_after) {
      strip_next = true;
      size_t k = pos;
      while (k < src.size() && IsJinjaSpace(src[k])) ++k;
      line_starting = k > pos && src[k - 1] == '\n';
    } else {
      strip_next = false;
      // trim_blocks: the newline right after a block or comment tag.
      if (type != '{' && pos < src.size() && src[pos] == '\n') {
        ++pos;
        ++line;
        line_starting = true;
      }
    }
  }
  return pieces;
}

}  // namespace moelora::jinja
