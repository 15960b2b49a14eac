// RMSNorm in the two forms the served architectures use, computed as transformers does:
//   plain (Llama, Qwen3):          w · dtype(x / rms(x))            (normalised in f32, cast,
//   scaled) zero-centred (Qwen3.5, Step3.5): dtype((x / rms(x)) · (1 + w))  (all in f32, cast last)
#ifndef MOELORA_WORKER_LAYERS_NORM_H_
#define MOELORA_WORKER_LAYERS_NORM_H_

#include <ATen/ATen.h>

#include <utility>
#include <vector>

#include "kernels/elementwise.h"

namespace moelora {

// kPlainF32Weight (GPT-OSS): dtype(w · (x / rms(x))), the weight applied in f32 before the cast.
enum class NormKind { kPlain, kZeroCentred, kPlainF32Weight };

// For fused passes over the rows (NormRotaryQk): the kernels' form of `kind`, and a contiguous f32
// or bf16 norm weight's values in f32 (an f32 weight as it is, a bf16 one widened into `buf`).
NormForm FormOf(NormKind kind);
const float* NormWeightF32(const at::Tensor& w, std::vector<float>& buf);

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& w, double eps,
                   NormKind kind = NormKind::kPlain);

// The residual add and the next norm: sum = x + delta (in x's dtype, as ATen's add rounds it) and
// normed = RmsNorm(sum, w, eps, kind), in one pass over the rows where RmsNorm runs by hand.
struct AddNormed {
  at::Tensor sum, normed;
};
AddNormed AddRmsNorm(const at::Tensor& x, const at::Tensor& delta, const at::Tensor& w, double eps,
                     NormKind kind = NormKind::kPlain);

// A pre-norm decoder's residual stream: each block's output is added when the next norm reads the
// stream, in the same pass (AddRmsNorm).
//   ResidualStream s(embeddings);
//   per layer: a = mixer(s.Norm(in_norm, ...)); s.Add(a); f = ffn(s.Norm(post_norm, ...));
//   s.Add(f); then s.Sum() for the final norm.
class ResidualStream {
 public:
  explicit ResidualStream(at::Tensor x) : x_(std::move(x)) {}
  // Queues a block's output (one still queued is added first).
  void Add(at::Tensor delta) {
    Sum();
    pending_ = std::move(delta);
  }
  // RmsNorm of the stream with the queued output added.
  at::Tensor Norm(const at::Tensor& w, double eps, NormKind kind);
  // The stream with the queued output added.
  const at::Tensor& Sum();

 private:
  at::Tensor x_, pending_;
};

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_NORM_H_
