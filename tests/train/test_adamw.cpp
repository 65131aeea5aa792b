// kvx's AdamW against libtorch's reference implementation.
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "train/adamw.h"

using namespace kvx;

TEST(AdamW, MatchesTorchAdamWOnMatrices) {
  torch::manual_seed(0);
  auto w0 = torch::randn({5, 7}, torch::kFloat64);
  auto a = w0.clone().requires_grad_(true), b = w0.clone().requires_grad_(true);
  train::AdamW ours({{"w", a}}, {0.9, 0.95, 1e-8, 0.1});
  torch::optim::AdamW ref({b}, torch::optim::AdamWOptions(0.01).betas({0.9, 0.95}).eps(1e-8).weight_decay(0.1));
  for (int i = 0; i < 5; ++i) {
    auto target = torch::randn({5, 7}, torch::kFloat64);
    ours.zero_grad();
    ref.zero_grad();
    (a - target).pow(2).sum().backward();
    (b - target).pow(2).sum().backward();
    ours.step(0.01);
    ref.step();
  }
  EXPECT_TRUE(torch::allclose(a, b, 1e-12, 1e-12)) << (a - b).abs().max().item<double>();
  EXPECT_EQ(ours.steps(), 5);
}

TEST(AdamW, StateRoundTrips) {
  auto p = torch::ones({3, 2}).requires_grad_(true);
  train::AdamW o({{"p", p}}, {});
  p.sum().backward();
  o.step(0.1);
  auto q = torch::ones({3, 2}).requires_grad_(true);
  train::AdamW o2({{"p", q}}, {});
  o2.load_state(o.state(), "test");
  EXPECT_EQ(o2.steps(), 1);
  EXPECT_TRUE(torch::equal(o2.state().at("exp_avg.p"), o.state().at("exp_avg.p")));
}
