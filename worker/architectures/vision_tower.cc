#include "worker/architectures/vision_tower.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <set>
#include <vector>

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/elementwise.h"
#include "lora/tp_slice.h"
#include "nlohmann/json.hpp"
#include "worker/layers/lora_batch.h"

namespace moelora {
namespace {

constexpr double kLayerNormEps = 1e-6;  // every LayerNorm of the tower (transformers' modules)

// This rank's part of a full [out, in] weight (and bias) for `mode`, as LoraLinear::Create
// takes it: the output rows and input columns lora/tp_slice.h gives the rank.
absl::StatusOr<std::unique_ptr<LoraLinear>> MakeLinear(const std::string& path, const at::Tensor& w,
                                                       const at::Tensor& b, TpMode mode,
                                                       const std::vector<int64_t>& sections,
                                                       const SlotShape& shape) {
  const int64_t in = w.size(1);
  auto shard = PlanLoraShard(mode, in, sections, shape.tp_rank, shape.tp_size);
  if (!shard.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(path, ": ", shard.status().message()));
  }
  auto pick = [](const at::Tensor& t, int64_t dim, const std::vector<IndexRange>& ranges) {
    std::vector<at::Tensor> parts;
    for (const IndexRange& r : ranges) parts.push_back(t.narrow(dim, r.begin, r.size));
    return parts.size() == 1 ? parts[0].contiguous() : at::cat(parts, dim).contiguous();
  };
  at::Tensor wl = pick(pick(w, 0, shard->b_rows), 1, shard->a_cols);
  at::Tensor bl = b.defined() ? (mode == TpMode::kRow ? b : pick(b, 0, shard->b_rows)) : b;
  return LoraLinear::Create(path, std::move(wl), std::move(bl), mode, in, sections, shape);
}

// Whether the tensor-parallel split of `n` over tp ranks is possible; a layer that cannot split
// is computed whole on every rank.
TpMode SplitOr(TpMode want, int64_t n, int tp) {
  return tp > 1 && n % tp == 0 ? want : TpMode::kReplicated;
}

at::Tensor Gelu(const at::Tensor& x, const std::string& act) {
  return at::gelu(x, act == "gelu_pytorch_tanh" ? "tanh" : "none");
}

// Attention within each frame on the CPU (no mask), by tiles as flash attention schedules it:
// per (head, tile of query rows), key tiles of kKeyTile: the scores as one BLAS product into a
// buffer that stays in cache, the online softmax row by row on it (OnlineSoftmaxRow: two passes
// over a row in L1), the weighted values as a second product. No [rows, keys] score matrix exists
// (a 1344 x 1344 image's [16, 7056, 7056] would be 3 GiB). q, k, v: [N, heads, head_dim]; frames:
// the row bounds of each frame. Returns f32 [N, heads · head_dim]. Tiles (bench/vision_encoder,
// 1344 x 1344 on a Zen 5, 2 runs each): 512 x 512 7.26 s, 256 x 512 7.34, 256 x 1024 6.81,
// 1024 x 1024 6.82, 512 x 1024 6.72 and 7.06, 512 x 2048 6.62, 384 x 1536 6.50 (the spread
// within runs' noise from 512 x 1024 on); with the softmax in ATen ops, 512 x 512 took 11.0 s.
at::Tensor TiledAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::vector<int64_t>& frames, double scale) {
  constexpr int64_t kRowTile = 512, kKeyTile = 1024;
  // The scale goes into q once (the scores' own pass over each tile is gone).
  const at::Tensor qh = (q.to(at::kFloat) * scale).transpose(0, 1).contiguous();  // [heads, N, d]
  const at::Tensor kh = k.to(at::kFloat).transpose(0, 1).contiguous();
  const at::Tensor vh = v.to(at::kFloat).transpose(0, 1).contiguous();
  const int64_t heads = q.size(1), d = q.size(2), N = q.size(0);
  at::Tensor out = at::empty({heads, N, d}, at::TensorOptions().dtype(at::kFloat));
  struct Task {
    int64_t head, frame_begin, keys, row0, rows;
  };
  std::vector<Task> tasks;
  for (size_t f = 0; f + 1 < frames.size(); ++f) {
    const int64_t b = frames[f], n = frames[f + 1] - frames[f];
    for (int64_t h = 0; h < heads; ++h) {
      for (int64_t r = 0; r < n; r += kRowTile) {
        tasks.push_back({h, b, n, b + r, std::min(kRowTile, n - r)});
      }
    }
  }
  at::parallel_for(0, static_cast<int64_t>(tasks.size()), 1, [&](int64_t t0, int64_t t1) {
    const auto f32 = at::TensorOptions().dtype(at::kFloat);
    at::Tensor s_buf = at::empty({kRowTile * kKeyTile}, f32);
    std::vector<float> mx(kRowTile), l(kRowTile);
    for (int64_t t = t0; t < t1; ++t) {
      const Task& w = tasks[t];
      const int64_t m = w.rows;
      const at::Tensor qt = qh[w.head].narrow(0, w.row0, m);
      at::Tensor a = at::zeros({m, d}, f32);
      float* ap = a.data_ptr<float>();
      std::fill(mx.begin(), mx.end(), -std::numeric_limits<float>::infinity());
      std::fill(l.begin(), l.end(), 0.0f);
      for (int64_t kb = 0; kb < w.keys; kb += kKeyTile) {
        const int64_t c = std::min(kKeyTile, w.keys - kb);
        at::Tensor s = s_buf.narrow(0, 0, m * c).view({m, c});
        at::mm_out(s, qt, kh[w.head].narrow(0, w.frame_begin + kb, c).t());
        float* sp = s.data_ptr<float>();
        for (int64_t i = 0; i < m; ++i) {
          const float corr = OnlineSoftmaxRow(sp + i * c, c, &mx[i], &l[i]);
          if (corr != 1.0f) {
            for (int64_t j = 0; j < d; ++j) ap[i * d + j] *= corr;
          }
        }
        a.addmm_(s, vh[w.head].narrow(0, w.frame_begin + kb, c));
      }
      for (int64_t i = 0; i < m; ++i) {
        const float inv = 1.0f / l[i];
        for (int64_t j = 0; j < d; ++j) ap[i * d + j] *= inv;
      }
      out[w.head].narrow(0, w.row0, m).copy_(a);
    }
  });
  return out.transpose(0, 1).reshape({N, heads * d});
}

