#include "tokenizer/chat_template.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <map>
#include <sstream>
#include <unordered_map>
#include <utility>
#include <vector>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "nlohmann/json.hpp"
#include "tokenizer/utf8.h"
#include "unicode/locid.h"
#include "unicode/uchar.h"
#include "unicode/unistr.h"

namespace moelora::tok {
namespace {

using nlohmann::ordered_json;

// The code point at s[pos] (valid UTF-8: JSON values, and Parse checks the source); its length.
size_t DecodeUtf8(const std::string& s, size_t pos, char32_t* cp) {
  size_t len = 1;
  *cp = DecodeCodePoint(s, pos, &len);
  return len;
}

// Errors inside the engine are thrown (parsing and evaluation are deeply recursive) and stop at
// Parse / Render, which turn them into a Status.
struct TemplateError {
  std::string message;
  int line = 0;
};

[[noreturn]] void Fail(std::string message, int line = 0) {
  throw TemplateError{std::move(message), line};
}

// Bounds the recursion of parsing and rendering (nested expressions, blocks, macro calls), so
// that a template can fail but never exhaust the stack.
class DepthGuard {
 public:
  static constexpr int kMax = 200;
  DepthGuard(int* depth, int line) : depth_(depth) {
    if (++*depth_ > kMax) {
      --*depth_;
      Fail(absl::StrCat("nested deeper than ", kMax, " levels"), line);
    }
  }
  ~DepthGuard() { --*depth_; }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  int* depth_;
};

// ---------------------------------------------------------------------------------------------
// Values: Python's types as a template sees them.

struct Value;
using List = std::vector<Value>;
using Dict = std::vector<std::pair<std::string, Value>>;  // insertion order, as Python's dict
struct Args;
using Function = std::function<Value(Args&)>;

struct Value {
  enum class Kind {
    kUndefined,
    kNone,
    kBool,
    kInt,
    kFloat,
    kString,
    kList,
    kDict,
    kNamespace,
    kFunction
  };
  Value() = default;
  explicit Value(Kind k) : kind(k) {}

  Kind kind = Kind::kUndefined;
  bool b = false;
  int64_t i = 0;
  double f = 0;
  std::string s;
  std::shared_ptr<List> list;  // kList
  std::shared_ptr<Dict> dict;  // kDict, kNamespace
  std::shared_ptr<Function> fn;
  std::string undefined_name;  // what was looked up, for messages
  // A JSON integer above INT64_MAX (Python's int has no bound): printed exactly from `i`'s
  // bits; arithmetic on it is an error.
  bool big = false;

  static Value None() { return Value{Kind::kNone}; }
  static Value Bool(bool v) {
    Value x{Kind::kBool};
    x.b = v;
    return x;
  }
  static Value Int(int64_t v) {
    Value x{Kind::kInt};
    x.i = v;
    return x;
  }
  static Value Float(double v) {
    Value x{Kind::kFloat};
    x.f = v;
    return x;
  }
  static Value Str(std::string v) {
    Value x{Kind::kString};
    x.s = std::move(v);
    return x;
  }
  static Value MakeList(List v) {
    Value x{Kind::kList};
    x.list = std::make_shared<List>(std::move(v));
    return x;
  }
  static Value MakeDict(Dict v, Kind kind = Kind::kDict) {
    Value x{kind};
    x.dict = std::make_shared<Dict>(std::move(v));
    return x;
  }
  static Value Fn(Function f) {
    Value x{Kind::kFunction};
    x.fn = std::make_shared<Function>(std::move(f));
    return x;
  }
  static Value Undefined(std::string name) {
    Value x;
    x.undefined_name = std::move(name);
    return x;
  }
  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_number() const {
    return kind == Kind::kInt || kind == Kind::kFloat || kind == Kind::kBool;
  }
  double AsDouble() const { return kind == Kind::kFloat ? f : static_cast<double>(AsInt()); }
  int64_t AsInt() const { return kind == Kind::kBool ? (b ? 1 : 0) : i; }
  const Value* Find(std::string_view key) const {
    if (dict == nullptr) return nullptr;
    for (const auto& [k, v] : *dict) {
      if (k == key) return &v;
    }
    return nullptr;
  }
};

// d[key] = v, keeping the key's place when it is there.
void SetKey(Dict* d, const std::string& key, Value v) {
  for (auto& kv : *d) {
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  }
  d->emplace_back(key, std::move(v));
}

struct Args {
  std::vector<Value> pos;
  std::vector<std::pair<std::string, Value>> kw;
  const Value* Get(size_t index, std::string_view name) const {
    if (index < pos.size()) return &pos[index];
    for (const auto& [k, v] : kw) {
      if (k == name) return &v;
    }
    return nullptr;
  }
};

// Request data nested deeper than this is refused (the evaluator recurses over values).
constexpr int kMaxDepth = 256;

Value FromJson(const ordered_json& j, int depth = 0) {
  if (depth > kMaxDepth)
    Fail(absl::StrCat("a template variable nests deeper than ", kMaxDepth, " levels"));
  switch (j.type()) {
    case ordered_json::value_t::null:
      return Value::None();
    case ordered_json::value_t::boolean:
      return Value::Bool(j.get<bool>());
    case ordered_json::value_t::number_integer:
      return Value::Int(j.get<int64_t>());
    case ordered_json::value_t::number_unsigned: {
      const uint64_t u = j.get<uint64_t>();
      Value v = Value::Int(static_cast<int64_t>(u));
      v.big = u > static_cast<uint64_t>(INT64_MAX);
      return v;
    }
    case ordered_json::value_t::number_float:
      return Value::Float(j.get<double>());
    case ordered_json::value_t::string:
      return Value::Str(j.get<std::string>());
    case ordered_json::value_t::array: {
      List l;
      l.reserve(j.size());
      for (const auto& e : j) l.push_back(FromJson(e, depth + 1));
      return Value::MakeList(std::move(l));
    }
    case ordered_json::value_t::object: {
      Dict d;
      d.reserve(j.size());
      for (const auto& [k, v] : j.items()) d.emplace_back(k, FromJson(v, depth + 1));
      return Value::MakeDict(std::move(d));
    }
    default:
      Fail("a binary value cannot be a template variable");
  }
}

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return false;
    case Value::Kind::kBool:
      return v.b;
    case Value::Kind::kInt:
      return v.i != 0;
    case Value::Kind::kFloat:
      return v.f != 0;
    case Value::Kind::kString:
      return !v.s.empty();
    case Value::Kind::kList:
      return !v.list->empty();
    case Value::Kind::kDict:
      return !v.dict->empty();
    default:
      return true;
  }
}

const char* TypeName(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "undefined";
    case Value::Kind::kNone:
      return "NoneType";
    case Value::Kind::kBool:
      return "bool";
    case Value::Kind::kInt:
      return "int";
    case Value::Kind::kFloat:
      return "float";
    case Value::Kind::kString:
      return "str";
    case Value::Kind::kList:
      return "list";
    case Value::Kind::kDict:
      return "dict";
    case Value::Kind::kNamespace:
      return "Namespace";
    default:
      return "function";
  }
}

// Python's repr(float): the shortest digits that read back to the same double, in fixed
// notation for exponents -4 .. 15, else scientific with at least two exponent digits.
std::string FloatRepr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  char buf[64];
  int precision = 1;
  for (; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof(buf), "%.*e", precision - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  // buf: [-]d[.ddd]e[+-]XX
  std::string s(buf);
  const bool negative = s[0] == '-';
  if (negative) s.erase(0, 1);
  const size_t e_pos = s.find('e');
  const int exponent = std::atoi(s.c_str() + e_pos + 1);
  std::string digits = s.substr(0, e_pos);
  digits.erase(std::remove(digits.begin(), digits.end(), '.'), digits.end());
  std::string out = negative ? "-" : "";
  if (exponent >= -4 && exponent < 16) {
    if (exponent < 0) {
      out += "0." + std::string(-exponent - 1, '0') + digits;
    } else if (static_cast<int>(digits.size()) <= exponent + 1) {
      out += digits + std::string(exponent + 1 - digits.size(), '0') + ".0";
    } else {
      out += digits.substr(0, exponent + 1) + "." + digits.substr(exponent + 1);
    }
  } else {
    out += digits.substr(0, 1);
    if (digits.size() > 1) out += "." + digits.substr(1);
    char e[16];
    std::snprintf(e, sizeof(e), "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    out += e;
  }
  return out;
}

std::string Repr(const Value& v);

// Python's str().
std::string Str(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return "";
    case Value::Kind::kNone:
      return "None";
    case Value::Kind::kBool:
      return v.b ? "True" : "False";
    case Value::Kind::kInt:
      return v.big ? std::to_string(static_cast<uint64_t>(v.i)) : std::to_string(v.i);
    case Value::Kind::kFloat:
      return FloatRepr(v.f);
    case Value::Kind::kString:
      return v.s;
    default:
      return Repr(v);
  }
}

// Python's str.isprintable() for one code point: false for control, format, surrogate, private,
// unassigned, and separator characters other than the ASCII space.
bool IsPrintable(char32_t cp) {
  if (cp == ' ') return true;
  switch (u_charType(static_cast<UChar32>(cp))) {
    case U_CONTROL_CHAR:
    case U_FORMAT_CHAR:
    case U_SURROGATE:
    case U_PRIVATE_USE_CHAR:
    case U_UNASSIGNED:
    case U_LINE_SEPARATOR:
    case U_PARAGRAPH_SEPARATOR:
    case U_SPACE_SEPARATOR:
      return false;
    default:
      return true;
  }
}

