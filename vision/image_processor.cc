#include "vision/image_processor.h"

#include <cfenv>
#include <cmath>
#include <fstream>
#include <sstream>

#include "absl/strings/str_cat.h"
#include "nlohmann/json.hpp"

namespace moelora::vision {
namespace {

absl::Status BadKey(const std::string& file, const std::string& key, absl::string_view why) {
  return absl::InvalidArgumentError(absl::StrCat(file, ": ", key, ": ", why));
}

}  // namespace

absl::StatusOr<ImageProcessorConfig> ImageProcessorConfig::Load(const std::string& dir) {
  const std::string file = dir + "/preprocessor_config.json";
  std::ifstream in(file, std::ios::binary);
  if (!in) return absl::NotFoundError(absl::StrCat(file, ": not found"));
  std::stringstream ss;
  ss << in.rdbuf();
  return Parse(ss.str(), file);
}

absl::StatusOr<ImageProcessorConfig> ImageProcessorConfig::Parse(std::string_view json,
                                                                 const std::string& file) {
  const nlohmann::json j = nlohmann::json::parse(json, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": not a JSON object"));
  }
  ImageProcessorConfig c;
  auto get_int = [&](const nlohmann::json& obj, const char* key, auto& out,
                     const std::string& path) -> absl::Status {
    if (!obj.contains(key) || obj[key].is_null()) return absl::OkStatus();
    const auto& v = obj[key];
    if (!v.is_number_integer() || v.get<int64_t>() <= 0 || v.get<int64_t>() > (int64_t{1} << 40)) {
      return BadKey(file, path, absl::StrCat("expected a positive integer, got ", v.dump()));
    }
    out = static_cast<std::decay_t<decltype(out)>>(v.get<int64_t>());
    return absl::OkStatus();
  };
  auto get_bool = [&](const char* key, bool& out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    if (!j[key].is_boolean()) return BadKey(file, key, "expected true or false");
    out = j[key].get<bool>();
    return absl::OkStatus();
  };
  auto get_triple = [&](const char* key, std::array<float, 3>& out) -> absl::Status {
    if (!j.contains(key) || j[key].is_null()) return absl::OkStatus();
    const auto& v = j[key];
    if (v.is_number()) {
      out.fill(v.get<float>());
      return absl::OkStatus();
    }
    if (!v.is_array() || v.size() != 3) return BadKey(file, key, "expected 3 numbers");
    for (int i = 0; i < 3; ++i) {
      if (!v[i].is_number()) return BadKey(file, key, "expected 3 numbers");
      out[i] = v[i].get<float>();  // transformers builds an f32 array of them
    }
    return absl::OkStatus();
  };
  for (auto s :
       {get_int(j, "patch_size", c.patch_size, "patch_size"),
        get_int(j, "temporal_patch_size", c.temporal_patch_size, "temporal_patch_size"),
        get_int(j, "merge_size", c.merge_size, "merge_size"), get_bool("do_resize", c.do_resize),
        get_bool("do_rescale", c.do_rescale), get_bool("do_normalize", c.do_normalize),
        get_triple("image_mean", c.mean), get_triple("image_std", c.std)}) {
    if (!s.ok()) return s;
  }
  if (j.contains("size") && j["size"].is_object()) {
    for (auto s : {get_int(j["size"], "shortest_edge", c.min_pixels, "size.shortest_edge"),
                   get_int(j["size"], "longest_edge", c.max_pixels, "size.longest_edge")}) {
      if (!s.ok()) return s;
    }
  }
  // The processor's constructor lets min_pixels / max_pixels override size.
  for (auto s : {get_int(j, "min_pixels", c.min_pixels, "min_pixels"),
                 get_int(j, "max_pixels", c.max_pixels, "max_pixels")}) {
    if (!s.ok()) return s;
  }
  if (j.contains("rescale_factor") && !j["rescale_factor"].is_null()) {
    if (!j["rescale_factor"].is_number())
      return BadKey(file, "rescale_factor", "expected a number");
    c.rescale_factor = j["rescale_factor"].get<double>();
  }
  if (j.contains("resample") && !j["resample"].is_null()) {
    if (!j["resample"].is_number_integer()) return BadKey(file, "resample", "expected 0-5");
    const int r = j["resample"].get<int>();
    if (r < 1 || r > 5) {
      return BadKey(file, "resample",
                    absl::StrCat(r,
                                 " is not implemented (1-5: lanczos, bilinear, bicubic, box, "
                                 "hamming)"));
    }
    c.resample = static_cast<Resample>(r);
  }
  for (int i = 0; i < 3; ++i) {
    if (c.std[i] == 0) return BadKey(file, "image_std", "a standard deviation of 0");
  }
  if (c.min_pixels > c.max_pixels) {
    return BadKey(
        file, "size",
        absl::StrCat("shortest_edge ", c.min_pixels, " above longest_edge ", c.max_pixels));
  }
  if (c.patch_size > 1024 || c.merge_size > 64 || c.temporal_patch_size > 64) {
    return BadKey(file, "patch_size", "patch, merge or temporal size out of range");
  }
  return c;
}

