// The values a template sees: Python's types (None, bool, int, float, str, list, dict, a
// namespace, functions) and the semantics templates rely on: truthiness, str() and repr(),
// json.dumps as transformers' tojson calls it, ==, ordering, iteration and `in`.
// Internal to jinja/.
#ifndef MOELORA_JINJA_VALUE_H_
#define MOELORA_JINJA_VALUE_H_

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nlohmann/json_fwd.hpp"

namespace moelora::jinja {

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

// d[key] = v, keeping the key's place when it is there.
void SetKey(Dict* d, const std::string& key, Value v);

Value FromJson(const nlohmann::ordered_json& j, int depth = 0);

bool Truthy(const Value& v);

const char* TypeName(const Value& v);

// Python's repr(float): the shortest digits that read back to the same double, in fixed
// notation for exponents -4 .. 15, else scientific with at least two exponent digits.
std::string FloatRepr(double x);

// Python's str().
std::string Str(const Value& v);

// Python's repr() of a str: single quotes unless it holds one and no double quote.
std::string StrRepr(const std::string& s);

std::string Repr(const Value& v);

// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers' tojson calls it.
struct JsonOptions {
  bool ensure_ascii = false;
  int indent = -1;  // -1: None
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};

void ToJson(const Value& v, const JsonOptions& o, int level, std::string* out);

bool Equal(const Value& a, const Value& b);

// -1, 0, 1 for <, ==, > of numbers or strings; a TypeError otherwise.
int Compare(const Value& a, const Value& b, std::string_view op);

// The items a for loop or `in` walks: list items, dict keys, string characters.
List Iterate(const Value& v);

bool Contains(const Value& container, const Value& item);

}  // namespace moelora::jinja

#endif  // MOELORA_JINJA_VALUE_H_
