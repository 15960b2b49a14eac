// The parser: a template's pieces (lexer.h) to a tree of statements (Node) and expressions
// (Expr), with Jinja's operator precedence. Literal-only expressions are folded. Internal to
// jinja/.
#ifndef MOELORA_JINJA_PARSER_H_
#define MOELORA_JINJA_PARSER_H_

#include <memory>
#include <string>
#include <vector>

#include "jinja/lexer.h"
#include "jinja/value.h"

namespace moelora::jinja {

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

// The statements of a whole template; throws TemplateError naming the line.
Body ParseTemplate(std::vector<Piece> pieces);

}  // namespace moelora::jinja

#endif  // MOELORA_JINJA_PARSER_H_
