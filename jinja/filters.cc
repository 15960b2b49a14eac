// The filters, tests and bound methods that templates call, and the template's globals.
#include <algorithm>
#include <ctime>
#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "jinja/error.h"
#include "jinja/renderer.h"
#include "jinja/strings.h"

namespace moelora::jinja {

Value Renderer::Method(const Value& obj, const std::string& name, int line) {
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
        for (size_t at = s.find(*sub); at != std::string::npos; at = s.find(*sub, at + sub->size()))
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

int64_t Renderer::Length(const Value& v, int line) {
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

Value Renderer::Attribute(const Value& item, const std::string& path, int line) {
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

Value Renderer::ApplyFilter(const std::string& name, const Value& v, Args& a, int line) {
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

bool Renderer::ApplyTest(const std::string& name, const Value& v, Args& a, int line) {
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

}  // namespace moelora::jinja
