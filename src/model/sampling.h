// Autoregressive generation with the model's decode caches: prefill the prompt, then one token
// per step. Sampling: temperature, nucleus (top-p); temperature 0 is greedy.
#pragma once
#include <torch/torch.h>

#include <cstdint>
#include <functional>
#include <random>
#include <vector>

#include "model/transformer.h"

namespace kvx::model {

struct SamplingOptions {
  double temperature = 0.8;
  double top_p = 0.95;
};

// Token ids -> a [1, n] int64 batch of one.
torch::Tensor token_batch(const std::vector<int32_t>& ids);

// logits: [V]. Deterministic given the rng state.
int64_t sample_token(const torch::Tensor& logits, const SamplingOptions& opt, std::mt19937_64& rng);

struct GenerateResult {
  std::vector<int32_t> tokens;  // generated only
  double prefill_seconds = 0, decode_seconds = 0;
  int64_t cache_bytes = 0;      // cache held at the end
  double cache_bytes_per_token = 0;
};

// The checks generate makes before any work, for callers that size memory first: a non-empty
// prompt, max_new >= 0, the positions it feeds (a Nectar document's tokens, the prompt, and all
// but the last new token, which is sampled and not fed back) within the model's context limit,
// temperature finite and >= 0, top_p in (0, 1].
void check_generation(const ModelConfig& config, int64_t prompt_tokens, int max_new, const SamplingOptions& opt,
                      int64_t document_tokens = 0);

GenerateResult generate(Transformer& model, const std::vector<int32_t>& prompt, int max_new,
                        const SamplingOptions& opt, uint64_t seed,
                        const std::function<void(int32_t)>& on_token = nullptr,
                        const attention::CacheOptions& cache = {});

}  // namespace kvx::model
