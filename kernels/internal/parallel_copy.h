// A memcpy split across a few persistent threads: filling the pinned staging buffers of
// PinnedUploader from pageable memory with one thread runs at a single core's copy bandwidth,
// well below a PCIe 5 / NVLink-C2C link. Internal to kernels/.
//
// Written by hand (a fixed pool, one job at a time) rather than with OpenMP: the GPU bundle
// leaves the OpenMP runtime to the PyTorch wheel, which renames its libgomp, so the kernels
// library links none of its own.
#ifndef MOELORA_KERNELS_INTERNAL_PARALLEL_COPY_H_
#define MOELORA_KERNELS_INTERNAL_PARALLEL_COPY_H_

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace moelora {
namespace kernels_internal {

class ParallelCopier {
 public:
  // `threads` >= 1 copy in parallel (threads - 1 helpers plus the caller). Copies smaller than
  // `min_split_bytes` per thread are done by the caller alone.
  explicit ParallelCopier(int threads, size_t min_split_bytes = size_t{1} << 20);
  ~ParallelCopier();
  ParallelCopier(const ParallelCopier&) = delete;
  ParallelCopier& operator=(const ParallelCopier&) = delete;

  // Same contract as std::memcpy (no overlap). Not reentrant: one Copy at a time.
  void Copy(void* dst, const void* src, size_t bytes);
  int threads() const { return static_cast<int>(helpers_.size()) + 1; }

 private:
  void Helper(int index);
  // Copies part `index` of `parts` of the current job.
  void CopyPart(int index, int parts) const;

  const size_t min_split_;
  std::vector<std::thread> helpers_;
  std::mutex mu_;
  std::condition_variable start_cv_, done_cv_;
  // The current job (written under mu_ before generation_ is bumped).
  uint8_t* dst_ = nullptr;
  const uint8_t* src_ = nullptr;
  size_t bytes_ = 0;
  int parts_ = 1;
  uint64_t generation_ = 0;
  int pending_ = 0;  // helpers still copying the current job
  bool stop_ = false;
};

}  // namespace kernels_internal
}  // namespace moelora

#endif  // MOELORA_KERNELS_INTERNAL_PARALLEL_COPY_H_
