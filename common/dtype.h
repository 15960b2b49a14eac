// Scalar conversions between F32 and the 16-bit float formats, and a reader that turns a tensor's
// bytes (any alignment) into floats.
//
// Written by hand: common/ and lora/ must not link libtorch (c10::Half/BFloat16 live there), and
// none of the project's other dependencies offers these conversions. The rules are IEEE 754
// half precision and bfloat16 = the top 16 bits of an f32 with round-to-nearest-even (NaN kept
// quiet), which is what PyTorch does. Thread-safe: pure functions.
#ifndef MOELORA_COMMON_DTYPE_H_
#define MOELORA_COMMON_DTYPE_H_

#include <cstdint>
#include <cstring>
#include <vector>

#include "common/safetensors.h"

namespace moelora {

inline float BF16ToF32(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

inline uint16_t F32ToBF16(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, 4);
  if ((bits & 0x7fffffffu) > 0x7f800000u)
    return static_cast<uint16_t>((bits >> 16) | 0x40u);  // NaN
  bits += 0x7fffu + ((bits >> 16) & 1u);
  return static_cast<uint16_t>(bits >> 16);
}

float F16ToF32(uint16_t h);
uint16_t F32ToF16(float f);

// Element `i` of a compute-dtype (F32/F16/BF16) buffer as float; `data` may be unaligned.
inline float LoadAsF32(DType dtype, const uint8_t* data, int64_t i) {
  switch (dtype) {
    case DType::kF32: {
      float f;
      std::memcpy(&f, data + 4 * i, 4);
      return f;
    }
    case DType::kBF16: {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      return BF16ToF32(h);
    }
    case DType::kF16: {
      uint16_t h;
      std::memcpy(&h, data + 2 * i, 2);
      return F16ToF32(h);
    }
    default:
      return 0.0f;
  }
}

// Stores `value` as element `i` of a compute-dtype buffer.
inline void StoreFromF32(DType dtype, uint8_t* data, int64_t i, float value) {
  switch (dtype) {
    case DType::kF32:
      std::memcpy(data + 4 * i, &value, 4);
      break;
    case DType::kBF16: {
      uint16_t h = F32ToBF16(value);
      std::memcpy(data + 2 * i, &h, 2);
      break;
    }
    case DType::kF16: {
      uint16_t h = F32ToF16(value);
      std::memcpy(data + 2 * i, &h, 2);
      break;
    }
    default:
      break;
  }
}

// All elements of a compute-dtype view as floats.
std::vector<float> ToF32(const TensorView& view);

}  // namespace moelora

#endif  // MOELORA_COMMON_DTYPE_H_
