#include "worker/architectures/decoder.h"

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "common/status_macros.h"
#include "glog/logging.h"
#include "kernels/device.h"
#include "nlohmann/json.hpp"
#include "schema/config_defaults.h"
#include "worker/layers/gemm.h"

namespace moelora {

[[nodiscard]] absl::StatusOr<StepInputs> BeginStep(const ForwardBatch& b, const ModelOptions& o,
                                                   const at::Device& device, int mtp_heads) {
  const int64_t T = static_cast<int64_t>(b.tokens.size());
  if (T == 0 || b.slots.size() != b.tokens.size()) {
    return absl::InvalidArgumentError("empty batch or slots/tokens size mismatch");
  }
  if (o.kernels == LoraKernels::kCuda) MOELORA_RETURN_IF_ERROR(CudaSetDevice(o.cuda_device));
  for (const auto& s : b.seqs) {
    // The blocks for the new tokens' keys and values (the engine reserves them before the step;
    // direct callers get them here).
    KvCache* kv = s.state->kv;
    if (kv == nullptr) continue;
    int64_t seen = s.state->len;  // the first position a query still to come is at
    for (int h = 0; h < mtp_heads; ++h) {
      seen = std::min(seen, s.state->mtp_len[static_cast<size_t>(h)]);
    }
    kv->Trim(s.state->table, seen);
    if (!kv->Reserve(s.state->table, s.state->len + s.count)) {
      return absl::ResourceExhaustedError(absl::StrCat(
          "the KV cache has ", kv->free_blocks(), " free blocks of ", kv->block_size(), " tokens (",
          kv->window_free_blocks(), " for sliding-window layers) and ", kv->state_entries(),
          " recurrent-state entries; a sequence of ", s.state->len + s.count, " tokens needs ",
          kv->BlocksFor(s.state->len + s.count) - s.state->table.blocks.size(), " more blocks"));
    }
  }
  StepInputs in;
  in.positions.resize(T);
  for (const auto& s : b.seqs) {
    for (int64_t i = 0; i < s.count; ++i) in.positions[s.begin + i] = s.state->len + i;
  }
  in.tokens = at::from_blob(const_cast<int64_t*>(b.tokens.data()), {T}, at::kLong).to(device);
  return in;
}

[[nodiscard]] absl::StatusOr<ModelWeights> LoadModelWeights(
    const ModelContext& ctx, const ModelConfig& c,
    const std::function<std::vector<ParamSpec>(bool has_lm_head)>& specs) {
  ModelWeights mw;
  const ModelOptions& o = ctx.options;
  LoadOptions lo{o.tp_rank, o.tp_size, o.dtype, /*lora_wrapped=*/true, o.expert_parallel};
  // A vision tower the factory did not build (no preprocessor_config.json).
  const SkipUnlisted skip{"model.visual.",
                          "vision tower not loaded: no preprocessor_config.json (text path only)"};
  if (o.dummy_weights) {
    mw.has_lm_head = !c.tie_word_embeddings;
    MOELORA_ASSIGN_OR_RETURN(mw.weights, DummyWeights(c, specs(mw.has_lm_head), lo));
    return mw;
  }
  mw.has_lm_head = ctx.checkpoint->tensors().count("lm_head.weight") > 0;
  if (!mw.has_lm_head && !c.tie_word_embeddings) {
    return absl::InvalidArgumentError(
        absl::StrCat(ctx.dir, ": no lm_head.weight and tie_word_embeddings is false"));
  }
  MOELORA_ASSIGN_OR_RETURN(
      mw.weights, LoadWeights(*ctx.checkpoint, *ctx.arch, c, specs(mw.has_lm_head), lo, skip));
  return mw;
}

absl::StatusOr<std::optional<VisionConfig>> ReadVisionConfig(const ModelContext& ctx,
                                                             const ModelConfig& c, bool deepstack,
                                                             int64_t image_token_default) {
  MOELORA_ASSIGN_OR_RETURN(const std::string text, ReadConfigText(ctx.dir));
  const std::string file = ctx.dir + "/config.json";
  // The vocabulary is checked once the tower is known to be built (test checkpoints carry
  // towers with the class's image_token_id and no preprocessor_config.json).
  MOELORA_ASSIGN_OR_RETURN(std::optional<VisionConfig> v,
                           VisionConfig::Parse(text, file, deepstack, image_token_default,
                                               c.info.hidden_size, /*vocab_size=*/0));
  if (v && !std::filesystem::exists(ctx.dir + "/preprocessor_config.json")) {
    // Without the image processor's settings no image can be prepared: the text path only.
    LOG(WARNING) << ctx.dir << " has a vision_config but no preprocessor_config.json: the vision "
                 << "tower is not loaded and requests with images are refused";
    return std::optional<VisionConfig>();
  }
  if (v && v->image_token_id >= c.vocab_size) {
    return absl::InvalidArgumentError(absl::StrCat(file, ": image_token_id ", v->image_token_id,
                                                   " is outside the vocabulary (", c.vocab_size,
                                                   ")"));
  }
  return v;
}

absl::Status DecoderModel::BuildVision(const VisionConfig& v,
                                       const std::map<std::string, at::Tensor>& params,
                                       const ModelContext& ctx) {
  const SlotShape shape = SlotShape::For(options_, device(), ctx.comm);
  MOELORA_ASSIGN_OR_RETURN(
      vision_, VisionTower::Create(v, params, options_, shape, options_.tower_connector_lora));
  if (options_.tower_connector_lora) {
    for (LoraModule* m : vision_->lora_modules()) RegisterLora(m);
  }
  return absl::OkStatus();
}

absl::StatusOr<VisionEncoding> DecoderModel::EncodeImages(const std::vector<VisionImage>& images) {
  if (!vision_) return CausalLM::EncodeImages(images);
  if (options_.kernels == LoraKernels::kCuda) {
    MOELORA_RETURN_IF_ERROR(CudaSetDevice(options_.cuda_device));
  }
  return vision_->Forward(images, [this](at::Tensor& t) { return AllReduce(t); });
}

absl::StatusOr<at::Tensor> DecoderModel::Forward(const ForwardBatch& b) {
  const at::Device dev = device();
  MOELORA_ASSIGN_OR_RETURN(StepInputs in, BeginStep(b, options_, dev, mtp_heads()));
  const LoraBatch lb = LoraBatch::Make(options_, b.slots, dev);
  const int64_t T = static_cast<int64_t>(b.tokens.size());
  if (!b.positions3.empty() && static_cast<int64_t>(b.positions3.size()) != 3 * T) {
    return absl::InvalidArgumentError("positions3 must hold three rows of the batch's tokens");
  }
  std::vector<Rotary::Table> tables;
  tables.reserve(rotaries_.size());
  for (const Rotary& r : rotaries_) {
    tables.push_back(!b.positions3.empty() && r.mrope()
                         ? r.ComputeMrope(b.positions3, options_.dtype)
                         : r.Compute(in.positions, options_.dtype));
  }
  at::Tensor embedded = ends_.embed.index_select(0, in.tokens);
  at::Tensor visual_rows;
  if (!b.visual_rows.empty()) {
    const int64_t n = static_cast<int64_t>(b.visual_rows.size());
    if (!b.visual_embeds.defined() || b.visual_embeds.size(0) != n ||
        b.visual_embeds.size(1) != embedded.size(1)) {
      return absl::InvalidArgumentError("visual_embeds do not match visual_rows");
    }
    visual_rows = at::from_blob(const_cast<int64_t*>(b.visual_rows.data()), {n}, at::kLong).to(dev);
    embedded.index_copy_(0, visual_rows, b.visual_embeds.to(embedded.scalar_type()));
  }
  ResidualStream x(std::move(embedded));
  const double eps = config_.rms_norm_eps;
  for (size_t l = 0; l < layers_.size(); ++l) {
    MOELORA_RETURN_IF_ERROR(RunLayer(layers_[l], static_cast<int>(l), x, b, tables, lb));
    if (l < b.visual_deepstack.size() && visual_rows.defined()) {
      // DeepStack: the layer's output at the image tokens plus the tower's features (in place
      // on the stream, which Sum has just completed).
      x.Sum().index_add_(0, visual_rows, b.visual_deepstack[l].to(x.Sum().scalar_type()));
    }
  }
  return ends_.Finish(b, x.Sum(), eps, norm_, mtp_.empty() ? nullptr : &last_hidden_, mtp_chained_);
}

absl::Status DecoderModel::RunLayer(DecoderLayer& L, int index, ResidualStream& x,
                                    const ForwardBatch& b, const std::vector<Rotary::Table>& t,
                                    const LoraBatch& lb) {
  const double eps = config_.rms_norm_eps;
  const at::Tensor hn = x.Norm(L.in_norm, eps, norm_);
  absl::StatusOr<at::Tensor> mixed =
      L.gdn ? L.gdn->Forward(hn, b, index, lb)
            : L.attn->Forward(hn, b, index, rotaries_[L.rope], t[L.rope], lb);
  if (!mixed.ok()) return mixed.status();
  MOELORA_RETURN_IF_ERROR(AllReduce(*mixed));
  x.Add(*mixed);
  const at::Tensor fn = x.Norm(L.post_norm, eps, norm_);
  absl::StatusOr<at::Tensor> f = L.moe ? L.moe->Forward(fn, lb) : L.mlp->Forward(fn, lb);
  if (!f.ok()) return f.status();
  MOELORA_RETURN_IF_ERROR(AllReduce(*f));
  x.Add(*f);
  return absl::OkStatus();
}

absl::StatusOr<at::Tensor> DecoderModel::ForwardMtp(const ForwardBatch& b, const at::Tensor& hidden,
                                                    at::Tensor* out, int head, bool every_row) {
  if (mtp_.empty()) return CausalLM::ForwardMtp(b, hidden, out, head, every_row);
  if (head < 0 || head >= mtp_heads()) {
    return absl::InvalidArgumentError(
        absl::StrCat("MTP head ", head, " of ", mtp_heads(), " (0 .. ", mtp_heads() - 1, ")"));
  }
  MtpHead& mh = *mtp_[static_cast<size_t>(head)];
  const int64_t T = static_cast<int64_t>(b.tokens.size()), H = config_.info.hidden_size;
  if (T == 0 || b.slots.size() != b.tokens.size()) {
    return absl::InvalidArgumentError("empty batch or slots/tokens size mismatch");
  }
  if (!hidden.defined() || hidden.dim() != 2 || hidden.size(0) != T || hidden.size(1) != H) {
    return absl::InvalidArgumentError(absl::StrCat("the MTP head takes one hidden state of ", H,
                                                   " values per token (", T, " tokens)"));
  }
  const at::Device dev = device();
  if (options_.kernels == LoraKernels::kCuda) {
    MOELORA_RETURN_IF_ERROR(CudaSetDevice(options_.cuda_device));
  }
  // The head's positions are its own, behind the target's: while its layer runs, each
  // sequence's len stands for its mtp_len[head] (what the attention writes at and reads up to).
  std::vector<int64_t> positions(T), saved;
  for (const auto& s : b.seqs) {
    SeqState& st = *s.state;
    const int64_t at = st.mtp_len[static_cast<size_t>(head)];
    if (st.kv == nullptr || !st.kv->Reserve(st.table, at + s.count)) {
      return absl::ResourceExhaustedError(
          absl::StrCat("the KV cache cannot hold the MTP head's positions up to ", at + s.count));
    }
    for (int64_t i = 0; i < s.count; ++i) positions[s.begin + i] = at + i;
  }
  for (const auto& s : b.seqs) {
    saved.push_back(s.state->len);
    s.state->len = s.state->mtp_len[static_cast<size_t>(head)];
  }
  auto restore = [&] {
    for (size_t i = 0; i < b.seqs.size(); ++i) b.seqs[i].state->len = saved[i];
  };
  const double eps = config_.rms_norm_eps;
  const Rotary& rope = rotaries_[mh.layer.rope];
  std::vector<Rotary::Table> tables(rotaries_.size());
  if (!b.positions3.empty() && static_cast<int64_t>(b.positions3.size()) != 3 * T) {
    restore();
    return absl::InvalidArgumentError("positions3 must hold three rows of the batch's tokens");
  }
  // Multimodal RoPE: the streams of each head position are the target's at that position.
  tables[mh.layer.rope] = !b.positions3.empty() && rope.mrope()
                              ? rope.ComputeMrope(b.positions3, options_.dtype)
                              : rope.Compute(positions, options_.dtype);
  // Each token's slot adapts the head's modules (b.slots; -1: the head unadapted).
  const LoraBatch lb = LoraBatch::Make(options_, b.slots, dev);
  const at::Tensor tokens =
      at::from_blob(const_cast<int64_t*>(b.tokens.data()), {T}, at::kLong).to(dev);
  at::Tensor embedded = ends_.embed.index_select(0, tokens);
  if (!b.visual_rows.empty()) {
    // Image tokens among the inputs: the tower's embeddings, as the target read them.
    const int64_t n = static_cast<int64_t>(b.visual_rows.size());
    if (!b.visual_embeds.defined() || b.visual_embeds.size(0) != n ||
        b.visual_embeds.size(1) != embedded.size(1)) {
      restore();
      return absl::InvalidArgumentError("visual_embeds do not match visual_rows");
    }
    embedded.index_copy_(
        0, at::from_blob(const_cast<int64_t*>(b.visual_rows.data()), {n}, at::kLong).to(dev),
        b.visual_embeds.to(embedded.scalar_type()));
  }
  const at::Tensor e = RmsNorm(embedded, mh.norm_embed, eps, norm_);
  const at::Tensor h =
      RmsNorm(hidden.to(dev).to(e.scalar_type()).contiguous(), mh.norm_hidden, eps, norm_);
  ResidualStream x(MatmulWt(at::cat({e, h}, 1), mh.fc));
  const absl::Status st = RunLayer(mh.layer, mh.kv_layer, x, b, tables, lb);
  restore();
  MOELORA_RETURN_IF_ERROR(st);
  for (const auto& s : b.seqs) s.state->mtp_len[static_cast<size_t>(head)] += s.count;
  std::vector<int64_t> rows;
  for (const auto& s : b.seqs) {
    for (int64_t i = s.all_logits ? 0 : s.count - 1; i < s.count; ++i) rows.push_back(s.begin + i);
  }
  const at::Tensor z = x.Sum();
  const at::Tensor sel = z.index_select(
      0, at::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, at::kLong).to(dev));
  const at::Tensor o = RmsNorm(sel, mh.norm, eps, norm_);
  if (out != nullptr) {
    // The next draft step's hidden input: chained heads read the output before the norm, a
    // reused head its output after it.
    if (every_row) {
      *out = mtp_chained_ ? z : RmsNorm(z, mh.norm, eps, norm_);
    } else {
      *out = mtp_chained_ ? sel : o;
    }
  }
  return MatmulWt(o, mh.lm_head.defined() ? mh.lm_head : ends_.lm_head)
      .to(at::kFloat)
      .to(at::kCPU)
      .contiguous();
}

