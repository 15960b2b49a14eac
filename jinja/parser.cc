#include "jinja/parser.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "jinja/error.h"

namespace moelora::jinja {

namespace {

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

}  // namespace

Body ParseTemplate(std::vector<Piece> pieces) {
  return TemplateParser(std::move(pieces)).ParseAll();
}

}  // namespace moelora::jinja
