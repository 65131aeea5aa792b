// Memory estimates made before a long run or a large context, so that a request that cannot
// fit is refused with the estimate instead of dying in the allocator (torch-free; from the
// config alone). fp32 throughout, as kvx trains and evaluates.
//
//   training   weights 4P + gradients 4P + AdamW moments 8P
//              + activations B T (L a_layer + 3 V) 4 bytes, a_layer = the tensors autograd keeps
//                per token and layer: 8 d + 3 q/k/v widths + H d_h + 4 I + 2 H T (scores, probs)
//   inference  (beyond the loaded weights) KV cache bytes/token x B x cached tokens
//              + the prefill's largest transient over P prompt tokens: B (2 H P^2 + 4 P (d + I) + P V) 4 bytes
// The estimates are deliberately round (they ignore allocator slack and libtorch's workspace);
// they exist to catch requests that are off by a large factor.
#pragma once
#include <cstdint>
#include <string>

#include "model/config.h"

namespace kvx::model {

struct MemoryEstimate {
  double weights = 0, gradients = 0, optimizer = 0, activations = 0, cache = 0;  // bytes
  double total() const { return weights + gradients + optimizer + activations + cache; }
  std::string describe() const;  // "7.1 GiB (weights 1.0, gradients 1.0, ...)"
};

double parameter_count(const ModelConfig& config);  // every weight, embeddings included
MemoryEstimate training_memory(const ModelConfig& config, int batch, int seq_len);
MemoryEstimate inference_memory(const ModelConfig& config, int batch, int64_t prefill_tokens, int64_t cached_tokens,
                                double cache_bytes_per_token);

// MemAvailable of /proc/meminfo (bytes); 0 if unknown.
double available_memory_bytes();

// Throws kvx::Error naming `what`, the estimate, the available memory and `fix` when the estimate
// exceeds what is available. KVX_SKIP_MEMORY_CHECK=1 turns the check off.
void require_memory(const MemoryEstimate& need, double available, const std::string& what, const std::string& fix);

}  // namespace kvx::model