std::vector<KvLayerShape> DecoderModel::KvShapes() const {
  std::vector<KvLayerShape> v;
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (!layers_[l].attn) continue;
    const AttentionSpec& a = layers_[l].attn->spec();
    v.push_back({static_cast<int>(l), a.kv_heads, a.head_dim, a.sliding_window});
  }
  for (const auto& h : mtp_) {
    const AttentionSpec& a = h->layer.attn->spec();
    v.push_back({h->kv_layer, a.kv_heads, a.head_dim, a.sliding_window});
  }
  return v;
}

std::vector<StateLayerShape> DecoderModel::StateShapes() const {
  std::vector<StateLayerShape> v;
  for (size_t l = 0; l < layers_.size(); ++l) {
    if (layers_[l].gdn) {
      v.push_back({static_cast<int>(l), layers_[l].gdn->conv_shape(), layers_[l].gdn->ssm_shape()});
    }
  }
  return v;
}

LmEnds LmEnds::From(const std::map<std::string, at::Tensor>& P, bool has_lm_head) {
  LmEnds e;
  e.embed = P.at("model.embed_tokens.weight");
  e.final_norm = P.at("model.norm.weight");
  e.lm_head = has_lm_head ? P.at("lm_head.weight") : e.embed;
  return e;
}

at::Tensor LmEnds::Finish(const ForwardBatch& b, const at::Tensor& x, double eps, NormKind kind,
                          at::Tensor* hidden, bool hidden_pre_norm) const {
  for (const auto& s : b.seqs) s.state->len += s.count;
  std::vector<int64_t> rows;
  for (const auto& s : b.seqs) {
    for (int64_t i = s.all_logits ? 0 : s.count - 1; i < s.count; ++i) rows.push_back(s.begin + i);
  }
  at::Tensor sel = x.index_select(
      0, at::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, at::kLong).to(x.device()));
  if (hidden != nullptr && hidden_pre_norm) {
    *hidden = x;  // every new token's row, as the MTP head reads them
  } else if (hidden != nullptr) {
    // Every new token's row after the norm (the MTP head reads each position's), the logit rows
    // among them.
    *hidden = RmsNorm(x, final_norm, eps, kind);
    sel = hidden->index_select(
        0,
        at::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, at::kLong).to(x.device()));
    return MatmulWt(sel, lm_head).to(at::kFloat).to(at::kCPU).contiguous();
  }
  sel = RmsNorm(sel, final_norm, eps, kind);
  return MatmulWt(sel, lm_head).to(at::kFloat).to(at::kCPU).contiguous();
}