// Python's repr() of a str: single quotes unless it holds one and no double quote.
std::string StrRepr(const std::string& s) {
  const char quote =
      s.find('\'') != std::string::npos && s.find('"') == std::string::npos ? '"' : '\'';
  std::string out(1, quote);
  for (size_t pos = 0; pos < s.size();) {
    const unsigned char c = static_cast<unsigned char>(s[pos]);
    if (c >= 0x80) {
      char32_t cp = 0;
      const size_t len = DecodeUtf8(s, pos, &cp);
      if (IsPrintable(cp)) {
        out.append(s, pos, len);
      } else {
        char b[16];
        std::snprintf(b, sizeof(b),
                      cp < 0x100     ? "\\x%02x"
                      : cp < 0x10000 ? "\\u%04x"
                                     : "\\U%08x",
                      static_cast<unsigned>(cp));
        out += b;
      }
      pos += len;
      continue;
    }
    ++pos;
    if (c == '\\') {
      out += "\\\\";
    } else if (c == quote) {
      out += '\\';
      out += static_cast<char>(c);
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (c < 0x20 || c == 0x7f) {
      char b[8];
      std::snprintf(b, sizeof(b), "\\x%02x", c);
      out += b;
    } else {
      out += static_cast<char>(c);
    }
  }
  out += quote;
  return out;
}

std::string Repr(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kString:
      return StrRepr(v.s);
    case Value::Kind::kList: {
      std::vector<std::string> parts;
      for (const Value& e : *v.list) parts.push_back(Repr(e));
      return "[" + absl::StrJoin(parts, ", ") + "]";
    }
    case Value::Kind::kDict: {
      std::vector<std::string> parts;
      for (const auto& [k, e] : *v.dict) parts.push_back(StrRepr(k) + ": " + Repr(e));
      return "{" + absl::StrJoin(parts, ", ") + "}";
    }
    case Value::Kind::kNamespace: {
      std::vector<std::string> parts;
      for (const auto& [k, e] : *v.dict) parts.push_back(StrRepr(k) + ": " + Repr(e));
      return "<Namespace {" + absl::StrJoin(parts, ", ") + "}>";
    }
    case Value::Kind::kFunction:
      return "<function>";
    default:
      return Str(v);
  }
}

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers' tojson calls it.
struct JsonOptions {
  bool ensure_ascii = false;
  int indent = -1;  // -1: None
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

void JsonString(const std::string& s, bool ensure_ascii, std::string* out) {
  *out += '"';
  size_t pos = 0;
  while (pos < s.size()) {
    const unsigned char c = static_cast<unsigned char>(s[pos]);
    if (c >= 0x80 && ensure_ascii) {
      char32_t cp = 0;
      const size_t len = DecodeUtf8(s, pos, &cp);
      char b[16];
      if (cp >= 0x10000) {
        const char32_t v = cp - 0x10000;
        std::snprintf(b, sizeof(b), "\\u%04x\\u%04x", 0xD800 + (v >> 10), 0xDC00 + (v & 0x3FF));
      } else {
        std::snprintf(b, sizeof(b), "\\u%04x", static_cast<unsigned>(cp));
      }
      *out += b;
      pos += len;
      continue;
    }
    switch (c) {
      case '"':
        *out += "\\\"";
        break;
      case '\\':
        *out += "\\\\";
        break;
      case '\n':
        *out += "\\n";
        break;
      case '\r':
        *out += "\\r";
        break;
      case '\t':
        *out += "\\t";
        break;
      case '\b':
        *out += "\\b";
        break;
      case '\f':
        *out += "\\f";
        break;
      default:
        if (c < 0x20) {
          char b[8];
          std::snprintf(b, sizeof(b), "\\u%04x", c);
          *out += b;
        } else {
          *out += static_cast<char>(c);
        }
    }
    ++pos;
  }
  *out += '"';
}

void ToJson(const Value& v, const JsonOptions& o, int level, std::string* out) {
  auto newline = [&](int l) {
    if (o.indent < 0) return;
    *out += '\n';
    out->append(static_cast<size_t>(o.indent) * l, ' ');
  };
  switch (v.kind) {
    case Value::Kind::kNone:
      *out += "null";
      return;
    case Value::Kind::kBool:
      *out += v.b ? "true" : "false";
      return;
    case Value::Kind::kInt:
      *out += Str(v);
      return;
    case Value::Kind::kFloat:
      if (std::isnan(v.f)) {
        *out += "NaN";
      } else if (std::isinf(v.f)) {
        *out += v.f > 0 ? "Infinity" : "-Infinity";
      } else {
        *out += FloatRepr(v.f);
      }
      return;
    case Value::Kind::kString:
      JsonString(v.s, o.ensure_ascii, out);
      return;
    case Value::Kind::kList: {
      if (v.list->empty()) {
        *out += "[]";
        return;
      }
      *out += '[';
      for (size_t k = 0; k < v.list->size(); ++k) {
        if (k > 0) *out += o.item_separator;
        newline(level + 1);
        ToJson((*v.list)[k], o, level + 1, out);
      }
      newline(level);
      *out += ']';
      return;
    }
    case Value::Kind::kDict: {
      if (v.dict->empty()) {
        *out += "{}";
        return;
      }
      std::vector<const std::pair<std::string, Value>*> items;
      for (const auto& kv : *v.dict) items.push_back(&kv);
      if (o.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const auto* a, const auto* b) { return a->first < b->first; });
      }
      *out += '{';
      for (size_t k = 0; k < items.size(); ++k) {
        if (k > 0) *out += o.item_separator;
        newline(level + 1);
        JsonString(items[k]->first, o.ensure_ascii, out);
        *out += o.key_separator;
        ToJson(items[k]->second, o, level + 1, out);
      }
      newline(level);
      *out += '}';
      return;
    }
    default:
      Fail(absl::StrCat("Object of type ", TypeName(v), " is not JSON serializable"));
  }
}

bool Equal(const Value& a, const Value& b) {
  if (a.big || b.big) return a.big == b.big && a.i == b.i;
  if (a.is_number() && b.is_number()) {
    if (a.kind == Value::Kind::kFloat || b.kind == Value::Kind::kFloat) {
      return a.AsDouble() == b.AsDouble();
    }
    return a.AsInt() == b.AsInt();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Value::Kind::kUndefined:
    case Value::Kind::kNone:
      return true;
    case Value::Kind::kString:
      return a.s == b.s;
    case Value::Kind::kList:
      if (a.list->size() != b.list->size()) return false;
      for (size_t k = 0; k < a.list->size(); ++k) {
        if (!Equal((*a.list)[k], (*b.list)[k])) return false;
      }
      return true;
    case Value::Kind::kDict:
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* o = b.Find(k);
        if (o == nullptr || !Equal(v, *o)) return false;
      }
      return true;
    default:
      return a.dict == b.dict && a.fn == b.fn;
  }
}

// -1, 0, 1 for <, ==, > of numbers or strings; a TypeError otherwise.
int Compare(const Value& a, const Value& b, std::string_view op) {
  if (a.big || b.big) Fail("comparison of an integer beyond 64 bits");
  if (a.is_number() && b.is_number()) {
    const double x = a.AsDouble(), y = b.AsDouble();
    if (a.kind != Value::Kind::kFloat && b.kind != Value::Kind::kFloat) {
      return a.AsInt() < b.AsInt() ? -1 : a.AsInt() > b.AsInt() ? 1 : 0;
    }
    return x < y ? -1 : x > y ? 1 : 0;
  }
  if (a.is_string() && b.is_string()) return a.s < b.s ? -1 : a.s > b.s ? 1 : 0;
  Fail(absl::StrCat("'", std::string(op), "' not supported between instances of '", TypeName(a),
                    "' and '", TypeName(b), "'"));
}

// Code points of a UTF-8 string (strings index and measure by them in Python).
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

// The items a for loop or `in` walks: list items, dict keys, string characters.
List Iterate(const Value& v) {
  switch (v.kind) {
    case Value::Kind::kUndefined:
      return {};
    case Value::Kind::kList:
      return *v.list;
    case Value::Kind::kDict: {
      List keys;
      for (const auto& kv : *v.dict) keys.push_back(Value::Str(kv.first));
      return keys;
    }
    case Value::Kind::kString: {
      List chars;
      for (std::string& c : CodePoints(v.s)) chars.push_back(Value::Str(std::move(c)));
      return chars;
    }
    default:
      Fail(absl::StrCat("'", TypeName(v), "' object is not iterable"));
  }
}

bool Contains(const Value& container, const Value& item) {
  switch (container.kind) {
    case Value::Kind::kUndefined:
      return false;
    case Value::Kind::kString:
      if (!item.is_string()) {
        Fail(absl::StrCat("'in <string>' requires string as left operand, not ", TypeName(item)));
      }
      return container.s.find(item.s) != std::string::npos;
    case Value::Kind::kList:
      return std::any_of(container.list->begin(), container.list->end(),
                         [&](const Value& e) { return Equal(e, item); });
    case Value::Kind::kDict:
      return item.is_string() && container.Find(item.s) != nullptr;
    default:
      Fail(absl::StrCat("argument of type '", TypeName(container), "' is not iterable"));
  }
}

// Python's str.isspace() characters, for strip() / split() without arguments.
bool IsPySpace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || (c >= 0x1C && c <= 0x20) || c == 0x85 || c == 0xA0 ||
         c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F ||
         c == 0x205F || c == 0x3000;
}

// str.strip / lstrip / rstrip: `chars` null strips whitespace.
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

// str.upper() / str.lower(): Unicode's full case mappings (ICU's root locale, as Python).
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

// ---------------------------------------------------------------------------------------------
// Lexer: the template source to text pieces and tag token lists, with Jinja's whitespace rules.

