#include "worker/loaders/weight_loader.h"

#include <ATen/CPUGeneratorImpl.h>
#include <sys/mman.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <set>
#include <utility>

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
[[nodiscard]] absl::StatusOr<at::Tensor> SourceTensor(const TensorView& v, const std::string& file,
                                                      bool raw_bytes = false) {
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
    case DType::kU8:
    case DType::kF8E4M3:
      if (raw_bytes) {
        st = at::kByte, elem = 1;
        break;
      }
      [[fallthrough]];
    default:
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": tensor ", v.name, " has dtype ", DTypeName(v.dtype),
                       "; base weights must be F32, BF16 or F16 (or quantized as config.json's "
                       "quantization_config says)"));
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

namespace {

// One array a parameter is stored in: the weight itself, or a quantized weight's codes and its
// scales. Element (r, c) of the logical [.., out, in] matrix lives at (r / row_unit, c / col_unit)
// of the array (MXFP4 codes: 2 a byte; its scales: one per 32 columns; FP8 scales: one per
// block_n x block_k block).
struct Plane {
  at::Tensor src;  // normalised to [n, out, in] units (experts) or [out, in] units (dense)
  at::Tensor dst;
  int64_t row_unit = 1, col_unit = 1;
  const char* what = "weight";
};

// src.narrow(dim, start, len) in logical elements, on a plane whose dim has `unit` elements an
// entry of `full` (the whole dim, in elements): INVALID_ARGUMENT when the range does not fall on
// entry boundaries (a tensor-parallel split inside a quantization block).
[[nodiscard]] absl::StatusOr<at::Tensor> NarrowUnits(const at::Tensor& t, int64_t dim,
                                                     int64_t start, int64_t len, int64_t unit,
                                                     int64_t full, const std::string& where) {
  if (start == 0 && len == full) return t;
  if (start % unit != 0 || len % unit != 0) {
    return absl::InvalidArgumentError(
        absl::StrCat(where, ": this rank's part (", len, " of ", full, " from ", start,
                     ") does not fall on the quantization's blocks of ", unit,
                     "; choose a --tensor-parallel-size that splits whole blocks, or "
                     "--enable-expert-parallel"));
  }
  return t.narrow(dim, start / unit, len / unit);
}

// The quantized tensors of a checkpoint: each quantized weight's codes tensor and the scales
// tensor that goes with it, and the parameters they fill.
struct QuantizedTensors {
  QuantFormat format = QuantFormat::kMxfp4;
  std::map<std::string, std::string> scales_of;  // codes tensor -> its scales tensor
  std::set<std::string> scales;                  // every scales tensor
  std::set<std::string> params;                  // parameters stored quantized
  // The name the table maps for a codes tensor (MXFP4: `<stem>_blocks` -> `<stem>`).
  std::string MappedName(const std::string& codes) const {
    return format == QuantFormat::kMxfp4 ? codes.substr(0, codes.size() - 7) : codes;
  }
};

[[nodiscard]] absl::StatusOr<QuantizedTensors> FindQuantizedTensors(const Checkpoint& ckpt,
                                                                    const ArchTable& table,
                                                                    const ModelConfig& config,
                                                                    bool lora_wrapped) {
  QuantizedTensors q;
  const WeightQuantization& wq = config.quantization;
  if (wq.method == WeightQuantization::Method::kNone) return q;
  const bool mx = wq.method == WeightQuantization::Method::kMxfp4;
  q.format = mx ? QuantFormat::kMxfp4 : QuantFormat::kFp8Block;
  const char* const scale_suffix = mx ? "_scales" : ".weight_scale_inv";
  const char* const codes_suffix = mx ? "_blocks" : ".weight";
  for (const auto& [name, view] : ckpt.tensors()) {
    if (!absl::EndsWith(name, scale_suffix)) continue;
    const std::string stem = name.substr(0, name.size() - std::strlen(scale_suffix));
    const std::string codes = stem + codes_suffix;
    if (ckpt.tensors().count(codes) == 0) {
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt.FileOf(name), ": tensor ", name, " has no ", codes, " to scale"));
    }
    if (wq.KeptUnquantized(stem)) {
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt.FileOf(codes), ": tensor ", codes,
                       " is stored quantized, but quantization_config.modules_to_not_convert "
                       "keeps its module unquantized"));
    }
    q.scales_of[codes] = name;
    q.scales.insert(name);
    const NameMapping m = table.map(q.MappedName(codes), lora_wrapped);
    if (m.kind == NameMapping::kLoad) q.params.insert(m.target.param);
  }
  for (const auto& [name, view] : ckpt.tensors()) {
    const bool codes_dtype = mx ? absl::EndsWith(name, "_blocks") : view->dtype == DType::kF8E4M3;
    if (codes_dtype && q.scales_of.count(name) == 0) {
      return absl::InvalidArgumentError(absl::StrCat(ckpt.FileOf(name), ": tensor ", name,
                                                     " is quantized but has no ", scale_suffix,
                                                     " tensor beside it"));
    }
  }
  return q;
}