void AddAttentionSpecs(std::vector<ParamSpec>& s, const std::string& p, const ModelConfig& c,
                       int64_t q_rows, bool qk_norm, bool lw) {
  const int64_t H = c.info.hidden_size, d = c.info.head_dim, hq = c.info.num_attention_heads,
                hkv = c.info.num_key_value_heads;
  const std::string a = p + "self_attn.", bl = lw ? "base_layer." : "";
  s.push_back({a + "q_proj." + bl + "weight", {q_rows, H}, TpSplit::kRows});
  s.push_back({a + "k_proj." + bl + "weight", {hkv * d, H}, TpSplit::kRows});
  s.push_back({a + "v_proj." + bl + "weight", {hkv * d, H}, TpSplit::kRows});
  s.push_back({a + "o_proj." + bl + "weight", {H, hq * d}, TpSplit::kCols});
  if (qk_norm) {
    s.push_back({a + "q_norm.weight", {d}, TpSplit::kReplicated});
    s.push_back({a + "k_norm.weight", {d}, TpSplit::kReplicated});
  }
}

absl::StatusOr<AttentionParts> MakeAttentionParts(const std::map<std::string, at::Tensor>& P,
                                                  const std::string& p, const ModelConfig& c,
                                                  int tp, int64_t q_rows, const SlotShape& shape) {
  const int64_t H = c.info.hidden_size, d = c.info.head_dim, hq = c.info.num_attention_heads,
                hkv = c.info.num_key_value_heads;
  auto linear = [&](const char* name, TpMode mode, int64_t in, int64_t out) {
    const std::string path = p + "self_attn." + name;
    at::Tensor bias = c.attention_bias ? P.at(path + ".bias") : at::Tensor();
    return LoraLinear::Create(path, P.at(path + ".base_layer.weight"), bias, mode, in, {out}, shape,
                              QuantizedParam(P, path + ".base_layer.weight"));
  };
  AttentionParts a;
  MOELORA_ASSIGN_OR_RETURN(a.q, linear("q_proj", TpMode::kColumn, H, q_rows));
  MOELORA_ASSIGN_OR_RETURN(a.k, linear("k_proj", TpMode::kColumn, H, hkv * d));
  MOELORA_ASSIGN_OR_RETURN(a.v, linear("v_proj", TpMode::kColumn, H, hkv * d));
  MOELORA_ASSIGN_OR_RETURN(a.o, linear("o_proj", TpMode::kRow, hq * d, H));
  a.spec.heads = hq / tp;
  a.spec.kv_heads = hkv / tp;
  a.spec.head_dim = d;
  a.spec.eps = c.rms_norm_eps;
  return a;
}

