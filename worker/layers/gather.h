// Rows of a tensor gathered by index on the CPU, without an ATen op per call.
#ifndef MOELORA_WORKER_LAYERS_GATHER_H_
#define MOELORA_WORKER_LAYERS_GATHER_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace moelora {

// src.index_select(0, rows): for a contiguous CPU src by memcpy per row (rows over 256 KB in all
// are split over the threads); anything else through index_select. Used where a decode step
// gathers a few rows (the experts' x rows and routing weights, the rotary table's rows): the ATen
// op took 21 µs a layer for the 32 rows of 4 KB of an f32 decode step at batch 8 and 48 µs for
// 128 rows at batch 32 (timers), most of it its dispatch and setup.
at::Tensor GatherRows(const at::Tensor& src, const std::vector<int64_t>& rows);

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_GATHER_H_
