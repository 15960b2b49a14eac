// kernels/device.h over the CUDA runtime, and NCCL's version.
#include "kernels/device.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <cstring>
#include <thread>
#include <vector>

#include "absl/strings/str_cat.h"
#include "kernels/cuda/status.h"
#include "kernels/internal/parallel_copy.h"

namespace moelora {

using cuda_internal::CudaStatus;

bool CudaDeviceAvailable() { return CudaDeviceCount() > 0; }

int CudaDeviceCount() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}

std::string CudaDeviceSummary() {
  int n = 0;
  if (cudaError_t e = cudaGetDeviceCount(&n); e != cudaSuccess) {
    return absl::StrCat("no CUDA device (", cudaGetErrorString(e), ")");
  }
  if (n == 0) return "no CUDA device";
  cudaDeviceProp prop;
  if (cudaGetDeviceProperties(&prop, 0) != cudaSuccess) return "CUDA device 0: no properties";
  return absl::StrCat(n, " x ", prop.name, ", sm_", prop.major, prop.minor, ", ",
                      prop.totalGlobalMem >> 30, " GiB");
}

int NcclVersionCode() {
  int v = 0;
  return ncclGetVersion(&v) == ncclSuccess ? v : 0;
}

[[nodiscard]] absl::Status CudaSetDevice(int device) {
  return CudaStatus(cudaSetDevice(device), absl::StrCat("cudaSetDevice(", device, ")").c_str());
}

[[nodiscard]] absl::Status DeviceSynchronize() {
  return CudaStatus(cudaDeviceSynchronize(), "cudaDeviceSynchronize");
}

namespace device_internal {

absl::Status DeviceMemory::Alloc(void** ptr, size_t bytes) {
  return CudaStatus(cudaMalloc(ptr, bytes), absl::StrCat("cudaMalloc(", bytes, ")").c_str());
}
void DeviceMemory::Free(void* ptr) { cudaFree(ptr); }

absl::Status PinnedMemory::Alloc(void** ptr, size_t bytes) {
  return CudaStatus(cudaMallocHost(ptr, bytes),
                    absl::StrCat("cudaMallocHost(", bytes, ")").c_str());
}
void PinnedMemory::Free(void* ptr) { cudaFreeHost(ptr); }

}  // namespace device_internal

[[nodiscard]] absl::Status CopyToDevice(void* dst, const void* src, size_t bytes) {
  return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyHostToDevice), "cudaMemcpy H2D");
}

[[nodiscard]] absl::Status CopyToHost(void* dst, const void* src, size_t bytes) {
  return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToHost), "cudaMemcpy D2H");
}

[[nodiscard]] absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes) {
  return CudaStatus(cudaMemcpy(dst, src, bytes, cudaMemcpyDeviceToDevice), "cudaMemcpy D2D");
}

namespace {

class CudaPinnedUploader final : public PinnedUploader {
 public:
  ~CudaPinnedUploader() override {
    if (stream_) {
      cudaStreamSynchronize(stream_);
      for (cudaEvent_t e : done_) cudaEventDestroy(e);
      cudaStreamDestroy(stream_);
    }
  }

