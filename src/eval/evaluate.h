// Language-model quality on held-out text: cross-entropy (nats/token), perplexity, bits per
// byte (total bits over the UTF-8 bytes the predicted tokens encode), and a unigram baseline.
#pragma once
#include <torch/torch.h>

#include <string>
#include <utility>
#include <vector>

#include "model/transformer.h"
#include "text/bpe.h"

namespace kvx::eval {

struct LmQuality {
  double cross_entropy = 0;   // nats per token
  double perplexity = 0;
  double bits_per_byte = 0;
  int64_t tokens = 0;
  int64_t bytes = 0;
};

LmQuality evaluate_lm(model::Transformer& model, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
                      const text::BpeTokenizer& tokenizer);

// Cross-entropy of an add-one-smoothed unigram model fitted on `train`, on the targets of `batches`.
LmQuality unigram_quality(const std::vector<int32_t>& train, int vocab_size,
                          const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
                          const text::BpeTokenizer& tokenizer);

}  // namespace kvx::eval
