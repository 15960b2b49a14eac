#include "jinja/strings.h"

#include "common/utf8.h"
#include "jinja/error.h"
#include "unicode/locid.h"
#include "unicode/unistr.h"

namespace moelora::jinja {

size_t DecodeUtf8(const std::string& s, size_t pos, char32_t* cp) {
  size_t len = 1;
  *cp = DecodeCodePoint(s, pos, &len);
  return len;
}

std::vector<std::string> CodePoints(const std::string& s) {
  std::vector<std::string> out;
  size_t pos = 0;
  while (pos < s.size()) {
    char32_t cp = 0;
    const size_t len = std::max<size_t>(1, DecodeUtf8(s, pos, &cp));
    out.push_back(s.substr(pos, len));
    pos += len;
  }
  return out;
}

bool IsPySpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

std::string Strip(const std::string& s, const std::string* chars, bool left, bool right) {
  const std::vector<std::string> cps = CodePoints(s);
  std::vector<std::string> set;
  if (chars != nullptr) set = CodePoints(*chars);
  auto strip_it = [&](const std::string& c) {
    if (chars != nullptr) return std::find(set.begin(), set.end(), c) != set.end();
    char32_t cp = 0;
    DecodeUtf8(c, 0, &cp);
    return IsPySpace(cp);
  };
  size_t begin = 0, end = cps.size();
  if (left) {
    while (begin < end && strip_it(cps[begin])) ++begin;
  }
  if (right) {
    while (end > begin && strip_it(cps[end - 1])) --end;
  }
  std::string out;
  for (size_t k = begin; k < end; ++k) out += cps[k];
  return out;
}

List Split(const std::string& s, const Value* sep, int64_t maxsplit) {
  List out;
  if (sep == nullptr || sep->kind == Value::Kind::kNone) {
    // Runs of whitespace separate; leading and trailing whitespace gives no empty items.
    const std::vector<std::string> cps = CodePoints(s);
    std::string cur;
    bool in_word = false;
    size_t k = 0;
    for (; k < cps.size(); ++k) {
      char32_t cp = 0;
      DecodeUtf8(cps[k], 0, &cp);
      if (IsPySpace(cp)) {
        if (in_word) {
          out.push_back(Value::Str(cur));
          cur.clear();
          in_word = false;
        }
        continue;
      }
      if (!in_word && maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) {
        std::string rest;
        for (size_t r = k; r < cps.size(); ++r) rest += cps[r];
        out.push_back(Value::Str(std::move(rest)));
        return out;
      }
      in_word = true;
      cur += cps[k];
    }
    if (in_word) out.push_back(Value::Str(cur));
    return out;
  }
  if (!sep->is_string()) Fail("split: the separator must be a string");
  if (sep->s.empty()) Fail("empty separator");
  size_t pos = 0;
  while (true) {
    if (maxsplit >= 0 && static_cast<int64_t>(out.size()) == maxsplit) break;
    const size_t at = s.find(sep->s, pos);
    if (at == std::string::npos) break;
    out.push_back(Value::Str(s.substr(pos, at - pos)));
    pos = at + sep->s.size();
  }
  out.push_back(Value::Str(s.substr(pos)));
  return out;
}

std::string Replace(const std::string& s, const std::string& from, const std::string& to,
                    int64_t count) {
  if (from.empty()) {
    // Python inserts `to` around every character.
    std::string out;
    int64_t n = 0;
    for (const std::string& c : CodePoints(s)) {
      if (count < 0 || n < count) {
        out += to;
        ++n;
      }
      out += c;
    }
    if (count < 0 || n < count) out += to;
    return out;
  }
  std::string out;
  size_t pos = 0;
  int64_t n = 0;
  while (count < 0 || n < count) {
    const size_t at = s.find(from, pos);
    if (at == std::string::npos) break;
    out += s.substr(pos, at - pos) + to;
    pos = at + from.size();
    ++n;
  }
  return out + s.substr(pos);
}

std::string Upper(const std::string& s, bool upper) {
  icu::UnicodeString u = icu::UnicodeString::fromUTF8(s);
  if (upper) {
    u.toUpper(icu::Locale::getRoot());
  } else {
    u.toLower(icu::Locale::getRoot());
  }
  std::string out;
  u.toUTF8String(out);
  return out;
}

}  // namespace moelora::jinja
