// RMSNorm in the two forms the served architectures use, computed as transformers does:
//   plain (Llama, Qwen3):          w · dtype(x / rms(x))            (normalised in f32, cast,
//   scaled) zero-centred (Qwen3.5, Step3.5): dtype((x / rms(x)) · (1 + w))  (all in f32, cast last)
#ifndef MOELORA_WORKER_LAYERS_NORM_H_
#define MOELORA_WORKER_LAYERS_NORM_H_

#include <ATen/ATen.h>

namespace moelora {

// kPlainF32Weight (GPT-OSS): dtype(w · (x / rms(x))), the weight applied in f32 before the cast.
enum class NormKind { kPlain, kZeroCentred, kPlainF32Weight };

at::Tensor RmsNorm(const at::Tensor& x, const at::Tensor& w, double eps,
                   NormKind kind = NormKind::kPlain);

}  // namespace moelora

#endif  // MOELORA_WORKER_LAYERS_NORM_H_