std::unique_ptr<Attention> MakeAttention(AttentionParts a,
                                         const std::map<std::string, at::Tensor>& P,
                                         const std::string& p, bool qk_norm, bool sinks) {
  const std::string s = p + "self_attn.";
  return std::make_unique<Attention>(
      a.spec, std::move(a.q), std::move(a.k), std::move(a.v), std::move(a.o),
      qk_norm ? P.at(s + "q_norm.weight") : at::Tensor(),
      qk_norm ? P.at(s + "k_norm.weight") : at::Tensor(), sinks ? P.at(s + "sinks") : at::Tensor());
}

void DecoderModel::RegisterLayerLora(DecoderLayer& L) {
  if (L.attn) {
    for (LoraModule* x :
         {L.attn->q_down(), L.attn->q(), L.attn->k(), L.attn->v(), L.attn->o(), L.attn->g()}) {
      if (x != nullptr) RegisterLora(x);
    }
  }
  if (L.gdn) {
    for (LoraModule* x :
         {L.gdn->in_qkv(), L.gdn->in_z(), L.gdn->in_b(), L.gdn->in_a(), L.gdn->out()}) {
      RegisterLora(x);
    }
  }
  if (SwiGluMlp* s = L.mlp ? L.mlp.get() : (L.moe ? L.moe->shared() : nullptr)) {
    for (LoraModule* x : {s->gate.get(), s->up.get(), s->down.get()}) RegisterLora(x);
  }
  if (L.moe) RegisterLora(L.moe->experts());
}

