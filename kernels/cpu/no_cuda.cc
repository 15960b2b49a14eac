// The CUDA entry points of a build without CUDA (MOELORA_ENABLE_CUDA=OFF): no device, every
// device operation UNIMPLEMENTED.
#include "kernels/bgmv.h"
#include "kernels/device.h"
#include "kernels/moe_lora.h"
#include "kernels/paged_attention.h"
#include "kernels/quant_gemm.h"

namespace moelora {

namespace {
[[nodiscard]] absl::Status NoCuda() {
  return absl::UnimplementedError("built without CUDA (configure with -DMOELORA_ENABLE_CUDA=ON)");
}
}  // namespace

bool CudaDeviceAvailable() { return false; }
int CudaDeviceCount() { return 0; }
std::string CudaDeviceSummary() { return "built without CUDA"; }
int NcclVersionCode() { return 0; }
[[nodiscard]] absl::Status CudaSetDevice(int) { return NoCuda(); }
[[nodiscard]] absl::Status DeviceSynchronize() { return NoCuda(); }

absl::Status device_internal::DeviceMemory::Alloc(void**, size_t) { return NoCuda(); }
void device_internal::DeviceMemory::Free(void*) {}
absl::Status device_internal::PinnedMemory::Alloc(void**, size_t) { return NoCuda(); }
void device_internal::PinnedMemory::Free(void*) {}
[[nodiscard]] absl::Status CopyToDevice(void*, const void*, size_t) { return NoCuda(); }
[[nodiscard]] absl::Status CopyToHost(void*, const void*, size_t) { return NoCuda(); }
[[nodiscard]] absl::Status CopyOnDevice(void*, const void*, size_t) { return NoCuda(); }
absl::StatusOr<std::unique_ptr<PinnedUploader>> PinnedUploader::Create(size_t, int) {
  return NoCuda();
}
absl::StatusOr<std::unique_ptr<DeviceTimer>> DeviceTimer::Create() { return NoCuda(); }

[[nodiscard]] absl::Status BgmvCuda(const BgmvParams&, void*) { return NoCuda(); }
[[nodiscard]] absl::Status MoeLoraCuda(const MoeLoraParams&, void*) { return NoCuda(); }
[[nodiscard]] absl::Status PagedAttentionCuda(const PagedAttentionBatch&, void*) {
  return NoCuda();
}
[[nodiscard]] absl::Status QuantGemmCuda(const QuantGemmArgs&, void*) { return NoCuda(); }

}  // namespace moelora
