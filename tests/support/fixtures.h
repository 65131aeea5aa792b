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

}  // namespace kvx::testing
