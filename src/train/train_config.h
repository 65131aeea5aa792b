// A training run's configuration: model, data and optimisation, one JSON file
// ({"name", "model": {...}, "data": {...}, "train": {...}}). Unknown keys are errors.
#pragma once
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "model/config.h"

namespace kvx::train {

struct DataOptions {
  std::string data_dir;                              // "" = text::default_data_dir()
  std::vector<std::string> sources{"brown", "kjv"};  // which corpora to train on
  double mqar_fraction = 0;  // share of training rows that are MQAR sequences (dataset.h)
  int mqar_max_pairs = 16;
  int mqar_symbols = 0;      // distinct MQAR keys and values; 0 = vocab_size / 4 each
};

struct TrainOptions {
  int steps = 1000;
  int batch_size = 16;
  int seq_len = 256;
  double lr = 3e-3;
  double min_lr_ratio = 0.1;  // cosine decays to lr * min_lr_ratio
  int warmup = 50;
  double weight_decay = 0.1;
  double beta1 = 0.9, beta2 = 0.95, eps = 1e-8;
  double grad_clip = 1.0;
  int eval_every = 100;
  int eval_batches = 8;
  int checkpoint_every = 100;
  int log_every = 10;
  uint64_t seed = 1234;
};

struct RunConfig {
  std::string name = "run";
  model::ModelConfig model;
  DataOptions data;
  TrainOptions train;

  static RunConfig from_json(const nlohmann::json& j);
  nlohmann::json to_json() const;
  void validate() const;
};

RunConfig load_run_config(const std::string& path);
RunConfig preset(const std::string& name);  // "tiny"; unknown names get an error listing them
std::vector<std::string> preset_names();

// Learning rate at `step` (0-based): linear warmup, then cosine to lr * min_lr_ratio.
double learning_rate(const TrainOptions& t, int step);

}  // namespace kvx::train
