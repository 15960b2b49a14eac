// Status propagation macros. Abseil 20220623 (Debian 12) has no status_macros.h, so these
// mirror the shape of the later ABSL_RETURN_IF_ERROR / ABSL_ASSIGN_OR_RETURN; switching to
// Abseil's is a rename. Thread-safe: macros only.
#ifndef MOELORA_COMMON_STATUS_MACROS_H_
#define MOELORA_COMMON_STATUS_MACROS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

#define MOELORA_CONCAT_IMPL_(a, b) a##b
#define MOELORA_CONCAT_(a, b) MOELORA_CONCAT_IMPL_(a, b)

// Returns from the enclosing function when `expr` (an absl::Status) is not OK.
#define MOELORA_RETURN_IF_ERROR(expr)                                     \
  do {                                                                    \
    if (::absl::Status moelora_status_ = (expr); !moelora_status_.ok()) { \
      return moelora_status_;                                             \
    }                                                                     \
  } while (false)

// `lhs = value of rexpr` (an absl::StatusOr<T>), or returns its status.
#define MOELORA_ASSIGN_OR_RETURN(lhs, rexpr) \
  MOELORA_ASSIGN_OR_RETURN_IMPL_(MOELORA_CONCAT_(moelora_statusor_, __LINE__), lhs, rexpr)
#define MOELORA_ASSIGN_OR_RETURN_IMPL_(tmp, lhs, rexpr) \
  auto tmp = (rexpr);                                   \
  if (!tmp.ok()) return tmp.status();                   \
  lhs = std::move(tmp).value()

namespace moelora {

// Prefixes `status`'s message with `context` ("context: message"), keeping its code.
[[nodiscard]] inline absl::Status Annotate(const absl::Status& status, absl::string_view context) {
  if (status.ok()) return status;
  return absl::Status(status.code(), std::string(context) + ": " + std::string(status.message()));
}

}  // namespace moelora

#endif  // MOELORA_COMMON_STATUS_MACROS_H_
