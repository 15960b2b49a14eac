// Which part of a LoRA pair one tensor-parallel rank holds: pure index arithmetic on plain
// integers (no libtorch), shared by every LoRA-capable layer of the worker.
//
// A linear layer y = x·Wᵀ with LoRA y += (x·Aᵀ)·Bᵀ·s, A [r, in], B [out, r]:
//   column-parallel (q/k/v, gate/up, in_proj_*): the rank holds 1/tp of W's output rows, so it
//     keeps A whole and the matching rows of B;
//   row-parallel (o_proj, down, out_proj): the rank holds 1/tp of W's input columns, so it keeps
//     the matching columns of A and B whole (the all-reduce after the layer sums the parts);
//   replicated: everything.
// A merged column layer (fused gate_up [gate ; up], Qwen3.5's in_proj_qkv [q | k | v]) shards
// each section on its own: rank r holds rows [s_0 + r·n_0/tp, n_0/tp) of section 0, then of
// section 1, and so on, so its local output is [section 0 part | section 1 part | ...].
#ifndef MOELORA_LORA_TP_SLICE_H_
#define MOELORA_LORA_TP_SLICE_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"

namespace moelora {

enum class TpMode { kReplicated, kColumn, kRow };
const char* TpModeName(TpMode m);

// A half-open index range [begin, begin + size) along one dimension.
struct IndexRange {
  int64_t begin = 0;
  int64_t size = 0;
  bool operator==(const IndexRange& o) const { return begin == o.begin && size == o.size; }
};

// The rank's ranges of a dimension made of `sections` (full sizes, in order), each split evenly
// over `tp_size` ranks. INVALID_ARGUMENT when a section does not divide by tp_size or the rank
// is outside [0, tp_size).
[[nodiscard]] absl::StatusOr<std::vector<IndexRange>> ShardSections(
    const std::vector<int64_t>& sections, int tp_rank, int tp_size);

// What a rank keeps of one LoRA pair.
struct LoraShard {
  std::vector<IndexRange> a_cols;  // columns of A [r, in] (its input dim), concatenated in order
  std::vector<IndexRange> b_rows;  // rows of B [out, r] (its output dim), concatenated in order
  int64_t in_local = 0;            // sum of a_cols sizes
  int64_t out_local = 0;           // sum of b_rows sizes
};

// The shard of a pair on a layer with full input dim `in_full` and output `out_sections`
// (one entry for a plain layer). Errors as ShardSections.
[[nodiscard]] absl::StatusOr<LoraShard> PlanLoraShard(TpMode mode, int64_t in_full,
                                                      const std::vector<int64_t>& out_sections,
                                                      int tp_rank, int tp_size);

// Sum of the sizes of `ranges`.
int64_t TotalSize(const std::vector<IndexRange>& ranges);

}  // namespace moelora

#endif  // MOELORA_LORA_TP_SLICE_H_
