// Errors inside the Jinja engine are thrown (parsing and evaluation are deeply recursive) and
// stop at Template::Parse / Render, which turn them into a Status. Internal to jinja/.
#ifndef MOELORA_JINJA_ERROR_H_
#define MOELORA_JINJA_ERROR_H_

#include <string>
#include <utility>

#include "absl/strings/str_cat.h"

namespace moelora::jinja {

struct TemplateError {
  std::string message;
  int line = 0;
};

[[noreturn]] inline void Fail(std::string message, int line = 0) {
  throw TemplateError{std::move(message), line};
}

// Bounds the recursion of parsing and rendering (nested expressions, blocks, macro calls), so
// that a template can fail but never exhaust the stack.
class DepthGuard {
 public:
  static constexpr int kMax = 200;
  DepthGuard(int* depth, int line) : depth_(depth) {
    if (++*depth_ > kMax) {
      --*depth_;
      Fail(absl::StrCat("nested deeper than ", kMax, " levels"), line);
    }
  }
  ~DepthGuard() { --*depth_; }
  DepthGuard(const DepthGuard&) = delete;
  DepthGuard& operator=(const DepthGuard&) = delete;

 private:
  int* depth_;
};

}  // namespace moelora::jinja

#endif  // MOELORA_JINJA_ERROR_H_