// The arrays a quantized parameter of local (logical) shape `local` is stored in.
[[nodiscard]] absl::StatusOr<std::pair<at::Tensor, at::Tensor>> QuantizedStorage(
    const std::string& param, std::vector<int64_t> local, const ModelConfig& config,
    QuantFormat format) {
  const int64_t in = local.back(), out = local[local.size() - 2];
  std::vector<int64_t> scales = local;
  if (format == QuantFormat::kMxfp4) {
    if (in % kMxfp4Block != 0) {
      return absl::InvalidArgumentError(absl::StrCat(
          "parameter ", param, ": MXFP4 rows of ", in,
          " values on this rank are not whole blocks of 32 (a --tensor-parallel-size that "
          "splits the experts' intermediate dim into multiples of 32, or "
          "--enable-expert-parallel)"));
    }
    local.back() = in / 2;
    scales.back() = in / kMxfp4Block;
    return std::make_pair(EmptyWeight(local, at::kByte), EmptyWeight(scales, at::kByte));
  }
  const int64_t bn = config.quantization.block_n, bk = config.quantization.block_k;
  scales[scales.size() - 2] = (out + bn - 1) / bn;
  scales.back() = (in + bk - 1) / bk;
  return std::make_pair(EmptyWeight(local, at::kByte), EmptyWeight(scales, at::kFloat));
}

// The planes of checkpoint tensor `name` (codes `src`) for a quantized parameter, after checking
// the codes and scales tensors against each other; `logical` gets the codes' [.., out, in].
[[nodiscard]] absl::StatusOr<std::vector<Plane>> QuantizedSourcePlanes(
    const Checkpoint& ckpt, const std::string& name, const QuantizedTensors& q,
    const ModelConfig& config, std::vector<int64_t>* logical) {
  const TensorView& codes = *ckpt.tensors().at(name);
  const std::string& scales_name = q.scales_of.at(name);
  const TensorView& sv = *ckpt.tensors().at(scales_name);
  const std::string& file = ckpt.FileOf(name);
  std::vector<int64_t> cs(codes.shape.begin(), codes.shape.end());
  std::vector<int64_t> want_scales;
  Plane c, sp;
  c.what = "codes";
  sp.what = "scales";
  if (q.format == QuantFormat::kMxfp4) {
    if (codes.dtype != DType::kU8 || cs.size() < 3 || cs.back() != kMxfp4BlockBytes) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": tensor ", name, " ", codes.ShapeString(),
                       ": MXFP4 blocks must be U8 [.., rows, blocks, 16]"));
    }
    want_scales.assign(cs.begin(), cs.end() - 1);
    *logical = want_scales;
    logical->back() *= kMxfp4Block;
    if (sv.dtype != DType::kU8 ||
        std::vector<int64_t>(sv.shape.begin(), sv.shape.end()) != want_scales) {
      return absl::InvalidArgumentError(absl::StrCat(
          ckpt.FileOf(scales_name), ": tensor ", scales_name, " ", sv.ShapeString(),
          ": expected U8 ", Shape(want_scales), " (one E8M0 scale per block of ", name, ")"));
    }
    MOELORA_ASSIGN_OR_RETURN(at::Tensor t, SourceTensor(codes, file, true));
    std::vector<int64_t> flat(cs.begin(), cs.end() - 2);
    flat.push_back(cs[cs.size() - 2] * kMxfp4BlockBytes);
    c.src = t.view(flat);
    c.col_unit = 2;
    MOELORA_ASSIGN_OR_RETURN(sp.src, SourceTensor(sv, ckpt.FileOf(scales_name), true));
    sp.col_unit = kMxfp4Block;
  } else {
    if (codes.dtype != DType::kF8E4M3 || cs.size() < 2) {
      return absl::InvalidArgumentError(
          absl::StrCat(file, ": tensor ", name, " ", codes.ShapeString(), " ",
                       DTypeName(codes.dtype), ": block-FP8 weights must be F8_E4M3"));
    }
    *logical = cs;
    const int64_t bn = config.quantization.block_n, bk = config.quantization.block_k;
    want_scales = cs;
    want_scales[cs.size() - 2] = (cs[cs.size() - 2] + bn - 1) / bn;
    want_scales.back() = (cs.back() + bk - 1) / bk;
    if ((sv.dtype != DType::kF32 && sv.dtype != DType::kBF16) ||
        std::vector<int64_t>(sv.shape.begin(), sv.shape.end()) != want_scales) {
      return absl::InvalidArgumentError(
          absl::StrCat(ckpt.FileOf(scales_name), ": tensor ", scales_name, " ", sv.ShapeString(),
                       " ", DTypeName(sv.dtype), ": expected F32 or BF16 ", Shape(want_scales),
                       " (one scale per ", bn, "x", bk, " block of ", name, ")"));
    }
    // NaN codes (S.1111.111) are refused here: the kernels read codes as finite values. Checked
    // in 64 KB runs without an early exit, which the compiler vectorizes.
    for (size_t base = 0; base < codes.nbytes; base += 65536) {
      const size_t end = std::min<size_t>(codes.nbytes, base + 65536);
      uint8_t any = 0;
      for (size_t i = base; i < end; ++i) any |= (codes.data[i] & 0x7F) == 0x7F;
      if (any == 0) continue;
      size_t i = base;
      while ((codes.data[i] & 0x7F) != 0x7F) ++i;
      return absl::InvalidArgumentError(absl::StrCat(file, ": tensor ", name, " ",
                                                     codes.ShapeString(), ": element ", i,
                                                     " is an FP8 NaN code"));
    }
    MOELORA_ASSIGN_OR_RETURN(c.src, SourceTensor(codes, file, true));
    MOELORA_ASSIGN_OR_RETURN(at::Tensor st, SourceTensor(sv, ckpt.FileOf(scales_name)));
    sp.src = st.to(at::kFloat);
    sp.row_unit = bn;
    sp.col_unit = bk;
  }
  return std::vector<Plane>{c, sp};
}

}  // namespace

