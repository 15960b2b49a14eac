// libFuzzer: image files from clients (PNG, JPEG, WebP) through the controller's decoding and
// Qwen2-VL preprocessing. Any input must give an image or an INVALID_ARGUMENT, never a crash,
// and bounded memory (small pixel limits here).
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "vision/image_processor.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace moelora::vision;  // NOLINT
  static const ImageProcessorConfig kConfig = [] {
    ImageProcessorConfig c;
    c.patch_size = 4;
    c.merge_size = 2;
    c.min_pixels = 64;
    c.max_pixels = 64 * 64;
    return c;
  }();
  DecodeLimits limits;
  limits.max_pixels = 1 << 20;
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  auto image = ProcessImage(bytes, kConfig, limits);
  if (!image.ok()) {
    if (image.status().code() != absl::StatusCode::kInvalidArgument) __builtin_trap();
    return 0;
  }
  const auto px = PixelValues(*image, kConfig);
  if (static_cast<int64_t>(px.size()) != image->patches() * kConfig.patch_dim()) __builtin_trap();
  return 0;
}
