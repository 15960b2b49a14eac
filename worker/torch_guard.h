// The worker's one exception boundary: libtorch reports errors by throwing (c10::Error), the
// rest of the worker by absl::Status. Every libtorch call reachable from an RPC or the loader
// thread runs inside GuardTorch, which turns an exception into a Status: out of memory ->
// RESOURCE_EXHAUSTED, anything else -> INTERNAL, with libtorch's message (its first line: the
// rest is a C++ backtrace).
#ifndef MOELORA_WORKER_TORCH_GUARD_H_
#define MOELORA_WORKER_TORCH_GUARD_H_

#include <c10/util/Exception.h>

#include <new>
#include <string>
#include <type_traits>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/str_cat.h"

namespace moelora {

namespace torch_guard_internal {
inline std::string FirstLine(const char* what) {
  std::string s = what ? what : "";
  const size_t nl = s.find('\n');
  return nl == std::string::npos ? s : s.substr(0, nl);
}
}  // namespace torch_guard_internal

// Runs `f` (returning absl::Status or absl::StatusOr<T>) and converts what it throws. `what`
// names the operation in the message ("forward", "load adapter ...").
template <typename F>
auto GuardTorch(const std::string& what, F&& f) -> decltype(f()) {
  using R = decltype(f());
  static_assert(std::is_same_v<R, absl::Status> || std::is_constructible_v<R, absl::Status>,
                "GuardTorch needs a function returning Status or StatusOr");
  try {
    return f();
  } catch (const c10::OutOfMemoryError& e) {
    return R(absl::ResourceExhaustedError(
        absl::StrCat(what, ": out of memory: ", torch_guard_internal::FirstLine(e.what()))));
  } catch (const std::bad_alloc&) {
    return R(absl::ResourceExhaustedError(absl::StrCat(what, ": out of host memory")));
  } catch (const c10::Error& e) {
    // libtorch builds without the OOM subclass report CUDA allocation failures as plain errors.
    const std::string msg = torch_guard_internal::FirstLine(e.what_without_backtrace());
    // (The CPU allocator says "can't allocate memory", CUDA's "out of memory".)
    if (msg.find("out of memory") != std::string::npos ||
        msg.find("allocate memory") != std::string::npos ||
        msg.find("not enough memory") != std::string::npos) {
      return R(absl::ResourceExhaustedError(absl::StrCat(what, ": ", msg)));
    }
    return R(absl::InternalError(absl::StrCat(what, ": libtorch: ", msg)));
  } catch (const std::exception& e) {
    return R(absl::InternalError(absl::StrCat(what, ": ", e.what())));
  }
}

}  // namespace moelora

#endif  // MOELORA_WORKER_TORCH_GUARD_H_
