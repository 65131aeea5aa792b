// NAtS-L (SPEC 1.2): routed GDN recurrent == block-parallel (outputs, state, gradients) for random
// routes; all-GDN routes == plain GDN; all-softmax routes == causal attention; the block-routed
// mask against a per-query loop; the sparse router gradient against its formula; route choice
// with the forced last block and the KV budget; the layer's decode (commit after the block) ==
// its full forward, in fp64 and through the fused GDN kernel, at odd lengths; the cache holds
// exactly the KV of the softmax-routed blocks; bad configurations are refused.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <functional>

#include "attention/dense.h"
#include "attention/natsl.h"
#include "support/mixer_checks.h"
#include "util/error.h"

using namespace kvx;
using attention::NatslAttention;

namespace {

const auto kF64 = torch::dtype(torch::kDouble);

struct GdnInputs {
  torch::Tensor q, k, v, g, beta;
};

GdnInputs random_gdn(int64_t B, int64_t H, int64_t T, int64_t K, int64_t V, uint64_t seed) {
  torch::manual_seed(seed);
  GdnInputs in;
  in.q = attention::l2_normalize(torch::randn({B, H, T, K}, kF64)).detach().requires_grad_();
  in.k = attention::l2_normalize(torch::randn({B, H, T, K}, kF64)).detach().requires_grad_();
  in.v = torch::randn({B, H, T, V}, kF64).requires_grad_();
  in.g = (-0.3 * torch::nn::functional::softplus(torch::randn({B, H, T}, kF64))).detach().requires_grad_();
  in.beta = torch::sigmoid(torch::randn({B, H, T}, kF64)).detach().requires_grad_();
  return in;
}

torch::Tensor random_routes(int64_t B, int64_t NB, int64_t H, uint64_t seed) {
  torch::manual_seed(seed);
  return torch::randint(0, 2, {B, NB, H}, kF64);
}

double max_diff(const torch::Tensor& a, const torch::Tensor& b) { return (a - b).abs().max().item<double>(); }

}  // namespace

TEST(RoutedGdn, RecurrentEqualsBlockParallelWithGradients) {
  for (auto [T, block] : std::vector<std::pair<int64_t, int64_t>>{{63, 64}, {193, 64}, {500, 64}, {37, 8}}) {
    SCOPED_TRACE("T " + std::to_string(T) + " block " + std::to_string(block));
    auto in = random_gdn(2, 3, T, 5, 4, T);
    auto commit = random_routes(2, (T + block - 1) / block, 3, T + 1).requires_grad_();
    const double scale = 1 / std::sqrt(5.0);
    auto rec = attention::gdn_routed_recurrent(in.q, in.k, in.v, in.g, in.beta, commit, block, scale);
    auto par = attention::gdn_routed_blocks(in.q, in.k, in.v, in.g, in.beta, commit, block, scale);
    EXPECT_LT(max_diff(rec.first, par.first), 1e-10);
    EXPECT_LT(max_diff(rec.second, par.second), 1e-10);
    torch::manual_seed(3);
    const auto wo = torch::randn_like(rec.first), ws = torch::randn_like(rec.second);
    std::vector<torch::Tensor> leaves{in.q, in.k, in.v, in.g, in.beta, commit};
    auto ga = torch::autograd::grad({(rec.first * wo).sum() + (rec.second * ws).sum()}, leaves);
    auto gb = torch::autograd::grad({(par.first * wo).sum() + (par.second * ws).sum()}, leaves);
    for (size_t i = 0; i < ga.size(); ++i) EXPECT_LT(max_diff(ga[i], gb[i]), 1e-9 * (1 + ga[i].abs().max().item<double>())) << i;
  }
}