struct Token {
  enum class Kind { kName, kString, kInt, kFloat, kOp, kEnd };
  Kind kind = Kind::kEnd;
  std::string text;  // name, operator, or the decoded string
  int64_t i = 0;
  double f = 0;
  int line = 0;
};

struct Piece {
  enum class Kind { kText, kOutput, kStatement };
  Kind kind = Kind::kText;
  std::string text;
  std::vector<Token> tokens;  // ends with a kEnd token
  int line = 0;
};

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

// ---------------------------------------------------------------------------------------------
// Expressions.

struct Expr {
  enum class Kind {
    kLiteral,
    kName,
    kAttr,
    kItem,
    kSlice,
    kCall,
    kFilter,
    kTest,
    kNot,
    kNeg,
    kPos,
    kBinary,
    kAnd,
    kOr,
    kCond,
    kList,
    kDict,
    kConcat
  };
  Kind kind = Kind::kLiteral;
  Value value;       // kLiteral
  std::string name;  // kName, kAttr, kFilter, kTest, kBinary (operator)
  std::vector<std::unique_ptr<Expr>> kids;
  std::vector<std::string> kw_names;  // kCall/kFilter/kTest: names of the last kids
  bool negated = false;               // kTest
  int line = 0;
};
using ExprPtr = std::unique_ptr<Expr>;

class ExprParser {
 public:
  ExprParser(const std::vector<Token>& tokens, size_t pos = 0) : t_(tokens), pos_(pos) {}

  ExprPtr Parse() { return CondExpr(); }
  // A for loop's iterable: no `if` (that starts the loop's filter).
  ExprPtr CondExprNoIf() { return Or(); }
  // `a, b` without brackets (a set statement's value) is a tuple: a list here.
  ExprPtr ParseTuple() {
    ExprPtr first = CondExpr();
    if (!IsOp(",")) return first;
    auto e = Make(Expr::Kind::kList, first->line);
    e->kids.push_back(std::move(first));
    while (IsOp(",")) {
      ++pos_;
      if (AtEnd()) break;
      e->kids.push_back(CondExpr());
    }
    return e;
  }
  const Token& Peek(size_t ahead = 0) const { return t_[std::min(pos_ + ahead, t_.size() - 1)]; }
  bool AtEnd() const { return Peek().kind == Token::Kind::kEnd; }
  bool IsOp(std::string_view op, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::Kind::kOp && Peek(ahead).text == op;
  }
  bool IsName(std::string_view name, size_t ahead = 0) const {
    return Peek(ahead).kind == Token::Kind::kName && Peek(ahead).text == name;
  }
  const Token& Next() { return t_[std::min(pos_++, t_.size() - 1)]; }
  void Expect(std::string_view op) {
    if (!IsOp(op))
      Fail(absl::StrCat("expected '", std::string(op), "', got '", Peek().text, "'"), Peek().line);
    ++pos_;
  }
  std::string ExpectName() {
    if (Peek().kind != Token::Kind::kName) Fail("expected a name", Peek().line);
    return Next().text;
  }
  void ExpectEnd() {
    if (!AtEnd()) Fail(absl::StrCat("unexpected '", Peek().text, "'"), Peek().line);
  }

  ExprPtr CondExpr() {
    DepthGuard guard(&depth_, Peek().line);
    ExprPtr body = Or();
    while (IsName("if")) {
      ++pos_;
      ExprPtr cond = Or();
      ExprPtr other;
      if (IsName("else")) {
        ++pos_;
        other = CondExpr();
      }
      auto e = Make(Expr::Kind::kCond, body->line);
      e->kids.push_back(std::move(cond));
      e->kids.push_back(std::move(body));
      if (other) e->kids.push_back(std::move(other));
      body = std::move(e);
    }
    return body;
  }

 private:
  static ExprPtr Make(Expr::Kind kind, int line) {
    auto e = std::make_unique<Expr>();
    e->kind = kind;
    e->line = line;
    return e;
  }
  static ExprPtr Pair(Expr::Kind kind, std::string name, ExprPtr a, ExprPtr b) {
    auto e = Make(kind, a->line);
    e->name = std::move(name);
    e->kids.push_back(std::move(a));
    e->kids.push_back(std::move(b));
    return e;
  }

  ExprPtr Or() {
    ExprPtr e = And();
    while (IsName("or")) {
      ++pos_;
      e = Pair(Expr::Kind::kOr, "or", std::move(e), And());
    }
    return e;
  }
  ExprPtr And() {
    ExprPtr e = Not();
    while (IsName("and")) {
      ++pos_;
      e = Pair(Expr::Kind::kAnd, "and", std::move(e), Not());
    }
    return e;
  }
  ExprPtr Not() {
    DepthGuard guard(&depth_, Peek().line);
    if (IsName("not")) {
      const int line = Next().line;
      auto e = Make(Expr::Kind::kNot, line);
      e->kids.push_back(Not());
      return e;
    }
    return Compare();
  }
  ExprPtr Compare() {
    ExprPtr e = Math1();
    while (true) {
      std::string op;
      if (Peek().kind == Token::Kind::kOp &&
          (Peek().text == "==" || Peek().text == "!=" || Peek().text == "<" || Peek().text == ">" ||
           Peek().text == "<=" || Peek().text == ">=")) {
        op = Next().text;
      } else if (IsName("in")) {
        ++pos_;
        op = "in";
      } else if (IsName("not") && IsName("in", 1)) {
        pos_ += 2;
        op = "not in";
      } else {
        return e;
      }
      e = Pair(Expr::Kind::kBinary, op, std::move(e), Math1());
    }
  }
  ExprPtr Math1() {
    ExprPtr e = Concat();
    while (IsOp("+") || IsOp("-")) {
      const std::string op = Next().text;
      e = Pair(Expr::Kind::kBinary, op, std::move(e), Concat());
    }
    return e;
  }
  ExprPtr Concat() {
    ExprPtr e = Math2();
    while (IsOp("~")) {
      ++pos_;
      e = Pair(Expr::Kind::kConcat, "~", std::move(e), Math2());
    }
    return e;
  }
  ExprPtr Math2() {
    ExprPtr e = Pow();
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      const std::string op = Next().text;
      e = Pair(Expr::Kind::kBinary, op, std::move(e), Pow());
    }
    return e;
  }
  ExprPtr Pow() {
    ExprPtr e = Unary();
    while (IsOp("**")) {
      ++pos_;
      e = Pair(Expr::Kind::kBinary, "**", std::move(e), Unary());
    }
    return e;
  }
  // Jinja applies filters after a sign: -3|abs is (-3)|abs.
  ExprPtr Unary(bool with_filter = true) {
    DepthGuard guard(&depth_, Peek().line);
    ExprPtr e;
    if (IsOp("-") || IsOp("+")) {
      const Token& t = Next();
      e = Make(t.text == "-" ? Expr::Kind::kNeg : Expr::Kind::kPos, t.line);
      e->kids.push_back(Unary(false));
    } else {
      e = Postfix(Primary());
    }
    return with_filter ? FilterExpr(std::move(e)) : std::move(e);
  }

  ExprPtr Primary() {
    const Token& t = Next();
    switch (t.kind) {
      case Token::Kind::kName: {
        auto e = Make(Expr::Kind::kLiteral, t.line);
        if (t.text == "true" || t.text == "True") {
          e->value = Value::Bool(true);
        } else if (t.text == "false" || t.text == "False") {
          e->value = Value::Bool(false);
        } else if (t.text == "none" || t.text == "None") {
          e->value = Value::None();
        } else {
          e->kind = Expr::Kind::kName;
          e->name = t.text;
        }
        return e;
      }
      case Token::Kind::kString: {
        std::string s = t.text;
        while (Peek().kind == Token::Kind::kString) s += Next().text;  // adjacent literals join
        auto e = Make(Expr::Kind::kLiteral, t.line);
        e->value = Value::Str(std::move(s));
        return e;
      }
      case Token::Kind::kInt: {
        auto e = Make(Expr::Kind::kLiteral, t.line);
        e->value = Value::Int(t.i);
        return e;
      }
      case Token::Kind::kFloat: {
        auto e = Make(Expr::Kind::kLiteral, t.line);
        e->value = Value::Float(t.f);
        return e;
      }
      case Token::Kind::kOp:
        if (t.text == "(") {
          if (IsOp(")")) {  // empty tuple
            ++pos_;
            return Make(Expr::Kind::kList, t.line);
          }
          ExprPtr first = CondExpr();
          if (IsOp(")")) {
            ++pos_;
            return first;
          }
          auto e = Make(Expr::Kind::kList, t.line);  // a tuple: a list here
          e->kids.push_back(std::move(first));
          while (IsOp(",")) {
            ++pos_;
            if (IsOp(")")) break;
            e->kids.push_back(CondExpr());
          }
          Expect(")");
          return e;
        }
        if (t.text == "[") {
          auto e = Make(Expr::Kind::kList, t.line);
          while (!IsOp("]")) {
            e->kids.push_back(CondExpr());
            if (!IsOp(",")) break;
            ++pos_;
          }
          Expect("]");
          return e;
        }
        if (t.text == "{") {
          auto e = Make(Expr::Kind::kDict, t.line);
          while (!IsOp("}")) {
            e->kids.push_back(CondExpr());
            Expect(":");
            e->kids.push_back(CondExpr());
            if (!IsOp(",")) break;
            ++pos_;
          }
          Expect("}");
          return e;
        }
        [[fallthrough]];
      default:
        Fail(absl::StrCat("unexpected '", t.text, "'"), t.line);
    }
  }

  // Call arguments after '(': positional then name=value.
  void CallArgs(Expr* e) {
    while (!IsOp(")")) {
      if (Peek().kind == Token::Kind::kName && IsOp("=", 1)) {
        e->kw_names.push_back(Next().text);
        ++pos_;
        e->kids.push_back(CondExpr());
      } else {
        if (!e->kw_names.empty()) Fail("positional argument after a keyword argument", Peek().line);
        e->kids.push_back(CondExpr());
      }
      if (!IsOp(",")) break;
      ++pos_;
    }
    Expect(")");
  }

  ExprPtr Postfix(ExprPtr e) {
    while (true) {
      if (IsOp(".")) {
        ++pos_;
        auto a = Make(Expr::Kind::kAttr, e->line);
        if (Peek().kind == Token::Kind::kInt) {
          a->kind = Expr::Kind::kItem;
          auto idx = Make(Expr::Kind::kLiteral, e->line);
          idx->value = Value::Int(Next().i);
          a->kids.push_back(std::move(e));
          a->kids.push_back(std::move(idx));
        } else {
          a->name = ExpectName();
          a->kids.push_back(std::move(e));
        }
        e = std::move(a);
      } else if (IsOp("[")) {
        ++pos_;
        // A subscript or a slice [a:b:c], each part optional.
        ExprPtr parts[3];
        int colons = 0;
        if (!IsOp(":")) parts[0] = CondExpr();
        while (IsOp(":") && colons < 2) {
          ++pos_;
          ++colons;
          if (!IsOp(":") && !IsOp("]")) parts[colons] = CondExpr();
        }
        Expect("]");
        if (colons == 0) {
          auto s = Make(Expr::Kind::kItem, e->line);
          s->kids.push_back(std::move(e));
          s->kids.push_back(std::move(parts[0]));
          e = std::move(s);
        } else {
          auto s = Make(Expr::Kind::kSlice, e->line);
          s->kids.push_back(std::move(e));
          for (auto& p : parts) s->kids.push_back(std::move(p));  // null: omitted
          e = std::move(s);
        }
      } else if (IsOp("(")) {
        ++pos_;
        auto c = Make(Expr::Kind::kCall, e->line);
        c->kids.push_back(std::move(e));
        CallArgs(c.get());
        e = std::move(c);
      } else {
        return e;
      }
    }
  }

  ExprPtr FilterExpr(ExprPtr e) {
    while (true) {
      if (IsOp("|")) {
        ++pos_;
        auto f = Make(Expr::Kind::kFilter, e->line);
        f->name = ExpectName();
        f->kids.push_back(std::move(e));
        if (IsOp("(")) {
          ++pos_;
          CallArgs(f.get());
        }
        e = std::move(f);
      } else if (IsName("is")) {
        ++pos_;
        auto t = Make(Expr::Kind::kTest, e->line);
        if (IsName("not")) {
          ++pos_;
          t->negated = true;
        }
        // `none`, `true` and `false` are test names here, not literals.
        t->name = ExpectName();
        t->kids.push_back(std::move(e));
        if (IsOp("(")) {
          ++pos_;
          CallArgs(t.get());
        } else {
          const Token& n = Peek();
          const bool arg_start = n.kind == Token::Kind::kString || n.kind == Token::Kind::kInt ||
                                 n.kind == Token::Kind::kFloat ||
                                 (n.kind == Token::Kind::kName && n.text != "else" &&
                                  n.text != "or" && n.text != "and") ||
                                 IsOp("(") || IsOp("[") || IsOp("{");
          if (arg_start) t->kids.push_back(Postfix(Primary()));
        }
        e = std::move(t);
      } else {
        return e;
      }
    }
  }

  const std::vector<Token>& t_;
  size_t pos_;
  int depth_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Statements.

