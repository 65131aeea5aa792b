// Dense attention (MHA/GQA/MQA) against a naive fp64 reference written with explicit loops:
// outputs and gradients, on odd sizes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "attention/dense.h"
#include "support/fixtures.h"
#include "support/naive.h"

using namespace kvx;
using kvx::testing::naive_head;
using kvx::testing::naive_rope;

namespace {

model::ModelConfig small_config(int heads, int kv_heads) { return kvx::testing::mixer_config(heads, kv_heads, 6); }

// The whole mixer from its weights, per batch row, head and query, with an explicit softmax.
torch::Tensor naive_attention_layer(attention::DenseAttention& m, const torch::Tensor& x, const model::ModelConfig& c) {
  const int64_t B = x.size(0), T = x.size(1), H = c.num_attention_heads, Hkv = c.num_key_value_heads, D = c.head_dim;
  auto q = torch::matmul(x, m.q_proj->weight.t());
  auto k = torch::matmul(x, m.k_proj->weight.t());
  auto v = torch::matmul(x, m.v_proj->weight.t());
  std::vector<torch::Tensor> batch_out;
  for (int64_t b = 0; b < B; ++b) {
    std::vector<torch::Tensor> heads;
    for (int64_t h = 0; h < H; ++h) {
      const int64_t g = h / (H / Hkv);  // the KV head this query head reads
      auto qh = naive_rope(q[b].narrow(1, h * D, D), c.rope_theta);
      auto kh = naive_rope(k[b].narrow(1, g * D, D), c.rope_theta);
      auto vh = v[b].narrow(1, g * D, D);
      heads.push_back(naive_head(qh, kh, vh, 1.0 / std::sqrt(static_cast<double>(D))));
    }
    batch_out.push_back(torch::cat(heads, 1));
  }
  return torch::matmul(torch::stack(batch_out), m.o_proj->weight.t());
}

class DenseAttentionTest : public ::testing::TestWithParam<std::pair<int, int>> {};

TEST_P(DenseAttentionTest, ForwardAndGradientsMatchNaiveFp64) {
  auto [H, Hkv] = GetParam();
  torch::manual_seed(7);
  auto c = small_config(H, Hkv);
  attention::DenseAttention m(c, 0);
  m.to(torch::kFloat64);
  for (auto& p : m.parameters()) torch::NoGradGuard(), p.data().normal_(0, 0.5);
  auto x = torch::randn({2, 7, c.hidden_size}, torch::kFloat64).requires_grad_(true);
  auto w = torch::randn({2, 7, c.hidden_size}, torch::kFloat64);

  auto y = m.forward(x);
  auto y_ref = naive_attention_layer(m, x, c);
  ASSERT_EQ(y.sizes(), y_ref.sizes());
  EXPECT_TRUE(torch::allclose(y, y_ref, 1e-10, 1e-12)) << (y - y_ref).abs().max().item<double>();

  auto params = m.parameters();
  params.push_back(x);
  auto g = torch::autograd::grad({(y * w).sum()}, params);
  auto g_ref = torch::autograd::grad({(y_ref * w).sum()}, params);
  for (size_t i = 0; i < g.size(); ++i)
    EXPECT_TRUE(torch::allclose(g[i], g_ref[i], 1e-9, 1e-11)) << "gradient " << i << " differs by "
                                                              << (g[i] - g_ref[i]).abs().max().item<double>();
}

INSTANTIATE_TEST_SUITE_P(HeadLayouts, DenseAttentionTest,
                         ::testing::Values(std::make_pair(3, 3), std::make_pair(4, 2), std::make_pair(6, 3),
                                           std::make_pair(5, 1)));

TEST(DenseAttention, StepInChunksEqualsForward) {
  torch::manual_seed(3);
  auto c = small_config(6, 2);
  attention::DenseAttention m(c, 0);
  m.to(torch::kFloat64);
  auto x = torch::randn({3, 13, c.hidden_size}, torch::kFloat64);
  torch::NoGradGuard ng;
  auto full = m.forward(x);
  attention::CacheOptions reference;
  reference.reference = true;
  auto cache = m.new_cache(3, reference);
  std::vector<torch::Tensor> parts;
  int64_t pos = 0;
  for (int64_t chunk : {5, 1, 1, 4, 2}) {
    parts.push_back(m.step(x.narrow(1, pos, chunk), *cache));
    pos += chunk;
  }
  EXPECT_EQ(cache->length(), 13);
  EXPECT_TRUE(torch::allclose(torch::cat(parts, 1), full, 1e-12, 1e-12));
}

TEST(DenseAttention, CacheKnowsItsBytes) {
  auto c = small_config(6, 2);
  attention::DenseAttention m(c, 0);
  auto cache = m.new_cache(2, attention::CacheOptions{});
  torch::NoGradGuard ng;
  m.step(torch::randn({2, 9, c.hidden_size}), *cache);
  EXPECT_EQ(cache->bytes(), 9 * 2 * (2 * 2 * 6 * 4));
  EXPECT_DOUBLE_EQ(cache->bytes_per_token(), 2 * 2 * 6 * 4);
  EXPECT_EQ(m.cache_bytes_per_token(kernels::KVType::F32), 2 * 2 * 6 * 4);
  cache->clear();
  EXPECT_EQ(cache->length(), 0);
  EXPECT_EQ(cache->bytes(), 0);
}

}  // namespace