  [[nodiscard]] absl::Status Init(size_t chunk, int n) {
    chunk_ = chunk;
    if (auto s = CudaStatus(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking),
                            "cudaStreamCreate");
        !s.ok()) {
      stream_ = nullptr;
      return s;
    }
    for (int i = 0; i < n; ++i) {
      auto buf = PinnedBuffer::Allocate(chunk);
      if (!buf.ok()) return buf.status();
      bufs_.push_back(std::move(*buf));
      cudaEvent_t e;
      if (auto s =
              CudaStatus(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), "cudaEventCreate");
          !s.ok()) {
        return s;
      }
      done_.push_back(e);
      used_.push_back(false);
    }
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status Copy(void* dst, const void* src, size_t bytes) override {
    auto* d = static_cast<uint8_t*>(dst);
    const auto* s = static_cast<const uint8_t*>(src);
    while (bytes > 0) {
      const size_t n = std::min(bytes, chunk_);
      const size_t i = next_;
      next_ = (next_ + 1) % bufs_.size();
      // Wait until the DMA that last read this staging buffer is done, then refill it.
      if (used_[i]) {
        if (auto st = CudaStatus(cudaEventSynchronize(done_[i]), "staging buffer wait"); !st.ok()) {
          return st;
        }
      }
      copier_.Copy(bufs_[i].get(), s, n);
      if (auto st =
              CudaStatus(cudaMemcpyAsync(d, bufs_[i].get(), n, cudaMemcpyHostToDevice, stream_),
                         "cudaMemcpyAsync H2D");
          !st.ok()) {
        return st;
      }
      if (auto st = CudaStatus(cudaEventRecord(done_[i], stream_), "cudaEventRecord"); !st.ok()) {
        return st;
      }
      used_[i] = true;
      d += n;
      s += n;
      bytes -= n;
    }
    return absl::OkStatus();
  }

  [[nodiscard]] absl::Status Finish() override {
    return CudaStatus(cudaStreamSynchronize(stream_), "upload stream synchronize");
  }

 private:
  size_t chunk_ = 0;
  // Fills the staging buffers with several threads: one core's memcpy is slower than the link.
  kernels_internal::ParallelCopier copier_{
      static_cast<int>(std::clamp(std::thread::hardware_concurrency() / 2, 1u, 8u))};
  cudaStream_t stream_ = nullptr;
  std::vector<PinnedBuffer> bufs_;
  std::vector<cudaEvent_t> done_;
  std::vector<bool> used_;
  size_t next_ = 0;
};

class CudaDeviceTimer final : public DeviceTimer {
 public:
  ~CudaDeviceTimer() override {
    if (start_) cudaEventDestroy(start_);
    if (stop_) cudaEventDestroy(stop_);
  }
  [[nodiscard]] absl::Status Init() {
    if (auto s = CudaStatus(cudaEventCreate(&start_), "cudaEventCreate"); !s.ok()) return s;
    return CudaStatus(cudaEventCreate(&stop_), "cudaEventCreate");
  }
  [[nodiscard]] absl::Status Start(void* stream) override {
    return CudaStatus(cudaEventRecord(start_, static_cast<cudaStream_t>(stream)), "timer start");
  }
  [[nodiscard]] absl::StatusOr<double> StopMs(void* stream) override {
    if (auto s =
            CudaStatus(cudaEventRecord(stop_, static_cast<cudaStream_t>(stream)), "timer stop");
        !s.ok()) {
      return s;
    }
    if (auto s = CudaStatus(cudaEventSynchronize(stop_), "timer sync"); !s.ok()) return s;
    float ms = 0;
    if (auto s = CudaStatus(cudaEventElapsedTime(&ms, start_, stop_), "cudaEventElapsedTime");
        !s.ok()) {
      return s;
    }
    return static_cast<double>(ms);
  }

 private:
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
};

}  // namespace

absl::StatusOr<std::unique_ptr<PinnedUploader>> PinnedUploader::Create(size_t chunk_bytes,
                                                                       int num_buffers) {
  if (chunk_bytes == 0 || num_buffers < 2) {
    return absl::InvalidArgumentError("PinnedUploader needs chunk_bytes > 0 and >= 2 buffers");
  }
  auto u = std::make_unique<CudaPinnedUploader>();
  if (auto s = u->Init(chunk_bytes, num_buffers); !s.ok()) return s;
  return std::unique_ptr<PinnedUploader>(std::move(u));
}

absl::StatusOr<std::unique_ptr<DeviceTimer>> DeviceTimer::Create() {
  auto t = std::make_unique<CudaDeviceTimer>();
  if (auto s = t->Init(); !s.ok()) return s;
  return std::unique_ptr<DeviceTimer>(std::move(t));
}

}  // namespace moelora
