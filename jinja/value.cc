#include "jinja/value.h"

#include <cmath>
#include <cstdio>
#include <cstdlib>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/utf8.h"
#include "jinja/error.h"
#include "jinja/strings.h"
#include "nlohmann/json.hpp"
#include "unicode/uchar.h"

namespace moelora::jinja {

using nlohmann::ordered_json;

namespace {

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

}  // namespace

void SetKey(Dict* d, const std::string& key, Value v) {
  for (auto& kv : *d) {
    if (kv.first == key) {
      kv.second = std::move(v);
      return;
    }
  }
  d->emplace_back(key, std::move(v));
}

// Request data nested deeper than this is refused (the evaluator recurses over values).
constexpr int kMaxDepth = 256;

Value FromJson(const ordered_json& j, int depth) {
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

}  // namespace moelora::jinja
