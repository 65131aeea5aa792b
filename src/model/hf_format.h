// Hugging Face interchange for dense models (Llama and Qwen3 layouts): config.json translation in
// both directions, weights from one safetensors file or shards with model.safetensors.index.json
// (bf16/f16/f32, converted to f32 on load), and the export of a kvx dense model in that layout so
// other tools load it. The tensor names are already Hugging Face's (model/transformer.h).
//
// Import accepts model_type "llama" and "qwen3" (Qwen3: per-head q/k RMSNorm, config qk_norm) and
// refuses anything that would change the computation kvx does not implement (rope_scaling,
// attention or MLP biases, sliding windows, other activations, unknown fields), naming the field.
#pragma once
#include <nlohmann/json.hpp>
#include <string>

#include "model/config.h"
#include "nn/tensor_io.h"

namespace kvx::model {

ModelConfig config_from_hf(const nlohmann::json& hf, const std::string& what = "config.json");
// dtype: the torch_dtype written ("float32", "bfloat16", "float16").
nlohmann::json config_to_hf(const ModelConfig& config, const std::string& dtype = "float32");

// Every tensor of an HF model directory: model.safetensors, or the shards its
// model.safetensors.index.json names. Tied models drop a stored lm_head.weight; RoPE inv_freq
// buffers (older checkpoints) are dropped.
nn::TensorMap load_hf_weights(const std::string& dir, const ModelConfig& config);

// "f32" | "bf16" | "f16" -> the torch_dtype name; anything else is an error listing those.
std::string hf_dtype_name(const std::string& short_name);

}  // namespace kvx::model
