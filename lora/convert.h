// Layout conversions of MoE LoRA (docs/formats.md §4, §5) and writing adapters back to disk.
// Thread-safety: functions mutate only the adapter passed in; callers serialise access to it.
#ifndef MOELORA_LORA_CONVERT_H_
#define MOELORA_LORA_CONVERT_H_

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "lora/adapter.h"

namespace moelora {

// Transposes a row-major [m, n] matrix of `elem_bytes`-sized elements into [n, m], in place.
// `scratch` is resized to max(m, n) * elem_bytes and is the only extra memory used.
//
// Written by hand (no library in the dependency set transposes in place with bounded scratch).
// Decomposition (after Catanzaro, Keller & Garland, "A Decomposition for In-place Matrix
// Transposition", PPoPP 2014), with c = gcd(m, n), b = n / c:
//   1. rotate column j down by floor(j / b)                 (only when c > 1)
//   2. in each row, the element from column j moves to column (j*m + i) mod n, where i is its
//      original row — a bijection within the row thanks to step 1
//   3. in each column, gather row (i + floor(j/b)) mod m into row i', where (j, i) = divmod(i'*n +
//   j', m)
// Each step permutes within one row or one column, so one row or column of scratch suffices.
void InPlaceTranspose(uint8_t* data, int64_t m, int64_t n, size_t elem_bytes,
                      std::vector<uint8_t>* scratch);

// 3D -> 2D, in place (docs/formats.md §4): for every 3D layer, lora_B [out, r*E] (column j*E+e) is
// permuted within its own buffer to [E, out, r]; gate_up rows are split into gate (rows [0, I))
// and up ([I, 2I)), or de-interleaved for GPT-OSS; w1 and w3 share expert e's rows of the
// gate_up lora_A, which is already expert-major. Afterwards the layer is 2D and its per-expert
// pairs are views into the original buffers. Extra memory: one expert's lora_B slice.
// No-op for 2D and dense adapters.
[[nodiscard]] absl::Status ConvertTo2DInPlace(LoraAdapter* adapter);

// The permutation ConvertTo2DInPlace makes of a 3D lora_B, done while copying it: `src` is
// [rows, r*E] (column j*E+e), `dst` (another buffer of the same size) becomes [E, rows, r].
// ReadAdapter copies lora_B out of the file so when it converts: one pass over the bytes instead
// of a copy and then an in-place permutation. Only source rows [o_begin, o_end) (o_end < 0: to
// the last), each to its place in the whole `dst`; o_begin a multiple of 4.
void CopyBExpertMajor(uint8_t* dst, const uint8_t* src, int64_t rows, int64_t r, int64_t experts,
                      size_t elem_bytes, int64_t o_begin = 0, int64_t o_end = -1);

// 2D -> 3D (docs/formats.md §5), into new buffers: when every expert's gate and up lora_A are
// bit-identical (Megatron/ms-swift exports, converted 3D adapters) the fused A is that A and B is
// [gate ; up] (interleaved for GPT-OSS); otherwise rank-concatenated: A = [A_gate ; A_up],
// B = blockdiag(B_gate, B_up), per-expert rank 2r (recorded in rank_pattern/alpha_pattern so
// the scaling is unchanged). INVALID_ARGUMENT if a layer lacks a projection, ranks differ
// between experts, or gate and up scale differently. No-op for 3D and dense adapters.
[[nodiscard]] absl::Status ConvertTo3D(LoraAdapter* adapter);

// Writes `adapter` as a PEFT adapter directory `out_dir` (created if missing): adapter_config.json
// (the original config with target_modules / target_parameters / rank_pattern / alpha_pattern
// rewritten for the adapter's current layout) and adapter_model.safetensors.
[[nodiscard]] absl::Status WriteAdapter(const LoraAdapter& adapter, const std::string& out_dir);

// scaling * B @ A as float, [out, in] (row-major). For tests and the CLI's checks.
std::vector<float> DeltaWeight(const LoraPair& pair);

}  // namespace moelora

#endif  // MOELORA_LORA_CONVERT_H_