TEST(RoutedGdn, AllGdnRoutesArePlainGdn) {
  auto in = random_gdn(1, 2, 193, 6, 3, 9);
  auto commit = torch::ones({1, 4, 2}, kF64);
  auto routed = attention::gdn_routed_blocks(in.q, in.k, in.v, in.g, in.beta, commit, 64, 0.4);
  auto plain = attention::gdn_recurrent(in.q, in.k, in.v, in.g, in.beta, 0.4);
  EXPECT_LT(max_diff(routed.first, plain.first), 1e-10);
  EXPECT_LT(max_diff(routed.second, plain.second), 1e-10);
}

TEST(RoutedGdn, SoftmaxRoutedBlocksCommitOnlyTheirDecay) {
  // Every block to softmax: each block starts from the decayed zero state, i.e. from zero.
  auto in = random_gdn(1, 2, 40, 4, 3, 10);
  auto routed = attention::gdn_routed_blocks(in.q, in.k, in.v, in.g, in.beta, torch::zeros({1, 5, 2}, kF64), 8, 0.5);
  for (int64_t t0 = 0; t0 < 40; t0 += 8) {
    auto alone = attention::gdn_recurrent(in.q.narrow(2, t0, 8), in.k.narrow(2, t0, 8), in.v.narrow(2, t0, 8),
                                          in.g.narrow(2, t0, 8), in.beta.narrow(2, t0, 8), 0.5);
    EXPECT_LT(max_diff(routed.first.narrow(2, t0, 8), alone.first), 1e-12) << t0;
  }
}

TEST(RoutedSoftmax, MatchesAPerQueryLoopAndTheEdgeCases) {
  torch::manual_seed(4);
  const int64_t B = 2, H = 2, GA = 3, T = 29, block = 8, KA = 4, VA = 5;
  auto q = torch::randn({B, H * GA, T, KA}, kF64), k = torch::randn({B, H * GA, T, KA}, kF64);
  auto v = torch::randn({B, H * GA, T, VA}, kF64);
  auto keep = random_routes(B, 4, H, 5);
  auto fast = attention::routed_softmax_attention(q, k, v, keep, block, 0.5);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H * GA; ++h)
      for (int64_t t = 0; t < T; ++t) {
        std::vector<torch::Tensor> ks, vs;
        for (int64_t s = 0; s <= t; ++s)
          if (s / block == t / block || keep[b][s / block][h / GA].item<double>() == 1.0) {
            ks.push_back(k[b][h][s]);
            vs.push_back(v[b][h][s]);
          }
        auto a = torch::softmax(torch::matmul(torch::stack(ks), q[b][h][t]) * 0.5, 0);
        auto o = torch::matmul(a, torch::stack(vs));
        ASSERT_LT(max_diff(fast[b][h][t], o), 1e-12) << b << " " << h << " " << t;
      }
  // All blocks kept: plain causal attention.
  auto all = attention::routed_softmax_attention(q, k, v, torch::ones({B, 4, H}, kF64), block, 1 / std::sqrt(4.0));
  EXPECT_LT(max_diff(all, attention::causal_attention(q, k, v, 0)), 1e-12);
}

