// Memory estimates (model/memory.h): what they count and how requests past them are refused.
#include <gtest/gtest.h>

#include <cstdlib>

#include "model/memory.h"
#include "util/error.h"

using namespace kvx;

namespace {
model::ModelConfig small() {
  model::ModelConfig c;
  c.vocab_size = 1000;
  c.hidden_size = 64;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.head_dim = 16;
  c.intermediate_size = 96;
  return c;
}
}  // namespace

TEST(MemoryEstimate, TrainingCountsWeightsGradientsMomentsAndActivations) {
  const auto c = small();
  const double P = model::parameter_count(c);
  // embeddings (tied) + final norm + per layer q, k, v, o, SwiGLU, two norms
  EXPECT_EQ(P, 1000.0 * 64 + 64 + 3 * (64 * 64 + 2 * 64 * 32 + 64 * 64 + 3 * 64 * 96 + 2 * 64));
  const auto m = model::training_memory(c, 8, 128);
  EXPECT_EQ(m.weights, 4 * P);
  EXPECT_EQ(m.gradients, 4 * P);
  EXPECT_EQ(m.optimizer, 8 * P);
  const double per_token = 3.0 * 1000 + 3 * (8 * 64 + 128 + 64 + 4 * 96 + 2 * 4 * 128);
  EXPECT_EQ(m.activations, 4.0 * 8 * 128 * per_token);
  EXPECT_DOUBLE_EQ(model::training_memory(c, 16, 128).activations, 2 * m.activations);  // linear in the batch
  EXPECT_NE(m.describe().find("GiB (weights "), std::string::npos) << m.describe();
}

TEST(MemoryEstimate, InferenceCountsTheCacheAndThePrefill) {
  const auto m = model::inference_memory(small(), 2, 1000, 5000, 256.0);  // 1000 prompt tokens, 4000 generated
  EXPECT_EQ(m.weights, 0);  // the caller has loaded them already
  EXPECT_EQ(m.cache, 256.0 * 2 * 5000);
  EXPECT_EQ(m.activations, 4.0 * 2 * (2 * 4 * 1000.0 * 1000 + 4 * 1000.0 * (64 + 96) + 1000.0 * 1000));
}

TEST(MemoryEstimate, RequestsPastTheAvailableMemoryAreRefusedWithTheEstimate) {
  model::MemoryEstimate need;
  need.cache = 3.0 * (1ull << 30);
  EXPECT_NO_THROW(model::require_memory(need, 4.0 * (1ull << 30), "job", "fix"));
  EXPECT_NO_THROW(model::require_memory(need, 0, "job", "fix"));  // unknown: no check
  try {
    model::require_memory(need, 2.0 * (1ull << 30), "kvx eval", "lower --seq-len");
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_STREQ(e.what(),
                 "kvx eval needs about 3.00 GiB (KV cache 3.00) of memory but this machine has 2.00 GiB available; lower "
                 "--seq-len (or set KVX_SKIP_MEMORY_CHECK=1 if the estimate is wrong)");
  }
  setenv("KVX_SKIP_MEMORY_CHECK", "1", 1);
  EXPECT_NO_THROW(model::require_memory(need, 2.0 * (1ull << 30), "kvx eval", "fix"));
  unsetenv("KVX_SKIP_MEMORY_CHECK");
  EXPECT_GT(model::available_memory_bytes(), 0);
}
