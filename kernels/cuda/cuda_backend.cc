// Host side of the CUDA kernels: Status conversion, device checks, host<->device helpers, NCCL.
#include <cuda_runtime.h>
#include <nccl.h>

#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/lora_shrink.h"

namespace moelora {

cudaError_t LaunchLoraShrinkF32(const float* x, const float* lora_a, const int32_t* rank,
                                const int32_t* slot_of_token, float* y, int64_t num_tokens,
                                int64_t h_in, int64_t max_rank, cudaStream_t stream);

namespace {

absl::Status CudaStatus(cudaError_t e, const char* what) {
  if (e == cudaSuccess) return absl::OkStatus();
  return absl::InternalError(absl::StrCat(what, ": ", cudaGetErrorString(e)));
}

#define MOELORA_RETURN_IF_CUDA_ERROR(expr, what)                 \
  do {                                                           \
    if (auto s_ = CudaStatus((expr), what); !s_.ok()) return s_; \
  } while (false)

// Device memory released on scope exit.
struct DeviceBuffer {
  void* ptr = nullptr;
  ~DeviceBuffer() {
    if (ptr) cudaFree(ptr);
  }
};

}  // namespace

bool CudaDeviceAvailable() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
}

absl::Status LoraShrinkCuda(const LoraShrinkParams& p, void* stream) {
  if (auto s = p.Validate(); !s.ok()) return s;
  return CudaStatus(LaunchLoraShrinkF32(p.x, p.lora_a, p.rank, p.slot_of_token, p.y, p.num_tokens,
                                        p.h_in, p.max_rank, static_cast<cudaStream_t>(stream)),
                    "LoraShrinkKernel launch");
}

absl::Status LoraShrinkCudaFromHost(const LoraShrinkParams& p) {
  if (auto s = p.Validate(); !s.ok()) return s;
  DeviceBuffer x, a, rank, slot, y;
  const size_t xb = p.num_tokens * p.h_in * sizeof(float);
  const size_t ab = p.num_slots * p.max_rank * p.h_in * sizeof(float);
  const size_t yb = p.num_tokens * p.max_rank * sizeof(float);
  MOELORA_RETURN_IF_CUDA_ERROR(cudaMalloc(&x.ptr, xb), "cudaMalloc x");
  MOELORA_RETURN_IF_CUDA_ERROR(cudaMalloc(&a.ptr, ab), "cudaMalloc lora_a");
  MOELORA_RETURN_IF_CUDA_ERROR(cudaMalloc(&rank.ptr, p.num_slots * sizeof(int32_t)),
                               "cudaMalloc rank");
  MOELORA_RETURN_IF_CUDA_ERROR(cudaMalloc(&slot.ptr, p.num_tokens * sizeof(int32_t)),
                               "cudaMalloc slot");
  MOELORA_RETURN_IF_CUDA_ERROR(cudaMalloc(&y.ptr, yb), "cudaMalloc y");
  MOELORA_RETURN_IF_CUDA_ERROR(cudaMemcpy(x.ptr, p.x, xb, cudaMemcpyHostToDevice), "copy x");
  MOELORA_RETURN_IF_CUDA_ERROR(cudaMemcpy(a.ptr, p.lora_a, ab, cudaMemcpyHostToDevice),
                               "copy lora_a");
  MOELORA_RETURN_IF_CUDA_ERROR(
      cudaMemcpy(rank.ptr, p.rank, p.num_slots * sizeof(int32_t), cudaMemcpyHostToDevice),
      "copy rank");
  MOELORA_RETURN_IF_CUDA_ERROR(
      cudaMemcpy(slot.ptr, p.slot_of_token, p.num_tokens * sizeof(int32_t), cudaMemcpyHostToDevice),
      "copy slots");
  LoraShrinkParams d = p;
  d.x = static_cast<const float*>(x.ptr);
  d.lora_a = static_cast<const float*>(a.ptr);
  d.rank = static_cast<const int32_t*>(rank.ptr);
  d.slot_of_token = static_cast<const int32_t*>(slot.ptr);
  d.y = static_cast<float*>(y.ptr);
  if (auto s = LoraShrinkCuda(d, nullptr); !s.ok()) return s;
  MOELORA_RETURN_IF_CUDA_ERROR(cudaDeviceSynchronize(), "LoraShrinkKernel");
  MOELORA_RETURN_IF_CUDA_ERROR(cudaMemcpy(p.y, y.ptr, yb, cudaMemcpyDeviceToHost), "copy y");
  return absl::OkStatus();
}

int NcclVersionCode() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

}  // namespace moelora