TEST(RouterGradient, SoftmaxRoutedBlocksGetThePapersSignal) {
  // d L / d keep[b, nb, j] = sum over the group's heads, queries i after block nb, keys s in nb of
  // P_is dO_i . (v_s - O_i), at blocks routed to softmax.
  torch::manual_seed(6);
  const int64_t H = 2, GA = 2, T = 21, block = 5, NB = 5;
  auto q = torch::randn({1, H * GA, T, 3}, kF64), k = torch::randn({1, H * GA, T, 3}, kF64);
  auto v = torch::randn({1, H * GA, T, 4}, kF64);
  auto keep = random_routes(1, NB, H, 7).requires_grad_();
  auto O = attention::routed_softmax_attention(q, k, v, keep, block, 0.6);
  auto w = torch::randn_like(O);
  auto dkeep = torch::autograd::grad({(O * w).sum()}, {keep})[0];
  const auto dO = w;  // dL/dO for L = sum(O w)
  for (int64_t nb = 0; nb < NB; ++nb)
    for (int64_t j = 0; j < H; ++j) {
      if (keep[0][nb][j].item<double>() != 1.0) continue;
      double expected = 0;
      for (int64_t h = GA * j; h < GA * (j + 1); ++h)
        for (int64_t i = (nb + 1) * block; i < T; ++i) {
          // P_is over the keys query i sees.
          std::vector<int64_t> seen;
          for (int64_t s = 0; s <= i; ++s)
            if (s / block == i / block || keep[0][s / block][j].item<double>() == 1.0) seen.push_back(s);
          std::vector<double> logits;
          double mx = -1e300, z = 0;
          for (auto s : seen) {
            logits.push_back(0.6 * (q[0][h][i] * k[0][h][s]).sum().item<double>());
            mx = std::max(mx, logits.back());
          }
          for (double l : logits) z += std::exp(l - mx);
          for (size_t n = 0; n < seen.size(); ++n) {
            const int64_t s = seen[n];
            if (s / block != nb) continue;
            const double P = std::exp(logits[n] - mx) / z;
            expected += P * (dO[0][h][i] * (v[0][h][s] - O[0][h][i])).sum().item<double>();
          }
        }
      EXPECT_NEAR(dkeep[0][nb][j].item<double>(), expected, 1e-10) << nb << " " << j;
    }
}

TEST(RouterGradient, GdnRoutedBlocksGetThePapersSignal) {
  // d L / d commit[b, nb, h] = < dL/dS_commit(nb), sum_{t in nb} exp(G_end - G_t) k_t u_t^T >,
  // u_t = beta_t (v_t - S_{t-1}'^T k_t), at blocks routed to GDN.
  const int64_t H = 2, T = 24, block = 6, NB = 4, K = 3, V = 4;
  auto in = random_gdn(1, H, T, K, V, 11);
  auto commit = random_routes(1, NB, H, 12);
  commit[0][1][0] = 1.0;  // at least one GDN-routed block with later blocks after it
  commit.requires_grad_();
  const double scale = 0.7;
  auto out = attention::gdn_routed_recurrent(in.q, in.k, in.v, in.g, in.beta, commit, block, scale);
  torch::manual_seed(13);
  auto w = torch::randn_like(out.first);
  auto dcommit = torch::autograd::grad({(out.first * w).sum()}, {commit})[0];
  for (int64_t nb = 0; nb + 1 < NB; ++nb) {
    // dL/dS_commit(nb): rerun the blocks after nb from a leaf state.
    const int64_t t1 = (nb + 1) * block;
    auto before = attention::gdn_routed_recurrent(in.q.narrow(2, 0, t1), in.k.narrow(2, 0, t1), in.v.narrow(2, 0, t1),
                                                  in.g.narrow(2, 0, t1), in.beta.narrow(2, 0, t1),
                                                  commit.narrow(1, 0, nb + 1), block, scale);
    auto S = before.second.detach().requires_grad_();
    torch::Tensor later_out, Sl = S;
    std::vector<torch::Tensor> outs;
    for (int64_t b2 = nb + 1; b2 < NB; ++b2) {
      const int64_t t0 = b2 * block;
      auto r = attention::gdn_recurrent(in.q.narrow(2, t0, block), in.k.narrow(2, t0, block), in.v.narrow(2, t0, block),
                                        in.g.narrow(2, t0, block), in.beta.narrow(2, t0, block), scale, Sl);
      outs.push_back(r.first);
      auto D = in.g.narrow(2, t0, block).sum(-1).exp().unsqueeze(-1).unsqueeze(-1) * Sl;
      Sl = D + commit.select(1, b2).detach().unsqueeze(-1).unsqueeze(-1) * (r.second - D);
    }
    auto dS = torch::autograd::grad({(torch::cat(outs, 2) * w.narrow(2, t1, T - t1)).sum()}, {S})[0];
    // The block's writes, literally: start from the committed state before nb.
    auto S0 = nb == 0 ? torch::zeros({1, H, K, V}, kF64)
                      : attention::gdn_routed_recurrent(in.q.narrow(2, 0, nb * block), in.k.narrow(2, 0, nb * block),
                                                        in.v.narrow(2, 0, nb * block), in.g.narrow(2, 0, nb * block),
                                                        in.beta.narrow(2, 0, nb * block), commit.narrow(1, 0, nb), block, scale)
                            .second.detach();
    for (int64_t h = 0; h < H; ++h) {
      if (commit[0][nb][h].item<double>() != 1.0) continue;
      auto St = S0[0][h].clone();
      auto writes = torch::zeros({K, V}, kF64);
      const int64_t t0 = nb * block;
      double G_end = 0;
      for (int64_t t = t0; t < t0 + block; ++t) G_end += in.g[0][h][t].item<double>();
      double G_t = 0;
      for (int64_t t = t0; t < t0 + block; ++t) {
        G_t += in.g[0][h][t].item<double>();
        auto kt = in.k[0][h][t].detach(), vt = in.v[0][h][t].detach();
        St = St * std::exp(in.g[0][h][t].item<double>());
        auto u = in.beta[0][h][t].item<double>() * (vt - torch::matmul(St.t(), kt));
        St = St + torch::outer(kt, u);
        writes += std::exp(G_end - G_t) * torch::outer(kt, u);
      }
      const double expected = (dS[0][h] * writes).sum().item<double>();
      EXPECT_NEAR(dcommit[0][nb][h].item<double>(), expected, 1e-9 * (1 + std::fabs(expected))) << nb << " " << h;
    }
  }
}