// The same with ATen on other devices: per frame, queries in chunks, so that the scores
// [heads, rows, keys] stay near 64 MiB. Returns [N, heads · head_dim] in q's dtype.
at::Tensor ChunkedAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                            const std::vector<int64_t>& frames, double scale) {
  const int64_t heads = q.size(1), hd = q.size(2);
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i + 1 < frames.size(); ++i) {
    const int64_t s = frames[i], n = frames[i + 1] - frames[i];
    const at::Tensor kt = k.narrow(0, s, n).permute({1, 2, 0}).contiguous();  // [heads, hd, n]
    const at::Tensor vi = v.narrow(0, s, n).transpose(0, 1).contiguous();     // [heads, n, hd]
    const int64_t rows =
        std::max<int64_t>(64, (int64_t{16} << 20) / std::max<int64_t>(1, heads * n));
    for (int64_t r = 0; r < n; r += rows) {
      const int64_t m = std::min(rows, n - r);
      const at::Tensor qi = q.narrow(0, s + r, m).transpose(0, 1);  // [heads, m, hd]
      const at::Tensor p = (at::matmul(qi, kt) * scale).softmax(-1, at::kFloat).to(q.scalar_type());
      outs.push_back(at::matmul(p, vi).transpose(0, 1).reshape({m, heads * hd}));
    }
  }
  return outs.size() == 1 ? outs[0] : at::cat(outs, 0);
}

}  // namespace

at::Tensor FrameAttention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const std::vector<int64_t>& frames, double scale, bool tiled) {
  return tiled ? TiledAttention(q, k, v, frames, scale).to(q.scalar_type())
               : ChunkedAttention(q, k, v, frames, scale);
}

