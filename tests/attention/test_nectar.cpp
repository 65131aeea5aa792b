// Nectar's per-layer math (SPEC 1.4): the exact log-mass/content split composes back into full
// attention (with and without local tokens, GQA), Quadrature with every cached pair is exact,
// the budget accounting, and GQA sharing of one module per KV head.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "attention/dense.h"
#include "attention/nectar.h"
#include "util/error.h"

using namespace kvx;
using namespace kvx::attention;

namespace {

torch::TensorOptions f64() { return torch::dtype(torch::kFloat64); }

// Plain full causal attention over [document; local] for queries at local positions q_start + i,
// written out per head with an explicit loop over keys (the reference the split must equal).
torch::Tensor full_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v, int64_t n_doc, int64_t q_start) {
  const int64_t B = q.size(0), H = q.size(1), T = q.size(2), d = q.size(3), Hkv = k.size(1), G = H / Hkv;
  auto out = torch::zeros_like(q);
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t) {
        const int64_t visible = n_doc + q_start + t + 1;
        const auto kk = k[b][h / G].narrow(0, 0, visible), vv = v[b][h / G].narrow(0, 0, visible);
        const auto p = torch::softmax(torch::mv(kk, q[b][h][t]) / std::sqrt(static_cast<double>(d)), 0);
        out[b][h][t] = torch::mv(vv.t(), p);
      }
  return out;
}

}  // namespace

TEST(Nectar, ExactSplitComposesIntoFullAttention) {
  torch::manual_seed(3);
  for (const auto [H, Hkv] : {std::pair<int64_t, int64_t>{4, 4}, {6, 2}, {3, 1}}) {
    const int64_t B = 2, d = 7, n = 13, T = 5;
    for (const int64_t q_start : {0, 3}) {
      const int64_t Tk = q_start + T;
      const auto k = torch::randn({B, Hkv, n + Tk, d}, f64()) * 1.5, v = torch::randn({B, Hkv, n + Tk, d}, f64());
      const auto q = torch::randn({B, H, T, d}, f64()) * 2;
      const auto doc = exact_document_attention(q, k.narrow(2, 0, n), v.narrow(2, 0, n));
      const auto composed = compose_document_attention(q, k.narrow(2, n, Tk), v.narrow(2, n, Tk), q_start, doc);
      EXPECT_TRUE(torch::allclose(composed, full_attention(q, k, v, n, q_start), 1e-10, 1e-12)) << H << "/" << Hkv;
    }
    // No local tokens: the document alone (its content), whether the local tensors are empty or undefined.
    const auto k = torch::randn({B, Hkv, 9, d}, f64()), v = torch::randn({B, Hkv, 9, d}, f64());
    const auto q = torch::randn({B, H, 1, d}, f64());
    const auto doc = exact_document_attention(q, k, v);
    const auto only = full_attention(q, k.narrow(2, 0, 8), v.narrow(2, 0, 8), 8, -1);  // position 7 sees keys 0..7
    const auto doc8 = exact_document_attention(q, k.narrow(2, 0, 8), v.narrow(2, 0, 8));
    EXPECT_TRUE(torch::allclose(compose_document_attention(q, {}, {}, 0, doc8), only, 1e-10, 1e-12));
    EXPECT_TRUE(torch::allclose(compose_document_attention(q, k.narrow(2, 0, 0), v.narrow(2, 0, 0), 0, doc), doc.content));
  }
}

TEST(Nectar, CompositionIsStableAtExtremeLogits) {
  // Log masses far outside exp's range: the max-shifted form stays finite and picks the dominant side.
  const auto q = torch::ones({1, 1, 1, 4}, f64()), k = torch::zeros({1, 1, 1, 4}, f64()), v = torch::ones({1, 1, 1, 4}, f64());
  for (const double a : {-2000.0, 2000.0}) {
    DocumentAttention doc{torch::full({1, 1, 1}, a, f64()), torch::full({1, 1, 1, 4}, -3.0, f64())};
    const auto out = compose_document_attention(q, k, v, 0, doc);
    EXPECT_TRUE(torch::isfinite(out).all().item<bool>());
    EXPECT_NEAR(out[0][0][0][0].item<double>(), a > 0 ? -3.0 : 1.0, 1e-12);
  }
}

TEST(Nectar, QuadratureWithEveryCachedPairIsExact) {
  torch::manual_seed(5);
  const int H = 6, Hkv = 2, d = 8, n = 11;
  const auto k = torch::randn({1, Hkv, n, d}) * 1.3, v = torch::randn({1, Hkv, n, d});
  NectarQuadrature quad(H, Hkv, d, n);
  quad.initialize(k[0], v[0]);
  const auto q = torch::randn({3, H, 4, d}) * 2;
  const auto got = quad.forward(q), want = exact_document_attention(q, k, v);
  EXPECT_TRUE(torch::allclose(got.log_mass, want.log_mass, 1e-5, 1e-5));
  EXPECT_TRUE(torch::allclose(got.content, want.content, 1e-5, 1e-5));
  EXPECT_EQ(quad.parameters_per_head(), 2 * n * d);
  // Fewer pairs than asked for: refused.
  NectarQuadrature big(H, Hkv, d, n + 1);
  EXPECT_THROW(big.initialize(k[0], v[0]), Error);
}

