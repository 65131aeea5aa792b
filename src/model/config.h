// Model configuration (config.json). Keys follow Hugging Face Llama names where one exists,
// plus kvx's per-layer mixer layout.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

namespace kvx::model {

struct ModelConfig {
  int vocab_size = 4096;
  int hidden_size = 256;            // d
  int num_hidden_layers = 4;
  int num_attention_heads = 4;      // H
  int num_key_value_heads = 4;      // Hkv: H (MHA), a divisor of H (GQA), 1 (MQA)
  int head_dim = 64;                // d_h
  int intermediate_size = 768;      // SwiGLU width
  int max_position_embeddings = 512;
  double rope_theta = 10000.0;
  double rms_norm_eps = 1e-5;
  bool tie_word_embeddings = true;
  std::string layout = "dense";     // e.g. "dense*4" or "lrkv*2,dense*2"; see expand_layout
  bool qk_norm = false;             // Qwen3: RMSNorm over each head's query and key before RoPE (dense layers)
  // LRKV layers (SPEC 1.1): residual rank r (0 <= r <= head_dim) and RoPE mode.
  int lrkv_rank = 16;
  std::string lrkv_rope = "expand";  // expand | shared_rope | pair_aligned
  // MLA layers (SPEC 2, DeepSeek-V2 key names): latent width d_c, decoupled RoPE key width d_R.
  int kv_lora_rank = 64;
  int qk_rope_head_dim = 16;
  // GDN and NAtS-L layers (SPEC 1.2; Qwen3-Next style names): H GDN heads of key width K and value
  // width V, short causal convolution of this kernel size.
  int linear_num_heads = 4;
  int linear_key_head_dim = 64;
  int linear_value_head_dim = 64;
  int linear_conv_kernel_dim = 4;
  // NAtS-L layers: HA softmax heads (a multiple of linear_num_heads; head group j = GDN head j's
  // channels split HA/H ways), the routing block size, RoPE (or none) in the softmax branch, the
  // router's gradient rule (sparse: the paper's; dense: straight-through), and the KV budget: at
  // most this fraction of each head group's completed blocks is routed to softmax (1 = no cap).
  int nats_attention_heads = 8;
  int nats_block_size = 64;
  bool nats_rope = true;
  std::string nats_router_grad = "sparse";
  double nats_max_softmax_fraction = 1.0;
  int nats_max_softmax_blocks = 0;  // and at most this many blocks per head group (0: no cap)
  // Looped (Ouro-style, SPEC 1.3): the stack of num_hidden_layers runs `loops` times, the final
  // RMSNorm after each loop feeding the next; every (loop, layer) has its own cache. Sandwich
  // norms (Ouro) also normalise each sub-layer's output before its residual add.
  int loops = 1;
  bool sandwich_norm = false;
  // Exit gate (Ouro): lambda_t = sigmoid(early_exit_gate(normed state of loop t)); exit distribution
  // p_t = lambda_t prod_{s<t} (1 - lambda_s), the last loop taking the rest. Training minimises
  // sum_t p_t CE_t - exit_entropy_weight H(p); inference reads the LM head from the first loop whose
  // cumulative exit probability reaches exit_threshold (all loops still run: their K/V are cached).
  bool exit_gate = false;
  double exit_threshold = 0.5;
  double exit_entropy_weight = 0.05;

  static ModelConfig from_json(const nlohmann::json& j);  // strict: unknown keys are errors
  nlohmann::json to_json() const;
  void validate() const;  // throws kvx::Error naming the bad field and the fix
  std::vector<std::string> layer_kinds() const;  // layout expanded to num_hidden_layers entries
  bool uses(const std::string& kind) const;      // some layer has this mixer kind
};

// LRKV RoPE modes (SPEC 1.1), each with what it costs.
std::vector<std::string> lrkv_rope_modes();
// The mixer kinds a layout may name (attention::make_mixer builds them).
std::vector<std::string> mixer_kinds();

// "dense*3,dense" -> 4 entries. A single kind without a count fills every layer.
std::vector<std::string> expand_layout(const std::string& layout, int num_layers);

}  // namespace kvx::model
