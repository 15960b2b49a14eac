// The layouts of MoE expert weights, shared by base checkpoints (an architecture's native layout)
// and LoRA adapters: dense modules only, 2D (one tensor per expert), 3D (experts fused in one
// tensor).
#ifndef MOELORA_SCHEMA_FORMATS_H_
#define MOELORA_SCHEMA_FORMATS_H_

namespace moelora {

enum class AdapterFormat { kDense, k2D, k3D };
const char* AdapterFormatName(AdapterFormat f);  // "dense" | "2d" | "3d"

}  // namespace moelora

#endif  // MOELORA_SCHEMA_FORMATS_H_
