// The Qwen2-VL image processor (transformers' Qwen2VLImageProcessor, which Qwen3-VL, Qwen3-VL-MoE
// and Qwen3.5 use): smart_resize to multiples of patch × merge within [min_pixels, max_pixels],
// Pillow's resampling, rescale, normalisation, and the patch order the vision tower expects.
// The controller runs it (to count an image's tokens and to send the resized pixels); the worker
// turns the resized pixels into the tower's input with PixelValues.
#ifndef MOELORA_VISION_IMAGE_PROCESSOR_H_
#define MOELORA_VISION_IMAGE_PROCESSOR_H_

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "absl/status/statusor.h"
#include "vision/image.h"

namespace moelora::vision {

// preprocessor_config.json, with the processor class's defaults for absent keys.
struct ImageProcessorConfig {
  int patch_size = 14;
  int temporal_patch_size = 2;
  int merge_size = 2;
  int64_t min_pixels = 56 * 56;         // size.shortest_edge (or min_pixels)
  int64_t max_pixels = 28 * 28 * 1280;  // size.longest_edge (or max_pixels)
  std::array<float, 3> mean = {0.48145466f, 0.4578275f, 0.40821073f};  // OpenAI CLIP
  std::array<float, 3> std = {0.26862954f, 0.26130258f, 0.27577711f};
  double rescale_factor = 1.0 / 255;
  bool do_resize = true;
  bool do_rescale = true;
  bool do_normalize = true;
  Resample resample = Resample::kBicubic;

  // One image's width of a patch row: channels × temporal × patch × patch.
  int64_t patch_dim() const { return int64_t{3} * temporal_patch_size * patch_size * patch_size; }
  // `dir`/preprocessor_config.json; NOT_FOUND when the file is absent, INVALID_ARGUMENT naming
  // the file and key for a bad value (sizes that are not positive, a merge size the patch grid
  // cannot hold, mean/std not of 3 numbers, a resampling filter not implemented).
  [[nodiscard]] static absl::StatusOr<ImageProcessorConfig> Load(const std::string& dir);
  [[nodiscard]] static absl::StatusOr<ImageProcessorConfig> Parse(std::string_view json,
                                                                  const std::string& file);
};

// Qwen2-VL's smart_resize: (height, width) rounded to multiples of `factor`, scaled (keeping the
// aspect ratio) into [min_pixels, max_pixels]. INVALID_ARGUMENT when the aspect ratio exceeds 200.
[[nodiscard]] absl::StatusOr<std::pair<int, int>> SmartResize(int height, int width, int factor,
                                                              int64_t min_pixels,
                                                              int64_t max_pixels);

// An image ready for the tower: its resized pixels and its patch grid (t = 1 for an image).
struct ProcessedImage {
  RgbImage pixels;  // resized (do_resize) RGB
  int grid_t = 1, grid_h = 0, grid_w = 0;
  int64_t patches() const { return int64_t{grid_t} * grid_h * grid_w; }
  // Tokens the image takes in the prompt: patches / merge².
  int64_t tokens(int merge_size) const { return patches() / (int64_t{merge_size} * merge_size); }
};

// Decode + resize. INVALID_ARGUMENT (from DecodeImage, SmartResize, or a size that is not a
// multiple of patch × merge without do_resize).
[[nodiscard]] absl::StatusOr<ProcessedImage> ProcessImage(std::string_view bytes,
                                                          const ImageProcessorConfig& c,
                                                          const DecodeLimits& limits = {});
// The tokens an image will take, from its header alone (ImageDimensions, then smart_resize):
// what ProcessImage's result would say, without decoding. INVALID_ARGUMENT as ProcessImage.
[[nodiscard]] absl::StatusOr<int64_t> ImageTokensFromHeader(std::string_view bytes,
                                                            const ImageProcessorConfig& c,
                                                            const DecodeLimits& limits = {});
// The same from decoded pixels.
[[nodiscard]] absl::StatusOr<ProcessedImage> ProcessImage(RgbImage image,
                                                          const ImageProcessorConfig& c);

// The tower's input as the processor's `pixel_values` rows of this image: [patches, patch_dim()]
// row-major f32, rescaled (x·factor in double, then f32) and normalised ((x − mean) / std in
// f32), patches in merge-block order (grid row blocks, column blocks, then the merge × merge
// patches inside), each patch as (channel, temporal copy, row, column).
std::vector<float> PixelValues(const ProcessedImage& image, const ImageProcessorConfig& c);

}  // namespace moelora::vision

#endif  // MOELORA_VISION_IMAGE_PROCESSOR_H_
