// Rotary: cos/sin tables (plain and M-RoPE) and their application.
#include "worker/layers/rotary.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "kernels/elementwise.h"
#include "worker/layers/gather.h"

namespace moelora {

Rotary::Rotary(const RopeSpec& spec, const at::Device& device)
    : rotary_dim_(spec.rotary_dim()),
      head_dim_(spec.head_dim),
      mrope_section_(spec.mrope_section),
      device_(device) {
  const std::vector<double> inv = RopeInvFreq(spec, &scaling_);
  std::vector<float> f(inv.begin(), inv.end());
  inv_freq_ =
      at::from_blob(f.data(), {static_cast<int64_t>(f.size())}, at::kFloat).clone().to(device);
}

Rotary::Table Rotary::ComputeRows(const at::Tensor& pos, at::ScalarType dtype) const {
  at::Tensor freqs = pos.unsqueeze(1) * inv_freq_.unsqueeze(0);  // [T, rd/2]
  at::Tensor emb = at::cat({freqs, freqs}, -1);
  at::Tensor c = emb.cos(), s = emb.sin();
  if (scaling_ != 1.0) {
    c = c * scaling_;
    s = s * scaling_;
  }
  return {c.to(dtype).contiguous(), s.to(dtype).contiguous()};
}

Rotary::Table Rotary::Compute(const std::vector<int64_t>& positions, at::ScalarType dtype) const {
  const int64_t T = static_cast<int64_t>(positions.size());
  if (!device_.is_cpu() || T == 0) {
    at::Tensor pos = at::from_blob(const_cast<int64_t*>(positions.data()), {T}, at::kLong)
                         .to(at::kFloat)
                         .to(device_);
    return ComputeRows(pos, dtype);
  }
  // The CPU: rows of a table of every position so far (grown by doubling), copied out. Each
  // element is the same elementwise computation of its position either way.
  const int64_t need = *std::max_element(positions.begin(), positions.end()) + 1;
  CpuTable& t = *cpu_table_;
  std::lock_guard<std::mutex> lock(t.mu);
  if (t.rows < need || t.dtype != dtype || !t.cos.defined()) {
    const int64_t rows = std::max<int64_t>({need, 2 * (t.dtype == dtype ? t.rows : 0), 256});
    Table all = ComputeRows(at::arange(rows, at::TensorOptions().dtype(at::kFloat)), dtype);
    t.cos = all.cos;
    t.sin = all.sin;
    t.rows = rows;
    t.dtype = dtype;
  }
  return {GatherRows(t.cos, positions), GatherRows(t.sin, positions)};
}

Rotary::Table Rotary::ComputeMrope(const std::vector<int64_t>& positions,
                                   at::ScalarType dtype) const {
  const int64_t T = static_cast<int64_t>(positions.size()) / 3;
  auto row = [&](int r) {
    return std::vector<int64_t>(positions.begin() + r * T, positions.begin() + (r + 1) * T);
  };
  const std::vector<int64_t> t = row(0), h = row(1), w = row(2);
  Table out = Compute(t, dtype);
  if (mrope_section_.empty() || (t == h && t == w)) return out;
  // Each element is cos / sin of its own stream's position times the frequency: the rows of the
  // height and width tables are taken where the layout gives those streams the frequency.
  const Table th = Compute(h, dtype), tw = Compute(w, dtype);
  const int64_t half = rotary_dim_ / 2;
  std::vector<int64_t> hcols, wcols;
  for (int64_t c = 0; c < rotary_dim_; ++c) {
    const int64_t j = c % half;
    if (j % 3 == 1 && j < 3 * mrope_section_[1]) hcols.push_back(c);
    if (j % 3 == 2 && j < 3 * mrope_section_[2]) wcols.push_back(c);
  }
  auto take = [&](at::Tensor& dst, const at::Tensor& src, const std::vector<int64_t>& cols) {
    if (cols.empty()) return;
    const at::Tensor idx = at::from_blob(const_cast<int64_t*>(cols.data()),
                                         {static_cast<int64_t>(cols.size())}, at::kLong)
                               .to(dst.device());
    dst.index_copy_(1, idx, src.index_select(1, idx));
  };
  take(out.cos, th.cos, hcols);
  take(out.sin, th.sin, hcols);
  take(out.cos, tw.cos, wcols);
  take(out.sin, tw.sin, wcols);
  return out;
}

namespace {

at::Tensor RotateHalf(const at::Tensor& x) {
  const int64_t h = x.size(-1) / 2;
  return at::cat({-x.narrow(-1, h, h), x.narrow(-1, 0, h)}, -1);
}

}  // namespace

namespace {
// Rotary::Apply on the CPU with the roundings of its ATen form (x·c and rotate_half(x)·s each
// rounded to T, then their sum), a token (all its heads) per row: x [T, heads, hd], cos/sin
// [T, rd].
template <typename T>
void RotaryRows(const T* x, const T* cs, const T* sn, T* out, int64_t tokens, int64_t heads,
                int64_t hd, int64_t rd) {
  constexpr bool kBf16 = std::is_same_v<T, at::BFloat16>;
  const int64_t row = heads * hd;
  at::parallel_for(0, tokens, ElementwiseGrain(row), [&](int64_t t0, int64_t t1) {
    std::vector<float> f(kBf16 ? row + 2 * rd : 0), o32(rd);
    for (int64_t t = t0; t < t1; ++t) {
      const float *xr, *c, *s;
      if constexpr (kBf16) {
        WidenBf16(reinterpret_cast<const uint16_t*>(x + t * row), f.data(), row);
        WidenBf16(reinterpret_cast<const uint16_t*>(cs + t * rd), f.data() + row, rd);
        WidenBf16(reinterpret_cast<const uint16_t*>(sn + t * rd), f.data() + row + rd, rd);
        xr = f.data();
        c = f.data() + row;
        s = c + rd;
      } else {
        xr = x + t * row;
        c = cs + t * rd;
        s = sn + t * rd;
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* o = out + t * row + h * hd;
        if constexpr (kBf16) {
          RotaryRow(xr + h * hd, c, s, o32.data(), rd, true);
          RoundToBf16(o32.data(), reinterpret_cast<uint16_t*>(o), rd);
        } else {
          RotaryRow(xr + h * hd, c, s, o, rd, false);
        }
        for (int64_t i = rd; i < hd; ++i) o[i] = x[t * row + h * hd + i];
      }
    }
  });
}
}  // namespace

at::Tensor Rotary::Apply(const at::Tensor& x, const Table& t) const {
  const at::ScalarType st = x.scalar_type();
  if (x.device().is_cpu() && x.dim() == 3 && x.is_contiguous() && t.cos.is_contiguous() &&
      t.sin.is_contiguous() && (st == at::kFloat || st == at::kBFloat16) &&
      t.cos.scalar_type() == st && t.sin.scalar_type() == st && t.cos.size(0) == x.size(0) &&
      t.cos.size(1) == rotary_dim_ && rotary_dim_ <= x.size(2) && rotary_dim_ % 2 == 0) {
    // By hand: the ATen form is 6–8 ops on q and on k per layer.
    at::Tensor out = at::empty_like(x);
    if (st == at::kFloat) {
      RotaryRows(x.data_ptr<float>(), t.cos.data_ptr<float>(), t.sin.data_ptr<float>(),
                 out.data_ptr<float>(), x.size(0), x.size(1), x.size(2), rotary_dim_);
    } else {
      RotaryRows(x.data_ptr<at::BFloat16>(), t.cos.data_ptr<at::BFloat16>(),
                 t.sin.data_ptr<at::BFloat16>(), out.data_ptr<at::BFloat16>(), x.size(0), x.size(1),
                 x.size(2), rotary_dim_);
    }
    return out;
  }
  at::Tensor c = t.cos.unsqueeze(1), s = t.sin.unsqueeze(1);  // [T, 1, rd]
  if (rotary_dim_ == x.size(-1)) return x * c + RotateHalf(x) * s;
  at::Tensor rot = x.narrow(-1, 0, rotary_dim_);
  at::Tensor pass = x.narrow(-1, rotary_dim_, x.size(-1) - rotary_dim_);
  return at::cat({rot * c + RotateHalf(rot) * s, pass}, -1);
}

}  // namespace moelora
