// Rotary position embedding parameters from config.json, and their inverse frequencies: plain
// C++ (no libtorch), following transformers' modeling_rope_utils (default, linear, yarn,
// llama3) so that a checkpoint's rope_parameters / rope_scaling mean what they meant in
// training. Thread-safe: plain data and pure functions.
#ifndef MOELORA_SCHEMA_ROPE_H_
#define MOELORA_SCHEMA_ROPE_H_

#include <optional>
#include <string>
#include <vector>

namespace moelora {

struct RopeSpec {
  std::string type = "default";  // default | linear | yarn | llama3
  double theta = 10000.0;
  int head_dim = 0;
  double partial_rotary_factor = 1.0;  // rotate the first head_dim · factor dims (neox pairs)
  bool partial_rotary_given = false;   // the config set it (Qwen3.5 defaults it to 0.25)
  double factor = 1.0;                 // linear, yarn, llama3
  int original_max_position_embeddings = 0;  // yarn, llama3
  // yarn
  std::optional<double> attention_factor, mscale, mscale_all_dim;
  double beta_fast = 32.0, beta_slow = 1.0;
  bool truncate = true;
  // llama3
  double low_freq_factor = 1.0, high_freq_factor = 4.0;
  // Multimodal RoPE (mrope_section: frequencies per temporal, height, width stream; empty: none).
  // The layout is the interleaved one of Qwen3-VL and Qwen3.5 (transformers uses it for both,
  // whatever mrope_interleaved says): frequency j takes the height position when j % 3 == 1 and
  // j < 3 · section[1], the width position when j % 3 == 2 and j < 3 · section[2], else the
  // temporal one.
  std::vector<int> mrope_section;

  // Dims that rotate: int(head_dim · partial_rotary_factor), as transformers computes it.
  int rotary_dim() const { return static_cast<int>(head_dim * partial_rotary_factor); }
};

// inv_freq[j] for j < rotary_dim / 2, and the factor cos and sin are multiplied by (yarn's
// attention factor; 1 otherwise).
std::vector<double> RopeInvFreq(const RopeSpec& spec, double* attention_scaling);

}  // namespace moelora

#endif  // MOELORA_SCHEMA_ROPE_H_
