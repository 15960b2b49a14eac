// cudaError_t -> absl::Status for the host code in kernels/cuda/. Internal to kernels/.
#ifndef MOELORA_KERNELS_CUDA_STATUS_H_
#define MOELORA_KERNELS_CUDA_STATUS_H_

#include <cuda_runtime.h>

#include "absl/status/status.h"
#include "absl/strings/str_cat.h"

namespace moelora {
namespace cuda_internal {

[[nodiscard]] inline absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(
      absl::StrCat(what, ": ", cudaGetErrorName(e), " (", cudaGetErrorString(e), ")"));
}

}  // namespace cuda_internal
}  // namespace moelora

#endif  // MOELORA_KERNELS_CUDA_STATUS_H_
