#include "schema/architectures.h"

namespace moelora {

namespace {

// The defaults below are the class defaults of transformers 5.24.0 (tests/integration/
// config_defaults_test.py compares them with the installed classes), of the hub's
// configuration_step3p5.py (Step-3.5-Flash) and of vLLM's Step3TextConfig (Step3 has no
// transformers class), written down where no package ships them. Keys a class derives rather than
// defaults (head_dim from hidden_size / heads, layer_types from the interval) are left to the
// parsers, which derive them the same way.
const char kQwen3Moe[] = R"({
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 6144,
  "num_hidden_layers": 24, "num_attention_heads": 32, "num_key_value_heads": 4,
  "hidden_act": "silu", "max_position_embeddings": 32768, "rms_norm_eps": 1e-6,
  "tie_word_embeddings": false, "rope_theta": 10000.0, "attention_bias": false,
  "use_sliding_window": false, "sliding_window": null, "decoder_sparse_step": 1,
  "moe_intermediate_size": 768, "num_experts_per_tok": 8, "num_experts": 128,
  "norm_topk_prob": false, "mlp_only_layers": []
})";

// Qwen3VLMoeTextConfig; the wrapper's own tie_word_embeddings (false) decides for the LM head.
// The VL router always renormalises its top-k (the class has no norm_topk_prob).
const char kQwen3VlMoe[] = R"({
  "vocab_size": 151936, "hidden_size": 2048, "intermediate_size": 5632,
  "num_hidden_layers": 24, "num_attention_heads": 16, "num_key_value_heads": 16, "head_dim": 128,
  "hidden_act": "silu", "max_position_embeddings": 128000, "rms_norm_eps": 1e-6,
  "rope_theta": 500000.0, "attention_bias": false, "decoder_sparse_step": 1,
  "moe_intermediate_size": 1408, "num_experts_per_tok": 4, "num_experts": 60,
  "mlp_only_layers": [],
  "@top": {"tie_word_embeddings": false}
})";

// Qwen3_5MoeTextConfig (partial_rotary_factor: `kwargs.setdefault(..., 0.25)`; layer_types from
// full_attention_interval, popped with a default of 4); the router always renormalises.
const char kQwen35Moe[] = R"({
  "vocab_size": 248320, "hidden_size": 2048, "num_hidden_layers": 40,
  "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 256, "hidden_act": "silu",
  "max_position_embeddings": 32768, "rms_norm_eps": 1e-6, "tie_word_embeddings": false,
  "rope_theta": 10000.0, "partial_rotary_factor": 0.25, "attention_bias": false,
  "linear_conv_kernel_dim": 4, "linear_key_head_dim": 128, "linear_value_head_dim": 128,
  "linear_num_key_heads": 16, "linear_num_value_heads": 32, "moe_intermediate_size": 512,
  "shared_expert_intermediate_size": 512, "num_experts_per_tok": 8, "num_experts": 256,
  "@top": {"tie_word_embeddings": false}
})";

// GptOssConfig: YaRN by default (rope_parameters None -> the dict below, theta default_theta).
const char kGptOss[] = R"({
  "num_hidden_layers": 36, "num_local_experts": 128, "vocab_size": 201088, "hidden_size": 2880,
  "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
  "num_key_value_heads": 8, "sliding_window": 128, "tie_word_embeddings": false,
  "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
  "num_experts_per_tok": 4, "swiglu_alpha": 1.702, "swiglu_limit": 7.0, "attention_bias": true,
  "rope_theta": 150000.0,
  "rope_scaling": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                   "truncate": false, "original_max_position_embeddings": 4096}
})";

// The hub's configuration_step3p5.py (Step-3.5-Flash; share_expert_dims is its keyword for
// share_expert_dim). The keys its modeling code reads without a class default are required below.
const char kStep3p5[] = R"({
  "hidden_size": 4096, "intermediate_size": 11264, "num_attention_heads": 64,
  "num_attention_groups": 8, "num_hidden_layers": 45, "max_seq_len": 128000,
  "vocab_size": 128815, "rms_norm_eps": 1e-5, "moe_intermediate_size": 1280,
  "moe_num_experts": 288, "moe_top_k": 8, "rope_theta": 10000.0,
  "max_position_embeddings": 128000, "share_expert_dim": 1280, "head_dim": 128,
  "norm_expert_weight": true, "sliding_window": null
})";

// vLLM's Step3TextConfig (vllm/transformers_utils/configs/step3_vl.py).
const char kStep3Text[] = R"({
  "hidden_size": 7168, "intermediate_size": 18432, "num_attention_heads": 64,
  "num_attention_groups": 1, "num_hidden_layers": 61, "max_seq_len": 65536,
  "vocab_size": 128815, "rms_norm_eps": 1e-5, "moe_intermediate_size": 5120,
  "moe_num_experts": 48, "moe_top_k": 3, "rope_theta": 500000.0,
  "max_position_embedding": 65536, "share_expert_dim": 5120, "share_q_dim": 2048,
  "head_dim": 256, "norm_expert_weight": false,
  "moe_layers_enum": [4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23,
                      24, 25, 26, 27, 28, 29, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39, 40, 41, 42,
                      43, 44, 45, 46, 47, 48, 49, 50, 51, 52, 53, 54, 55, 56, 57, 58, 59]
})";

