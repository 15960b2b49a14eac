#include "worker/engine/image_inputs.h"

#include <openssl/evp.h>

#include <algorithm>
#include <utility>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "worker/architectures/vision_tower.h"

namespace moelora {

namespace {

// The SHA-256 of `bytes` in hex (the encoder cache's key: a collision would hand one request
// another image's tower output, so a cryptographic hash, OpenSSL's).
std::string Sha256Hex(const std::vector<uint8_t>& bytes) {
  unsigned char md[EVP_MAX_MD_SIZE];
  unsigned int n = 0;
  EVP_Digest(bytes.data(), bytes.size(), md, &n, EVP_sha256(), nullptr);
  static const char* kHex = "0123456789abcdef";
  std::string out;
  for (unsigned int k = 0; k < n; ++k) {
    out.push_back(kHex[md[k] >> 4]);
    out.push_back(kHex[md[k] & 15]);
  }
  return out;
}

}  // namespace

absl::StatusOr<std::unique_ptr<ImageInputs>> ImageInputs::Create(CausalLM* model,
                                                                 const EngineOptions& options) {
  std::unique_ptr<ImageInputs> in(new ImageInputs(model, options));
  const VisionConfig* v = model->vision();
  if (v == nullptr) return in;
  MOELORA_ASSIGN_OR_RETURN(in->processor_, vision::ImageProcessorConfig::Load(options.model_dir));
  if (in->processor_->patch_size != v->patch_size ||
      in->processor_->merge_size != v->spatial_merge_size ||
      in->processor_->temporal_patch_size != v->temporal_patch_size) {
    return absl::InvalidArgumentError(
        absl::StrCat(options.model_dir,
                     "/preprocessor_config.json: patch_size, merge_size and "
                     "temporal_patch_size must equal vision_config's patch_size (",
                     v->patch_size, "), spatial_merge_size (", v->spatial_merge_size,
                     ") and temporal_patch_size (", v->temporal_patch_size, ")"));
  }
  return in;
}

absl::Status ImageInputs::Check(const NewSequence& n) const {
  const VisionConfig* v = model_->vision();
  if (n.images.empty()) {
    if (v == nullptr) return absl::OkStatus();
    for (int32_t t : n.prompt) {
      if (t == v->image_token_id) {
        return absl::InvalidArgumentError(absl::StrCat("the prompt holds image token ", t,
                                                       " but the request has no image for it"));
      }
    }
    return absl::OkStatus();
  }
  if (v == nullptr) {
    return absl::InvalidArgumentError(absl::StrCat(
        model_->config().info.architecture, " has no vision tower: images are not accepted"));
  }
  const int factor = v->patch_size * v->spatial_merge_size;
  const int64_t P = static_cast<int64_t>(n.prompt.size());
  int64_t end = 0, covered = 0;
  for (size_t i = 0; i < n.images.size(); ++i) {
    const ImageInput& im = n.images[i];
    auto bad = [&](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat("image ", i, ": ", parts...));
    };
    if (im.height <= 0 || im.width <= 0 || im.height % factor != 0 || im.width % factor != 0) {
      return bad(im.width, "x", im.height, " pixels: both sides must be positive multiples of ",
                 factor, " (patch × merge)");
    }
    if (static_cast<int64_t>(im.rgb.size()) != int64_t{3} * im.height * im.width) {
      return bad(im.rgb.size(), " bytes of RGB for ", im.width, "x", im.height, " pixels");
    }
    const int64_t tokens = int64_t{im.height / factor} * (im.width / factor);
    if (im.offset < end || im.offset + tokens > P) {
      return bad("its ", tokens, " tokens at ", im.offset,
                 " overlap another image or pass the prompt's end (", P, ")");
    }
    for (int64_t p = im.offset; p < im.offset + tokens; ++p) {
      if (n.prompt[p] != v->image_token_id) {
        return bad("prompt position ", p, " holds token ", n.prompt[p], ", not the image token ",
                   v->image_token_id);
      }
    }
    end = im.offset + tokens;
    covered += tokens;
  }
  const int64_t pads =
      std::count(n.prompt.begin(), n.prompt.end(), static_cast<int32_t>(v->image_token_id));
  if (pads != covered) {
    return absl::InvalidArgumentError(absl::StrCat("the prompt holds ", pads, " image tokens; its ",
                                                   n.images.size(), " images take ", covered));
  }
  return absl::OkStatus();
}