void AddExpertSpecs(std::vector<ParamSpec>& s, const std::string& experts, const ModelConfig& c,
                    bool lw) {
  const int64_t H = c.info.hidden_size, E = c.info.num_experts, I = c.info.moe_intermediate_size;
  s.push_back({W13Name(experts, lw), {E, 2 * I, H}, TpSplit::kExperts});
  s.push_back({W2Name(experts, lw), {E, H, I}, TpSplit::kExperts});
}

void AddSwiGluSpecs(std::vector<ParamSpec>& s, const std::string& m, int64_t H, int64_t inter) {
  s.push_back({m + "gate_proj.base_layer.weight", {inter, H}, TpSplit::kRows});
  s.push_back({m + "up_proj.base_layer.weight", {inter, H}, TpSplit::kRows});
  s.push_back({m + "down_proj.base_layer.weight", {H, inter}, TpSplit::kCols});
}

[[nodiscard]] absl::StatusOr<std::unique_ptr<SwiGluMlp>> MakeSwiGluMlp(
    const std::map<std::string, at::Tensor>& P, const std::string& m, int64_t H, int64_t inter,
    const SlotShape& shape, double limit) {
  auto linear = [&](const char* name, TpMode mode, int64_t in, int64_t out) {
    const std::string path = m + name;
    return LoraLinear::Create(path, P.at(path + ".base_layer.weight"), at::Tensor(), mode, in,
                              {out}, shape, QuantizedParam(P, path + ".base_layer.weight"));
  };
  auto s = std::make_unique<SwiGluMlp>();
  MOELORA_ASSIGN_OR_RETURN(s->gate, linear("gate_proj", TpMode::kColumn, H, inter));
  MOELORA_ASSIGN_OR_RETURN(s->up, linear("up_proj", TpMode::kColumn, H, inter));
  MOELORA_ASSIGN_OR_RETURN(s->down, linear("down_proj", TpMode::kRow, inter, H));
  s->limit = limit;
  return s;
}

