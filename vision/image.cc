#include "vision/image.h"

// clang-format off
#include <csetjmp>
#include <cstdio>
#include <png.h>
#include <jpeglib.h>
#include <jerror.h>
#include <webp/decode.h>
#include <webp/demux.h>
// clang-format on

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>

#include "absl/strings/str_cat.h"

namespace moelora::vision {
namespace {

absl::Status Bad(absl::string_view what) { return absl::InvalidArgumentError(what); }

absl::Status CheckSize(int64_t width, int64_t height, const DecodeLimits& limits,
                       absl::string_view format) {
  if (width <= 0 || height <= 0) {
    return Bad(absl::StrCat(format, " image of ", width, "x", height, " pixels"));
  }
  if (width * height > limits.max_pixels) {
    return Bad(absl::StrCat(format, " image of ", width, "x", height, " pixels: more than ",
                            limits.max_pixels, " pixels"));
  }
  return absl::OkStatus();
}

// RGBA (8 bits) → RGB, composited over opaque white as Pillow's ImagingAlphaComposite does it
// (integer arithmetic with 7 extra bits; a transparent pixel takes the background). With an
// opaque white background the coefficients reduce to a·128 and (255 − a)·128, exactly.
void CompositeOverWhite(const uint8_t* rgba, int64_t pixels, uint8_t* rgb) {
  constexpr uint32_t kBits = 7;
  for (int64_t i = 0; i < pixels; ++i) {
    const uint8_t* s = rgba + 4 * i;
    uint8_t* o = rgb + 3 * i;
    const uint32_t a = s[3];
    if (a == 0) {
      o[0] = o[1] = o[2] = 255;
      continue;
    }
    const uint32_t outa255 = a * 255 + 255 * (255 - a);
    const uint32_t coef1 = a * 255 * 255 * (1u << kBits) / outa255;
    const uint32_t coef2 = 255 * (1u << kBits) - coef1;
    for (int c = 0; c < 3; ++c) {
      const uint32_t t = s[c] * coef1 + 255 * coef2 + (0x80u << kBits);
      o[c] = static_cast<uint8_t>((((t >> 8) + t) >> 8) >> kBits);
    }
  }
}

// ---- PNG (libpng's progressive API would do too; the sequential one with a memory reader) ----

struct PngSource {
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t pos = 0;
  char error[256] = {};
};

void PngRead(png_structp png, png_bytep out, size_t n) {
  auto* src = static_cast<PngSource*>(png_get_io_ptr(png));
  if (n > src->size - src->pos) png_error(png, "truncated data");
  std::memcpy(out, src->data + src->pos, n);
  src->pos += n;
}

void PngError(png_structp png, png_const_charp message) {
  auto* src = static_cast<PngSource*>(png_get_error_ptr(png));
  std::snprintf(src->error, sizeof(src->error), "%s", message);
  png_longjmp(png, 1);
}

void PngWarning(png_structp, png_const_charp) {}

struct PngHeader {
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, color_type = 0;
  bool has_trns = false;
  bool gray16 = false;  // 16-bit grayscale without alpha: Pillow's I;16, clipped at 255
  size_t rowbytes = 0;
  int channels = 0;
};

// The two libpng phases are separate functions whose locals are all trivial, so that longjmp
// skips no destructor (the buffers are allocated by the caller in between).
bool PngReadHeader(png_structp png, png_infop info, PngHeader* h) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_info(png, info);
  png_get_IHDR(png, info, &h->width, &h->height, &h->bit_depth, &h->color_type, nullptr, nullptr,
               nullptr);
  h->has_trns = png_get_valid(png, info, PNG_INFO_tRNS) != 0;
  h->gray16 = h->color_type == PNG_COLOR_TYPE_GRAY && h->bit_depth == 16 && !h->has_trns;
  if (h->gray16) {
    png_set_swap(png);  // native order: read as 16-bit samples and clip them below
  } else {
    // Palette → RGB, gray below 8 bits → 8 bits (scaled, as Pillow's L;2 / L;4 / 1), tRNS →
    // alpha; 16-bit samples keep their high byte (Pillow's RGB;16B, LA;16B, RGBA;16B); gray →
    // RGB. No gamma correction: Pillow ignores gAMA.
    png_set_expand(png);
    png_set_strip_16(png);
    png_set_gray_to_rgb(png);
  }
  png_set_interlace_handling(png);
  png_read_update_info(png, info);
  h->rowbytes = png_get_rowbytes(png, info);
  h->channels = png_get_channels(png, info);
  return true;
}

bool PngReadRows(png_structp png, png_bytepp rows) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_read_image(png, rows);
  return true;
}

