// The double-precision product y = x · wᵀ that the CPU GEMM kernels' tests (AMX, wide) compare
// against, from exactly the values the kernel reads.
#ifndef MOELORA_TESTS_TESTING_GEMM_REFERENCE_H_
#define MOELORA_TESTS_TESTING_GEMM_REFERENCE_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace moelora::testing {

// One test shape: x [m, k] against w [n, k].
struct GemmCase {
  int64_t m, n, k;
};

// want[i * n + j] = sum over c of x(i, c) · w(j, c), in double. *scale: the largest sum of
// |x(i, c) · w(j, c)| over one output, the size f32 rounding errors scale with.
template <typename X, typename W>
std::vector<double> DoubleXWt(int64_t m, int64_t n, int64_t k, X x, W w, double* scale) {
  std::vector<double> want(m * n);
  *scale = 0;
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double s = 0, a = 0;
      for (int64_t c = 0; c < k; ++c) {
        const double p = static_cast<double>(x(i, c)) * w(j, c);
        s += p;
        a += std::abs(p);
      }
      want[i * n + j] = s;
      *scale = std::max(*scale, a);
    }
  }
  return want;
}

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_TESTING_GEMM_REFERENCE_H_
