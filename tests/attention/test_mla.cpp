// MLA (SPEC 2): the training path against a naive per-head fp64 reference from the weights,
// absorbed decode == forward (outputs and gradients), the fused path over a values-are-keys
// store, and the cache's bytes.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "attention/mla.h"
#include "support/fixtures.h"
#include "support/mixer_checks.h"
#include "support/naive.h"

using namespace kvx;
using attention::MlaAttention;
using kvx::testing::naive_head;
using kvx::testing::naive_rope;
using kvx::testing::reference_cache;

namespace {

model::ModelConfig mla_config(int heads, int head_dim, int latent, int rope_dim) {
  auto c = kvx::testing::mixer_config(heads, heads, head_dim, 12);
  c.layout = "mla";
  c.kv_lora_rank = latent;
  c.qk_rope_head_dim = rope_dim;
  c.validate();
  return c;
}

std::shared_ptr<MlaAttention> make(const model::ModelConfig& c, int seed, double sd = 0.5) {
  torch::manual_seed(seed);
  auto m = std::make_shared<MlaAttention>(c, 0);
  m->to(torch::kFloat64);
  torch::NoGradGuard ng;
  for (auto& p : m->parameters()) p.normal_(0, sd);
  return m;
}

// Head by head: c = x W_DKV, k_h = [c W_UK,h^T, rope(x W_KR)], v_h = c W_UV,h^T, q_h = [q, rope(q_R)].
torch::Tensor naive_mla(MlaAttention& m, const torch::Tensor& x, const model::ModelConfig& c) {
  const int64_t H = c.num_attention_heads, D = c.head_dim, dc = c.kv_lora_rank, dr = c.qk_rope_head_dim;
  std::vector<torch::Tensor> batch_out;
  for (int64_t b = 0; b < x.size(0); ++b) {
    auto xb = x[b];
    auto q = torch::matmul(xb, m.q_proj->weight.t());
    auto ckv = torch::matmul(xb, m.kv_a_proj_with_mqa->weight.t());
    auto cl = ckv.narrow(1, 0, dc), kr = naive_rope(ckv.narrow(1, dc, dr), c.rope_theta);
    std::vector<torch::Tensor> heads;
    for (int64_t h = 0; h < H; ++h) {
      auto wuk = m.kv_b_proj->weight.narrow(0, h * 2 * D, D), wuv = m.kv_b_proj->weight.narrow(0, h * 2 * D + D, D);
      auto qh = q.narrow(1, h * (D + dr), D + dr);
      auto qfull = torch::cat({qh.narrow(1, 0, D), naive_rope(qh.narrow(1, D, dr), c.rope_theta)}, 1);
      auto kfull = torch::cat({torch::matmul(cl, wuk.t()), kr}, 1);
      heads.push_back(naive_head(qfull, kfull, torch::matmul(cl, wuv.t()), 1.0 / std::sqrt(static_cast<double>(D + dr))));
    }
    batch_out.push_back(torch::cat(heads, 1));
  }
  return torch::matmul(torch::stack(batch_out), m.o_proj->weight.t());
}

}  // namespace

TEST(Mla, ForwardMatchesNaivePerHeadReference) {
  const auto c = mla_config(3, 6, 5, 4);
  auto m = make(c, 1);
  auto x = torch::randn({2, 7, c.hidden_size}, torch::kFloat64);
  torch::NoGradGuard ng;
  auto y = m->forward(x), y_ref = naive_mla(*m, x, c);
  EXPECT_TRUE(torch::allclose(y, y_ref, 1e-10, 1e-12)) << (y - y_ref).abs().max().item<double>();
}

TEST(Mla, AbsorbedDecodeEqualsForwardWithGradients) {
  const auto c = mla_config(3, 6, 5, 4);
  auto m = make(c, 2);
  auto x = torch::randn({2, 13, c.hidden_size}, torch::kFloat64);
  {
    torch::NoGradGuard ng;
    auto full = m->forward(x);
    auto cache = m->new_cache(2, reference_cache());
    std::vector<torch::Tensor> parts;
    int64_t pos = 0;
    for (int64_t chunk : {5, 1, 1, 4, 2}) {
      parts.push_back(m->step(x.narrow(1, pos, chunk), *cache));
      pos += chunk;
    }
    auto stepped = torch::cat(parts, 1);
    EXPECT_TRUE(torch::allclose(stepped, full, 1e-10, 1e-12)) << (stepped - full).abs().max().item<double>();
    EXPECT_EQ(cache->bytes(), 13 * 2 * 4 * (5 + 4));  // f32, d_c + d_R per token
  }
  kvx::testing::expect_step_gradients_equal_forward(*m, x.narrow(1, 0, 9));
}

TEST(Mla, FusedDecodeOverOneLatentRowPerToken) {
  for (auto [latent, rope_dim] : std::vector<std::pair<int, int>>{{5, 4}, {48, 16}}) {  // odd widths (AVX2), 64 (AVX-512)
    const auto c = mla_config(4, 8, latent, rope_dim);
    auto m = make(c, 3, 0.25);
    auto x = torch::randn({2, 11, c.hidden_size}, torch::kFloat64);
    torch::NoGradGuard ng;
    auto full = m->forward(x);
    auto cache = m->new_cache(2, attention::CacheOptions{});
    ASSERT_NE(dynamic_cast<attention::FusedKVCache*>(cache.get()), nullptr);
    std::vector<torch::Tensor> parts{m->step(x.narrow(1, 0, 4), *cache)};
    for (int t = 4; t < 11; ++t) parts.push_back(m->step(x.narrow(1, t, 1), *cache));
    auto stepped = torch::cat(parts, 1);
    EXPECT_LT(((stepped - full).abs().max() / full.abs().max()).item<double>(), 1e-5) << latent;
    EXPECT_EQ(cache->bytes(), 11 * 2 * 4 * (latent + rope_dim));  // the row is stored once, not as K and V
    EXPECT_DOUBLE_EQ(m->cache_bytes_per_token(kernels::KVType::F32), 4.0 * (latent + rope_dim));
  }
  // A q8 latent cache stays close to the f32 one.
  const auto c = mla_config(4, 8, 48, 16);
  auto m = make(c, 4, 0.25);
  auto x = torch::randn({1, 9, c.hidden_size}, torch::kFloat64);
  torch::NoGradGuard ng;
  attention::CacheOptions q8;
  q8.type = kernels::KVType::Q8;
  auto cache = m->new_cache(1, q8);
  auto y = m->step(x, *cache), full = m->forward(x);
  EXPECT_LT(((y - full).abs().max() / full.abs().max()).item<double>(), 0.05);
  EXPECT_EQ(cache->bytes(), 9 * 2 * 34);  // 64 values = 2 q8 blocks of 34 bytes
}
