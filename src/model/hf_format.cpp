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
    "pretraining_tp", "use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
    "total_ut_steps", "early_exit_threshold", "auto_map"};

// Ouro's default loop count and exit threshold (OuroConfig).
constexpr int kOuroDefaultLoops = 4;
constexpr double kOuroDefaultThreshold = 1.0;

ModelConfig translate(const nlohmann::json& hf, const std::string& what) {
  if (!hf.is_object()) throw Error(what + ": not a JSON object");
  const std::string type = hf.value("model_type", "");
  if (type != "llama" && type != "qwen3" && type != "ouro")
    throw Error(what + ": model_type '" + type + "' is not supported (kvx imports llama and qwen3 dense models and "
                "ouro looped ones)");
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
  if (type != "ouro")
    for (const char* k : {"total_ut_steps", "early_exit_threshold", "auto_map"})
      if (hf.contains(k))
        throw Error(what + ": " + k + " is not supported for " + type + " (looped ouro models only; auto_map there names "
                    "Ouro's own code, anywhere else custom code kvx does not run)");
  nlohmann::json j = nlohmann::json::object();  // the fields that carry over under the same names
  for (const char* k : {"vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                        "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta",
                        "tie_word_embeddings"})
    if (hf.contains(k) && !hf[k].is_null()) j[k] = hf[k];
  // transformers' defaults where a field is absent or null (None), for Llama, Qwen3 and Ouro alike;
  // kvx's own defaults differ (tied embeddings, eps 1e-5), and a tied model would drop lm_head.
  if (!j.contains("tie_word_embeddings")) j["tie_word_embeddings"] = false;
  if (!j.contains("rms_norm_eps")) j["rms_norm_eps"] = 1e-6;
  if (type == "qwen3" && !hf.contains("head_dim")) j["head_dim"] = 128;      // Qwen3Config's default
  j["model_type"] = "kvx";
  j["layout"] = "dense";
  if (type == "qwen3") j["qk_norm"] = true;
  if (type == "ouro") {  // SPEC 1.3: the stack runs total_ut_steps times; sandwich norms and the exit gate
    // copied as they are, for from_json's checked conversion (value() truncated 4.5 and 2^32 + 4 to 4)
    auto given = [&](const char* k) { return hf.contains(k) && !hf.at(k).is_null(); };
    j["loops"] = given("total_ut_steps") ? hf.at("total_ut_steps") : nlohmann::json(kOuroDefaultLoops);
    j["sandwich_norm"] = true;
    j["exit_gate"] = true;
    j["exit_threshold"] = given("early_exit_threshold") ? hf.at("early_exit_threshold") : nlohmann::json(kOuroDefaultThreshold);
  }
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
  const bool looped = c.loops > 1, qwen3 = c.qk_norm;
  if (looped && (qwen3 || !c.sandwich_norm))
    throw Error(std::string("a looped model exports in Ouro's layout, which has sandwich norms and no q/k norms; this one ") +
                (qwen3 ? "has q/k norms" : "has no sandwich norms (train it with \"sandwich_norm\": true)"));
  if (!looped && (c.sandwich_norm || c.exit_gate))
    throw Error("sandwich norms and the exit gate belong to looped (Ouro) models; Llama and Qwen3 have neither, so this "
                "one-loop model has no Hugging Face form");
  const std::string type = looped ? "ouro" : qwen3 ? "qwen3" : "llama";
  nlohmann::json j = {{"architectures", {looped ? "OuroForCausalLM" : qwen3 ? "Qwen3ForCausalLM" : "LlamaForCausalLM"}},
                      {"model_type", type},
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
  if (looped) {
    j["total_ut_steps"] = c.loops;
    j["early_exit_threshold"] = c.exit_gate ? c.exit_threshold : kOuroDefaultThreshold;
    // Ouro's modelling code is not in transformers; these resolve to the published implementation.
    j["auto_map"] = {{"AutoConfig", "ByteDance/Ouro-1.4B--configuration_ouro.OuroConfig"},
                     {"AutoModelForCausalLM", "ByteDance/Ouro-1.4B--modeling_ouro.OuroForCausalLM"}};
  }
  if (qwen3 || looped) {
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
