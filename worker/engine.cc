#include "worker/engine.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <openssl/evp.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <future>
#include <list>
#include <map>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "common/request_rules.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "kernels/device.h"
#include "lora/adapter.h"
#include "lora/model_info.h"
#include "vision/image_processor.h"
#include "worker/model/causal_lm.h"
#include "worker/models/vision_tower.h"
#include "worker/torch_guard.h"

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

double Since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

[[nodiscard]] absl::Status ResetSlot(CausalLM& model, int slot) {
  return GuardTorch(absl::StrCat("clear LoRA slot ", slot), [&] {
    model.ResetSlot(slot);
    return absl::OkStatus();
  });
}
}  // namespace

[[nodiscard]] absl::Status ParseDevice(const std::string& device, int* cuda_index) {
  *cuda_index = -1;
  if (device == "cpu" || device == "cpu-twins" || device == "cuda") return absl::OkStatus();
  if (absl::StartsWith(device, "cuda:") && absl::SimpleAtoi(device.substr(5), cuda_index) &&
      *cuda_index >= 0) {
    return absl::OkStatus();
  }
  return absl::InvalidArgumentError(
      absl::StrCat("--device ", device, ": expected cpu, cuda, cuda:N or cpu-twins"));
}

[[nodiscard]] absl::Status ValidateDType(const std::string& dtype) {
  if (dtype == "float32" || dtype == "bfloat16") return absl::OkStatus();
  return absl::InvalidArgumentError(
      absl::StrCat("--dtype \"", dtype, "\": use float32 or bfloat16"));
}

// One thread runs everything of the engine that computes on tensors: the model load, adapter
// staging, unloads and every Step. libgomp keeps one OpenMP team per thread that opens a parallel
// region, and a team's idle threads spin after each region:
// - with Step on whichever gRPC thread took the call, several teams spun on the same cores, and
//   73% of a decode step's samples (perf, batch 32) were in libgomp's spin loop;
// - with only Step here, the model load (main thread) and adapter staging (gRPC threads) still
//   left teams behind. Once libgomp manages more threads than there are CPUs it spins 100 times
//   instead of about 3 ms before sleeping, so every parallel region of a step woke a sleeping
//   thread: 60-125 us for an empty region on this VM against 1 us, about 50 regions a step.
// One compute thread means one team, of --cpu-threads threads (its OpenMP thread count is set on
// it: the setting is per thread). The price: a step waits while an adapter is staged.
class ComputeThread {
 public:
  explicit ComputeThread(int threads) : thread_([this, threads] { Loop(threads); }) {}
  ~ComputeThread() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  // The reply of the last task run with `replied` is on its way.
  void Replied() {
    {
      std::lock_guard<std::mutex> l(mu_);
      awaiting_reply_ = false;
    }
    cv_.notify_all();
  }
  // Runs f there and waits for it (at once when called from there). Tasks run in the order they
  // were queued; `queued` (if any) is called once f is queued, before the wait.
  // `replied`: after f the thread waits (up to kReplyWait) for Replied(), before the next task:
  // the caller's gRPC thread then sends its reply on a free core instead of waiting for one
  // while the next call (sent ahead) keeps both busy (replies came up to two steps late).
  template <typename F>
  auto Run(F&& f, const std::function<void()>& queued = nullptr, bool replied = false)
      -> decltype(f()) {
    if (std::this_thread::get_id() == thread_.get_id()) {
      if (queued) queued();
      return f();
    }
    std::packaged_task<decltype(f())()> task(std::forward<F>(f));
    auto result = task.get_future();
    {
      std::lock_guard<std::mutex> l(mu_);
      tasks_.push_back([this, &task, replied] {
        if (replied) {
          std::lock_guard<std::mutex> l(mu_);
          awaiting_reply_ = true;
        }
        task();
      });
    }
    cv_.notify_all();
    if (queued) queued();
    return result.get();
  }

 private:
  void Loop(int threads) {
    at::set_num_threads(threads);
    for (;;) {
      std::function<void()> t;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [this] { return stop_ || !tasks_.empty(); });
        if (tasks_.empty()) return;
        t = std::move(tasks_.front());
        tasks_.pop_front();
      }
      t();
      std::unique_lock<std::mutex> l(mu_);
      if (awaiting_reply_) {
        cv_.wait_for(l, kReplyWait, [this] { return !awaiting_reply_ || stop_; });
        awaiting_reply_ = false;
      }
    }
  }
  static constexpr std::chrono::microseconds kReplyWait{1000};
  std::mutex mu_;
  bool awaiting_reply_ = false;  // under mu_
  std::condition_variable cv_;
  std::deque<std::function<void()>> tasks_;
  bool stop_ = false;
  std::thread thread_;
};

struct Engine::Impl {
  EngineOptions options;
  Communicator* comm = nullptr;
  std::unique_ptr<CausalLM> model;
  int max_model_len = 0;
  std::string config_fingerprint;  // of the model's config.json (ConfigFingerprint)

  struct Sequence {
    NewSequence spec;
    int32_t slot = -1;
    SeqState state;
    std::unique_ptr<Sampler> sampler;
    int32_t pending = -1;  // last sampled token, fed at the next step
    int generated = 0;
    // Tokens to compute before the next sample: the prompt, read in chunks of at most
    // --max-num-batched-tokens a step; after a preemption, the prompt and every sampled token
    // (recomputed, so the sequence goes on as if it had not stopped).
    std::vector<int32_t> feed;
    size_t fed = 0;
    bool recompute = false;
    std::vector<int32_t> history;      // the token at each position: the prompt, then sampled
    std::vector<float> prompt_logits;  // return_prompt_logits: collected over the chunks
    // Speculative decoding: the MTP head's draft of the token after `pending`, and the head's
    // output there (the hidden input of a further draft); -1 / undefined until the head has run
    // over the whole feed (again after a preemption). Sequences with images decode without.
    int64_t draft = -1;
    at::Tensor head_out;
    int32_t head_slot = -1;  // the slot when the adapter adapts the head too (else -1)
    // Chained heads (Step3.5): drafts 2 .. k, from heads 1 .. k - 1 at the same position as the
    // first; and each head's output at its last position computed from known tokens, the hidden
    // input of the next head there at the next step.
    std::vector<int64_t> more_drafts;
    std::vector<at::Tensor> chain_out;
    bool Prefilling() const { return fed < feed.size(); }
    // Images of the prompt: their tokens, patch grid, and the tower's output while the prompt
    // is being read (computed when a chunk first reaches the image, dropped once the prompt is
    // past it; a preempted sequence computes it again).
    struct Image {
      int64_t offset = 0, tokens = 0;
      vision::ProcessedImage pixels;  // the controller's resized RGB (pixel_values made per encode)
      std::string cache_key;          // the encoder cache's: the pixels' SHA-256, size, adapter
      VisionEncoding encoded;
    };
    std::vector<Image> images;
    // Multimodal RoPE with images: each prompt position's (t, h, w) rows; positions after the
    // prompt are p + rope_delta on every stream.
    std::vector<int64_t> pos3;
    int64_t rope_delta = 0;
    // Position p's three streams (text-only sequences: p on each).
    std::array<int64_t, 3> Position(int64_t p) const {
      const int64_t P = static_cast<int64_t>(spec.prompt.size());
      if (pos3.empty()) return {p, p, p};
      if (p >= P) return {p + rope_delta, p + rope_delta, p + rope_delta};
      return {pos3[p], pos3[P + p], pos3[2 * P + p]};
    }
  };
  KvCache* kv = nullptr;  // the model's
  bool prefix_caching = false;
  int spec_k = 0;  // drafts per decode step (--speculative-config), 0: none
  // Models with a vision tower: preprocessor_config.json (how pixels become pixel_values).
  std::optional<vision::ImageProcessorConfig> image_processor;
  // Tower outputs kept for reuse (--mm-encoder-cache-bytes), most recently used first; the
  // compute thread's alone.
  struct CachedEncoding {
    std::string key;
    VisionEncoding encoding;
    int64_t bytes = 0;
  };
  std::list<CachedEncoding> encoder_cache;
  std::map<std::string, std::list<CachedEncoding>::iterator> encoder_index;
  int64_t encoder_cache_bytes = 0;
  std::atomic<int64_t> encoder_cache_hits{0}, images_encoded{0};
  bool CachedEncodingFor(const std::string& key, VisionEncoding* out) {
    auto it = encoder_index.find(key);
    if (it == encoder_index.end()) return false;
    encoder_cache.splice(encoder_cache.begin(), encoder_cache, it->second);
    *out = it->second->encoding;
    return true;
  }
  // Keeps a copy of `e` (its own storage, not a view of a batch's output), evicting the least
  // recently used beyond the budget; nothing when `e` alone is larger.
  void CacheEncoding(const std::string& key, const VisionEncoding& e) {
    if (options.mm_encoder_cache_bytes <= 0 || encoder_index.count(key)) return;
    CachedEncoding c;
    c.key = key;
    c.encoding.embeds = e.embeds.clone();
    c.bytes = c.encoding.embeds.nbytes();
    for (const at::Tensor& d : e.deepstack) {
      c.encoding.deepstack.push_back(d.clone());
      c.bytes += d.nbytes();
    }
    if (c.bytes > options.mm_encoder_cache_bytes) return;
    while (encoder_cache_bytes + c.bytes > options.mm_encoder_cache_bytes) {
      encoder_cache_bytes -= encoder_cache.back().bytes;
      encoder_index.erase(encoder_cache.back().key);
      encoder_cache.pop_back();
    }
    encoder_cache_bytes += c.bytes;
    encoder_cache.push_front(std::move(c));
    encoder_index[key] = encoder_cache.begin();
  }
  mutable std::mutex step_mu;  // serialises Step, Unload's in-use check, Info
  // When the last Steps call's work ended (compute thread; under step_mu).
  std::optional<std::chrono::steady_clock::time_point> last_steps_end;
  uint64_t epoch = 0;  // the newest controller epoch seen (under step_mu)
  std::deque<Sequence> running;

