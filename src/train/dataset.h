// Training data: the tokenizer (trained once per corpus selection and vocabulary, cached under
// the data directory), tokenised splits (cached by tokenizer hash), and batch sampling.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "text/bpe.h"
#include "text/corpus.h"
#include "text/mqar.h"

namespace kvx::train {

text::BpeTokenizer load_or_train_tokenizer(const std::string& data_dir, const std::vector<std::string>& sources,
                                           int vocab_size);

struct TokenizedText {
  std::vector<int32_t> tokens;
  int64_t bytes = 0;  // UTF-8 bytes of the text the tokens encode (for bits per byte)
};

TokenizedText load_split_tokens(const std::string& data_dir, const std::vector<std::string>& sources,
                                const text::BpeTokenizer& tokenizer, text::Split split);

// A share of MQAR rows mixed into training batches (text/mqar.h), so the same model is probed
// for in-context recall. MQAR rows score only the answers (other targets are kIgnoreTarget).
struct MqarMix {
  double fraction = 0;  // share of rows, 0 = text only
  int max_pairs = 0;    // pairs drawn uniformly from [1, max_pairs]
  int vocab_size = 0;
  int symbols = 0;      // distinct keys (and values); 0 = a quarter of the vocabulary each
};
constexpr int64_t kIgnoreTarget = -100;  // torch cross_entropy's default ignore_index

// The MQAR rows' layout at `pairs`: queries fill the rest of a window of `length` tokens.
text::MqarSpec mqar_spec(int vocab_size, int pairs, int length, int symbols);

// Data-parallel sharding: the tokens split into `total` equal contiguous shards, of which this
// sampler draws from [first, first + count), batch / count rows from each with the shard's own
// RNG. Worker r of N owns {r, 1, N}; one process owning {0, N, N} with N times the batch draws
// exactly the rows the N workers draw together (the data-parallel equivalence test uses this;
// the trainer weighs each worker's loss by its share of the targets, so the averaged gradient
// is that of the whole batch also when MQAR rows ignore some targets).
struct DataShards {
  int first = 0, count = 1, total = 1;
};

// Random windows of seq_len + 1 tokens; inputs are the first seq_len, targets the last seq_len.
class BatchSampler {
 public:
  BatchSampler(const std::vector<int32_t>* tokens, int batch, int seq_len, uint64_t seed, MqarMix mix = {},
               DataShards shards = {});
  std::pair<torch::Tensor, torch::Tensor> next();  // [B, T] int64 each
  std::string state() const;                       // the RNG states, for checkpoints
  void set_state(const std::string& s);

 private:
  struct Shard {
    const int32_t* tokens;
    int64_t size;
    std::mt19937_64 rng;
  };
  std::vector<Shard> shards_;
  int batch_, seq_len_;
  MqarMix mix_;
};

// `count` windows (at most as many as the text holds) of seq_len + 1 tokens, or seq_len - p + 1
// with a prefix, spread evenly over the tokens (deterministic), as (inputs, targets) batches of
// at most `batch` rows. With a `prefix` of p tokens (a tokenizer's
// BOS: BpeTokenizer::special_prefix) each input is the prefix then seq_len - p text tokens, and
// the targets are the text's seq_len - p + 1 tokens: the predictions of the inputs' last
// seq_len - p + 1 positions (the prefix's last token predicts the text's first). Evaluators score
// the last targets.size(1) positions.
std::vector<std::pair<torch::Tensor, torch::Tensor>> evaluation_batches(const std::vector<int32_t>& tokens, int count,
                                                                        int batch, int seq_len,
                                                                        const std::vector<int32_t>& prefix = {});

}  // namespace kvx::train
