// Gated DeltaNet core (attention/gdn.h): the chunked (UT-transform) form equals the
// token-recurrent form, outputs, final state and gradients, in fp64 at odd lengths and widths
// and across chunk boundaries; hand-checked cases of the recurrence itself.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "attention/gdn.h"
#include "support/mixer_checks.h"
#include "util/error.h"

using namespace kvx;

namespace {

struct Inputs {
  torch::Tensor q, k, v, g, beta, state;
  std::vector<torch::Tensor> leaves() const { return {q, k, v, g, beta, state}; }
};

Inputs random_inputs(int64_t B, int64_t H, int64_t T, int64_t K, int64_t V, uint64_t seed) {
  torch::manual_seed(seed);
  auto opt = torch::dtype(torch::kDouble);
  Inputs in;
  in.q = attention::l2_normalize(torch::randn({B, H, T, K}, opt)).detach().requires_grad_();
  in.k = attention::l2_normalize(torch::randn({B, H, T, K}, opt)).detach().requires_grad_();
  in.v = torch::randn({B, H, T, V}, opt).requires_grad_();
  in.g = (-torch::nn::functional::softplus(torch::randn({B, H, T}, opt))).detach().requires_grad_();  // log decay <= 0
  in.beta = torch::sigmoid(torch::randn({B, H, T}, opt)).detach().requires_grad_();
  in.state = torch::randn({B, H, K, V}, opt).requires_grad_();
  return in;
}

std::vector<torch::Tensor> grads(const std::pair<torch::Tensor, torch::Tensor>& out, const Inputs& in, uint64_t seed) {
  torch::manual_seed(seed);
  const auto wo = torch::randn_like(out.first), ws = torch::randn_like(out.second);
  const auto loss = (out.first * wo).sum() + (out.second * ws).sum();
  return torch::autograd::grad({loss}, in.leaves());
}

}  // namespace

TEST(Gdn, ChunkedEqualsRecurrentWithGradients) {
  const double scale = 1.0 / std::sqrt(5.0);
  for (int64_t T : {1, 63, 64, 65, 193}) {
    for (int64_t chunk : {64, 16}) {
      const auto in = random_inputs(2, 3, T, 5, 7, 100 + T);
      const auto rec = attention::gdn_recurrent(in.q, in.k, in.v, in.g, in.beta, scale, in.state);
      const auto chk = attention::gdn_chunked(in.q, in.k, in.v, in.g, in.beta, scale, in.state, chunk);
      SCOPED_TRACE("T " + std::to_string(T) + ", chunk " + std::to_string(chunk));
      EXPECT_LT((rec.first - chk.first).abs().max().item<double>(), 1e-10);
      EXPECT_LT((rec.second - chk.second).abs().max().item<double>(), 1e-10);
      const auto ga = grads(rec, in, 7), gb = grads(chk, in, 7);
      const char* names[] = {"q", "k", "v", "g", "beta", "state"};
      for (size_t i = 0; i < ga.size(); ++i)
        EXPECT_LT((ga[i] - gb[i]).abs().max().item<double>(), 1e-9 * (1 + ga[i].abs().max().item<double>())) << names[i];
    }
  }
}

TEST(Gdn, RecurrenceByHand) {
  auto opt = torch::dtype(torch::kDouble);
  // One token, no decay, beta 1, empty state: S = k v^T, o = scale (k . q) v.
  const auto k = torch::tensor({0.6, 0.8}, opt).view({1, 1, 1, 2});
  const auto q = torch::tensor({1.0, 0.0}, opt).view({1, 1, 1, 2});
  const auto v = torch::tensor({2.0, -1.0, 3.0}, opt).view({1, 1, 1, 3});
  const auto zeros = torch::zeros({1, 1, 1}, opt), ones = torch::ones({1, 1, 1}, opt);
  auto [o, S] = attention::gdn_recurrent(q, k, v, zeros, ones, 0.5);
  EXPECT_TRUE(torch::allclose(o.view({3}), 0.5 * 0.6 * v.view({3})));
  EXPECT_TRUE(torch::allclose(S.view({2, 3}), torch::outer(k.view({2}), v.view({3}))));
  // Writing the same key again with beta 1 replaces its value (the delta rule), decay first.
  const auto k2 = torch::cat({k, k}, 2), q2 = torch::cat({q, q}, 2);
  const auto v2 = torch::cat({v, torch::tensor({1.0, 1.0, 1.0}, opt).view({1, 1, 1, 3})}, 2);
  const auto g2 = torch::tensor({0.0, std::log(0.5)}, opt).view({1, 1, 2});
  auto [o2, S2] = attention::gdn_recurrent(q2, k2, v2, g2, torch::ones({1, 1, 2}, opt), 1.0);
  EXPECT_TRUE(torch::allclose(S2.view({2, 3}), torch::outer(k.view({2}), torch::ones({3}, opt))));
  // beta 0: nothing is written, the initial state only decays.
  const auto S0 = torch::randn({1, 1, 2, 3}, opt);
  auto [o3, S3] = attention::gdn_chunked(q2, k2, v2, g2, torch::zeros({1, 1, 2}, opt), 1.0, S0);
  EXPECT_TRUE(torch::allclose(S3, 0.5 * S0));
  EXPECT_TRUE(torch::allclose(o3.select(2, 1).view({3}), 0.5 * (S0.view({2, 3}).t().matmul(q.view({2})))));
}

