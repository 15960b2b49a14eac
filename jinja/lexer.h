// The lexer: a template's source to text pieces and tag token lists, with Jinja's whitespace
// rules (trim_blocks, lstrip_blocks, "-" on a delimiter) as transformers configures them.
// Internal to jinja/.
#ifndef MOELORA_JINJA_LEXER_H_
#define MOELORA_JINJA_LEXER_H_

#include <cstdint>
#include <string>
#include <vector>

namespace moelora::jinja {

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

// The pieces of `src`; throws TemplateError naming the line.
std::vector<Piece> Lex(std::string src);

}  // namespace moelora::jinja

#endif  // MOELORA_JINJA_LEXER_H_
