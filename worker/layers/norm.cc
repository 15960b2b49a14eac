// RmsNorm, AddRmsNorm and ResidualStream.
#include "worker/layers/norm.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/elementwise.h"

namespace moelora {

NormForm FormOf(NormKind kind) {
  return kind == NormKind::kPlain         ? NormForm::kPlain
         : kind == NormKind::kZeroCentred ? NormForm::kZeroCentred
                                          : NormForm::kF32Weight;
}

// A contiguous f32 or bf16 norm weight's values in f32: an f32 weight as it is, a bf16 one widened
// into `buf` (w.to(at::kFloat) was an ATen op and an allocation per norm, 4 per layer of a bf16
// step).
const float* NormWeightF32(const at::Tensor& w, std::vector<float>& buf) {
  if (w.scalar_type() != at::kBFloat16) return w.data_ptr<float>();
  buf.resize(w.numel());
  WidenBf16(reinterpret_cast<const uint16_t*>(w.data_ptr<at::BFloat16>()), buf.data(), buf.size());
  return buf.data();
}

namespace {

// RmsNorm rows on the CPU: the operations and roundings of the ATen expression in RmsNorm below,
// element by element (kernels/elementwise.h, RmsNormRow), in f32 rows (bf16 widened and rounded
// 16 at a time). The sum of squares runs in another order than ATen's mean. With `delta`, each
// row of x is first replaced by x + delta, rounded to T (ATen's add), and that sum written to
// `sum` too.
template <typename T>
void RmsNormRows(const T* x, const T* delta, const at::Tensor& w, T* sum, T* out, int64_t rows,
                 int64_t n, float eps, NormKind kind) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  // NormByHand has checked that w is contiguous and of x's dtype.
  std::vector<float> widened;
  const float* wp = NormWeightF32(w, widened);
  const NormForm form = FormOf(kind);
  auto u16 = [](const T* p) { return reinterpret_cast<const uint16_t*>(p); };
  at::parallel_for(0, rows, ElementwiseGrain(n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      if constexpr (kBf16) {
        auto* s = sum != nullptr ? reinterpret_cast<uint16_t*>(sum + r * n) : nullptr;
        RmsNormRowBf16(u16(x + r * n), delta != nullptr ? u16(delta + r * n) : nullptr, wp, s,
                       reinterpret_cast<uint16_t*>(out + r * n), n, eps, form);
      } else {
        const float* xr = x + r * n;
        if (delta != nullptr) {
          AddRows(x + r * n, delta + r * n, sum + r * n, n, false);
          xr = sum + r * n;
        }
        RmsNormRow(xr, wp, out + r * n, n, eps, form, false);
      }
    }
  });
}

bool NormByHand(const at::Tensor& x, const at::Tensor& w) {
  const at::ScalarType t = x.scalar_type();
  return x.device().is_cpu() && x.is_contiguous() && w.is_contiguous() && x.dim() >= 1 &&
         w.dim() == 1 && w.size(0) == x.size(-1) && x.numel() > 0 &&
         (t == at::kFloat || t == at::kBFloat16) && w.scalar_type() == t;
}

}  // namespace

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& w, double eps, NormKind kind) {
  if (NormByHand(x, w)) {
    // By hand: the ATen form below is 7–9 ops per call (2 per layer, 2 more with q/k norms),
    // each a pass over the rows; this is one.
    const int64_t n = x.size(-1), rows = x.numel() / n;
    at::Tensor out = at::empty_like(x);
    const float e = static_cast<float>(eps);
    if (x.scalar_type() == at::kFloat) {
      RmsNormRows<float>(x.data_ptr<float>(), nullptr, w, nullptr, out.data_ptr<float>(), rows, n,
                         e, kind);
    } else {
      RmsNormRows<at::BFloat16>(x.data_ptr<at::BFloat16>(), nullptr, w, nullptr,
                                out.data_ptr<at::BFloat16>(), rows, n, e, kind);
    }
    return out;
  }
  at::Tensor xf = x.to(at::kFloat);
  at::Tensor var = xf.pow(2).mean(-1, /*keepdim=*/true);
  xf = xf * at::rsqrt(var + eps);
  if (kind == NormKind::kZeroCentred) return (xf * (1.0 + w.to(at::kFloat))).to(x.scalar_type());
  if (kind == NormKind::kPlainF32Weight) return (w.to(at::kFloat) * xf).to(x.scalar_type());
  return w * xf.to(x.scalar_type());
}

AddNormed AddRmsNorm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps,
                     NormKind kind) {
  if (!NormByHand(x, w) || !delta.is_contiguous() || delta.sizes() != x.sizes() ||
      delta.scalar_type() != x.scalar_type() || !delta.device().is_cpu()) {
    at::Tensor sum = x + delta;
    return {sum, RmsNorm(sum, w, eps, kind)};
  }
  // One pass where x + delta and RmsNorm were two ops (a bf16 decode step at batch 32 spent
  // about 23 µs on each ATen add of [32, 1024]).
  const int64_t n = x.size(-1), rows = x.numel() / n;
  AddNormed r{at::empty_like(x), at::empty_like(x)};
  const float e = static_cast<float>(eps);
  if (x.scalar_type() == at::kFloat) {
    RmsNormRows<float>(x.data_ptr<float>(), delta.data_ptr<float>(), w, r.sum.data_ptr<float>(),
                       r.normed.data_ptr<float>(), rows, n, e, kind);
  } else {
    RmsNormRows<at::BFloat16>(x.data_ptr<at::BFloat16>(), delta.data_ptr<at::BFloat16>(), w,
                              r.sum.data_ptr<at::BFloat16>(), r.normed.data_ptr<at::BFloat16>(),
                              rows, n, e, kind);
  }
  return r;
}

at::Tensor ResidualStream::Norm(const at::Tensor& w, double eps, NormKind kind) {
  if (!pending_.defined()) return RmsNorm(x_, w, eps, kind);
  AddNormed r = AddRmsNorm(x_, pending_, w, eps, kind);
  x_ = std::move(r.sum);
  pending_ = at::Tensor();
  return r.normed;
}

const at::Tensor& ResidualStream::Sum() {
  if (pending_.defined()) {
    x_ = x_ + pending_;
    pending_ = at::Tensor();
  }
  return x_;
}

}  // namespace moelora
