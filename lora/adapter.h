// A LoRA adapter in host memory, read from a PEFT adapter directory and validated.
//
// Layouts (docs/formats.md §2, §3; shapes outermost first, row-major):
//   dense module        A [r, in], B [out, r]
//   2D expert e, proj   A [r, in], B [out, r]  (gate/up: in=H, out=I; down: in=I, out=H)
//   3D gate_up          A [E*r, H]  row e*r+j;  B [2I, r*E]  column j*E+e; rows [gate ; up]
//                       (GPT-OSS: interleaved g0,u0,g1,u1,...)
//   3D down             A [E*r, I]  row e*r+j;  B [H, r*E]   column j*E+e
// After ConvertTo2DInPlace (lora/convert.h) a 3D layer holds 2D per-expert views into the same
// buffers: no second copy of the adapter.
//
// Thread-safety: a LoraAdapter is plain data; share it read-only or guard it externally.
#ifndef MOELORA_LORA_ADAPTER_H_
#define MOELORA_LORA_ADAPTER_H_

#include <array>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "common/safetensors.h"
#include "lora/adapter_config.h"
#include "lora/lora_names.h"
#include "schema/formats.h"
#include "schema/model_info.h"

namespace moelora {

// Owned bytes, uninitialised on allocation (no zero-fill pass over gigabytes).
struct HostBuffer {
  explicit HostBuffer(size_t n) : bytes(new uint8_t[n]), size(n) {}
  std::unique_ptr<uint8_t[]> bytes;
  size_t size;
};

// A contiguous row-major tensor: a view of `nbytes()` bytes at `offset` in `storage`.
struct HostTensor {
  DType dtype = DType::kF32;
  std::vector<int64_t> shape;
  std::shared_ptr<HostBuffer> storage;
  size_t offset = 0;

  bool empty() const { return storage == nullptr; }
  int64_t numel() const;
  size_t nbytes() const;
  uint8_t* data() const { return storage->bytes.get() + offset; }
  int64_t dim(size_t i) const { return shape[i]; }
  std::string ShapeString() const;
  // A contiguous sub-view: `rows` rows of the given shape starting `byte_offset` into this one.
  HostTensor View(size_t byte_offset, std::vector<int64_t> view_shape) const;
};

// One LoRA pair and its scaling (alpha/r or alpha/sqrt(r)), per module.
struct LoraPair {
  HostTensor a;  // [r, in]  (3D: [E*r, in])
  HostTensor b;  // [out, r] (3D: [out, r*E])
  int rank = 0;  // per expert for 3D
  double alpha = 0;
  double scaling = 0;
  std::string a_name, b_name;  // tensor names in the file (for messages)
};

// Expert LoRA of one MoE layer.
struct MoeLayerLora {
  std::string prefix;  // module path ending in ".experts"
  int layer = -1;
  AdapterFormat format = AdapterFormat::k2D;
  int num_experts = 0;
  // 2D: experts[e][ExpertProj]; a projection the adapter does not target is absent for all e.
  std::vector<std::array<std::optional<LoraPair>, 3>> experts;
  // 3D (before conversion):
  std::optional<LoraPair> gate_up;
  std::optional<LoraPair> down;
  // 3D: both lora_B are already laid out [E, out, r] (ReadAdapter with convert_to_2d permutes
  // them while copying them out of the file); ConvertTo2DInPlace then skips that permutation.
  // Only ReadAdapter sets it, and it converts before it returns.
  bool b_expert_major = false;
};

struct LoraAdapter {
  std::string dir;
  std::string safetensors_path;
  AdapterConfig config;
  AdapterFormat format = AdapterFormat::kDense;  // as read from the file
  bool converted_to_2d = false;
  bool interleaved_gate_up = false;         // GPT-OSS gate/up order
  int num_experts = 0;                      // 0 for dense adapters
  bool num_experts_inferred = false;        // true when no model config gave E
  int max_rank = 0;                         // largest per-module (per-expert) rank
  size_t bytes = 0;                         // LoRA weight bytes held
  std::map<std::string, LoraPair> dense;    // by module path
  std::map<std::string, MoeLayerLora> moe;  // by experts prefix
  std::vector<std::string> notes;           // facts worth reporting (inferred E, ...)

  // Sorted distinct last components of the targeted modules ("q_proj", "experts", ...).
  std::vector<std::string> TargetModules() const;
  size_t num_tensors() const;
};

struct AdapterReadOptions {
  // When set: E, H, I, layers and module dims are checked against it (and E is not inferred).
  std::optional<ModelInfo> model;
  // Largest rank accepted; 0 accepts any. Over it: RESOURCE_EXHAUSTED.
  int max_rank = 0;
  // The caller's claim about the file; a contradiction is INVALID_ARGUMENT naming a tensor.
  std::optional<AdapterFormat> expected_format;
  // Convert a 3D adapter to 2D in place after validation.
  bool convert_to_2d = false;
  // Copy the tensors out of the file on all cores (OpenMP); false: on the calling thread (the
  // controller's validation read, which runs beside the gRPC threads, and under TSan, which
  // cannot see libgomp's synchronisation).
  bool parallel = true;
  // Architecture override for the gate/up order (e.g. "GptOssForCausalLM"); the model's otherwise.
  std::string arch;
};

// Seconds spent per phase, for metrics and benchmarks.
struct AdapterLoadTimings {
  double read = 0;      // map + parse header + copy tensor bytes into host memory
  double validate = 0;  // names, pairs, shapes, ranks (before any byte is copied)
  double convert = 0;   // 3D -> 2D in place
};

// Reads and validates a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).
// Errors (each message names the file, the tensor and the shapes involved):
//   NOT_FOUND          the directory does not exist
//   INVALID_ARGUMENT   a malformed config or safetensors file; only pickle weights
//                      (adapter_model.bin/.pt); unpaired lora_A/lora_B; non-2-D or empty tensors;
//                      ranks that contradict r / rank_pattern; expert index >= E; 3D rows not
//                      divisible by E; odd gate_up rows; old-PEFT swapped orientation; 2D and 3D
//                      expert tensors mixed; DoRA, modules_to_save, bias; a format flag that
//                      contradicts the file; dims that contradict the model; a tensor that
//                      holds NaN or infinite values
//   RESOURCE_EXHAUSTED a rank above options.max_rank
// Nothing is kept on error.
[[nodiscard]] absl::StatusOr<LoraAdapter> ReadAdapter(const std::string& dir,
                                                      const AdapterReadOptions& options = {},
                                                      AdapterLoadTimings* timings = nullptr);

}  // namespace moelora

#endif  // MOELORA_LORA_ADAPTER_H_