// The positions as transformers' get_rope_index lays them out: text runs on; an image's tokens
// take (start, start + row, start + column) of its merged grid; the text after it starts at
// start + max(rows, columns).
void ImageInputs::Add(RunningSequence& s) const {
  if (s.spec.images.empty()) return;
  const VisionConfig& v = *model_->vision();
  const int merge = v.spatial_merge_size;
  const int64_t P = static_cast<int64_t>(s.spec.prompt.size());
  const bool mrope = !model_->config().rope.mrope_section.empty();
  if (mrope) s.pos3.assign(3 * P, 0);
  int64_t cur = 0, next = 0;  // the next position; the next prompt index to place
  auto text_until = [&](int64_t stop) {
    for (; next < stop; ++next, ++cur) {
      if (mrope) s.pos3[next] = s.pos3[P + next] = s.pos3[2 * P + next] = cur;
    }
  };
  for (ImageInput& in : s.spec.images) {
    RunningSequence::Image im;
    im.offset = in.offset;
    im.pixels.pixels.height = in.height;
    im.pixels.pixels.width = in.width;
    im.pixels.pixels.rgb.assign(in.rgb.begin(), in.rgb.end());
    std::string().swap(in.rgb);
    im.pixels.grid_h = in.height / v.patch_size;
    im.pixels.grid_w = in.width / v.patch_size;
    im.tokens = im.pixels.tokens(merge);
    // The tower's output depends on the pixels, and on the adapter where adapters adapt it.
    im.cache_key = absl::StrCat(Sha256Hex(im.pixels.pixels.rgb), ":", in.width, "x", in.height, ":",
                                options_.enable_tower_connector_lora ? s.spec.adapter_id : 0);
    text_until(im.offset);
    const int64_t rows = im.pixels.grid_h / merge, cols = im.pixels.grid_w / merge;
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c, ++next) {
        if (mrope) {
          s.pos3[next] = cur;
          s.pos3[P + next] = cur + r;
          s.pos3[2 * P + next] = cur + c;
        }
      }
    }
    cur += std::max(rows, cols);
    s.images.push_back(std::move(im));
  }
  text_until(P);
  s.rope_delta = cur - P;
  if (!mrope) s.pos3.clear();
}

