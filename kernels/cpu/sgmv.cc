#include "kernels/sgmv.h"

namespace moelora {

void SgmvCpu(const SgmvParams& p, const SgmvSegment* segs, int64_t first, int64_t last) {
  float y[kSgmvMaxRank];
  for (int64_t s = first; s < last; ++s) {
    const SgmvSegment& seg = segs[s];
    const int64_t r = seg.rank;
    if (r <= 0) continue;
    for (int64_t i = seg.begin; i < seg.end; ++i) {
      const int64_t row = p.rows ? p.rows[i] : i;
      const float* x = p.x + row * p.x_stride;
      for (int64_t j = 0; j < r; ++j) y[j] = 0.0f;
      // Shrink: y = A x, as a sum of columns of A_t scaled by x[k].
      for (int64_t k = 0; k < p.in_dim; ++k) {
        const float xk = x[k];
        const float* a = seg.a_t + k * p.r_stride;
        for (int64_t j = 0; j < r; ++j) y[j] += a[j] * xk;
      }
      // Expand: out += B y, as a sum of rows of B_t scaled by y[j].
      float* o = p.out + row * p.out_stride;
      for (int64_t j = 0; j < r; ++j) {
        const float yj = y[j];
        const float* b = seg.b_t + j * p.out_dim;
        for (int64_t c = 0; c < p.out_dim; ++c) o[c] += b[c] * yj;
      }
    }
  }
}

}  // namespace moelora
