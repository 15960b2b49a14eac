#include "worker/loaders/weight_loader.h"

#include <ATen/CPUGeneratorImpl.h>
#include <sys/mman.h>

#include <cstdlib>
#include <cstring>
#include <functional>

#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_join.h"
#include "common/status_macros.h"
#include "lora/tp_slice.h"
#include "schema/name_tables.h"

namespace moelora {
namespace {

std::string Shape(at::IntArrayRef s) { return absl::StrCat("[", absl::StrJoin(s, ", "), "]"); }

bool IsW13(const std::string& p) {
  return absl::EndsWith(p, "w13_weight") || absl::EndsWith(p, "w13_bias");
}
bool IsW2(const std::string& p) { return absl::EndsWith(p, "w2_weight"); }

// A view of the checkpoint bytes as an ATen tensor (copied when the mapping is misaligned for
// the element type).
[[nodiscard]] absl::StatusOr<at::Tensor> SourceTensor(const TensorView& v,
                                                      const std::string& file) {
  at::ScalarType st;
  size_t elem = 0;
  switch (v.dtype) {
    case DType::kF32:
      st = at::kFloat, elem = 4;
      break;
    case DType::kBF16:
      st = at::kBFloat16, elem = 2;
      break;
    case DType::kF16:
      st = at::kHalf, elem = 2;
      break;
    default:
      return absl::InvalidArgumentError(absl::StrCat(file, ": tensor ", v.name, " has dtype ",
                                                     DTypeName(v.dtype),
                                                     "; base weights must be F32, BF16 or F16"));
  }
  std::vector<int64_t> shape(v.shape.begin(), v.shape.end());
  auto* data = const_cast<uint8_t*>(v.data);
  if (reinterpret_cast<uintptr_t>(data) % elem != 0) {
    at::Tensor t = at::empty(shape, at::TensorOptions().dtype(st));
    std::memcpy(t.data_ptr(), data, v.nbytes);
    return t;
  }
  return at::from_blob(data, shape, at::TensorOptions().dtype(st));
}

struct Coverage {
  std::vector<std::string> setter;  // per piece: the checkpoint tensor that set it ("" = unset)
};

int64_t PiecesOf(const std::string& param, int num_experts) {
  if (IsW13(param)) return 2 * static_cast<int64_t>(num_experts);
  if (IsW2(param)) return num_experts;
  return 1;
}

}  // namespace

namespace {

// This rank's shape of `s` (its full shape split as s.split says); INVALID_ARGUMENT when a split
// does not divide by the world size.
[[nodiscard]] absl::StatusOr<std::vector<int64_t>> LocalShape(const ParamSpec& s,
                                                              const ModelConfig& config,
                                                              const LoadOptions& opt) {
  const int E = config.info.num_experts;
  const int64_t I = config.info.moe_intermediate_size;
  const int tp = opt.tp_size;
  std::vector<int64_t> local = s.shape;
  auto split_dim = [&](size_t d) -> absl::Status {
    if (d >= local.size() || local[d] % tp != 0) {
      return absl::InvalidArgumentError(
          absl::StrCat("parameter ", s.name, " ", Shape(s.shape), ": dim ", d,
                       " does not divide by --tensor-parallel-size ", tp));
    }
    local[d] /= tp;
    return absl::OkStatus();
  };
  switch (s.split) {
    case TpSplit::kReplicated:
      break;
    case TpSplit::kRows:
      MOELORA_RETURN_IF_ERROR(split_dim(0));
      if (!s.sections.empty()) {
        int64_t sum = 0;
        for (int64_t n : s.sections) sum += n;
        auto check = ShardSections(s.sections, 0, tp);
        if (sum != s.shape[0] || !check.ok()) {
          return absl::InvalidArgumentError(absl::StrCat(
              "parameter ", s.name, " ", Shape(s.shape), ": sections [",
              absl::StrJoin(s.sections, ", "), "] do not each divide by --tensor-parallel-size ",
              tp, " or do not sum to dim 0"));
        }
      }
      break;
    case TpSplit::kCols:
      MOELORA_RETURN_IF_ERROR(split_dim(1));
      break;
    case TpSplit::kExperts:
      if (opt.expert_parallel) {
        if (E % tp != 0) {
          return absl::InvalidArgumentError(
              absl::StrCat("num_experts ", E, " does not divide by --tensor-parallel-size ", tp,
                           " (--enable-expert-parallel)"));
        }
        local[0] = E / tp;
        break;
      }
      if (I % tp != 0) {
        return absl::InvalidArgumentError(absl::StrCat(
            "moe_intermediate_size ", I, " does not divide by --tensor-parallel-size ", tp));
      }
      if (IsW13(s.name))
        local[1] = 2 * I / tp;
      else
        local[2] = I / tp;
      break;
  }
  return local;
}

}  // namespace

[[nodiscard]] absl::StatusOr<LoadedWeights> DummyWeights(const ModelConfig& config,
                                                         const std::vector<ParamSpec>& specs,
                                                         const LoadOptions& opt) {
  if (opt.tp_size < 1 || opt.tp_rank < 0 || opt.tp_rank >= opt.tp_size) {
    return absl::InvalidArgumentError(
        absl::StrCat("tp rank ", opt.tp_rank, " outside world size ", opt.tp_size));
  }
  LoadedWeights out;
  for (const ParamSpec& s : specs) {
    MOELORA_ASSIGN_OR_RETURN(const std::vector<int64_t> local, LocalShape(s, config, opt));
    // N(0, 0.02^2), the usual initializer_range; seeded by the name and rank, so that a load is
    // repeatable.
    at::Generator gen = at::detail::createCPUGenerator(std::hash<std::string>{}(s.name) ^
                                                       (static_cast<uint64_t>(opt.tp_rank) << 56));
    at::Tensor t = at::empty(local, at::kFloat);
    t.normal_(0.0, 0.02, gen);
    out.params[s.name] = t.to(opt.dtype);
  }
  return out;
}

namespace {

// Whether a layer's fused experts (`<layer>.experts.gate_up_proj` and `.down_proj`) are stored
// transposed (the Qwen3-VL-MoE release: [E, H, 2I] and [E, I, H]) or not (transformers 5's
// save_pretrained: [E, 2I, H] and [E, H, I]). down_proj tells whenever H != I; else gate_up_proj
// does (then 2I != H). A layer whose tensors fit neither layout is left to the shape check, which
// names both.
bool FusedExpertsTransposed(const Checkpoint& ckpt, const std::string& name, int64_t H, int64_t I) {
  const std::string stem = name.substr(0, name.rfind('.'));  // `<layer>.experts`
  auto shape_of = [&](const char* which) -> const std::vector<int64_t>* {
    auto it = ckpt.tensors().find(stem + "." + which);
    return it == ckpt.tensors().end() ? nullptr : &it->second->shape;
  };
  auto is = [](const std::vector<int64_t>* s, int64_t a, int64_t b) {
    return s != nullptr && s->size() == 3 && (*s)[1] == a && (*s)[2] == b;
  };
  const std::vector<int64_t>* down = shape_of("down_proj");
  const std::vector<int64_t>* gate_up = shape_of("gate_up_proj");
  if (H != I) {
    if (is(down, I, H)) return true;
    if (is(down, H, I)) return false;
  }
  if (H != 2 * I) {
    if (is(gate_up, H, 2 * I)) return true;
    if (is(gate_up, 2 * I, H)) return false;
  }
  return true;
}

}  // namespace

[[nodiscard]] absl::StatusOr<LoadedWeights> LoadWeights(
    const Checkpoint& ckpt, const ArchTable& table, const ModelConfig& config,
    const std::vector<ParamSpec>& specs, const LoadOptions& opt, const SkipUnlisted& skip) {
  const int E = config.info.num_experts;
  const int64_t I = config.info.moe_intermediate_size;
  const int64_t H = config.info.hidden_size;
  const int tp = opt.tp_size, r = opt.tp_rank;
  if (tp < 1 || r < 0 || r >= tp) {
    return absl::InvalidArgumentError(absl::StrCat("tp rank ", r, " outside world size ", tp));
  }
  LoadedWeights out;
  std::map<std::string, const ParamSpec*> spec_of;
  std::map<std::string, Coverage> coverage;
  for (const ParamSpec& s : specs) {
    MOELORA_ASSIGN_OR_RETURN(const std::vector<int64_t> local, LocalShape(s, config, opt));
    out.params[s.name] = EmptyWeight(local, opt.dtype);
    spec_of[s.name] = &s;
    coverage[s.name].setter.assign(
        PiecesOf(s.name, s.split == TpSplit::kExperts && opt.expert_parallel ? E / tp : E), "");
  }

  std::vector<std::string> unconsumed;
  for (const auto& [name, view] : ckpt.tensors()) {
    if (table.facts->mtp_layers_follow && CheckpointLayerIndex(name) >= config.info.num_layers) {
      out.skipped.push_back(absl::StrCat(
          name, " (an MTP layer after num_hidden_layers: speculative decoding is not served)"));
      continue;
    }
    NameMapping m = table.map(name, opt.lora_wrapped);
    if (m.kind == NameMapping::kSkip) {
      out.skipped.push_back(absl::StrCat(name, " (", m.reason, ")"));
      continue;
    }
    auto sit = m.kind == NameMapping::kLoad ? spec_of.find(m.target.param) : spec_of.end();
    if (sit == spec_of.end() && m.kind == NameMapping::kLoad && !skip.prefix.empty() &&
        absl::StartsWith(m.target.param, skip.prefix)) {
      out.skipped.push_back(absl::StrCat(name, " (", skip.reason, ")"));
      continue;
    }
    if (sit == spec_of.end()) {
      unconsumed.push_back(m.kind == NameMapping::kLoad
                               ? absl::StrCat(name, " (-> ", m.target.param, ", not a parameter)")
                               : name);
      continue;
    }
    const std::string& file = ckpt.FileOf(name);
    auto where = [&]() { return absl::StrCat(file, ": tensor ", name, " ", view->ShapeString()); };
    MOELORA_ASSIGN_OR_RETURN(at::Tensor src, SourceTensor(*view, file));
    at::Tensor& dst = out.params[m.target.param];
    Coverage& cov = coverage[m.target.param];
    const ParamSpec& spec = *sit->second;
    auto claim = [&](int64_t piece) -> absl::Status {
      if (!cov.setter[piece].empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where(), " sets part of ", spec.name, " that ", cov.setter[piece], " already set"));
      }
      cov.setter[piece] = name;
      return absl::OkStatus();
    };
    if (m.target.shard == ExpertShard::kNone) {
      if (src.sizes() != at::IntArrayRef(spec.shape)) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), ": expected ", Shape(spec.shape), " for ", spec.name));
      }
      at::Tensor piece = src;
      if (spec.split == TpSplit::kRows && !spec.sections.empty()) {
        MOELORA_ASSIGN_OR_RETURN(std::vector<IndexRange> rows, ShardSections(spec.sections, r, tp));
        std::vector<at::Tensor> parts;
        for (const IndexRange& ir : rows) parts.push_back(src.narrow(0, ir.begin, ir.size));
        piece = at::cat(parts, 0);
      } else if (spec.split == TpSplit::kRows) {
        piece = src.narrow(0, r * dst.size(0), dst.size(0));
      }
      if (spec.split == TpSplit::kCols) piece = src.narrow(1, r * dst.size(1), dst.size(1));
      dst.copy_(piece);
      MOELORA_RETURN_IF_ERROR(claim(0));
      continue;
    }
    // Expert weights. Normalise the source to [n, out, in] with n = 1 (one expert) or E.
    if (m.target.either_layout) {
      m.target.transposed = FusedExpertsTransposed(ckpt, name, H, I);
    }
    const bool stacked = m.target.expert < 0;
    if (!stacked && m.target.expert >= E) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": expert index ", m.target.expert, " >= num_experts ", E));
    }
    const ExpertShard sh = m.target.shard;
    const int64_t want_out = sh == ExpertShard::kW2 ? H : (sh == ExpertShard::kW13 ? 2 * I : I);
    const int64_t want_in = m.target.bias ? 1 : sh == ExpertShard::kW2 ? I : H;
    std::vector<int64_t> want;
    if (stacked) want.push_back(E);
    if (m.target.transposed) {
      want.push_back(want_in), want.push_back(want_out);
    } else {
      want.push_back(want_out), want.push_back(want_in);
    }
    if (m.target.bias) src = src.unsqueeze(-1);  // [E, 2I] -> [E, 2I, 1]
    if (src.sizes() != at::IntArrayRef(want)) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ": expected ", Shape(want), " for ", ExpertShardName(sh), " of ", spec.name,
          m.target.either_layout
              ? " (fits neither layout of the experts: gate_up_proj [E, H, 2I] and "
                "down_proj [E, I, H] as released, or [E, 2I, H] and [E, H, I] as "
                "transformers saves them)"
          : m.target.transposed ? " (stored transposed, x @ W)"
                                : ""));
    }
    at::Tensor s3 = stacked ? src : src.unsqueeze(0);
    if (m.target.transposed) s3 = s3.transpose(1, 2);
    // Expert parallelism: this rank's experts [lo, lo + El) whole; otherwise every expert, with
    // 1/tp of the intermediate dim.
    const bool ep = opt.expert_parallel;
    const int64_t El = ep ? E / tp : E, lo = ep ? r * El : 0;
    int64_t e0 = stacked ? 0 : m.target.expert;
    if (stacked && ep) {
      s3 = s3.narrow(0, lo, El);
    } else if (ep) {
      if (e0 < lo || e0 >= lo + El) continue;  // another rank's expert
    }
    e0 -= stacked ? 0 : lo;
    const int64_t n = s3.size(0);
    at::Tensor d3 = dst.narrow(0, e0, n);
    const int64_t Ip = ep ? I : I / tp, ir = ep ? 0 : r;
    if (sh == ExpertShard::kW2) {
      d3.copy_(s3.narrow(2, ir * Ip, Ip));
      for (int64_t e = e0; e < e0 + n; ++e) MOELORA_RETURN_IF_ERROR(claim(e));
      continue;
    }
    auto copy_half = [&](const at::Tensor& half, int which) -> absl::Status {
      d3.narrow(1, which * Ip, Ip).copy_(half.narrow(1, ir * Ip, Ip));
      for (int64_t e = e0; e < e0 + n; ++e) MOELORA_RETURN_IF_ERROR(claim(2 * e + which));
      return absl::OkStatus();
    };
    if (sh == ExpertShard::kW13 && m.target.interleaved) {
      // Rows g0, u0, g1, u1, ...: the even ones are gate, the odd ones up.
      MOELORA_RETURN_IF_ERROR(copy_half(s3.slice(1, 0, 2 * I, 2), 0));
      MOELORA_RETURN_IF_ERROR(copy_half(s3.slice(1, 1, 2 * I, 2), 1));
    } else if (sh == ExpertShard::kW13) {
      MOELORA_RETURN_IF_ERROR(copy_half(s3.narrow(1, 0, I), 0));
      MOELORA_RETURN_IF_ERROR(copy_half(s3.narrow(1, I, I), 1));
    } else {
      MOELORA_RETURN_IF_ERROR(copy_half(s3, sh == ExpertShard::kW1 ? 0 : 1));
    }
  }
  if (!unconsumed.empty()) {
    const size_t shown = std::min<size_t>(unconsumed.size(), 8);
    return absl::InvalidArgumentError(
        absl::StrCat(ckpt.dir(), ": ", unconsumed.size(), " checkpoint tensor(s) the ",
                     table.architecture, " loader does not consume: ",
                     absl::StrJoin(unconsumed.begin(), unconsumed.begin() + shown, ", "),
                     unconsumed.size() > shown ? ", ..." : ""));
  }
  std::vector<std::string> unset;
  for (const auto& [param, cov] : coverage) {
    for (size_t p = 0; p < cov.setter.size(); ++p) {
      if (!cov.setter[p].empty()) continue;
      if (cov.setter.size() == 1) {
        unset.push_back(param);
      } else if (IsW13(param)) {
        unset.push_back(absl::StrCat(param, " (expert ", p / 2, p % 2 ? " up" : " gate", ")"));
      } else {
        unset.push_back(absl::StrCat(param, " (expert ", p, ")"));
      }
    }
  }
  if (!unset.empty()) {
    const size_t shown = std::min<size_t>(unset.size(), 8);
    return absl::InvalidArgumentError(absl::StrCat(
        ckpt.dir(), ": ", unset.size(), " parameter piece(s) no checkpoint tensor sets: ",
        absl::StrJoin(unset.begin(), unset.begin() + shown, ", "),
        unset.size() > shown ? ", ..." : ""));
  }
  return out;
}

[[nodiscard]] absl::StatusOr<std::vector<ParamSpec>> InferParamSpecs(const Checkpoint& ckpt,
                                                                     const ArchTable& table,
                                                                     const ModelConfig& config,
                                                                     bool lora_wrapped) {
  const int64_t E = config.info.num_experts, I = config.info.moe_intermediate_size,
                H = config.info.hidden_size;
  std::map<std::string, ParamSpec> specs;
  for (const auto& [name, view] : ckpt.tensors()) {
    const NameMapping m = table.map(name, lora_wrapped);
    if (m.kind != NameMapping::kLoad) continue;
    ParamSpec s;
    s.name = m.target.param;
    if (m.target.shard == ExpertShard::kNone) {
      s.shape.assign(view->shape.begin(), view->shape.end());
    } else if (m.target.shard == ExpertShard::kW2) {
      s.shape = {E, H, I};
      s.split = TpSplit::kExperts;
    } else {
      s.shape = {E, 2 * I, H};
      s.split = TpSplit::kExperts;
    }
    specs.emplace(s.name, s);
  }
  std::vector<ParamSpec> out;
  for (auto& [n, s] : specs) out.push_back(std::move(s));
  return out;
}

}  // namespace moelora
