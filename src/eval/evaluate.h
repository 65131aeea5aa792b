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

// Quality through a decode cache: every window is fed through step() with the given cache
// (quantised and/or evicted), and compared with the uncached full forward (f32). chunk > 0 feeds
// the window that many tokens per step (LLA: 1, so every token reads codes, not exact K/V).
struct CachedQuality {
  LmQuality quality;
  double kl_vs_full = 0;       // mean KL(p_full || p_cache) per token, nats
  double top1_agreement = 0;   // share of tokens whose argmax agrees with the full forward
  double cache_bytes_per_token = 0;  // per cached token (a row of every layer)
  double held_bytes_per_token = 0;   // bytes held after a window / its tokens (below the above under eviction)
};
CachedQuality evaluate_lm_cached(model::Transformer& model,
                                 const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
                                 const text::BpeTokenizer& tokenizer, const attention::CacheOptions& cache,
                                 int64_t chunk = 0);

// MQAR recall accuracy (text/mqar.h) at each number of pairs: the share of queries whose
// argmax prediction is the paired value, over `sequences` fresh sequences of `length` tokens.
struct MqarPoint {
  int pairs = 0;
  double accuracy = 0;
  int64_t queries = 0;
};
// With `cache` set, predictions come through step() with that decode cache (quantised/evicted).
std::vector<MqarPoint> mqar_accuracy(model::Transformer& model, const std::vector<int>& pairs, int sequences, int length,
                                     int symbols, uint64_t seed, const attention::CacheOptions* cache = nullptr);

// Cross-entropy of an add-one-smoothed unigram model fitted on `train`, on the targets of `batches`.
LmQuality unigram_quality(const std::vector<int32_t>& train, int vocab_size,
                          const std::vector<std::pair<torch::Tensor, torch::Tensor>>& batches,
                          const text::BpeTokenizer& tokenizer);

}  // namespace kvx::eval