struct Node;
using Body = std::vector<std::unique_ptr<Node>>;

struct Node {
  enum class Kind { kText, kOutput, kIf, kFor, kSet, kSetBlock, kMacro, kBreak, kContinue, kBlock };
  Kind kind = Kind::kText;
  std::string text;                // kText; kSet/kSetBlock/kMacro: the name
  std::string attr;                // kSet of ns.attr
  std::vector<std::string> names;  // kFor targets, kSet tuple targets, kMacro parameters
  std::vector<ExprPtr> exprs;      // kOutput/kSet: [value]; kIf: conditions; kFor: [iter, cond?]
                                   // kMacro: parameter defaults (null: none)
  std::vector<Body> bodies;        // kIf: one per condition (+ else); kFor: body (+ else)
  int line = 0;
};

class TemplateParser {
 public:
  explicit TemplateParser(std::vector<Piece> pieces) : pieces_(std::move(pieces)) {}

  Body ParseAll() {
    std::string end;
    Body body = ParseBody({}, &end);
    return body;
  }

 private:
  // Statements until one of `ends` (a block keyword), whose keyword goes to *end_found and
  // whose piece index stays current.
  Body ParseBody(const std::vector<std::string>& ends, std::string* end_found) {
    DepthGuard guard(&depth_, pos_ < pieces_.size() ? pieces_[pos_].line : 0);
    Body body;
    while (pos_ < pieces_.size()) {
      Piece& p = pieces_[pos_];
      if (p.kind == Piece::Kind::kText) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kText;
        n->text = std::move(p.text);
        n->line = p.line;
        body.push_back(std::move(n));
        ++pos_;
        continue;
      }
      ExprParser ep(p.tokens);
      if (p.kind == Piece::Kind::kOutput) {
        auto n = std::make_unique<Node>();
        n->kind = Node::Kind::kOutput;
        n->line = p.line;
        n->exprs.push_back(ep.Parse());
        ep.ExpectEnd();
        body.push_back(std::move(n));
        ++pos_;
        continue;
      }
      const std::string keyword = ep.ExpectName();
      if (std::find(ends.begin(), ends.end(), keyword) != ends.end()) {
        *end_found = keyword;
        return body;
      }
      ++pos_;
      body.push_back(Statement(keyword, ep, p.line));
    }
    if (!ends.empty()) {
      Fail(absl::StrCat("unexpected end of template, expected '", absl::StrJoin(ends, "' or '"),
                        "'"));
    }
    return body;
  }

  // The tokens of the current piece (the statement that ended a body) after its keyword.
  ExprParser EndParser() {
    ExprParser ep(pieces_[pos_].tokens);
    ep.ExpectName();
    return ep;
  }

  std::unique_ptr<Node> Statement(const std::string& keyword, ExprParser& ep, int line) {
    auto n = std::make_unique<Node>();
    n->line = line;
    std::string end;
    if (keyword == "if") {
      n->kind = Node::Kind::kIf;
      n->exprs.push_back(ep.Parse());
      ep.ExpectEnd();
      while (true) {
        n->bodies.push_back(ParseBody({"elif", "else", "endif"}, &end));
        ExprParser tail = EndParser();
        ++pos_;
        if (end == "elif") {
          n->exprs.push_back(tail.Parse());
          tail.ExpectEnd();
          continue;
        }
        tail.ExpectEnd();
        if (end == "else") {
          n->bodies.push_back(ParseBody({"endif"}, &end));
          EndParser().ExpectEnd();
          ++pos_;
        }
        break;
      }
    } else if (keyword == "for") {
      n->kind = Node::Kind::kFor;
      n->names.push_back(ep.ExpectName());
      while (ep.IsOp(",")) {
        ep.Next();
        n->names.push_back(ep.ExpectName());
      }
      if (!ep.IsName("in")) Fail("expected 'in' in a for statement", line);
      ep.Next();
      // The iterable stops before a filter condition (`for x in y if c`).
      n->exprs.push_back(ep.CondExprNoIf());
      if (ep.IsName("if")) {
        ep.Next();
        n->exprs.push_back(ep.Parse());
      }
      if (ep.IsName("recursive")) Fail("recursive for loops are not supported", line);
      ep.ExpectEnd();
      n->bodies.push_back(ParseBody({"else", "endfor"}, &end));
      EndParser().ExpectEnd();
      ++pos_;
      if (end == "else") {
        n->bodies.push_back(ParseBody({"endfor"}, &end));
        EndParser().ExpectEnd();
        ++pos_;
      }
    } else if (keyword == "set") {
      n->text = ep.ExpectName();
      if (ep.IsOp(".")) {
        ep.Next();
        n->attr = ep.ExpectName();
      } else if (ep.IsOp(",")) {
        n->names.push_back(n->text);
        while (ep.IsOp(",")) {
          ep.Next();
          n->names.push_back(ep.ExpectName());
        }
      }
      if (ep.AtEnd() && n->attr.empty() && n->names.empty()) {
        n->kind = Node::Kind::kSetBlock;
        n->bodies.push_back(ParseBody({"endset"}, &end));
        EndParser().ExpectEnd();
        ++pos_;
      } else {
        n->kind = Node::Kind::kSet;
        ep.Expect("=");
        n->exprs.push_back(ep.ParseTuple());
        ep.ExpectEnd();
      }
    } else if (keyword == "macro") {
      n->kind = Node::Kind::kMacro;
      n->text = ep.ExpectName();
      ep.Expect("(");
      while (!ep.IsOp(")")) {
        n->names.push_back(ep.ExpectName());
        if (ep.IsOp("=")) {
          ep.Next();
          n->exprs.push_back(ep.Parse());
        } else {
          n->exprs.push_back(nullptr);
        }
        if (!ep.IsOp(",")) break;
        ep.Next();
      }
      ep.Expect(")");
      ep.ExpectEnd();
      n->bodies.push_back(ParseBody({"endmacro"}, &end));
      ++pos_;
    } else if (keyword == "break" || keyword == "continue") {
      n->kind = keyword == "break" ? Node::Kind::kBreak : Node::Kind::kContinue;
      ep.ExpectEnd();
    } else if (keyword == "generation") {
      // transformers' {% generation %} marks assistant text for masks; it renders its body.
      n->kind = Node::Kind::kBlock;
      ep.ExpectEnd();
      n->bodies.push_back(ParseBody({"endgeneration"}, &end));
      ++pos_;
    } else {
      Fail(absl::StrCat("unsupported statement '", keyword, "'"), line);
    }
    return n;
  }

  std::vector<Piece> pieces_;
  int depth_ = 0;
  size_t pos_ = 0;
};

