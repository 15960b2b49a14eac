#include "common/logging.h"

#include <mutex>

namespace moelora {

void InitLogging(const char* argv0) {
  static std::once_flag once;
  std::call_once(once, [argv0] {
    FLAGS_logtostderr = true;
    google::InitGoogleLogging(argv0);
  });
}

}  // namespace moelora