absl::StatusOr<std::optional<VisionConfig>> VisionConfig::Parse(
    const std::string& text, const std::string& file, bool deepstack, int64_t image_token_default,
    int64_t text_hidden_size, int64_t vocab_size) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object() || !j.contains("vision_config") ||
      !j["vision_config"].is_object()) {
    return std::optional<VisionConfig>();
  }
  const nlohmann::json& vc = j["vision_config"];
  VisionConfig v;
  if (deepstack) v.deepstack_visual_indexes = {8, 16, 24};
  auto bad = [&](const std::string& key, const std::string& why) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": vision_config.", key, ": ", why));
  };
  for (auto [key, out] : std::initializer_list<std::pair<const char*, int*>>{
           {"depth", &v.depth},
           {"hidden_size", &v.hidden_size},
           {"num_heads", &v.num_heads},
           {"intermediate_size", &v.intermediate_size},
           {"in_channels", &v.in_channels},
           {"patch_size", &v.patch_size},
           {"temporal_patch_size", &v.temporal_patch_size},
           {"spatial_merge_size", &v.spatial_merge_size},
           {"out_hidden_size", &v.out_hidden_size},
           {"num_position_embeddings", &v.num_position_embeddings}}) {
    if (!vc.contains(key) || vc[key].is_null()) continue;
    if (!vc[key].is_number_integer() || vc[key].get<int64_t>() <= 0 ||
        vc[key].get<int64_t>() > (int64_t{1} << 24)) {
      return bad(key, absl::StrCat("expected a positive integer, got ", vc[key].dump()));
    }
    *out = vc[key].get<int>();
  }
  if (vc.contains("deepstack_visual_indexes") && !vc["deepstack_visual_indexes"].is_null()) {
    v.deepstack_visual_indexes.clear();
    for (const auto& i : vc["deepstack_visual_indexes"]) {
      if (!i.is_number_integer() || i.get<int64_t>() < 0 || i.get<int64_t>() >= v.depth) {
        return bad("deepstack_visual_indexes", "block indices below depth expected");
      }
      v.deepstack_visual_indexes.push_back(i.get<int>());
    }
    if (!deepstack && !v.deepstack_visual_indexes.empty()) {
      return absl::FailedPreconditionError(absl::StrCat(
          file, ": vision_config.deepstack_visual_indexes: this architecture has no DeepStack"));
    }
  }
  // Every other key changes the tower in a way this code does not implement: refused by name,
  // never ignored (bookkeeping keys aside).
  static const std::set<std::string> kKnown = {
      "depth", "hidden_size", "num_heads", "intermediate_size", "in_channels", "patch_size",
      "temporal_patch_size", "spatial_merge_size", "out_hidden_size", "num_position_embeddings",
      "deepstack_visual_indexes", "hidden_act", "rope_parameters", "rope_scaling",
      // bookkeeping
      "model_type", "initializer_range", "dtype", "torch_dtype", "_name_or_path",
      "transformers_version", "num_attention_heads", "num_hidden_layers"};
  for (const auto& [key, value] : vc.items()) {
    if (!kKnown.count(key)) {
      return absl::FailedPreconditionError(
          absl::StrCat(file, ": vision_config.", key, " is not implemented by the vision tower"));
    }
  }
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (vc.contains(key) && vc[key].is_object() && vc[key].contains("rope_type") &&
        vc[key]["rope_type"] != "axial" && vc[key]["rope_type"] != "default") {
      return absl::FailedPreconditionError(absl::StrCat(file, ": vision_config.", key,
                                                        ".rope_type ", vc[key]["rope_type"].dump(),
                                                        " is not implemented (axial)"));
    }
  }
  // transformers' attribute_map aliases; they must agree with the names read above.
  if (vc.contains("num_attention_heads") && vc.contains("num_heads") &&
      vc["num_attention_heads"] != vc["num_heads"]) {
    return bad("num_attention_heads", "differs from num_heads");
  }
  if (vc.contains("num_hidden_layers") && vc.contains("depth") &&
      vc["num_hidden_layers"] != vc["depth"]) {
    return bad("num_hidden_layers", "differs from depth");
  }
  if (vc.contains("hidden_act") && vc["hidden_act"].is_string()) {
    v.hidden_act = vc["hidden_act"].get<std::string>();
  }
  if (v.hidden_act != "gelu_pytorch_tanh" && v.hidden_act != "gelu") {
    return absl::FailedPreconditionError(
        absl::StrCat(file, ": vision_config.hidden_act \"", v.hidden_act,
                     "\" is not implemented (gelu_pytorch_tanh, gelu)"));
  }
  for (const char* key : {"rope_parameters", "rope_scaling"}) {
    if (vc.contains(key) && vc[key].is_object() && vc[key].contains("rope_theta") &&
        vc[key]["rope_theta"].is_number()) {
      v.rope_theta = vc[key]["rope_theta"].get<double>();
    }
  }
  v.image_token_id = image_token_default;
  if (j.contains("image_token_id") && j["image_token_id"].is_number_integer()) {
    v.image_token_id = j["image_token_id"].get<int64_t>();
  }
  if (v.image_token_id < 0 || (vocab_size > 0 && v.image_token_id >= vocab_size)) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": image_token_id ", v.image_token_id,
                                                   " is outside the vocabulary (", vocab_size,
                                                   ")"));
  }
  if (v.hidden_size % v.num_heads != 0 || v.head_dim() % 4 != 0) {
    return bad("num_heads", absl::StrCat("hidden_size ", v.hidden_size, " / num_heads ",
                                         v.num_heads, " must be a multiple of 4"));
  }
  const int side = static_cast<int>(std::lround(std::sqrt(v.num_position_embeddings)));
  if (side * side != v.num_position_embeddings) {
    return bad("num_position_embeddings", "must be a square number");
  }
  if (v.out_hidden_size != text_hidden_size) {
    return bad("out_hidden_size", absl::StrCat(v.out_hidden_size, " differs from the text model's ",
                                               "hidden_size ", text_hidden_size));
  }
  if (v.in_channels != 3) return bad("in_channels", "only 3 (RGB) is implemented");
  return std::optional<VisionConfig>(v);
}

