// safetensors reading (over mmap, zero-copy views) and writing.
//
// The reader validates what the reference implementation (the `safetensors` crate) validates,
// before any tensor is handed out:
//   - file at least 8 bytes; header length N (u64 little endian) <= 100 MB, checked before any
//     allocation, and 8 + N <= file size;
//   - the header is a JSON object (UTF-8, starting with '{'); every entry but `__metadata__` has
//     a known `dtype`, a `shape` of non-negative integers and `data_offsets` [begin, end];
//   - duplicate tensor names are rejected (the crate's map would silently keep one);
//   - sorted by begin, the spans are contiguous from 0 (no gap, no overlap), end >= begin, and the
//     last end equals the data section's size;
//   - product(shape) * bits(dtype) / 8 == end - begin, with overflow-checked arithmetic and whole
//     bytes for sub-byte dtypes;
//   - `__metadata__`, when present, maps strings to strings.
// Every error is INVALID_ARGUMENT (NOT_FOUND for a missing file) naming the file and the tensor.
//
// Thread-safety: a SafetensorsFile is immutable after Open() and may be read from any thread.
#ifndef MOELORA_COMMON_SAFETENSORS_H_
#define MOELORA_COMMON_SAFETENSORS_H_

#include <sys/stat.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/types/span.h"

namespace moelora {

// Every dtype of the safetensors format. F32, F16 and BF16 are computed with; the others are
// recognised (sizes checked, bytes copied) so that a valid file never fails to parse.
enum class DType {
  kBool,
  kF4,
  kF6E2M3,
  kF6E3M2,
  kU8,
  kI8,
  kF8E5M2,
  kF8E4M3,
  kF8E8M0,
  kI16,
  kU16,
  kF16,
  kBF16,
  kI32,
  kU32,
  kF32,
  kC64,
  kF64,
  kI64,
  kU64,
};

// Size of one element in bits (4 for F4, 6 for F6_*, 8 for BOOL).
int DTypeBits(DType dtype);
// The format's spelling, e.g. "BF16".
absl::string_view DTypeName(DType dtype);
// Parses the format's spelling; INVALID_ARGUMENT for an unknown one.
[[nodiscard]] absl::StatusOr<DType> ParseDType(absl::string_view name);
// True for F32, F16, BF16: the dtypes LoRA math runs on.
bool IsComputeDType(DType dtype);

// Largest accepted header, as in the reference implementation.
inline constexpr uint64_t kMaxSafetensorsHeaderBytes = 100'000'000;

// A tensor inside a mapped file. `data` points into the mapping (not necessarily aligned for the
// element type: read through memcpy or the converters in common/dtype.h).
struct TensorView {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const uint8_t* data = nullptr;
  size_t nbytes = 0;
  size_t offset = 0;  // begin within the data section

  int64_t numel() const;
  std::string ShapeString() const;  // "[2, 3]"
};

class SafetensorsFile {
 public:
  // Maps `path` read-only and validates it. NOT_FOUND if it does not exist, INVALID_ARGUMENT for
  // anything malformed (message starts with the path).
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<SafetensorsFile>> Open(
      const std::string& path);

  // Validates an in-memory buffer (fuzzing, tests). The buffer must outlive the result; `label`
  // names it in messages.
  [[nodiscard]] static absl::StatusOr<std::unique_ptr<SafetensorsFile>> FromBuffer(
      absl::Span<const uint8_t> bytes, std::string label);

  ~SafetensorsFile();
  SafetensorsFile(const SafetensorsFile&) = delete;
  SafetensorsFile& operator=(const SafetensorsFile&) = delete;

  const std::string& path() const { return path_; }
  // Tensors in file order (sorted by offset).
  const std::vector<TensorView>& tensors() const { return tensors_; }
  // nullptr if absent.
  const TensorView* Find(absl::string_view name) const;
  const std::map<std::string, std::string>& metadata() const { return metadata_; }
  // Size of the data section (sum of all tensors' bytes).
  size_t data_bytes() const { return data_bytes_; }
  // Tells the kernel that the pages of `view` are no longer needed (MADV_DONTNEED on the
  // read-only mapping): they leave this process's resident set and stay in the page cache. The
  // view stays valid (pages fault back in on access). No-op for buffers.
  void ReleasePages(const TensorView& view) const;
  // OK unless the file changed since Open: a read past its new end (truncated while mapped:
  // the kernel's SIGBUS, turned into a page of zeros and a mark here instead of a crash), or a
  // size, modification time or inode that differ now. Call once the views have been read:
  // anything read from a changed file must be dropped. INVALID_ARGUMENT naming the file.
  [[nodiscard]] absl::Status CheckIntact() const;

 private:
  SafetensorsFile() = default;
  [[nodiscard]] absl::Status Parse(absl::Span<const uint8_t> bytes);

  std::string path_;
  void* map_ = nullptr;  // mmap base when opened from a file
  size_t map_size_ = 0;
  int guard_slot_ = -1;    // its entry in the SIGBUS guard's table (-1: none)
  struct stat opened_ {};  // the file as Open found it
  std::vector<TensorView> tensors_;
  std::map<std::string, size_t, std::less<>> index_;
  std::map<std::string, std::string> metadata_;
  size_t data_bytes_ = 0;
};

// A tensor to write: the bytes are copied from `data` (row-major, contiguous).
struct TensorToWrite {
  std::string name;
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  const void* data = nullptr;
  size_t nbytes = 0;
};

// Writes a safetensors file (tensors in the given order, header padded with spaces to a multiple
// of 8 bytes, as the reference writer does). Writes to `path`.tmp then renames, so a reader never
// sees a half-written file. INVALID_ARGUMENT on a size mismatch or duplicate name.
[[nodiscard]] absl::Status WriteSafetensors(
    const std::string& path, const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata = {});

// The same bytes as WriteSafetensors would write, in memory (tests, fuzz seeds).
[[nodiscard]] absl::StatusOr<std::string> SerializeSafetensors(
    const std::vector<TensorToWrite>& tensors,
    const std::map<std::string, std::string>& metadata = {});

}  // namespace moelora

#endif  // MOELORA_COMMON_SAFETENSORS_H_
