// Small libtorch helpers the layers share: host tensors as ATen tensors, kernel dtypes, memory for
// long-lived weights and slots, device scratch, and the CPU path's SGMV accumulation. Internal to
// worker/ (layers, architectures, loaders).
#ifndef MOELORA_WORKER_LAYERS_LORA_OPS_H_
#define MOELORA_WORKER_LAYERS_LORA_OPS_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "common/safetensors.h"
#include "kernels/sgmv.h"
#include "lora/adapter.h"
#include "lora/tp_slice.h"

namespace moelora {

// A HostTensor as an f32 ATen tensor (copied).
// An adapter tensor as f32 (a view of it where it is aligned f32: read-only, valid while `h` is);
// ToFloatScaled multiplies by the LoRA scaling.
at::Tensor ToFloat(const HostTensor& h);
at::Tensor ToFloatScaled(const HostTensor& h, double scaling);
DType KernelDType(at::ScalarType t);
// An uninitialised CPU tensor for long-lived weights. From 2 MB on it is 2 MB-aligned and asks
// Linux for transparent huge pages (madvise(MADV_HUGEPAGE); a no-op where they are off): a
// decode step streams every weight once, and on 4 KB pages the page walks (two-level under a
// hypervisor) cost a third of the read rate.
at::Tensor EmptyWeight(at::IntArrayRef shape, at::ScalarType dtype);

// Zeroed storage for LoRA slots (long-lived; a decode step reads a slot in small pieces, one per
// segment). On the CPU: anonymous memory (zero by construction) with transparent huge pages as
// the model's weights have (on 4 KB pages a segment's 32–48 KB of A and B cost 8–12 page walks),
// touched only as adapters are written into it: a slot no adapter has used costs no memory.
at::Tensor SlotZeros(at::IntArrayRef shape, const at::TensorOptions& options);
// Bytes of `t` in memory (CPU: its pages that mincore reports resident; elsewhere all of it).
int64_t ResidentBytes(const at::Tensor& t);
// Zeroes a slot (a contiguous tensor): on the CPU its whole pages go back to the system (they read
// as zero again), so a slot freed by an unload or a swap-out stops costing memory.
void ZeroSlot(at::Tensor slot);
// Device scratch for a kernel, from the tensor allocator (cached on CUDA).
at::Tensor Scratch(size_t bytes, const at::Device& dev);
// The CPU path's LoRA slot dtype for a model dtype: bf16 slots for a bf16 model (half the bytes a
// decode step reads; PEFT holds a bf16 model's adapter in bf16 too), f32 otherwise.
at::ScalarType CpuSlotDType(at::ScalarType model_dtype);
// The SGMV weight type of a slot tensor (f32 or bf16) and the address of its element `offset`.
SgmvWeight SgmvWeightOf(const at::Tensor& slots);
const void* SlotElement(const at::Tensor& slots, int64_t offset);
// Accumulates LoRA into `out` columns [out_col, out_col + out_dim) (rows given by `rows` or all;
// a segment's own out_col and second B move and widen that) through the SGMV kernel on slots of
// type `w` (f32 or bf16). bf16 x and out are read and rounded in place; other dtypes form the
// LoRA sum in f32 and add it once.
void AddLora(const at::Tensor& x, at::Tensor& out, int64_t out_col, int64_t out_dim,
             const int64_t* rows, int64_t r_stride, SgmvWeight w,
             const std::vector<SgmvSegment>& segs);
// Concatenates the given ranges of `t` along `dim` (a view when there is one range).
at::Tensor GatherRanges(const at::Tensor& t, int64_t dim, const std::vector<IndexRange>& ranges);

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_LORA_OPS_H_
