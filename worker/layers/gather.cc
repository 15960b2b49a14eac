#include "worker/layers/gather.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstring>

namespace moelora {

at::Tensor GatherRows(const at::Tensor& src, const std::vector<int64_t>& rows) {
  const int64_t n = static_cast<int64_t>(rows.size());
  if (!src.device().is_cpu() || !src.is_contiguous() || src.dim() == 0) {
    return src.index_select(
        0, at::from_blob(const_cast<int64_t*>(rows.data()), {n}, at::kLong).to(src.device()));
  }
  std::vector<int64_t> sizes = src.sizes().vec();
  sizes[0] = n;
  at::Tensor out = at::empty(sizes, src.options());
  const int64_t bytes = src.size(0) > 0 ? src.nbytes() / src.size(0) : 0;
  const char* from = static_cast<const char*>(src.data_ptr());
  char* to = static_cast<char*>(out.data_ptr());
  at::parallel_for(0, n, std::max<int64_t>(1, (int64_t{256} << 10) / std::max<int64_t>(bytes, 1)),
                   [&](int64_t i0, int64_t i1) {
                     for (int64_t i = i0; i < i1; ++i) {
                       std::memcpy(to + i * bytes, from + rows[i] * bytes, bytes);
                     }
                   });
  return out;
}

}  // namespace moelora
