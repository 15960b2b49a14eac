// Random tensors in a compute dtype for the kernel tests (CPU twins and GPU): bytes plus the
// float values they hold, so references can be computed from exactly what the kernel reads.
#ifndef MOELORA_TESTS_TESTING_KERNEL_DATA_H_
#define MOELORA_TESTS_TESTING_KERNEL_DATA_H_

#include <cmath>
#include <cstdint>
#include <random>
#include <vector>

#include "common/dtype.h"

namespace moelora::testing {

inline size_t DTypeBytes(DType d) { return d == DType::kF32 ? 4 : 2; }

struct DTensor {
  DType dtype = DType::kF32;
  std::vector<uint8_t> bytes;
  int64_t numel() const { return static_cast<int64_t>(bytes.size() / DTypeBytes(dtype)); }
  float at(int64_t i) const { return LoadAsF32(dtype, bytes.data(), i); }
  void set(int64_t i, float v) { StoreFromF32(dtype, bytes.data(), i, v); }
  std::vector<float> floats() const {
    std::vector<float> f(numel());
    for (int64_t i = 0; i < numel(); ++i) f[i] = at(i);
    return f;
  }
};

inline DTensor Zeros(DType d, int64_t n) {
  DTensor t;
  t.dtype = d;
  t.bytes.assign(n * DTypeBytes(d), 0);
  return t;
}

inline DTensor Random(DType d, int64_t n, std::mt19937& rng, float scale = 1.0f) {
  DTensor t = Zeros(d, n);
  std::normal_distribution<float> dist(0.0f, scale);
  for (int64_t i = 0; i < n; ++i) t.set(i, dist(rng));
  return t;
}

// ||a - b|| / max(||b||, tiny).
inline double RelErr(const std::vector<float>& a, const std::vector<float>& b) {
  double num = 0, den = 0;
  for (size_t i = 0; i < a.size() && i < b.size(); ++i) {
    num += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    den += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(num / std::max(den, 1e-30));
}

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_TESTING_KERNEL_DATA_H_