  struct AdapterEntry {
    std::string path;
    int slot = -1;
    bool committed = false;
    StageResult result;
  };
  mutable std::mutex adapters_mu;  // guards adapters, free_slots and the host cache
  std::map<int64_t, AdapterEntry> adapters;
  std::set<int> free_slots;

  // Swapped-out adapters (most recently used first), as their slots held them.
  struct Cached {
    int64_t id = 0;
    std::string path;
    StageResult result;
    CausalLM::SlotImage image;
  };
  std::list<Cached> host_cache;
  int64_t host_cache_bytes = 0;

  // A joiner's images against the model (the controller checks the same before sending):
  // INVALID_ARGUMENT naming the image.
  absl::Status CheckImages(const NewSequence& n) const {
    const VisionConfig* v = model->vision();
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
          model->config().info.architecture, " has no vision tower: images are not accepted"));
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
      return absl::InvalidArgumentError(absl::StrCat("the prompt holds ", pads,
                                                     " image tokens; its ", n.images.size(),
                                                     " images take ", covered));
    }
    return absl::OkStatus();
  }

  // A joiner's images (checked): their pixels and encoder cache keys, and the prompt's multimodal
  // positions
  // (transformers' get_rope_index): text runs on; an image's tokens take (start, start + row,
  // start + column) of its merged grid; the text after it starts at start + max(rows, columns).
  void AddImages(Sequence& s) const {
    if (s.spec.images.empty()) return;
    const VisionConfig& v = *model->vision();
    const int merge = v.spatial_merge_size;
    const int64_t P = static_cast<int64_t>(s.spec.prompt.size());
    const bool mrope = !model->config().rope.mrope_section.empty();
    if (mrope) s.pos3.assign(3 * P, 0);
    int64_t cur = 0, next = 0;  // the next position; the next prompt index to place
    auto text_until = [&](int64_t stop) {
      for (; next < stop; ++next, ++cur) {
        if (mrope) s.pos3[next] = s.pos3[P + next] = s.pos3[2 * P + next] = cur;
      }
    };
    for (ImageInput& in : s.spec.images) {
      Sequence::Image im;
      im.offset = in.offset;
      im.pixels.pixels.height = in.height;
      im.pixels.pixels.width = in.width;
      im.pixels.pixels.rgb.assign(in.rgb.begin(), in.rgb.end());
      std::string().swap(in.rgb);
      im.pixels.grid_h = in.height / v.patch_size;
      im.pixels.grid_w = in.width / v.patch_size;
      im.tokens = im.pixels.tokens(merge);
      // The tower's output depends on the pixels, and on the adapter where adapters adapt it.
      im.cache_key = absl::StrCat(Sha256Hex(im.pixels.pixels.rgb), ":", in.width, "x", in.height,
                                  ":", options.enable_tower_connector_lora ? s.spec.adapter_id : 0);
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

  // Before a forward: the tower's output for every image a prompt chunk of `b` reaches that has
  // none yet (all of them in one tower call), and `b`'s image rows with their embeddings and
  // DeepStack features.
  absl::Status PrepareImages(ForwardBatch& b, const std::vector<size_t>& in_batch) {
    std::vector<VisionImage> todo;
    std::vector<Sequence::Image*> targets;
    std::vector<std::vector<float>> pixel_values;  // alive until the tower has run
    auto chunk_of = [&](size_t k, const Sequence& s) {
      return std::pair<int64_t, int64_t>(s.Prefilling() ? static_cast<int64_t>(s.fed) : -1,
                                         s.Prefilling() ? s.fed + b.seqs[k].count : -1);
    };
    // With an MTP head, the image under the next chunk's first token too: the head reads it
    // after this step (its input at the chunk's last position).
    const int64_t ahead = HeadsRun() > 0 ? 1 : 0;
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      Sequence& s = running[in_batch[k]];
      const auto [from, to] = chunk_of(k, s);
      for (Sequence::Image& im : s.images) {
        if (im.encoded.embeds.defined() || im.offset >= to + ahead ||
            im.offset + im.tokens <= from) {
          continue;
        }
        if (CachedEncodingFor(im.cache_key, &im.encoded)) {
          ++encoder_cache_hits;
          continue;
        }
        pixel_values.push_back(vision::PixelValues(im.pixels, *image_processor));
        todo.push_back(
            {at::from_blob(pixel_values.back().data(),
                           {im.pixels.patches(), image_processor->patch_dim()}, at::kFloat),
             1, im.pixels.grid_h, im.pixels.grid_w, s.slot});
        targets.push_back(&im);
      }
    }
    if (!todo.empty()) {
      MOELORA_ASSIGN_OR_RETURN(VisionEncoding e, model->EncodeImages(todo));
      int64_t row = 0;
      for (Sequence::Image* im : targets) {
        im->encoded.embeds = e.embeds.narrow(0, row, im->tokens);
        im->encoded.deepstack.clear();
        for (const at::Tensor& d : e.deepstack) {
          im->encoded.deepstack.push_back(d.narrow(0, row, im->tokens));
        }
        row += im->tokens;
        CacheEncoding(im->cache_key, im->encoded);
      }
      images_encoded += static_cast<int64_t>(targets.size());
    }
    std::vector<at::Tensor> embeds;
    std::vector<std::vector<at::Tensor>> deep;
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      Sequence& s = running[in_batch[k]];
      const auto [from, to] = chunk_of(k, s);
      for (Sequence::Image& im : s.images) {
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

  // The MTP heads a sequence runs with speculation (0: none), and the first position any of them
  // computes next (else the sequence's length): their keys and values before it are final, and
  // their queries from it reach back a sliding window.
  int HeadsRun() const {
    if (spec_k == 0) return 0;
    return model->mtp_chained() ? std::min(spec_k, model->mtp_heads()) : 1;
  }
  int64_t HeadsFrom(const Sequence& s) const {
    int64_t from = s.state.len;
    for (int h = 0; h < HeadsRun(); ++h) {
      from = std::min(from, s.state.mtp_len[static_cast<size_t>(h)]);
    }
    return from;
  }

  // A head batch's multimodal inputs: each token's RoPE streams (those of its position in its
  // sequence) and, where its input is an image token, the tower's embedding of that token, as
  // the target read it.
  struct HeadInputs {
    std::vector<std::array<int64_t, 3>> pos;
    bool mm = false;
    std::vector<int64_t> rows;
    std::vector<at::Tensor> embeds;
    // The batch's next token: position p of `s`, its input the token at position q.
    absl::Status Add(const Sequence& s, int64_t p, int64_t q) {
      const auto row = static_cast<int64_t>(pos.size());
      pos.push_back(s.Position(p));
      mm = mm || !s.pos3.empty();
      for (const Sequence::Image& im : s.images) {
        if (q < im.offset || q >= im.offset + im.tokens) continue;
        if (!im.encoded.embeds.defined()) {
          return absl::InternalError("the MTP head reads an image the tower has not encoded");
        }
        rows.push_back(row);
        embeds.push_back(im.encoded.embeds[q - im.offset]);
      }
      return absl::OkStatus();
    }
    void Into(ForwardBatch& h) const {
      if (mm) {
        const auto T = static_cast<int64_t>(pos.size());
        h.positions3.resize(3 * T);
        for (int64_t i = 0; i < T; ++i) {
          for (int r = 0; r < 3; ++r) h.positions3[r * T + i] = pos[i][r];
        }
      }
      if (!rows.empty()) {
        h.visual_rows = rows;
        h.visual_embeds = at::stack(embeds, 0);
      }
    }
  };

  // Speculation, before the forward: drafts 2 .. d of the batch's decodes with d drafts (their
  // tokens after `pending` and d1 hold placeholders): each sequence's last draft through the
  // head, from the head's own last output, the sequences batched, while any needs more.
  absl::Status DraftMore(ForwardBatch& b, const std::vector<size_t>& in_batch,
                         const std::vector<int64_t>& ndraft, const std::vector<int64_t>& head_len) {
    std::vector<size_t> who;  // b.seqs entries still drafting
    std::vector<at::Tensor> rows;
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      if (ndraft[in_batch[k]] < 2) continue;
      if (b.seqs[k].state->mtp_len[0] != head_len[k]) {
        return absl::InternalError("head out of step");
      }
      who.push_back(k);
      rows.push_back(running[in_batch[k]].head_out);
    }
    if (who.empty()) return absl::OkStatus();
    at::Tensor z = at::stack(rows, 0);
    for (int64_t j = 1; !who.empty(); ++j) {
      ForwardBatch h;
      HeadInputs mm;
      for (size_t k : who) {
        h.seqs.push_back({b.seqs[k].state, static_cast<int64_t>(h.tokens.size()), 1, false, false});
        h.tokens.push_back(b.tokens[b.seqs[k].begin + j]);
        h.slots.push_back(running[in_batch[k]].head_slot);
        const int64_t p = b.seqs[k].state->mtp_len[0];  // a draft (text) after the prompt
        MOELORA_RETURN_IF_ERROR(mm.Add(running[in_batch[k]], p, p + 1));
      }
      mm.Into(h);
      at::Tensor z2;
      MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, model->ForwardMtp(h, z, &z2));
      std::vector<size_t> more;
      std::vector<int64_t> keep;
      for (size_t i = 0; i < who.size(); ++i) {
        const size_t k = who[i];
        b.tokens[b.seqs[k].begin + j + 1] =
            logits[static_cast<int64_t>(i)].argmax().item<int64_t>();
        if (ndraft[in_batch[k]] > j + 1) {
          more.push_back(k);
          keep.push_back(static_cast<int64_t>(i));
        }
      }
      if (!more.empty()) z = z2.index_select(0, at::tensor(keep, at::kLong).to(z2.device()));
      who = std::move(more);
    }
    return absl::OkStatus();
  }

  // Speculation, after the step's tokens: every running sequence of the batch that drafts (no
  // images) gives back the positions of its rejected drafts (recurrent states included), and
  // the head runs over the positions the target computed and kept — a prompt chunk's, or a
  // decode's kept drafts and the target's own token — with the target's hidden states there,
  // its inputs the tokens one position on (the next chunk's first, or the sampled token).
  // A sequence past its feed gets its next draft and head output.
  absl::Status AfterVerify(const ForwardBatch& b, const std::vector<size_t>& in_batch,
                           const std::vector<int64_t>& nd, const std::vector<char>& was_prefilling,
                           const std::vector<std::vector<int32_t>>& tokens,
                           const std::vector<int64_t>& head_len,
                           const std::set<int64_t>& finished) {
    if (model->mtp_chained()) {
      return AfterVerifyChained(b, in_batch, nd, was_prefilling, tokens, finished);
    }
    const at::Tensor hidden = model->last_hidden();
    if (!hidden.defined() || hidden.size(0) != static_cast<int64_t>(b.tokens.size())) {
      return absl::InternalError("the forward kept no hidden states for the MTP head");
    }
    ForwardBatch h;
    HeadInputs mm;
    std::vector<at::Tensor> rows;
    std::vector<Sequence*> seqs;
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      Sequence& s = running[in_batch[k]];
      if (finished.count(s.spec.id)) continue;
      const ForwardBatch::Seq& f = b.seqs[k];
      std::vector<int64_t> in;
      int64_t count = f.count;
      if (was_prefilling[k]) {
        in.assign(b.tokens.begin() + f.begin + 1, b.tokens.begin() + f.begin + f.count);
        in.push_back(s.Prefilling() ? s.feed[s.fed] : tokens[k].front());
      } else {
        count = static_cast<int64_t>(tokens[k].size());
        if (nd[k] > 0) MOELORA_RETURN_IF_ERROR(model->RollBack(s.state, nd[k] + 1, count));
        in.assign(tokens[k].begin(), tokens[k].end());
      }
      s.state.mtp_len[0] = head_len[k];
      if (head_len[k] != s.state.len - count) return absl::InternalError("head out of step");
      h.seqs.push_back({&s.state, static_cast<int64_t>(h.tokens.size()), count, false, false});
      h.tokens.insert(h.tokens.end(), in.begin(), in.end());
      h.slots.insert(h.slots.end(), count, s.head_slot);
      for (int64_t i = 0; i < count; ++i) {
        MOELORA_RETURN_IF_ERROR(mm.Add(s, head_len[k] + i, head_len[k] + i + 1));
      }
      rows.push_back(hidden.narrow(0, f.begin, count));
      seqs.push_back(&s);
    }
    if (seqs.empty()) return absl::OkStatus();
    mm.Into(h);
    at::Tensor z;
    MOELORA_ASSIGN_OR_RETURN(at::Tensor logits, model->ForwardMtp(h, at::cat(rows, 0), &z));
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& s = *seqs[i];
      if (s.Prefilling()) continue;
      s.draft = logits[static_cast<int64_t>(i)].argmax().item<int64_t>();
      s.head_out = z[static_cast<int64_t>(i)];
    }
    return absl::OkStatus();
  }

  // AfterVerify with chained heads (Step3.5): after the rejected drafts' positions are given
  // back, each head j in turn runs over its positions from where it stopped up to the target's
  // last, batched over the sequences. Head j at position p reads token p + 1 + j (known, or for
  // the last j positions of a decode the drafts of the heads before it) and head j - 1's output
  // at p (head 0: the target's hidden state). It keeps its positions up to the last one whose
  // token is known (the others are computed again next step) and its output there (the next
  // step's input of head j + 1 one position back). A sequence past its feed gets drafts 1 .. k:
  // each head's argmax at the target's last position.
  absl::Status AfterVerifyChained(const ForwardBatch& b, const std::vector<size_t>& in_batch,
                                  const std::vector<int64_t>& nd,
                                  const std::vector<char>& was_prefilling,
                                  const std::vector<std::vector<int32_t>>& tokens,
                                  const std::set<int64_t>& finished) {
    const at::Tensor hidden = model->last_hidden();
    if (!hidden.defined() || hidden.size(0) != static_cast<int64_t>(b.tokens.size())) {
      return absl::InternalError("the forward kept no hidden states for the MTP head");
    }
    std::vector<Sequence*> seqs;
    // Per sequence: the previous head's outputs of this pass (the target's hidden states for
    // head 0), over positions prev_at .. prev_at + rows - 1.
    std::vector<at::Tensor> prev;
    std::vector<int64_t> prev_at;
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      Sequence& s = running[in_batch[k]];
      if (!s.images.empty() || finished.count(s.spec.id)) continue;
      const ForwardBatch::Seq& f = b.seqs[k];
      int64_t count = f.count;
      if (!was_prefilling[k]) {
        count = static_cast<int64_t>(tokens[k].size());
        if (nd[k] > 0) MOELORA_RETURN_IF_ERROR(model->RollBack(s.state, nd[k] + 1, count));
      }
      if (s.state.mtp_len[0] != s.state.len - count) {
        return absl::InternalError("head out of step");
      }
      seqs.push_back(&s);
      prev.push_back(hidden.narrow(0, f.begin, count));
      prev_at.push_back(s.state.len - count);
    }
    const int heads = std::min(spec_k, model->mtp_heads());
    std::vector<std::vector<int64_t>> drafts(seqs.size());
    for (int j = 0; j < heads; ++j) {
      const auto J = static_cast<size_t>(j);
      ForwardBatch h;
      std::vector<at::Tensor> rows;
      std::vector<size_t> who;
      std::vector<int64_t> from, real;
      for (size_t i = 0; i < seqs.size(); ++i) {
        Sequence& s = *seqs[i];
        s.chain_out.resize(static_cast<size_t>(heads));
        const int64_t H = s.state.len, K = static_cast<int64_t>(s.history.size());
        const int64_t a = s.state.mtp_len[J];
        const int64_t real_end = std::min(H, K - 1 - j);
        const int64_t end = s.Prefilling() ? real_end : H;
        if (end <= a) {
          prev[i] = at::Tensor();
          prev_at[i] = a;
          continue;
        }
        if (real_end < a || a < prev_at[i] - 1 || (a < prev_at[i] && j == 0) ||
            (a < prev_at[i] && !s.chain_out[J - 1].defined())) {
          return absl::InternalError(absl::StrCat("MTP head ", j, " out of step"));
        }
        std::vector<at::Tensor> in;
        if (a < prev_at[i]) in.push_back(s.chain_out[J - 1].unsqueeze(0));
        if (end > prev_at[i]) in.push_back(prev[i].narrow(0, 0, end - prev_at[i]));
        rows.push_back(in.size() == 1 ? in[0] : at::cat(in, 0));
        h.seqs.push_back({&s.state, static_cast<int64_t>(h.tokens.size()), end - a, false, false});
        for (int64_t p = a; p < end; ++p) {
          const int64_t q = p + 1 + j;
          h.tokens.push_back(q < K ? s.history[static_cast<size_t>(q)]
                                   : drafts[i][static_cast<size_t>(q - K)]);
        }
        h.slots.insert(h.slots.end(), end - a, s.head_slot);
        who.push_back(i);
        from.push_back(a);
        real.push_back(real_end);
      }
      if (who.empty()) break;
      at::Tensor z;
      MOELORA_ASSIGN_OR_RETURN(at::Tensor logits,
                               model->ForwardMtp(h, at::cat(rows, 0), &z, j, /*every_row=*/true));
      for (size_t w = 0; w < who.size(); ++w) {
        const size_t i = who[w];
        Sequence& s = *seqs[i];
        const ForwardBatch::Seq& hs = h.seqs[w];
        prev[i] = z.narrow(0, hs.begin, hs.count);
        prev_at[i] = from[w];
        s.state.mtp_len[J] = real[w];
        if (real[w] - 1 >= from[w]) s.chain_out[J] = prev[i][real[w] - 1 - from[w]];
        if (!s.Prefilling()) {
          drafts[i].push_back(logits[static_cast<int64_t>(w)].argmax().item<int64_t>());
        }
      }
    }
    for (size_t i = 0; i < seqs.size(); ++i) {
      Sequence& s = *seqs[i];
      if (s.Prefilling()) continue;
      if (static_cast<int>(drafts[i].size()) != heads) {
        return absl::InternalError("a chained MTP head drafted nothing");
      }
      s.draft = drafts[i][0];
      s.more_drafts.assign(drafts[i].begin() + 1, drafts[i].end());
    }
    return absl::OkStatus();
  }

  // Under adapters_mu.
  HostCacheStats CacheStats() const {
    HostCacheStats st;
    st.adapters = static_cast<int>(host_cache.size());
    st.bytes = host_cache_bytes;
    for (const Cached& c : host_cache) st.adapter_ids.push_back(c.id);
    return st;
  }
  // Under adapters_mu: removes and returns the entry for `id` (any path), if any.
  std::optional<Cached> TakeCached(int64_t id) {
    for (auto it = host_cache.begin(); it != host_cache.end(); ++it) {
      if (it->id != id) continue;
      Cached c = std::move(*it);
      host_cache_bytes -= c.image.bytes;
      host_cache.erase(it);
      return c;
    }
    return std::nullopt;
  }

  // Last: destroyed first, so no Step runs while the rest goes.
  std::unique_ptr<ComputeThread> compute;
};

