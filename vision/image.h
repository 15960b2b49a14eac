// Image decoding and resampling for the vision models' preprocessing, as Pillow does them: what
// transformers' image processors see is a PIL image, so "the same pixels" means Pillow's
// decoders, its RGB conversion and its resampling filters. No libtorch, no gRPC (the controller
// and the worker link it).
#ifndef MOELORA_VISION_IMAGE_H_
#define MOELORA_VISION_IMAGE_H_

#include <cstdint>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"

namespace moelora::vision {

// 8-bit RGB, rows top to bottom, pixels left to right, channels R G B (numpy's (H, W, 3)).
struct RgbImage {
  int height = 0;
  int width = 0;
  std::vector<uint8_t> rgb;  // height * width * 3
};

// What DecodeImage accepts.
struct DecodeLimits {
  // Width × height of the encoded image at most: Pillow's decompression-bomb limit.
  int64_t max_pixels = 89478485;
};

// PNG (libpng), JPEG (libjpeg-turbo) or WebP (libwebp), told apart by their signatures, to RGB as
// transformers' convert_to_rgb makes it from the PIL image Pillow opens: an image with alpha
// (an alpha channel, or a tRNS chunk) is composited over opaque white with Pillow's integer
// alpha_composite; 16-bit samples keep their high byte (16-bit grayscale is clipped at 255, as
// Pillow's I;16 → L); grayscale is repeated into R, G and B; palettes are expanded. The first
// frame of an animation. EXIF orientation is not applied (the processor does not apply it).
// INVALID_ARGUMENT naming what is wrong (not one of the three formats, truncated or corrupt
// data, CMYK JPEG, more pixels than `limits` allow).
[[nodiscard]] absl::StatusOr<RgbImage> DecodeImage(std::string_view bytes,
                                                   const DecodeLimits& limits = {});

// The width and height in an image's header (PNG's IHDR, JPEG's frame header, WebP's
// bitstream features), its pixels not decoded: what a request's images will cost is known before
// any is decoded. INVALID_ARGUMENT as DecodeImage (not one of the formats, a corrupt header, more
// pixels than `limits` allow).
[[nodiscard]] absl::StatusOr<std::pair<int64_t, int64_t>> ImageDimensions(
    std::string_view bytes, const DecodeLimits& limits = {});

// Resampling filters, numbered as PIL.Image.Resampling.
enum class Resample {
  kNearest = 0,
  kLanczos = 1,
  kBilinear = 2,
  kBicubic = 3,
  kBox = 4,
  kHamming = 5
};

// Pillow's Image.resize((width, height), filter) of an 8-bit image (ImagingResample: a
// horizontal pass into an 8-bit image, then a vertical one; the filter's support widened by the
// scale when shrinking; coefficients in 22-bit fixed point). kNearest is not implemented:
// INVALID_ARGUMENT. Equal sizes return a copy, as Pillow does.
[[nodiscard]] absl::StatusOr<RgbImage> Resize(const RgbImage& in, int height, int width,
                                              Resample filter);

}  // namespace moelora::vision

#endif  // MOELORA_VISION_IMAGE_H_