// The config.json keys (besides the benign ones, schema/model_config.h) each forward pass
// implements; CheckConfigKeys refuses any other.
const std::vector<std::string>& Qwen3MoeConfigKeys() {
  static const std::vector<std::string> keys = {
      "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
      "moe_intermediate_size", "num_experts", "num_local_experts", "num_experts_per_tok",
      "norm_topk_prob", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
      "partial_rotary_factor", "original_max_position_embeddings", "max_position_embeddings",
      "vocab_size", "tie_word_embeddings",
      // Checked below: silu only, no attention biases, full or sliding attention layers.
      "hidden_act", "attention_bias", "use_sliding_window", "sliding_window", "layer_types",
      // Dense-MLP layers: refused when present (mlp_only_layers non-empty, step != 1); the dense
      // MLP's size matters only then.
      "mlp_only_layers", "decoder_sparse_step", "intermediate_size",
      // Qwen3-Coder-480B-A35B's release carries these three; transformers and vLLM ignore them.
      // Accepted where they describe this forward (Create checks them).
      "qkv_bias", "use_qk_norm", "shared_expert_intermediate_size"};
  return keys;
}

const std::vector<std::string>& Qwen35MoeConfigKeys() {
  static const std::vector<std::string> keys = [] {
    std::vector<std::string> k = Qwen3MoeConfigKeys();
    k.insert(k.end(),
             {"linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
              "linear_num_key_heads", "linear_num_value_heads", "shared_expert_intermediate_size",
              "full_attention_interval", "attn_output_gate",
              // Always float32 here (the SSM state is kept in f32).
              "mamba_ssm_dtype",
              // The MTP head is not served; it does not change the main model.
              "mtp_num_hidden_layers", "mtp_use_dedicated_embeddings"});
    return k;
  }();
  return keys;
}

const std::vector<std::string>& GptOssConfigKeys() {
  static const std::vector<std::string> keys = {
      "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
      "num_local_experts", "num_experts", "num_experts_per_tok", "experts_per_token",
      "intermediate_size", "rms_norm_eps", "rope_theta", "rope_parameters", "rope_scaling",
      "max_position_embeddings", "vocab_size", "tie_word_embeddings", "attention_bias",
      "sliding_window", "layer_types", "swiglu_alpha", "swiglu_limit",
      // transformers' GptOssConfig carries it; the forward does not read it.
      "initial_context_length", "hidden_act"};
  return keys;
}

const std::vector<std::string>& Step3p5ConfigKeys() {
  static const std::vector<std::string> keys = {
      "hidden_size", "num_hidden_layers", "num_attention_heads", "num_attention_groups", "head_dim",
      "vocab_size", "intermediate_size", "rms_norm_eps", "max_position_embeddings", "rope_theta",
      "partial_rotary_factors", "rope_scaling", "yarn_only_types", "layer_types", "sliding_window",
      "attention_other_setting", "use_head_wise_attn_gate", "att_impl_type", "use_qk_norm",
      "moe_layers_enum", "moe_num_experts", "moe_top_k", "moe_intermediate_size",
      "share_expert_dim", "moe_router_activation", "use_moe_router_bias", "need_fp32_gate",
      "norm_expert_weight", "moe_router_scaling_factor", "swiglu_limits", "swiglu_limits_shared",
      "use_rope_layers", "tie_word_embeddings", "hidden_act",
      // The MTP layers are skipped; the longest sequence is --max-model-len's business.
      "num_nextn_predict_layers", "max_seq_len",
      // The release's older keys, checked against moe_layers_enum and the norms (ReadLayout).
      "use_moe", "moe_layer_offset", "moe_every_n_layer", "zero_centered", "sink"};
  return keys;
}

const std::vector<std::string>& Step3TextConfigKeys() {
  static const std::vector<std::string> keys = {
      "hidden_size", "intermediate_size", "num_attention_heads", "num_attention_groups", "head_dim",
      "share_q_dim", "num_hidden_layers", "vocab_size", "rms_norm_eps", "moe_num_experts",
      "moe_top_k", "moe_intermediate_size", "share_expert_dim", "norm_expert_weight",
      "moe_layers_enum", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embedding",
      "max_position_embeddings", "tie_word_embeddings", "hidden_act",
      // The longest sequence is --max-model-len's business.
      "max_seq_len"};
  return keys;
}

}  // namespace

