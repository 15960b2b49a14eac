// Rotary position embedding (neox pairs) on the first rotary_dim dims of each head, with the
// frequencies of schema/rope.h (default, linear, yarn, llama3; partial rotary).
#ifndef MOELORA_WORKER_LAYERS_ROTARY_H_
#define MOELORA_WORKER_LAYERS_ROTARY_H_

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <vector>

#include "schema/rope.h"

namespace moelora {

class Rotary {
 public:
  Rotary() = default;
  Rotary(const RopeSpec& spec, const at::Device& device);

  // cos and sin [T, rotary_dim] for `positions`, in `dtype` (computed in f32, times the
  // attention scaling, then cast: as transformers does).
  struct Table {
    at::Tensor cos, sin;
  };
  Table Compute(const std::vector<int64_t>& positions, at::ScalarType dtype) const;
  // Multimodal RoPE (spec.mrope_section): `positions` holds three rows of T positions
  // (temporal, height, width); frequency j reads the row schema/rope.h's layout gives it. Equal
  // rows give Compute's table.
  Table ComputeMrope(const std::vector<int64_t>& positions, at::ScalarType dtype) const;
  bool mrope() const { return !mrope_section_.empty(); }
  // x [T, heads, head_dim]: rotates dims [0, rotary_dim) by pairs (i, i + rotary_dim / 2); the
  // rest pass through.
  at::Tensor Apply(const at::Tensor& x, const Table& t) const;
  int64_t rotary_dim() const { return rotary_dim_; }

 private:
  // cos and sin of positions [0, rows) on the CPU, computed by the ATen ops below once for a
  // range of positions and reused (per step they were 8-10 ATen ops). Shared by copies.
  struct CpuTable {
    std::mutex mu;
    at::ScalarType dtype = at::kFloat;
    int64_t rows = 0;
    at::Tensor cos, sin;  // [rows, rotary_dim]
  };
  // cos and sin [positions, rotary_dim] in f32 times the scaling, then cast: the one computation
  // both paths use.
  Table ComputeRows(const at::Tensor& pos_f32, at::ScalarType dtype) const;
  std::shared_ptr<CpuTable> cpu_table_ = std::make_shared<CpuTable>();
  at::Tensor inv_freq_;  // f32 [rotary_dim / 2] on the device
  double scaling_ = 1.0;
  int64_t rotary_dim_ = 0;
  int64_t head_dim_ = 0;
  std::vector<int> mrope_section_;
  at::Device device_ = at::kCPU;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_ROTARY_H_