TEST(Routing, ArgmaxWithTheForcedLastBlockAndTheBudget) {
  // probs [1, 6, 2, 2]: head 0 always prefers softmax, head 1 always GDN.
  auto probs = torch::zeros({1, 6, 2, 2}, kF64);
  probs.select(2, 0).select(-1, 0).fill_(0.9);
  probs.select(2, 0).select(-1, 1).fill_(0.1);
  probs.select(2, 1).select(-1, 0).fill_(0.2);
  probs.select(2, 1).select(-1, 1).fill_(0.8);
  torch::Tensor counts;
  auto chosen = attention::choose_routes(probs, {1.0, 0}, counts, 0, true);
  auto type = chosen.argmax(-1);
  for (int nb = 0; nb < 5; ++nb) EXPECT_EQ(type[0][nb][0].item<int64_t>(), 0) << nb;
  EXPECT_EQ(type[0][5][0].item<int64_t>(), 1) << "the last block is forced to GDN";
  for (int nb = 0; nb < 6; ++nb) EXPECT_EQ(type[0][nb][1].item<int64_t>(), 1);
  EXPECT_EQ(counts[0][0].item<int64_t>(), 5);
  // Budget 0.5: at most floor(0.5 (blocks so far)) softmax blocks: GDN, softmax, GDN, softmax, GDN, softmax.
  torch::Tensor capped;
  type = attention::choose_routes(probs, {0.5, 0}, capped, 0, false).argmax(-1);
  for (int nb = 0; nb < 6; ++nb) EXPECT_EQ(type[0][nb][0].item<int64_t>(), nb % 2 == 0 ? 1 : 0) << nb;
  EXPECT_EQ(capped[0][0].item<int64_t>(), 3);
  // A count cap of 2: the first two softmax-preferring blocks keep their KV, no later one does.
  torch::Tensor counted;
  type = attention::choose_routes(probs, {1.0, 2}, counted, 0, false).argmax(-1);
  for (int nb = 0; nb < 6; ++nb) EXPECT_EQ(type[0][nb][0].item<int64_t>(), nb < 2 ? 0 : 1) << nb;
  EXPECT_EQ(counted[0][0].item<int64_t>(), 2);
  torch::Tensor fresh;
  type = attention::choose_routes(probs, {0.5, 0}, fresh, 0, false).argmax(-1);  // the f = 0.5 routes again
  // The same one block at a time (decode) gives the same routes.
  torch::Tensor step_counts;
  for (int nb = 0; nb < 6; ++nb) {
    auto t = attention::choose_routes(probs.narrow(1, nb, 1), {0.5, 0}, step_counts, nb, false).argmax(-1);
    EXPECT_EQ(t[0][0][0].item<int64_t>(), type[0][nb][0].item<int64_t>()) << nb;
  }
}