// ---------------------------------------------------------------------------------------------
// Evaluation.

struct Scope {
  std::unordered_map<std::string, Value> vars;
  Scope* parent = nullptr;
  const Value* Find(const std::string& name) const {
    for (const Scope* s = this; s != nullptr; s = s->parent) {
      auto it = s->vars.find(name);
      if (it != s->vars.end()) return &it->second;
    }
    return nullptr;
  }
};

enum class Flow { kNormal, kBreak, kContinue };

class Renderer {
 public:
  explicit Renderer(Scope* root) : root_(root) {}

  Flow Exec(const Body& body, Scope* scope, std::string* out) {
    for (const auto& n : body) {
      const Flow f = ExecNode(*n, scope, out);
      if (f != Flow::kNormal) return f;
    }
    return Flow::kNormal;
  }

 private:
  Flow ExecNode(const Node& n, Scope* scope, std::string* out) {
    switch (n.kind) {
      case Node::Kind::kText:
        *out += n.text;
        return Flow::kNormal;
      case Node::Kind::kOutput:
        *out += Str(Eval(*n.exprs[0], scope));
        return Flow::kNormal;
      case Node::Kind::kIf:
        for (size_t k = 0; k < n.exprs.size(); ++k) {
          if (Truthy(Eval(*n.exprs[k], scope))) return Exec(n.bodies[k], scope, out);
        }
        if (n.bodies.size() > n.exprs.size()) return Exec(n.bodies.back(), scope, out);
        return Flow::kNormal;
      case Node::Kind::kFor:
        For(n, scope, out);
        return Flow::kNormal;
      case Node::Kind::kSet: {
        Value v = Eval(*n.exprs[0], scope);
        if (!n.attr.empty()) {
          const Value* ns = scope->Find(n.text);
          if (ns == nullptr || ns->kind != Value::Kind::kNamespace) {
            Fail("can only assign attributes of a namespace", n.line);
          }
          SetKey(ns->dict.get(), n.attr, std::move(v));
        } else if (!n.names.empty()) {
          List items = Iterate(v);
          if (items.size() != n.names.size()) Fail("wrong number of values to unpack", n.line);
          for (size_t k = 0; k < items.size(); ++k) scope->vars[n.names[k]] = std::move(items[k]);
        } else {
          scope->vars[n.text] = std::move(v);
        }
        return Flow::kNormal;
      }
      case Node::Kind::kSetBlock: {
        std::string captured;
        Scope inner;
        inner.parent = scope;
        Exec(n.bodies[0], &inner, &captured);
        scope->vars[n.text] = Value::Str(std::move(captured));
        return Flow::kNormal;
      }
      case Node::Kind::kMacro:
        scope->vars[n.text] = MakeMacro(n);
        return Flow::kNormal;
      case Node::Kind::kBreak:
        return Flow::kBreak;
      case Node::Kind::kContinue:
        return Flow::kContinue;
      case Node::Kind::kBlock:
        return Exec(n.bodies[0], scope, out);
    }
    return Flow::kNormal;
  }

  void For(const Node& n, Scope* scope, std::string* out) {
    List items = Iterate(Eval(*n.exprs[0], scope));
    if (n.exprs.size() > 1) {  // the loop's filter condition, before loop.* is known
      List kept;
      for (Value& item : items) {
        Scope s;
        s.parent = scope;
        Bind(n, item, &s);
        if (Truthy(Eval(*n.exprs[1], &s))) kept.push_back(std::move(item));
      }
      items = std::move(kept);
    }
    if (items.empty()) {
      if (n.bodies.size() > 1) Exec(n.bodies[1], scope, out);
      return;
    }
    const int64_t length = static_cast<int64_t>(items.size());
    for (int64_t k = 0; k < length; ++k) {
      Scope s;
      s.parent = scope;
      Bind(n, items[k], &s);
      Dict loop = {{"index", Value::Int(k + 1)},
                   {"index0", Value::Int(k)},
                   {"revindex", Value::Int(length - k)},
                   {"revindex0", Value::Int(length - k - 1)},
                   {"first", Value::Bool(k == 0)},
                   {"last", Value::Bool(k == length - 1)},
                   {"length", Value::Int(length)},
                   {"depth", Value::Int(1)},
                   {"depth0", Value::Int(0)}};
      if (k > 0) loop.emplace_back("previtem", items[k - 1]);
      if (k + 1 < length) loop.emplace_back("nextitem", items[k + 1]);
      s.vars["loop"] = Value::MakeDict(std::move(loop));
      if (Exec(n.bodies[0], &s, out) == Flow::kBreak) break;
    }
  }

  static void Bind(const Node& n, const Value& item, Scope* s) {
    if (n.names.size() == 1) {
      s->vars[n.names[0]] = item;
      return;
    }
    List parts = Iterate(item);
    if (parts.size() != n.names.size()) {
      Fail(absl::StrCat("cannot unpack ", parts.size(), " values into ", n.names.size()), n.line);
    }
    for (size_t k = 0; k < parts.size(); ++k) s->vars[n.names[k]] = std::move(parts[k]);
  }

  Value MakeMacro(const Node& n) {
    return Value::Fn([this, &n](Args& args) {
      DepthGuard guard(&calls_, n.line);  // a macro that calls itself forever
      Scope s;
      s.parent = root_;
      for (size_t k = 0; k < n.names.size(); ++k) {
        const Value* given = args.Get(k, n.names[k]);
        if (given != nullptr) {
          s.vars[n.names[k]] = *given;
        } else if (n.exprs[k] != nullptr) {
          s.vars[n.names[k]] = Eval(*n.exprs[k], &s);
        } else {
          s.vars[n.names[k]] = Value::Undefined(n.names[k]);
        }
      }
      std::string body;
      Exec(n.bodies[0], &s, &body);
      return Value::Str(std::move(body));
    });
  }

  Args EvalArgs(const Expr& e, size_t first, Scope* scope) {
    Args a;
    const size_t n_kw = e.kw_names.size();
    const size_t n_pos = e.kids.size() - first - n_kw;
    for (size_t k = 0; k < n_pos; ++k) a.pos.push_back(Eval(*e.kids[first + k], scope));
    for (size_t k = 0; k < n_kw; ++k) {
      a.kw.emplace_back(e.kw_names[k], Eval(*e.kids[first + n_pos + k], scope));
    }
    return a;
  }

  Value Eval(const Expr& e, Scope* scope) {
    switch (e.kind) {
      case Expr::Kind::kLiteral:
        return e.value;
      case Expr::Kind::kName: {
        const Value* v = scope->Find(e.name);
        return v != nullptr ? *v : Value::Undefined(e.name);
      }
      case Expr::Kind::kAttr:
        return GetAttr(Eval(*e.kids[0], scope), e.name, e.line);
      case Expr::Kind::kItem:
        return GetItem(Eval(*e.kids[0], scope), Eval(*e.kids[1], scope), e.line);
      case Expr::Kind::kSlice: {
        Value obj = Eval(*e.kids[0], scope);
        Value parts[3];
        for (int k = 0; k < 3; ++k) {
          parts[k] = e.kids[k + 1] ? Eval(*e.kids[k + 1], scope) : Value::None();
        }
        return Slice(obj, parts, e.line);
      }
      case Expr::Kind::kCall: {
        Value fn = Eval(*e.kids[0], scope);
        Args args = EvalArgs(e, 1, scope);
        if (fn.kind != Value::Kind::kFunction) {
          Fail(absl::StrCat("'", fn.is_undefined() ? fn.undefined_name : TypeName(fn),
                            "' is not callable"),
               e.line);
        }
        return (*fn.fn)(args);
      }
      case Expr::Kind::kFilter: {
        Value v = Eval(*e.kids[0], scope);
        Args args = EvalArgs(e, 1, scope);
        return ApplyFilter(e.name, v, args, e.line);
      }
      case Expr::Kind::kTest: {
        Value v = Eval(*e.kids[0], scope);
        Args args = EvalArgs(e, 1, scope);
        const bool r = ApplyTest(e.name, v, args, e.line);
        return Value::Bool(e.negated ? !r : r);
      }
      case Expr::Kind::kNot:
        return Value::Bool(!Truthy(Eval(*e.kids[0], scope)));
      case Expr::Kind::kNeg:
      case Expr::Kind::kPos: {
        Value v = Eval(*e.kids[0], scope);
        if (!v.is_number())
          Fail(absl::StrCat("bad operand type for unary -: '", TypeName(v), "'"), e.line);
        if (e.kind == Expr::Kind::kPos)
          return v.kind == Value::Kind::kBool ? Value::Int(v.AsInt()) : v;
        if (v.kind != Value::Kind::kFloat && v.AsInt() == INT64_MIN)
          Fail("integer - beyond 64 bits", e.line);
        return v.kind == Value::Kind::kFloat ? Value::Float(-v.f) : Value::Int(-v.AsInt());
      }
      case Expr::Kind::kAnd: {
        Value a = Eval(*e.kids[0], scope);
        return Truthy(a) ? Eval(*e.kids[1], scope) : a;
      }
      case Expr::Kind::kOr: {
        Value a = Eval(*e.kids[0], scope);
        return Truthy(a) ? a : Eval(*e.kids[1], scope);
      }
      case Expr::Kind::kCond:
        if (Truthy(Eval(*e.kids[0], scope))) return Eval(*e.kids[1], scope);
        return e.kids.size() > 2 ? Eval(*e.kids[2], scope) : Value::Undefined("");
      case Expr::Kind::kList: {
        List l;
        for (const auto& k : e.kids) l.push_back(Eval(*k, scope));
        return Value::MakeList(std::move(l));
      }
      case Expr::Kind::kDict: {
        Dict d;
        for (size_t k = 0; k + 1 < e.kids.size(); k += 2) {
          Value key = Eval(*e.kids[k], scope);
          if (!key.is_string()) Fail("dict keys must be strings here", e.line);
          SetKey(&d, key.s, Eval(*e.kids[k + 1], scope));
        }
        return Value::MakeDict(std::move(d));
      }
      case Expr::Kind::kConcat:
        return Value::Str(Str(Eval(*e.kids[0], scope)) + Str(Eval(*e.kids[1], scope)));
      case Expr::Kind::kBinary:
        return Binary(e.name, Eval(*e.kids[0], scope), Eval(*e.kids[1], scope), e.line);
    }
    Fail("bad expression", e.line);
  }

