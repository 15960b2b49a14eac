// Skipping GPU tests without a device, except where a device is required.
//
// gpu_check.sh exports MOELORA_REQUIRE_CUDA=1: on a machine that is meant to have a working GPU
// a test that would skip (CUDA did not come up: driver/runtime mismatch, libtorch_cuda not
// loaded, a bundled library shadowing cudart) fails instead, so a run that proved nothing
// cannot read as a pass.
#ifndef MOELORA_TESTS_TESTING_REQUIRE_DEVICE_H_
#define MOELORA_TESTS_TESTING_REQUIRE_DEVICE_H_

#include <gtest/gtest.h>

#include <cstdlib>
#include <cstring>

namespace moelora::testing {

inline bool CudaRequired() {
  const char* v = std::getenv("MOELORA_REQUIRE_CUDA");
  return v != nullptr && std::strcmp(v, "") != 0 && std::strcmp(v, "0") != 0;
}

}  // namespace moelora::testing

// Skips the test (fails it under MOELORA_REQUIRE_CUDA=1) unless `available`; `why` is streamed
// into the message. Use in a TEST body (it returns from it).
#define MOELORA_SKIP_UNLESS_DEVICE(available, why)                 \
  do {                                                             \
    if (!(available)) {                                            \
      if (::moelora::testing::CudaRequired()) {                    \
        GTEST_FAIL() << "MOELORA_REQUIRE_CUDA is set but " << why; \
      }                                                            \
      GTEST_SKIP() << why;                                         \
    }                                                              \
  } while (false)

#endif  // MOELORA_TESTS_TESTING_REQUIRE_DEVICE_H_
