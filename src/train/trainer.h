// `kvx train`: the training loop (AdamW, warmup + cosine, clipping, held-out evaluation,
// atomic checkpoints, exact resume, progress line, JSONL log and loss-curve PNG).
#pragma once
#include <string>

#include "text/bpe.h"
#include "train/dataset.h"
#include "train/distributed.h"
#include "train/train_config.h"

namespace kvx::train {

struct TrainingData {
  text::BpeTokenizer tokenizer;
  TokenizedText train, validation;
};

// Tokenizer and splits for the config's data sources (fetches nothing: run `kvx data fetch` first).
TrainingData prepare_training_data(const RunConfig& config);
// The train and validation splits of these corpora in a given (a trained model's) tokenizer; an
// empty data_dir is the default one.
TrainingData training_data_for(const text::BpeTokenizer& tokenizer, const std::string& data_dir,
                               const std::vector<std::string>& sources);

struct TrainArgs {
  RunConfig config;
  std::string run_dir;
  bool resume = false;       // continue from the run's LATEST checkpoint
  int stop_after = -1;       // stop (after checkpointing) once this step is reached; -1 = run to the end
  bool verbose = true;
  std::string init_from;     // a model directory whose weights start a fresh run (fine-tuning); must match the config
  DistributedOptions distributed;  // data-parallel workers (world_size > 1); train.batch_size is per worker
  int data_shards = 0;       // data shards (0: one per worker); a multiple of the workers (dataset.h, DataShards)
};

struct TrainSummary {
  int64_t step = 0;
  double train_loss = 0;     // mean of the last log window
  double val_cross_entropy = 0, val_bits_per_byte = 0;
  double unigram_cross_entropy = 0;
  double seconds = 0, tokens_per_second = 0;     // tokens of every worker
  double allreduce_wait_seconds = 0;             // data-parallel: waiting for gradients, not overlapped with backward
  std::string run_dir;
};

TrainSummary run_training(const TrainArgs& args, const TrainingData& data);

// "3m07s", "1h02m": elapsed times and ETAs in progress lines.
std::string format_duration(double seconds);

}  // namespace kvx::train