std::vector<ParamSpec> VisionParamSpecs(const VisionConfig& v) {
  const int64_t D = v.hidden_size, F = v.intermediate_size,
                M = int64_t{D} * v.spatial_merge_size * v.spatial_merge_size;
  std::vector<ParamSpec> s = {
      {"model.visual.patch_embed.proj.weight",
       {D, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size}},
      {"model.visual.patch_embed.proj.bias", {D}},
      {"model.visual.pos_embed.weight", {v.num_position_embeddings, D}}};
  for (int b = 0; b < v.depth; ++b) {
    const std::string p = absl::StrCat("model.visual.blocks.", b, ".");
    for (const char* n : {"norm1", "norm2"}) {
      s.push_back({p + n + ".weight", {D}});
      s.push_back({p + n + ".bias", {D}});
    }
    s.push_back({p + "attn.qkv.weight", {3 * D, D}});
    s.push_back({p + "attn.qkv.bias", {3 * D}});
    s.push_back({p + "attn.proj.weight", {D, D}});
    s.push_back({p + "attn.proj.bias", {D}});
    s.push_back({p + "mlp.linear_fc1.weight", {F, D}});
    s.push_back({p + "mlp.linear_fc1.bias", {F}});
    s.push_back({p + "mlp.linear_fc2.weight", {D, F}});
    s.push_back({p + "mlp.linear_fc2.bias", {D}});
  }
  auto merger = [&](const std::string& p, bool postshuffle) {
    s.push_back({p + "norm.weight", {postshuffle ? M : D}});
    s.push_back({p + "norm.bias", {postshuffle ? M : D}});
    s.push_back({p + "linear_fc1.weight", {M, M}});
    s.push_back({p + "linear_fc1.bias", {M}});
    s.push_back({p + "linear_fc2.weight", {v.out_hidden_size, M}});
    s.push_back({p + "linear_fc2.bias", {v.out_hidden_size}});
  };
  merger("model.visual.merger.", false);
  for (size_t i = 0; i < v.deepstack_visual_indexes.size(); ++i) {
    merger(absl::StrCat("model.visual.deepstack_merger_list.", i, "."), true);
  }
  return s;
}

