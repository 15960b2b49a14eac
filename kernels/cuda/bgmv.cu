// Dense batched multi-LoRA on the GPU (contract in kernels/bgmv.h): a shrink kernel writes the
// f32 intermediate y [T, R_max], an expand kernel adds B·y into out. Two launches rather than
// one fused kernel: a fused one would recompute the shrink for every block of output columns.
#include "kernels/cuda/launch.h"
#include "kernels/cuda/lora_kernels.cuh"

namespace moelora {
namespace cuda_internal {
namespace {

template <typename T>
cudaError_t Run(const BgmvArgs& a, cudaStream_t stream) {
  const ShrinkProj<T> proj{static_cast<const T*>(a.a_t), a.rank, a.y};
  cudaError_t e =
      LaunchShrink<T>(a.num_tokens, static_cast<const T*>(a.x), a.x_stride, nullptr, 1,
                      a.slot_of_token, &proj, 1, a.max_rank, a.in_dim, a.max_rank, stream);
  if (e != cudaSuccess) return e;
  return LaunchExpand<T, T>(a.num_tokens, a.y, a.max_rank, a.slot_of_token,
                            static_cast<const T*>(a.b_t), a.rank, static_cast<T*>(a.out),
                            a.out_stride, a.out_dim, a.max_rank, stream);
}

}  // namespace

cudaError_t LaunchBgmv(const BgmvArgs& a, cudaStream_t stream) {
  return DispatchElem(a.type, [&](auto tag) { return Run<decltype(tag)>(a, stream); });
}

}  // namespace cuda_internal
}  // namespace moelora
