#include "jinja/renderer.h"

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "jinja/error.h"
#include "jinja/strings.h"

namespace moelora::jinja {

Flow Renderer::Exec(const Body& body, Scope* scope, std::string* out) {
  for (const auto& n : body) {
    const Flow f = ExecNode(*n, scope, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Flow Renderer::ExecNode(const Node& n, Scope* scope, std::string* out) {
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

void Renderer::For(const Node& n, Scope* scope, std::string* out) {
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

void Renderer::Bind(const Node& n, const Value& item, Scope* s) {
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

Value Renderer::MakeMacro(const Node& n) {
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

Args Renderer::EvalArgs(const Expr& e, size_t first, Scope* scope) {
  Args a;
  const size_t n_kw = e.kw_names.size();
  const size_t n_pos = e.kids.size() - first - n_kw;
  for (size_t k = 0; k < n_pos; ++k) a.pos.push_back(Eval(*e.kids[first + k], scope));
  for (size_t k = 0; k < n_kw; ++k) {
    a.kw.emplace_back(e.kw_names[k], Eval(*e.kids[first + n_pos + k], scope));
  }
  return a;
}

Value Renderer::Eval(const Expr& e, Scope* scope) {
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

void Renderer::RequireDefined(const Value& v, int line) {
  if (v.is_undefined()) Fail(absl::StrCat("'", v.undefined_name, "' is undefined"), line);
}

Value Renderer::Binary(const std::string& op, const Value& a, const Value& b, int line) {
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
      if (!text->s.empty() && times > (int64_t{64} << 20) / static_cast<int64_t>(text->s.size())) {
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

Value Renderer::Slice(const Value& obj, const Value parts[3], int line) {
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
  int64_t start =
      parts[0].kind == Value::Kind::kNone ? (step > 0 ? 0 : n - 1) : adjust(get(parts[0], 0), true);
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

Value Renderer::GetAttr(const Value& obj, const std::string& name, int line) {
  if (obj.is_undefined()) {
    Fail(absl::StrCat("'", obj.undefined_name, "' is undefined (reading its '", name, "')"), line);
  }
  if (Value m = Method(obj, name, line); !m.is_undefined()) return m;
  if (obj.kind == Value::Kind::kDict || obj.kind == Value::Kind::kNamespace) {
    if (const Value* v = obj.Find(name)) return *v;
  }
  return Value::Undefined(name);
}

Value Renderer::GetItem(const Value& obj, const Value& key, int line) {
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

Value Renderer::GetAttrNoItem(const Value& obj, const std::string& name, int line) {
  if (Value m = Method(obj, name, line); !m.is_undefined()) return m;
  if (obj.kind == Value::Kind::kNamespace) {
    if (const Value* v = obj.Find(name)) return *v;
  }
  return Value::Undefined(name);
}

}  // namespace moelora::jinja
