// Head diversity: hand-built cases with known centred effective rank, and the per-layer walk.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "eval/analyze.h"

using namespace kvx;

TEST(HeadDiversity, OrthogonalFormsReachTheCeilingIdenticalOnesGiveZero) {
  // H heads whose A_h live in disjoint coordinate blocks: Gram = I, centred J, eigenvalues
  // H-1 ones and a zero -> r_eff = H - 1 exactly.
  const int H = 5, dh = 2, d = H * dh;
  auto wq = torch::zeros({H, d, dh}, torch::kFloat64), wk = torch::zeros({H, d, dh}, torch::kFloat64);
  for (int h = 0; h < H; ++h)
    for (int i = 0; i < dh; ++i) {
      wq[h][h * dh + i][i] = 1.0 + h;  // scale does not matter: forms are normalised
      wk[h][h * dh + i][i] = 2.0;
    }
  EXPECT_NEAR(eval::centred_effective_rank(wq, wk), H - 1, 1e-9);
  // Every head the same form: no diversity.
  auto same_q = wq[0].unsqueeze(0).repeat({H, 1, 1}), same_k = wk[0].unsqueeze(0).repeat({H, 1, 1});
  EXPECT_NEAR(eval::centred_effective_rank(same_q, same_k), 0.0, 1e-9);
  // Two groups of identical heads: centred Gram has rank 1 -> r_eff = 1.
  auto two_q = torch::cat({wq[0].unsqueeze(0).repeat({2, 1, 1}), wq[1].unsqueeze(0).repeat({2, 1, 1})});
  auto two_k = torch::cat({wk[0].unsqueeze(0).repeat({2, 1, 1}), wk[1].unsqueeze(0).repeat({2, 1, 1})});
  EXPECT_NEAR(eval::centred_effective_rank(two_q, two_k), 1.0, 1e-9);
}

TEST(HeadDiversity, MatchesTheExplicitFormsOnRandomWeights) {
  // The Gram trick against forming A_h and the centred spectrum explicitly.
  torch::manual_seed(3);
  const int H = 4, d = 7, dh = 3;
  auto wq = torch::randn({H, d, dh}, torch::kFloat64), wk = torch::randn({H, d, dh}, torch::kFloat64);
  auto A = torch::matmul(wq, wk.transpose(1, 2)).reshape({H, d * d});
  A = A / A.norm(2, 1, true);
  auto G = torch::matmul(A, A.t());
  auto J = torch::eye(H, torch::kFloat64) - 1.0 / H;
  auto eig = torch::linalg::eigvalsh(torch::matmul(torch::matmul(J, G), J), "L").clamp_min(0);
  auto p = eig / eig.sum();
  p = p.masked_select(p > 1e-15);
  const double expected = std::exp(-(p * p.log()).sum().item<double>());
  EXPECT_NEAR(eval::centred_effective_rank(wq, wk), expected, 1e-9);
  EXPECT_LE(expected, H - 1 + 1e-9);
}

TEST(HeadDiversity, WalksDenseLrkvAndMlaLayers) {
  model::ModelConfig c;
  c.vocab_size = 20;
  c.hidden_size = 16;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 4;
  c.head_dim = 4;
  c.intermediate_size = 8;
  c.max_position_embeddings = 16;
  c.layout = "dense,lrkv,mla";
  c.lrkv_rank = 0;  // every LRKV head shares one key projection
  model::Transformer m(c);
  const auto rows = eval::head_diversity(m);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows[2].kind, "mla");
  EXPECT_GT(rows[2].effective_rank, 1.0);
  EXPECT_EQ(rows[1].kind, "lrkv");
  EXPECT_GT(rows[0].effective_rank, 1.0);  // random dense heads are diverse
  EXPECT_LE(rows[0].effective_rank, 3.0 + 1e-9);
  EXPECT_GT(rows[1].effective_rank, 0.5);  // distinct queries keep r = 0 heads apart
  // Both units: of the H-1 ceiling (the issue's) and of H (the seed's Table 3, ceiling (H-1)/H).
  const auto j = eval::to_json(rows);
  EXPECT_DOUBLE_EQ(j[0]["share_of_ceiling"].get<double>(), rows[0].effective_rank / 3);
  EXPECT_DOUBLE_EQ(j[0]["share_of_heads"].get<double>(), rows[0].effective_rank / 4);
}