absl::Status ImageInputs::Prepare(ForwardBatch& b, const std::vector<RunningSequence*>& seqs,
                                  bool head_reads_ahead) {
  std::vector<VisionImage> todo;
  std::vector<RunningSequence::Image*> targets;
  std::vector<std::vector<float>> pixel_values;  // alive until the tower has run
  auto chunk_of = [&](size_t k, const RunningSequence& s) {
    return std::pair<int64_t, int64_t>(s.Prefilling() ? static_cast<int64_t>(s.fed) : -1,
                                       s.Prefilling() ? s.fed + b.seqs[k].count : -1);
  };
  // With an MTP head, the image under the next chunk's first token too: the head reads it
  // after this step (its input at the chunk's last position).
  const int64_t ahead = head_reads_ahead ? 1 : 0;
  for (size_t k = 0; k < b.seqs.size(); ++k) {
    RunningSequence& s = *seqs[k];
    const auto [from, to] = chunk_of(k, s);
    for (RunningSequence::Image& im : s.images) {
      if (im.encoded.embeds.defined() || im.offset >= to + ahead || im.offset + im.tokens <= from) {
        continue;
      }
      if (CachedEncodingFor(im.cache_key, &im.encoded)) {
        ++cache_hits_;
        continue;
      }
      pixel_values.push_back(vision::PixelValues(im.pixels, *processor_));
      todo.push_back({at::from_blob(pixel_values.back().data(),
                                    {im.pixels.patches(), processor_->patch_dim()}, at::kFloat),
                      1, im.pixels.grid_h, im.pixels.grid_w, s.slot});
      targets.push_back(&im);
    }
  }
  if (!todo.empty()) {
    MOELORA_ASSIGN_OR_RETURN(VisionEncoding e, model_->EncodeImages(todo));
    int64_t row = 0;
    for (RunningSequence::Image* im : targets) {
      im->encoded.embeds = e.embeds.narrow(0, row, im->tokens);
      im->encoded.deepstack.clear();
      for (const at::Tensor& d : e.deepstack) {
        im->encoded.deepstack.push_back(d.narrow(0, row, im->tokens));
      }
      row += im->tokens;
      CacheEncoding(im->cache_key, im->encoded);
    }
    images_encoded_ += static_cast<int64_t>(targets.size());
  }
  std::vector<at::Tensor> embeds;
  std::vector<std::vector<at::Tensor>> deep;
  for (size_t k = 0; k < b.seqs.size(); ++k) {
    RunningSequence& s = *seqs[k];
    const auto [from, to] = chunk_of(k, s);
    for (RunningSequence::Image& im : s.images) {
      const int64_t lo = std::max(im.offset, from), hi = std::min(im.offset + im.tokens, to);
      if (lo >= hi) continue;
      for (int64_t p = lo; p < hi; ++p) b.visual_rows.push_back(b.seqs[k].begin + p - from);
      embeds.push_back(im.encoded.embeds.narrow(0, lo - im.offset, hi - lo));
      deep.resize(im.encoded.deepstack.size());
      for (size_t d = 0; d < im.encoded.deepstack.size(); ++d) {
        deep[d].push_back(im.encoded.deepstack[d].narrow(0, lo - im.offset, hi - lo));
      }
    }
  }
  if (!embeds.empty()) {
    b.visual_embeds = at::cat(embeds, 0);
    for (auto& d : deep) b.visual_deepstack.push_back(at::cat(d, 0));
  }
  return absl::OkStatus();
}

void ImageInputs::DropBefore(RunningSequence& s, int64_t past) {
  for (RunningSequence::Image& im : s.images) {
    if (im.offset + im.tokens <= past) im.encoded = VisionEncoding();
  }
}

bool ImageInputs::CachedEncodingFor(const std::string& key, VisionEncoding* out) {
  auto it = index_.find(key);
  if (it == index_.end()) return false;
  cache_.splice(cache_.begin(), cache_, it->second);
  *out = it->second->encoding;
  return true;
}

// Keeps a copy of `e` (its own storage, not a view of a batch's output), evicting the least
// recently used beyond the budget; nothing when `e` alone is larger.
void ImageInputs::CacheEncoding(const std::string& key, const VisionEncoding& e) {
  const int64_t budget = options_.mm_encoder_cache_bytes;
  if (budget <= 0 || index_.count(key)) return;
  CachedEncoding c;
  c.key = key;
  c.encoding.embeds = e.embeds.clone();
  c.bytes = c.encoding.embeds.nbytes();
  for (const at::Tensor& d : e.deepstack) {
    c.encoding.deepstack.push_back(d.clone());
    c.bytes += d.nbytes();
  }
  if (c.bytes > budget) return;
  while (cache_bytes_ + c.bytes > budget) {
    cache_bytes_ -= cache_.back().bytes;
    index_.erase(cache_.back().key);
    cache_.pop_back();
  }
  cache_bytes_ += c.bytes;
  cache_.push_front(std::move(c));
  index_[key] = cache_.begin();
}

}  // namespace moelora
