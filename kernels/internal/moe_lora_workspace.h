// The device scratch layout of MoeLoraCuda, shared by kernels/cpu/moe_lora.cc (which reports its
// size without CUDA) and kernels/cuda/moe_lora.cu. Internal to kernels/.
#ifndef MOELORA_KERNELS_INTERNAL_MOE_LORA_WORKSPACE_H_
#define MOELORA_KERNELS_INTERNAL_MOE_LORA_WORKSPACE_H_

#include <cstddef>
#include <cstdint>

namespace moelora {
namespace moe_internal {

inline constexpr int64_t kTileRows = 16;  // rows of one base-GEMM tile (one expert each)

// Byte offsets into the workspace, each 256-byte aligned.
struct MoeWorkspaceLayout {
  size_t sorted_src = 0;  // int32 [N]: assignment index t*K + k of sorted row i
  size_t inv = 0;         // int32 [N]: sorted row of assignment t*K + k
  size_t row_lora = 0;    // int32 [N]: s*E + e, or -1
  size_t tiles = 0;       // int32 [max_tiles, 3]: expert, begin, end
  size_t num_tiles = 0;   // int32 [1]
  size_t h13 = 0;         // f32 [N, 2I]
  size_t act = 0;         // dtype [N, I]
  size_t y = 0;           // f32 [N, H]
  size_t lora_mid = 0;    // f32 [N, 2 · R_max]: the rank-sized intermediates
  size_t total = 0;
  int64_t max_tiles = 0;
};

inline size_t AlignUp(size_t v) { return (v + 255) & ~static_cast<size_t>(255); }

inline MoeWorkspaceLayout ComputeMoeWorkspace(int64_t num_tokens, int64_t top_k,
                                              int64_t num_experts, int64_t hidden, int64_t inter,
                                              int64_t max_rank, size_t dtype_bytes) {
  MoeWorkspaceLayout w;
  const size_t n = static_cast<size_t>(num_tokens * top_k);
  w.max_tiles = (num_tokens * top_k + kTileRows - 1) / kTileRows + num_experts;
  size_t at = 0;
  auto take = [&](size_t bytes) {
    const size_t here = at;
    at = AlignUp(at + bytes);
    return here;
  };
  w.sorted_src = take(n * 4);
  w.inv = take(n * 4);
  w.row_lora = take(n * 4);
  w.tiles = take(static_cast<size_t>(w.max_tiles) * 3 * 4);
  w.num_tiles = take(4);
  w.h13 = take(n * 2 * static_cast<size_t>(inter) * 4);
  w.act = take(n * static_cast<size_t>(inter) * dtype_bytes);
  w.y = take(n * static_cast<size_t>(hidden) * 4);
  w.lora_mid = take(n * 2 * static_cast<size_t>(max_rank > 0 ? max_rank : 1) * 4);
  w.total = at;
  return w;
}

}  // namespace moe_internal
}  // namespace moelora

#endif  // MOELORA_KERNELS_INTERNAL_MOE_LORA_WORKSPACE_H_