Engine::Engine(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Engine::~Engine() = default;

absl::StatusOr<std::unique_ptr<Engine>> Engine::Create(const EngineOptions& o, Communicator* comm) {
  MOELORA_RETURN_IF_ERROR(ValidateDType(o.dtype));
  if (o.max_num_seqs < 1) return absl::InvalidArgumentError("--max-num-seqs must be >= 1");
  if (o.num_threads < 0) return absl::InvalidArgumentError("--num-threads must be >= 0");
  if (o.max_cpu_loras < 0) return absl::InvalidArgumentError("--max-cpu-loras must be >= 0");
  // libgomp may report one thread under a CPU quota; set the pool size explicitly.
  const int hw = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  const int threads = o.num_threads > 0 ? o.num_threads : std::max(1, hw / comm->world_size());
  at::set_num_threads(threads);
  auto impl = std::make_unique<Impl>();
  impl->compute = std::make_unique<ComputeThread>(threads);
  impl->options = o;
  impl->comm = comm;
  ModelOptions mo;
  mo.tp_rank = comm->rank();
  mo.tp_size = comm->world_size();
  mo.dtype = o.dtype == "bfloat16" ? at::kBFloat16 : at::kFloat;
  int cuda_index = -1;
  MOELORA_RETURN_IF_ERROR(ParseDevice(o.device, &cuda_index));
  if (o.device == "cpu-twins") {
    mo.kernels = LoraKernels::kCpuTwins;
  } else if (absl::StartsWith(o.device, "cuda")) {
    mo.kernels = LoraKernels::kCuda;
    const int n = CudaDeviceCount();
    mo.cuda_device = cuda_index >= 0 ? cuda_index : (n > 0 ? comm->rank() % n : 0);
  }
  mo.max_loras = o.max_loras;
  mo.max_lora_rank = o.max_lora_rank;
  mo.mixed_moe_lora_format = o.enable_mixed_moe_lora_format;
  mo.expert_parallel = o.enable_expert_parallel;
  mo.fully_sharded_loras = o.fully_sharded_loras;
  mo.dummy_weights = o.dummy_weights;
  mo.tower_connector_lora = o.enable_tower_connector_lora;
  if (o.num_speculative_tokens < 0) {
    return absl::InvalidArgumentError("num_speculative_tokens must be >= 0");
  }
  mo.mtp = o.num_speculative_tokens > 0;
  MOELORA_ASSIGN_OR_RETURN(impl->model,
                           impl->compute->Run([&] { return LoadCausalLM(o.model_dir, mo, comm); }));
  if (mo.mtp && !impl->model->has_mtp()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--speculative-config method mtp: ", impl->model->config().info.architecture,
                     " from ", o.model_dir,
                     " has no MTP head this server can build (Qwen3.5/3.6-MoE checkpoints with "
                     "mtp_num_hidden_layers and mtp.* weights, Step3.5 with "
                     "num_nextn_predict_layers and its layers after num_hidden_layers)"));
  }
  if (mo.mtp && impl->model->mtp_chained() && o.num_speculative_tokens > impl->model->mtp_heads()) {
    return absl::FailedPreconditionError(
        absl::StrCat("--speculative-config num_speculative_tokens ", o.num_speculative_tokens, ": ",
                     impl->model->config().info.architecture, " from ", o.model_dir,
                     " declares num_nextn_predict_layers ", impl->model->mtp_heads(),
                     " (one MTP layer per draft token, each reading the one before): at most ",
                     impl->model->mtp_heads(), " a step"));
  }
  impl->spec_k = o.num_speculative_tokens;
  const int cfg_len = impl->model->config().max_position_embeddings;
  impl->max_model_len = o.max_model_len > 0 ? o.max_model_len : cfg_len;
  MOELORA_ASSIGN_OR_RETURN(impl->config_fingerprint, ConfigFingerprint(o.model_dir));
  if (impl->max_model_len <= 1) {
    return absl::InvalidArgumentError(
        "--max-model-len must be > 1 (config has no max_position_embeddings)");
  }
  if (o.max_num_batched_tokens < o.max_num_seqs) {
    return absl::InvalidArgumentError(
        absl::StrCat("--max-num-batched-tokens ", o.max_num_batched_tokens,
                     " must be >= --max-num-seqs ", o.max_num_seqs, " (every decode in one step)"));
  }
  KvCacheOptions ko;
  ko.block_size = o.block_size;
  ko.memory_bytes = o.kv_cache_memory_bytes;
  // No more blocks than --max-num-seqs sequences of max_model_len tokens can hold.
  ko.max_blocks = static_cast<int64_t>(o.max_num_seqs) *
                  ((impl->max_model_len + o.block_size - 1) / o.block_size);
  ko.max_model_len = impl->max_model_len;
  ko.max_num_seqs = o.max_num_seqs;
  ko.max_num_batched_tokens = o.max_num_batched_tokens;
  ko.head_lag = impl->HeadsRun();  // MTP heads query from up to this many positions back
  CausalLM* model = impl->model.get();
  MOELORA_RETURN_IF_ERROR(impl->compute->Run([&] { return model->InitKvCache(ko); }));
  impl->kv = model->kv_cache();
  // With speculation only for chained heads (Step3.5): a reused head's cached blocks would lack
  // its keys and values (and Qwen3.5 has recurrent layers anyway).
  impl->prefix_caching = o.enable_prefix_caching && !model->has_recurrent_layers() &&
                         (impl->spec_k == 0 || model->mtp_chained());
  if (const VisionConfig* v = model->vision()) {
    MOELORA_ASSIGN_OR_RETURN(impl->image_processor,
                             vision::ImageProcessorConfig::Load(o.model_dir));
    if (impl->image_processor->patch_size != v->patch_size ||
        impl->image_processor->merge_size != v->spatial_merge_size ||
        impl->image_processor->temporal_patch_size != v->temporal_patch_size) {
      return absl::InvalidArgumentError(
          absl::StrCat(o.model_dir,
                       "/preprocessor_config.json: patch_size, merge_size and "
                       "temporal_patch_size must equal vision_config's patch_size (",
                       v->patch_size, "), spatial_merge_size (", v->spatial_merge_size,
                       ") and temporal_patch_size (", v->temporal_patch_size, ")"));
    }
  }
  LOG(INFO) << "KV cache: " << impl->kv->num_blocks() << " blocks of " << o.block_size
            << " tokens, " << impl->kv->bytes_per_block() << " bytes each ("
            << impl->kv->num_blocks() * impl->kv->bytes_per_block() << " bytes reserved)";
  if (impl->kv->window_blocks() > 0) {
    LOG(INFO) << "KV cache, sliding-window layers: " << impl->kv->window_blocks() << " blocks ("
              << impl->kv->window_bytes() << " bytes of the budget)";
  }
  {
    const int64_t slots = model->AllocatedSlotBytes(true) + model->AllocatedSlotBytes(false);
    LOG(INFO) << "LoRA slots: " << o.max_loras << " of up to " << slots / std::max(1, o.max_loras)
              << " bytes at rank " << o.max_lora_rank << " ("
              << (!absl::StartsWith(o.device, "cuda")
                      ? "host memory taken only while a slot holds an adapter"
                      : "allocated on the device")
              << ")";
  }
  if (impl->kv->state_entries() > 0) {
    LOG(INFO) << "Recurrent state: " << impl->kv->state_entries() << " entries of "
              << impl->kv->state_bytes_per_entry() << " bytes ("
              << impl->kv->state_entries() * impl->kv->state_bytes_per_entry()
              << " bytes reserved beside the budget)";
  }
  for (int s = 0; s < o.max_loras; ++s) impl->free_slots.insert(s);
  return std::unique_ptr<Engine>(new Engine(std::move(impl)));
}