absl::StatusOr<RgbImage> DecodePng(std::string_view bytes, const DecodeLimits& limits) {
  PngSource src;
  src.data = reinterpret_cast<const uint8_t*>(bytes.data());
  src.size = bytes.size();
  png_structp png = png_create_read_struct(PNG_LIBPNG_VER_STRING, &src, PngError, PngWarning);
  if (png == nullptr) return absl::ResourceExhaustedError("PNG: out of memory");
  png_infop info = png_create_info_struct(png);
  struct Destroy {
    png_structp* png;
    png_infop* info;
    ~Destroy() { png_destroy_read_struct(png, info, nullptr); }
  } destroy{&png, &info};
  if (info == nullptr) return absl::ResourceExhaustedError("PNG: out of memory");
  png_set_read_fn(png, &src, PngRead);
  // Pillow's own limit on decompressed text chunks is higher; these only bound memory.
  png_set_user_limits(png, 1 << 24, 1 << 24);
  PngHeader h;
  if (!PngReadHeader(png, info, &h)) return Bad(absl::StrCat("PNG: ", src.error));
  if (auto s = CheckSize(h.width, h.height, limits, "PNG"); !s.ok()) return s;
  std::vector<uint8_t> pixels(h.rowbytes * h.height);
  std::vector<png_bytep> rows(h.height);
  for (png_uint_32 y = 0; y < h.height; ++y) rows[y] = pixels.data() + y * h.rowbytes;
  if (!PngReadRows(png, rows.data())) return Bad(absl::StrCat("PNG: ", src.error));

  RgbImage out;
  out.height = static_cast<int>(h.height);
  out.width = static_cast<int>(h.width);
  const int64_t n = int64_t{out.height} * out.width;
  out.rgb.resize(n * 3);
  if (h.gray16) {
    for (int64_t y = 0; y < out.height; ++y) {
      const auto* row = reinterpret_cast<const uint16_t*>(rows[y]);
      for (int64_t x = 0; x < out.width; ++x) {
        const uint8_t v = static_cast<uint8_t>(std::min<uint16_t>(row[x], 255));
        std::memset(&out.rgb[3 * (y * out.width + x)], v, 3);
      }
    }
  } else if (h.channels == 4) {
    CompositeOverWhite(pixels.data(), n, out.rgb.data());
  } else if (h.channels == 3) {
    out.rgb = std::move(pixels);
  } else {
    return Bad(absl::StrCat("PNG: unexpected channel count ", h.channels));
  }
  return out;
}

// ---- JPEG (libjpeg-turbo, with Pillow's settings: the library's defaults, islow DCT and fancy
// upsampling; YCbCr and grayscale decoded to RGB by the library) ----

struct JpegError {
  jpeg_error_mgr mgr;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX] = {};
  bool truncated = false;
};

