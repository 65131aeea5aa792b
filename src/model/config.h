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
  std::string layout = "dense";     // e.g. "dense*4" or "dense,dense"; see expand_layout

  static ModelConfig from_json(const nlohmann::json& j);  // strict: unknown keys are errors
  nlohmann::json to_json() const;
  void validate() const;  // throws kvx::Error naming the bad field and the fix
  std::vector<std::string> layer_kinds() const;  // layout expanded to num_hidden_layers entries
};

// "dense*3,dense" -> 4 entries. A single kind without a count fills every layer.
std::vector<std::string> expand_layout(const std::string& layout, int num_layers);

}  // namespace kvx::model