TEST(Routing, SparseRuleKeepsOnlyTheChosenOpsGradient) {
  auto probs = torch::tensor({0.7, 0.3, 0.4, 0.6}, kF64).view({1, 2, 1, 2}).requires_grad_();
  auto chosen = torch::tensor({1.0, 0.0, 0.0, 1.0}, kF64).view({1, 2, 1, 2});
  auto upstream = torch::tensor({2.0, 3.0, 5.0, 7.0}, kF64).view({1, 2, 1, 2});
  auto sparse = torch::autograd::grad({(attention::route_select(probs, chosen, true) * upstream).sum()}, {probs})[0];
  EXPECT_TRUE(torch::equal(sparse, upstream * chosen));
  auto dense = torch::autograd::grad({(attention::route_select(probs, chosen, false) * upstream).sum()}, {probs})[0];
  EXPECT_TRUE(torch::equal(dense, upstream));
  EXPECT_TRUE(torch::equal(attention::route_select(probs, chosen, true), chosen));
}

// ---- the layer ----

namespace {

model::ModelConfig natsl_config(int heads, int attn_heads, int key_dim, int value_dim, int block) {
  auto c = kvx::testing::linear_mixer_config("natsl", heads, key_dim, value_dim);
  c.nats_attention_heads = attn_heads;
  c.nats_block_size = block;
  c.validate();
  return c;
}

std::shared_ptr<NatslAttention> make_natsl(const model::ModelConfig& c, int seed) {
  auto m = kvx::testing::make_fp64_layer<NatslAttention>(c, seed);
  torch::NoGradGuard ng;
  m->router->weight.normal_(0, 3.0);  // decisive routes that vary from block to block
  return m;
}

attention::CacheOptions cache_options(bool reference) { return reference ? kvx::testing::reference_cache() : attention::CacheOptions{}; }

}  // namespace

