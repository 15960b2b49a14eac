#include "schema/name_tables.h"

#include <regex>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"

namespace moelora {
namespace {

// std::regex is slow to build; the patterns are built once. (A hand-rolled matcher would be
// faster still, but name mapping runs once per checkpoint tensor at load time.)
const std::regex& PerExpertRe() {
  static const std::regex re(R"(^(.*\.experts)\.(\d+)\.(gate|up|down)_proj\.weight$)");
  return re;
}
const std::regex& FusedRe() {
  static const std::regex re(R"(^(.*\.experts)\.(gate_up|down)_proj$)");
  return re;
}
const std::regex& StackedStepRe() {
  static const std::regex re(R"(^(.*\.moe)\.(gate|up|down)_proj\.weight$)");
  return re;
}

// Checkpoint names from a PEFT-wrapped trainer carry `.base_layer.`; the table works on the
// plain name and adds the engine's own `.base_layer.` where the engine wraps.
std::string StripBaseLayer(const std::string& name) {
  return absl::StrReplaceAll(name, {{".base_layer.", "."}});
}

std::string TextPrefix(const std::string& name) {
  if (absl::StartsWith(name, "model.language_model.")) {
    return absl::StrCat("model.", name.substr(std::string("model.language_model.").size()));
  }
  return name;
}

// Dense linears the engine wraps for LoRA (their weight moves under `.base_layer.`): attention,
// Qwen3.5's Gated DeltaNet projections and the shared expert.
bool IsWrappedDense(const std::string& name) {
  static const char* kWrapped[] = {
      ".self_attn.q_proj.weight", ".self_attn.k_proj.weight", ".self_attn.v_proj.weight",
      ".self_attn.o_proj.weight", ".linear_attn.in_proj_qkv.weight",
      ".linear_attn.in_proj_z.weight", ".linear_attn.in_proj_b.weight",
      ".linear_attn.in_proj_a.weight", ".linear_attn.out_proj.weight",
      ".mlp.shared_expert.gate_proj.weight", ".mlp.shared_expert.up_proj.weight",
      ".mlp.shared_expert.down_proj.weight",
      // Step3.5: the head-wise gate, the layer-level shared expert and the dense layers' MLP.
      ".self_attn.wq.weight", ".self_attn.g_proj.weight", ".share_expert.gate_proj.weight",
      ".share_expert.up_proj.weight", ".share_expert.down_proj.weight", ".mlp.gate_proj.weight",
      ".mlp.up_proj.weight", ".mlp.down_proj.weight"};
  for (const char* s : kWrapped) {
    if (absl::EndsWith(name, s)) return true;
  }
  return false;
}

NameMapping Dense(const std::string& name, bool lora_wrapped) {
  NameMapping m;
  m.kind = NameMapping::kLoad;
  if (lora_wrapped && IsWrappedDense(name)) {
    m.target.param = absl::StrCat(name.substr(0, name.size() - std::string("weight").size()),
                                  "base_layer.weight");
  } else {
    m.target.param = name;
  }
  return m;
}

NameMapping Skip(std::string reason) {
  NameMapping m;
  m.kind = NameMapping::kSkip;
  m.reason = std::move(reason);
  return m;
}

NameMapping Expert(const std::string& prefix, int expert, ExpertShard shard, bool transposed,
                   bool lora_wrapped) {
  NameMapping m;
  m.kind = NameMapping::kLoad;
  m.target.param =
      shard == ExpertShard::kW2 ? W2Name(prefix, lora_wrapped) : W13Name(prefix, lora_wrapped);
  m.target.expert = expert;
  m.target.shard = shard;
  m.target.transposed = transposed;
  return m;
}

ExpertShard ShardOf(const std::string& proj) {
  if (proj == "gate") return ExpertShard::kW1;
  if (proj == "up") return ExpertShard::kW3;
  return ExpertShard::kW2;
}

// Per-expert nn.Linear weights: `experts.{e}.{gate,up,down}_proj.weight` (Qwen3-MoE; also the
// FP8 releases of Qwen3.5).
bool MatchPerExpert(const std::string& n, bool lora_wrapped, NameMapping* out) {
  std::smatch m;
  if (!std::regex_match(n, m, PerExpertRe())) return false;
  int e = 0;
  try {
    e = std::stoi(m[2].str());
  } catch (...) {
    return false;  // an index too large for int: reported as an unknown tensor
  }
  *out = Expert(m[1].str(), e, ShardOf(m[3].str()), false, lora_wrapped);
  return true;
}

// Fused `experts.gate_up_proj` / `experts.down_proj`: [E, 2I, H] / [E, H, I] (Qwen3.5), or
// transposed [E, H, 2I] / [E, I, H] (Qwen3-VL-MoE).
bool MatchFused(const std::string& n, bool transposed, bool lora_wrapped, NameMapping* out) {
  std::smatch m;
  if (!std::regex_match(n, m, FusedRe())) return false;
  *out = Expert(m[1].str(), -1, m[2].str() == "down" ? ExpertShard::kW2 : ExpertShard::kW13,
                transposed, lora_wrapped);
  return true;
}

// Step3: `moe.{gate,up,down}_proj.weight` stacked [E, I, H] / [E, H, I] ->
// `moe.experts.w13_weight`.
bool MatchStackedStep(const std::string& n, bool lora_wrapped, NameMapping* out) {
  std::smatch m;
  if (!std::regex_match(n, m, StackedStepRe())) return false;
  *out = Expert(m[1].str() + ".experts", -1, ShardOf(m[2].str()), false, lora_wrapped);
  return true;
}

}  // namespace

NameMapping MapQwen3Moe(const std::string& ckpt, bool lw) {
  const std::string n = StripBaseLayer(ckpt);
  NameMapping m;
  if (MatchPerExpert(n, lw, &m)) return m;
  return Dense(n, lw);
}

namespace {

// The vision tower's tensors: `model.visual.…` (older exports `visual.…`), loaded under
// model.visual. with any PEFT `.base_layer.` removed (worker/architectures/vision_tower.h).
bool MatchVisual(const std::string& ckpt, NameMapping* out) {
  std::string n = StripBaseLayer(ckpt);
  if (absl::StartsWith(n, "visual.")) n = "model." + n;
  if (!absl::StartsWith(n, "model.visual.")) return false;
  out->kind = NameMapping::kLoad;
  out->target.param = n;
  return true;
}

}  // namespace

NameMapping MapQwen3VlMoe(const std::string& ckpt, bool lw) {
  NameMapping m;
  if (MatchVisual(ckpt, &m)) return m;
  const std::string n = TextPrefix(StripBaseLayer(ckpt));
  if (MatchFused(n, /*transposed=*/true, lw, &m)) {
    m.target.either_layout = true;
    return m;
  }
  return Dense(n, lw);
}

NameMapping MapQwen35Moe(const std::string& ckpt, bool lw) {
  NameMapping m;
  if (MatchVisual(ckpt, &m)) return m;
  const std::string n = TextPrefix(StripBaseLayer(ckpt));
  if (MatchFused(n, /*transposed=*/false, lw, &m)) return m;
  if (MatchPerExpert(n, lw, &m)) return m;  // FP8 releases store experts one by one
  return Dense(n, lw);
}

NameMapping MapGptOss(const std::string& ckpt, bool lw) {
  const std::string n = StripBaseLayer(ckpt);
  static const std::regex re(R"(^(.*\.experts)\.(gate_up_proj|down_proj)(_bias)?$)");
  std::smatch m;
  if (std::regex_match(n, m, re)) {
    const bool gate_up = m[2].str() == "gate_up_proj", bias = m[3].matched;
    if (!gate_up && bias) {
      // down_proj_bias [E, H]: whole on every rank (added once: rank 0, or the expert's rank).
      NameMapping d;
      d.kind = NameMapping::kLoad;
      d.target.param = m[1].str() + ".w2_bias";
      return d;
    }
    NameMapping e = Expert(m[1].str(), -1, gate_up ? ExpertShard::kW13 : ExpertShard::kW2,
                           /*transposed=*/!bias, lw);
    e.target.interleaved = gate_up;
    e.target.bias = bias;
    if (bias) e.target.param = m[1].str() + ".w13_bias";
    return e;
  }
  return Dense(n, lw);
}

NameMapping MapQwen35MoeMain(const std::string& ckpt, bool lw) {
  if (absl::StartsWith(ckpt, "mtp.")) {
    return Skip("MTP head (speculative decoding is not served)");
  }
  return MapQwen35Moe(ckpt, lw);
}

int CheckpointLayerIndex(const std::string& name) {
  const size_t at = name.find("layers.");
  if (at == std::string::npos || (at > 0 && name[at - 1] != '.')) return -1;
  int n = -1;
  const size_t b = at + 7, e = name.find('.', b);
  if (e == std::string::npos || !absl::SimpleAtoi(name.substr(b, e - b), &n)) return -1;
  return n;
}

NameMapping MapStep3(const std::string& ckpt, bool lw) {
  const std::string n = StripBaseLayer(ckpt);
  // vLLM ignores these too (with a warning): the router's selection bias is moe.router_bias.
  if (absl::EndsWith(n, ".expert_bias")) return Skip("expert_bias is not read (vLLM neither)");
  NameMapping m;
  if (MatchStackedStep(n, lw, &m)) return m;
  return Dense(n, lw);
}

NameMapping MapStep3p5Mtp(const std::string& ckpt, bool lw) {
  // vLLM drops the `.transformer.` some MTP layers' block names carry, and loads an MTP layer's
  // own embed_tokens into the shared embedding (the release stores the same matrix).
  if (CheckpointLayerIndex(ckpt) >= 0 && absl::StrContains(ckpt, ".embed_tokens.")) {
    return Skip("an MTP layer's copy of the embedding: the model's own is used");
  }
  return MapStep3(absl::StrReplaceAll(ckpt, {{".transformer.", "."}}), lw);
}

const char* ExpertShardName(ExpertShard s) {
  switch (s) {
    case ExpertShard::kNone:
      return "none";
    case ExpertShard::kW1:
      return "w1";
    case ExpertShard::kW3:
      return "w3";
    case ExpertShard::kW13:
      return "w13";
    case ExpertShard::kW2:
      return "w2";
  }
  return "?";
}

std::string W13Name(const std::string& experts_prefix, bool lora_wrapped) {
  return absl::StrCat(experts_prefix, lora_wrapped ? ".base_layer" : "", ".w13_weight");
}
std::string W2Name(const std::string& experts_prefix, bool lora_wrapped) {
  return absl::StrCat(experts_prefix, lora_wrapped ? ".base_layer" : "", ".w2_weight");
}

}  // namespace moelora
