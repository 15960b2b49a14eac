// The double-precision product y = x · wᵀ that the CPU GEMM kernels' tests (AMX, wide) compare
// against, from exactly the values the kernel reads.
#ifndef MOELORA_TESTS_TESTING_GEMM_REFERENCE_H_
#define MOELORA_TESTS_TESTING_GEMM_REFERENCE_H_

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "tests/testing/bf16.h"

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

// A kernel's output y [m, ldy] (filled with -7 before the call) against want [m, n]: each of the
// n columns within tol(want value), the columns past n still -7. got(i, j): y's element as a
// double (widened from bf16 where the kernel wrote bf16).
template <typename Got, typename Tol>
void ExpectOutput(int64_t m, int64_t n, int64_t ldy, const std::vector<double>& want, Got got,
                  Tol tol) {
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < ldy; ++j) {
      const double g = got(i, j);
      if (j >= n) {
        ASSERT_EQ(g, -7.0) << "wrote past column n at row " << i;
        continue;
      }
      ASSERT_NEAR(g, want[i * n + j], tol(want[i * n + j])) << "y[" << i << "][" << j << "]";
    }
  }
}

// A bf16 kernel (args A: AmxGemmArgs or WideBf16GemmArgs, which share x_packed, w, y, y_bf16,
// ldy, m, n, k) run twice through run(a): into f32 rows, then into bf16 rows (both ldy apart and
// prefilled with -7), each checked against want: within 1e-6·scale, and bf16 also within its
// own rounding. `a` carries any other fields (next_w).
template <typename A, typename Run>
void ExpectBf16Kernel(A a, const uint16_t* x_packed, const uint16_t* w, int64_t m, int64_t n,
                      int64_t k, int64_t ldy, const std::vector<double>& want, double scale,
                      Run run) {
  for (bool bf16_out : {false, true}) {
    SCOPED_TRACE(bf16_out ? "bf16 y" : "f32 y");
    std::vector<float> y(m * ldy, -7.0f);
    std::vector<uint16_t> yb(m * ldy, ToBf16(-7.0f));
    a.x_packed = x_packed;
    a.w = w;
    a.y = bf16_out ? nullptr : y.data();
    a.y_bf16 = bf16_out ? yb.data() : nullptr;
    a.ldy = ldy;
    a.m = m;
    a.n = n;
    a.k = k;
    run(a);
    ExpectOutput(
        m, n, ldy, want,
        [&](int64_t i, int64_t j) {
          return bf16_out ? FromBf16(yb[i * ldy + j]) : static_cast<double>(y[i * ldy + j]);
        },
        [&](double v) { return bf16_out ? std::abs(v) / 128 + 1e-6 * scale : 1e-6 * scale; });
  }
}

}  // namespace moelora::testing

#endif  // MOELORA_TESTS_TESTING_GEMM_REFERENCE_H_