  static void RequireDefined(const Value& v, int line) {
    if (v.is_undefined()) Fail(absl::StrCat("'", v.undefined_name, "' is undefined"), line);
  }

  Value Binary(const std::string& op, const Value& a, const Value& b, int line) {
    if (op == "==") return Value::Bool(Equal(a, b));
    if (op == "!=") return Value::Bool(!Equal(a, b));
    if (op == "in") return Value::Bool(Contains(b, a));
    if (op == "not in") return Value::Bool(!Contains(b, a));
    if (op == "<") return Value::Bool(Compare(a, b, op) < 0);
    if (op == ">") return Value::Bool(Compare(a, b, op) > 0);
    if (op == "<=") return Value::Bool(Compare(a, b, op) <= 0);
    if (op == ">=") return Value::Bool(Compare(a, b, op) >= 0);
    RequireDefined(a, line);
    RequireDefined(b, line);
    if (a.big || b.big) Fail("arithmetic on an integer beyond 64 bits", line);
    if (op == "+") {
      if (a.is_string() && b.is_string()) return Value::Str(a.s + b.s);
      if (a.kind == Value::Kind::kList && b.kind == Value::Kind::kList) {
        List l = *a.list;
        l.insert(l.end(), b.list->begin(), b.list->end());
        return Value::MakeList(std::move(l));
      }
    }
    if (op == "*") {
      const Value* text = a.is_string() ? &a : b.is_string() ? &b : nullptr;
      const Value* count = a.is_string() ? &b : &a;
      if (text != nullptr && count->kind != Value::Kind::kFloat && count->is_number()) {
        std::string out;
        const int64_t times = std::max<int64_t>(0, count->AsInt());
        if (!text->s.empty() &&
            times > (int64_t{64} << 20) / static_cast<int64_t>(text->s.size())) {
          Fail("a string repeated beyond 64 MiB", line);
        }
        for (int64_t k = 0; k < times; ++k) out += text->s;
        return Value::Str(std::move(out));
      }
    }
    if (a.is_number() && b.is_number()) {
      const bool floats = a.kind == Value::Kind::kFloat || b.kind == Value::Kind::kFloat;
      const double x = a.AsDouble(), y = b.AsDouble();
      const int64_t p = a.AsInt(), q = b.AsInt();
      // Python's integers have no bound; ours end at 64 bits, loudly.
      int64_t r = 0;
      auto overflow = [&] { Fail(absl::StrCat("integer ", op, " beyond 64 bits"), line); };
      if (op == "+") {
        if (floats) return Value::Float(x + y);
        if (__builtin_add_overflow(p, q, &r)) overflow();
        return Value::Int(r);
      }
      if (op == "-") {
        if (floats) return Value::Float(x - y);
        if (__builtin_sub_overflow(p, q, &r)) overflow();
        return Value::Int(r);
      }
      if (op == "*") {
        if (floats) return Value::Float(x * y);
        if (__builtin_mul_overflow(p, q, &r)) overflow();
        return Value::Int(r);
      }
      if (op == "/") {
        if (y == 0) Fail("division by zero", line);
        return Value::Float(x / y);
      }
      if (op == "//" || op == "%") {
        if (floats ? y == 0 : q == 0) Fail("integer division or modulo by zero", line);
        if (floats) {
          const double d = std::floor(x / y);
          return op == "//" ? Value::Float(d) : Value::Float(x - d * y);
        }
        if (p == INT64_MIN && q == -1) overflow();
        int64_t d = p / q;
        if ((p % q != 0) && ((p < 0) != (q < 0))) --d;  // floor, as Python
        return op == "//" ? Value::Int(d) : Value::Int(p - d * q);
      }
      if (op == "**") {
        if (floats || q < 0) return Value::Float(std::pow(x, y));
        int64_t acc = 1;
        for (int64_t k = 0; k < q; ++k) {
          if (__builtin_mul_overflow(acc, p, &acc)) overflow();
          if (acc == 0 || acc == 1) break;  // 0 and 1 stay; -1 alternates (handled below)
        }
        if (p == -1) acc = q % 2 == 0 ? 1 : -1;
        return Value::Int(acc);
      }
    }
    Fail(absl::StrCat("unsupported operand type(s) for ", op, ": '", TypeName(a), "' and '",
                      TypeName(b), "'"),
         line);
  }

  static Value Slice(const Value& obj, const Value parts[3], int line) {
    auto get = [&](const Value& v, int64_t def) {
      if (v.kind == Value::Kind::kNone) return def;
      if (v.kind != Value::Kind::kInt && v.kind != Value::Kind::kBool)
        Fail("slice indices must be integers", line);
      return v.AsInt();
    };
    const int64_t step = get(parts[2], 1);
    if (step == 0) Fail("slice step cannot be zero", line);
    List items;
    std::vector<std::string> chars;
    int64_t n = 0;
    if (obj.kind == Value::Kind::kList) {
      n = static_cast<int64_t>(obj.list->size());
    } else if (obj.is_string()) {
      chars = CodePoints(obj.s);
      n = static_cast<int64_t>(chars.size());
    } else {
      Fail(absl::StrCat("'", TypeName(obj), "' object is not subscriptable"), line);
    }
    // Python's slice.indices.
    auto adjust = [&](int64_t v, bool is_start) {
      if (v < 0) v += n;
      if (step > 0) return std::clamp<int64_t>(v, 0, n);
      (void)is_start;
      return std::clamp<int64_t>(v, -1, n - 1);
    };
    int64_t start = parts[0].kind == Value::Kind::kNone ? (step > 0 ? 0 : n - 1)
                                                        : adjust(get(parts[0], 0), true);
    int64_t stop =
        parts[1].kind == Value::Kind::kNone ? (step > 0 ? n : -1) : adjust(get(parts[1], 0), false);
    List out;
    std::string s;
    for (int64_t k = start; step > 0 ? k < stop : k > stop;
         k = __builtin_add_overflow(k, step, &k) ? stop : k) {
      if (obj.kind == Value::Kind::kList) {
        out.push_back((*obj.list)[k]);
      } else {
        s += chars[k];
      }
    }
    return obj.kind == Value::Kind::kList ? Value::MakeList(std::move(out))
                                          : Value::Str(std::move(s));
  }

  // obj.name: Jinja's getattr first (methods), then the item.
  Value GetAttr(const Value& obj, const std::string& name, int line) {
    if (obj.is_undefined()) {
      Fail(absl::StrCat("'", obj.undefined_name, "' is undefined (reading its '", name, "')"),
           line);
    }
    if (Value m = Method(obj, name, line); !m.is_undefined()) return m;
    if (obj.kind == Value::Kind::kDict || obj.kind == Value::Kind::kNamespace) {
      if (const Value* v = obj.Find(name)) return *v;
    }
    return Value::Undefined(name);
  }

  // obj[key]: the item first, then the attribute.
  Value GetItem(const Value& obj, const Value& key, int line) {
    if (obj.is_undefined()) {
      Fail(absl::StrCat("'", obj.undefined_name, "' is undefined (reading an item)"), line);
    }
    if (obj.kind == Value::Kind::kDict && key.is_string()) {
      if (const Value* v = obj.Find(key.s)) return *v;
      return GetAttrNoItem(obj, key.s, line);
    }
    if ((obj.kind == Value::Kind::kList || obj.is_string()) &&
        (key.kind == Value::Kind::kInt || key.kind == Value::Kind::kBool)) {
      int64_t k = key.AsInt();
      if (obj.kind == Value::Kind::kList) {
        const int64_t n = static_cast<int64_t>(obj.list->size());
        if (k < 0) k += n;
        if (k < 0 || k >= n) return Value::Undefined("list index out of range");
        return (*obj.list)[k];
      }
      std::vector<std::string> chars = CodePoints(obj.s);
      const int64_t n = static_cast<int64_t>(chars.size());
      if (k < 0) k += n;
      if (k < 0 || k >= n) return Value::Undefined("string index out of range");
      return Value::Str(chars[k]);
    }
    if (key.is_string()) return GetAttrNoItem(obj, key.s, line);
    return Value::Undefined(Str(key));
  }

  Value GetAttrNoItem(const Value& obj, const std::string& name, int line) {
    if (Value m = Method(obj, name, line); !m.is_undefined()) return m;
    if (obj.kind == Value::Kind::kNamespace) {
      if (const Value* v = obj.Find(name)) return *v;
    }
    return Value::Undefined(name);
  }