absl::StatusOr<StageResult> Engine::StageAdapter(int64_t id, const std::string& path,
                                                 std::optional<AdapterFormat> expected) {
  return impl_->compute->Run([&] { return StageOnComputeThread(id, path, expected); });
}

absl::StatusOr<StageResult> Engine::StageOnComputeThread(int64_t id, const std::string& path,
                                                         std::optional<AdapterFormat> expected) {
  Impl& m = *impl_;
  if (id <= 0) return absl::InvalidArgumentError(absl::StrCat("adapter id ", id, " must be > 0"));
  int slot = -1;
  {
    std::lock_guard<std::mutex> lock(m.adapters_mu);
    auto it = m.adapters.find(id);
    if (it != m.adapters.end()) {
      if (it->second.path == path) return it->second.result;  // idempotent
      return absl::AlreadyExistsError(absl::StrCat("adapter id ", id, " is already ",
                                                   it->second.committed ? "loaded" : "staged",
                                                   " from ", it->second.path));
    }
    if (m.free_slots.empty()) {
      return absl::ResourceExhaustedError(
          absl::StrCat("all ", m.options.max_loras, " LoRA slots (--max-loras) are in use"));
    }
    slot = *m.free_slots.begin();
    m.free_slots.erase(m.free_slots.begin());
    m.adapters[id] = Impl::AdapterEntry{path, slot, false, {}};
  }
  auto release = [&]() {
    std::lock_guard<std::mutex> lock(m.adapters_mu);
    m.adapters.erase(id);
    m.free_slots.insert(slot);
  };
  // The host cache first: a swap-in copies the slot's saved image back, reading no file.
  std::optional<Impl::Cached> cached;
  {
    std::lock_guard<std::mutex> lock(m.adapters_mu);
    cached = m.TakeCached(id);
  }
  if (cached && cached->path == path) {
    const auto t0 = std::chrono::steady_clock::now();
    absl::Status s = GuardTorch(absl::StrCat("swap in adapter ", path, " from the host cache"),
                                [&] { return m.model->RestoreSlot(slot, cached->image); });
    if (s.ok()) {
      StageResult r = cached->result;
      r.from_host_cache = true;
      r.phase_seconds = {{"swap_in", Since(t0)}};
      std::lock_guard<std::mutex> lock(m.adapters_mu);
      m.adapters[id].result = r;
      return r;
    }
    // Read it from disk instead.
    LOG(WARNING) << "adapter id " << id << ": restoring from the host cache failed (" << s
                 << "); reading " << path;
    ResetSlot(*m.model, slot).IgnoreError();
  }
  AdapterReadOptions ro;
  ro.model = m.model->config().info;
  ro.max_rank = m.options.max_lora_rank;
  ro.expected_format = expected;
  ro.convert_to_2d = m.options.enable_mixed_moe_lora_format;
  AdapterLoadTimings t;
  absl::StatusOr<LoraAdapter> a = ReadAdapter(path, ro, &t);
  if (!a.ok()) {
    release();
    return a.status();
  }
  const auto t0 = std::chrono::steady_clock::now();
  if (absl::Status s = GuardTorch(absl::StrCat("load adapter ", path),
                                  [&] { return m.model->SetSlot(slot, *a); });
      !s.ok()) {
    // SetSlot left the slot clear unless libtorch threw half-way; clear it again either way.
    ResetSlot(*m.model, slot).IgnoreError();
    release();
    return s;
  }
  StageResult r;
  r.detected_format = a->format;
  r.converted_to_2d = a->converted_to_2d;
  r.bytes = m.model->SlotBytes(*a);
  r.rank = a->max_rank;
  if (m.model->has_mtp()) {
    for (const auto& [module, pair] : a->dense) r.adapts_draft |= m.model->IsMtpModule(module);
    for (const auto& [prefix, moe] : a->moe) r.adapts_draft |= m.model->IsMtpModule(prefix);
  }
  r.phase_seconds = {
      {"read", t.read}, {"validate", t.validate}, {"convert", t.convert}, {"copy", Since(t0)}};
  std::lock_guard<std::mutex> lock(m.adapters_mu);
  m.adapters[id].result = r;
  return r;
}

