// LRKV (SPEC 1.1): the training path against a naive per-head fp64 reference written from the
// weights, factored decode == the expanded forward (outputs and gradients) in every RoPE mode,
// the pair-aligned identity, r = 0 as one shared K/V (MQA), cache bytes and the residual init.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>

#include "attention/dense.h"
#include "attention/lrkv.h"
#include "support/fixtures.h"
#include "support/naive.h"
#include "util/error.h"

using namespace kvx;
using attention::LrkvAttention;
using kvx::testing::naive_head;
using kvx::testing::naive_rope;

namespace {

model::ModelConfig lrkv_config(int heads, int head_dim, int rank, const std::string& rope) {
  auto c = kvx::testing::mixer_config(heads, heads, head_dim);
  c.layout = "lrkv";
  c.lrkv_rank = rank;
  c.lrkv_rope = rope;
  c.validate();
  return c;
}

// A mixer in fp64 with weights large enough that every path matters.
std::shared_ptr<LrkvAttention> make(const model::ModelConfig& c, int seed) {
  torch::manual_seed(seed);
  auto m = std::make_shared<LrkvAttention>(c, 0);
  m->to(torch::kFloat64);
  torch::NoGradGuard ng;
  for (auto& p : m->parameters()) p.normal_(0, 0.5);
  return m;
}

// The layer from its weights, head by head: K_h = X W_s + X U_h B_h^T, V_h likewise, each RoPE
// mode written out (shared_rope: rope(q) rope(K_s) + q (R B^T)).
torch::Tensor naive_lrkv(LrkvAttention& m, const torch::Tensor& x, const model::ModelConfig& c) {
  const int64_t B = x.size(0), H = c.num_attention_heads, D = c.head_dim, r = c.lrkv_rank;
  const double theta = c.rope_theta, scale = 1.0 / std::sqrt(static_cast<double>(D));
  std::vector<torch::Tensor> batch_out;
  for (int64_t b = 0; b < B; ++b) {
    auto xb = x[b];
    auto q = torch::matmul(xb, m.q_proj->weight.t());
    auto ks = torch::matmul(xb, m.k_shared_proj->weight.t()), vs = torch::matmul(xb, m.v_shared_proj->weight.t());
    std::vector<torch::Tensor> heads;
    for (int64_t h = 0; h < H; ++h) {
      auto kres = torch::zeros_like(ks), vres = torch::zeros_like(vs);
      if (r > 0) {
        kres = torch::matmul(torch::matmul(xb, m.k_down_proj->weight.narrow(0, h * r, r).t()), m.k_up[h]);
        vres = torch::matmul(torch::matmul(xb, m.v_down_proj->weight.narrow(0, h * r, r).t()), m.v_up[h]);
      }
      auto qh = q.narrow(1, h * D, D);
      torch::Tensor out;
      if (c.lrkv_rope == "shared_rope")
        out = naive_head(torch::cat({naive_rope(qh, theta), qh}, 1), torch::cat({naive_rope(ks, theta), kres}, 1), vs + vres, scale);
      else
        out = naive_head(naive_rope(qh, theta), naive_rope(ks + kres, theta), vs + vres, scale);
      heads.push_back(out);
    }
    batch_out.push_back(torch::cat(heads, 1));
  }
  return torch::matmul(torch::stack(batch_out), m.o_proj->weight.t());
}

struct Mode {
  std::string rope;
  int rank;
};

class LrkvModes : public ::testing::TestWithParam<Mode> {};

TEST_P(LrkvModes, ForwardMatchesNaivePerHeadReference) {
  const auto [rope, rank] = GetParam();
  const auto c = lrkv_config(3, 8, rank, rope);
  auto m = make(c, 1);
  auto x = torch::randn({2, 7, c.hidden_size}, torch::kFloat64);
  torch::NoGradGuard ng;
  auto y = m->forward(x), y_ref = naive_lrkv(*m, x, c);
  EXPECT_TRUE(torch::allclose(y, y_ref, 1e-10, 1e-12)) << rope << " differs by " << (y - y_ref).abs().max().item<double>();
}

TEST_P(LrkvModes, FactoredDecodeInChunksEqualsForward) {
  const auto [rope, rank] = GetParam();
  const auto c = lrkv_config(3, 8, rank, rope);
  auto m = make(c, 2);
  auto x = torch::randn({2, 13, c.hidden_size}, torch::kFloat64);
  torch::NoGradGuard ng;
  auto full = m->forward(x);
  attention::CacheOptions reference;
  reference.reference = true;
  auto cache = m->new_cache(2, reference);
  std::vector<torch::Tensor> parts;
  int64_t pos = 0;
  for (int64_t chunk : {5, 1, 1, 4, 2}) {
    parts.push_back(m->step(x.narrow(1, pos, chunk), *cache));
    pos += chunk;
  }
  EXPECT_EQ(cache->length(), 13);
  auto stepped = torch::cat(parts, 1);
  EXPECT_TRUE(torch::allclose(stepped, full, 1e-10, 1e-12)) << rope << " differs by " << (stepped - full).abs().max().item<double>();
}

TEST_P(LrkvModes, FactoredGradientsEqualExpanded) {
  const auto [rope, rank] = GetParam();
  const auto c = lrkv_config(3, 8, rank, rope);
  auto m = make(c, 3);
  auto x = torch::randn({2, 9, c.hidden_size}, torch::kFloat64).requires_grad_(true);
  auto w = torch::randn({2, 9, c.hidden_size}, torch::kFloat64);
  auto params = m->parameters();
  params.push_back(x);
  auto g_full = torch::autograd::grad({(m->forward(x) * w).sum()}, params);
  attention::CacheOptions reference;
  reference.reference = true;
  auto cache = m->new_cache(2, reference);
  auto g_fact = torch::autograd::grad({(m->step(x, *cache) * w).sum()}, params);
  for (size_t i = 0; i < params.size(); ++i)
    EXPECT_TRUE(torch::allclose(g_fact[i], g_full[i], 1e-9, 1e-11))
        << rope << " gradient " << i << " differs by " << (g_fact[i] - g_full[i]).abs().max().item<double>();
}

INSTANTIATE_TEST_SUITE_P(RopeModes, LrkvModes,
                         ::testing::Values(Mode{"expand", 3}, Mode{"shared_rope", 3}, Mode{"pair_aligned", 4},
                                           Mode{"pair_aligned", 8}, Mode{"expand", 0}),
                         [](const auto& info) { return info.param.rope + "_r" + std::to_string(info.param.rank); });

// The fused torch-free kernel path (f32 cache, float32 arithmetic) against the fp64 forward.
TEST(Lrkv, FusedDecodeMatchesForward) {
  // (16 heads of rank 4: a row of latents is whole vectors that straddle heads)
  for (const auto& [heads, mode] : std::vector<std::pair<int, Mode>>{
           {3, {"shared_rope", 5}}, {3, {"pair_aligned", 6}}, {3, {"shared_rope", 0}}, {16, {"shared_rope", 4}}}) {
    const auto c = lrkv_config(heads, 16, mode.rank, mode.rope);
    auto m = make(c, 8);
    torch::NoGradGuard ng;
    for (auto& p : m->parameters()) p.mul_(0.4);  // keep the softmax away from one-hot
    auto x = torch::randn({2, 11, c.hidden_size}, torch::kFloat64);
    auto full = m->forward(x);
    auto cache = m->new_cache(2, attention::CacheOptions{});
    ASSERT_NE(dynamic_cast<attention::LrkvFusedCache*>(cache.get()), nullptr);
    std::vector<torch::Tensor> parts{m->step(x.narrow(1, 0, 4), *cache)};
    for (int t = 4; t < 11; ++t) parts.push_back(m->step(x.narrow(1, t, 1), *cache));
    auto stepped = torch::cat(parts, 1);
    const double err = ((stepped - full).abs().max() / full.abs().max()).item<double>();
    EXPECT_LT(err, 1e-5) << mode.rope << " H" << heads << " r" << mode.rank;
    EXPECT_EQ(cache->bytes(), static_cast<int64_t>(11 * 2 * 4.0 * 2 * (16 + heads * mode.rank)));
  }
  // expand rebuilds keys at read time: libtorch f32 cache only, with a clear error otherwise.
  auto m = make(lrkv_config(3, 16, 4, "expand"), 9);
  attention::CacheOptions bf16;
  bf16.type = kernels::KVType::BF16;
  EXPECT_THROW(m->new_cache(1, bf16), Error);
  EXPECT_NE(dynamic_cast<attention::LrkvCache*>(m->new_cache(1, attention::CacheOptions{}).get()), nullptr);
}

TEST(Lrkv, PairAlignedRotationCommutesWithTheSelection) {
  // P_t B_h = B_h P~_t: rotating z B (z in R^r placed in the r/2 lowest-frequency planes) equals
  // placing the rotated latent, at every position.
  const auto c = lrkv_config(2, 12, 6, "pair_aligned");
  auto m = make(c, 4);
  auto z = torch::randn({1, 2, 9, 6}, torch::kFloat64);
  auto lhs = nn::Rope(12, c.rope_theta).apply(torch::matmul(z, m->k_up), 5);
  auto rhs = torch::matmul(m->latent_rope().apply(z, 5), m->k_up);
  EXPECT_TRUE(torch::allclose(lhs, rhs, 1e-12, 1e-12)) << (lhs - rhs).abs().max().item<double>();
  // ... and the latent rotation is the naive one over those planes' frequencies.
  std::vector<double> inv;
  for (int64_t p : {3, 4, 5}) inv.push_back(std::pow(c.rope_theta, -2.0 * p / 12));
  auto naive = naive_rope(z[0][1], c.rope_theta, 5, inv);
  EXPECT_TRUE(torch::allclose(m->latent_rope().apply(z, 5)[0][1], naive, 1e-12, 1e-12));
  EXPECT_EQ(m->k_up.sum().item<double>(), 2 * 6);  // a 0/1 selection, one entry per latent dim and head
  EXPECT_FALSE(m->k_up.requires_grad());            // fixed: not a parameter
}

TEST(Lrkv, RankZeroIsOneSharedKeyValue) {
  // r = 0: every head reads the shared K/V, exactly MQA with k_proj = W_s^K, v_proj = W_s^V.
  auto c = lrkv_config(3, 8, 0, "expand");
  auto m = make(c, 5);
  auto dense_config = c;
  dense_config.layout = "dense";
  dense_config.num_key_value_heads = 1;
  attention::DenseAttention mqa(dense_config, 0);
  mqa.to(torch::kFloat64);
  torch::NoGradGuard ng;
  mqa.q_proj->weight.copy_(m->q_proj->weight);
  mqa.k_proj->weight.copy_(m->k_shared_proj->weight);
  mqa.v_proj->weight.copy_(m->v_shared_proj->weight);
  mqa.o_proj->weight.copy_(m->o_proj->weight);
  auto x = torch::randn({2, 6, c.hidden_size}, torch::kFloat64);
  EXPECT_TRUE(torch::allclose(m->forward(x), mqa.forward(x), 1e-12, 1e-12));
  EXPECT_EQ(m->cache_bytes_per_token(kernels::KVType::F32), mqa.cache_bytes_per_token(kernels::KVType::F32));
}

TEST(Lrkv, CacheBytesFollowTheFormula) {
  const auto c = lrkv_config(4, 8, 3, "shared_rope");
  LrkvAttention m(c, 0);
  auto cache = m.new_cache(2, attention::CacheOptions{});
  torch::NoGradGuard ng;
  m.step(torch::randn({2, 5, c.hidden_size}), *cache);
  const double per_token = 4.0 * 2 * (8 + 4 * 3);  // f32, 2 (d_h + H r)
  EXPECT_DOUBLE_EQ(cache->bytes_per_token(), per_token);
  EXPECT_EQ(cache->bytes(), static_cast<int64_t>(5 * 2 * per_token));
  EXPECT_DOUBLE_EQ(m.cache_bytes_per_token(kernels::KVType::F32), per_token);
  EXPECT_DOUBLE_EQ(m.cache_bytes_per_token(kernels::KVType::BF16), per_token / 2);
  cache->clear();
  EXPECT_EQ(cache->bytes(), 0);
  attention::CacheOptions q8;
  q8.type = kernels::KVType::Q8;
  EXPECT_THROW(m.new_cache(1, q8), Error);  // q8 latents need H r % 32 == 0 (4 x 3 = 12)
  // 16 heads of rank 6: 96 latent values a token, three q8 blocks that span heads
  const auto c16 = lrkv_config(16, 32, 6, "shared_rope");
  LrkvAttention m16(c16, 0);
  auto quantised = m16.new_cache(1, q8), exact = m16.new_cache(1, attention::CacheOptions{});
  auto x = torch::randn({1, 9, c16.hidden_size});
  const auto yq = m16.step(x, *quantised), y = m16.step(x, *exact);
  EXPECT_LT(((yq - y).abs().max() / y.abs().max()).item<double>(), 0.05);  // q8's error, no more
  EXPECT_DOUBLE_EQ(quantised->bytes_per_token(), 2 * (kernels::row_bytes(kernels::KVType::Q8, 32) + kernels::row_bytes(kernels::KVType::Q8, 96)));
  EXPECT_DOUBLE_EQ(m16.cache_bytes_per_token(kernels::KVType::Q8), quantised->bytes_per_token());
}

TEST(Lrkv, ResidualStartsAtATenthOfTheSharedProjection) {
  for (const char* rope : {"expand", "pair_aligned"}) {
    torch::manual_seed(6);
    const auto c = lrkv_config(3, 16, 4, rope);
    LrkvAttention m(c, 0);
    const double ks = m.k_shared_proj->weight.norm().item<double>(), vs = m.v_shared_proj->weight.norm().item<double>();
    for (int64_t h = 0; h < 3; ++h) {
      const double kr = torch::matmul(m.k_down_proj->weight.narrow(0, h * 4, 4).t(), m.k_up[h]).norm().item<double>();
      const double vr = torch::matmul(m.v_down_proj->weight.narrow(0, h * 4, 4).t(), m.v_up[h]).norm().item<double>();
      EXPECT_NEAR(kr / ks, 0.1, 1e-6) << rope << " head " << h;
      EXPECT_NEAR(vr / vs, 0.1, 1e-6) << rope << " head " << h;
    }
  }
}

}  // namespace