absl::StatusOr<std::unique_ptr<VisionTower>> VisionTower::Create(
    const VisionConfig& v, const std::map<std::string, at::Tensor>& P, const ModelOptions& o,
    const SlotShape& shape, bool lora) {
  auto t = std::unique_ptr<VisionTower>(new VisionTower());
  t->v_ = v;
  t->o_ = o;
  t->lora_ = lora;
  const int tp = o.tp_size;
  const int64_t D = v.hidden_size, F = v.intermediate_size,
                M = int64_t{D} * v.spatial_merge_size * v.spatial_merge_size;
  t->patch_w_ = P.at("model.visual.patch_embed.proj.weight").reshape({D, -1}).contiguous();
  t->patch_b_ = P.at("model.visual.patch_embed.proj.bias");
  t->pos_embed_ = P.at("model.visual.pos_embed.weight");
  // The 2D rotary table's frequencies: head_dim / 4 of them, each used for the height and the
  // width position (transformers' compute_axial_rope_parameters, in f32 as there).
  const int64_t spatial = v.head_dim() / 2;
  t->inv_freq_ =
      1.0 / at::pow(v.rope_theta,
                    at::arange(0, spatial, 2, at::TensorOptions().dtype(at::kFloat)) / spatial);
  const TpMode qkv_mode = SplitOr(TpMode::kColumn, v.num_heads, tp);
  t->heads_local_ = qkv_mode == TpMode::kColumn ? v.num_heads / tp : v.num_heads;
  const TpMode proj_mode = qkv_mode == TpMode::kColumn ? TpMode::kRow : TpMode::kReplicated;
  const TpMode fc1_mode = SplitOr(TpMode::kColumn, F, tp);
  const TpMode fc2_mode = fc1_mode == TpMode::kColumn ? TpMode::kRow : TpMode::kReplicated;
  for (int b = 0; b < v.depth; ++b) {
    const std::string p = absl::StrCat("model.visual.blocks.", b, ".");
    Block B;
    B.norm1_w = P.at(p + "norm1.weight");
    B.norm1_b = P.at(p + "norm1.bias");
    B.norm2_w = P.at(p + "norm2.weight");
    B.norm2_b = P.at(p + "norm2.bias");
    auto lin = [&](const std::string& name, TpMode mode, std::vector<int64_t> sections) {
      return MakeLinear(p + name, P.at(p + name + ".weight"), P.at(p + name + ".bias"), mode,
                        sections, shape);
    };
    MOELORA_ASSIGN_OR_RETURN(B.qkv, lin("attn.qkv", qkv_mode, {D, D, D}));
    MOELORA_ASSIGN_OR_RETURN(B.proj, lin("attn.proj", proj_mode, {D}));
    MOELORA_ASSIGN_OR_RETURN(B.fc1, lin("mlp.linear_fc1", fc1_mode, {F}));
    MOELORA_ASSIGN_OR_RETURN(B.fc2, lin("mlp.linear_fc2", fc2_mode, {D}));
    t->blocks_.push_back(std::move(B));
  }
  const TpMode m1 = SplitOr(TpMode::kColumn, M, tp);
  const TpMode m2 = m1 == TpMode::kColumn ? TpMode::kRow : TpMode::kReplicated;
  auto merger = [&](const std::string& p, bool postshuffle) -> absl::StatusOr<Merger> {
    Merger m;
    m.postshuffle = postshuffle;
    m.norm_w = P.at(p + "norm.weight");
    m.norm_b = P.at(p + "norm.bias");
    MOELORA_ASSIGN_OR_RETURN(m.fc1, MakeLinear(p + "linear_fc1", P.at(p + "linear_fc1.weight"),
                                               P.at(p + "linear_fc1.bias"), m1, {M}, shape));
    MOELORA_ASSIGN_OR_RETURN(
        m.fc2, MakeLinear(p + "linear_fc2", P.at(p + "linear_fc2.weight"),
                          P.at(p + "linear_fc2.bias"), m2, {v.out_hidden_size}, shape));
    return m;
  };
  MOELORA_ASSIGN_OR_RETURN(t->merger_, merger("model.visual.merger.", false));
  for (size_t i = 0; i < v.deepstack_visual_indexes.size(); ++i) {
    MOELORA_ASSIGN_OR_RETURN(
        Merger m, merger(absl::StrCat("model.visual.deepstack_merger_list.", i, "."), true));
    t->deepstack_.push_back(std::move(m));
  }
  return t;
}

std::vector<LoraModule*> VisionTower::lora_modules() const {
  std::vector<LoraModule*> v;
  for (const Block& b : blocks_) {
    for (const auto* l : {&b.qkv, &b.proj, &b.fc1, &b.fc2}) v.push_back(l->get());
  }
  v.push_back(merger_.fc1.get());
  v.push_back(merger_.fc2.get());
  for (const Merger& m : deepstack_) {
    v.push_back(m.fc1.get());
    v.push_back(m.fc2.get());
  }
  return v;
}

