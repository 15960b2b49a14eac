// The CUDA runtime as the rest of the project sees it: device memory, host<->device copies,
// pinned staging for adapter uploads, event timing. No CUDA types here, so this header compiles
// without nvcc; a build without CUDA (MOELORA_ENABLE_CUDA=OFF) answers UNIMPLEMENTED everywhere
// and CudaDeviceAvailable() is false.
//
// Streams are passed as `void*` (a cudaStream_t; nullptr = the legacy default stream, which is
// also libtorch's current stream unless a caller changes it).
// Thread-safety: DeviceBuffer and PinnedUploader are single-owner objects; the free functions
// are thread-safe as the CUDA runtime is.
#ifndef MOELORA_KERNELS_DEVICE_H_
#define MOELORA_KERNELS_DEVICE_H_

#include <cstddef>
#include <memory>
#include <string>

#include "absl/status/status.h"
#include "absl/status/statusor.h"

namespace moelora {

// True when built with CUDA and at least one device is visible.
bool CudaDeviceAvailable();
int CudaDeviceCount();
// "NVIDIA H200, sm_90, 139 GiB" or the reason there is none.
std::string CudaDeviceSummary();
// NCCL's version code (e.g. 22807) when built with CUDA, 0 otherwise: proves NCCL links.
int NcclVersionCode();

[[nodiscard]] absl::Status CudaSetDevice(int device);
[[nodiscard]] absl::Status DeviceSynchronize();

namespace device_internal {
// Where an OwnedBuffer's memory comes from: kernels/cuda/device.cc (cudaMalloc, cudaMallocHost)
// or kernels/cpu/no_cuda.cc (UNIMPLEMENTED).
struct DeviceMemory {
  [[nodiscard]] static absl::Status Alloc(void** ptr, size_t bytes);
  static void Free(void* ptr);
};
struct PinnedMemory {
  [[nodiscard]] static absl::Status Alloc(void** ptr, size_t bytes);
  static void Free(void* ptr);
};
}  // namespace device_internal

// Memory of kind `M`, freed on destruction; move-only.
template <class M>
class OwnedBuffer {
 public:
  OwnedBuffer() = default;
  [[nodiscard]] static absl::StatusOr<OwnedBuffer> Allocate(size_t bytes) {
    OwnedBuffer b;
    if (bytes == 0) return b;
    if (absl::Status s = M::Alloc(&b.ptr_, bytes); !s.ok()) {
      b.ptr_ = nullptr;
      return s;
    }
    b.bytes_ = bytes;
    return b;
  }
  OwnedBuffer(OwnedBuffer&& o) noexcept : ptr_(o.ptr_), bytes_(o.bytes_) { o.ptr_ = nullptr; }
  OwnedBuffer& operator=(OwnedBuffer&& o) noexcept {
    if (this != &o) {
      Reset();
      ptr_ = o.ptr_;
      bytes_ = o.bytes_;
      o.ptr_ = nullptr;
    }
    return *this;
  }
  OwnedBuffer(const OwnedBuffer&) = delete;
  OwnedBuffer& operator=(const OwnedBuffer&) = delete;
  ~OwnedBuffer() { Reset(); }
  void* get() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t bytes() const { return bytes_; }

 private:
  void Reset() {
    if (ptr_) M::Free(ptr_);
    ptr_ = nullptr;
    bytes_ = 0;
  }
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

using DeviceBuffer = OwnedBuffer<device_internal::DeviceMemory>;  // device memory
using PinnedBuffer = OwnedBuffer<device_internal::PinnedMemory>;  // page-locked host memory

// Blocking copies (synchronise the default stream).
[[nodiscard]] absl::Status CopyToDevice(void* dst, const void* src, size_t bytes);
[[nodiscard]] absl::Status CopyToHost(void* dst, const void* src, size_t bytes);
[[nodiscard]] absl::Status CopyOnDevice(void* dst, const void* src, size_t bytes);

// Uploads pageable host memory to the device through a ring of pinned staging buffers: the
// memcpy into buffer i+1 overlaps the DMA of buffer i, so an adapter of any size moves at close
// to pinned bandwidth without pinning the adapter itself (a pinned copy of every registered
// adapter would take host memory the kernel cannot page out).
class PinnedUploader {
 public:
  // `chunk_bytes` per staging buffer, `num_buffers` >= 2. Creates its own stream.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<PinnedUploader>> Create(
      size_t chunk_bytes = 64 << 20, int num_buffers = 3);
  virtual ~PinnedUploader() = default;
  // Queues `bytes` from `src` (host, pageable) to `dst` (device). Returns once `src` may be
  // reused; the device copy may still be in flight until Finish().
  [[nodiscard]] virtual absl::Status Copy(void* dst, const void* src, size_t bytes) = 0;
  // Waits until every queued copy has landed.
  [[nodiscard]] virtual absl::Status Finish() = 0;
};

// Milliseconds between two points on a stream, measured with CUDA events.
class DeviceTimer {
 public:
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<DeviceTimer>> Create();
  virtual ~DeviceTimer() = default;
  [[nodiscard]] virtual absl::Status Start(void* stream) = 0;
  [[nodiscard]] virtual absl::StatusOr<double> StopMs(void* stream) = 0;  // synchronises
};

}  // namespace moelora

#endif  // MOELORA_KERNELS_DEVICE_H_
