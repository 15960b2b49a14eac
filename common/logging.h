// Logging for moelora: glog (Debian's libgoogle-glog-dev), because Abseil 20220623 has no
// absl/log. LOG(INFO)/LOG(WARNING)/LOG(ERROR) for events; MOELORA_CHECK only for programmer
// errors (never for request or file data, which get an absl::Status). Thread-safe.
#ifndef MOELORA_COMMON_LOGGING_H_
#define MOELORA_COMMON_LOGGING_H_

#include <glog/logging.h>

#define MOELORA_CHECK(cond) CHECK(cond)

namespace moelora {

// Initialises glog once per process: logs go to stderr, never to files.
void InitLogging(const char* argv0);

}  // namespace moelora

#endif  // MOELORA_COMMON_LOGGING_H_
