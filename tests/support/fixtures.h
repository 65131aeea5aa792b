// Shared test fixtures: scratch directories and a small synthetic byte-level corpus.
#pragma once
#include <unistd.h>

#include <filesystem>
#include <random>
#include <string>

#include "train/trainer.h"

namespace kvx::testing {

// A fresh, empty directory under the system temp dir, unique to this process.
inline std::string temp_dir(const std::string& name) {
  auto d = std::filesystem::temp_directory_path() / ("kvx_test_" + name + "_" + std::to_string(::getpid()));
  std::filesystem::remove_all(d);
  std::filesystem::create_directories(d);
  return d.string();
}

// Byte-level (256-token) training data from random sentences over a few words: `train`
// tokens for training, the next `validation` for validation, the rest returned in *test.
inline train::TrainingData synthetic_data(size_t train, size_t validation, size_t total,
                                          train::TokenizedText* test = nullptr) {
  std::mt19937 rng(1);
  const char* words[] = {"the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far"};
  std::string text;
  while (text.size() < total) {
    text += words[rng() % 10];
    text += (rng() % 7 == 0) ? ".\n" : " ";
  }
  train::TrainingData d;
  auto toks = d.tokenizer.encode(text.substr(0, total));
  d.train.tokens.assign(toks.begin(), toks.begin() + train);
  d.train.bytes = static_cast<int64_t>(train);
  d.validation.tokens.assign(toks.begin() + train, toks.begin() + train + validation);
  if (test) test->tokens.assign(toks.begin() + train + validation, toks.end());
  return d;
}

// The training tests' corpus (16000 training tokens, 4000 validation) and run: a 2-layer
// byte-level GQA model that trains in milliseconds a step, checkpointing every 4 steps.
inline train::TrainingData small_training_data() { return synthetic_data(16000, 4000, 20000); }

inline train::RunConfig small_run(int steps) {
  train::RunConfig c;
  c.name = "unit";
  auto& m = c.model;
  m.vocab_size = 256;
  m.hidden_size = 32;
  m.num_hidden_layers = 2;
  m.num_attention_heads = 4;
  m.num_key_value_heads = 2;
  m.head_dim = 8;
  m.intermediate_size = 48;
  m.max_position_embeddings = 64;
  auto& t = c.train;
  t.steps = steps;
  t.batch_size = 4;
  t.seq_len = 32;
  t.warmup = 2;
  t.lr = 1e-2;
  t.eval_every = 4;
  t.eval_batches = 2;
  t.checkpoint_every = 4;
  t.log_every = 2;
  return c;
}

// A one-layer model config for mixer tests: odd sizes, a short context, RoPE theta 100 (so
// positions turn visibly); layout and family settings are the caller's.
inline model::ModelConfig mixer_config(int heads, int kv_heads, int head_dim, int hidden = 10) {
  model::ModelConfig c;
  c.vocab_size = 11;
  c.hidden_size = hidden;
  c.num_hidden_layers = 1;
  c.num_attention_heads = heads;
  c.num_key_value_heads = kv_heads;
  c.head_dim = head_dim;
  c.intermediate_size = 7;
  c.max_position_embeddings = 64;
  c.rope_theta = 100.0;
  return c;
}

}  // namespace kvx::testing