TEST(NatslLayer, DecodeCommitsAfterTheBlockAndEqualsTheFullForward) {
  struct Case {
    int64_t T, block;
    std::vector<int64_t> pieces;
  };
  for (const auto& cs : std::vector<Case>{{63, 8, {5, 1, 1, 20, 3, 1, 32}},  // prefill and steps across block edges
                                          {193, 64, {70, 1, 1, 57, 64}},
                                          {500, 16, {100, 1, 1, 1, 13, 384}}}) {
    for (int path = 0; path < 3; ++path) {  // reference; fused GDN (K != V); fused GDN and softmax KV stores (K == V)
      const bool reference = path == 0;
      const int V = path == 2 ? 8 : 4;
      SCOPED_TRACE("T " + std::to_string(cs.T) + " block " + std::to_string(cs.block) + " path " + std::to_string(path));
      const auto c = natsl_config(2, 4, 8, V, cs.block);
      auto m = make_natsl(c, static_cast<int>(cs.T));
      torch::NoGradGuard ng;
      auto x = torch::randn({2, cs.T, c.hidden_size}, kF64);
      auto full = m->forward(x);
      const auto routes = m->last_routes();
      EXPECT_THROW(m->forward(x.narrow(1, 0, 0)), Error);  // an empty sequence: a kvx error, not libtorch's
      auto cache_base = m->new_cache(2, cache_options(reference));
      auto& cache = dynamic_cast<attention::NatslCache&>(*cache_base);
      EXPECT_EQ(cache.fused_kv, path == 2);
      std::vector<torch::Tensor> parts;
      int64_t pos = 0;
      for (int64_t n : cs.pieces) {
        parts.push_back(m->step(x.narrow(1, pos, n), cache));
        pos += n;
      }
      ASSERT_EQ(pos, cs.T);
      auto stepped = torch::cat(parts, 1);
      const double tol = reference ? 1e-10 : 1e-5 * full.abs().max().item<double>();
      EXPECT_LT(max_diff(stepped, full), tol);
      // The decode routes are the forward's (except the forward's forced last block), and both kinds occur.
      const int64_t complete = cs.T / cs.block;
      ASSERT_EQ(static_cast<int64_t>(cache.routes.size()), complete);
      int64_t softmax_blocks = 0, gdn_blocks = 0;
      for (int64_t nb = 0; nb < complete; ++nb) {
        if (nb + 1 < routes.size(1)) EXPECT_TRUE(torch::equal(cache.routes[nb], routes.select(1, nb))) << nb;
        softmax_blocks += (cache.routes[nb] == 0).sum().item<int64_t>();
        gdn_blocks += (cache.routes[nb] == 1).sum().item<int64_t>();
      }
      EXPECT_GT(softmax_blocks, 0);
      EXPECT_GT(gdn_blocks, 0);
      // The cache holds exactly the KV of the softmax-routed blocks and of the current block.
      const int64_t partial = cs.T % cs.block;
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t j = 0; j < 2; ++j) {
          int64_t kept = 0;
          for (const auto& r : cache.routes) kept += r[b][j].item<int64_t>() == 0 ? cs.block : 0;
          EXPECT_EQ(cache.kv_tokens(b, j), kept + partial) << b << " " << j;
        }
      int64_t held = 0;
      for (int64_t b = 0; b < 2; ++b)
        for (int64_t j = 0; j < 2; ++j) held += cache.kv_tokens(b, j);
      // Per group: GA heads of KA + VA values, f32 in the KV stores, the model's fp64 in the torch buffers.
      EXPECT_EQ(cache.kv_bytes(), held * (cache.fused_kv ? 4 : 8) * 2 * (8 / 2 + V / 2));
    }
  }
}

TEST(NatslLayer, AllSoftmaxBudgetAndNoPositionEncodingVariantsDecodeExactly) {
  for (double budget : {0.25, 1.0})
    for (bool rope : {true, false}) {
      auto c = natsl_config(2, 2, 4, 6, 8);
      c.nats_max_softmax_fraction = budget;
      c.nats_max_softmax_blocks = budget == 1.0 && !rope ? 1 : 0;  // one variant with a count cap
      c.nats_rope = rope;
      c.validate();
      auto m = make_natsl(c, 21);
      torch::NoGradGuard ng;
      auto x = torch::randn({1, 45, c.hidden_size}, kF64);
      auto full = m->forward(x);
      auto cache = m->new_cache(1, cache_options(true));
      std::vector<torch::Tensor> parts{m->step(x.narrow(1, 0, 10), *cache)};
      for (int64_t t = 10; t < 45; ++t) parts.push_back(m->step(x.narrow(1, t, 1), *cache));
      EXPECT_LT(max_diff(torch::cat(parts, 1), full), 1e-10) << budget << " " << rope;
      auto& nc = dynamic_cast<attention::NatslCache&>(*cache);
      for (int64_t j = 0; j < 2; ++j)
        EXPECT_LE(nc.softmax_counts[0][j].item<int64_t>(),
                  c.nats_max_softmax_blocks > 0 ? 1 : static_cast<int64_t>(std::floor(budget * 5 + 1e-9))) << j;
    }
}

