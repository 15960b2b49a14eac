// Loads a checkpoint into engine parameters through an architecture's name table, taking this
// tensor-parallel rank's shard of every parameter.
//
// Every checkpoint tensor must be consumed (or knowingly skipped, e.g. a vision tower) and every
// piece of every parameter set exactly once; anything else is a load error naming the tensors.
// Includes ATen: only for translation units that already use libtorch.
#ifndef MOELORA_WORKER_LOADERS_WEIGHT_LOADER_H_
#define MOELORA_WORKER_LOADERS_WEIGHT_LOADER_H_

#include <ATen/ATen.h>

#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "kernels/quant_gemm.h"
#include "schema/model_config.h"
#include "schema/name_tables.h"
#include "worker/checkpoint.h"
#include "worker/layers/lora_ops.h"  // EmptyWeight, what loaded weights are allocated with
#include "worker/layers/quantized.h"
#include "worker/model/registry.h"

namespace moelora {

// How a parameter is split across tensor-parallel ranks.
enum class TpSplit {
  kReplicated,
  kRows,     // dim 0 (column-parallel linear: q/k/v_proj)
  kCols,     // dim 1 (row-parallel linear: o_proj)
  kExperts,  // w13 [E, 2I, H]: each half's rows; w2 [E, H, I]: the last dim
};

struct ParamSpec {
  std::string name;
  std::vector<int64_t> shape;  // full (unsharded) shape
  TpSplit split = TpSplit::kReplicated;
  // kRows of a merged parameter (Qwen3.5's in_proj_qkv and conv1d: [q | k | v]): the full sizes
  // of dim 0's sections, each split over the ranks on its own (lora/tp_slice.h). Empty: one.
  std::vector<int64_t> sections = {};
};

struct LoadOptions {
  int tp_rank = 0;
  int tp_size = 1;
  at::ScalarType dtype = at::kFloat;
  bool lora_wrapped = true;
  // kExperts parameters hold E / tp whole experts (rank r: [r·E/tp, (r+1)·E/tp)) instead of
  // 1/tp of every expert's intermediate dim; other ranks' experts are skipped.
  bool expert_parallel = false;
};

// Checkpoint parameters a model knowingly leaves out: those under `prefix` that no spec lists
// are skipped (listed with `reason`), not errors (a vision tower the model does not build).
struct SkipUnlisted {
  std::string prefix;
  std::string reason;
};

// A parameter the checkpoint stores quantized (config.json's quantization_config) keeps that
// storage: params[name] holds its codes (uint8: MXFP4 [.., out, in / 2], FP8 [.., out, in]) and
// params[name + kQuantScalesSuffix] its scales (MXFP4: uint8 E8M0 [.., out, in / 32]; FP8: f32
// [.., ceil(out / block_n), ceil(in / block_k)]), this rank's part of each.
// FP8 parameters also carry params[name + kQuantBlockSuffix], int64 {block_n, block_k}.
inline constexpr char kQuantScalesSuffix[] = ":scales";
inline constexpr char kQuantBlockSuffix[] = ":block";

struct LoadedWeights {
  std::map<std::string, at::Tensor> params;      // this rank's shards, in options.dtype
  std::vector<std::string> skipped;              // "name (reason)" for knowingly skipped tensors
  std::map<std::string, QuantFormat> quantized;  // the parameters stored quantized
};

// The quantized storage of parameter `name` of `params` (LoadedWeights::params), or an undefined
// one where the parameter is stored unquantized.
QuantizedWeight QuantizedParam(const std::map<std::string, at::Tensor>& params,
                               const std::string& name);

// INVALID_ARGUMENT for: a checkpoint tensor no rule consumes, a parameter piece left unset or set
// twice, a shape that contradicts the spec, an expert index >= E, a non-float dtype, a split that
// does not divide by tp_size.
[[nodiscard]] absl::StatusOr<LoadedWeights> LoadWeights(
    const Checkpoint& ckpt, const ArchTable& table, const ModelConfig& config,
    const std::vector<ParamSpec>& specs, const LoadOptions& options, const SkipUnlisted& skip = {});

// --load-format dummy: every parameter of `specs` as this rank's shard, drawn from N(0, 0.02^2)
// (repeatable: seeded by name and rank). INVALID_ARGUMENT when a split does not divide.
[[nodiscard]] absl::StatusOr<LoadedWeights> DummyWeights(const ModelConfig& config,
                                                         const std::vector<ParamSpec>& specs,
                                                         const LoadOptions& options);

// Specs inferred from the checkpoint itself (expert parameters from E, I, H; everything else
// as stored): for architectures that have a name table but no forward pass yet, so their tables
// can load real checkpoints in tests and tools.
[[nodiscard]] absl::StatusOr<std::vector<ParamSpec>> InferParamSpecs(const Checkpoint& ckpt,
                                                                     const ArchTable& table,
                                                                     const ModelConfig& config,
                                                                     bool lora_wrapped);

}  // namespace moelora

#endif  // MOELORA_WORKER_LOADERS_WEIGHT_LOADER_H_