  // The bound methods of str and dict that templates call.
  Value Method(const Value& obj, const std::string& name, int line) {
    if (obj.is_string()) {
      const std::string s = obj.s;
      auto str_arg = [line](Args& a, size_t k, const char* what) -> const std::string* {
        const Value* v = a.Get(k, what);
        if (v == nullptr || v->kind == Value::Kind::kNone) return nullptr;
        if (!v->is_string()) Fail(absl::StrCat(what, " must be a string"), line);
        return &v->s;
      };
      if (name == "startswith" || name == "endswith") {
        const bool start = name == "startswith";
        return Value::Fn([s, start, line](Args& a) {
          const Value* p = a.Get(0, "prefix");
          if (p == nullptr) Fail("startswith/endswith takes an argument", line);
          List options = p->kind == Value::Kind::kList ? *p->list : List{*p};
          for (const Value& o : options) {
            if (!o.is_string()) Fail("startswith/endswith takes strings", line);
            if (start ? s.compare(0, o.s.size(), o.s) == 0
                      : s.size() >= o.s.size() &&
                            s.compare(s.size() - o.s.size(), o.s.size(), o.s) == 0) {
              return Value::Bool(true);
            }
          }
          return Value::Bool(false);
        });
      }
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        const bool left = name != "rstrip", right = name != "lstrip";
        return Value::Fn([s, left, right, str_arg](Args& a) {
          return Value::Str(Strip(s, str_arg(a, 0, "chars"), left, right));
        });
      }
      if (name == "split") {
        return Value::Fn([s](Args& a) {
          const Value* m = a.Get(1, "maxsplit");
          return Value::MakeList(Split(s, a.Get(0, "sep"), m != nullptr ? m->AsInt() : -1));
        });
      }
      if (name == "replace") {
        return Value::Fn([s, str_arg, line](Args& a) {
          const std::string* from = str_arg(a, 0, "old");
          const std::string* to = str_arg(a, 1, "new");
          if (from == nullptr || to == nullptr) Fail("replace takes two strings", line);
          const Value* c = a.Get(2, "count");
          return Value::Str(Replace(s, *from, *to, c != nullptr ? c->AsInt() : -1));
        });
      }
      if (name == "upper" || name == "lower") {
        const bool up = name == "upper";
        return Value::Fn([s, up](Args&) { return Value::Str(Upper(s, up)); });
      }
      if (name == "title" || name == "capitalize") {
        const bool title = name == "title";
        return Value::Fn([s, title](Args&) {
          std::string out = Upper(s, false);
          bool start = true;
          for (char& c : out) {
            if (start && std::isalpha(static_cast<unsigned char>(c)))
              c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
            start = title ? !std::isalpha(static_cast<unsigned char>(c)) : false;
          }
          return Value::Str(out);
        });
      }
      if (name == "find" || name == "count") {
        const bool find = name == "find";
        return Value::Fn([s, find, str_arg, line](Args& a) {
          const std::string* sub = str_arg(a, 0, "sub");
          if (sub == nullptr) Fail("find/count takes a string", line);
          if (find) {
            const size_t at = s.find(*sub);
            if (at == std::string::npos) return Value::Int(-1);
            return Value::Int(static_cast<int64_t>(CodePoints(s.substr(0, at)).size()));
          }
          if (sub->empty()) return Value::Int(static_cast<int64_t>(CodePoints(s).size()) + 1);
          int64_t n = 0;
          for (size_t at = s.find(*sub); at != std::string::npos;
               at = s.find(*sub, at + sub->size()))
            ++n;
          return Value::Int(n);
        });
      }
      if (name == "join") {
        return Value::Fn([s](Args& a) {
          const Value* items = a.Get(0, "iterable");
          std::vector<std::string> parts;
          if (items != nullptr) {
            for (const Value& v : Iterate(*items)) parts.push_back(Str(v));
          }
          return Value::Str(absl::StrJoin(parts, s));
        });
      }
      return Value::Undefined(name);
    }
    if (obj.kind == Value::Kind::kDict) {
      const std::shared_ptr<Dict> d = obj.dict;
      if (name == "items") {
        return Value::Fn([d](Args&) {
          List out;
          for (const auto& [k, v] : *d) out.push_back(Value::MakeList({Value::Str(k), v}));
          return Value::MakeList(std::move(out));
        });
      }
      if (name == "keys" || name == "values") {
        const bool keys = name == "keys";
        return Value::Fn([d, keys](Args&) {
          List out;
          for (const auto& [k, v] : *d) out.push_back(keys ? Value::Str(k) : v);
          return Value::MakeList(std::move(out));
        });
      }
      if (name == "get") {
        return Value::Fn([obj](Args& a) {
          const Value* key = a.Get(0, "key");
          const Value* def = a.Get(1, "default");
          if (key != nullptr && key->is_string()) {
            if (const Value* v = obj.Find(key->s)) return *v;
          }
          return def != nullptr ? *def : Value::None();
        });
      }
    }
    return Value::Undefined(name);
  }

  static int64_t Length(const Value& v, int line) {
    switch (v.kind) {
      case Value::Kind::kUndefined:
        return 0;
      case Value::Kind::kString:
        return static_cast<int64_t>(CodePoints(v.s).size());
      case Value::Kind::kList:
        return static_cast<int64_t>(v.list->size());
      case Value::Kind::kDict:
        return static_cast<int64_t>(v.dict->size());
      default:
        Fail(absl::StrCat("object of type '", TypeName(v), "' has no len()"), line);
    }
  }

  // An attribute path "a.b" of an item, for map / selectattr.
  Value Attribute(const Value& item, const std::string& path, int line) {
    Value v = item;
    size_t pos = 0;
    while (true) {
      const size_t dot = path.find('.', pos);
      const std::string part =
          path.substr(pos, dot == std::string::npos ? std::string::npos : dot - pos);
      v = GetItem(v, Value::Str(part), line);
      if (dot == std::string::npos) return v;
      pos = dot + 1;
    }
  }

  Value ApplyFilter(const std::string& name, const Value& v, Args& a, int line) {
    if (name == "tojson") {
      JsonOptions o;
      if (const Value* x = a.Get(0, "ensure_ascii")) o.ensure_ascii = Truthy(*x);
      if (const Value* x = a.Get(1, "indent"); x != nullptr && x->kind != Value::Kind::kNone) {
        o.indent = static_cast<int>(x->AsInt());
        o.item_separator = ",";
      }
      if (const Value* x = a.Get(2, "separators"); x != nullptr && x->kind == Value::Kind::kList) {
        if (x->list->size() != 2) Fail("separators must be a pair", line);
        o.item_separator = Str((*x->list)[0]);
        o.key_separator = Str((*x->list)[1]);
      }
      if (const Value* x = a.Get(3, "sort_keys")) o.sort_keys = Truthy(*x);
      std::string out;
      ToJson(v, o, 0, &out);
      return Value::Str(std::move(out));
    }
    if (name == "safe" || name == "e" || name == "escape" || name == "string") {
      if (name == "e" || name == "escape") Fail("the escape filter is not supported", line);
      if (name == "safe" && !v.is_string()) return v;
      return Value::Str(Str(v));
    }
    if (name == "length" || name == "count") return Value::Int(Length(v, line));
    if (name == "trim") {
      const Value* chars = a.Get(0, "chars");
      const std::string* c = chars != nullptr && chars->is_string() ? &chars->s : nullptr;
      return Value::Str(Strip(Str(v), c, true, true));
    }
    if (name == "upper" || name == "lower") return Value::Str(Upper(Str(v), name == "upper"));
    if (name == "items") {
      if (v.is_undefined()) return Value::MakeList({});
      if (v.kind != Value::Kind::kDict) Fail("items filter: not a mapping", line);
      List out;
      for (const auto& [k, x] : *v.dict) out.push_back(Value::MakeList({Value::Str(k), x}));
      return Value::MakeList(std::move(out));
    }
    if (name == "list") return Value::MakeList(Iterate(v));
    if (name == "first" || name == "last") {
      List items = Iterate(v);
      if (items.empty()) return Value::Undefined("first/last of an empty sequence");
      return name == "first" ? items.front() : items.back();
    }
    if (name == "join") {
      const Value* sep = a.Get(0, "d");
      const Value* attr = a.Get(1, "attribute");
      std::vector<std::string> parts;
      for (const Value& x : Iterate(v)) {
        parts.push_back(Str(attr != nullptr ? Attribute(x, Str(*attr), line) : x));
      }
      return Value::Str(absl::StrJoin(parts, sep != nullptr ? Str(*sep) : ""));
    }
    if (name == "default" || name == "d") {
      const Value* def = a.Get(0, "default_value");
      const Value* boolean = a.Get(1, "boolean");
      const bool use = v.is_undefined() || (boolean != nullptr && Truthy(*boolean) && !Truthy(v));
      return use ? (def != nullptr ? *def : Value::Str("")) : v;
    }
    if (name == "replace") {
      const Value* from = a.Get(0, "old");
      const Value* to = a.Get(1, "new");
      const Value* c = a.Get(2, "count");
      if (from == nullptr || to == nullptr) Fail("replace takes two arguments", line);
      return Value::Str(Replace(Str(v), Str(*from), Str(*to), c != nullptr ? c->AsInt() : -1));
    }
    if (name == "int") {
      if (v.is_number())
        return Value::Int(v.kind == Value::Kind::kFloat ? static_cast<int64_t>(v.f) : v.AsInt());
      if (v.is_string()) {
        char* end = nullptr;
        const long long x = std::strtoll(v.s.c_str(), &end, 10);
        if (end != v.s.c_str()) return Value::Int(x);
      }
      return Value::Int(0);
    }
    if (name == "float") {
      if (v.is_number()) return Value::Float(v.AsDouble());
      if (v.is_string()) return Value::Float(std::strtod(v.s.c_str(), nullptr));
      return Value::Float(0);
    }
    if (name == "abs") {
      if (!v.is_number()) Fail("abs of a non-number", line);
      return v.kind == Value::Kind::kFloat ? Value::Float(std::fabs(v.f))
                                           : Value::Int(std::llabs(v.AsInt()));
    }
    if (name == "reverse") {
      if (v.is_string()) {
        std::vector<std::string> c = CodePoints(v.s);
        std::reverse(c.begin(), c.end());
        return Value::Str(absl::StrJoin(c, ""));
      }
      List items = Iterate(v);
      std::reverse(items.begin(), items.end());
      return Value::MakeList(std::move(items));
    }
    if (name == "map") {
      const Value* attr = a.Get(99, "attribute");
      List out;
      for (const Value& x : Iterate(v)) {
        if (attr != nullptr) {
          out.push_back(Attribute(x, Str(*attr), line));
        } else {
          if (a.pos.empty() || !a.pos[0].is_string())
            Fail("map takes a filter name or attribute=", line);
          Args rest;
          rest.pos.assign(a.pos.begin() + 1, a.pos.end());
          out.push_back(ApplyFilter(a.pos[0].s, x, rest, line));
        }
      }
      return Value::MakeList(std::move(out));
    }
    if (name == "selectattr" || name == "rejectattr" || name == "select" || name == "reject") {
      const bool by_attr = name == "selectattr" || name == "rejectattr";
      const bool keep = name == "selectattr" || name == "select";
      size_t k = 0;
      std::string attr;
      if (by_attr) {
        if (a.pos.empty()) Fail(name + " takes an attribute", line);
        attr = Str(a.pos[k++]);
      }
      std::string test = k < a.pos.size() ? Str(a.pos[k++]) : "";
      Args test_args;
      test_args.pos.assign(a.pos.begin() + std::min(k, a.pos.size()), a.pos.end());
      List out;
      for (const Value& x : Iterate(v)) {
        const Value subject = by_attr ? Attribute(x, attr, line) : x;
        const bool r = test.empty() ? Truthy(subject) : ApplyTest(test, subject, test_args, line);
        if (r == keep) out.push_back(x);
      }
      return Value::MakeList(std::move(out));
    }
    if (name == "unique") {
      List out;
      for (const Value& x : Iterate(v)) {
        if (std::none_of(out.begin(), out.end(), [&](const Value& y) { return Equal(x, y); }))
          out.push_back(x);
      }
      return Value::MakeList(std::move(out));
    }
    if (name == "indent") {
      const Value* width = a.Get(0, "width");
      const Value* first = a.Get(1, "first");
      const Value* blank = a.Get(2, "blank");
      const std::string pad = width == nullptr ? std::string(4, ' ')
                              : width->is_string()
                                  ? width->s
                                  : std::string(static_cast<size_t>(width->AsInt()), ' ');
      const std::string s = Str(v);
      std::string out;
      size_t pos = 0;
      bool first_line = true;
      while (pos <= s.size()) {
        const size_t nl = s.find('\n', pos);
        const std::string l = s.substr(pos, nl == std::string::npos ? std::string::npos : nl - pos);
        const bool indent = first_line ? (first != nullptr && Truthy(*first))
                                       : (!l.empty() || (blank != nullptr && Truthy(*blank)));
        if (!first_line) out += '\n';
        if (indent) out += pad;
        out += l;
        first_line = false;
        if (nl == std::string::npos) break;
        pos = nl + 1;
      }
      return Value::Str(std::move(out));
    }
    Fail(absl::StrCat("unsupported filter '", name, "'"), line);
  }

  bool ApplyTest(const std::string& name, const Value& v, Args& a, int line) {
    if (name == "defined") return !v.is_undefined();
    if (name == "undefined") return v.is_undefined();
    if (name == "none") return v.kind == Value::Kind::kNone;
    if (name == "string") return v.is_string();
    if (name == "mapping") return v.kind == Value::Kind::kDict;
    if (name == "iterable") {
      return v.is_string() || v.kind == Value::Kind::kList || v.kind == Value::Kind::kDict ||
             v.is_undefined();
    }
    if (name == "sequence") {
      return v.is_string() || v.kind == Value::Kind::kList || v.kind == Value::Kind::kDict;
    }
    if (name == "number") return v.is_number();
    if (name == "integer") return v.kind == Value::Kind::kInt;
    if (name == "float") return v.kind == Value::Kind::kFloat;
    if (name == "boolean") return v.kind == Value::Kind::kBool;
    if (name == "true") return v.kind == Value::Kind::kBool && v.b;
    if (name == "false") return v.kind == Value::Kind::kBool && !v.b;
    if (name == "callable") return v.kind == Value::Kind::kFunction;
    if (name == "lower" || name == "upper")
      return v.is_string() && Upper(v.s, name == "upper") == v.s;
    if (name == "odd" || name == "even" || name == "divisibleby") {
      if (!v.is_number()) Fail(name + " test of a non-number", line);
      if (name == "divisibleby") {
        const Value* d = a.Get(0, "num");
        if (d == nullptr || d->AsInt() == 0) Fail("divisibleby needs a non-zero number", line);
        return v.AsInt() % d->AsInt() == 0;
      }
      return (v.AsInt() % 2 != 0) == (name == "odd");
    }
    const Value* other = a.Get(0, "b");
    if (name == "eq" || name == "equalto" || name == "==")
      return other != nullptr && Equal(v, *other);
    if (name == "ne" || name == "!=") return other == nullptr || !Equal(v, *other);
    if (name == "in") return other != nullptr && Contains(*other, v);
    if (name == "sameas") {
      if (other == nullptr) return false;
      if (v.kind != other->kind) return false;
      if (v.kind == Value::Kind::kBool) return v.b == other->b;
      if (v.kind == Value::Kind::kNone) return true;
      return Equal(v, *other) && v.list == other->list && v.dict == other->dict;
    }
    Fail(absl::StrCat("unsupported test '", name, "'"), line);
  }

  Scope* root_;
  int calls_ = 0;
};