QuantizedWeight QuantizedParam(const std::map<std::string, at::Tensor>& params,
                               const std::string& name) {
  QuantizedWeight q;
  auto scales = params.find(name + kQuantScalesSuffix);
  if (scales == params.end()) return q;
  q.codes = params.at(name);
  q.scales = scales->second;
  auto block = params.find(name + kQuantBlockSuffix);
  if (block == params.end()) {
    q.format = QuantFormat::kMxfp4;
  } else {
    q.format = QuantFormat::kFp8Block;
    q.block_n = block->second[0].item<int64_t>();
    q.block_k = block->second[1].item<int64_t>();
  }
  return q;
}

namespace {

// Dense parameter plane `p`'s part on rank r of tp (rows, columns, or each section's rows, on
// whole entries of the plane) into its destination.
[[nodiscard]] absl::Status CopyDensePlane(Plane& p, const ParamSpec& spec, int r, int tp,
                                          const std::string& where) {
  at::Tensor piece = p.src;
  if (spec.split == TpSplit::kRows && !spec.sections.empty() && tp > 1) {
    // Each section's share on its own (a quantized plane: on whole blocks).
    MOELORA_ASSIGN_OR_RETURN(std::vector<IndexRange> rows, ShardSections(spec.sections, r, tp));
    std::vector<at::Tensor> parts;
    for (const IndexRange& ir : rows) {
      MOELORA_ASSIGN_OR_RETURN(at::Tensor part, NarrowUnits(p.src, 0, ir.begin, ir.size, p.row_unit,
                                                            spec.shape[0], where));
      parts.push_back(part);
    }
    piece = at::cat(parts, 0);
  } else if (spec.split == TpSplit::kRows) {
    const int64_t rows = spec.shape[0] / tp;
    MOELORA_ASSIGN_OR_RETURN(
        piece, NarrowUnits(p.src, 0, r * rows, rows, p.row_unit, spec.shape[0], where));
  } else if (spec.split == TpSplit::kCols) {
    const int64_t cols = spec.shape[1] / tp;
    MOELORA_ASSIGN_OR_RETURN(
        piece, NarrowUnits(p.src, 1, r * cols, cols, p.col_unit, spec.shape[1], where));
  }
  p.dst.copy_(piece);
  return absl::OkStatus();
}

// Which experts a source tensor fills here: all of a stacked one (this rank's [lo, lo + El)
// under expert parallelism) or its one expert, from local index e0.
struct ExpertRange {
  bool stacked, ep;
  int64_t lo, El, e0;
};

// Expert plane `p` (source [n, out, in] entries, or [out, in] for one expert) into this rank's
// part: w2's columns [ir·Ip, +Ip), gate's and up's rows the same (interleaved or in halves, or
// one of them). *n: the experts it covered.
[[nodiscard]] absl::Status CopyExpertPlane(Plane& p, const WeightTarget& t, const ExpertRange& x,
                                           int64_t I, int64_t Ip, int64_t ir,
                                           const std::string& where, int64_t* n) {
  at::Tensor s3 = x.stacked ? p.src : p.src.unsqueeze(0);
  if (t.transposed) s3 = s3.transpose(1, 2);
  if (x.stacked && x.ep) s3 = s3.narrow(0, x.lo, x.El);
  *n = s3.size(0);
  at::Tensor d3 = p.dst.narrow(0, x.e0, *n);
  const std::string loc = absl::StrCat(where, " (", p.what, ")");
  if (t.shard == ExpertShard::kW2) {
    MOELORA_ASSIGN_OR_RETURN(at::Tensor part, NarrowUnits(s3, 2, ir * Ip, Ip, p.col_unit, I, loc));
    d3.copy_(part);
    return absl::OkStatus();
  }
  // Rows [which * Ip, +Ip) of the destination from `half` (I rows: gate's or up's).
  auto copy_half = [&](const at::Tensor& half, int which) -> absl::Status {
    MOELORA_ASSIGN_OR_RETURN(at::Tensor part,
                             NarrowUnits(half, 1, ir * Ip, Ip, p.row_unit, I, loc));
    MOELORA_ASSIGN_OR_RETURN(at::Tensor dst,
                             NarrowUnits(d3, 1, which * Ip, Ip, p.row_unit, 2 * Ip, loc));
    dst.copy_(part);
    return absl::OkStatus();
  };
  if (t.shard == ExpertShard::kW13 && t.interleaved) {
    // Rows g0, u0, g1, u1, ...: the even ones are gate, the odd ones up.
    if (p.row_unit != 1) {
      return absl::InvalidArgumentError(
          absl::StrCat(loc, ": interleaved gate/up rows inside quantization blocks"));
    }
    MOELORA_RETURN_IF_ERROR(copy_half(s3.slice(1, 0, 2 * I, 2), 0));
    return copy_half(s3.slice(1, 1, 2 * I, 2), 1);
  }
  if (t.shard == ExpertShard::kW13) {
    MOELORA_ASSIGN_OR_RETURN(at::Tensor gate, NarrowUnits(s3, 1, 0, I, p.row_unit, 2 * I, loc));
    MOELORA_ASSIGN_OR_RETURN(at::Tensor up, NarrowUnits(s3, 1, I, I, p.row_unit, 2 * I, loc));
    MOELORA_RETURN_IF_ERROR(copy_half(gate, 0));
    return copy_half(up, 1);
  }
  return copy_half(s3, t.shard == ExpertShard::kW1 ? 0 : 1);
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
  MOELORA_ASSIGN_OR_RETURN(const QuantizedTensors quant,
                           FindQuantizedTensors(ckpt, table, config, opt.lora_wrapped));
  LoadedWeights out;
  std::map<std::string, const ParamSpec*> spec_of;
  std::map<std::string, Coverage> coverage;
  for (const ParamSpec& s : specs) {
    MOELORA_ASSIGN_OR_RETURN(const std::vector<int64_t> local, LocalShape(s, config, opt));
    if (quant.params.count(s.name) > 0) {
      MOELORA_ASSIGN_OR_RETURN(auto storage, QuantizedStorage(s.name, local, config, quant.format));
      out.params[s.name] = storage.first;
      out.params[s.name + kQuantScalesSuffix] = storage.second;
      if (quant.format == QuantFormat::kFp8Block) {
        out.params[s.name + kQuantBlockSuffix] = at::tensor(
            std::vector<int64_t>{config.quantization.block_n, config.quantization.block_k});
      }
      out.quantized[s.name] = quant.format;
    } else {
      out.params[s.name] = EmptyWeight(local, opt.dtype);
    }
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
    if (quant.scales.count(name) > 0) continue;  // read with its codes tensor
    const bool quantized_src = quant.scales_of.count(name) > 0;
    NameMapping m = table.map(quantized_src ? quant.MappedName(name) : name, opt.lora_wrapped);
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
    const ParamSpec& spec = *sit->second;
    const bool quantized_dst = out.quantized.count(spec.name) > 0;
    if (quantized_src != quantized_dst) {
      return absl::InvalidArgumentError(
          absl::StrCat(where(), ": ", quantized_src ? "quantized" : "unquantized", " where ",
                       spec.name, " is ", quantized_dst ? "quantized" : "unquantized",
                       " in other tensors of the checkpoint (one parameter, one storage)"));
    }
    // The source's arrays and its logical shape.
    std::vector<Plane> planes;
    std::vector<int64_t> src_shape;
    if (quantized_src) {
      MOELORA_ASSIGN_OR_RETURN(planes,
                               QuantizedSourcePlanes(ckpt, name, quant, config, &src_shape));
      planes[0].dst = out.params[spec.name];
      planes[1].dst = out.params[spec.name + kQuantScalesSuffix];
      m.target.transposed =
          false;  // quantized experts are stored [.., out, in] whatever the layout
    } else {
      Plane p;
      MOELORA_ASSIGN_OR_RETURN(p.src, SourceTensor(*view, file));
      p.dst = out.params[spec.name];
      src_shape = p.src.sizes().vec();
      planes.push_back(p);
    }
    Coverage& cov = coverage[m.target.param];
    auto claim = [&](int64_t piece) -> absl::Status {
      if (!cov.setter[piece].empty()) {
        return absl::InvalidArgumentError(absl::StrCat(
            where(), " sets part of ", spec.name, " that ", cov.setter[piece], " already set"));
      }
      cov.setter[piece] = name;
      return absl::OkStatus();
    };
    if (m.target.shard == ExpertShard::kNone) {
      if (src_shape != spec.shape) {
        return absl::InvalidArgumentError(
            absl::StrCat(where(), ": expected ", Shape(spec.shape), " for ", spec.name));
      }
      for (Plane& p : planes) MOELORA_RETURN_IF_ERROR(CopyDensePlane(p, spec, r, tp, where()));
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
    if (m.target.bias) {
      planes[0].src = planes[0].src.unsqueeze(-1);  // [E, 2I] -> [E, 2I, 1]
      src_shape.push_back(1);
    }
    if (src_shape != want) {
      return absl::InvalidArgumentError(absl::StrCat(
          where(), ": expected ", Shape(want), " for ", ExpertShardName(sh), " of ", spec.name,
          m.target.either_layout
              ? " (fits neither layout of the experts: gate_up_proj [E, H, 2I] and "
                "down_proj [E, I, H] as released, or [E, 2I, H] and [E, H, I] as "
                "transformers saves them)"
          : m.target.transposed ? " (stored transposed, x @ W)"
                                : ""));
    }
    // Expert parallelism: this rank's experts [lo, lo + El) whole; otherwise every expert, with
    // 1/tp of the intermediate dim.
    const bool ep = opt.expert_parallel;
    const int64_t El = ep ? E / tp : E, lo = ep ? r * El : 0;
    int64_t e0 = stacked ? 0 : m.target.expert;
    if (!stacked && ep && (e0 < lo || e0 >= lo + El)) continue;  // another rank's expert
    e0 -= stacked ? 0 : lo;
    const int64_t Ip = ep ? I : I / tp, ir = ep ? 0 : r;
    int64_t n = 0;
    for (Plane& p : planes) {
      MOELORA_RETURN_IF_ERROR(CopyExpertPlane(p, m.target, ExpertRange{stacked, ep, lo, El, e0}, I,
                                              Ip, ir, where(), &n));
    }
    for (int64_t e = e0; e < e0 + n; ++e) {
      if (sh == ExpertShard::kW2) {
        MOELORA_RETURN_IF_ERROR(claim(e));
      } else if (sh == ExpertShard::kW13) {
        MOELORA_RETURN_IF_ERROR(claim(2 * e));
        MOELORA_RETURN_IF_ERROR(claim(2 * e + 1));
      } else {
        MOELORA_RETURN_IF_ERROR(claim(2 * e + (sh == ExpertShard::kW1 ? 0 : 1)));
      }
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