const std::vector<ArchFacts>& AllArchFacts() {
  static const std::vector<ArchFacts> facts = [] {
    std::vector<ArchFacts> f;
    ArchFacts qwen3;
    qwen3.architecture = "Qwen3MoeForCausalLM";
    qwen3.defaults_source = "transformers 5.24.0 Qwen3MoeConfig";
    qwen3.defaults_json = kQwen3Moe;
    qwen3.map = &MapQwen3Moe;
    qwen3.config_keys = Qwen3MoeConfigKeys();
    f.push_back(qwen3);
    // The text path of the VL release: fused, transposed experts.
    ArchFacts vl = qwen3;
    vl.architecture = "Qwen3VLMoeForConditionalGeneration";
    vl.native_moe_format = AdapterFormat::k3D;
    vl.defaults_source =
        "transformers 5.24.0 Qwen3VLMoeTextConfig (text_config) and Qwen3VLMoeConfig";
    vl.defaults_json = kQwen3VlMoe;
    vl.map = &MapQwen3VlMoe;
    f.push_back(vl);
    ArchFacts q35;
    q35.architecture = "Qwen3_5MoeForConditionalGeneration";
    q35.native_moe_format = AdapterFormat::k3D;
    q35.attn_output_gate = true;
    q35.defaults_source =
        "transformers 5.24.0 Qwen3_5MoeTextConfig (text_config) and Qwen3_5MoeConfig";
    q35.defaults_json = kQwen35Moe;
    q35.map = &MapQwen35MoeMain;
    q35.config_keys = Qwen35MoeConfigKeys();
    f.push_back(q35);
    q35.architecture = "Qwen3_5MoeForCausalLM";
    q35.defaults_source = "transformers 5.24.0 Qwen3_5MoeTextConfig";
    f.push_back(q35);
    q35.architecture = "Qwen3_5MoeMTP";
    q35.defaults_source.clear();
    q35.defaults_json = nullptr;
    q35.map = &MapQwen35Moe;  // the MTP head: `mtp.layers.{i}.mlp.experts.gate_up_proj` etc.
    q35.config_keys.clear();
    f.push_back(q35);
    ArchFacts oss;
    oss.architecture = "GptOssForCausalLM";
    oss.native_moe_format = AdapterFormat::k3D;
    oss.interleaved_gate_up = true;
    oss.expert_inter_keys = {"intermediate_size"};
    oss.top_k_keys = {"num_experts_per_tok", "experts_per_token"};
    oss.defaults_source = "transformers 5.24.0 GptOssConfig";
    oss.defaults_json = kGptOss;
    oss.map = &MapGptOss;
    oss.config_keys = GptOssConfigKeys();
    f.push_back(oss);
    ArchFacts step;  // Step3 and Step3.5 name their keys alike
    step.map = &MapStep3;
    step.kv_heads_keys = {"num_attention_groups"};
    step.experts_keys = {"moe_num_experts"};
    step.shared_expert_keys = {"share_expert_dim"};
    step.top_k_keys = {"moe_top_k"};
    ArchFacts step3 = step;
    step3.architecture = "Step3TextForCausalLM";
    step3.kv_replicated = true;
    step3.defaults_source = "vLLM's Step3TextConfig (transformers has no Step3 class)";
    step3.defaults_json = kStep3Text;
    step3.config_keys = Step3TextConfigKeys();
    f.push_back(step3);
    ArchFacts step35 = step;
    step35.architecture = "Step3p5ForCausalLM";
    step35.mtp_layers_follow = true;
    step35.defaults_source = "the hub's configuration_step3p5.py (stepfun-ai/Step-3.5-Flash)";
    step35.defaults_json = kStep3p5;
    step35.config_keys = Step3p5ConfigKeys();
    step35.required = {
        {"layer_types",
         "the hub class defaults it to None and transformers' Step3p7 to all full attention"},
        {"moe_layers_enum",
         "the hub class defaults it to layers 3..44 of the 45-layer release, transformers' Step3p7 "
         "to a different split"},
        {"moe_router_activation",
         "the hub class has no default and vLLM's Step3p5Config defaults it to softmax, while the "
         "release uses sigmoid"},
        {"use_head_wise_attn_gate",
         "the hub class has no default and vLLM's Step3p5Config defaults it to false, while the "
         "release uses the gate"}};
    f.push_back(step35);
    step35.architecture = "Step3p5MTP";  // the MTP layers themselves: none to skip
    step35.mtp_layers_follow = false;
    step35.map = &MapStep3p5Mtp;
    step35.defaults_source.clear();
    step35.defaults_json = nullptr;
    step35.required.clear();
    step35.config_keys.clear();
    f.push_back(step35);
    return f;
  }();
  return facts;
}

const ArchFacts* FindArchFacts(const std::string& architecture) {
  for (const ArchFacts& f : AllArchFacts()) {
    if (f.architecture == architecture) return &f;
  }
  return nullptr;
}

}  // namespace moelora