Value Globals(const std::string& name) {
  if (name == "raise_exception") {
    return Value::Fn([](Args& a) -> Value {
      const Value* m = a.Get(0, "message");
      Fail(m != nullptr ? Str(*m) : "raise_exception");
    });
  }
  if (name == "strftime_now") {
    return Value::Fn([](Args& a) {
      const Value* f = a.Get(0, "format");
      if (f == nullptr || !f->is_string()) Fail("strftime_now takes a format string");
      const std::time_t now = std::time(nullptr);
      std::tm tm{};
      localtime_r(&now, &tm);
      char buf[256];
      const size_t n = std::strftime(buf, sizeof(buf), f->s.c_str(), &tm);
      return Value::Str(std::string(buf, n));
    });
  }
  if (name == "namespace" || name == "dict") {
    const bool ns = name == "namespace";
    return Value::Fn([ns](Args& a) {
      Dict d;
      for (const Value& p : a.pos) {
        if (p.kind != Value::Kind::kDict) Fail("namespace()/dict() takes a mapping or name=value");
        for (const auto& kv : *p.dict) SetKey(&d, kv.first, kv.second);
      }
      for (const auto& [k, v] : a.kw) SetKey(&d, k, v);
      return Value::MakeDict(std::move(d), ns ? Value::Kind::kNamespace : Value::Kind::kDict);
    });
  }
  if (name == "range") {
    return Value::Fn([](Args& a) {
      int64_t start = 0, stop = 0, step = 1;
      if (a.pos.size() == 1) {
        stop = a.pos[0].AsInt();
      } else if (a.pos.size() >= 2) {
        start = a.pos[0].AsInt();
        stop = a.pos[1].AsInt();
        if (a.pos.size() > 2) step = a.pos[2].AsInt();
      }
      if (step == 0) Fail("range() arg 3 must not be zero");
      List out;
      for (int64_t k = start; step > 0 ? k < stop : k > stop;
           k = __builtin_add_overflow(k, step, &k) ? stop : k) {
        out.push_back(Value::Int(k));
        if (out.size() > 1000000) Fail("range() too large");
      }
      return Value::MakeList(std::move(out));
    });
  }
  return Value::Undefined(name);
}

}  // namespace

struct ChatTemplate::Impl {
  Body body;
};

ChatTemplate::ChatTemplate() : impl_(std::make_unique<Impl>()) {}
ChatTemplate::~ChatTemplate() = default;

absl::StatusOr<std::shared_ptr<const ChatTemplate>> ChatTemplate::Parse(std::string_view source) {
  std::shared_ptr<ChatTemplate> t(new ChatTemplate());
  size_t bad = 0;
  if (!IsValidUtf8(source, &bad)) {
    return absl::InvalidArgumentError(absl::StrCat("chat template: not valid UTF-8 at byte ", bad));
  }
  try {
    t->impl_->body = TemplateParser(Lex(std::string(source))).ParseAll();
  } catch (const TemplateError& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chat template", e.line > 0 ? absl::StrCat(" line ", e.line) : "", ": ", e.message));
  }
  return std::shared_ptr<const ChatTemplate>(std::move(t));
}

absl::StatusOr<std::string> ChatTemplate::Render(const ordered_json& variables) const {
  if (!variables.is_object())
    return absl::InvalidArgumentError("chat template variables: not an object");
  Scope root;
  for (const char* g : {"raise_exception", "strftime_now", "namespace", "dict", "range"}) {
    root.vars[g] = Globals(g);
  }
  std::string out;
  try {
    for (const auto& [k, v] : variables.items()) root.vars[k] = FromJson(v);
    Renderer r(&root);
    r.Exec(impl_->body, &root, &out);
  } catch (const TemplateError& e) {
    return absl::InvalidArgumentError(absl::StrCat(
        "chat template", e.line > 0 ? absl::StrCat(" line ", e.line) : "", ": ", e.message));
  }
  return out;
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
