#include "worker/models/decoder.h"

#include "absl/strings/str_cat.h"
#include "common/status_macros.h"
#include "kernels/device.h"

namespace moelora {

absl::StatusOr<StepInputs> BeginStep(const ForwardBatch& b, const ModelOptions& o,
                                     const at::Device& device) {
  const int64_t T = static_cast<int64_t>(b.tokens.size());
  if (T == 0 || b.slots.size() != b.tokens.size()) {
    return absl::InvalidArgumentError("empty batch or slots/tokens size mismatch");
  }
  if (o.kernels == LoraKernels::kCuda) MOELORA_RETURN_IF_ERROR(CudaSetDevice(o.cuda_device));
  StepInputs in;
  in.positions.resize(T);
  for (const auto& s : b.seqs) {
    for (int64_t i = 0; i < s.count; ++i) in.positions[s.begin + i] = s.state->len + i;
  }
  in.tokens = at::from_blob(const_cast<int64_t*>(b.tokens.data()), {T}, at::kLong).to(device);
  return in;
}

LmEnds LmEnds::From(const std::map<std::string, at::Tensor>& P, bool has_lm_head) {
  LmEnds e;
  e.embed = P.at("model.embed_tokens.weight");
  e.final_norm = P.at("model.norm.weight");
  e.lm_head = has_lm_head ? P.at("lm_head.weight") : e.embed;
  return e;
}

at::Tensor LmEnds::Finish(const ForwardBatch& b, const at::Tensor& x, double eps,
                          NormKind kind) const {
  for (const auto& s : b.seqs) s.state->len += s.count;
  std::vector<int64_t> rows;
  for (const auto& s : b.seqs) {
    for (int64_t i = s.all_logits ? 0 : s.count - 1; i < s.count; ++i) rows.push_back(s.begin + i);
  }
  at::Tensor sel = x.index_select(
      0, at::from_blob(rows.data(), {static_cast<int64_t>(rows.size())}, at::kLong).to(x.device()));
  sel = RmsNorm(sel, final_norm, eps, kind);
  return at::matmul(sel, lm_head.t()).to(at::kFloat).to(at::kCPU).contiguous();
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

void AddExpertSpecs(std::vector<ParamSpec>& s, const std::string& experts, const ModelConfig& c,
                    bool lw) {
  const int64_t H = c.info.hidden_size, E = c.info.num_experts, I = c.info.moe_intermediate_size;
  s.push_back({W13Name(experts, lw), {E, 2 * I, H}, TpSplit::kExperts});
  s.push_back({W2Name(experts, lw), {E, H, I}, TpSplit::kExperts});
}

std::unique_ptr<MoeExperts> MakeExperts(const std::string& experts,
                                        const std::map<std::string, at::Tensor>& P,
                                        const ModelConfig& c, const ModelOptions& o,
                                        AdapterFormat wrapper, const SlotShape& shape) {
  const int64_t E = c.info.num_experts;
  const bool ep = o.expert_parallel;
  return std::make_unique<MoeExperts>(experts, P.at(W13Name(experts, true)),
                                      P.at(W2Name(experts, true)), c.info.moe_intermediate_size,
                                      wrapper, c.info.architecture, shape,
                                      ep ? o.tp_rank * (E / o.tp_size) : 0, ep ? E : 0);
}

}  // namespace moelora