absl::StatusOr<at::Tensor> VisionTower::RunMerger(
    const Merger& m, const at::Tensor& x, const LoraBatch& lb,
    const std::function<absl::Status(at::Tensor&)>& all_reduce) const {
  const int64_t M = x.size(1) * v_.spatial_merge_size * v_.spatial_merge_size;
  at::Tensor h =
      m.postshuffle
          ? at::layer_norm(x.reshape({-1, M}), {M}, m.norm_w, m.norm_b, kLayerNormEps)
          : at::layer_norm(x, {x.size(1)}, m.norm_w, m.norm_b, kLayerNormEps).reshape({-1, M});
  MOELORA_ASSIGN_OR_RETURN(at::Tensor a, m.fc1->Forward(h.contiguous(), lb));
  a = at::gelu(a, "none");
  MOELORA_ASSIGN_OR_RETURN(at::Tensor y, m.fc2->Forward(a, lb));
  if (m.fc1->out_local() != M) MOELORA_RETURN_IF_ERROR(all_reduce(y));  // fc2 row-parallel
  return y;
}

absl::StatusOr<VisionTower::Output> VisionTower::Forward(
    const std::vector<VisionImage>& images,
    const std::function<absl::Status(at::Tensor&)>& all_reduce) const {
  const at::Device dev = patch_w_.device();
  const at::ScalarType dt = patch_w_.scalar_type();
  const int m = v_.spatial_merge_size,
            side = static_cast<int>(std::lround(std::sqrt(v_.num_position_embeddings)));
  // Per patch (images one after the other, each in merge-block order as pixel_values are):
  // its slot, its (row, col) on the grid, and the position table's bilinear taps.
  std::vector<at::Tensor> pixels;
  std::vector<int32_t> slots, merged_slots;
  std::vector<float> hpos, wpos;
  std::vector<int64_t> taps, bounds = {0};
  std::vector<float> weights;
  for (const VisionImage& im : images) {
    if (im.pixel_values.dim() != 2 || im.pixel_values.size(1) != v_.patch_dim() ||
        im.pixel_values.size(0) != int64_t{im.grid_t} * im.grid_h * im.grid_w ||
        im.grid_h % m != 0 || im.grid_w % m != 0) {
      return absl::InvalidArgumentError("image pixel_values do not match the tower's patches");
    }
    pixels.push_back(im.pixel_values);
    const int64_t n = int64_t{im.grid_t} * im.grid_h * im.grid_w;
    const int32_t slot = lora_ ? im.slot : -1;
    slots.insert(slots.end(), n, slot);
    merged_slots.insert(merged_slots.end(), n / (m * m), slot);
    // transformers' get_vision_interpolation_indices_and_weights (bilinear, align_corners,
    // border), in f32 as there: source = index · (side − 1) / max(size − 1, 1).
    auto axis = [&](int index, int size, int64_t tap[2], float w[2]) {
      const float src = static_cast<float>(index) * static_cast<float>(side - 1) /
                        static_cast<float>(std::max(size - 1, 1));
      const float fl = std::floor(src);
      for (int k = 0; k < 2; ++k) {
        const float d = std::fabs(src - fl - static_cast<float>(k));
        w[k] = std::max(1.0f - d, 0.0f);
        tap[k] = std::clamp<int64_t>(static_cast<int64_t>(fl) + k, 0, side - 1);
      }
    };
    for (int t = 0; t < im.grid_t; ++t) {
      for (int br = 0; br < im.grid_h / m; ++br) {
        for (int bc = 0; bc < im.grid_w / m; ++bc) {
          for (int ir = 0; ir < m; ++ir) {
            for (int ic = 0; ic < m; ++ic) {
              const int r = br * m + ir, c = bc * m + ic;
              hpos.push_back(static_cast<float>(r));
              wpos.push_back(static_cast<float>(c));
              int64_t ht[2], wt[2];
              float hw[2], ww[2];
              axis(r, im.grid_h, ht, hw);
              axis(c, im.grid_w, wt, ww);
              for (int a = 0; a < 2; ++a) {
                for (int b = 0; b < 2; ++b) {
                  taps.push_back(ht[a] * side + wt[b]);
                  weights.push_back(hw[a] * ww[b]);
                }
              }
            }
          }
        }
      }
      bounds.push_back(bounds.back() + int64_t{im.grid_h} * im.grid_w);  // attention per frame
    }
  }
  const int64_t N = static_cast<int64_t>(hpos.size());
  const auto f32 = at::TensorOptions().dtype(at::kFloat);
  // Patch embedding: the Conv3d whose kernel equals its stride is one product per patch.
  at::Tensor x = at::cat(pixels, 0).to(dev).to(dt);
  x = at::addmm(patch_b_, x, patch_w_.t());
  at::Tensor tap_t = at::from_blob(taps.data(), {N, 4}, at::kLong).to(dev);
  at::Tensor w_t = at::from_blob(weights.data(), {N, 4}, f32).to(dev);
  // The table's rows times the f32 weights (a bf16 table is promoted, as in transformers).
  at::Tensor pos =
      (pos_embed_.index_select(0, tap_t.view(-1)).view({N, 4, -1}) * w_t.unsqueeze(2)).sum(1);
  x = x + pos.to(dt);
  // 2D rotary: [N, head_dim] cos / sin in f32 (freqs of the row, then of the column, twice).
  at::Tensor hp = at::from_blob(hpos.data(), {N, 1}, f32).to(dev);
  at::Tensor wp = at::from_blob(wpos.data(), {N, 1}, f32).to(dev);
  at::Tensor inv = inv_freq_.to(dev).unsqueeze(0);
  at::Tensor fhw = at::cat({hp * inv, wp * inv}, 1);
  at::Tensor emb = at::cat({fhw, fhw}, 1);
  const at::Tensor cos = emb.cos().unsqueeze(1), sin = emb.sin().unsqueeze(1);  // [N, 1, hd]
  const int64_t hd = v_.head_dim(), half = hd / 2;
  auto rope = [&](const at::Tensor& q) {  // q [N, heads, hd], computed in f32
    at::Tensor qf = q.to(at::kFloat);
    at::Tensor rot = at::cat({-qf.narrow(2, half, half), qf.narrow(2, 0, half)}, 2);
    return (qf * cos + rot * sin).to(dt);
  };
  const LoraBatch lb = LoraBatch::Make(o_, slots, dev);
  const double scale = 1.0 / std::sqrt(static_cast<double>(hd));
  const int64_t D = v_.hidden_size, hl = heads_local_;
  Output out;
  for (size_t b = 0; b < blocks_.size(); ++b) {
    const Block& B = blocks_[b];
    at::Tensor h = at::layer_norm(x, {D}, B.norm1_w, B.norm1_b, kLayerNormEps);
    MOELORA_ASSIGN_OR_RETURN(at::Tensor qkv, B.qkv->Forward(h, lb));
    qkv = qkv.view({N, 3, hl, hd});
    const at::Tensor q = rope(qkv.select(1, 0)), k = rope(qkv.select(1, 1));
    const at::Tensor vv = qkv.select(1, 2);
    const at::Tensor a = FrameAttention(q, k, vv, bounds, scale, dev.is_cpu());
    MOELORA_ASSIGN_OR_RETURN(at::Tensor o, B.proj->Forward(a.contiguous(), lb));
    if (hl != v_.num_heads) MOELORA_RETURN_IF_ERROR(all_reduce(o));
    x = x + o;
    h = at::layer_norm(x, {D}, B.norm2_w, B.norm2_b, kLayerNormEps);
    MOELORA_ASSIGN_OR_RETURN(at::Tensor f, B.fc1->Forward(h, lb));
    f = Gelu(f, v_.hidden_act);
    MOELORA_ASSIGN_OR_RETURN(at::Tensor g, B.fc2->Forward(f, lb));
    if (B.fc1->out_local() != v_.intermediate_size) MOELORA_RETURN_IF_ERROR(all_reduce(g));
    x = x + g;
    for (size_t d = 0; d < v_.deepstack_visual_indexes.size(); ++d) {
      if (v_.deepstack_visual_indexes[d] != static_cast<int>(b)) continue;
      const LoraBatch mlb = LoraBatch::Make(o_, merged_slots, dev);
      MOELORA_ASSIGN_OR_RETURN(at::Tensor f2, RunMerger(deepstack_[d], x, mlb, all_reduce));
      out.deepstack.resize(deepstack_.size());
      out.deepstack[d] = std::move(f2);
    }
  }
  const LoraBatch mlb = LoraBatch::Make(o_, merged_slots, dev);
  MOELORA_ASSIGN_OR_RETURN(out.embeds, RunMerger(merger_, x, mlb, all_reduce));
  return out;
}

}  // namespace moelora
