// bf16 <-> f32 for kernel tests: rounding to nearest even one way, exact widening the other.
#ifndef MOELORA_TESTS_TESTING_BF16_H_
#define MOELORA_TESTS_TESTING_BF16_H_

#include <cstdint>
#include <cstring>

namespace moelora::testing {

inline uint16_t ToBf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<uint16_t>((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}

inline float FromBf16(uint16_t h) {
  const uint32_t u = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_TESTING_BF16_H_
