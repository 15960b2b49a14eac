// libFuzzer harness: arbitrary bytes through the safetensors reader. Any input must produce an
// OK file or an INVALID_ARGUMENT, never a crash, hang or sanitizer report; for OK files every
// view must lie inside the buffer.
#include <cstddef>
#include <cstdint>
#include <cstdlib>

#include "common/safetensors.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  auto f = moelora::SafetensorsFile::FromBuffer(absl::MakeConstSpan(data, size), "fuzz");
  if (!f.ok()) {
    if (f.status().code() != absl::StatusCode::kInvalidArgument) std::abort();
    return 0;
  }
  size_t sum = 0;
  for (const auto& t : (*f)->tensors()) {
    if (t.data < data || t.data + t.nbytes > data + size) std::abort();
    sum += t.nbytes;
    volatile uint8_t touch = t.nbytes ? t.data[t.nbytes - 1] : 0;
    (void)touch;
  }
  if (sum != (*f)->data_bytes()) std::abort();
  return 0;
}