absl::StatusOr<std::unique_ptr<MoeExperts>> MakeExperts(const std::string& experts,
                                                        const std::map<std::string, at::Tensor>& P,
                                                        const ModelConfig& c, const ModelOptions& o,
                                                        AdapterFormat wrapper,
                                                        const SlotShape& shape) {
  const int64_t E = c.info.num_experts;
  const bool ep = o.expert_parallel;
  const std::string w13 = W13Name(experts, true), w2 = W2Name(experts, true);
  QuantizedWeight a = QuantizedParam(P, w13), b = QuantizedParam(P, w2);
  if (!a.defined() || !b.defined()) {
    if (a.defined() != b.defined()) {
      return absl::InvalidArgumentError(absl::StrCat(
          experts, ": one of gate_up and down is stored quantized and the other is not"));
    }
    return std::make_unique<MoeExperts>(experts, P.at(w13), P.at(w2), c.info.moe_intermediate_size,
                                        wrapper, c.info.architecture, shape,
                                        ep ? o.tp_rank * (E / o.tp_size) : 0, ep ? E : 0);
  }
  if (o.kernels != LoraKernels::kCpuSgmv) return QuantizedNeedsCpuPath(experts);
  // The shapes the module is built with: meta tensors hold no memory.
  const auto meta = at::TensorOptions().dtype(o.dtype).device(at::kMeta);
  auto m = std::make_unique<MoeExperts>(experts, at::empty({a.codes.size(0), a.n(), a.k()}, meta),
                                        at::empty({b.codes.size(0), b.n(), b.k()}, meta),
                                        c.info.moe_intermediate_size, wrapper, c.info.architecture,
                                        shape, ep ? o.tp_rank * (E / o.tp_size) : 0, ep ? E : 0);
  m->SetQuantized(std::move(a), std::move(b));
  return m;
}