absl::StatusOr<int> Engine::CommitAdapter(int64_t id) {
  std::lock_guard<std::mutex> lock(impl_->adapters_mu);
  auto it = impl_->adapters.find(id);
  if (it == impl_->adapters.end()) {
    return absl::NotFoundError(absl::StrCat("adapter id ", id, " was not staged"));
  }
  it->second.committed = true;
  return it->second.slot;
}

absl::Status Engine::AbortAdapter(int64_t id) {
  return impl_->compute->Run([&] { return AbortOnComputeThread(id); });
}

absl::Status Engine::AbortOnComputeThread(int64_t id) {
  Impl& m = *impl_;
  int slot = -1;
  {
    std::lock_guard<std::mutex> lock(m.adapters_mu);
    auto it = m.adapters.find(id);
    if (it == m.adapters.end() || it->second.committed) return absl::OkStatus();
    slot = it->second.slot;
    m.adapters.erase(it);
  }
  // A slot that could not be cleared is not handed out again.
  MOELORA_RETURN_IF_ERROR(ResetSlot(*m.model, slot));
  std::lock_guard<std::mutex> lock(m.adapters_mu);
  m.free_slots.insert(slot);
  return absl::OkStatus();
}

absl::StatusOr<HostCacheStats> Engine::UnloadAdapter(int64_t id, bool keep_in_host_cache) {
  return impl_->compute->Run([&] { return UnloadOnComputeThread(id, keep_in_host_cache); });
}

absl::StatusOr<HostCacheStats> Engine::UnloadOnComputeThread(int64_t id, bool keep_in_host_cache) {
  Impl& m = *impl_;
  std::lock_guard<std::mutex> step_lock(m.step_mu);
  int slot = -1;
  Impl::Cached saved;
  {
    std::lock_guard<std::mutex> lock(m.adapters_mu);
    auto it = m.adapters.find(id);
    if (it == m.adapters.end() || !it->second.committed) {
      if (!keep_in_host_cache) m.TakeCached(id);  // an unload by the user forgets it entirely
      return absl::NotFoundError(absl::StrCat("adapter id ", id, " is not loaded"));
    }
    slot = it->second.slot;
    saved.id = id;
    saved.path = it->second.path;
    saved.result = it->second.result;
  }
  for (const auto& s : m.running) {
    if (s.slot == slot) {
      return absl::FailedPreconditionError(absl::StrCat(
          "adapter id ", id, " is used by running sequence ", s.spec.id, "; unload it when done"));
    }
  }
  // Step is excluded (step_mu) and the slot is committed, so nothing writes it meanwhile.
  bool keep = keep_in_host_cache && m.options.max_cpu_loras > 0;
  if (keep) {
    absl::Status s = GuardTorch(absl::StrCat("keep adapter id ", id, " in the host cache"), [&] {
      saved.image = m.model->SaveSlot(slot);
      return absl::OkStatus();
    });
    if (!s.ok()) {
      // Not cached: the next swap-in reads the file again.
      LOG(WARNING) << s;
      keep = false;
    }
  }
  MOELORA_RETURN_IF_ERROR(ResetSlot(*m.model, slot));
  std::lock_guard<std::mutex> lock(m.adapters_mu);
  m.adapters.erase(id);
  m.free_slots.insert(slot);
  m.TakeCached(id);
  if (keep) {
    m.host_cache_bytes += saved.image.bytes;
    m.host_cache.push_front(std::move(saved));
    while (static_cast<int>(m.host_cache.size()) > m.options.max_cpu_loras) {
      m.host_cache_bytes -= m.host_cache.back().image.bytes;
      m.host_cache.pop_back();
    }
  }
  return m.CacheStats();
}

int64_t Engine::SlotResidentBytes() const { return impl_->model->ResidentSlotBytes(); }

absl::StatusOr<StepOutput> Engine::Step(const std::vector<NewSequence>& add,
                                        const std::vector<int64_t>& remove) {
  return impl_->compute->Run([&] { return StepOnComputeThread(add, remove); });
}

