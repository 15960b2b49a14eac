// A Jinja template engine: the subset that models' chat templates use, rendered as transformers'
// `apply_chat_template` renders them (Jinja's trim_blocks and lstrip_blocks, a dropped trailing
// newline, `tojson` as json.dumps, `raise_exception`, `strftime_now`, `namespace`).
//
// Written here because Debian packages no C++ Jinja engine (neither Jinja2Cpp nor inja, which is
// not Jinja): the subset covers statements if/elif/else, for (unpacking, loop.*, else, a filter
// condition, break/continue), set (names, namespace attributes, blocks), macro; Python's
// expression semantics (truthiness, `and`/`or` returning operands, `in`, slicing, str/dict
// methods, str() and repr() of values) and the filters and tests real templates use. Anything
// else is an error naming the line, never a silent difference.
//
// The engine as an interpreter: value.h (Python's values), strings.h (str methods), lexer.h,
// parser.h (statements and expressions), renderer.h (execution; filters.cc the filters, tests
// and methods). Only this header is for use outside jinja/. It includes common/ alone.
//
// Thread-safety: a parsed Template is immutable; Render may run on any thread at once.
#ifndef MOELORA_JINJA_TEMPLATE_H_
#define MOELORA_JINJA_TEMPLATE_H_

#include <memory>
#include <string>
#include <string_view>

#include "absl/status/statusor.h"
#include "nlohmann/json_fwd.hpp"

namespace moelora::jinja {

class Template {
 public:
  // INVALID_ARGUMENT naming the line for a template this engine cannot parse. `name` begins
  // every error's message ("chat template line 3: ...").
  [[nodiscard]] static absl::StatusOr<std::shared_ptr<const Template>> Parse(
      std::string_view source, std::string_view name = "template");
  ~Template();
  Template(const Template&) = delete;
  Template& operator=(const Template&) = delete;

  // Renders with `variables` (a JSON object) as the template's globals. INVALID_ARGUMENT with
  // the template's own message for raise_exception, or naming the line of an error (an
  // undefined attribute's attribute, a type error).
  [[nodiscard]] absl::StatusOr<std::string> Render(const nlohmann::ordered_json& variables) const;

 private:
  struct Impl;
  Template();
  std::unique_ptr<Impl> impl_;
};

}  // namespace moelora::jinja

#endif  // MOELORA_JINJA_TEMPLATE_H_