TEST(Gdn, BadShapesNameTheExpectedLayout) {
  auto x = torch::zeros({1, 2, 3, 4});
  try {
    attention::gdn_recurrent(x, x, x, torch::zeros({1, 2, 4}), torch::zeros({1, 2, 3}), 1.0);
    ADD_FAILURE() << "no error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("expected q, k [B, H, T, K]"), std::string::npos) << e.what();
  }
  EXPECT_THROW(attention::gdn_chunked(x, x, x, torch::zeros({1, 2, 3}), torch::zeros({1, 2, 3}), 1.0, {}, 0), Error);
  // An empty sequence is a kvx error on every path (libtorch's "stack expects a non-empty TensorList" before).
  const auto empty = torch::zeros({1, 2, 0, 4});
  EXPECT_THROW(attention::gdn_recurrent(empty, empty, empty, torch::zeros({1, 2, 0}), torch::zeros({1, 2, 0}), 1.0), Error);
  EXPECT_THROW(attention::gdn_chunked(empty, empty, empty, torch::zeros({1, 2, 0}), torch::zeros({1, 2, 0}), 1.0), Error);
}

// ---- The GDN layer (GdnAttention) ----

using kvx::testing::reference_cache;

namespace {

model::ModelConfig gdn_config(int heads, int key_dim, int value_dim) {
  auto c = kvx::testing::linear_mixer_config("gdn", heads, key_dim, value_dim);
  c.validate();
  return c;
}

std::shared_ptr<attention::GdnAttention> make_gdn(const model::ModelConfig& c, int seed) {
  return kvx::testing::make_fp64_layer<attention::GdnAttention>(c, seed);
}

// The layer written out token by token from its weights: explicit convolution taps, the
// recurrence of SPEC 1.2 per head, RMSNorm, SiLU gate.
torch::Tensor naive_gdn_layer(attention::GdnAttention& m, const torch::Tensor& x, const model::ModelConfig& c) {
  const int64_t B = x.size(0), T = x.size(1), H = c.linear_num_heads, K = c.linear_key_head_dim, V = c.linear_value_head_dim;
  const int64_t W = c.linear_conv_kernel_dim;
  auto conv = [&](const torch::Tensor& w_proj, const torch::Tensor& w_conv) {  // [B, T, C]
    auto p = torch::matmul(x, w_proj.t());
    auto out = torch::zeros_like(p);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t j = 0; j < W; ++j) {
        const int64_t s = t - (W - 1) + j;
        if (s >= 0) out.select(1, t) += p.select(1, s) * w_conv.select(1, 0).select(1, j);
      }
    return torch::silu(out);
  };
  auto q = conv(m.q_proj->weight, m.q_conv1d->weight), k = conv(m.k_proj->weight, m.k_conv1d->weight);
  auto v = conv(m.v_proj->weight, m.v_conv1d->weight);
  auto beta = torch::sigmoid(torch::matmul(x, m.b_proj->weight.t()));
  auto g = -m.A_log.exp() * torch::log1p(torch::exp(torch::matmul(x, m.a_proj->weight.t()) + m.dt_bias));
  auto y = torch::zeros({B, T, H, V}, x.options());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h) {
      auto S = torch::zeros({K, V}, x.options());
      for (int64_t t = 0; t < T; ++t) {
        auto qt = q[b][t].narrow(0, h * K, K), kt = k[b][t].narrow(0, h * K, K), vt = v[b][t].narrow(0, h * V, V);
        qt = qt / torch::sqrt((qt * qt).sum() + 1e-6);
        kt = kt / torch::sqrt((kt * kt).sum() + 1e-6);
        S = S * torch::exp(g[b][t][h]);
        auto u = beta[b][t][h] * (vt - torch::matmul(S.t(), kt));
        S = S + torch::outer(kt, u);
        auto o = torch::matmul(S.t(), qt / std::sqrt(static_cast<double>(K)));
        o = o / torch::sqrt((o * o).mean() + c.rms_norm_eps) * m.o_norm->weight;
        y[b][t][h] = o * torch::silu(torch::matmul(x[b][t], m.g_proj->weight.t()).narrow(0, h * V, V));
      }
    }
  return torch::matmul(y.reshape({B, T, H * V}), m.o_proj->weight.t());
}

}  // namespace

