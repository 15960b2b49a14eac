// moelora-image: what the controller makes of images for a model, one JSON line per image.
//
//   moelora-image MODEL_DIR IMAGE...   -> {"file", "width", "height", "resized_width",
//                                          "resized_height", "image_grid_thw", "tokens"} or
//                                          {"file", "error"} per image
//
// MODEL_DIR holds preprocessor_config.json. With --pixel-values-out FILE, the images that were
// read are written to FILE (safetensors) as the Hugging Face processor names them:
// "pixel_values" [patches, 3·temporal·patch²] f32 and "image_grid_thw" [images, 3] i64.
// Exit status 1 when the config cannot be read, 2 when an image could not be read.
#include <fstream>
#include <iostream>
#include <sstream>
#include <string>
#include <vector>

#include "absl/flags/flag.h"
#include "common/flags.h"
#include "common/safetensors.h"
#include "nlohmann/json.hpp"
#include "vision/image_processor.h"

ABSL_FLAG(std::string, pixel_values_out, "",
          "write pixel_values and image_grid_thw of the images to this safetensors file");

int main(int argc, char** argv) {
  const auto args = moelora::ParseFlags(
      argc, argv,
      "moelora-image MODEL_DIR IMAGE...: each image decoded, resized and counted in tokens as the "
      "controller does it (JSON lines)",
      "moelora_image_main");
  if (args.size() < 3) {
    std::cerr << "usage: moelora-image [--pixel-values-out FILE] MODEL_DIR IMAGE...\n";
    return 1;
  }
  auto config = moelora::vision::ImageProcessorConfig::Load(args[1]);
  if (!config.ok()) {
    std::cerr << "moelora-image: " << config.status() << "\n";
    return 1;
  }
  int status = 0;
  std::vector<float> pixels;
  std::vector<int64_t> grids;
  for (size_t i = 2; i < args.size(); ++i) {
    nlohmann::ordered_json line;
    line["file"] = args[i];
    std::ifstream in(args[i], std::ios::binary);
    std::stringstream bytes;
    bytes << in.rdbuf();
    if (!in) {
      line["error"] = "cannot read the file";
      status = 2;
      std::cout << line.dump() << "\n";
      continue;
    }
    auto decoded = moelora::vision::DecodeImage(bytes.str());
    absl::StatusOr<moelora::vision::ProcessedImage> image =
        decoded.ok() ? moelora::vision::ProcessImage(*decoded, *config) : decoded.status();
    if (!image.ok()) {
      line["error"] = std::string(image.status().message());
      status = 2;
      std::cout << line.dump() << "\n";
      continue;
    }
    line["width"] = decoded->width;
    line["height"] = decoded->height;
    line["resized_width"] = image->pixels.width;
    line["resized_height"] = image->pixels.height;
    line["image_grid_thw"] = {image->grid_t, image->grid_h, image->grid_w};
    line["tokens"] = image->tokens(config->merge_size);
    std::cout << line.dump() << "\n";
    if (!absl::GetFlag(FLAGS_pixel_values_out).empty()) {
      const auto v = moelora::vision::PixelValues(*image, *config);
      pixels.insert(pixels.end(), v.begin(), v.end());
      grids.insert(grids.end(), {image->grid_t, image->grid_h, image->grid_w});
    }
  }
  if (const std::string out = absl::GetFlag(FLAGS_pixel_values_out); !out.empty()) {
    const int64_t n = static_cast<int64_t>(grids.size() / 3);
    const int64_t dim = config->patch_dim();
    const auto s =
        moelora::WriteSafetensors(out, {{"pixel_values",
                                         moelora::DType::kF32,
                                         {static_cast<int64_t>(pixels.size()) / dim, dim},
                                         pixels.data(),
                                         pixels.size() * sizeof(float)},
                                        {"image_grid_thw",
                                         moelora::DType::kI64,
                                         {n, 3},
                                         grids.data(),
                                         grids.size() * sizeof(int64_t)}});
    if (!s.ok()) {
      std::cerr << "moelora-image: " << s << "\n";
      return 1;
    }
  }
  return status;
}
