// The renderer: executes a parsed template's statements and evaluates its expressions over a
// scope of Values, Python's semantics throughout; the filters, tests and bound methods of
// str and dict that templates call live in filters.cc. Internal to jinja/.
#ifndef MOELORA_JINJA_RENDERER_H_
#define MOELORA_JINJA_RENDERER_H_

#include <cstdint>
#include <string>
#include <unordered_map>

#include "jinja/parser.h"
#include "jinja/value.h"

namespace moelora::jinja {

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
  Flow Exec(const Body& body, Scope* scope, std::string* out);

 private:
  Flow ExecNode(const Node& n, Scope* scope, std::string* out);
  void For(const Node& n, Scope* scope, std::string* out);
  static void Bind(const Node& n, const Value& item, Scope* s);
  Value MakeMacro(const Node& n);
  Args EvalArgs(const Expr& e, size_t first, Scope* scope);
  Value Eval(const Expr& e, Scope* scope);
  static void RequireDefined(const Value& v, int line);
  Value Binary(const std::string& op, const Value& a, const Value& b, int line);
  static Value Slice(const Value& obj, const Value parts[3], int line);
  // obj.name: Jinja's getattr first (methods), then the item.
  Value GetAttr(const Value& obj, const std::string& name, int line);
  // obj[key]: the item first, then the attribute.
  Value GetItem(const Value& obj, const Value& key, int line);
  Value GetAttrNoItem(const Value& obj, const std::string& name, int line);
  // The bound methods of str and dict that templates call.
  Value Method(const Value& obj, const std::string& name, int line);
  static int64_t Length(const Value& v, int line);
  // An attribute path "a.b" of an item, for map / selectattr.
  Value Attribute(const Value& item, const std::string& path, int line);
  Value ApplyFilter(const std::string& name, const Value& v, Args& a, int line);
  bool ApplyTest(const std::string& name, const Value& v, Args& a, int line);

  Scope* root_;
  int calls_ = 0;
};

// The template's global functions: raise_exception, strftime_now, namespace, dict, range; an
// undefined value for any other name.
Value Globals(const std::string& name);

}  // namespace moelora::jinja

#endif  // MOELORA_JINJA_RENDERER_H_