void JpegErrorExit(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  cinfo->err->format_message(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// Warnings are ignored as Pillow ignores them, except running out of data: Pillow fails such an
// image ("image file is truncated") where libjpeg would pad it with grey.
void JpegWarning(j_common_ptr cinfo, int level) {
  if (level < 0 && cinfo->err->msg_code == JWRN_JPEG_EOF) {
    reinterpret_cast<JpegError*>(cinfo->err)->truncated = true;
  }
}

bool JpegReadHeader(jpeg_decompress_struct* cinfo, JpegError* err, const uint8_t* data, size_t n,
                    bool* cmyk) {
  if (setjmp(err->jump)) return false;
  jpeg_create_decompress(cinfo);
  jpeg_mem_src(cinfo, data, n);
  jpeg_read_header(cinfo, TRUE);
  *cmyk = cinfo->jpeg_color_space == JCS_CMYK || cinfo->jpeg_color_space == JCS_YCCK;
  if (*cmyk) return true;
  cinfo->out_color_space = JCS_RGB;
  jpeg_start_decompress(cinfo);
  return true;
}

bool JpegReadRows(jpeg_decompress_struct* cinfo, JpegError* err, uint8_t* out, size_t stride) {
  if (setjmp(err->jump)) return false;
  while (cinfo->output_scanline < cinfo->output_height) {
    JSAMPROW row = out + cinfo->output_scanline * stride;
    jpeg_read_scanlines(cinfo, &row, 1);
  }
  jpeg_finish_decompress(cinfo);
  return true;
}

// A decompressor with our error handlers, destroyed with its scope (both JPEG readers).
struct JpegDecompress {
  jpeg_decompress_struct cinfo;
  JpegError err;
  JpegDecompress() {
    cinfo.err = jpeg_std_error(&err.mgr);
    err.mgr.error_exit = JpegErrorExit;
    err.mgr.emit_message = JpegWarning;
  }
  ~JpegDecompress() { jpeg_destroy_decompress(&cinfo); }
  JpegDecompress(const JpegDecompress&) = delete;
  JpegDecompress& operator=(const JpegDecompress&) = delete;
};

bool JpegReadDimensions(jpeg_decompress_struct* cinfo, JpegError* err, const uint8_t* data,
                        size_t n) {
  if (setjmp(err->jump)) return false;
  jpeg_create_decompress(cinfo);
  jpeg_mem_src(cinfo, data, n);
  jpeg_read_header(cinfo, TRUE);
  return true;
}

absl::StatusOr<std::pair<int64_t, int64_t>> JpegDimensions(std::string_view bytes) {
  JpegDecompress j;
  jpeg_decompress_struct& cinfo = j.cinfo;
  JpegError& err = j.err;
  if (!JpegReadDimensions(&cinfo, &err, reinterpret_cast<const uint8_t*>(bytes.data()),
                          bytes.size())) {
    return Bad(absl::StrCat("JPEG: ", err.message));
  }
  return std::pair<int64_t, int64_t>{cinfo.image_width, cinfo.image_height};
}

absl::StatusOr<RgbImage> DecodeJpeg(std::string_view bytes, const DecodeLimits& limits) {
  JpegDecompress j;
  jpeg_decompress_struct& cinfo = j.cinfo;
  JpegError& err = j.err;
  bool cmyk = false;
  if (!JpegReadHeader(&cinfo, &err, reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                      &cmyk)) {
    return Bad(absl::StrCat("JPEG: ", err.message));
  }
  if (cmyk) return Bad("JPEG: CMYK images are not supported");
  if (auto s = CheckSize(cinfo.output_width, cinfo.output_height, limits, "JPEG"); !s.ok()) {
    return s;
  }
  RgbImage out;
  out.height = static_cast<int>(cinfo.output_height);
  out.width = static_cast<int>(cinfo.output_width);
  out.rgb.resize(int64_t{out.height} * out.width * 3);
  if (!JpegReadRows(&cinfo, &err, out.rgb.data(), size_t{3} * out.width)) {
    return Bad(absl::StrCat("JPEG: ", err.message));
  }
  if (err.truncated) return Bad("JPEG: truncated data");
  return out;
}

// ---- WebP (libwebp's animation decoder, as Pillow opens every WebP: the first frame) ----

absl::StatusOr<RgbImage> DecodeWebp(std::string_view bytes, const DecodeLimits& limits) {
  WebPBitstreamFeatures features;
  if (WebPGetFeatures(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &features) !=
      VP8_STATUS_OK) {
    return Bad("WebP: corrupt or truncated data");
  }
  if (auto s = CheckSize(features.width, features.height, limits, "WebP"); !s.ok()) return s;
  WebPData data{reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()};
  WebPAnimDecoderOptions options;
  if (!WebPAnimDecoderOptionsInit(&options)) return absl::InternalError("WebP: library mismatch");
  options.color_mode = MODE_RGBA;
  options.use_threads = 0;
  WebPAnimDecoder* dec = WebPAnimDecoderNew(&data, &options);
  if (dec == nullptr) return Bad("WebP: corrupt or truncated data");
  struct Destroy {
    WebPAnimDecoder* d;
    ~Destroy() { WebPAnimDecoderDelete(d); }
  } destroy{dec};
  WebPAnimInfo info;
  uint8_t* frame = nullptr;
  int timestamp = 0;
  if (!WebPAnimDecoderGetInfo(dec, &info) || !WebPAnimDecoderGetNext(dec, &frame, &timestamp)) {
    return Bad("WebP: corrupt or truncated data");
  }
  RgbImage out;
  out.height = static_cast<int>(info.canvas_height);
  out.width = static_cast<int>(info.canvas_width);
  if (auto s = CheckSize(out.width, out.height, limits, "WebP"); !s.ok()) return s;
  const int64_t n = int64_t{out.height} * out.width;
  out.rgb.resize(n * 3);
  if (features.has_alpha) {
    CompositeOverWhite(frame, n, out.rgb.data());
  } else {
    for (int64_t i = 0; i < n; ++i) std::memcpy(&out.rgb[3 * i], frame + 4 * i, 3);
  }
  return out;
}

// ---- Pillow's resampling (Resample.c): the same filters, coefficient windows and fixed-point
// rounding, written here because no Debian library reproduces Pillow's results bit for bit ----

struct Filter {
  double (*fn)(double);
  double support;
};

double BoxFilter(double x) { return x > -0.5 && x <= 0.5 ? 1.0 : 0.0; }
double BilinearFilter(double x) {
  x = std::fabs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}
double HammingFilter(double x) {
  x = std::fabs(x);
  if (x == 0.0) return 1.0;
  if (x >= 1.0) return 0.0;
  x *= M_PI;
  return std::sin(x) / x * (0.54f + 0.46f * std::cos(x));
}
double BicubicFilter(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}
double Sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= M_PI;
  return std::sin(x) / x;
}
double LanczosFilter(double x) { return -3.0 <= x && x < 3.0 ? Sinc(x) * Sinc(x / 3) : 0.0; }

constexpr int kPrecisionBits = 32 - 8 - 2;

// Per output pixel: the first input pixel, the count, and `ksize` coefficients in fixed point.
struct Coeffs {
  int ksize = 0;
  std::vector<int> bounds;  // [out][2]: xmin, count
  std::vector<int32_t> k;   // [out][ksize]
};

Coeffs Precompute(int in_size, int out_size, const Filter& f) {
  Coeffs c;
  const double scale = static_cast<double>(in_size) / out_size;
  const double filterscale = std::max(scale, 1.0);
  const double support = f.support * filterscale;
  c.ksize = static_cast<int>(std::ceil(support)) * 2 + 1;
  c.bounds.resize(size_t{2} * out_size);
  c.k.assign(size_t{1} * out_size * c.ksize, 0);
  std::vector<double> w(c.ksize);
  for (int xx = 0; xx < out_size; ++xx) {
    const double center = (xx + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    int xmin = static_cast<int>(center - support + 0.5);
    if (xmin < 0) xmin = 0;
    int xmax = static_cast<int>(center + support + 0.5);
    if (xmax > in_size) xmax = in_size;
    xmax -= xmin;
    double ww = 0.0;
    for (int x = 0; x < xmax; ++x) {
      w[x] = f.fn((x + xmin - center + 0.5) * ss);
      ww += w[x];
    }
    for (int x = 0; x < xmax; ++x) {
      const double v = ww != 0.0 ? w[x] / ww : w[x];
      c.k[size_t{1} * xx * c.ksize + x] = static_cast<int32_t>(
          v < 0 ? -0.5 + v * (1 << kPrecisionBits) : 0.5 + v * (1 << kPrecisionBits));
    }
    c.bounds[2 * xx] = xmin;
    c.bounds[2 * xx + 1] = xmax;
  }
  return c;
}

uint8_t Clip8(int v) {
  const int s = v >> kPrecisionBits;  // arithmetic shift, as Pillow's lookup index
  return static_cast<uint8_t>(s < 0 ? 0 : s > 255 ? 255 : s);
}

// Pillow's ImagingResampleInner: a horizontal pass over the rows the vertical pass will read,
// then the vertical pass, each rounding to 8 bits.
RgbImage ResampleInner(const RgbImage& in, int height, int width, const Filter& f) {
  const bool need_h = width != in.width;
  const bool need_v = height != in.height;
  if (!need_h && !need_v) return in;
  const Coeffs cv = Precompute(in.height, height, f);
  // Rows of the input the vertical pass reads; the horizontal pass produces only those.
  const int y_first = cv.bounds[0];
  const int y_last = cv.bounds[2 * height - 2] + cv.bounds[2 * height - 1];
  RgbImage tmp;
  const RgbImage* src = &in;
  int row0 = 0;  // the first input row `src` holds
  if (need_h) {
    const Coeffs ch = Precompute(in.width, width, f);
    tmp.height = y_last - y_first;
    tmp.width = width;
    tmp.rgb.resize(size_t{3} * tmp.height * width);
    for (int yy = 0; yy < tmp.height; ++yy) {
      const uint8_t* row = &in.rgb[size_t{3} * (yy + y_first) * in.width];
      uint8_t* out = &tmp.rgb[size_t{3} * yy * width];
      for (int xx = 0; xx < width; ++xx) {
        const int xmin = ch.bounds[2 * xx], n = ch.bounds[2 * xx + 1];
        const int32_t* k = &ch.k[size_t{1} * xx * ch.ksize];
        int s0 = 1 << (kPrecisionBits - 1), s1 = s0, s2 = s0;
        for (int x = 0; x < n; ++x) {
          const uint8_t* p = row + 3 * (x + xmin);
          s0 += p[0] * k[x];
          s1 += p[1] * k[x];
          s2 += p[2] * k[x];
        }
        out[3 * xx] = Clip8(s0);
        out[3 * xx + 1] = Clip8(s1);
        out[3 * xx + 2] = Clip8(s2);
      }
    }
    if (!need_v) return tmp;
    src = &tmp;
    row0 = y_first;
  }
  RgbImage out;
  out.height = height;
  out.width = src->width;
  out.rgb.resize(size_t{3} * height * out.width);
  const size_t stride = size_t{3} * src->width;
  for (int yy = 0; yy < height; ++yy) {
    const int ymin = cv.bounds[2 * yy] - row0, n = cv.bounds[2 * yy + 1];
    const int32_t* k = &cv.k[size_t{1} * yy * cv.ksize];
    uint8_t* o = &out.rgb[size_t{3} * yy * out.width];
    for (size_t c = 0; c < stride; ++c) {
      int s = 1 << (kPrecisionBits - 1);
      for (int y = 0; y < n; ++y) s += src->rgb[(ymin + y) * stride + c] * k[y];
      o[c] = Clip8(s);
    }
  }
  return out;
}

}  // namespace

absl::StatusOr<RgbImage> DecodeImage(std::string_view bytes, const DecodeLimits& limits) {
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  if (bytes.size() >= 8 && std::memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) {
    return DecodePng(bytes, limits);
  }
  if (bytes.size() >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) {
    return DecodeJpeg(bytes, limits);
  }
  if (bytes.size() >= 12 && std::memcmp(b, "RIFF", 4) == 0 && std::memcmp(b + 8, "WEBP", 4) == 0) {
    return DecodeWebp(bytes, limits);
  }
  return Bad(absl::StrCat("not a PNG, JPEG or WebP image (", bytes.size(), " bytes)"));
}

absl::StatusOr<std::pair<int64_t, int64_t>> ImageDimensions(std::string_view bytes,
                                                            const DecodeLimits& limits) {
  const auto* b = reinterpret_cast<const uint8_t*>(bytes.data());
  auto be32 = [&](size_t at) {
    return (int64_t{b[at]} << 24) | (int64_t{b[at + 1]} << 16) | (int64_t{b[at + 2]} << 8) |
           int64_t{b[at + 3]};
  };
  absl::StatusOr<std::pair<int64_t, int64_t>> wh;
  const char* format = "";
  if (bytes.size() >= 8 && std::memcmp(b, "\x89PNG\r\n\x1a\n", 8) == 0) {
    format = "PNG";
    // The signature, then the IHDR chunk: length 13, "IHDR", width, height (big-endian).
    if (bytes.size() < 24 || std::memcmp(b + 12, "IHDR", 4) != 0) {
      return Bad("PNG: the first chunk is not IHDR");
    }
    wh = std::pair<int64_t, int64_t>{be32(16), be32(20)};
  } else if (bytes.size() >= 3 && b[0] == 0xFF && b[1] == 0xD8 && b[2] == 0xFF) {
    format = "JPEG";
    wh = JpegDimensions(bytes);
  } else if (bytes.size() >= 12 && std::memcmp(b, "RIFF", 4) == 0 &&
             std::memcmp(b + 8, "WEBP", 4) == 0) {
    format = "WebP";
    WebPBitstreamFeatures features;
    if (WebPGetFeatures(b, bytes.size(), &features) != VP8_STATUS_OK) {
      return Bad("WebP: corrupt or truncated data");
    }
    wh = std::pair<int64_t, int64_t>{features.width, features.height};
  } else {
    return Bad(absl::StrCat("not a PNG, JPEG or WebP image (", bytes.size(), " bytes)"));
  }
  if (!wh.ok()) return wh.status();
  if (auto s = CheckSize(wh->first, wh->second, limits, format); !s.ok()) return s;
  return wh;
}

absl::StatusOr<RgbImage> Resize(const RgbImage& in, int height, int width, Resample filter) {
  if (height <= 0 || width <= 0) {
    return Bad(absl::StrCat("resize to ", width, "x", height, " pixels"));
  }
  Filter f;
  switch (filter) {
    case Resample::kBox:
      f = {BoxFilter, 0.5};
      break;
    case Resample::kBilinear:
      f = {BilinearFilter, 1.0};
      break;
    case Resample::kHamming:
      f = {HammingFilter, 1.0};
      break;
    case Resample::kBicubic:
      f = {BicubicFilter, 2.0};
      break;
    case Resample::kLanczos:
      f = {LanczosFilter, 3.0};
      break;
    default:
      return Bad(
          absl::StrCat("resampling filter ", static_cast<int>(filter),
                       " is not implemented (bicubic, bilinear, lanczos, box, hamming are)"));
  }
  // Image.resize: an image over 100 times taller than wide that gets shorter is resized in
  // two calls, the height first (Pillow 12; Pillow 13 picks the order of the passes by rules of
  // its own: docs/decisions/image-preprocessing-as-pillow-does-it.md).
  if (int64_t{in.height} > int64_t{in.width} * 100 && height < in.height) {
    return ResampleInner(ResampleInner(in, height, in.width, f), height, width, f);
  }
  return ResampleInner(in, height, width, f);
}

}  // namespace moelora::vision
