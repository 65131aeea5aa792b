// Hugging Face interchange for dense models (Llama and Qwen3 layouts): config.json translation in
// both directions (torch-free; the weights, one safetensors file or shards, are read by
// train::import_hf). The tensor names are already Hugging Face's (model/transformer.h).
//
// Import accepts model_type "llama", "qwen3" (Qwen3: per-head q/k RMSNorm, config qk_norm) and
// "ouro" (looped, SPEC 1.3: total_ut_steps loops of the stack, sandwich norms, the exit gate with
// early_exit_threshold; export writes looped models in that layout) and refuses anything that would change the computation kvx does not implement (rope_scaling,
// attention or MLP biases, sliding windows, other activations, unknown fields), naming the field.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"

namespace kvx::model {

ModelConfig config_from_hf(const nlohmann::json& hf, const std::string& what = "config.json");
// dtype: the torch_dtype written ("float32", "bfloat16", "float16").
nlohmann::json config_to_hf(const ModelConfig& config, const std::string& dtype = "float32");

// The exit-gate bias written for a looped model that has no gate (its weight is zero): the gate
// then never exits before the last loop (lambda = sigmoid(-30) ~ 1e-13 per loop), which is what
// such a model computes.
constexpr double kHfNeverExitGateBias = -30.0;

// "f32" | "bf16" | "f16" -> the torch_dtype name; anything else is an error listing those.
std::string hf_dtype_name(const std::string& short_name);

}  // namespace kvx::model
