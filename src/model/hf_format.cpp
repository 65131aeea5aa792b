#include "model/hf_format.h"

#include <set>

#include "util/error.h"

namespace kvx::model {

namespace {

// Fields read, or known to be bookkeeping that does not change the computation.
const std::set<std::string> kKnown = {
    "architectures", "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "tie_word_embeddings", "hidden_act", "attention_bias", "attention_dropout", "mlp_bias", "rope_scaling", "torch_dtype",
    "dtype", "use_cache", "initializer_range", "bos_token_id", "eos_token_id", "pad_token_id", "transformers_version",
    "pretraining_tp", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types"};

ModelConfig translate(const nlohmann::json& hf, const std::string& what) {
  if (!hf.is_object()) throw Error(what + ": not a JSON object");
  const std::string type = hf.value("model_type", "");
  if (type != "llama" && type != "qwen3")
    throw Error(what + ": model_type '" + type + "' is not supported (kvx imports llama and qwen3 dense models)");
  for (auto it = hf.begin(); it != hf.end(); ++it)
    if (!kKnown.count(it.key()))
      throw Error(what + ": field '" + it.key() + "' is not supported by kvx's " + type +
                  " import (it may change the model); remove it only if you know it does not");
  const auto refuse_unless = [&](bool ok, const std::string& field, const std::string& why) {
    if (!ok) throw Error(what + ": " + field + " = " + hf.at(field).dump() + " is not supported (" + why + ")");
  };
  if (hf.contains("hidden_act")) refuse_unless(hf["hidden_act"] == "silu", "hidden_act", "kvx's MLP is SwiGLU with SiLU");
  if (hf.contains("attention_bias")) refuse_unless(hf["attention_bias"] == false, "attention_bias", "kvx's projections have no bias");
  if (hf.contains("mlp_bias")) refuse_unless(hf["mlp_bias"] == false, "mlp_bias", "kvx's MLP has no bias");
  if (hf.contains("rope_scaling")) refuse_unless(hf["rope_scaling"].is_null(), "rope_scaling", "only plain RoPE is implemented");
  if (hf.contains("pretraining_tp")) refuse_unless(hf["pretraining_tp"] == 1, "pretraining_tp", "must be 1");
  if (hf.contains("use_sliding_window"))
    refuse_unless(hf["use_sliding_window"] == false, "use_sliding_window", "kvx attends to the whole context");
  if (hf.contains("layer_types"))
    for (const auto& t : hf["layer_types"])
      refuse_unless(t == "full_attention", "layer_types", "every layer must be full_attention");
  nlohmann::json j = nlohmann::json::object();  // the fields that carry over under the same names
  for (const char* k : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                        "tie_word_embeddings"})
    if (hf.contains(k)) j[k] = hf[k];
  if (!hf.contains("tie_word_embeddings")) j["tie_word_embeddings"] = false;  // transformers' default for both
  if (type == "qwen3" && !hf.contains("head_dim")) j["head_dim"] = 128;      // Qwen3Config's default
  j["model_type"] = "kvx";
  j["layout"] = "dense";
  if (type == "qwen3") j["qk_norm"] = true;
  try {
    return ModelConfig::from_json(j);
  } catch (const Error& e) {
    throw Error(what + ": " + e.what());
  }
}

}  // namespace

ModelConfig config_from_hf(const nlohmann::json& hf, const std::string& what) {
  try {
    return translate(hf, what);
  } catch (const nlohmann::json::exception& e) {  // a field of the wrong type (e.g. a numeric model_type)
    throw Error(what + ": " + e.what());
  }
}

nlohmann::json config_to_hf(const ModelConfig& c, const std::string& dtype) {
  for (const auto& kind : c.layer_kinds())
    if (kind != "dense")
      throw Error("Hugging Face export covers dense (MHA/GQA/MQA) models; this one has '" + kind + "' layers");
  if (c.loops != 1) throw Error("Hugging Face export of looped models is not implemented (this model runs " + std::to_string(c.loops) + " loops)");
  const bool qwen3 = c.qk_norm;
  nlohmann::json j = {{"architectures", {qwen3 ? "Qwen3ForCausalLM" : "LlamaForCausalLM"}},
                      {"model_type", qwen3 ? "qwen3" : "llama"},
                      {"vocab_size", c.vocab_size},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_key_value_heads},
                      {"head_dim", c.head_dim},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"rope_scaling", nullptr},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {"hidden_act", "silu"},
                      {"attention_bias", false},
                      {"attention_dropout", 0.0},
                      {"initializer_range", 0.02},
                      {"use_cache", true},
                      {"torch_dtype", dtype}};
  if (qwen3) {
    j["use_sliding_window"] = false;
    j["sliding_window"] = nullptr;
  } else {
    j["mlp_bias"] = false;
    j["pretraining_tp"] = 1;
  }
  return j;
}

std::string hf_dtype_name(const std::string& s) {
  if (s == "f32") return "float32";
  if (s == "bf16") return "bfloat16";
  if (s == "f16") return "float16";
  throw Error("unknown weight type '" + s + "' (valid: f32, bf16, f16)");
}

}  // namespace kvx::model