TEST(NatslLayer, QuantisedKeptBlocksAndRandomHistoryForBenchmarks) {
  const auto c = natsl_config(2, 4, 64, 64, 16);  // KA = VA = 32: one q8 block per row
  auto m = make_natsl(c, 41);
  torch::NoGradGuard ng;
  auto x = torch::randn({1, 70, c.hidden_size}, kF64);
  auto full = m->forward(x);
  auto cache = m->new_cache(1, attention::CacheOptions::parse("q8", "", false));
  auto y = m->step(x, *cache);
  EXPECT_LT(((y - full).abs().max() / full.abs().max()).item<double>(), 0.05);
  auto& nc = dynamic_cast<attention::NatslCache&>(*cache);
  int64_t held = 0;
  for (int64_t j = 0; j < 2; ++j) held += nc.kv_tokens(0, j);
  EXPECT_EQ(nc.kv_bytes(), held * 2 * 2 * 34);  // K and V, GA = 2 heads, 32 values = one 34-byte q8 block
  // Random history keeps the asked fraction of complete blocks, and decoding continues from it.
  attention::CacheOptions o;
  o.history_softmax_fraction = 0.25;
  auto bench = m->new_cache(1, o);
  bench->append_random_history(16 * 40 + 5, 3);
  auto& bc = dynamic_cast<attention::NatslCache&>(*bench);
  EXPECT_EQ(bc.kv_tokens(0, 1), 10 * 16 + 5);
  EXPECT_EQ(bc.length(), 16 * 40 + 5);
  auto next = m->step(x.narrow(1, 0, 1).to(torch::kFloat64), *bench);
  EXPECT_TRUE(torch::isfinite(next).all().item<bool>());
}

TEST(NatslLayer, TrainingGradientsReachTheRouterOnlyThroughTheChosenOps) {
  auto c = natsl_config(2, 4, 4, 4, 8);
  auto m = make_natsl(c, 31);
  auto x = torch::randn({2, 40, c.hidden_size}, kF64);
  auto loss = (m->forward(x) * torch::randn({2, 40, c.hidden_size}, kF64)).sum();
  loss.backward();
  ASSERT_TRUE(m->router->weight.grad().defined());
  EXPECT_GT(m->router->weight.grad().abs().sum().item<double>(), 0.0) << "the router learns from the LM loss";
  for (const auto& p : m->parameters()) EXPECT_TRUE(torch::isfinite(p.grad()).all().item<bool>());
  int64_t n = 0;
  for (const auto& p : m->parameters()) n += p.numel();
  EXPECT_EQ(n, static_cast<int64_t>(attention::AttentionShape::of_layer(c, "natsl").mixer_params()));
}

TEST(NatslLayer, BadConfigurationsAreRefusedWithTheFix) {
  auto expect_error = [](model::ModelConfig c, const std::string& needle) {
    try {
      c.validate();
      FAIL() << "accepted: " << needle;
    } catch (const Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  const auto c = natsl_config(2, 4, 8, 4, 8);
  const std::vector<std::pair<std::function<void(model::ModelConfig&)>, std::string>> cases = {
      {[](auto& b) { b.nats_attention_heads = 3; }, "must be a multiple of linear_num_heads"},
      {[](auto& b) { b.nats_attention_heads = 6; }, "must be divisible by"},  // GA = 3 does not split K = 8
      {[](auto& b) { b.nats_max_softmax_fraction = 0; }, "nats_max_softmax_fraction must be in (0, 1]"},
      {[](auto& b) { b.nats_router_grad = "straight"; }, "is not one of sparse"},
      {[](auto& b) { b.nats_block_size = 0; }, "nats_block_size must be positive"},
      {[](auto& b) { b.nats_max_softmax_blocks = -1; }, "nats_max_softmax_blocks must be >= 0"},
      {[](auto& b) { b.layout = "gdn*1,natsl"; }, "describes more than num_hidden_layers"}};
  for (const auto& [mutate, needle] : cases) {
    auto bad = c;
    mutate(bad);
    expect_error(bad, needle);
  }
  // Caches the layer cannot honour.
  NatslAttention m(c, 0);
  try {
    m.new_cache(1, attention::CacheOptions::parse("q8", "", false));
    FAIL() << "a q8 NAtS-L cache was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("use --kv-cache f32"), std::string::npos) << e.what();
  }
}