absl::StatusOr<std::vector<StepOutput>> Engine::Steps(const std::vector<NewSequence>& add,
                                                      const std::vector<int64_t>& remove, int steps,
                                                      const std::function<void()>& before_step,
                                                      const std::function<void()>& queued,
                                                      const StepControl& control) {
  return impl_->compute->Run(
      [&]() -> absl::StatusOr<std::vector<StepOutput>> {
        {
          Impl& m = *impl_;
          std::lock_guard<std::mutex> lock(m.step_mu);
          if (control.epoch != 0 && control.epoch < m.epoch) {
            return absl::FailedPreconditionError(absl::StrCat(
                "a newer controller (epoch ", m.epoch, ") drives this worker; this call's epoch ",
                control.epoch, " is older: the controller that sent it should stop"));
          }
          bool drop_all = control.drop_all;
          if (control.epoch > m.epoch) {
            if (m.epoch != 0) LOG(WARNING) << "a new controller (epoch " << control.epoch << ")";
            m.epoch = control.epoch;
            drop_all = true;
          }
          if (drop_all) {
            if (!m.running.empty()) {
              LOG(WARNING) << "dropping " << m.running.size()
                           << " sequences no controller knows of";
            }
            m.running.clear();
          } else if (control.epoch != 0) {
            // Strays: held, neither expected after this call nor leaving in it.
            const std::set<int64_t> keep(control.expected.begin(), control.expected.end());
            const std::set<int64_t> leaving(remove.begin(), remove.end());
            for (auto it = m.running.begin(); it != m.running.end();) {
              const int64_t id = it->spec.id;
              if (keep.count(id) || leaving.count(id)) {
                ++it;
                continue;
              }
              LOG(WARNING) << "dropping sequence " << id << ": the controller does not expect it";
              it = m.running.erase(it);
            }
          }
        }
        const auto start = std::chrono::steady_clock::now();
        double idle = -1;
        {
          std::lock_guard<std::mutex> lock(impl_->step_mu);
          if (!impl_->running.empty() && impl_->last_steps_end) {
            idle = std::chrono::duration<double>(start - *impl_->last_steps_end).count();
          }
        }
        std::vector<StepOutput> outs;
        for (int i = 0; i < std::max(steps, 1); ++i) {
          if (i > 0) {
            std::lock_guard<std::mutex> lock(impl_->step_mu);
            if (impl_->running.empty()) break;
          }
          if (before_step) before_step();
          absl::StatusOr<StepOutput> out =
              i == 0 ? StepOnComputeThread(add, remove) : StepOnComputeThread({}, {});
          if (!out.ok()) return out.status();
          const bool failed = !out->failed.empty();
          outs.push_back(std::move(*out));
          if (failed) break;  // the controller ends those requests before the next step
        }
        if (!outs.empty()) outs.front().idle_before_seconds = idle;
        {
          std::lock_guard<std::mutex> lock(impl_->step_mu);
          impl_->last_steps_end = std::chrono::steady_clock::now();
        }
        return outs;
      },
      queued, /*replied=*/true);
}

void Engine::StepsReplied() { impl_->compute->Replied(); }

