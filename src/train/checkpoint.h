// Model directories and training checkpoints.
//
// A model directory holds config.json, tokenizer.json and model.safetensors (HF names). A run
// directory holds checkpoints ckpt-<step>/ (a model directory plus optimizer.safetensors and
// trainer_state.json) and a LATEST file naming the newest one. A checkpoint is built in a
// temporary directory and renamed into place, then LATEST is replaced atomically: a kill at any
// moment leaves the previous checkpoint intact.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/transformer.h"
#include "text/bpe.h"
#include "train/adamw.h"

namespace kvx::train {

struct TrainerState {
  int64_t step = 0;
  std::vector<std::string> sampler_states;  // one per data-parallel worker, in rank order
  nlohmann::json run_config;
};

struct LoadedModel {
  model::Transformer model{nullptr};
  text::BpeTokenizer tokenizer;
  std::string dir;  // the model directory actually read
};

void save_model_dir(const std::string& dir, const model::Transformer& model, const text::BpeTokenizer& tokenizer);
// `path` may be a model directory or a run directory (then LATEST is followed).
LoadedModel load_model(const std::string& path);
std::string resolve_model_dir(const std::string& path);

// Hugging Face interchange (model/hf_format.h): an HF Llama/Qwen3 directory (config.json,
// safetensors or shards, tokenizer.json) -> a kvx model directory, and a kvx dense model -> an HF
// directory with weights in `dtype` ("f32", "bf16", "f16"). Both return the model written.
model::Transformer import_hf(const std::string& hf_dir, const std::string& out_dir);
void export_hf(const std::string& model_path, const std::string& out_dir, const std::string& dtype = "f32");

void save_checkpoint(const std::string& run_dir, const model::Transformer& model, const text::BpeTokenizer& tokenizer,
                     const AdamW& optimizer, const TrainerState& state, int keep = 2);
std::string latest_checkpoint(const std::string& run_dir);  // "" if the run has none
std::vector<std::string> checkpoint_names(const std::string& run_dir);  // complete checkpoints (ckpt-*), oldest first
// A checkpoint's step, samplers and run config (trainer_state.json), then, once the caller has
// compared the config, its optimizer state.
TrainerState read_trainer_state(const std::string& checkpoint_dir);
void load_optimizer_state(const std::string& checkpoint_dir, AdamW& optimizer);

}  // namespace kvx::train