TEST(GdnLayer, ForwardMatchesTheLayerWrittenOutTokenByToken) {
  const auto c = gdn_config(3, 5, 7);
  auto m = make_gdn(c, 1);
  torch::NoGradGuard ng;
  auto x = torch::randn({2, 70, c.hidden_size}, torch::kFloat64);  // crosses a chunk boundary
  auto full = m->forward(x), naive = naive_gdn_layer(*m, x, c);
  EXPECT_LT((full - naive).abs().max().item<double>(), 1e-10);
}

TEST(GdnLayer, DecodeEqualsForwardWithGradientsAndConstantState) {
  const auto c = gdn_config(2, 6, 5);
  auto m = make_gdn(c, 2);
  auto x = torch::randn({2, 83, c.hidden_size}, torch::kFloat64);
  {
    torch::NoGradGuard ng;
    auto full = m->forward(x);
    auto cache = m->new_cache(2, reference_cache());
    const int64_t state_bytes = cache->bytes();
    EXPECT_EQ(state_bytes, 2 * 4 * (2 * 6 * 5 + 3 * 2 * (2 * 6 + 5)));  // S and 3 conv taps of q, k, v (f32)
    std::vector<torch::Tensor> parts;
    int64_t pos = 0;
    for (int64_t chunk : {2, 1, 1, 66, 5, 1, 6, 1}) {  // 66: the chunked form inside a step
      parts.push_back(m->step(x.narrow(1, pos, chunk), *cache));
      pos += chunk;
      EXPECT_EQ(cache->bytes(), state_bytes) << "the state must not grow with the context";
    }
    EXPECT_EQ(cache->length(), 83);
    auto stepped = torch::cat(parts, 1);
    EXPECT_LT((stepped - full).abs().max().item<double>(), 1e-10);
    EXPECT_EQ(m->cache_bytes_per_token(kernels::KVType::F32), 0.0);
    EXPECT_EQ(m->state_bytes(), state_bytes / 2);
  }
  kvx::testing::expect_step_gradients_equal_forward(*m, x.narrow(1, 0, 9));
}

TEST(GdnLayer, FusedKernelDecodeMatchesForward) {
  for (auto [K, V] : std::vector<std::pair<int, int>>{{5, 7}, {32, 64}}) {
    const auto c = gdn_config(3, K, V);
    auto m = make_gdn(c, 3);
    torch::NoGradGuard ng;
    auto x = torch::randn({2, 21, c.hidden_size}, torch::kFloat64);
    auto full = m->forward(x);
    for (int threads : {1, 2}) {
      attention::CacheOptions o;
      o.threads = threads;
      auto cache = m->new_cache(2, o);
      ASSERT_TRUE(dynamic_cast<attention::GdnCache&>(*cache).fused);
      std::vector<torch::Tensor> parts{m->step(x.narrow(1, 0, 6), *cache)};
      for (int t = 6; t < 21; ++t) parts.push_back(m->step(x.narrow(1, t, 1), *cache));
      auto stepped = torch::cat(parts, 1);
      EXPECT_LT(((stepped - full).abs().max() / full.abs().max()).item<double>(), 1e-5) << K << "x" << V;
      EXPECT_THROW(m->step(x.narrow(1, 0, 0), *cache), Error);  // the fused path returned an empty tensor
    }
    EXPECT_THROW(m->step(x.narrow(1, 0, 0), *m->new_cache(2, reference_cache())), Error);
    EXPECT_THROW(m->forward(x.narrow(1, 0, 0)), Error);
  }
}

TEST(GdnLayer, InitialisationFollowsTheSpec) {
  const auto c = gdn_config(64, 4, 4);
  torch::manual_seed(5);
  attention::GdnAttention m(c, 0);
  const auto A = m.A_log.exp();
  EXPECT_GE(A.min().item<double>(), 0.0);
  EXPECT_LE(A.max().item<double>(), 16.0);
  const auto dt = torch::nn::functional::softplus(m.dt_bias);  // softplus(softplus^-1(dt)) = dt
  EXPECT_GE(dt.min().item<double>(), 1e-3 * 0.999);
  EXPECT_LE(dt.max().item<double>(), 0.1 * 1.001);
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  EXPECT_EQ(n, static_cast<int64_t>(attention::AttentionShape::of_layer(c, "gdn").mixer_params()));
}

TEST(GdnLayer, EvictionIsRefused) {
  const auto c = gdn_config(2, 4, 4);
  attention::GdnAttention m(c, 0);
  auto o = attention::CacheOptions::parse("f32", "sink=4,window=16", false);
  try {
    m.new_cache(1, o);
    FAIL() << "eviction on a GDN layer was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no KV to evict"), std::string::npos) << e.what();
  }
}