absl::StatusOr<StepOutput> Engine::StepOnComputeThread(const std::vector<NewSequence>& add,
                                                       const std::vector<int64_t>& remove) {
  Impl& m = *impl_;
  const auto t0 = std::chrono::steady_clock::now();
  std::lock_guard<std::mutex> step_lock(m.step_mu);
  const int64_t vocab = m.model->config().vocab_size;
  // Validate joiners before changing anything.
  std::set<int64_t> remove_set(remove.begin(), remove.end());
  std::set<int64_t> ids;
  for (const auto& s : m.running) {
    if (!remove_set.count(s.spec.id)) ids.insert(s.spec.id);
  }
  std::vector<int32_t> slots, head_slots;
  for (const NewSequence& n : add) {
    auto bad = [&](auto&&... parts) {
      return absl::InvalidArgumentError(absl::StrCat("sequence ", n.id, ": ", parts...));
    };
    if (!ids.insert(n.id).second) {
      return absl::AlreadyExistsError(absl::StrCat("sequence ", n.id, " is already running"));
    }
    if (n.prompt.empty()) return bad("empty prompt");
    if (const int i = FirstTokenOutsideVocabulary(n.prompt, vocab); i >= 0) {
      return bad("prompt token ", n.prompt[i], " at position ", i, " is outside [0, ", vocab, ")");
    }
    if (static_cast<int>(n.prompt.size()) >= m.max_model_len) {
      return bad("prompt of ", n.prompt.size(), " tokens leaves no room under max_model_len ",
                 m.max_model_len);
    }
    if (absl::Status st = m.CheckImages(n); !st.ok()) return bad(st.message());
    int32_t slot = -1, head_slot = -1;
    if (n.adapter_id != 0) {
      std::lock_guard<std::mutex> lock(m.adapters_mu);
      auto it = m.adapters.find(n.adapter_id);
      if (it == m.adapters.end() || !it->second.committed) {
        return absl::NotFoundError(
            absl::StrCat("sequence ", n.id, ": adapter id ", n.adapter_id, " is not loaded"));
      }
      slot = it->second.slot;
      head_slot = it->second.result.adapts_draft ? slot : -1;
    }
    // The rules the controller applies too (common/request_rules.h).
    for (absl::Status st :
         {CheckMaxTokens(n.max_tokens, static_cast<int64_t>(n.prompt.size()), m.max_model_len),
          CheckSampling(n.sampling.temperature, n.sampling.top_p, n.sampling.top_k),
          CheckStopTokenIds(n.stop_token_ids, vocab)}) {
      if (!st.ok()) return bad(st.message());
    }
    if (absl::Status st = CheckFitsKvCache(static_cast<int64_t>(n.prompt.size()), n.max_tokens,
                                           m.kv->num_blocks(), m.kv->block_size());
        !st.ok()) {
      return bad(st.message());
    }
    slots.push_back(slot);
    head_slots.push_back(head_slot);
  }
  if (static_cast<int>(ids.size()) > m.options.max_num_seqs) {
    return absl::ResourceExhaustedError(
        absl::StrCat(ids.size(), " sequences exceed --max-num-seqs ", m.options.max_num_seqs));
  }
  // Apply.
  for (auto it = m.running.begin(); it != m.running.end();) {
    it = remove_set.count(it->spec.id) ? m.running.erase(it) : std::next(it);
  }
  for (size_t i = 0; i < add.size(); ++i) {
    Impl::Sequence s;
    s.spec = add[i];
    s.slot = slots[i];
    s.head_slot = head_slots[i];
    s.state = m.model->NewState();
    s.sampler = std::make_unique<Sampler>(add[i].sampling);
    s.feed = add[i].prompt;
    s.history = add[i].prompt;
    m.AddImages(s);
    m.running.push_back(std::move(s));
  }
  StepOutput out;
  if (m.running.empty()) return out;
  // The step's plan: how many tokens each sequence computes (0: none this step).
  const size_t nrun = m.running.size();
  std::vector<int64_t> take(nrun, 0);
  std::vector<int64_t> ndraft(nrun, 0);  // drafts each decode verifies (speculation)
  auto preempt = [&](size_t j) {
    Impl::Sequence& v = m.running[j];
    // Recomputed from the start: the prompt and every token sampled, the last of which (the
    // pending one) is fed last, so the next sample is the one its decode step would have made.
    v.feed = v.history;
    v.fed = 0;
    v.recompute = true;
    v.state = m.model->NewState();  // frees its blocks
    v.draft = -1;                   // the head runs over the recomputed feed again
    v.head_out = at::Tensor();
    v.more_drafts.clear();
    v.chain_out.clear();
    take[j] = 0;
    ndraft[j] = 0;
    ++out.preempted;
  };
  // The latest admitted sequence holding blocks, after `after` (or `after` itself).
  auto victim = [&](size_t after) {
    for (size_t j = nrun; j-- > after + 1;) {
      if (m.running[j].state.table.Holds()) return j;
    }
    return after;
  };
  int64_t budget = m.options.max_num_batched_tokens;
  for (;;) {
    // Decodes first, in admission order; a decode that finds no free block preempts the latest
    // admitted sequence (itself if it is the latest). With speculation, a decode also verifies
    // its drafts, out of what the budget holds beyond one token per decode and the prompt tokens
    // waiting (up to what a step reads beside decodes: drafts may be rejected, prompt tokens
    // are progress), in admission order, where free blocks allow (drafts never preempt), and no
    // more than its max_tokens and max_model_len leave room for.
    int64_t spare = budget, waiting = 0;
    for (size_t i = 0; i < nrun; ++i) {
      const Impl::Sequence& s = m.running[i];
      if (take[i] > 0) continue;
      if (s.Prefilling()) {
        waiting += static_cast<int64_t>(s.feed.size() - s.fed);
      } else {
        --spare;
      }
    }
    if (m.options.prefill_tokens_beside_decodes > 0) {
      waiting = std::min<int64_t>(waiting, m.options.prefill_tokens_beside_decodes);
    }
    spare -= waiting;
    for (size_t i = 0; i < nrun && budget > 0; ++i) {
      Impl::Sequence& s = m.running[i];
      if (s.Prefilling() || take[i] > 0) continue;
      int64_t d = 0;
      if (s.draft >= 0) {
        d = std::min<int64_t>(
            {m.spec_k, spare, m.max_model_len - 2 - s.state.len,
             s.spec.max_tokens > 0 ? s.spec.max_tokens - s.generated - 1 : int64_t{m.spec_k}});
        if (m.model->mtp_chained()) {
          d = std::min<int64_t>(d, 1 + static_cast<int64_t>(s.more_drafts.size()));
        }
        if (d > 0 && !m.kv->Reserve(s.state.table, s.state.len + 1 + d)) d = 0;
        d = std::max<int64_t>(d, 0);
      }
      bool self = false;
      while (!m.kv->Reserve(s.state.table, s.state.len + 1)) {
        const size_t j = victim(i);
        preempt(j);
        if (j == i) {
          self = true;
          break;
        }
      }
      if (self) continue;
      take[i] = 1 + d;
      ndraft[i] = d;
      spare -= d;
      budget -= 1 + d;
    }
    // While sequences decode, a step reads at most --prefill-tokens-beside-decodes prompt
    // tokens, so a long prompt cannot stretch their inter-token time to its chunk's.
    int64_t decodes = 0;
    for (int64_t t : take) decodes += t;
    if (decodes > 0 && m.options.prefill_tokens_beside_decodes > 0) {
      budget = std::min<int64_t>(budget, m.options.prefill_tokens_beside_decodes);
    }
    // Then chunks of prompts (and recomputations), in admission order, while the budget and the
    // free blocks last.
    for (size_t i = 0; i < nrun && budget > 0; ++i) {
      Impl::Sequence& s = m.running[i];
      if (!s.Prefilling() || take[i] > 0) continue;
      // (Not for prompts with images: their image tokens are all the same id.)
      if (m.prefix_caching && s.fed == 0 && !s.state.table.Holds() && s.images.empty() &&
          !(s.spec.return_prompt_logits && !s.recompute)) {
        // Blocks of a prefix computed before under the same adapter: not computed again.
        int64_t hit = m.kv->Match(s.spec.adapter_id, s.feed, s.state.table);
        if (const int heads = m.HeadsRun(); heads > 0 && hit > 0) {
          // Head j's keys and values at position p came from token p + 1 + j: a cached block
          // serves the heads only where the prompt matches `heads` tokens past it too.
          const int64_t B = m.kv->block_size();
          const int64_t usable = std::max<int64_t>(0, (hit - heads) / B * B);
          if (usable < hit) {
            m.kv->Release(s.state.table);
            hit =
                usable == 0
                    ? 0
                    : m.kv->Match(s.spec.adapter_id,
                                  std::vector<int32_t>(s.feed.begin(), s.feed.begin() + usable + 1),
                                  s.state.table);
          }
          for (int h = 0; h < heads; ++h) s.state.mtp_len[static_cast<size_t>(h)] = hit;
        }
        s.state.len = hit;
        s.fed = static_cast<size_t>(hit);
        out.prefix_queries += static_cast<int64_t>(s.feed.size());
        out.prefix_hits += hit;
      }
      const int64_t fits =
          (static_cast<int64_t>(s.state.table.blocks.size()) + m.kv->free_blocks()) *
              m.kv->block_size() -
          s.state.len;
      const int64_t n =
          std::min<int64_t>({static_cast<int64_t>(s.feed.size() - s.fed), budget, fits});
      if (n <= 0) break;  // later sequences wait for this one's blocks
      if (!m.kv->Reserve(s.state.table, s.state.len + n)) break;
      take[i] = n;
      budget -= n;
    }
    bool any = false;
    for (int64_t t : take) any = any || t > 0;
    if (any) break;
    // Nothing could run: every block is held by prompts still being read. The latest admitted
    // one gives its blocks back (each sequence fits the cache alone: checked at admission).
    size_t j = victim(0);
    if (!m.running[j].state.table.Holds()) {
      // Unreachable while admission checks each sequence against the whole cache; should it
      // happen, drop the batch as a failed forward does, so no sequence is left behind here.
      m.running.clear();
      return absl::InternalError("the KV cache is full and no sequence holds a block");
    }
    preempt(j);
  }
  ForwardBatch b;
  std::set<int32_t> distinct;
  std::vector<size_t> in_batch;  // running index of each b.seqs entry
  for (size_t i = 0; i < nrun; ++i) {
    if (take[i] == 0) continue;
    Impl::Sequence& s = m.running[i];
    ForwardBatch::Seq fs;
    fs.state = &s.state;
    fs.begin = static_cast<int64_t>(b.tokens.size());
    if (s.Prefilling()) {
      b.tokens.insert(b.tokens.end(), s.feed.begin() + s.fed, s.feed.begin() + s.fed + take[i]);
      fs.all_logits = s.spec.return_prompt_logits && !s.recompute;
    } else {
      b.tokens.push_back(s.pending);
      if (ndraft[i] > 0) {
        // The head's first draft; the others come from the chained heads, or (placeholders
        // here) are drafted by the reused head before the forward.
        b.tokens.push_back(s.draft);
        if (m.model->mtp_chained()) {
          b.tokens.insert(b.tokens.end(), s.more_drafts.begin(),
                          s.more_drafts.begin() + (ndraft[i] - 1));
        } else {
          b.tokens.insert(b.tokens.end(), ndraft[i] - 1, -1);
        }
        fs.all_logits = true;
        fs.keep_states = true;  // rolled back past the first rejected draft
      }
    }
    fs.count = take[i];
    b.slots.insert(b.slots.end(), fs.count, s.slot);
    if (s.slot >= 0) distinct.insert(s.slot);
    b.seqs.push_back(fs);
    in_batch.push_back(i);
  }
  bool mm = false;  // a sequence of the batch has images: multimodal positions
  for (size_t k = 0; k < b.seqs.size(); ++k) mm = mm || !m.running[in_batch[k]].pos3.empty();
  if (mm) {
    const int64_t T = static_cast<int64_t>(b.tokens.size());
    b.positions3.resize(3 * T);
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      const Impl::Sequence& s = m.running[in_batch[k]];
      for (int64_t i = 0; i < b.seqs[k].count; ++i) {
        const std::array<int64_t, 3> p = s.Position(s.state.len + i);
        for (int r = 0; r < 3; ++r) b.positions3[r * T + b.seqs[k].begin + i] = p[r];
      }
    }
  }
  // Speculation: where the head's positions were before the step's drafts (they are drafted
  // again from the target's hidden states once the verify has spoken).
  std::vector<int64_t> head_len(b.seqs.size());
  for (size_t k = 0; k < b.seqs.size(); ++k) head_len[k] = b.seqs[k].state->mtp_len[0];
  absl::StatusOr<at::Tensor> logits = GuardTorch("forward", [&]() -> absl::StatusOr<at::Tensor> {
    if (const int f = m.options.debug_fail_prompt_chunk_tokens; f > 0) {
      for (const ForwardBatch::Seq& fs : b.seqs) {
        if (fs.count >= f) (void)at::empty({int64_t{1} << 62}, at::kByte);  // throws
      }
    }
    MOELORA_RETURN_IF_ERROR(m.PrepareImages(b, in_batch));
    if (m.spec_k > 0 && !m.model->mtp_chained()) {
      MOELORA_RETURN_IF_ERROR(m.DraftMore(b, in_batch, ndraft, head_len));
    }
    return m.model->Forward(b);
  });
  if (!logits.ok() && logits.status().code() == absl::StatusCode::kResourceExhausted &&
      m.comm->world_size() == 1 && !m.model->has_recurrent_layers() && m.spec_k == 0) {
    // Out of memory on the only rank, in a model without recurrent state: nothing this step did
    // stays (a state's length grows only at the forward's end, and its K/V rows are written
    // again), so the sequence with the largest prompt chunk fails alone and the others step on
    // next time. With recurrent layers (their states change layer by layer) or other ranks
    // (which wait in a collective), the step is dropped below.
    int64_t worst = -1;
    for (size_t k = 0; k < b.seqs.size(); ++k) {
      if (m.running[in_batch[k]].Prefilling() &&
          (worst < 0 || b.seqs[k].count > b.seqs[static_cast<size_t>(worst)].count)) {
        worst = static_cast<int64_t>(k);
      }
    }
    if (worst >= 0) {
      const size_t i = in_batch[static_cast<size_t>(worst)];
      const int64_t id = m.running[i].spec.id;
      out.failed.push_back(
          {id, absl::StrCat("out of memory computing ", b.seqs[static_cast<size_t>(worst)].count,
                            " tokens of this prompt (", b.tokens.size(),
                            " tokens in the step; --max-num-batched-tokens bounds it): ",
                            logits.status().message())});
      LOG(WARNING) << "sequence " << id << " removed: " << out.failed.back().second;
      m.running.erase(m.running.begin() + static_cast<std::ptrdiff_t>(i));  // frees its blocks
      out.kv_free_blocks = m.kv->free_blocks();
      out.seconds = Since(t0);
      return out;
    }
  }
  if (!logits.ok()) {
    // A failed step (a collective, or libtorch itself) leaves the states inconsistent across
    // ranks: drop the batch and report it. The other ranks fail their collective by its deadline.
    // ABORTED whatever the cause (out of memory included): the controller reads
    // RESOURCE_EXHAUSTED and INVALID_ARGUMENT as "a joiner was refused, nothing stepped", and
    // must instead end every sequence this step dropped.
    const size_t dropped = m.running.size();
    m.running.clear();
    return absl::AbortedError(absl::StrCat(
        "the step failed and its ", dropped, " sequences were dropped: ",
        absl::StatusCodeToString(logits.status().code()), ": ", logits.status().message()));
  }
  const float* L = logits->data_ptr<float>();
  // Each sequence's rows of logits (its last; all_logits sequences have one per new token before
  // it; a decode with d drafts has d + 1, one per position it verifies). Sequences that finish
  // reading their feed (or decode) sample: in parallel (each has its own sampler), a task at
  // least 32768 logits, so a small vocabulary stays on this thread.
  const int64_t n = static_cast<int64_t>(b.seqs.size());
  std::vector<int64_t> last_row(n), nd(n, 0);
  std::vector<char> samples(n, 0), was_prefilling(n, 0);
  for (int64_t k = 0, row = 0; k < n; ++k) {
    Impl::Sequence& s = m.running[in_batch[k]];
    row += b.seqs[k].all_logits ? b.seqs[k].count : 1;
    last_row[k] = row - 1;
    if (s.Prefilling()) {
      was_prefilling[k] = 1;
      if (b.seqs[k].all_logits) {
        const float* r = L + last_row[k] * vocab;
        s.prompt_logits.insert(s.prompt_logits.end(), r - (b.seqs[k].count - 1) * vocab, r + vocab);
      }
      s.fed += b.seqs[k].count;
      samples[k] = !s.Prefilling();
      // An image's tower output goes once the prompt is past it; with an MTP head, once the
      // head is too (it reads the tokens up to the chunk's end + 1 after this step).
      const int64_t past =
          static_cast<int64_t>(s.fed) - (m.HeadsRun() > 0 ? b.seqs[k].count - 1 : 0);
      for (Impl::Sequence::Image& im : s.images) {
        if (im.offset + im.tokens <= past) im.encoded = VisionEncoding();
      }
    } else {
      samples[k] = 1;
      nd[k] = ndraft[in_batch[k]];
      // Past its prompt: the head read every image token at the step that finished it.
      for (Impl::Sequence::Image& im : s.images) im.encoded = VisionEncoding();
    }
  }
  // Per sequence: its tokens (the drafts kept, in order, then the target's own) and their
  // logprobs; the first from row last_row - nd.
  std::vector<std::vector<int32_t>> tokens(n);
  std::vector<std::vector<float>> logprobs(n);
  at::parallel_for(
      0, n, std::max<int64_t>(1, 32768 / std::max<int64_t>(1, vocab)), [&](int64_t i0, int64_t i1) {
        for (int64_t k = i0; k < i1; ++k) {
          if (!samples[k]) continue;
          Impl::Sequence& s = m.running[in_batch[k]];
          for (int64_t j = 0; j <= nd[k]; ++j) {
            const float* r = L + (last_row[k] - nd[k] + j) * vocab;
            float lp = 0;
            float* want = s.spec.return_logprobs ? &lp : nullptr;
            bool kept = false;
            tokens[k].push_back(
                j < nd[k] ? s.sampler->Verify(
                                r, vocab, static_cast<int32_t>(b.tokens[b.seqs[k].begin + 1 + j]),
                                &kept, want)
                          : s.sampler->Sample(r, vocab, want));
            logprobs[k].push_back(lp);
            if (j < nd[k] && !kept) break;
          }
        }
      });
  std::set<int64_t> finished;
  for (int64_t k = 0; k < n; ++k) {
    if (!samples[k]) continue;
    Impl::Sequence& s = m.running[in_batch[k]];
    ++out.sequences;
    for (size_t j = 0; j < tokens[k].size(); ++j) {
      TokenOut t;
      t.sequence_id = s.spec.id;
      const float* r = L + (last_row[k] - nd[k] + static_cast<int64_t>(j)) * vocab;
      if (j == 0) {
        if (!s.prompt_logits.empty()) t.prompt_logits = std::move(s.prompt_logits);
        s.prompt_logits.clear();
        s.recompute = false;
        t.drafted = static_cast<int32_t>(nd[k]);
        t.accepted = static_cast<int32_t>(tokens[k].size() - 1);
      }
      t.same_step = j > 0;
      t.token = tokens[k][j];
      if (s.spec.return_logprobs) t.logprob = logprobs[k][j];
      if (s.spec.return_logits) t.logits.assign(r, r + vocab);
      s.pending = t.token;
      s.history.push_back(t.token);
      ++s.generated;
      // The length once this token's position is computed (the state holds every verified one).
      const int64_t len = s.state.len - (nd[k] + 1) + static_cast<int64_t>(j) + 1;
      const auto& stop = s.spec.stop_token_ids;
      if (std::find(stop.begin(), stop.end(), t.token) != stop.end()) {
        t.finished = true, t.finish_reason = "stop";
      } else if ((s.spec.max_tokens > 0 && s.generated >= s.spec.max_tokens) ||
                 len + 1 >= m.max_model_len) {
        t.finished = true, t.finish_reason = "length";
      }
      out.tokens.push_back(std::move(t));
      if (out.tokens.back().finished) {
        finished.insert(s.spec.id);
        break;  // the rest of its kept drafts are not emitted
      }
    }
  }
  if (m.spec_k > 0) {
    absl::Status st = GuardTorch("speculation", [&]() -> absl::Status {
      return m.AfterVerify(b, in_batch, nd, was_prefilling, tokens, head_len, finished);
    });
    if (!st.ok()) {
      // As for a failed forward: the ranks' states may differ now.
      const size_t dropped = m.running.size();
      m.running.clear();
      return absl::AbortedError(absl::StrCat(
          "the step failed and its ", dropped,
          " sequences were dropped: ", absl::StatusCodeToString(st.code()), ": ", st.message()));
    }
  }
  out.batch_tokens = static_cast<int>(b.tokens.size());
  out.distinct_adapters = static_cast<int>(distinct.size());
  for (size_t k = 0; k < in_batch.size(); ++k) {
    Impl::Sequence& s = m.running[in_batch[k]];
    // The full blocks this step completed become findable (before finished sequences release
    // theirs, which then stay cached until evicted), then the sliding-window blocks no later
    // query sees go back.
    // With MTP heads, only as far as every head's keys and values are final, and the window
    // blocks the heads' next queries still see stay.
    const int64_t done = m.HeadsFrom(s);
    if (m.prefix_caching && s.images.empty()) {
      m.kv->Publish(s.spec.adapter_id, s.history, done, s.state.table);
    }
    m.kv->Trim(s.state.table, done);
  }
  for (auto it = m.running.begin(); it != m.running.end();) {
    it = finished.count(it->spec.id) ? m.running.erase(it) : std::next(it);
  }
  out.kv_free_blocks = m.kv->free_blocks();
  out.seconds = Since(t0);
  return out;
}

