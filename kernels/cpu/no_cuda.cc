// The CUDA entry points of a build without CUDA (MOELORA_ENABLE_CUDA=OFF).
#include "kernels/lora_shrink.h"

namespace moelora {

bool CudaDeviceAvailable() { return false; }
absl::Status LoraShrinkCuda(const LoraShrinkParams&, void*) {
  return absl::UnimplementedError("built without CUDA (configure with -DMOELORA_ENABLE_CUDA=ON)");
}
absl::Status LoraShrinkCudaFromHost(const LoraShrinkParams& p) {
  return LoraShrinkCuda(p, nullptr);
}
int NcclVersionCode() { return 0; }

}  // namespace moelora