TEST(Nectar, BudgetAccountingMatchesTheModules) {
  for (const auto& [depths, kind] : {std::pair{"1,1,2", "mlp"}, {"0,2,1", "mlp"}, {"2,0,0", "mlp"}, {"0,1,1", "mlp"}}) {
    const auto arch = NectarArch::parse(kind, depths);
    for (const int64_t w : {1, 5, 16}) {
      NectarMlp mlp(4, 2, 12, arch, w);
      EXPECT_EQ(mlp.parameters_per_head(), NectarMlp::parameter_count(arch, 12, w)) << depths << " w" << w;
    }
    // The chosen width is the largest within the budget.
    const double budget = 0.05 * 2 * 500 * 12;  // rho 5%, n 500, d_h 12
    const int64_t w = NectarMlp::width_for_budget(arch, 12, budget);
    EXPECT_LE(NectarMlp::parameter_count(arch, 12, w), budget);
    EXPECT_GT(NectarMlp::parameter_count(arch, 12, w + 1), budget);
    EXPECT_THROW(NectarMlp::width_for_budget(arch, 12, 10), Error);
  }
  // Hand count for (1,1,2), d = 3, w = 2: backbone 2*3+2; score 2*3+2+4; target 2*(2*3+2+4); outputs (2+1) + (2*3+3).
  EXPECT_EQ(NectarMlp::parameter_count(NectarArch::parse("mlp", "1,1,2"), 3, 2), 8 + 12 + 24 + 3 + 9);
  EXPECT_EQ(NectarQuadrature::pairs_for_budget(64, 0.02 * 2 * 427 * 64), 8);  // p = floor(rho n)
  EXPECT_THROW(NectarQuadrature::pairs_for_budget(64, 100), Error);
  EXPECT_THROW(NectarArch::parse("mlp", "0,0,1"), Error);
  EXPECT_THROW(NectarArch::parse("mlp", "1,x,1"), Error);
  EXPECT_THROW(NectarArch::parse("mlp", "1x,1,2"), Error);  // not read as 1
  EXPECT_THROW(NectarArch::parse("mlp", "1,,2"), Error);
  EXPECT_THROW(NectarArch::parse("transformer", ""), Error);
}

TEST(Nectar, QueryHeadsOfAGroupShareTheirKvHeadsModule) {
  torch::manual_seed(9);
  const int H = 6, Hkv = 2, d = 8;
  NectarMlp mlp(H, Hkv, d, NectarArch::parse("mlp", "1,1,1"), 5);
  auto q = torch::randn({2, H, 3, d});
  // Heads 0..2 are group 0, heads 3..5 group 1: the same query in heads 0 and 2 gets the same
  // answer; in heads 0 and 3 (other module) a different one.
  q[0][2] = q[0][0];
  q[0][3] = q[0][0];
  const auto r = mlp.forward(q);
  EXPECT_TRUE(torch::equal(r.content[0][2], r.content[0][0]));
  EXPECT_TRUE(torch::equal(r.log_mass[0][2], r.log_mass[0][0]));
  EXPECT_FALSE(torch::allclose(r.content[0][3], r.content[0][0]));
  // Each query is evaluated on its own: answering one head alone gives the same numbers.
  auto single = torch::zeros({1, H, 1, d});
  single[0][4][0] = q[1][4][2];
  EXPECT_TRUE(torch::allclose(mlp.forward(single).content[0][4][0], r.content[1][4][2], 1e-6, 1e-6));
  EXPECT_EQ(mlp.parameters_per_head() * Hkv, [&] {
    int64_t n = 0;
    for (const auto& p : mlp.parameters()) n += p.numel();
    return n;
  }());
  EXPECT_THROW(mlp.forward(torch::randn({1, 4, 1, d})), Error);  // other head count
  EXPECT_THROW(mlp.forward(torch::randn({1, H, 1, d + 1})), Error);
}

TEST(Nectar, MlpInitialisationStartsAtTheMeanResponse) {
  torch::manual_seed(4);
  const int H = 4, Hkv = 2, d = 6;
  NectarMlp mlp(H, Hkv, d, NectarArch::parse("mlp", "1,1,2"), 9);
  const auto q = torch::randn({200, H, d}) * 5, alpha = torch::randn({200, H}) + 7, content = torch::randn({200, H, d}) + 2;
  mlp.initialize(q, alpha, content);
  const auto r = mlp.forward(q.transpose(0, 1).unsqueeze(0));  // [1, H, 200, d]
  // Near the per-group means, far from zero.
  EXPECT_NEAR(r.log_mass.mean().item<double>(), alpha.mean().item<double>(), 0.2);
  EXPECT_NEAR(r.content.mean().item<double>(), content.mean().item<double>(), 0.2);
}
