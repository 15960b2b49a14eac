// gMock matchers for absl::Status / StatusOr, which Abseil 20220623 does not ship.
#ifndef MOELORA_TESTS_TESTING_STATUS_MATCHERS_H_
#define MOELORA_TESTS_TESTING_STATUS_MATCHERS_H_

#include <gmock/gmock.h>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moelora::testing {

inline const absl::Status& GetStatus(const absl::Status& s) { return s; }
template <typename T>
const absl::Status& GetStatus(const absl::StatusOr<T>& s) {
  return s.status();
}

MATCHER(IsOk, "is OK") {
  const auto& s = GetStatus(arg);
  if (!s.ok()) *result_listener << "status is " << s.ToString();
  return s.ok();
}

// StatusIs(code) and StatusIs(code, message_matcher).
MATCHER_P(StatusIs, code, "has code " + absl::StatusCodeToString(code)) {
  const auto& s = GetStatus(arg);
  *result_listener << "status is " << s.ToString();
  return s.code() == code;
}

MATCHER_P2(StatusIs, code, message_matcher, "has code " + absl::StatusCodeToString(code)) {
  const auto& s = GetStatus(arg);
  *result_listener << "status is " << s.ToString();
  return s.code() == code &&
         ::testing::ExplainMatchResult(message_matcher, std::string(s.message()), result_listener);
}

}  // namespace moelora::testing

#define ASSERT_OK(expr) ASSERT_THAT((expr), ::moelora::testing::IsOk())
#define EXPECT_OK(expr) EXPECT_THAT((expr), ::moelora::testing::IsOk())

#endif  // MOELORA_TESTS_TESTING_STATUS_MATCHERS_H_