EngineInfo Engine::Info() const {
  const Impl& m = *impl_;
  EngineInfo i;
  i.rank = m.comm->rank();
  i.world_size = m.comm->world_size();
  i.architecture = m.model->config().info.architecture;
  i.vocab_size = m.model->config().vocab_size;
  i.max_model_len = m.max_model_len;
  i.max_loras = m.options.max_loras;
  i.max_lora_rank = m.options.max_lora_rank;
  i.mixed = m.options.enable_mixed_moe_lora_format;
  i.native_format = m.model->native_format();
  i.skipped_tensors = m.model->skipped_tensors();
  i.dtype = m.options.dtype;
  i.model_dir = m.options.model_dir;
  i.config_fingerprint = m.config_fingerprint;
  i.expert_parallel = m.options.enable_expert_parallel;
  i.fully_sharded_loras = m.options.fully_sharded_loras;
  i.max_num_seqs = m.options.max_num_seqs;
  i.max_cpu_loras = m.options.max_cpu_loras;
  {
    std::lock_guard<std::mutex> lock(m.adapters_mu);
    for (const auto& [id, a] : m.adapters) {
      i.committed_adapters += a.committed;
      i.staged_adapters += !a.committed;
      if (a.committed) i.committed_adapter_ids.push_back(id);
    }
    i.host_cache = m.CacheStats();
  }
  i.block_size = static_cast<int>(m.kv->block_size());
  i.num_blocks = m.kv->num_blocks();
  i.free_blocks = m.kv->free_blocks();
  i.bytes_per_block = m.kv->bytes_per_block();
  i.window_bytes = m.kv->window_bytes();
  i.max_num_batched_tokens = m.options.max_num_batched_tokens;
  i.prefix_caching = m.prefix_caching;
  i.prefill_tokens_beside_decodes = m.options.prefill_tokens_beside_decodes;
  i.num_speculative_tokens = m.spec_k;
  if (const VisionConfig* v = m.model->vision()) {
    i.vision = true;
    i.image_token_id = v->image_token_id;
  }
  i.tower_connector_lora = m.options.enable_tower_connector_lora;
  i.encoder_cache_hits = m.encoder_cache_hits;
  i.images_encoded = m.images_encoded;
  std::lock_guard<std::mutex> step_lock(m.step_mu);
  i.running = static_cast<int>(m.running.size());
  return i;
}

}  // namespace moelora
