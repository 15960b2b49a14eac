#include "jinja/template.h"

#include <utility>

#include "absl/strings/str_cat.h"
#include "common/utf8.h"
#include "jinja/error.h"
#include "jinja/lexer.h"
#include "jinja/parser.h"
#include "jinja/renderer.h"
#include "nlohmann/json.hpp"

namespace moelora::jinja {

struct Template::Impl {
  std::string name;
  Body body;
  absl::Status Error(const TemplateError& e) const {
    return absl::InvalidArgumentError(
        absl::StrCat(name, e.line > 0 ? absl::StrCat(" line ", e.line) : "", ": ", e.message));
  }
};

Template::Template() : impl_(std::make_unique<Impl>()) {}
Template::~Template() = default;

absl::StatusOr<std::shared_ptr<const Template>> Template::Parse(std::string_view source,
                                                                std::string_view name) {
  std::shared_ptr<Template> t(new Template());
  t->impl_->name = std::string(name);
  size_t bad = 0;
  if (!IsValidUtf8(source, &bad)) {
    return absl::InvalidArgumentError(
        absl::StrCat(std::string(name), ": not valid UTF-8 at byte ", bad));
  }
  try {
    t->impl_->body = ParseTemplate(Lex(std::string(source)));
  } catch (const TemplateError& e) {
    return t->impl_->Error(e);
  }
  return std::shared_ptr<const Template>(std::move(t));
}

absl::StatusOr<std::string> Template::Render(const nlohmann::ordered_json& variables) const {
  if (!variables.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(impl_->name, " variables: not an object"));
  }
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
    return impl_->Error(e);
  }
  return out;
}

}  // namespace moelora::jinja