[[nodiscard]] absl::StatusOr<std::vector<bool>> MoeLayersEnum(const std::string& text, int n,
                                                              const std::string& file,
                                                              bool required) {
  const nlohmann::json t = nlohmann::json::parse(text, nullptr, false);
  std::vector<bool> moe(n, false);
  if (!t.is_object() || !t.contains("moe_layers_enum")) {
    if (required) {
      return absl::FailedPreconditionError(
          absl::StrCat(file,
                       ": moe_layers_enum is required (the hub code and transformers default it "
                       "differently)"));
    }
    for (int i = 1; i < n; ++i) moe[i] = true;
    return moe;
  }
  std::set<int> layers;
  const nlohmann::json& me = t["moe_layers_enum"];
  if (me.is_string()) {
    for (absl::string_view part : absl::StrSplit(me.get<std::string>(), ',', absl::SkipEmpty())) {
      int k = 0;
      if (!absl::SimpleAtoi(part, &k))
        return ConfigInvalid(file, "moe_layers_enum: \"", part, "\" is not a layer");
      layers.insert(k);
    }
  } else if (me.is_array()) {
    for (const auto& v : me) {
      if (!v.is_number_integer())
        return ConfigInvalid(file, "moe_layers_enum must list layer indices");
      layers.insert(v.get<int>());
    }
  } else {
    return ConfigInvalid(file, "moe_layers_enum must be a comma-separated string or a list");
  }
  for (int i = 0; i < n; ++i) moe[i] = layers.count(i) > 0;
  return moe;
}

[[nodiscard]] absl::StatusOr<std::string> ReadConfigText(const std::string& model_dir) {
  const std::string path = model_dir + "/config.json";
  std::ifstream in(path);
  if (!in) return absl::NotFoundError(absl::StrCat(path, ": cannot open"));
  std::stringstream ss;
  ss << in.rdbuf();
  // What the model files read: absent keys as the architecture's class defaults.
  return ApplyConfigDefaults(ss.str(), path);
}

}  // namespace moelora
