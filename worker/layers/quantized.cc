#include "worker/layers/quantized.h"

#include <ATen/Parallel.h>

#include <algorithm>

#include "absl/strings/str_cat.h"

namespace moelora {

absl::Status QuantizedNeedsCpuPath(const std::string& what) {
  return absl::FailedPreconditionError(
      absl::StrCat(what,
                   ": quantized weights are computed on the CPU path only (--device cpu, without "
                   "--lora-kernels fused); this build has no GPU kernel that reads them yet"));
}

QuantMatrix QuantizedWeight::Matrix(int64_t e) const {
  QuantMatrix m;
  m.format = format;
  const bool stacked = codes.dim() == 3;
  m.data = codes.data_ptr<uint8_t>() + (stacked ? e * codes.stride(0) : 0);
  m.row_bytes = codes.stride(-2);
  m.n = n();
  m.k = k();
  m.scale_stride = scales.stride(-2);
  if (format == QuantFormat::kMxfp4) {
    m.e8m0 = scales.data_ptr<uint8_t>() + (stacked ? e * scales.stride(0) : 0);
  } else {
    m.block_scales = scales.data_ptr<float>() + (stacked ? e * scales.stride(0) : 0);
    m.block_n = block_n;
    m.block_k = block_k;
  }
  return m;
}

namespace {

// The weight rows one work item computes: enough items for every thread at decode sizes, and
// items long enough that the tile's dequantization is amortised over the x rows.
constexpr int64_t kRowsPerItem = 64;

}  // namespace

void GroupedQuantizedMatmulWt(const at::Tensor& x, const QuantizedWeight& w,
                              const std::vector<std::pair<int64_t, int64_t>>& runs,
                              const std::vector<int64_t>& expert, at::Tensor& out) {
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  at::Tensor of = out.scalar_type() == at::kFloat ? out : at::empty(out.sizes(), xf.options());
  const int64_t n = w.n(), chunks = (n + kRowsPerItem - 1) / kRowsPerItem;
  const int64_t items = static_cast<int64_t>(runs.size()) * chunks;
  const float* xp = xf.data_ptr<float>();
  float* yp = of.data_ptr<float>();
  at::parallel_for(0, items, 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const auto [b, e] = runs[it / chunks];
      if (e <= b) continue;
      const int64_t c0 = (it % chunks) * kRowsPerItem, c1 = std::min(n, c0 + kRowsPerItem);
      QuantGemmArgs a;
      a.x = xp + b * xf.stride(0);
      a.ldx = xf.stride(0);
      a.m = e - b;
      a.w = w.Matrix(expert[it / chunks]);
      a.y = yp + b * of.stride(0);
      a.ldy = of.stride(0);
      QuantGemmRows(a, c0, c1);
    }
  });
  if (!of.is_same(out)) out.copy_(of);
}

at::Tensor QuantizedMatmulWt(const at::Tensor& x, const QuantizedWeight& w) {
  at::Tensor out = at::empty({x.size(0), w.n()}, x.options());
  GroupedQuantizedMatmulWt(x, w, {{0, x.size(0)}}, {0}, out);
  return out;
}

}  // namespace moelora