absl::StatusOr<std::pair<int, int>> SmartResize(int height, int width, int factor,
                                                int64_t min_pixels, int64_t max_pixels) {
  if (height <= 0 || width <= 0) {
    return absl::InvalidArgumentError(absl::StrCat("image of ", width, "x", height, " pixels"));
  }
  const double ratio = static_cast<double>(std::max(height, width)) / std::min(height, width);
  if (ratio > 200) {
    return absl::InvalidArgumentError(
        absl::StrCat("absolute aspect ratio must be smaller than 200, got ", ratio));
  }
  // Python's round(): halves to even, as nearbyint in the default rounding mode.
  auto round_even = [](double v) { return static_cast<int64_t>(std::nearbyint(v)); };
  int64_t h = round_even(static_cast<double>(height) / factor) * factor;
  int64_t w = round_even(static_cast<double>(width) / factor) * factor;
  if (h * w > max_pixels) {
    const double beta = std::sqrt(static_cast<double>(height) * width / max_pixels);
    h = std::max<int64_t>(factor,
                          static_cast<int64_t>(std::floor(height / beta / factor)) * factor);
    w = std::max<int64_t>(factor, static_cast<int64_t>(std::floor(width / beta / factor)) * factor);
  } else if (h * w < min_pixels) {
    const double beta = std::sqrt(static_cast<double>(min_pixels) / (double{1} * height * width));
    h = static_cast<int64_t>(std::ceil(height * beta / factor)) * factor;
    w = static_cast<int64_t>(std::ceil(width * beta / factor)) * factor;
  }
  if (h <= 0 || w <= 0 || h > (1 << 20) || w > (1 << 20)) {
    return absl::InvalidArgumentError(
        absl::StrCat("image of ", width, "x", height, " pixels resizes to ", w, "x", h));
  }
  return std::pair<int, int>(static_cast<int>(h), static_cast<int>(w));
}

absl::StatusOr<ProcessedImage> ProcessImage(RgbImage image, const ImageProcessorConfig& c) {
  const int factor = c.patch_size * c.merge_size;
  ProcessedImage out;
  if (c.do_resize) {
    auto size = SmartResize(image.height, image.width, factor, c.min_pixels, c.max_pixels);
    if (!size.ok()) return size.status();
    auto resized = Resize(image, size->first, size->second, c.resample);
    if (!resized.ok()) return resized.status();
    out.pixels = *std::move(resized);
  } else {
    if (image.height % factor != 0 || image.width % factor != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("image of ", image.width, "x", image.height,
                       " pixels: without do_resize both sides must be multiples of ", factor));
    }
    out.pixels = std::move(image);
  }
  out.grid_h = out.pixels.height / c.patch_size;
  out.grid_w = out.pixels.width / c.patch_size;
  return out;
}

absl::StatusOr<int64_t> ImageTokensFromHeader(std::string_view bytes, const ImageProcessorConfig& c,
                                              const DecodeLimits& limits) {
  auto wh = ImageDimensions(bytes, limits);
  if (!wh.ok()) return wh.status();
  const int factor = c.patch_size * c.merge_size;
  int64_t h = wh->second, w = wh->first;
  if (c.do_resize) {
    auto size =
        SmartResize(static_cast<int>(h), static_cast<int>(w), factor, c.min_pixels, c.max_pixels);
    if (!size.ok()) return size.status();
    h = size->first;
    w = size->second;
  } else if (h % factor != 0 || w % factor != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat("image of ", w, "x", h,
                     " pixels: without do_resize both sides must be multiples of ", factor));
  }
  return (h / c.patch_size) * (w / c.patch_size) / (int64_t{c.merge_size} * c.merge_size);
}

absl::StatusOr<ProcessedImage> ProcessImage(std::string_view bytes, const ImageProcessorConfig& c,
                                            const DecodeLimits& limits) {
  auto image = DecodeImage(bytes, limits);
  if (!image.ok()) return image.status();
  return ProcessImage(*std::move(image), c);
}

std::vector<float> PixelValues(const ProcessedImage& image, const ImageProcessorConfig& c) {
  const int p = c.patch_size, m = c.merge_size, t = c.temporal_patch_size;
  const int W = image.pixels.width;
  // One value per (channel, input level): rescale then normalise, as the processor does them.
  float table[3][256];
  for (int ch = 0; ch < 3; ++ch) {
    for (int v = 0; v < 256; ++v) {
      float x = c.do_rescale ? static_cast<float>(static_cast<double>(v) * c.rescale_factor)
                             : static_cast<float>(v);
      if (c.do_normalize) x = (x - c.mean[ch]) / c.std[ch];
      table[ch][v] = x;
    }
  }
  std::vector<float> out(static_cast<size_t>(image.patches() * c.patch_dim()));
  float* o = out.data();
  const int bh = image.grid_h / m, bw = image.grid_w / m;
  for (int by = 0; by < bh; ++by) {
    for (int bx = 0; bx < bw; ++bx) {
      for (int my = 0; my < m; ++my) {
        for (int mx = 0; mx < m; ++mx) {
          const int y0 = (by * m + my) * p, x0 = (bx * m + mx) * p;
          for (int ch = 0; ch < 3; ++ch) {
            for (int tt = 0; tt < t; ++tt) {
              for (int py = 0; py < p; ++py) {
                const uint8_t* row = &image.pixels.rgb[(size_t{1} * (y0 + py) * W + x0) * 3 + ch];
                for (int px = 0; px < p; ++px) *o++ = table[ch][row[3 * px]];
              }
            }
          }
        }
      }
    }
  }
  return out;
}

}  // namespace moelora::vision
